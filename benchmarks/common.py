"""What every suite shares: the device, interleaved timing, the benchmark models and their weights."""

from __future__ import annotations

import copy
import datetime
import json
import os
import platform
import re
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fastes import linear_weights
from fastes.engine import noise
from fastes.run.config import TrainConfig
from fastes.tasks import get_task

# Benchmark models. "tiny" is the shipped checkpoint (random weights when it is missing); the synthetic
# ones are Llama shapes with random weights, big enough that bandwidth, not Python, decides the kernels.
SYNTHETIC_MODELS: dict[str, dict[str, int]] = {
    "synthetic-25m": dict(
        hidden_size=512, intermediate_size=2048, num_hidden_layers=6, num_attention_heads=8
    ),
    "synthetic-1b": dict(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16
    ),
}
MODEL_NAMES = ("tiny", *SYNTHETIC_MODELS)


@dataclass
class Context:
    """One benchmark run: where it runs and how hard it tries."""

    device: torch.device
    quick: bool
    dtype: torch.dtype
    backend: str = "auto"
    threads: int | None = None
    log: Callable[[str], None] = print

    @property
    def kind(self) -> str:
        """'gpu' on CUDA, else 'cpu': the suffix of latest-<kind>.md."""
        return "gpu" if self.device.type == "cuda" else "cpu"


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda was asked for but torch sees no CUDA device")
    return device


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_model()


def device_slug(device: torch.device) -> str:
    """A file-name-safe label: 'cpu-amd-epyc', 'cuda-nvidia-h200'."""
    name = re.sub(r"[^a-z0-9]+", "-", device_name(device).lower()).strip("-")
    return f"{device.type}-{name[:40].rstrip('-')}"


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages now (None where the OS has none): read it before the work,
    so that it says what else was running rather than what the benchmark itself put on the machine."""
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def dated_stem(out_dir: Path, name: str, date: str, suffix: str = "", endings=(".json", ".md")) -> str:
    """`<name>-<date><suffix>`, or `<name>-<date>-2<suffix>`, -3, ... where a file of that stem and one
    of `endings` exists: a results file is never overwritten in place; a second run the same day gets
    its own name."""
    stem, n = f"{name}-{date}{suffix}", 2
    while any((out_dir / f"{stem}{ending}").exists() for ending in endings):
        stem, n = f"{name}-{date}-{n}{suffix}", n + 1
    return stem


def products_taken(report: dict) -> str:
    """The library's products a report's linear layers took (its "cpu_products": fastes.engine.cpu_linear),
    or "none" (torch's)."""
    taken = [name.replace("_", "-") for name, used in report.get("cpu_products", {}).items() if used]
    return ", ".join(taken) or "none: torch's linear throughout"


def write_results(out_dir: Path, name: str, report: dict, markdown: str) -> Path:
    """Write `report` as <name>-<date>.json and `markdown` as its .md beside it, under a stem no earlier
    results file has (dated_stem, report["date"]); returns the .md path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = dated_stem(out_dir, name, report["date"])
    (out_dir / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / f"{stem}.md").write_text(markdown)
    return out_dir / f"{stem}.md"


def environment(ctx: Context, load_at_start: list[float] | None) -> dict:
    """Date, device, versions and settings: the header of every result file. `load_at_start` is the
    load average read before the suites ran (`load_average()`)."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    import transformers

    return {
        "date": datetime.date.today().isoformat(),
        "time": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "device": str(ctx.device),
        "device_kind": ctx.kind,
        "device_name": device_name(ctx.device),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "load_average": load_at_start,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "triton": triton_version,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "cuda": torch.version.cuda if ctx.device.type == "cuda" else None,
        "dtype": str(ctx.dtype).replace("torch.", ""),
        "backend": ctx.backend,
        "resolved_backend": _resolved_backend(ctx),
        "quick": ctx.quick,
    }


def _resolved_backend(ctx: Context) -> str:
    from fastes.engine import ops

    return ops.resolve_backend([torch.empty(0, device=ctx.device)], ctx.backend)


# ---------------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------------


@dataclass
class Timing:
    """Per-call seconds of one variant over several interleaved rounds."""

    samples: list[float] = field(default_factory=list)
    number: int = 1  # calls per sample

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def best(self) -> float:
        return min(self.samples)

    def as_dict(self) -> dict:
        return {
            "median_s": self.median,
            "min_s": self.best,
            "rounds": len(self.samples),
            "number": self.number,
        }


def measure(
    variants: dict[str, Callable[[], object]],
    device: torch.device,
    *,
    rounds: int,
    warmup: int = 1,
    min_sample_s: float = 0.05,
    max_number: int = 1000,
) -> dict[str, Timing]:
    """Time each variant, interleaving them round by round so that they share the machine's load.

    Each sample repeats a call enough times to last about `min_sample_s` (calibrated on a warm call),
    so that fast calls are not timer- or launch-bound.
    The order of the variants rotates every round, so none always runs right after the same neighbour.
    """
    timings: dict[str, Timing] = {}

    def once(fn: Callable[[], object]) -> float:
        start = time.perf_counter()
        fn()
        sync(device)
        return time.perf_counter() - start

    for name, fn in variants.items():
        elapsed = 0.0  # without a warm-up there is no calibration: long calls run once per sample
        for _ in range(max(warmup, 0)):
            elapsed = once(fn)
        # The first call may have compiled kernels (CUDA): calibrate on a warm one, except for slow CPU
        # calls, where a second untimed call would cost seconds and one call per sample is right anyway.
        if elapsed > 0 and (device.type == "cuda" or elapsed < 1.0):
            elapsed = once(fn)
        number = 1 if elapsed <= 0 else max(1, min(max_number, int(min_sample_s / max(elapsed, 1e-9))))
        timings[name] = Timing(number=number)
    names = list(variants)
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            timing = timings[name]
            fn = variants[name]
            sync(device)
            start = time.perf_counter()
            for _ in range(timing.number):
                fn()
            sync(device)
            timing.samples.append((time.perf_counter() - start) / timing.number)
    return timings


# ---------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------


@dataclass
class BenchModel:
    """A benchmark model with the tensors ES evolves (every nn.Linear weight)."""

    name: str
    model: torch.nn.Module
    tokenizer: object
    source: str  # "checkpoint" or "random"
    weights: list[tuple[str, torch.nn.Parameter]]

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [p.data for _, p in self.weights]

    @property
    def ids(self) -> list[int]:
        return [noise.tensor_id(n) for n, _ in self.weights]

    @property
    def numel(self) -> int:
        return sum(p.numel() for _, p in self.weights)

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for _, p in self.weights)

    @property
    def params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    @property
    def dtype(self) -> torch.dtype:
        return self.weights[0][1].dtype

    def describe(self) -> dict:
        return {
            "model": self.name,
            "source": self.source,
            "params": self.params,
            "evolved_tensors": len(self.weights),
            "evolved_elements": self.numel,
            "dtype": str(self.dtype).replace("torch.", ""),
        }

    def clone(self) -> BenchModel:
        """An independent copy (same weights), for comparisons that must start from the same point."""
        model = copy.deepcopy(self.model)
        return BenchModel(self.name, model, self.tokenizer, self.source, linear_weights(model))


