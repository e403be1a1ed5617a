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
import time
from pathlib import Path

import torch

from .memory import current_rss_bytes, peak_rss_bytes, reset_peak_rss
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


def _measured(work) -> tuple[float, int, object]:
    """(seconds, peak RSS bytes above the start, result) of one call, with the high-water mark reset."""
    gc.collect()
    reset_peak_rss()
    before = current_rss_bytes()
    start = time.perf_counter()
    result = work()
    return time.perf_counter() - start, peak_rss_bytes() - before, result


def run(args: argparse.Namespace) -> dict:
    from fastes import defaults
    from fastes.config import load_config
    from fastes.generation import generate
    from fastes.model_sources import resolve_model
    from fastes.models import is_character_tokenizer, load_model
    from fastes.train import Run, batch_for, es_iteration, evolved_weights, make_es, make_task

    model_dir = resolve_model(args.model)
    model, tokenizer = load_model(model_dir, dtype="float32")
    params = sum(p.numel() for p in model.parameters())
    base = {
        "model": args.model,
        "task": "arithmetic:max_operand=20,operations=+-,n_train=372,n_test=300",
        "batch_size": args.prompts,
        "max_new_tokens": args.new_tokens,
        "progress": False,
        "es.population": args.population,
        "es.sigma": 1e-3,
        "es.lr": 5e-6,
    }
    chosen = defaults.resolve(load_config(None, base), model, tokenizer)
    modes = [chosen.es.eval_mode] + [
        m for m in ("lowrank", "materialised", "member") if m != chosen.es.eval_mode
    ]

    def make_run(mode: str) -> tuple[Run, object]:
        overrides = {
            **base,
            "es.eval_mode": mode,
            "es.noise_type": "lowrank" if mode == "lowrank" else "full",
        }
        cfg = defaults.resolve(load_config(None, overrides), model, tokenizer)
        task = make_task(cfg, strict_alphabet=is_character_tokenizer(tokenizer))
        run = Run(cfg, model, tokenizer, task, Path(args.out) / "real-model-run")
        return run, make_es(run)

    first_run, _ = make_run(modes[0])
    examples = batch_for(first_run, "es", 0)
    prompts = first_run.prompts(examples)
    rows = prompts * args.population
    prompt_tokens = sum(len(tokenizer(p).input_ids) for p in prompts) * args.population
    generate(model, tokenizer, prompts[:1], max_new_tokens=2)  # lazy allocations happen here

    rate = matmul_flops_per_second()
    results: dict[str, dict] = {}
    seconds, peak, gen = _measured(lambda: generate(model, tokenizer, rows, max_new_tokens=args.new_tokens))
    results["plain batched inference"] = {
        "seconds": seconds,
        "peak_bytes": peak,
        "tokens": prompt_tokens + gen.num_tokens,
    }
    for mode in modes:
        run_, es = make_run(mode)
        seconds, peak, record = _measured(lambda run_=run_, es=es: es_iteration(run_, es, 0))
        results[f"fastes {mode}"] = {
            "seconds": seconds,
            "peak_bytes": peak,
            "tokens": prompt_tokens + round(record["tokens_per_second"] * record["seconds"]),
            "parts": {k: v for k, v in record.items() if k.startswith("time/")},
        }
    tensors = [p for _, p in evolved_weights(model, first_run.cfg.es)]
    seconds, peak, record = _measured(
        lambda: naive_es_iteration(
            model,
            tokenizer,
            tensors,
            examples,
            prompts,
            first_run.task,
            population=args.population,
            sigma=1e-3,
            lr=5e-6,
            max_new_tokens=args.new_tokens,
        )
    )
    results["naive loop"] = {
        "seconds": seconds,
        "peak_bytes": peak,
        "tokens": prompt_tokens + record["tokens"],
    }

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
        "rows": len(rows),
        "population": args.population,
        "prompts": args.prompts,
        "new_tokens": args.new_tokens,
        "default_mode": modes[0],
        "results": results,
        "targets": {
            f"default mode >= {TARGET_LIMIT_SHARE:.0%} of the machine's limit": default["share_of_limit"],
            f"default mode >= {TARGET_NAIVE_RATIO}x the naive loop": results["naive loop"]["seconds"]
            / default["seconds"],
            f"ES peak <= {TARGET_MEMORY_RATIO}x plain batched inference (bytes above the loaded model)": (
                default["peak_bytes"] / max(inference["peak_bytes"], 1)
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
        "| variant | seconds | share of the machine's limit | peak RSS above the loaded model |",
        "|---|---|---|---|",
    ]
    for name, entry in report["results"].items():
        lines.append(
            f"| {name} | {entry['seconds']:.1f} | {entry['share_of_limit']:.0%} | "
            f"{entry['peak_bytes'] / 2**20:.0f} MiB |"
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
    args = parser.parse_args(argv)
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
