"""One ES iteration of a real model per eval mode, against a member-by-member naive loop and the machine.

    python -m benchmarks.real_model [--model smollm2-135m-instruct] [--population 8] [--prompts 8]
                                    [--new_tokens 16] [--out benchmarks/results]

Needs the shipped model (`bash scripts/setup.sh real`); without it, it says so and exits. On one
batch of instruct-form arithmetic prompts, in one process and one run, it times

- fastes' default eval mode for this model (what a run chooses, fastes.defaults) and every other mode
  this device runs (materialised, member; lowrank when the default is not),
- the naive loop (benchmarks/naive.py: per-tensor seeded randn, perturb, generate, restore, N-pass
  update, member by member),
- one plain batched generate call of the same rows (what any population-batched ES could at best reach),

and reports each against the machine's limit: the tokens processed (prompt and generated tokens of every
row) x 2 x parameters / the fp32 matmul rate measured in the same run. Peak memory (RSS high-water mark,
reset before each) is compared with plain batched inference of the same rows. Figures are measured;
nothing is asserted. Results: <out>/real-model-<cpu>-<date>.json and .md.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from .common import current_rss_bytes, peak_rss_bytes, reset_peak_rss
from .naive import naive_es_iteration

TARGET_LIMIT_SHARE = 0.8  # the default mode's share of the machine's limit
TARGET_NAIVE_RATIO = 2.0
TARGET_MEMORY_RATIO = 1.3


def matmul_flops_per_second(size: int = 2048, repeats: int = 5) -> float:
    """The fp32 matmul rate of this machine now: the best of `repeats` square products."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)  # warm up
    best = min(_seconds(lambda: torch.mm(a, b)) for _ in range(repeats))
    return 2 * size**3 / best


def _seconds(work) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def _measured(work) -> tuple[float, dict, object]:
    """(seconds, {"peak_bytes": the process's peak RSS, "peak_above_model_bytes": that above the RSS at
    the start}, result) of one call, with the high-water mark reset first."""
    gc.collect()
    reset_peak_rss()
    before = current_rss_bytes()
    start = time.perf_counter()
    result = work()
    seconds, peak = time.perf_counter() - start, peak_rss_bytes()
    return seconds, {"peak_bytes": peak, "peak_above_model_bytes": peak - before}, result


def _settings(args: argparse.Namespace) -> dict:
    return {
        "model": args.model,
        "task": "arithmetic:max_operand=20,operations=+-,n_train=372,n_test=300",
        "instruction": 'Write the result after "Answer:".',
        "batch_size": args.prompts,
        "max_new_tokens": args.new_tokens,
        "progress": False,
        "es.population": args.population,
        "es.sigma": 1e-3,
        "es.lr": 5e-6,
    }


def measure(args: argparse.Namespace, variant: str) -> dict:
    """One variant in this process: seconds, tokens processed and peak RSS above the loaded model."""
    from fastes import defaults
    from fastes.config import load_config
    from fastes.es_step import es_iteration, evolved_weights, make_es
    from fastes.generation import generate
    from fastes.model_sources import resolve_model
    from fastes.models import is_character_tokenizer, load_model
    from fastes.run import Run, batch_for
    from fastes.train import make_task

    model, tokenizer = load_model(resolve_model(args.model), dtype="float32")
    mode = variant.removeprefix("fastes ") if variant.startswith("fastes ") else "member"
    overrides = {
        **_settings(args),
        "es.eval_mode": mode,
        "es.noise_type": "lowrank" if mode == "lowrank" else "full",
    }
    cfg = defaults.resolve(load_config(None, overrides), model, tokenizer)
    run = Run(
        cfg, model, tokenizer, make_task(cfg, is_character_tokenizer(tokenizer)), args.out / "real-model-run"
    )
    examples = batch_for(run, "es", 0)
    prompts = run.prompts(examples)
    prompt_tokens = sum(len(tokenizer(p).input_ids) for p in prompts) * args.population
    generate(model, tokenizer, prompts[:1], max_new_tokens=2)  # lazy allocations happen here
    if variant == "plain batched inference":
        rows = prompts * args.population
        seconds, peak, gen = _measured(
            lambda: generate(model, tokenizer, rows, max_new_tokens=args.new_tokens)
        )
        return {"seconds": seconds, **peak, "tokens": prompt_tokens + gen.num_tokens}
    if variant == "naive loop":
        tensors = [p for _, p in evolved_weights(model, cfg.es)]
        seconds, peak, record = _measured(
            lambda: naive_es_iteration(
                model,
                tokenizer,
                tensors,
                examples,
                prompts,
                run.task,
                population=args.population,
                sigma=1e-3,
                lr=5e-6,
                max_new_tokens=args.new_tokens,
            )
        )
        return {"seconds": seconds, **peak, "tokens": prompt_tokens + record["tokens"]}
    es = make_es(run)
    seconds, peak, record = _measured(lambda: es_iteration(run, es, 0))
    return {
        "seconds": seconds,
        **peak,
        "tokens": prompt_tokens + round(record["tokens_per_second"] * record["seconds"]),
        "parts": {k: v for k, v in record.items() if k.startswith("time/")},
    }


