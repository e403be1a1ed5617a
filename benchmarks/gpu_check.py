"""The compiled Triton kernels vs the torch reference, on the same CUDA tensors (scripts/gpu_check.sh).

    python -m benchmarks.gpu_check [--skip-large]

The test suite runs the kernels under the Triton interpreter on CPU; this is the same comparison with
the kernels compiled for the GPU. Contract (docs/noise.md): raw Philox words bit-identical; normals within
1e-5; perturb and update results within float tolerance (fp32) or one ulp in under 1% of elements
(16-bit, where a ~1e-7 difference in a normal can flip a rounding); restore bit-exact. Exit status 0 when
every check passes, 1 when one fails, 2 when there is no CUDA device.
"""

from __future__ import annotations

import os

# Compiled kernels and automatic dispatch, whatever the calling shell set; before triton is imported.
os.environ.pop("TRITON_INTERPRET", None)
os.environ.pop("FASTES_BACKEND", None)

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402

import torch  # noqa: E402

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SHAPES = [(1,), (7,), (33, 5), (4097,), (1000, 1031)]
NAMES = ["emb", "layers.0.q.weight", "layers.0.mlp.weight", "lm_head.weight", "layers.1.o.weight"]
NORMAL_TOL = 1e-5
# (element offset, count) of the stream checks; offsets crossing the 2^32-block boundary (element 2^34)
# exercise the high counter word.
STREAM_CASES = [(0, 1), (0, 4097), (1028, 1 << 20), ((1 << 34) - 2048, 8192), (1 << 40, 3001)]


class Checks:
    """Collects named pass/fail results and prints each as it comes."""

    def __init__(self) -> None:
        self.failed: list[str] = []
        self.count = 0

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        self.count += 1
        print(f"{'PASS' if ok else 'FAIL'}  {name}{'  ' + detail if detail else ''}", flush=True)
        if not ok:
            self.failed.append(name)

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
    if result.dtype == torch.float32:
        diff = (result - expected).abs()
        bound = NORMAL_TOL * (magnitude if isinstance(magnitude, float) else magnitude.float())
        worst = float((diff / bound).max()) if diff.numel() else 0.0
        return bool((diff <= bound).all()), f"max diff {float(diff.max()):.2e} ({worst:.2f} of tolerance)"
    ulps = (ordered(result) - ordered(expected)).abs()
    share = float((ulps > 0).float().mean())
    return int(ulps.max()) <= 1 and share < 0.01, f"max {int(ulps.max())} ulp, {100 * share:.3f}% off by one"


def make_tensors(dtype: torch.dtype, seed: int, device: torch.device, shapes=SHAPES) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype).to(device) for s in shapes]


# ---------------------------------------------------------------------------------------------------


def check_stream(c: Checks, device: torch.device) -> None:
    from fastes import kernels, noise

    keys = [noise.member_key(0, 0, 0), noise.member_key(1234, 7, 5), (0, 0), (0xFFFFFFFF, 0xFFFFFFFF)]
    ids = [0, noise.tensor_id("model.layers.0.mlp.up_proj.weight"), 0xFFFFFFFF]
    cases = STREAM_CASES
    for key in keys:
        for tid in ids:
            for offset, n in cases:
                name = f"fill bits   key={key[0]:#x},{key[1]:#x} id={tid:#x} offset={offset} n={n}"

                def bits(key=key, tid=tid, offset=offset, n=n) -> tuple[bool, str]:
                    out = torch.full((n,), -1, dtype=torch.int64, device=device)
                    kernels.launch_fill(out, key, tid, offset, noise.STREAM_NOISE, True)
                    c0, c1, start, _ = noise._counter_words(n, offset, device)
                    words = noise.philox4x32(c0, c1, tid, noise.STREAM_NOISE, key[0], key[1])
                    expected = torch.stack(words, dim=1).reshape(-1)[offset - start : offset - start + n]
                    cpu = torch.stack(
                        noise.philox4x32(c0.cpu(), c1.cpu(), tid, noise.STREAM_NOISE, key[0], key[1]), dim=1
                    ).reshape(-1)[offset - start : offset - start + n]
                    mismatches = int((out != expected).sum())
                    ref_agree = torch.equal(expected.cpu(), cpu)
                    return (
                        mismatches == 0 and ref_agree,
                        f"{mismatches} words differ; cpu ref agrees: {ref_agree}",
                    )

                c.run(name, bits)
            name = f"fill normal key={key[0]:#x},{key[1]:#x} id={tid:#x}"

            def normals(key=key, tid=tid) -> tuple[bool, str]:
                worst = 0.0
                for offset, n in cases:
                    out = torch.empty(n, dtype=torch.float32, device=device)
                    kernels.launch_fill(out, key, tid, offset, noise.STREAM_NOISE, False)
                    ref = noise.normal(key, tid, n, offset=offset, device=device)
                    ref_cpu = noise.normal(key, tid, n, offset=offset, device="cpu")
                    scale = ref.abs().clamp(min=1.0)
                    worst = max(worst, float(((out - ref).abs() / scale).max()))
                    worst = max(worst, float(((ref.cpu() - ref_cpu).abs() / scale.cpu()).max()))
                return worst <= NORMAL_TOL, f"max relative diff {worst:.2e} (kernel and cpu reference)"

            c.run(name, normals)


