"""Where the low-rank layer adds its rank-r term on a CPU, measured on a real model's generation.

    python -m benchmarks.lowrank_forward_cpu [--model smollm2-135m-instruct] [--shape 8x8x16]
                                             [--rounds 6] [--out benchmarks/results]

One process, the same rows (population x prompts, greedy, fixed members), four ways interleaved round
by round, each one generate call:
- plain: the model as it is, all rows in one batch;
- in the stores: fastes.es.population.LowRankLinear as it is: on the compiled CPU backend, at a
  prefill's many rows, the packed linear adds the term to each output before it is stored
  (cpu_library.packed_linear); at fewer rows, as "added after";
- added after: the same layer with the packed linear off: the base projection's own product, then the
  term (products x output factors) added into its output by one broadcast multiply-add per rank;
- written first: the alternative tried on 2026-12-05: the term (bias + products x output factors)
  written into y first and the base GEMM accumulating into it (beta = 1), so that the GEMM's own pass
  over y absorbs the term's instead of a second read and write of y.
Plain generation's layers take the packed linear at a prefill's rows in every way (decoding_linears).
Only the generation is timed (no noise, no update): the ratio to plain is what the population layers
cost. Needs the shipped model (`bash scripts/setup.sh real`). Results:
<out>/lowrank-forward-cpu-<date>[-n].json and .md (never overwritten).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common import cpu_model, write_results
from benchmarks.real_model import _settings, _setup, _shape, _steps

WAYS = ("plain", "in the stores", "added after", "written first")


def written_first(layer, x: torch.Tensor) -> torch.Tensor:
    """LowRankLinear's output with its term written first and the base GEMM accumulating into it."""
    members, rank, out_features = layer.outputs.shape
    weight, bias = layer.base.weight, layer.base.bias
    flat = x.reshape(-1, x.shape[-1])
    products = torch.bmm(flat.reshape(members, -1, flat.shape[-1]), layer.inputs.transpose(1, 2))
    lead = (products[..., :1], layer.outputs[:, :1])
    term = torch.mul(*lead) if bias is None else torch.addcmul(bias, *lead)
    for i in range(1, rank):
        term.addcmul_(products[..., i : i + 1], layer.outputs[:, i : i + 1])
    y = term.view(-1, out_features).addmm_(flat, weight if layer.transposed else weight.T)
    return y.view(*x.shape[:-1], out_features)


def measure(args: argparse.Namespace) -> dict:
    from fastes.es.population import LowRankLinear, population_batched
    from fastes.models.generation import generate

    run, es, prompts, _ = _setup(args, "lowrank")
    rows = prompts * args.population
    as_it_is = LowRankLinear.forward

    def added_after(layer, x: torch.Tensor) -> torch.Tensor:
        packed, layer.packed = layer.packed, False
        try:
            return as_it_is(layer, x)
        finally:
            layer.packed = packed

    forwards = {"in the stores": as_it_is, "added after": added_after, "written first": written_first}

    def timed(way: str) -> tuple[float, int]:
        def call() -> object:
            return generate(run.model, run.tokenizer, rows, max_new_tokens=args.new_tokens)

        if way == "plain":
            return _seconds(call)
        LowRankLinear.forward = forwards[way]
        try:
            with population_batched(es, run.model, "lowrank"):  # the same members every round
                return _seconds(call)
        finally:
            LowRankLinear.forward = as_it_is

    for way in WAYS:  # warm
        timed(way)
    rounds = []
    for index in range(args.rounds):
        order = WAYS if index % 2 == 0 else WAYS[::-1]
        rounds.append({way: dict(zip(("seconds", "steps"), timed(way))) for way in order})
    median = statistics.median
    ratios = {way: median(r["plain"]["seconds"] / r[way]["seconds"] for r in rounds) for way in WAYS[1:]}
    return {"ratio_to_plain": ratios, "rounds": rounds}


def _seconds(call: Callable[[], object]) -> tuple[float, int]:
    start = time.perf_counter()
    gen = call()
    return time.perf_counter() - start, _steps(gen)


def markdown(report: dict) -> str:
    r = report
    lines = [
        "# The low-rank layer's rank-r term on a CPU: in the product's stores, added after, or written first",
        "",
        f"Measured {r['date']} {r['time']}; {r['cpu_model']}; {r['threads']} torch threads; {r['model']} "
        f"fp32, {r['shape']} (population x prompts x new tokens), greedy; {len(r['rounds'])} interleaved "
        "rounds of one generate call each (`python -m benchmarks.lowrank_forward_cpu`).",
        "",
        "| way | plain generation's time / this way's: median | seconds per round |",
        "|---|---|---|",
    ]
    for way in WAYS[1:]:
        seconds = ", ".join(f"{x[way]['seconds']:.2f}" for x in r["rounds"])
        lines.append(f"| {way} | {r['ratio_to_plain'][way]:.3f} | {seconds} |")
    plain = ", ".join(f"{x['plain']['seconds']:.2f}" for x in r["rounds"])
    lines += [f"| plain | 1 | {plain} |", ""]
    steps = {way: sorted({x[way]["steps"] for x in r["rounds"]}) for way in WAYS}
    lines.append(f"Decode steps per call (the same members every round): {steps}.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.lowrank_forward_cpu", description=__doc__)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--shape", type=_shape, default=(8, 8, 16), help="population x prompts x new tokens")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    args.population, args.prompts, args.new_tokens = args.shape
    from fastes.errors import FastesError

    try:
        measured = measure(args)
    except FastesError as error:  # the shipped model's package is missing: say so, and how to get it
        print(f"low-rank forward benchmark skipped: {error}")
        return 0
    now = datetime.datetime.now()
    report = {
        "date": now.date().isoformat(),
        "time": now.strftime("%H:%M"),
        "model": args.model,
        "shape": "x".join(map(str, args.shape)),
        "settings": _settings(args),
        "cpu_model": cpu_model(),
        "threads": torch.get_num_threads(),
        **measured,
    }
    text = markdown(report)
    print(text)
    print(f"wrote {write_results(args.out, 'lowrank-forward-cpu', report, text)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
