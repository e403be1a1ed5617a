"""The ES step on bare weights, the CPU backend's first-call compile time, and the step's peak memory.

Weights: 12 fp32 matrices of 1024 x 1024 (12.6M weights, as in issue 11), N = 30, a reward closure of
negligible cost. Variants, timed side by side in one run:
- step: one `fastes.ES.step` (antithetic, the default: 15 directions; and with antithetic=False: 30)
  vs the naive step (per member: seeded torch.Generator + randn + add_ per tensor, restore by
  regenerating + sub_; then the naive 30-pass update);
- member: one member's perturb + exact restore (`with member:`) vs naive perturb + restore, and the
  same member on the eager reference backend;
- update: `fastes.engine.ops.es_update` over 30 directions vs the naive 30-pass update.
Compile: a fresh process with an empty build cache times its first compiled call (cold), a second
process with that cache does it again (warm). Memory: a fresh process reports the peak RSS of one ES
step beyond the weights, over the evolved bytes (the work buffer alone is 1x).

    python -m benchmarks.step '{"memory": {...}}'     # the memory child (used by run_step)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch

from benchmarks import naive
from benchmarks.common import Context, current_rss_bytes, measure, peak_rss_bytes, ratio, reset_peak_rss
from fastes import ES, Member
from fastes.engine import noise, ops

SIGMA = 1e-3


def make_weights(quick: bool, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    shape, count = ((64, 64), 3) if quick else ((1024, 1024), 12)
    g = torch.Generator().manual_seed(seed)
    return [(f"layers.{i}.weight", torch.randn(shape, generator=g) * 0.02) for i in range(count)]


def _reward() -> float:
    return float(time.perf_counter_ns() % 1000)  # negligible cost, members differ


def step_variants(
    weights: list[tuple[str, torch.Tensor]], population: int, backend: str
) -> dict[str, Callable[[], object]]:
    tensors = [t for _, t in weights]
    ids = [noise.tensor_id(n) for n, _ in weights]
    lr = 1e-9  # the timing loops must not move the weights far
    es = ES(weights, sigma=SIGMA, lr=lr, population=population, backend=backend, checksum_every=0)
    es_plain = ES(
        weights,
        sigma=SIGMA,
        lr=lr,
        population=population,
        antithetic=False,
        backend=backend,
        checksum_every=0,
    )
    es_reference = ES(weights, sigma=SIGMA, lr=lr, population=2, backend="torch", checksum_every=0)
    member, reference_member = Member(es, 0), Member(es_reference, 0)
    seeds = list(range(population))
    keys = [noise.member_key(0, 0, j) for j in range(population)]
    update_weights = torch.linspace(-1, 1, population).tolist()

    def naive_step() -> None:
        for s in seeds:
            naive.naive_perturb(tensors, s, SIGMA)
            _reward()
            naive.naive_restore(tensors, s, SIGMA)
        naive.naive_update(tensors, seeds, update_weights, lr / (population * SIGMA))

    def cycle(m: Member) -> None:
        with m:
            pass

    return {
        "step": lambda: es.step(_reward),
        "step-not-antithetic": lambda: es_plain.step(_reward),
        "naive-step": naive_step,
        "member": lambda: cycle(member),
        "member-reference": lambda: cycle(reference_member),
        "naive-member": lambda: (
            naive.naive_perturb(tensors, 7, SIGMA),
            naive.naive_restore(tensors, 7, SIGMA),
        ),
        "update": lambda: ops.es_update(tensors, ids, keys, update_weights, coef=1e-9, backend=backend),
        "naive-update": lambda: naive.naive_update(tensors, seeds, update_weights, 1e-9),
    }


def _child(spec: dict, cache_dir: str | None = None) -> dict:
    """Run child_main(spec) in a fresh process (with its own build cache when `cache_dir` is given)."""
    env = dict(os.environ)
    if cache_dir is not None:
        env["FASTES_CACHE_DIR"] = cache_dir
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.step", json.dumps(spec)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if out.returncode != 0:
        raise RuntimeError(f"benchmarks.step child failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_step(ctx: Context, plan, models) -> list[dict]:
    population = 4 if ctx.quick else 30
    weights = make_weights(ctx.quick)
    numel = sum(t.numel() for _, t in weights)
    saved = [t.clone() for _, t in weights]
    variants = step_variants(weights, population, ctx.backend)
    rounds = 2 if ctx.quick else 3
    t = measure(variants, ctx.device, rounds=rounds, warmup=1, min_sample_s=0.0 if not ctx.quick else 0.01)
    for (_, w), s in zip(weights, saved):
        w.copy_(s)
    record: dict = {
        "model": f"linear-{len(weights)}x{weights[0][1].shape[0]}x{weights[0][1].shape[1]}",
        "evolved_elements": numel,
        "population": population,
        "backend": ops.resolve_backend([weights[0][1]], ctx.backend),
        **{k.replace("-", "_"): v.as_dict() for k, v in t.items()},
        "speedup_vs_naive": ratio(t["naive-step"].median, t["step"].median),
        "not_antithetic_speedup_vs_naive": ratio(t["naive-step"].median, t["step-not-antithetic"].median),
        "member_speedup_vs_naive": ratio(t["naive-member"].median, t["member"].median),
        "member_reference_speedup_vs_naive": ratio(t["naive-member"].median, t["member-reference"].median),
        "update_speedup_vs_naive": ratio(t["naive-update"].median, t["update"].median),
    }
    spec = {"quick": ctx.quick, "threads": torch.get_num_threads(), "backend": ctx.backend}
    if not ctx.quick:  # the first call builds the library (cold) or loads the cached build (warm)
        with tempfile.TemporaryDirectory(prefix="fastes-build-cache-") as cache:
            record["compile_cold_s"] = _child({**spec, "measure": "compile"}, cache)["first_call_s"]
            record["compile_warm_s"] = _child({**spec, "measure": "compile"}, cache)["first_call_s"]
    record["memory"] = _child({**spec, "measure": "memory"})
    record["peak_over_evolved"] = record["memory"]["increment_bytes"] / record["memory"]["evolved_bytes"]
    ctx.log(
        f"step     {record['model']} N={population} vs naive {record['speedup_vs_naive']:.2f}x, member "
        f"{record['member_speedup_vs_naive']:.2f}x, update {record['update_speedup_vs_naive']:.2f}x"
    )
    return [record]


def child_main(spec: dict) -> dict:
    """In a fresh process: the first compiled call's time, or one ES step's peak memory."""
    torch.set_num_threads(int(spec["threads"]))
    if spec["measure"] == "compile":
        start = time.perf_counter()
        ops.normal((1, 2), 3, 8, backend=spec["backend"])
        return {"first_call_s": time.perf_counter() - start}
    weights = make_weights(spec["quick"])
    population = 4 if spec["quick"] else 30
    es = ES(weights, sigma=SIGMA, lr=1e-9, population=population, backend=spec["backend"], checksum_every=0)
    ops.normal((1, 2), 3, 8, backend=spec["backend"])  # compile (or load) outside the measured step
    reset_peak_rss()
    setup = current_rss_bytes()
    es.step(_reward)
    evolved = sum(t.numel() * t.element_size() for _, t in weights)
    return {"setup_bytes": setup, "increment_bytes": peak_rss_bytes() - setup, "evolved_bytes": evolved}


if __name__ == "__main__":
    print(json.dumps(child_main(json.loads(sys.argv[1]))))
