"""The compiled Triton kernels vs the torch reference, step by step (scripts/gpu_check.sh runs it).

    python -m benchmarks.gpu_check --out DIR [--steps environment,stream,...] [--device cuda] [--small]

Steps: environment (GPU, driver, CUDA, torch, triton), stream (raw Philox words exact, normals), perturb,
update (every mode), virtual (virtual_linear vs materialised weights), es (exact restore, ES.step vs the
CPU reference), large (a tensor past 2^31 elements), bench (a short benchmark), model (one ES iteration of
Qwen2.5-0.5B's shape with random weights: the noise time of materialised, virtual and low-rank
evaluation and of the update against benchmarks.model_iteration's prediction). Keys, rounding keys and
tensor ids of 1 are included: Triton used to turn an int argument equal to 1 into a constant.

Each step runs on its own: a failure or crash in one is recorded and the next step still runs. After each
step DIR/<step>.log and DIR/<step>.json are written and DIR/summary.json is updated (steps run in separate
processes by gpu_check.sh add to the same summary). Contract (docs/noise.md): raw words bit-identical;
normals within 1e-5; fp32 results within 1e-5 of their magnitude; 16-bit results at most one ulp apart in
under 1% of elements; restore bit-exact. Exit status: 0 all passed, 1 a check failed, 2 no CUDA device.

`--device cpu` runs the same steps on the Triton interpreter (TRITON_INTERPRET=1) with `--small` sizes:
that is how the test suite checks this script's logic without a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
NAMES = ["emb", "layers.0.q.weight", "layers.0.mlp.weight", "lm_head.weight", "layers.1.o.weight"]
NORMAL_TOL = 1e-5
EDGE_KEYS = [(1, 1), (1, 0xFFFFFFFF), (16, 1 << 31)]  # key words Triton used to specialise
STEP_NAMES = ("environment", "stream", "perturb", "update", "virtual", "es", "large", "bench", "model")


@dataclass(frozen=True)
class Sizes:
    """How big each step's tensors are: full on a GPU, small under the interpreter."""

    shapes: tuple
    stream_cases: tuple  # (element offset, count); offsets past element 2^34 use the high counter word
    virtual_shapes: tuple  # (members, rows per member, in, out)
    large: int  # elements of the one huge tensor (0: skip)
    bench_elements: int
    bench_rounds: int
    thin: bool = False  # fewer keys, scales and modes (each edge case still once): the interpreter
    # The model step: a real model's config (fields overridden for the interpreter), population, prompts.
    model: tuple = ("Qwen2.5-0.5B", (), 32, 64)


FULL = Sizes(
    shapes=((1,), (7,), (33, 5), (4097,), (1000, 1031)),
    stream_cases=((0, 1), (0, 4097), (1028, 1 << 20), ((1 << 34) - 2048, 8192), (1 << 40, 3001)),
    virtual_shapes=((4, 1, 4096, 1024), (3, 17, 1000, 333), (2, 5, 37, 48)),
    large=(1 << 31) + 4099,
    bench_elements=1 << 28,
    bench_rounds=5,
)
SMALL = Sizes(
    shapes=((1,), (7,), (33, 5), (1029,)),
    stream_cases=((0, 1), (1028, 1100), ((1 << 34) - 8, 16)),
    virtual_shapes=((2, 1, 64, 48), (2, 3, 37, 33)),
    large=0,
    bench_elements=1 << 11,
    bench_rounds=1,
    thin=True,
    model=(
        "Qwen2.5-0.5B",
        (
            ("hidden_size", 32),
            ("intermediate_size", 64),
            ("num_attention_heads", 4),
            ("num_key_value_heads", 2),
            ("num_hidden_layers", 1),
            ("vocab_size", 64),
        ),
        2,
        2,
    ),
)