def check_perturb(c: Checks, device: torch.device) -> None:
    from fastes import noise, ops

    ids = [noise.tensor_id(n) for n in NAMES]
    for dtype in DTYPES:
        for seed in (0, 31337):
            for sign in (1, -1):
                for in_place in (False, True):
                    key = noise.member_key(seed, 3, 1)
                    scale = sign * 0.05
                    label = f"perturb {str(dtype)[6:]:8s} seed={seed} sign={sign:+d} in_place={in_place}"

                    def one(
                        dtype=dtype, seed=seed, key=key, scale=scale, in_place=in_place
                    ) -> tuple[bool, str]:
                        src = make_tensors(dtype, seed, device)
                        before = [t.clone() for t in src]
                        expected = [torch.empty_like(t) for t in src]
                        ops.perturb_reference(before, expected, ids, key, scale)
                        if in_place:
                            ops.perturb(src, src, ids, key, scale, backend="triton")
                            got = src
                        else:
                            got = [torch.empty_like(t) for t in src]
                            ops.perturb(src, got, ids, key, scale, backend="triton")
                            if not all(torch.equal(a, b) for a, b in zip(src, before)):
                                return False, "the sources were modified by an out-of-place perturb"
                        sync(device)
                        details, ok = [], True
                        for r, e, theta in zip(got, expected, before):
                            good, detail = compare(r, e, theta.float().abs() + abs(scale) * 6)
                            ok &= good
                            details.append(detail)
                        return ok, "; ".join(details[-2:])

                    c.run(label, one)


def check_update(c: Checks, device: torch.device) -> None:
    from fastes import noise, ops

    ids = [noise.tensor_id(n) for n in NAMES]
    cases = [
        ("apply", 0, 0, [0.75, -1.25, 0.5], 0.02, 1.0),
        ("apply+decay", 977, 12, [1.0, -0.5], 0.03, 0.995),
        ("apply N=30", 5, 1, [((i * 7919) % 13 - 6) / 6 for i in range(30)], 0.01, 1.0),
        ("stochastic", 11, 4, [0.3, -0.9, 1.1, 0.2], 0.02, 1.0),
        ("gradient", 21, 2, [0.5, -1.5, 0.25], -0.04, 1.0),
    ]
    for dtype in DTYPES:
        for mode, seed, generation, weights, coef, decay in cases:
            label = f"update  {str(dtype)[6:]:8s} {mode}"

            def one(
                dtype=dtype,
                mode=mode,
                seed=seed,
                generation=generation,
                weights=weights,
                coef=coef,
                decay=decay,
            ) -> tuple[bool, str]:
                keys = [noise.member_key(seed, generation, j) for j in range(len(weights))]
                rounding = noise.rounding_key(seed, generation) if mode == "stochastic" else None
                params = make_tensors(dtype, seed, device)
                reference = [t.clone() for t in params]
                theta = [t.clone() for t in params]
                kwargs = dict(coef=coef, decay=decay, rounding_key=rounding)
                if mode == "gradient":
                    got = [torch.empty_like(t) for t in params]
                    expected = [torch.empty_like(t) for t in params]
                    ops.es_update(params, ids, keys, weights, grads=got, backend="triton", **kwargs)
                    ops.es_update_reference(reference, ids, keys, weights, grads=expected, **kwargs)
                    if not all(torch.equal(a, b) for a, b in zip(params, theta)):
                        return False, "gradient mode modified the parameters"
                else:
                    ops.es_update(params, ids, keys, weights, backend="triton", **kwargs)
                    ops.es_update_reference(reference, ids, keys, weights, **kwargs)
                    got, expected = params, reference
                sync(device)
                spread = abs(coef) * sum(abs(w) for w in weights) * 6
                ok, details = True, []
                for r, e, t in zip(got, expected, theta):
                    good, detail = compare(r, e, t.float().abs() * decay + spread)
                    ok &= good
                    details.append(detail)
                return ok, "; ".join(details[-2:])

            c.run(label, one)


