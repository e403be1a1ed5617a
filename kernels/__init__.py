"""Triton kernels of fastes: the Philox noise stream, multi-tensor perturb, fused ES update, and the
population-batched linear layer with in-register noise.

Kernels know nothing of models or tasks; `fastes.ops` chooses between them and the torch reference.
"""

from .noise import launch_fill
from .perturb import launch_perturb
from .table import TileTable, build_tile_table
from .update import MODE_APPLY, MODE_APPLY_STOCHASTIC, MODE_GRADIENT, launch_update
from .virtual_linear import launch_virtual_linear

__all__ = [
    "MODE_APPLY",
    "MODE_APPLY_STOCHASTIC",
    "MODE_GRADIENT",
    "TileTable",
    "build_tile_table",
    "launch_fill",
    "launch_perturb",
    "launch_update",
    "launch_virtual_linear",
]