class Checks:
    """Collects named pass/fail results and prints each as it comes."""

    def __init__(self) -> None:
        self.results: list[dict] = []
        self.facts: dict = {}

    @property
    def failed(self) -> list[str]:
        return [r["name"] for r in self.results if not r["ok"]]

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        self.results.append({"name": name, "ok": bool(ok), "detail": detail})
        print(f"{'PASS' if ok else 'FAIL'}  {name}{'  ' + detail if detail else ''}", flush=True)

    def run(self, name: str, fn: Callable[[], tuple[bool, str]]) -> None:
        try:
            ok, detail = fn()
        except Exception as error:  # a crash is a failed check, and the others still run
            ok, detail = False, f"{type(error).__name__}: {error}"
        self.check(name, ok, detail)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ordered(t: torch.Tensor) -> torch.Tensor:
    """16-bit floats as integers in value order: one step is one ulp."""
    bits = t.view(torch.int16).to(torch.int32)
    return torch.where(bits < 0, -(bits & 0x7FFF), bits)


def compare(
    result: torch.Tensor, expected: torch.Tensor, magnitude: torch.Tensor | float
) -> tuple[bool, str]:
    """fp32: |diff| <= 1e-5 * magnitude; 16-bit: at most one ulp, and off by it in < 1% of elements."""
    result, expected = result.cpu(), expected.cpu()
    if result.dtype == torch.float32:
        diff = (result - expected).abs()
        bound = NORMAL_TOL * (magnitude if isinstance(magnitude, float) else magnitude.float().cpu())
        worst = float((diff / bound).max()) if diff.numel() else 0.0
        return bool((diff <= bound).all()), f"max diff {float(diff.max()):.2e} ({worst:.2f} of tolerance)"
    ulps = (ordered(result) - ordered(expected)).abs()
    share = float((ulps > 0).float().mean())
    return int(ulps.max()) <= 1 and share < 0.01, f"max {int(ulps.max())} ulp, {100 * share:.3f}% off by one"


def make_tensors(dtype: torch.dtype, seed: int, device: torch.device, shapes) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype).to(device) for s in shapes]


# ---------------------------------------------------------------------------------------------------
# Steps
# ---------------------------------------------------------------------------------------------------


def step_environment(c: Checks, device: torch.device, sizes: Sizes) -> None:
    import triton

    facts = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": triton.__version__,
        "device": str(device),
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
    }
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        facts.update(
            gpu=p.name,
            capability=f"{p.major}.{p.minor}",
            sms=p.multi_processor_count,
            memory_gib=round(p.total_memory / 2**30, 1),
        )
        try:
            smi = subprocess.run(
                [
                    "nvidia-smi",
                    "--query-gpu=driver_version,clocks.max.sm,power.limit",
                    "--format=csv,noheader",
                ],
                capture_output=True,
                text=True,
                timeout=20,
            )
            facts["nvidia_smi"] = smi.stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as error:
            facts["nvidia_smi"] = f"unavailable: {error}"
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            timeout=10,
        )
        facts["fastes_commit"] = commit.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        facts["fastes_commit"] = "unknown"
    c.facts.update(facts)
    for key, value in facts.items():
        print(f"{key}: {value}")
    c.check(
        "environment",
        True,
        f"{facts.get('gpu', 'cpu')}, torch {torch.__version__}, triton {triton.__version__}",
    )