def check_es(c: Checks, device: torch.device) -> None:
    import fastes

    def restore() -> tuple[bool, str]:
        params = [(n, t) for n, t in zip(NAMES, make_tensors(torch.bfloat16, 7, device))]
        before = [t.clone() for _, t in params]
        es = fastes.ES(params, sigma=1e-3, lr=5e-4, population=8, seed=3, checksum_every=0)
        for _ in range(25):
            for member in es.members():
                with member:
                    pass
        exact = all(torch.equal(a, t) for a, (_, t) in zip(before, params))
        return exact, "weights bit-identical after 200 member enter/exit cycles"

    def step_matches_cpu() -> tuple[bool, str]:
        gpu = [(n, t) for n, t in zip(NAMES, make_tensors(torch.bfloat16, 8, device))]
        cpu = [(n, t.cpu().clone()) for n, t in gpu]
        rewards = torch.linspace(-1, 1, 8, dtype=torch.float64)
        for params in (gpu, cpu):
            es = fastes.ES(params, sigma=1e-2, lr=1e-2, population=8, seed=5, checksum_every=0)
            es.step(rewards)
        ok, details = True, []
        for (_, g), (_, h) in zip(gpu, cpu):
            good, detail = compare(g.cpu(), h, 1.0)
            ok &= good
            details.append(detail)
        return ok, "ES.step on CUDA (kernels) vs CPU (reference): " + details[-1]

    c.run("ES exact restore (bf16, cuda)", restore)
    c.run("ES.step cuda vs cpu", step_matches_cpu)


def check_large(c: Checks, device: torch.device) -> None:
    """One tensor past 2^31 elements: 64-bit offsets in the kernels (about 13 GB of GPU memory)."""
    from fastes import noise, ops

    def large() -> tuple[bool, str]:
        n = (1 << 31) + 4099
        free, _ = torch.cuda.mem_get_info(device)
        if free < 6 * n * 2:
            return True, f"skipped: needs {6 * n * 2 / 2**30:.0f} GiB free, {free / 2**30:.0f} GiB are"
        key, tid = noise.member_key(9, 9, 9), noise.tensor_id("huge")
        src = torch.zeros(n, dtype=torch.bfloat16, device=device)
        got = torch.empty_like(src)
        ops.perturb([src], [got], [tid], key, 1.0, backend="triton")
        ok, detail = True, ""
        # The reference on the last 2^20 elements and around 2^31: where 32-bit offsets would wrap.
        for start in ((1 << 31) - 512, n - (1 << 20)):
            expected = noise.normal(key, tid, min(1 << 20, n - start), offset=start, device=device)
            good, detail = compare(got[start : start + expected.numel()], expected.to(torch.bfloat16), 1.0)
            ok &= good
        del src, got
        torch.cuda.empty_cache()
        return ok, detail

    c.run("perturb bf16 tensor of 2^31 + 4099 elements", large)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__)
    parser.add_argument("--skip-large", action="store_true", help="skip the 2^31-element tensor check")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        message = (
            "gpu_check: no CUDA device visible to torch (torch.cuda.is_available() is False); "
            "run this on a machine with an NVIDIA GPU and a CUDA build of torch"
        )
        print(message, file=sys.stderr)
        return 2
    import triton

    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    print(f"gpu_check on {name}: torch {torch.__version__}, triton {triton.__version__}")
    start = time.perf_counter()
    c = Checks()
    check_stream(c, device)
    check_perturb(c, device)
    check_update(c, device)
    check_es(c, device)
    if not args.skip_large:
        check_large(c, device)
    seconds = time.perf_counter() - start
    if c.failed:
        print(f"\n{len(c.failed)} of {c.count} checks FAILED in {seconds:.0f} s:", *c.failed, sep="\n  ")
        return 1
    print(f"\nall {c.count} checks passed in {seconds:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
