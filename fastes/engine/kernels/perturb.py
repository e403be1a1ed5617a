"""Perturb every evolved tensor in one launch: dst = theta + scale * eps(member key), scale = +-sigma.

With dst != src the weights are never modified, which is what makes restore exact: the caller swaps the
parameters onto the perturbed buffer and back (see fastes.engine.ops). With dst == src it perturbs in place.
"""

import triton
import triton.language as tl

from .philox import (
    NOISE_CODES,
    NOISE_RADEMACHER,
    STREAM_SIGN,
    lanes_to_tile,
    normal_lanes,
    sign_mask_tile,
    signed,
    tile_offsets,
)
from .rounding import round_to
from .table import NUM_WARPS, TileTable, blocks_per_row, read_tile, tile_pointer


@triton.jit(do_not_specialize=["k0", "k1"])  # see fastes/engine/kernels/__init__.py: typed, never specialised
def perturb_kernel(
    src_addresses,
    dst_addresses,
    numels,
    tensor_ids,
    tile_tensor,
    tile_start,
    k0: tl.uint32,
    k1: tl.uint32,
    scale: tl.float32,
    DTYPE: tl.constexpr,
    NOISE: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCKS_PER_ROW: tl.constexpr,
):
    ROWS: tl.constexpr = BLOCK // (4 * BLOCKS_PER_ROW)
    start, tensor_id, src_address, dst_address, count, fast = read_tile(
        src_addresses, dst_addresses, numels, tensor_ids, tile_tensor, tile_start, DTYPE, BLOCK
    )
    offsets = tile_offsets(ROWS, BLOCKS_PER_ROW)
    if NOISE == NOISE_RADEMACHER:  # sign masks, already in element order
        eps = (sign_mask_tile(k0, k1, tensor_id, STREAM_SIGN, start, ROWS, 4 * BLOCKS_PER_ROW),)
    else:
        eps = normal_lanes(k0, k1, tensor_id, 0, start, ROWS, BLOCKS_PER_ROW)
    if fast:  # full, aligned tile: unmasked 128-bit accesses
        src = tile_pointer(src_address, start, DTYPE, True)
        dst = tile_pointer(dst_address, start, DTYPE, True)
        _write(src, dst, offsets, None, scale, eps, DTYPE, NOISE, BLOCKS_PER_ROW)
    else:
        src = tile_pointer(src_address, start, DTYPE, False)
        dst = tile_pointer(dst_address, start, DTYPE, False)
        _write(src, dst, offsets, offsets < count, scale, eps, DTYPE, NOISE, BLOCKS_PER_ROW)


@triton.jit
def _write(
    src,
    dst,
    offsets,
    mask,
    scale,
    eps_lanes,
    DTYPE: tl.constexpr,
    NOISE: tl.constexpr,
    BLOCKS_PER_ROW: tl.constexpr,
):
    """dst = round(src + scale * eps), the noise put into element order in this branch's layout
    (sign noise arrives as one tile of sign masks: scale * eps is scale with its sign flipped)."""
    if NOISE == NOISE_RADEMACHER:
        step = signed(scale, eps_lanes[0])
    else:
        step = scale * lanes_to_tile(*eps_lanes, BLOCKS_PER_ROW)
    # Upcast right after the load: bf16 arithmetic is wrong under the interpreter and imprecise anyway.
    theta = tl.load(src + offsets, mask=mask).to(tl.float32)
    tl.store(dst + offsets, round_to(theta + step, DTYPE), mask=mask)


def launch_perturb(
    table: TileTable, dst_addresses, key: tuple[int, int], scale: float, dtype, noise: str = "gaussian"
) -> None:
    """dst_i = src_i + scale * eps_i for every tensor of `table` (all of one dtype), in one launch.

    `noise` is the distribution of eps, "gaussian" or "rademacher" (table.block a multiple of 128).

    `dst_addresses` is the int64 address column of the destinations (`table.addresses` for in place).
    """
    perturb_kernel[(table.n_tiles,)](
        table.addresses,
        dst_addresses,
        table.numels,
        table.tensor_ids,
        table.tile_tensor,
        table.tile_start,
        key[0],
        key[1],
        scale,
        DTYPE=dtype,
        NOISE=NOISE_CODES[noise],
        BLOCK=table.block,
        # Sign tiles use twice the threads: with 2 warps, ptxas for sm_80 spilled 8 bytes in fp16 (72
        # registers); at 4 warps the sign perturb is still predicted at the copy's bandwidth (17
        # instructions per element, ~28 allowed on an H200; python -m benchmarks --static).
        num_warps=NUM_WARPS if noise == "gaussian" else 2 * NUM_WARPS,
        BLOCKS_PER_ROW=blocks_per_row(dtype.primitive_bitwidth // 8),
    )
