"""pytest-benchmark setup: `python -m pytest benchmarks [--bench-models tiny,synthetic-25m]`.

The suites time the same calls as `python -m benchmarks` (see benchmarks/suites.py); pytest-benchmark
groups fastes with its baselines, so each group's table shows their ratio. Don't collect these together
with tests/: its conftest turns on the Triton interpreter, which would make CUDA kernels crawl.
"""

from __future__ import annotations

import os

import pytest
import torch

from benchmarks.common import MODEL_NAMES, load_bench_model, resolve_device


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fastes benchmarks")
    group.addoption("--bench-models", default="tiny", help=f"comma-separated subset of {MODEL_NAMES}")
    group.addoption("--bench-device", default="auto", help="auto (CUDA when present), cpu or cuda[:i]")
    group.addoption("--bench-dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    group.addoption("--bench-threads", type=int, default=None, help="torch CPU threads (default: torch's)")


@pytest.fixture(scope="session", autouse=True)
def threads(request: pytest.FixtureRequest):
    n = request.config.getoption("--bench-threads")
    previous = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    yield torch.get_num_threads()
    torch.set_num_threads(previous)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "model_name" in metafunc.fixturenames:
        names = [n for n in metafunc.config.getoption("--bench-models").split(",") if n]
        metafunc.parametrize("model_name", names, scope="session")


@pytest.fixture(scope="session")
def device(request: pytest.FixtureRequest) -> torch.device:
    device = resolve_device(request.config.getoption("--bench-device"))
    if device.type == "cuda" and os.environ.get("TRITON_INTERPRET") == "1":
        pytest.exit("TRITON_INTERPRET=1 would interpret the CUDA kernels; unset it to benchmark", 2)
    return device


@pytest.fixture(scope="session")
def dtype(request: pytest.FixtureRequest, device: torch.device) -> torch.dtype:
    name = request.config.getoption("--bench-dtype")
    if name:
        return getattr(torch, name)
    return torch.bfloat16 if device.type == "cuda" else torch.float32


@pytest.fixture(scope="session")
def bench_model(model_name: str, device: torch.device, dtype: torch.dtype):
    return load_bench_model(model_name, device, dtype)


@pytest.fixture
def timed(benchmark, device: torch.device):
    """benchmark(fn) with a device sync, so that CUDA calls are timed to completion."""

    def run(fn, *, rounds: int | None = None):
        def call() -> None:
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        if rounds is None:
            return benchmark(call)
        return benchmark.pedantic(call, rounds=rounds, warmup_rounds=1, iterations=1)

    return run
