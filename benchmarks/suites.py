"""The benchmark suites: each builds its variants (fastes and its baselines) and times them in one run.

The `*_variants` builders are shared by the plain runner (`python -m benchmarks`) and the
pytest-benchmark files, so both time exactly the same calls. Every `run_*` returns plain records:
absolute figures plus the ratio to the baseline measured in the same run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks import naive
from benchmarks.common import (
    BenchModel,
    Context,
    IterationSetting,
    load_bench_model,
    make_run,
    measure,
    ratio,
)
from benchmarks.step import run_step
from fastes import ES, Member
from fastes.engine import noise, ops

SIGMA = 1e-3  # the ES-at-scale setting; the value does not change any cost
REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Plan:
    """How much each suite measures on this device in this mode."""

    models: tuple[str, ...]
    update_ns: dict[str, tuple[int, ...]]
    iteration: IterationSetting
    memory: tuple[tuple[str, IterationSetting], ...]
    rounds: int  # interleaved rounds for cheap calls
    heavy: frozenset[str]  # models whose calls take seconds here: one round, no calibration call
    iteration_rounds: int
    min_sample_s: float


def make_plan(ctx: Context) -> Plan:
    default = IterationSetting(population=16, batch=32, max_new_tokens=12)  # TrainConfig's defaults
    if ctx.quick:
        tiny = IterationSetting(population=2, batch=2, max_new_tokens=2)
        return Plan(
            models=("tiny",),
            update_ns={"tiny": (8, 30)},
            iteration=tiny,
            memory=(("tiny", tiny),),
            rounds=2,
            heavy=frozenset(),
            iteration_rounds=1,
            min_sample_s=0.01,
        )
    if ctx.device.type == "cuda":
        return Plan(
            models=("tiny", "synthetic-25m", "synthetic-1b"),
            update_ns={m: (8, 30, 128) for m in ("tiny", "synthetic-25m", "synthetic-1b")},
            iteration=default,
            memory=(
                ("tiny", default),
                ("synthetic-25m", default),
                ("synthetic-1b", IterationSetting(population=4, batch=8, max_new_tokens=8)),
            ),
            rounds=7,
            heavy=frozenset(),
            iteration_rounds=3,
            min_sample_s=0.05,
        )
    # CPU: the 25M model's calls take seconds each (the naive N = 30 update ~10 s): one round each.
    return Plan(
        models=("tiny", "synthetic-25m"),
        update_ns={"tiny": (8, 30, 128), "synthetic-25m": (8, 30)},
        iteration=default,
        memory=(
            ("tiny", default),
            ("synthetic-25m", IterationSetting(population=2, batch=4, max_new_tokens=4)),
        ),
        rounds=5,
        heavy=frozenset({"synthetic-25m"}),
        iteration_rounds=2,
        min_sample_s=0.05,
    )


@contextmanager
def preserved(bench: BenchModel) -> Iterator[None]:
    """Put the weights back afterwards: timing loops of naive restores and updates make them drift."""
    saved = [t.clone() for t in bench.tensors]
    try:
        yield
    finally:
        with torch.no_grad():
            for t, s in zip(bench.tensors, saved):
                t.copy_(s)


def _rounds(plan: Plan, model: str) -> tuple[int, int]:
    """(rounds, warmup calls) for a model: heavy models get one untimed call and one timed round."""
    return (1, 1) if model in plan.heavy else (plan.rounds, 1)


# ---------------------------------------------------------------------------------------------------
# Noise generation
# ---------------------------------------------------------------------------------------------------


def noise_variants(
    numel: int, device: torch.device, backend: str = "auto"
) -> dict[str, Callable[[], object]]:
    """fastes normals (compiled CPU backend on CPU, the Triton fill kernel on CUDA) vs torch.randn.

    On CPU the eager reference is timed too: it was the CPU engine before the compiled backend.
    """
    key = noise.member_key(0, 0, 0)
    tid = noise.tensor_id("bench.noise")
    if device.type == "cuda":
        from fastes.engine.kernels import launch_fill

        out = torch.empty(numel, dtype=torch.float32, device=device)
        ref = torch.empty_like(out)
        return {
            "fastes": lambda: launch_fill(out, key, tid, 0, noise.STREAM_NOISE, False),
            "torch.randn": lambda: torch.randn(numel, out=ref),
        }
    return {
        "fastes": lambda: ops.normal(key, tid, numel, device=device, backend=backend),
        "reference": lambda: noise.normal(key, tid, numel, device=device),
        "torch.randn": lambda: torch.randn(numel, device=device),
    }


def run_noise(ctx: Context, plan: Plan, models: dict[str, BenchModel]) -> list[dict]:
    records = []
    for name, bench in models.items():
        numel = bench.numel  # as many normals as one member's perturbation needs
        rounds, warmup = _rounds(plan, name)
        t = measure(
            noise_variants(numel, ctx.device, ctx.backend),
            ctx.device,
            rounds=rounds,
            warmup=warmup,
            min_sample_s=plan.min_sample_s,
        )
        records.append(
            {
                "model": name,
                "normals": numel,
                "fastes": t["fastes"].as_dict(),
                "torch_randn": t["torch.randn"].as_dict(),
                "fastes_normals_per_s": numel / t["fastes"].median,
                "randn_normals_per_s": numel / t["torch.randn"].median,
                "ratio_vs_randn": ratio(t["torch.randn"].median, t["fastes"].median),
            }
        )
        if "reference" in t:
            records[-1]["reference"] = t["reference"].as_dict()
            records[-1]["reference_normals_per_s"] = numel / t["reference"].median
        ctx.log(f"noise    {name:14s} fastes/randn throughput {records[-1]['ratio_vs_randn']:.3f}")
    return records


# ---------------------------------------------------------------------------------------------------
# Perturb + restore
# ---------------------------------------------------------------------------------------------------


def perturb_variants(bench: BenchModel, backend: str) -> dict[str, Callable[[], object]]:
    """fastes member enter/exit (out-of-place perturb + pointer swap) vs naive in-place vs plain copies."""
    es = ES(
        bench.weights, sigma=SIGMA, lr=0.0, population=2, antithetic=False, backend=backend, checksum_every=0
    )
    member = Member(es, 0)
    tensors = bench.tensors
    buffers = [torch.empty_like(t) for t in tensors]

    def fastes_cycle() -> None:
        member.__enter__()
        member.__exit__(None, None, None)

    def naive_cycle() -> None:
        naive.naive_perturb(tensors, 1234, SIGMA)
        naive.naive_restore(tensors, 1234, SIGMA)

    variants = {
        "fastes": fastes_cycle,
        "naive": naive_cycle,
        "copy": lambda: naive.copy_weights(tensors, buffers),
    }
    if hasattr(torch, "_foreach_copy_"):  # one fused launch on CUDA: a stricter bandwidth limit
        variants["copy_foreach"] = lambda: torch._foreach_copy_(buffers, tensors)
    return variants


@torch.no_grad()
def restore_check(bench: BenchModel, backend: str) -> dict:
    """Are the weights bit-identical after one perturb/restore cycle? fastes vs naive, on copies."""
    original = [t.clone() for t in bench.tensors]
    es = ES(
        bench.weights, sigma=SIGMA, lr=0.0, population=2, antithetic=False, backend=backend, checksum_every=0
    )
    with Member(es, 0):
        pass
    fastes_exact = all(torch.equal(a, b) for a, b in zip(original, bench.tensors))
    work = [t.clone() for t in original]
    naive.naive_perturb(work, 1234, SIGMA)
    naive.naive_restore(work, 1234, SIGMA)
    changed = sum(int((a != b).sum()) for a, b in zip(original, work))
    return {"fastes_exact": fastes_exact, "naive_changed_fraction": changed / bench.numel}


def run_perturb(ctx: Context, plan: Plan, models: dict[str, BenchModel]) -> list[dict]:
    records = []
    for name, bench in models.items():
        rounds, warmup = _rounds(plan, name)
        with preserved(bench):
            t = measure(
                perturb_variants(bench, ctx.backend),
                ctx.device,
                rounds=rounds,
                warmup=warmup,
                min_sample_s=plan.min_sample_s,
            )
        copy_s = min(t[k].median for k in ("copy", "copy_foreach") if k in t)
        moved = 2 * bench.nbytes  # a perturbation reads every weight and writes it once
        record = {
            **bench.describe(),
            "bytes_moved": moved,
            **{k.replace(".", "_"): v.as_dict() for k, v in t.items()},
            "fastes_gb_per_s": moved / t["fastes"].median / 1e9,
            "copy_gb_per_s": moved / copy_s / 1e9,
            "speedup_vs_naive": ratio(t["naive"].median, t["fastes"].median),
            "fraction_of_copy_bandwidth": copy_s / t["fastes"].median,
            **restore_check(bench, ctx.backend),
        }
        records.append(record)
        ctx.log(
            f"perturb  {name:14s} vs naive {record['speedup_vs_naive']:.2f}x, "
            f"{100 * record['fraction_of_copy_bandwidth']:.2g}% of copy bandwidth"
        )
    return records


# ---------------------------------------------------------------------------------------------------
# Update vs population size
# ---------------------------------------------------------------------------------------------------


def update_variants(bench: BenchModel, n: int, backend: str) -> dict[str, Callable[[], object]]:
    """The fused update over N directions vs the naive N-pass update, on the same tensors."""
    tensors, ids = bench.tensors, bench.ids
    keys = [noise.member_key(0, 0, j) for j in range(n)]
    g = torch.Generator().manual_seed(n)
    weights = (torch.rand(n, generator=g) * 2 - 1).tolist()
    coef = 1e-9  # small: repeated timing calls must not move the weights far
    seeds = list(range(n))
    return {
        "fastes": lambda: ops.es_update(tensors, ids, keys, weights, coef=coef, backend=backend),
        "naive": lambda: naive.naive_update(tensors, seeds, weights, coef),
    }


def run_update(ctx: Context, plan: Plan, models: dict[str, BenchModel]) -> list[dict]:
    records = []
    for name, bench in models.items():
        rounds, warmup = _rounds(plan, name)
        buffers = [torch.empty_like(t) for t in bench.tensors]
        copy_s = measure(
            {"copy": lambda bench=bench, buffers=buffers: naive.copy_weights(bench.tensors, buffers)},
            ctx.device,
            rounds=3,
            min_sample_s=plan.min_sample_s,
        )["copy"].median
        for n in plan.update_ns.get(name, ()):
            # Heavy CPU models: no calibration call for the slow fused update (each call is tens of s).
            with preserved(bench):
                t = measure(
                    update_variants(bench, n, ctx.backend),
                    ctx.device,
                    rounds=rounds,
                    warmup=0 if name in plan.heavy else warmup,
                    min_sample_s=plan.min_sample_s,
                )
            work = bench.numel * n
            record = {
                **bench.describe(),
                "population": n,
                "fastes": t["fastes"].as_dict(),
                "naive": t["naive"].as_dict(),
                "fastes_element_members_per_s": work / t["fastes"].median,
                "naive_element_members_per_s": work / t["naive"].median,
                "speedup_vs_naive": ratio(t["naive"].median, t["fastes"].median),
                "copy_s": copy_s,
                "fraction_of_copy_bandwidth": copy_s / t["fastes"].median,
            }
            records.append(record)
            ctx.log(f"update   {name:14s} N={n:<4d} vs naive {record['speedup_vs_naive']:.2f}x")
    return records


# ---------------------------------------------------------------------------------------------------
# Whole ES iteration
# ---------------------------------------------------------------------------------------------------


_probed: dict[tuple, tuple[list[str], dict[str, str]]] = {}


def eval_modes(bench: BenchModel, backend: str) -> tuple[list[str], dict[str, str]]:
    """The ES eval modes that run here (default first) and why the others do not.

    fastes.run.config.EVAL_MODES lists them; some need CUDA (e.g. a Triton-only mode), so each non-default
    mode is tried once on a throwaway copy with a one-token iteration, and kept when it works.
    """
    from fastes.run import config
    from fastes.run.es_loop import es_iteration

    cache_key = (str(bench.tensors[0].device), str(bench.dtype), backend)
    if cache_key in _probed:
        return _probed[cache_key]
    default_mode = make_run(bench.clone(), IterationSetting(2, 1, 1), backend)[0].cfg.es.eval_mode
    modes, skipped = [default_mode], {}
    for mode in getattr(config, "EVAL_MODES", ()):
        if mode in (default_mode, "auto"):
            continue
        try:
            es_iteration(*make_run(bench.clone(), IterationSetting(2, 1, 1), backend, mode), 0)
        except Exception as error:  # a mode this device cannot run is reported, not fatal
            skipped[mode] = f"{type(error).__name__}: {str(error)[:200]}"
        else:
            modes.append(mode)
    _probed[cache_key] = (modes, skipped)
    return modes, skipped


def iteration_variants(
    bench: BenchModel, setting: IterationSetting, backend: str
) -> tuple[dict[str, Callable[[], object]], dict[str, dict]]:
    """fastes.run.es_loop.es_iteration (each eval mode) vs the naive loop vs generation alone.

    Also plain batched inference of members x prompts rows in one generate call: each mode's
    tokens/s over its tokens/s is the share of plain inference throughput that mode reaches.

    Every variant gets its own copy of the model, so all start from the same weights and see the same
    prompts (step 0's batch). The second dict receives each variant's last output (tokens, ...).
    """
    from fastes.models.generation import generate
    from fastes.run.es_loop import es_iteration
    from fastes.run.shared import batch_for

    outputs: dict[str, dict] = {}
    variants: dict[str, Callable[[], object]] = {}
    modes, _ = eval_modes(bench, backend)
    for mode in modes:
        run, es = make_run(bench.clone(), setting, backend, mode)
        label = "fastes" if mode == modes[0] else f"fastes-{mode}"

        def fastes_call(run=run, es=es, label=label) -> None:
            out = es_iteration(run, es, 0)
            outputs[label] = {"tokens": out["tokens_per_second"] * out["seconds"], "reward": out["reward"]}

        variants[label] = fastes_call

    naive_bench = bench.clone()
    run, _ = make_run(naive_bench, setting, backend)
    examples = batch_for(run, "es", 0)
    prompts = run.prompts(examples)
    cfg = run.cfg

    def naive_call() -> None:
        outputs["naive"] = naive.naive_es_iteration(
            naive_bench.model,
            naive_bench.tokenizer,
            naive_bench.tensors,
            examples,
            prompts,
            run.task,
            population=setting.population,
            sigma=cfg.es.sigma,
            lr=cfg.es.lr,
            max_new_tokens=setting.max_new_tokens,
            format_weight=cfg.format_weight,
        )

    def generate_only() -> None:
        tokens = 0
        for _ in range(setting.population):
            tokens += generate(
                bench.model, bench.tokenizer, prompts, max_new_tokens=setting.max_new_tokens
            ).num_tokens
        outputs["generate-only"] = {"tokens": tokens}

    def batched_inference() -> None:
        # Plain inference at the same total batch: the throughput ceiling of population-batched ES.
        gen = generate(
            bench.model, bench.tokenizer, prompts * setting.population, max_new_tokens=setting.max_new_tokens
        )
        outputs["batched-inference"] = {"tokens": gen.num_tokens}

    variants["naive"] = naive_call
    variants["generate-only"] = generate_only
    variants["batched-inference"] = batched_inference
    return variants, outputs


def run_iteration(ctx: Context, plan: Plan, models: dict[str, BenchModel]) -> list[dict]:
    from fastes.models.generation import generate

    bench = models["tiny"]
    setting = plan.iteration
    variants, outputs = iteration_variants(bench, setting, ctx.backend)
    # One untimed generate call warms the model up; on CUDA a whole untimed call also compiles kernels.
    generate(bench.model, bench.tokenizer, ["1 2 3"], max_new_tokens=2)
    warmup = 1 if ctx.device.type == "cuda" else 0
    t = measure(variants, ctx.device, rounds=plan.iteration_rounds, warmup=warmup, min_sample_s=0.0)
    modes, skipped = eval_modes(bench, ctx.backend)
    record: dict = {
        **bench.describe(),
        "task": "countdown",
        **setting.__dict__,
        "default_eval_mode": modes[0],
        "skipped_eval_modes": skipped,
    }
    for label, timing in t.items():
        tokens = outputs.get(label, {}).get("tokens", 0)
        record[label] = {**timing.as_dict(), "tokens": tokens, "tokens_per_s": tokens / timing.median}
    record["speedup_vs_naive"] = ratio(t["naive"].median, t["fastes"].median)
    for label in t:
        if label.startswith("fastes-"):
            record[f"speedup_vs_naive_{label[len('fastes-') :]}"] = ratio(t["naive"].median, t[label].median)
    record["generate_only_share_of_naive"] = t["generate-only"].median / t["naive"].median
    plain = record["batched-inference"]["tokens_per_s"]
    for label in t:
        if label.startswith("fastes"):
            record[f"{label}_share_of_batched_inference"] = record[label]["tokens_per_s"] / plain
    ctx.log(f"iteration tiny N={setting.population} vs naive loop {record['speedup_vs_naive']:.2f}x")
    return [record]


# ---------------------------------------------------------------------------------------------------
# Peak memory (fresh subprocesses: a process's high-water mark says nothing once other work ran in it)
# ---------------------------------------------------------------------------------------------------


def memory_modes(ctx: Context, models: dict[str, BenchModel]) -> list[str]:
    """inference, es (the default eval mode) and es-<mode> for every other mode that runs here."""
    modes, _ = eval_modes(models["tiny"], ctx.backend)
    return ["inference", "es", *(f"es-{m}" for m in modes[1:])]


def _child_env(ctx: Context) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    if ctx.device.type == "cuda":
        env.pop("TRITON_INTERPRET", None)  # compiled kernels, whatever the parent process uses
    return env


def _memory_child(ctx: Context, name: str, setting: IterationSetting, modes: list[str]) -> subprocess.Popen:
    spec = {
        "modes": modes,
        "model": name,
        "device": str(ctx.device),
        "dtype": str(ctx.dtype).replace("torch.", ""),
        "backend": ctx.backend,
        "threads": ctx.threads,
        **setting.__dict__,
    }
    return subprocess.Popen(
        [sys.executable, "-m", "benchmarks.memory", json.dumps(spec)],
        cwd=REPO_ROOT,
        env=_child_env(ctx),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def start_memory(
    ctx: Context, plan: Plan, models: dict[str, BenchModel]
) -> list[tuple[str, IterationSetting, list, list]]:
    """Start the memory children: one fresh process per mode, run side by side (memory, not time, is
    measured); the quick mode measures all modes in one process, one after another, to spare imports."""
    started = []
    modes = memory_modes(ctx, models)
    for name, setting in plan.memory:
        groups = [modes] if ctx.quick else [[m] for m in modes]
        started.append((name, setting, groups, [_memory_child(ctx, name, setting, g) for g in groups]))
    return started


def collect_memory(ctx: Context, started: list[tuple[str, IterationSetting, list, list]]) -> list[dict]:
    records = []
    for name, setting, groups, jobs in started:
        found: dict[str, dict] = {}
        for group, job in zip(groups, jobs):
            out, err = job.communicate(timeout=900)
            if job.returncode != 0:
                raise RuntimeError(f"memory child {name}/{group} failed ({job.returncode}):\n{err[-3000:]}")
            found.update(json.loads(out.strip().splitlines()[-1]))
        base = found["inference"]
        record: dict = {
            "model": name,
            **setting.__dict__,
            "metric": base["metric"],
            "one_process_per_mode": len(groups) > 1,
            **found,
        }
        for mode in found:
            if mode != "inference":
                record[f"{mode}_vs_inference"] = found[mode]["peak_bytes"] / base["peak_bytes"]
        records.append(record)
        ctx.log(f"memory   {name:14s} ES peak / inference peak {record['es_vs_inference']:.3f}")
    return records


def run_memory(ctx: Context, plan: Plan, models: dict[str, BenchModel]) -> list[dict]:
    return collect_memory(ctx, start_memory(ctx, plan, models))


SUITES: dict[str, Callable[[Context, Plan, dict[str, BenchModel]], list[dict]]] = {
    "noise": run_noise,
    "step": run_step,
    "perturb": run_perturb,
    "update": run_update,
    "iteration": run_iteration,
    "memory": run_memory,
}


def run_suites(ctx: Context, names: list[str] | None = None) -> dict[str, list[dict]]:
    """Run the chosen suites (all by default) on every model of the plan."""
    plan = make_plan(ctx)
    names = names or list(SUITES)
    unknown = set(names) - set(SUITES)
    if unknown:
        raise ValueError(f"unknown suites {sorted(unknown)}; choose from {list(SUITES)}")
    models: dict[str, BenchModel] = {}
    for name in plan.models:
        models[name] = load_bench_model(name, ctx.device, ctx.dtype)
        ctx.log(f"model    {name:14s} {models[name].describe()}")
    # Quick mode: the memory children start first and run while the other suites time (their timings
    # mean nothing in quick mode anyway); otherwise nothing runs beside a timed suite.
    early = start_memory(ctx, plan, models) if ctx.quick and "memory" in names else None
    results = {}
    for suite in names:
        start = time.perf_counter()
        if suite == "memory" and early is not None:
            results[suite] = collect_memory(ctx, early)
        else:
            results[suite] = SUITES[suite](ctx, plan, models)
        ctx.log(f"suite    {suite:14s} {time.perf_counter() - start:.1f} s")
    return results