def step_stream(c: Checks, device: torch.device, sizes: Sizes) -> None:
    from fastes.engine import kernels, noise

    keys = [noise.member_key(1234, 7, 5), *EDGE_KEYS, (0, 0), (0xFFFFFFFF, 0xFFFFFFFF)]
    ids = [1, 0xFFFFFFFF, noise.tensor_id("model.layers.0.mlp.up_proj.weight")]
    if sizes.thin:
        keys, ids = keys[:2], ids[:2]
    for key in keys:
        for tid in ids:
            for stream in (noise.STREAM_NOISE, noise.STREAM_ROUNDING):

                def bits(key=key, tid=tid, stream=stream) -> tuple[bool, str]:
                    mismatches = 0
                    for offset, n in sizes.stream_cases:
                        out = torch.full((n,), -1, dtype=torch.int64, device=device)
                        kernels.launch_fill(out, key, tid, offset, stream, True)
                        c0, c1, start, _ = noise._counter_words(n, offset, "cpu")
                        words = torch.stack(noise.philox4x32(c0, c1, tid, stream, key[0], key[1]), dim=1)
                        expected = words.reshape(-1)[offset - start : offset - start + n]
                        mismatches += int((out.cpu() != expected).sum())
                    return mismatches == 0, f"{mismatches} words differ"

                c.run(f"stream bits   key={key[0]:#x},{key[1]:#x} id={tid:#x} stream={stream}", bits)

            def normals(key=key, tid=tid) -> tuple[bool, str]:
                worst = 0.0
                for offset, n in sizes.stream_cases:
                    out = torch.empty(n, dtype=torch.float32, device=device)
                    kernels.launch_fill(out, key, tid, offset, noise.STREAM_NOISE, False)
                    ref = noise.normal(key, tid, n, offset=offset, device="cpu")
                    worst = max(worst, float(((out.cpu() - ref).abs() / ref.abs().clamp(min=1.0)).max()))
                return worst <= NORMAL_TOL, f"max relative diff {worst:.2e}"

            c.run(f"stream normal key={key[0]:#x},{key[1]:#x} id={tid:#x}", normals)


def step_perturb(c: Checks, device: torch.device, sizes: Sizes) -> None:
    from fastes.engine import noise, ops

    ids = [1, *(noise.tensor_id(n) for n in NAMES[1:])][: len(sizes.shapes)]
    for dtype in DTYPES:
        for key in [EDGE_KEYS[0]] if sizes.thin else [noise.member_key(31337, 3, 1), EDGE_KEYS[0]]:
            for scale in (0.05,) if sizes.thin else (0.05, -0.05):
                for in_place in (False, True):

                    def one(dtype=dtype, key=key, scale=scale, in_place=in_place) -> tuple[bool, str]:
                        src = make_tensors(dtype, 7, device, sizes.shapes)
                        before = [t.cpu().clone() for t in src]
                        expected = [torch.empty_like(t) for t in before]
                        ops.perturb_reference(before, expected, ids, key, scale)
                        got = src if in_place else [torch.empty_like(t) for t in src]
                        ops.perturb(src, got, ids, key, scale, backend="triton")
                        sync(device)
                        if not in_place and not all(torch.equal(a.cpu(), b) for a, b in zip(src, before)):
                            return False, "the sources were modified by an out-of-place perturb"
                        results = [
                            compare(r, e, t.float().abs() + abs(scale) * 6)
                            for r, e, t in zip(got, expected, before)
                        ]
                        return all(ok for ok, _ in results), "; ".join(d for _, d in results[-2:])

                    name = f"perturb {str(dtype)[6:]:8s} key={key[0]:#x} scale={scale:+} in_place={in_place}"
                    c.run(name, one)