def run(args: argparse.Namespace) -> dict:
    """Every variant, each in a fresh process (so that no variant's peak memory is hidden by what an
    earlier one left allocated), one after the other; the matmul rate measured here, in between."""
    from fastes import defaults
    from fastes.config import load_config
    from fastes.model_sources import resolve_model
    from fastes.models import load_model

    model, tokenizer = load_model(resolve_model(args.model), dtype="float32")  # converts a GGUF once
    params = sum(p.numel() for p in model.parameters())
    default_mode = defaults.resolve(load_config(None, _settings(args)), model, tokenizer).es.eval_mode
    del model
    # fastes' default eval mode for this model first, then the other modes
    modes = [default_mode] + [m for m in ("lowrank", "materialised", "member") if m != default_mode]
    names = ["plain batched inference", *(f"fastes {mode}" for mode in modes), "naive loop"]
    rate = matmul_flops_per_second()
    results: dict[str, dict] = {}
    for name in names:
        flags = [f"--{k}={getattr(args, k)}" for k in ("model", "population", "prompts", "new_tokens", "out")]
        child = subprocess.run(
            [sys.executable, "-m", "benchmarks.real_model", *flags, "--only", name],
            capture_output=True,
            text=True,
            check=True,
        )
        results[name] = json.loads(child.stdout.strip().splitlines()[-1])
    for entry in results.values():
        entry["limit_seconds"] = entry["tokens"] * 2 * params / rate
        entry["share_of_limit"] = entry["limit_seconds"] / entry["seconds"]
    default = results[f"fastes {modes[0]}"]
    inference = results["plain batched inference"]
    report = {
        "date": datetime.date.today().isoformat(),
        "model": args.model,
        "parameters": params,
        "threads": torch.get_num_threads(),
        "matmul_gflops": rate / 1e9,
        "rows": args.population * args.prompts,
        "population": args.population,
        "prompts": args.prompts,
        "new_tokens": args.new_tokens,
        "default_mode": modes[0],
        "results": results,
        "targets": {
            f"default mode >= {TARGET_LIMIT_SHARE:.0%} of the machine's limit": default["share_of_limit"],
            f"default mode >= {TARGET_NAIVE_RATIO}x the naive loop": results["naive loop"]["seconds"]
            / default["seconds"],
            f"ES peak RSS <= {TARGET_MEMORY_RATIO}x plain batched inference's": (
                default["peak_bytes"] / inference["peak_bytes"]
            ),
        },
    }
    return report


def markdown(report: dict) -> str:
    lines = [
        f"# One ES iteration of {report['model']} ({report['parameters'] / 1e6:.1f}M parameters), measured",
        "",
        f"{report['date']}; {report['threads']} torch threads; fp32 matmul "
        f"{report['matmul_gflops']:.0f} GFLOP/s measured in the same run; population "
        f"{report['population']} x {report['prompts']} prompts x {report['new_tokens']} new tokens "
        f"({report['rows']} rows); default mode: {report['default_mode']}.",
        "",
        "| variant | seconds | share of the machine's limit | peak RSS | above the loaded model |",
        "|---|---|---|---|---|",
    ]
    for name, entry in report["results"].items():
        lines.append(
            f"| {name} | {entry['seconds']:.1f} | {entry['share_of_limit']:.0%} | "
            f"{entry['peak_bytes'] / 2**20:.0f} MiB | {entry['peak_above_model_bytes'] / 2**20:.0f} MiB |"
        )
    lines += ["", "| target | measured |", "|---|---|"]
    lines += [f"| {name} | {value:.2f} |" for name, value in report["targets"].items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.real_model", description=__doc__)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--population", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new_tokens", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--only", default=None, help=argparse.SUPPRESS)  # one variant, in a child process
    args = parser.parse_args(argv)
    if args.only:
        print(json.dumps(measure(args, args.only)))
        return 0
    from fastes.errors import FastesError

    try:
        report = run(args)
    except FastesError as error:  # the shipped model's package is missing: say so, and how to get it
        print(f"real-model benchmark skipped: {error}")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"real-model-cpu-{report['date']}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2))
    stem.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