def load_bench_model(name: str, device: torch.device, dtype: torch.dtype) -> BenchModel:
    """The tiny checkpoint (or a random tiny model when it is not shipped) or a synthetic Llama."""
    from transformers import LlamaForCausalLM

    from fastes.models.loading import (
        build_tiny_model,
        build_tokenizer,
        char_llama_config,
        load_model,
        tiny_model_path,
    )

    if name == "tiny":
        path = tiny_model_path()
        if (path / "config.json").is_file():
            model, tokenizer = load_model(path, dtype=dtype, device=device)
            source = "checkpoint"
        else:
            tokenizer = build_tokenizer()
            model = build_tiny_model(tokenizer=tokenizer).to(device=device, dtype=dtype).eval()
            source = "random"
    elif name in SYNTHETIC_MODELS:
        tokenizer = build_tokenizer()  # the character vocabulary: generated ids always decode
        config = char_llama_config(tokenizer, **SYNTHETIC_MODELS[name])
        with torch.device(device):  # initialise where it will live: a 1B model inits in seconds on a GPU
            model = LlamaForCausalLM(config)
        model = model.to(dtype).eval()
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        source = "random"
    else:
        raise ValueError(f"unknown benchmark model {name!r}; choose one of {MODEL_NAMES}")
    model.requires_grad_(False)
    return BenchModel(name, model, tokenizer, source, linear_weights(model))


def ratio(baseline_s: float, fastes_s: float) -> float:
    """How many times faster fastes is than the baseline (> 1: fastes is faster)."""
    return baseline_s / fastes_s if fastes_s > 0 else float("inf")


# --- memory (process-wide resident set) ---------------------------------------------------------


def ru_maxrss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB, macOS bytes


def peak_rss_bytes() -> int:
    """This process's RSS high-water mark: VmHWM on Linux, else getrusage's ru_maxrss.

    On Linux ru_maxrss is max(VmHWM, the high-water mark inherited at exec): a child started from a big
    parent reports the parent's size (measured here: every child of a 1.7 GiB benchmark process said
    1.7 GiB). VmHWM is the same high-water mark without that inheritance.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return ru_maxrss_bytes()


def current_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return peak_rss_bytes()


def reset_peak_rss() -> bool:
    """Reset the RSS high-water mark (and so ru_maxrss) to the current RSS; False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# --- one ES iteration of the training loop, as several suites set it up --------------------------


@dataclass(frozen=True)
class IterationSetting:
    """One ES iteration's size: members, prompts per member, new tokens per prompt."""

    population: int
    batch: int
    max_new_tokens: int


def make_run(
    bench: BenchModel,
    setting: IterationSetting,
    backend: str,
    eval_mode: str | None = None,
    antithetic: bool = False,
):
    """A fastes.run.shared.Run on `bench` for the countdown task, with the ES it iterates: N noise
    directions by default, as in the naive loop (the engines do the same work); `antithetic` as a
    run's default settings have it."""
    from fastes.run import auto_settings
    from fastes.run.es_loop import make_es
    from fastes.run.shared import Run

    cfg = TrainConfig()
    cfg.batch_size = setting.batch
    cfg.max_new_tokens = setting.max_new_tokens
    cfg.backend = backend
    cfg.progress = False
    cfg.es.population = setting.population
    cfg.es.antithetic = antithetic
    if eval_mode is not None:
        cfg.es.eval_mode = eval_mode
        if eval_mode == "lowrank":  # the low-rank eval mode evaluates low-rank noise (rank cfg.es.rank)
            cfg.es.noise_type = "lowrank"
    cfg = auto_settings.resolve(cfg, bench.model, bench.tokenizer)  # what a run chooses for this model
    task = get_task(cfg.task, seed=cfg.task_seed)
    run = Run(cfg, bench.model, bench.tokenizer, task, Path(tempfile.gettempdir()) / "fastes-bench")
    return run, make_es(run)