def step_update(c: Checks, device: torch.device, sizes: Sizes) -> None:
    from fastes.engine import noise, ops

    ids = [1, *(noise.tensor_id(n) for n in NAMES[1:])][: len(sizes.shapes)]
    cases = [
        ("apply", [0.75, -1.25, 0.5], 0.02, 1.0, None),
        ("apply+decay", [1.0, -0.5], 0.03, 0.995, None),
        ("apply N=30", [((i * 7919) % 13 - 6) / 6 for i in range(15)], 0.01, 1.0, None),
        ("stochastic", [0.3, -0.9, 1.1, 0.2], 0.02, 1.0, noise.rounding_key(11, 4)),
        ("stochastic key 1", [0.3, -0.9], 0.02, 1.0, EDGE_KEYS[0]),
        ("gradient", [0.5, -1.5, 0.25], -0.04, 1.0, None),
    ]
    if sizes.thin:  # each mode once per dtype where it differs: stochastic 16-bit, gradient bf16
        cases = [cases[0], cases[4], cases[5]]
    for dtype in DTYPES:
        for mode, weights, coef, decay, rounding in cases:
            if sizes.thin and (
                mode.startswith("stochastic")
                and dtype == torch.float32
                or mode == "gradient"
                and dtype != torch.bfloat16
            ):
                continue

            def one(dtype=dtype, mode=mode, weights=weights, coef=coef, decay=decay, rounding=rounding):
                keys = [EDGE_KEYS[0], *(noise.member_key(5, 2, j) for j in range(1, len(weights)))]
                params = make_tensors(dtype, 3, device, sizes.shapes)
                reference = [t.cpu().clone() for t in params]
                theta = [t.clone() for t in reference]
                kwargs = dict(coef=coef, decay=decay, rounding_key=rounding)
                if mode == "gradient":
                    got = [torch.empty_like(t) for t in params]
                    expected = [torch.empty_like(t) for t in reference]
                    ops.es_update(params, ids, keys, weights, grads=got, backend="triton", **kwargs)
                    ops.es_update_reference(reference, ids, keys, weights, grads=expected, **kwargs)
                    if not all(torch.equal(a.cpu(), b) for a, b in zip(params, theta)):
                        return False, "gradient mode modified the parameters"
                else:
                    ops.es_update(params, ids, keys, weights, backend="triton", **kwargs)
                    ops.es_update_reference(reference, ids, keys, weights, **kwargs)
                    got, expected = params, reference
                sync(device)
                spread = abs(coef) * sum(abs(w) for w in weights) * 6
                results = [
                    compare(r, e, t.float().abs() * decay + spread) for r, e, t in zip(got, expected, theta)
                ]
                return all(ok for ok, _ in results), "; ".join(d for _, d in results[-2:])

            c.run(f"update  {str(dtype)[6:]:8s} {mode}", one)


def step_virtual(c: Checks, device: torch.device, sizes: Sizes) -> None:
    from fastes.engine import noise, ops
    from fastes.engine.kernels import launch_virtual_linear

    tolerance = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3}
    for dtype in DTYPES:
        for members, rows, n_in, n_out in sizes.virtual_shapes:
            for tid in (1,) if sizes.thin else (1, noise.tensor_id("model.layers.3.mlp.down_proj.weight")):

                def one(dtype=dtype, members=members, rows=rows, n_in=n_in, n_out=n_out, tid=tid):
                    g = torch.Generator().manual_seed(members * 100 + n_in)
                    x = torch.randn(members * rows, n_in, generator=g).to(dtype)
                    weight = (torch.randn(n_out, n_in, generator=g) / n_in**0.5).to(dtype)
                    keys = [EDGE_KEYS[0], *(noise.member_key(7, 1, m) for m in range(1, members))]
                    scales = [0.05 * (-1) ** m for m in range(members)]
                    y = torch.empty(members * rows, n_out, dtype=dtype, device=device)
                    launch_virtual_linear(
                        x.to(device),
                        weight.to(device),
                        y,
                        torch.tensor(keys, device=device),
                        torch.tensor(scales, device=device),
                        tid,
                        rows,
                        ops.triton_dtype(dtype),
                    )
                    sync(device)
                    expected = []
                    for m, (key, scale) in enumerate(zip(keys, scales)):
                        w = torch.empty_like(weight)
                        ops.perturb_reference([weight], [w], [tid], key, scale)
                        expected.append(x[m * rows : (m + 1) * rows].float() @ w.float().T)
                    expected = torch.cat(expected)
                    error = float(
                        (y.cpu().float() - expected).abs().max() / expected.abs().max().clamp(min=1.0)
                    )
                    return error <= tolerance[dtype], f"max error {error:.2e} of the largest output"

                c.run(
                    f"virtual {str(dtype)[6:]:8s} {members}x{rows} rows K={n_in} N={n_out} id={tid:#x}",
                    one,
                )


