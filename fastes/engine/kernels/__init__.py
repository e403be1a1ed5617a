"""Triton kernels of fastes: the Philox noise stream, multi-tensor perturb, fused ES update, and the
population-batched linear layers (in-register noise; the low-rank term in a GEMM's epilogue).

Kernels know nothing of models or tasks; `fastes.engine.ops` chooses between them and the torch reference.

Scalar arguments that carry data (member and rounding keys, tensor ids, element offsets, counts) are
typed (`k0: tl.uint32`, ...) and listed in `do_not_specialize`: Triton would otherwise compile a
separate variant for a value equal to 1 (as a constexpr, on which `.to()` fails to compile), for values
past 2^31 (i64) and for multiples of 16, so a run would crash on key word 1 and recompile per key.
`benchmarks.aot` compiles every launch the runtime makes for sm_90/sm_80 and checks this.
"""

from .lowrank_linear import launch_lowrank_linear, launch_lowrank_products, products_first
from .noise import launch_fill, launch_normals
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
    "launch_lowrank_linear",
    "launch_lowrank_products",
    "launch_normals",
    "launch_perturb",
    "launch_update",
    "launch_virtual_linear",
    "products_first",
]
