"""Run the suites on one device and write the result files (the body of `python -m benchmarks`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common import Context, device_slug, environment, load_average, resolve_device
from benchmarks.report import evaluate_targets, write_results
from benchmarks.suites import run_suites


def run(
    *,
    quick: bool = False,
    out: Path | str | None = None,
    device: str = "auto",
    dtype: str | None = None,
    threads: int | None = None,
    suites: list[str] | None = None,
    notes: list[str] | None = None,
    backend: str = "auto",
    log: Callable[[str], None] = print,
) -> tuple[dict, dict[str, Path]]:
    """Run the suites; returns the result data and the files written to `out` (none when out is None)."""
    torch_device = resolve_device(device)
    if dtype is None:  # bf16 is how LLMs are post-trained on GPUs; CPUs have no fast bf16 arithmetic
        torch_dtype = torch.bfloat16 if torch_device.type == "cuda" else torch.float32
    else:
        torch_dtype = getattr(torch, dtype)
    previous_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        ctx = Context(torch_device, quick, torch_dtype, backend=backend, threads=threads, log=log)
        load_at_start = load_average()  # before the suites: what else was running, not the suites' own load
        start = time.perf_counter()
        results = run_suites(ctx, suites)
        data = {
            "environment": {**environment(ctx, load_at_start), "seconds": time.perf_counter() - start},
            "results": results,
            "targets": evaluate_targets(results, ctx.kind),
            "notes": list(notes or []),
        }
    finally:
        torch.set_num_threads(previous_threads)
    paths = write_results(data, Path(out), device_slug(torch_device)) if out is not None else {}
    return data, paths
