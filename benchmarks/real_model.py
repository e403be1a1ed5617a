"""ES on a real model against plain batched generation of the same rows, and against the machine.

    python -m benchmarks.real_model [--model smollm2-135m-instruct] [--shapes 8x8x16,16x16x24]
                                    [--rounds 6] [--out benchmarks/results]

Needs the shipped model (`bash scripts/setup.sh real`); without it, it says so and exits. Shapes are
population x prompts x new tokens, on instruct-form arithmetic prompts, fp32, greedy.

The headline, per shape: one ES iteration's token rate (prompt and generated tokens of every row per
second) against plain batched generation of the same rows, both in one process, warm, interleaved for
`--rounds` rounds (the order rotates), as the median of the rounds' ratios: a 2-core machine's speed
drifts by +-10% within a minute, which a ratio of neighbours cancels. The rounds run as `fastes train`
runs its steps, with the objects made before them frozen out of full garbage collections. The first
(cold) iteration is reported apart: it pays once for writing the weights the first time (they are mapped
from the file) and for loading the compiled library. Both decode with fastes' own loop, in which
finished rows leave the batch; each round also times transformers' `generate` of the same rows (every
row decoding until the last stops), the baseline before that loop. Beside it, the median over the
rounds whose ES iteration decoded as many steps as plain generation did: a member whose answer runs
longer than the unperturbed model's makes the iteration decode more steps (for its rows), work that
the headline charges to ES. And each round, right after its ES iteration, plain generation of the same
rows with each row generating as many tokens as it did in that iteration (its rows and decode steps
alike): the iteration's own work, so that ratio is the engine's speed on it. Then the same rounds
again with EOS stopping no row (every row decodes `max_new_tokens` in all three, as inference
throughput benchmarks measure, e.g. vLLM's with --ignore-eos): both sides do the same work, so that
ratio is the engine's speed alone. Member by member, likewise against plain generation of each
member's rows one call at a time (first shape).

Then each variant in a fresh process (so that no variant's peak memory is hidden by what an earlier one
left allocated): plain batched inference, fastes' default eval mode for this model and the other modes,
and the naive loop (benchmarks/naive.py: per-tensor seeded randn, perturb, generate, restore, N-pass
update, member by member), each against the machine's limit: the tokens processed x 2 x parameters / the
fp32 matmul rate measured in the same run.
Peak memory is the RSS high-water mark, reset before each. Plain generation and ES's default mode, whose
peaks the memory target compares, run `--memory-repeats` times each under two allocator settings:
- fastes' own (fastes.engine.cpu_memory: every block from glibc's heap, which is never trimmed): freed
  memory stays in the process for its next tensors, so one start's peak lands on one of several levels
  hundreds of MiB apart, as it did under glibc's defaults, whose mmap threshold rises as large blocks
  are freed (the median run is reported, and every run's peak);
- the threshold fixed at glibc's starting value (`FIXED_ALLOCATOR`): every large block goes back to the
  system when freed, so the peak is what the process held at once, the same from one start to the next.
  The target is judged on this one. (Setting a MALLOC_ variable turns fastes' own setting off.)
Figures are measured; nothing is asserted.
Results: <out>/real-model-cpu-<date>-<time>.json and .md (never overwritten).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import torch

from benchmarks.common import cpu_model, current_rss_bytes, peak_rss_bytes, products_taken, reset_peak_rss
from benchmarks.naive import generate_at_lengths, naive_es_iteration, transformers_generate
from fastes.engine import cpu_linear

TARGET_RATE_RATIO = 0.95  # an ES iteration's token rate over plain batched generation's
TARGET_MEMBER_RATIO = 0.7  # member by member over plain generation of each member's rows
TARGET_NAIVE_RATIO = 2.0
TARGET_MEMORY_RATIO = 1.1
FIXED_LENGTH = "fixed-length"  # `--only`'s prefix for the rounds in which EOS stops no row
# glibc's starting mmap threshold, set explicitly, which also stops glibc from raising it (mallopt(3)); other
# C libraries ignore the variable
FIXED_ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": "131072"}
ALLOCATORS = {"default": {}, "fixed mmap threshold": FIXED_ALLOCATOR}


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


def _setup(args: argparse.Namespace, mode: str):
    """(run, es, the iteration's prompts, their prompt tokens over all members) for eval mode `mode`."""
    from fastes.models.generation import generate
    from fastes.models.loading import is_character_tokenizer, load_model
    from fastes.models.sources import resolve_model
    from fastes.run import auto_settings
    from fastes.run.config import load_config
    from fastes.run.es_loop import make_es
    from fastes.run.shared import Run, batch_for
    from fastes.tasks.setup import make_task

    model, tokenizer = load_model(resolve_model(args.model), dtype="float32")
    overrides = {
        **_settings(args),
        "es.eval_mode": mode,
        "es.noise_type": "lowrank" if mode == "lowrank" else "full",
    }
    cfg = auto_settings.resolve(load_config(None, overrides), model, tokenizer)
    task = make_task(cfg, is_character_tokenizer(tokenizer))
    run = Run(cfg, model, tokenizer, task, args.out / "real-model-run")
    prompts = run.prompts(batch_for(run, "es", 0))
    prompt_tokens = sum(len(tokenizer(p).input_ids) for p in prompts) * args.population
    generate(model, tokenizer, prompts[:1], max_new_tokens=2)  # lazy allocations happen here
    return run, make_es(run), prompts, prompt_tokens


def _generated(record: dict) -> int:
    """The tokens an ES iteration generated, from its metrics record."""
    return round(record["tokens_per_second"] * record["seconds"])


def _steps(gen) -> int:
    """The decode steps of one generate call: its longest completion (the call decodes until its last row
    stops)."""
    return max(gen.lengths)


def _round(index: int, plain, iteration, reference, matched=None) -> dict:
    """One round: plain generation, an ES iteration and plain generation by transformers' `generate`, the
    order rotating from one round to the next; with `matched`, plain generation at the lengths the ES
    iteration's rows answered at, right after it (it needs those lengths)."""
    calls = {"plain": plain, "es": iteration, "transformers": reference}
    names = list(calls)
    measured = {}
    for name in names[index % 3 :] + names[: index % 3]:
        measured[name] = calls[name]()
        if name == "es" and matched is not None:
            measured["matched"] = matched()
    plain_seconds, plain_tokens, plain_steps = measured["plain"]
    es_seconds, es_tokens, es_steps, parts = measured["es"]
    reference_seconds, reference_tokens, _ = measured["transformers"]
    es_rate = es_tokens / es_seconds
    result = {
        "plain_seconds": plain_seconds,
        "plain_tokens": plain_tokens,
        "plain_steps": plain_steps,
        "es_seconds": es_seconds,
        "es_tokens": es_tokens,
        "es_steps": es_steps,
        "transformers_seconds": reference_seconds,
        "transformers_tokens": reference_tokens,
        "rate_ratio": es_rate / (plain_tokens / plain_seconds),
        "transformers_rate_ratio": es_rate / (reference_tokens / reference_seconds),
        "plain_over_transformers": (plain_tokens / plain_seconds) / (reference_tokens / reference_seconds),
        "parts": parts,
    }
    if "matched" in measured:
        matched_seconds, matched_tokens, _ = measured["matched"]
        result |= {
            "matched_seconds": matched_seconds,
            "matched_tokens": matched_tokens,
            "matched_rate_ratio": es_rate / (matched_tokens / matched_seconds),
        }
    return result


def _fastest_ratio(rounds: list[dict]) -> float:
    """The fastest ES token rate over the fastest plain generation's, among `rounds`."""
    es = max(r["es_tokens"] / r["es_seconds"] for r in rounds)
    return es / max(r["plain_tokens"] / r["plain_seconds"] for r in rounds)


def interleaved(args: argparse.Namespace, mode: str, fixed_length: bool = False) -> dict:
    """ES iterations of eval mode `mode` and plain generation of the same rows, warm, alternating.

    Plain generation is one batched call of every member's rows, or in "member" mode one call per member
    (what member-by-member evaluation does, without perturbing). Rates are tokens processed (prompt and
    generated) per second. "rate_ratio" is the median over all rounds (the headline); "same_steps_ratio"
    the median over the rounds whose ES iteration decoded as many steps as plain generation did: a member
    whose answer runs longer keeps its rows decoding, work that plain generation of the
    unperturbed model does not do (None when no round matched); "fastest_same_steps_ratio" the fastest
    ES rate over the fastest plain rate in those rounds: a busy machine only ever adds time, so the
    fastest of several runs is the closest reading of what a program itself costs (as timeit takes it).

    Both decode with fastes' loop, in which finished rows leave the batch (fastes.models.decoding). Each
    round also generates the same rows with transformers' `generate`, which decodes every row until the
    last stops: "transformers_rate_ratio" is the ES iteration's rate over that one's, and
    "plain_over_transformers" plain generation's (medians over all rounds).

    With `fixed_length`, EOS stops no row, in any of the three: every row decodes max_new_tokens tokens,
    so both sides do the same work whatever the members answer (as inference throughput benchmarks
    measure), and the ratio is the engine's speed alone."""
    import fastes.run.es_loop as es_loop
    from fastes.models.generation import generate
    from fastes.run.es_loop import es_iteration
    from fastes.run.shared import long_lived_objects_frozen

    run, es, prompts, prompt_tokens = _setup(args, mode)
    calls = [prompts] * args.population if mode == "member" else [prompts * args.population]
    generated = []  # the Generation of each call of the ES iteration under way

    stop_at_eos = not fixed_length

    def recording(*positional, **keywords):
        generated.append(generate(*positional, **keywords, stop_at_eos=stop_at_eos))
        return generated[-1]

    def counted(gens: list) -> tuple[int, int]:
        """Tokens processed (every row's prompt and generated tokens) and decode steps of some calls."""
        return prompt_tokens + sum(g.num_tokens for g in gens), sum(map(_steps, gens))

    def plain() -> tuple[float, int, int]:
        start = time.perf_counter()
        gens = [
            generate(run.model, run.tokenizer, rows, max_new_tokens=args.new_tokens, stop_at_eos=stop_at_eos)
            for rows in calls
        ]
        return time.perf_counter() - start, *counted(gens)

    def reference() -> tuple[float, int, int]:
        start = time.perf_counter()
        gens = [
            transformers_generate(run.model, run.tokenizer, rows, args.new_tokens, stop_at_eos)
            for rows in calls
        ]
        return time.perf_counter() - start, *counted(gens)

    def matched() -> tuple[float, int, int]:
        start = time.perf_counter()
        gens = [
            generate_at_lengths(run.model, run.tokenizer, rows, gen.lengths, args.new_tokens)
            for rows, gen in zip(calls, generated, strict=True)
        ]
        seconds = time.perf_counter() - start
        if [g.lengths for g in gens] != [g.lengths for g in generated]:
            raise RuntimeError("plain generation at the ES iteration's lengths generated other lengths")
        return seconds, *counted(gens)

    def iteration() -> tuple[float, int, int, dict]:
        generated.clear()
        record = es_iteration(run, es, 0)  # the same prompts every time; the members change
        parts = {k: v for k, v in record.items() if k.startswith("time/")}
        return record["seconds"], *counted(generated), parts

    with mock.patch.object(es_loop, "generate", recording):  # the ES iteration's generate call
        cold = iteration()
        plain()
        with long_lived_objects_frozen():  # as `fastes train` runs its steps
            rounds = [
                _round(index, plain, iteration, reference, None if fixed_length else matched)
                for index in range(args.rounds)
            ]
    median = statistics.median
    equal = [r for r in rounds if r["es_steps"] == r["plain_steps"]]
    return {
        "mode": mode,
        "fixed_length": fixed_length,
        "rate_ratio": median(r["rate_ratio"] for r in rounds),
        "rate_ratio_range": [min(r["rate_ratio"] for r in rounds), max(r["rate_ratio"] for r in rounds)],
        "same_steps_ratio": median(same) if (same := [r["rate_ratio"] for r in equal]) else None,
        "same_steps_rounds": len(equal),
        "fastest_same_steps_ratio": _fastest_ratio(equal) if equal else None,
        "matched_length_ratio": None if fixed_length else median(r["matched_rate_ratio"] for r in rounds),
        "transformers_rate_ratio": median(r["transformers_rate_ratio"] for r in rounds),
        "plain_over_transformers": median(r["plain_over_transformers"] for r in rounds),
        "plain_seconds": median(r["plain_seconds"] for r in rounds),
        "es_seconds": median(r["es_seconds"] for r in rounds),
        "es_parts": {k: median(r["parts"][k] for r in rounds) for k in rounds[0]["parts"]},
        "cold_first_iteration": {"seconds": cold[0], "tokens": cold[1], "parts": cold[3]},
        "rounds": rounds,
    }


def measure(args: argparse.Namespace, variant: str) -> dict:
    """One variant once in this process: seconds, tokens processed and peak RSS above the loaded model."""
    from fastes.models.generation import generate
    from fastes.run.es_loop import es_iteration, evolved_weights
    from fastes.run.shared import batch_for

    mode = variant.removeprefix("fastes ") if variant.startswith("fastes ") else "member"
    run, es, prompts, prompt_tokens = _setup(args, mode)
    if variant == "plain batched inference":
        rows = prompts * args.population
        seconds, peak, gen = _measured(
            lambda: generate(run.model, run.tokenizer, rows, max_new_tokens=args.new_tokens)
        )
        return {"seconds": seconds, **peak, "tokens": prompt_tokens + gen.num_tokens}
    if variant == "naive loop":
        tensors = [p for _, p in evolved_weights(run.model, run.cfg.es)]
        seconds, peak, record = _measured(
            lambda: naive_es_iteration(
                run.model,
                run.tokenizer,
                tensors,
                batch_for(run, "es", 0),
                prompts,
                run.task,
                population=args.population,
                sigma=1e-3,
                lr=5e-6,
                max_new_tokens=args.new_tokens,
            )
        )
        return {"seconds": seconds, **peak, "tokens": prompt_tokens + record["tokens"]}
    seconds, peak, record = _measured(lambda: es_iteration(run, es, 0))
    return {
        "seconds": seconds,
        **peak,
        "tokens": prompt_tokens + _generated(record),
        "parts": {k: v for k, v in record.items() if k.startswith("time/")},
    }


def _child(
    args: argparse.Namespace, shape: tuple[int, int, int], only: str, allocator: str = "default"
) -> dict:
    """`only` (a variant, or "interleaved <mode>") at `shape` in a fresh process under `allocator` (a key
    of ALLOCATORS): its JSON result."""
    population, prompts, new_tokens = shape
    flags = [f"--model={args.model}", f"--shapes={population}x{prompts}x{new_tokens}"]
    flags += [f"--rounds={args.rounds}", f"--out={args.out}", "--only", only]
    child = subprocess.run(
        [sys.executable, "-m", "benchmarks.real_model", *flags],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **ALLOCATORS[allocator]},
    )
    return json.loads(child.stdout.strip().splitlines()[-1])


