"""fastes benchmarks: suites that time fastes against the naive ES pattern and the hardware limit.

    python -m benchmarks [--quick] [--out benchmarks/results]   # all suites, writes JSON/markdown/plot
    python -m pytest benchmarks                                   # the same calls under pytest-benchmark
    bash scripts/gpu_check.sh                                     # CUDA: kernels vs reference, then all

Suites: noise generation, perturb + restore, the update vs population size, a whole ES iteration and
peak memory. Every figure comes with its ratio to a baseline measured in the same run.
"""

from __future__ import annotations

from typing import Any


def run(**options: Any) -> tuple[dict, dict]:
    """Run the suites and write the result files; see benchmarks.runner.run for the options."""
    # Imported on use: `python -m benchmarks.gpu_check` must control the Triton environment before
    # anything (transformers included) imports triton.
    from benchmarks.runner import run as run_suites

    return run_suites(**options)


__all__ = ["run"]