def step_es(c: Checks, device: torch.device, sizes: Sizes) -> None:
    import fastes

    def restore() -> tuple[bool, str]:
        params = [(n, t) for n, t in zip(NAMES, make_tensors(torch.bfloat16, 7, device, sizes.shapes))]
        before = [t.clone() for _, t in params]
        es = fastes.ES(params, sigma=1e-3, lr=5e-4, population=8, seed=3, checksum_every=0)
        for _ in range(3):
            for member in es.members():
                with member:
                    pass
        exact = all(torch.equal(a, t) for a, (_, t) in zip(before, params))
        return exact, "weights bit-identical after 24 member enter/exit cycles"

    def step_matches_cpu() -> tuple[bool, str]:
        gpu = [(n, t) for n, t in zip(NAMES, make_tensors(torch.bfloat16, 8, device, sizes.shapes))]
        cpu = [(n, t.cpu().clone()) for n, t in gpu]
        rewards = torch.linspace(-1, 1, 8, dtype=torch.float64)
        fastes.ES(gpu, sigma=1e-2, lr=1e-2, population=8, seed=5, checksum_every=0, backend="triton").step(
            rewards
        )
        fastes.ES(cpu, sigma=1e-2, lr=1e-2, population=8, seed=5, checksum_every=0, backend="torch").step(
            rewards
        )
        results = [compare(g, h, 1.0) for (_, g), (_, h) in zip(gpu, cpu)]
        return all(ok for ok, _ in results), "ES.step with the kernels vs the torch reference: " + results[
            -1
        ][1]

    c.run("ES exact restore (bf16)", restore)
    c.run("ES.step kernels vs reference", step_matches_cpu)


def step_large(c: Checks, device: torch.device, sizes: Sizes) -> None:
    """One tensor past 2^31 elements: 64-bit offsets in the kernels (about 13 GB of GPU memory)."""
    from fastes.engine import noise, ops

    def large() -> tuple[bool, str]:
        n = sizes.large
        if n == 0 or device.type != "cuda":
            return True, "skipped: only with full sizes on a GPU"
        free, _ = torch.cuda.mem_get_info(device)
        if free < 6 * n * 2:
            return True, f"skipped: needs {6 * n * 2 / 2**30:.0f} GiB free, {free / 2**30:.0f} GiB are"
        key, tid = noise.member_key(9, 9, 9), noise.tensor_id("huge")
        src = torch.zeros(n, dtype=torch.bfloat16, device=device)
        got = torch.empty_like(src)
        ops.perturb([src], [got], [tid], key, 1.0, backend="triton")
        ok, details = True, []
        for start in ((1 << 31) - 512, n - (1 << 20)):  # where 32-bit offsets would wrap, and the end
            expected = noise.normal(key, tid, min(1 << 20, n - start), offset=start, device=device)
            good, detail = compare(got[start : start + expected.numel()], expected.to(torch.bfloat16), 1.0)
            ok &= good
            details.append(detail)
        del src, got
        torch.cuda.empty_cache()
        return ok, "; ".join(details)

    c.run("perturb bf16 tensor past 2^31 elements", large)


def step_bench(c: Checks, device: torch.device, sizes: Sizes) -> None:
    """Kernel throughput against a copy of the same bytes and against the naive N-pass update."""
    for dtype in (torch.bfloat16, torch.float32):
        _bench_dtype(c, device, dtype, sizes.bench_elements, sizes.bench_rounds, 2 if sizes.thin else 15)