def _median_run(runs: list[dict]) -> dict:
    """The median run by peak, with every run's peak and seconds beside it."""
    median = sorted(runs, key=lambda r: r["peak_bytes"])[len(runs) // 2]
    return {**median, "runs": [{k: r[k] for k in ("seconds", "peak_bytes")} for r in runs]}


def _fresh_variants(
    args: argparse.Namespace, shape: tuple[int, int, int], names: list[str], compared: list[str]
) -> dict[str, dict]:
    """Each variant in fresh processes: the `compared` pair (plain generation and ES's default mode,
    whose peak memory the target compares) `args.memory_repeats` times each under each allocator setting,
    alternating, the others once under fastes' own. A repeated variant reports its median run (by peak)
    and every run's peak and seconds; under the fixed mmap threshold, in its "fixed mmap threshold"
    entry."""
    label = "x".join(map(str, shape))
    runs: dict[tuple[str, str], list[dict]] = {}
    for repeat in range(args.memory_repeats):
        for allocator in ALLOCATORS:
            for name in names if repeat == 0 and allocator == "default" else compared:
                each = runs.setdefault((name, allocator), [])
                _progress(f"{label}: {name}, in a fresh process ({allocator} allocator, run {len(each) + 1})")
                each.append(_child(args, shape, name, allocator))
    variants = {name: _median_run(runs[name, "default"]) for name in names}
    for name in compared:
        variants[name]["fixed mmap threshold"] = _median_run(runs[name, "fixed mmap threshold"])
    return variants


def run(args: argparse.Namespace) -> dict:
    """Every measurement, each in a fresh process, one after the other; the matmul rate in between."""
    from fastes.models.loading import load_model
    from fastes.models.sources import resolve_model
    from fastes.run import auto_settings
    from fastes.run.config import load_config

    load_average = os.getloadavg()[0]  # what else was running, at the start
    model, tokenizer = load_model(resolve_model(args.model), dtype="float32")  # converts a GGUF once
    params = sum(p.numel() for p in model.parameters())
    first = args.shapes[0]
    args.population, args.prompts, args.new_tokens = first
    default_mode = auto_settings.resolve(load_config(None, _settings(args)), model, tokenizer).es.eval_mode
    del model
    rate = matmul_flops_per_second()
    shapes = {}
    for shape in args.shapes:
        label = "x".join(map(str, shape))
        _progress(f"{label}: {default_mode} ES and plain batched generation, {args.rounds} rounds")
        entry = {"interleaved": _child(args, shape, f"interleaved {default_mode}")}
        _progress(f"{label}: the same, every row decoding {shape[2]} tokens, {args.rounds} rounds")
        entry["fixed_length_interleaved"] = _child(args, shape, f"{FIXED_LENGTH} interleaved {default_mode}")
        # peak memory of one call each, in fresh processes; every other mode at the first shape only
        modes = [default_mode] + (
            [m for m in ("lowrank", "materialised", "member") if m != default_mode] if shape == first else []
        )
        names = ["plain batched inference", *(f"fastes {mode}" for mode in modes)] + (
            ["naive loop"] if shape == first else []
        )
        if shape == first:
            _progress(
                f"{label}: member by member and plain generation member by member, {args.rounds} rounds"
            )
            entry["member_interleaved"] = _child(args, shape, "interleaved member")
        entry["variants"] = _fresh_variants(args, shape, names, compared=names[:2])
        for variant in entry["variants"].values():
            variant["limit_seconds"] = variant["tokens"] * 2 * params / rate
            variant["share_of_limit"] = variant["limit_seconds"] / variant["seconds"]
        shapes[label] = entry
    targets = {}
    for label, entry in shapes.items():
        variants = entry["variants"]
        targets[f"{label}: ES token rate >= {TARGET_RATE_RATIO:.0%} of plain batched generation's"] = entry[
            "interleaved"
        ]["rate_ratio"]
        if entry["interleaved"]["same_steps_ratio"] is not None:
            targets[f"{label}: the same, rounds where ES decoded as many steps as plain"] = entry[
                "interleaved"
            ]["same_steps_ratio"]
            targets[f"{label}: the same, the fastest of those rounds"] = entry["interleaved"][
                "fastest_same_steps_ratio"
            ]
        targets[f"{label}: the same, plain generation at the ES rows' own lengths (the same work)"] = entry[
            "interleaved"
        ]["matched_length_ratio"]
        fixed = entry["fixed_length_interleaved"]
        targets[f"{label}: the same, every row decoding max_new_tokens (EOS stops no row, in either)"] = (
            fixed["rate_ratio"]
        )
        es_variant, plain_variant = variants[f"fastes {default_mode}"], variants["plain batched inference"]
        fixed_es, fixed_plain = es_variant["fixed mmap threshold"], plain_variant["fixed mmap threshold"]
        memory = f"{label}: ES peak RSS <= {TARGET_MEMORY_RATIO}x plain batched generation's"
        targets[f"{memory} (fixed mmap threshold)"] = fixed_es["peak_bytes"] / fixed_plain["peak_bytes"]
        targets[f"{label}: the same, fastes' allocator setting (median runs)"] = (
            es_variant["peak_bytes"] / plain_variant["peak_bytes"]
        )
        if "member_interleaved" in entry:
            targets[
                f"{label}: member by member >= {TARGET_MEMBER_RATIO:.0%} of plain generation member by member"
            ] = entry["member_interleaved"]["rate_ratio"]
            targets[f"{label}: {default_mode} >= {TARGET_NAIVE_RATIO}x the naive loop (fresh processes)"] = (
                variants["naive loop"]["seconds"] / variants[f"fastes {default_mode}"]["seconds"]
            )
    now = datetime.datetime.now()
    return {
        "date": now.date().isoformat(),
        "time": now.strftime("%H%M"),
        "model": args.model,
        "parameters": params,
        "cpu": platform.processor() or platform.machine(),
        "cpu_model": cpu_model(),
        "threads": torch.get_num_threads(),
        # which products the model's linear layers took here (fastes.engine.cpu_linear)
        "cpu_products": cpu_linear.products(torch.get_num_threads())._asdict(),
        "load_average_at_start": load_average,
        "matmul_gflops": rate / 1e9,
        "rounds": args.rounds,
        "default_mode": default_mode,
        "shapes": shapes,
        "targets": targets,
    }


def _progress(message: str) -> None:
    print(f"[real-model {datetime.datetime.now():%H:%M:%S}] {message}", file=sys.stderr, flush=True)


def markdown(report: dict) -> str:
    r = report
    lines = [
        f"# ES on {r['model']} ({r['parameters'] / 1e6:.1f}M parameters) against plain generation",
        "",
        f"Measured {r['date']} {r['time'][:2]}:{r['time'][2:]}; {r['cpu_model']}; {r['threads']} torch "
        f"threads; the library's products taken ({products_taken(r)}); load average "
        f"{r['load_average_at_start']:.2f} at the start; fp32 matmul "
        f"{r['matmul_gflops']:.0f} GFLOP/s measured in the same run; default mode: {r['default_mode']}; "
        f"shapes are population x prompts x new tokens; {r['rounds']} interleaved rounds, warm.",
        "",
        "| shape | ES token rate / plain's: median (range) | the same, rounds with as many decode steps "
        "| the fastest of those rounds | plain at the ES rows' own lengths | plain s | ES s "
        "| ES generation / noise / update s | cold first iteration s | ES / transformers' generate "
        "| plain / transformers' generate |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, entry in report["shapes"].items():
        for key in ("interleaved", "fixed_length_interleaved", "member_interleaved"):
            if key not in entry:  # results files before 2026-12-07 have no fixed-length rounds
                continue
            e = entry[key]
            mode = (
                f"{e['mode']}, every row {label.split('x')[2]} tokens" if e.get("fixed_length") else e["mode"]
            )
            parts = e["es_parts"]
            low, high = e["rate_ratio_range"]
            same = "-" if e["same_steps_ratio"] is None else f"{e['same_steps_ratio']:.3f}"
            fastest = "-" if e["fastest_same_steps_ratio"] is None else f"{e['fastest_same_steps_ratio']:.3f}"
            lines.append(
                f"| {label} {mode} | {e['rate_ratio']:.3f} ({low:.3f}-{high:.3f}) | "
                f"{same} ({e['same_steps_rounds']} of {len(e['rounds'])} rounds) | {fastest} | "
                f"{_cell(e.get('matched_length_ratio'))} | {e['plain_seconds']:.2f} | "
                f"{e['es_seconds']:.2f} | {parts['time/generation']:.2f} / "
                f"{parts['time/noise']:.2f} / "
                f"{parts['time/update']:.2f} | {e['cold_first_iteration']['seconds']:.2f} | "
                f"{_cell(e.get('transformers_rate_ratio'))} | {_cell(e.get('plain_over_transformers'))} |"
            )
    lines += [
        "",
        "Each variant in fresh processes (cold: the first iteration's one-time costs included); plain "
        "generation and the default mode, whose peak memory the target compares, several times each under "
        "fastes' allocator setting (cpu_memory) and with glibc's mmap threshold fixed (the target's "
        "measure): their median run (by peak), and every run's peak:",
        "",
        "| shape | variant | seconds | share of the machine's limit | peak RSS | above the loaded model "
        "| every run's peak RSS | fixed mmap threshold: peak RSS | every run's |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def every(runs: list[dict]) -> str:
        return ", ".join(f"{r['peak_bytes'] / 2**20:.0f}" for r in runs) if len(runs) > 1 else ""

    for label, entry in report["shapes"].items():
        for name, v in entry["variants"].items():
            fixed = v.get("fixed mmap threshold")  # results files before 2026-12-05 19:30 have none
            fixed_cells = f"{fixed['peak_bytes'] / 2**20:.0f} MiB | {every(fixed['runs'])}" if fixed else " |"
            lines.append(
                f"| {label} | {name} | {v['seconds']:.1f} | {v['share_of_limit']:.0%} | "
                f"{v['peak_bytes'] / 2**20:.0f} MiB | {v['peak_above_model_bytes'] / 2**20:.0f} MiB | "
                f"{every(v.get('runs', []))} | {fixed_cells} |"
            )
    lines += ["", "| target | measured |", "|---|---|"]
    lines += [f"| {name} | {value:.3f} |" for name, value in report["targets"].items()]
    return "\n".join(lines) + "\n"


def _cell(value: float | None) -> str:
    """A ratio, or "-" in a results file from before it was measured."""
    return "-" if value is None else f"{value:.3f}"


def _shape(text: str) -> tuple[int, int, int]:
    population, prompts, new_tokens = (int(part) for part in text.lower().split("x"))
    return population, prompts, new_tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.real_model", description=__doc__)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument(
        "--shapes",
        type=lambda text: [_shape(part) for part in text.split(",")],
        default=[(8, 8, 16), (16, 16, 24)],
        help="population x prompts x new tokens, comma-separated (default 8x8x16,16x16x24)",
    )
    parser.add_argument("--rounds", type=int, default=6, help="interleaved rounds per shape (default 6)")
    parser.add_argument(
        "--memory-repeats",
        type=int,
        default=3,
        help="fresh processes each, under each allocator setting, for plain generation and ES's default "
        "mode, whose peak memory the target compares (default 3: the median is reported)",
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--only", default=None, help=argparse.SUPPRESS)  # one measurement, in a child
    args = parser.parse_args(argv)
    if args.only:
        args.population, args.prompts, args.new_tokens = args.shapes[0]
        if args.only.startswith("interleaved "):
            result = interleaved(args, args.only.removeprefix("interleaved "))
        elif args.only.startswith(FIXED_LENGTH + " interleaved "):
            result = interleaved(
                args, args.only.removeprefix(FIXED_LENGTH + " interleaved "), fixed_length=True
            )
        else:
            result = measure(args, args.only)
        print(json.dumps(result))
        return 0
    from fastes.errors import FastesError

    try:
        report = run(args)
    except FastesError as error:  # the shipped model's package is missing: say so, and how to get it
        print(f"real-model benchmark skipped: {error}")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"real-model-cpu-{report['date']}-{report['time']}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2))
    stem.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
