"""Shared test setup.

The Triton kernels are tested under the interpreter on CPU tensors. TRITON_INTERPRET must be set before
`triton` is first imported, so it is set here, when pytest imports this file (before any test module).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"