def _seconds(fn: Callable[[], object], device: torch.device, rounds: int) -> float:
    """Best of `rounds` timed calls after one warm-up call (which may compile)."""
    fn()
    sync(device)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def _bench_dtype(
    c: Checks, device: torch.device, dtype: torch.dtype, n: int, rounds: int, directions: int
) -> None:
    from benchmarks.naive import naive_update
    from fastes.engine import noise, ops

    name = str(dtype)[6:]
    src = torch.randn(n, device=device).to(dtype)
    dst = torch.empty_like(src)
    tid, key = noise.tensor_id("bench"), noise.member_key(0, 0, 0)
    perturb = _seconds(lambda: ops.perturb([src], [dst], [tid], key, 1e-3, backend="triton"), device, rounds)
    copy = _seconds(lambda: dst.copy_(src), device, rounds)
    gbytes = 2 * n * src.element_size() / 1e9
    c.facts[f"perturb_{name}"] = {
        "elements": n,
        "perturb_s": perturb,
        "copy_s": copy,
        "perturb_gb_s": gbytes / perturb,
        "copy_gb_s": gbytes / copy,
    }
    c.check(
        f"bench perturb {name}",
        True,
        f"{gbytes / perturb:.0f} GB/s = {copy / perturb:.0%} of a copy ({gbytes / copy:.0f} GB/s)",
    )
    keys = [noise.member_key(0, 0, j) for j in range(directions)]
    weights = [((j * 7) % 5 - 2) / 2 for j in range(directions)]
    fused = _seconds(
        lambda: ops.es_update([dst], [tid], keys, weights, coef=1e-6, backend="triton"), device, rounds
    )
    naive = _seconds(lambda: naive_update([dst], list(range(directions)), weights, 1e-6), device, rounds)
    c.facts[f"update_{name}"] = {"directions": directions, "fused_s": fused, "naive_s": naive}
    c.check(
        f"bench update {name} N={2 * directions}",
        True,
        f"fused {1e3 * fused:.2f} ms vs naive {1e3 * naive:.2f} ms: {naive / fused:.1f}x; "
        f"{n * directions / fused / 1e9:.2f} G normals/s",
    )


