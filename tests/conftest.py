"""Shared test setup.

The Triton kernels are tested under the interpreter on CPU tensors. TRITON_INTERPRET must be set before
`triton` is first imported, so it is set here, when pytest imports this file (before any test module).
"""

import os

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


def is_timing(key: str) -> bool:
    """Metrics that measure time: different on every run, so left out when two runs are compared."""
    return key in ("seconds", "tokens_per_second") or key.startswith("time/")
