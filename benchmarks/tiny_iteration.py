"""Where one ES iteration of the tiny model spends its time, against plain batched generation.

    python -m benchmarks.tiny_iteration [--threads 1] [--rounds 9] [--modes materialised,lowrank]
                                        [--antithetic] [--fixed-length] [--out DIR]

The demo's setting (16 members x 32 countdown prompts x 12 new tokens, greedy; antithetic off as in the
iteration suite, or on, as a run has it by default, with --antithetic), each round interleaved: plain
batched generation of the same 512 rows; the same generate call inside `population_batched` (the members'
perturbed weights or factors in place, built before the call is timed; in the runs up to
tiny-iteration-2026-12-07-22 its time included building them, charged to the generation); entering and
leaving `population_batched` alone; and a whole `es_iteration`, whose own split (generation, noise,
scoring, update) it records. The headline is the iteration's time over plain generation's for the same
rows and max_new_tokens, the median over rounds of the two in the same round (up to
tiny-iteration-2026-12-07-28 the ratio of their medians over all rounds) (in both, a row leaves the batch
when it finishes; the generated-token rate is also reported, and is lower for ES whenever perturbed
members stop earlier at EOS). With --fixed-length, EOS stops no row in any of them (every row decodes
max_new_tokens: the same work on both sides, whatever the members answer, so the ratio is the engine's
speed alone). Medians over rounds (and, beside them, the fastest round of each), run as `fastes train`
runs its steps: with the objects made before them frozen out of full garbage collections. Measured, never
asserted. Writes <out>/tiny-iteration-<date>.json and .md. One thread by default, the count
`fastes.run.auto_settings` gives a tiny model; a lone `fastes` command then generates with its share of
the cores, every core (fastes.engine.cpu_share): `--threads 2` measures that on a 2-core machine.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import statistics
import time
from pathlib import Path
from unittest import mock

import torch

from benchmarks.common import (
    IterationSetting,
    cpu_model,
    load_average,
    load_bench_model,
    make_run,
    products_taken,
    write_results,
)
from fastes.engine import cpu_linear

SETTING = IterationSetting(population=16, batch=32, max_new_tokens=12)


def _timed(call) -> tuple[float, object]:
    start = time.perf_counter()
    result = call()
    return time.perf_counter() - start, result


def measure_mode(mode: str, rounds: int, antithetic: bool = False, fixed_length: bool = False) -> dict:
    """Interleaved rounds of plain generation, population generation, enter/exit and a whole iteration;
    with `fixed_length`, EOS stops no row in any of them."""
    import fastes.run.es_loop as es_loop
    from fastes.es.population import population_batched
    from fastes.models.generation import generate as generate_stopping
    from fastes.run.es_loop import es_iteration
    from fastes.run.shared import batch_for, long_lived_objects_frozen

    generate = functools.partial(generate_stopping, stop_at_eos=not fixed_length)

    bench = load_bench_model("tiny", torch.device("cpu"), torch.float32)
    run, es = make_run(bench.clone(), SETTING, "auto", mode, antithetic)
    prompts = run.prompts(batch_for(run, "es", 0)) * SETTING.population
    members = list(es.members())

    def generated():
        return generate(run.model, run.tokenizer, prompts, max_new_tokens=SETTING.max_new_tokens)

    def population():  # the generate call alone, the population's layers in place
        with population_batched(es, run.model, mode=run.cfg.es.eval_mode, members=members):
            return _timed(generated)

    def enter_exit():
        with population_batched(es, run.model, mode=run.cfg.es.eval_mode, members=members):
            pass

    # each call gives its seconds and its generation (None: enter and exit)
    calls = {
        "plain": lambda: _timed(generated),
        "population generation": population,
        "enter and exit": lambda: (_timed(enter_exit)[0], None),
    }
    with mock.patch.object(es_loop, "generate", generate):  # the iteration's generate call, likewise
        for call in calls.values():  # warm: lazy allocations, the compiled library
            call()
        es_iteration(run, es, 0)
        seconds: dict[str, list[float]] = {name: [] for name in [*calls, "ES iteration"]}
        tokens: dict[str, int] = {}
        parts: list[dict] = []
        with long_lived_objects_frozen():  # as `fastes train` runs its steps
            for _ in range(rounds):
                for name, call in calls.items():
                    s, out = call()
                    seconds[name].append(s)
                    if out is not None:
                        tokens[name] = out.num_tokens
                s, record = _timed(lambda: es_iteration(run, es, 0))
                seconds["ES iteration"].append(s)
                tokens["ES iteration"] = round(record["tokens_per_second"] * record["seconds"])
                parts.append({k: v for k, v in record.items() if k.startswith("time/")})
    median = {name: statistics.median(values) for name, values in seconds.items()}
    split = {k: statistics.median(p[k] for p in parts) for k in parts[0]}

    def ratio_of_neighbours(name: str) -> float:
        """The median over rounds of plain generation's time over `name`'s in the same round: this 2-core
        machine's speed drifts by 10-40% within a minute (plain generation's rounds of one run ranged
        124-173 ms: tiny-iteration-2026-12-07-23), which a ratio of neighbours cancels and a ratio of two
        medians, each taken from other rounds, does not."""
        return statistics.median(a / b for a, b in zip(seconds["plain"], seconds[name]))

    time_ratio = ratio_of_neighbours("ES iteration")
    return {
        "eval_mode": run.cfg.es.eval_mode,
        "noise_type": run.cfg.es.noise_type,
        "median_s": median,
        "range_s": {name: [min(v), max(v)] for name, v in seconds.items()},
        "rounds_s": seconds,
        "tokens": tokens,
        "iteration_split_s": split,
        "time_ratio": time_ratio,
        # the headline up to tiny-iteration-2026-12-07-28
        "ratio_of_medians": median["plain"] / median["ES iteration"],
        # a busy machine only adds time: the fastest rounds are the closest reading of each one's cost
        "fastest_time_ratio": min(seconds["plain"]) / min(seconds["ES iteration"]),
        "generation_time_ratio": ratio_of_neighbours("population generation"),
        "token_rate_ratio": time_ratio * (tokens["ES iteration"] / tokens["plain"]),
    }


def markdown(report: dict) -> str:
    products = (
        f"the library's products taken ({products_taken(report)}); " if "cpu_products" in report else ""
    )
    lines = [
        "# One ES iteration of the tiny model against plain batched generation",
        "",
        f"Measured {report['date']} {report['time']}; {report['cpu']}; {report['threads']} torch thread(s); "
        f"{products}load average {report['load_average_at_start']} at the start; "
        f"{SETTING.population} members x {SETTING.batch} prompts x {SETTING.max_new_tokens} new tokens; "
        "antithetic pairs "
        f"{'on' if report['antithetic'] else 'off'}; "
        f"{'EOS stops no row (every row decodes the max_new_tokens); ' if report.get('fixed_length') else ''}"
        f"median of {report['rounds']} "
        "interleaved rounds (`python -m benchmarks.tiny_iteration`).",
        "",
        "| mode | plain ms | population generation ms | enter + exit ms | ES iteration ms | its generation / "
        "noise / scoring / update ms | iteration time ratio | fastest rounds | generation only "
        "| generated-token rate ratio |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, r in report["modes"].items():
        m, split = r["median_s"], r["iteration_split_s"]
        parts = " / ".join(
            f"{split[f'time/{p}'] * 1e3:.1f}" for p in ("generation", "noise", "scoring", "update")
        )
        ms = [m[k] * 1e3 for k in ("plain", "population generation", "enter and exit", "ES iteration")]
        ratios = [r["time_ratio"], r["fastest_time_ratio"], r["generation_time_ratio"], r["token_rate_ratio"]]
        cells = [
            f"{mode} ({r['noise_type']} noise)",
            *(f"{v:.1f}" for v in ms),
            parts,
            *(f"{v:.3f}" for v in ratios),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Time ratio: plain generation's time over the ES iteration's, the same rows and decode steps, "
        "the median over rounds of the two in the same round (target >= 0.95). Fastest rounds: plain "
        "generation's fastest round over the ES iteration's fastest. Generation only: plain over the "
        "same generate call with the population layers in place (built before it is timed), likewise "
        "per round. Generated-token rate ratio: the ES iteration's generated tokens per second over plain's "
        f"(tokens: {json.dumps({mode: r['tokens'] for mode, r in report['modes'].items()})}).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tiny_iteration", description=__doc__)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--modes", default="materialised,lowrank")
    parser.add_argument("--antithetic", action="store_true", help="antithetic pairs, as a run's default")
    parser.add_argument(
        "--fixed-length", action="store_true", help="EOS stops no row: every row decodes max_new_tokens"
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    now = datetime.datetime.now()
    report = {
        "date": now.strftime("%Y-%m-%d"),
        "time": now.strftime("%H:%M"),
        "cpu": cpu_model(),
        "threads": args.threads,
        "rounds": args.rounds,
        "antithetic": args.antithetic,
        "fixed_length": args.fixed_length,
        "load_average_at_start": load_average(),
        "modes": {},
    }
    for mode in args.modes.split(","):
        report["modes"][mode] = measure_mode(mode, args.rounds, args.antithetic, args.fixed_length)
        print(f"{mode}: iteration time ratio {report['modes'][mode]['time_ratio']:.3f}", flush=True)
    # which products the layers took here (fastes.engine.cpu_linear): plain generation's small layers too
    report["cpu_products"] = cpu_linear.products(args.threads)._asdict()
    print(f"wrote {write_results(args.out, 'tiny-iteration', report, markdown(report))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