def step_model(c: Checks, device: torch.device, sizes: Sizes) -> None:
    """One ES iteration of a real model's shape (random weights, bf16): the noise work of materialised,
    virtual and low-rank evaluation (one decode step of every member's prompts) and the update, measured
    against benchmarks.model_iteration's prediction; virtual logits against materialised ones."""
    from transformers import AutoModelForCausalLM

    import fastes
    from benchmarks import aot
    from benchmarks import model_iteration as predicted
    from benchmarks.model_iteration import DEVICES
    from fastes.es.population import population_batched

    name, overrides, population, prompts = sizes.model
    config = aot.model_config(name)
    config.update(dict(overrides))
    torch.manual_seed(0)
    with torch.device(device):  # random weights initialised where they live
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    shape = predicted.shape_of(model, name)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    predicted_for = "H200 SXM" if "H200" in gpu else "H100 SXM"  # the GPUs the model knows
    rate = _predicted_rates()[predicted_for]
    spec = next(d for d in DEVICES if d.name == predicted_for)
    ids = torch.randint(0, config.vocab_size, (population * prompts, 1), device=device)
    rewards = torch.linspace(-1, 1, population)

    def forward() -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=ids, use_cache=False).logits

    plain = _seconds(forward, device, sizes.bench_rounds)
    logits = {"plain": forward().float().cpu()}
    measured, optimizers = {}, {}
    for mode, noise_type in (("materialised", "full"), ("virtual", "full"), ("lowrank", "lowrank")):
        es = optimizers[mode] = fastes.ES(
            fastes.linear_weights(model, warn=False),
            sigma=0.05,  # large enough that wrong or missing noise shows in the logits
            lr=1e-4,
            population=population,
            noise_type=noise_type,
            backend="triton",
            checksum_every=0,
        )
        members = list(es.members())
        with population_batched(es, model, mode, members):  # compiles the kernels: not timed
            pass
        sync(device)
        start = time.perf_counter()
        with population_batched(es, model, mode, members):
            sync(device)
            build = time.perf_counter() - start
            seconds = _seconds(forward, device, sizes.bench_rounds)
            if mode != "lowrank":  # low-rank logits are compared in fp32 (_lowrank_in_float32)
                logits[mode] = forward().float().cpu()
        measured[mode] = {"build_s": build, "forward_s": seconds}
    # The updates last: they change the weights the evaluations above share.
    for mode, es in optimizers.items():
        es.step(rewards)  # compiles the update: not timed
        sync(device)
        start = time.perf_counter()
        es.step(rewards)
        sync(device)
        measured[mode]["update_s"] = time.perf_counter() - start
    _lowrank_in_float32(model, forward, logits, population)
    m = measured
    noise = {
        "materialised": m["materialised"]["build_s"] + m["materialised"]["update_s"],
        "virtual": m["virtual"]["forward_s"] - m["materialised"]["forward_s"] + m["virtual"]["update_s"],
        "lowrank": m["lowrank"]["build_s"] + m["lowrank"]["forward_s"] - plain + m["lowrank"]["update_s"],
    }
    rows = population * prompts
    expected = {
        "materialised": predicted.perturb_seconds(shape, rate, population)
        + predicted.update_seconds(shape, rate),
        "virtual": predicted.virtual_noise_seconds(shape, spec, rate, population, prompts)
        + predicted.update_seconds(shape, rate),
        "lowrank": predicted.lowrank_noise_seconds(shape, spec, rate, population, rows)
        + predicted.lowrank_update_seconds(shape, spec, rate, population // 2),
    }
    c.facts["model"] = {
        "name": name,
        "overrides": dict(overrides),
        "shape": asdict(shape),
        "population": population,
        "prompts": prompts,
        "plain_forward_s": plain,
        "lowrank_forward_over_plain": measured["lowrank"]["forward_s"] / plain,
        "measured": measured,
        "noise_s": noise,
        "predicted_noise_s": expected,
        "predicted_for": predicted_for,
    }

    def gap(a: str, b: str) -> float:
        return float((logits[a] - logits[b]).abs().max() / logits[b].abs().max())

    for mode, reference, plain_logits in (
        ("virtual", "materialised", "plain"),
        ("lowrank", "lowrank materialised", "plain fp32"),
    ):
        error, noise_effect = gap(mode, reference), gap(plain_logits, reference)
        c.check(
            f"model {mode} logits vs {reference}",
            error <= 2e-2 and error < noise_effect / 4,
            f"max error {error:.2e} of the largest logit (the noise itself moves them {noise_effect:.2e})",
        )
    for mode in noise:
        ratio = noise[mode] / expected[mode] if expected[mode] > 0 else math.inf
        detail = (
            f"noise work {1e3 * noise[mode]:.2f} ms measured, {1e3 * expected[mode]:.2f} ms predicted for "
            f"{predicted_for} ({ratio:.2f}x)"
        )
        if device.type != "cuda" or mode == "lowrank":
            # The interpreter's timings say nothing of a GPU's, and low-rank noise is a few hundred small
            # launches whose latency the model leaves out: recorded, not judged.
            c.check(f"model {mode} noise time (recorded)", math.isfinite(noise[mode]), detail)
        else:
            c.check(f"model {mode} noise time within 3x of the prediction", 1 / 3 <= ratio <= 3, detail)


def _lowrank_in_float32(model: torch.nn.Module, forward: Callable, logits: dict, population: int) -> None:
    """Low-rank logits against the same members' weights materialised, with the model in fp32 (last:
    it converts the model). In bf16 the two round differently (the factored term vs the perturbed
    weights), and at sigma 0.05 on random weights such rounding grows through the layers to the size
    of the noise's own effect (measured on Qwen2.5-0.5B's shape on CPU: 0.30 of the largest logit after
    4 layers, 0.96 after 24, against 1e-4 in fp32), so only fp32 can tell a wrong forward."""
    import fastes
    from fastes.es.population import population_batched

    model.float()
    es = fastes.ES(
        fastes.linear_weights(model, warn=False),
        sigma=0.05,
        lr=1e-4,
        population=population,
        noise_type="lowrank",
        backend="triton",
        checksum_every=0,
    )
    logits["plain fp32"] = forward().float().cpu()
    for mode, name in (("lowrank", "lowrank"), ("materialised", "lowrank materialised")):
        with population_batched(es, model, mode):
            logits[name] = forward().float().cpu()


def _predicted_rates() -> dict:
    """The noise kernels' predicted rates per GPU, from a process without the interpreter (they come from
    SASS compiled for sm_90, which the interpreter cannot do)."""
    from benchmarks.model_iteration import NoiseRates

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rates.json"
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        done = subprocess.run(
            [sys.executable, "-m", "benchmarks.static", "--rates", str(path)],
            cwd=Path(__file__).resolve().parents[1],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode != 0:
            raise RuntimeError(f"python -m benchmarks.static failed:\n{done.stderr[-2000:]}")
        return {name: NoiseRates(**r) for name, r in json.loads(path.read_text()).items()}


STEPS: dict[str, Callable[[Checks, torch.device, Sizes], None]] = {
    "environment": step_environment,
    "stream": step_stream,
    "perturb": step_perturb,
    "update": step_update,
    "virtual": step_virtual,
    "es": step_es,
    "large": step_large,
    "bench": step_bench,
    "model": step_model,
}


# ---------------------------------------------------------------------------------------------------
# Running steps and recording them
# ---------------------------------------------------------------------------------------------------


class _Tee(io.TextIOBase):
    """Writes to several streams at once (the console and a step's log file)."""

    def __init__(self, *streams) -> None:
        self.streams = streams

    def write(self, text: str) -> int:
        for s in self.streams:
            s.write(text)
            s.flush()
        return len(text)


def run_step(name: str, out: Path, device: torch.device, sizes: Sizes) -> dict:
    """Run one step; whatever happens, write out/<name>.log, out/<name>.json and update the summary."""
    c = Checks()
    start = time.perf_counter()
    error = ""
    with open(out / f"{name}.log", "w") as log, contextlib.redirect_stdout(_Tee(sys.stdout, log)):
        print(f"== {name} ==", flush=True)
        try:
            STEPS[name](c, device, sizes)
        except Exception:  # the step's own crash: recorded, and the next step still runs
            error = traceback.format_exc()
            print(error, flush=True)
    record = {
        "step": name,
        "passed": not error and not c.failed,
        "failed": c.failed + ([f"{name} crashed"] if error else []),
        "error": error,
        "checks": c.results,
        "facts": c.facts,
        "seconds": round(time.perf_counter() - start, 2),
    }
    (out / f"{name}.json").write_text(json.dumps(record, indent=1))
    record_in_summary(out, record)
    return record


def record_in_summary(out: Path, record: dict) -> None:
    """Add a step's outcome to out/summary.json (written atomically: a crash never leaves half a file)."""
    path = out / "summary.json"
    summary = json.loads(path.read_text()) if path.exists() else {"steps": {}}
    summary["steps"][record["step"]] = {k: record[k] for k in ("passed", "failed", "seconds")}
    summary["passed"] = all(s["passed"] for s in summary["steps"].values())
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(summary, indent=1))
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_check", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for the logs and JSON files")
    parser.add_argument(
        "--steps", default=",".join(STEP_NAMES), help=f"comma-separated, of {list(STEP_NAMES)}"
    )
    parser.add_argument("--device", default="cuda", help="cuda (compiled kernels) or cpu (the interpreter)")
    parser.add_argument("--small", action="store_true", help="small sizes (the interpreter, tests)")
    args = parser.parse_args(argv)
    steps = [s for s in args.steps.split(",") if s]
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        parser.error(f"unknown steps {unknown}; choose from {list(STEP_NAMES)}")
    device = torch.device(args.device)
    if device.type == "cuda":
        if "triton" not in sys.modules:  # compiled kernels, whatever the calling shell set
            os.environ.pop("TRITON_INTERPRET", None)
        if not torch.cuda.is_available():
            print(
                "gpu_check: no CUDA device visible to torch (torch.cuda.is_available() is False); run it "
                "on a machine with an NVIDIA GPU and a CUDA build of torch, or use --device cpu",
                file=sys.stderr,
            )
            return 2
    elif os.environ.get("TRITON_INTERPRET") != "1":
        print("gpu_check: --device cpu needs the Triton interpreter: set TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    sizes = SMALL if args.small else FULL
    records = [run_step(name, args.out, device, sizes) for name in steps]
    failed = [f for r in records for f in r["failed"]]
    print(
        f"\n{len(failed)} failed of {sum(len(r['checks']) for r in records)} checks in {len(records)} steps"
        + "".join(f"\n  {f}" for f in failed)
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
