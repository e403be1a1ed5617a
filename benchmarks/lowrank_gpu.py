"""Ways to add the low-rank population term to a projection on a GPU, timed against the plain GEMM.

    python -m benchmarks.lowrank_gpu [--out DIR]

For each projection shape of Qwen2.5-1.5B (hidden 1536, MLP 8960, 2 KV heads of 128) and a decode step
of 32 members x 64 prompts (2048 rows), bf16, CUDA events over repeated calls:
- plain: y = x W^T (cuBLAS);
- unfused (fastes.es.population.LowRankLinear's torch fallback): plain, then per row the dot product
  with its member's input factor and an addcmul of its output factor into y;
- fused (LowRankLinear on the Triton backend): one Triton GEMM with the term in its epilogue
  (fastes/engine/kernels/lowrank_linear.py), y written once;
- one GEMM: the rank-r term as extra inner columns, y = [x | P] [W | A_stack]^T, where P holds each
  row's x . b_m in its member's column (zeros elsewhere): cuBLAS writes y once; building [x | P] and P
  is counted, the extended weight [W | A_stack] is built once per generation and not counted.
Measured, not asserted. Writes DIR/lowrank-gpu-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch

SHAPES = {"q/o": (1536, 1536), "k/v": (256, 1536), "gate/up": (8960, 1536), "down": (1536, 8960)}


def timed(fn, rounds: int = 50) -> float:
    """Median milliseconds of `fn` over `rounds` calls (CUDA events), after 5 warm-up calls."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def measure(out_features: int, in_features: int, members: int, rows: int) -> dict:
    import triton.language as tl

    from fastes.engine.kernels import launch_lowrank_linear

    device, dtype = torch.device("cuda"), torch.bfloat16
    x = torch.randn(members * rows, in_features, device=device, dtype=dtype)
    w = torch.randn(out_features, in_features, device=device, dtype=dtype) * 0.02
    b = torch.randn(members, 1, in_features, device=device, dtype=dtype)
    a = torch.randn(members, 1, out_features, device=device, dtype=dtype) * 1e-3
    w_ext = torch.cat([w, a[:, 0].T], dim=1).contiguous()  # [out, in + members]
    owner = torch.arange(members * rows, device=device) // rows

    def plain():
        return x @ w.T

    def unfused():
        y = x @ w.T
        grouped = x.view(members, rows, in_features)
        projected = (grouped * b).sum(-1, keepdim=True)
        y.view(members, rows, out_features).addcmul_(projected, a)
        return y

    def fused():
        y = torch.empty(members * rows, out_features, device=device, dtype=dtype)
        launch_lowrank_linear(x, w, None, b, a, y, tl.bfloat16)
        return y

    def one_gemm():
        projected = (x.view(members, rows, in_features) * b).sum(-1).reshape(-1)  # [rows]: x . b_m
        extended = torch.zeros(members * rows, in_features + members, device=device, dtype=dtype)
        extended[:, :in_features] = x
        extended[torch.arange(members * rows, device=device), in_features + owner] = projected
        return extended @ w_ext.T

    reference = unfused().float()

    def error(fn) -> float:
        return float((fn().float() - reference).abs().max() / reference.abs().max())

    ways = {"plain": plain, "unfused": unfused, "fused": fused, "one_gemm": one_gemm}
    ms = {name: timed(fn) for name, fn in ways.items()}
    return {
        **ms,
        "unfused_over_plain": ms["unfused"] / ms["plain"],
        "fused_over_plain": ms["fused"] / ms["plain"],
        "one_gemm_over_plain": ms["one_gemm"] / ms["plain"],
        "fused_error": error(fused),
        "one_gemm_error": error(one_gemm),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.lowrank_gpu", description=__doc__)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("lowrank_gpu: needs a CUDA device")
        return 2
    results = {name: measure(o, i, 32, 64) for name, (o, i) in SHAPES.items()}
    report = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "rows": "32 members x 64 prompts, decode",
        "results": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"lowrank-gpu-{report['date']}.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
