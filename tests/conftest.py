"""Shared test setup.

The Triton kernels are tested under the interpreter on CPU tensors. TRITON_INTERPRET must be set before
`triton` is first imported, so it is set here, when pytest imports this file (before any test module).
"""

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from fastes.models import build_tiny_model, build_tokenizer  # noqa: E402

# The models under test are tiny: a second thread costs more in synchronisation than it gives, and on a
# shared 2-core machine it makes every test several times slower.
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny():
    """A random-weight model of the built-in tiny architecture and its tokenizer (eval mode).
    test_virtual.py overrides it with a smaller one for its interpreted kernels."""
    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    return build_tiny_model("tiny", tokenizer).eval(), tokenizer


# The two noise distributions (docs/noise.md): the per-op tests run for both. Sign arithmetic is exact
# (w * eps and scale * eps are sign flips), so for "rademacher" the interpreted kernels must equal the torch
# reference bit for bit, where Gaussian noise is compared to a tolerance.
NOISE_KINDS = ["gaussian", "rademacher"]


def make_tensors(dtype, seed, shapes):
    """Standard-normal tensors of the given shapes, rounded to `dtype`, from a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


def bits(tensors):
    """The raw bytes of each tensor: equal bits means equal values, -0.0 and NaN payloads included."""
    return [t.view(-1).view(torch.uint8).clone() for t in tensors]


def ordered(t):
    """Integers in the order of the float values (one step = one ulp) for a 16-bit float tensor."""
    raw = t.view(torch.int16).to(torch.int32)
    return torch.where(raw < 0, -(raw & 0x7FFF), raw)


def correlation(a, b):
    """Pearson correlation of two samples, in float64."""
    a, b = a.double() - a.double().mean(), b.double() - b.double().mean()
    return (a @ b / (a.norm() * b.norm())).item()


def is_timing(key: str) -> bool:
    """Metrics that measure time: different on every run, so left out when two runs are compared."""
    return key in ("seconds", "tokens_per_second") or key.startswith("time/")


def python_steps(function, *args):
    """(result, the number of Python lines executed by function(*args), nested calls included): a measure
    of work that does not depend on the machine's load, for bounds that a timing would make flaky."""
    steps = 0

    def count(frame, event, arg):
        nonlocal steps
        steps += event == "line"
        return count

    previous = sys.gettrace()
    sys.settrace(count)
    try:
        result = function(*args)
    finally:
        sys.settrace(previous)
    return result, steps
