"""The ES update of every evolved tensor in one launch.

Per element: regenerate the noise of all P directions in registers, accumulate sum_j w_j * eps_j in fp32,
then either write theta * decay + coef * sum (rounded to nearest, or stochastically with uniforms from
the rounding stream) or write coef * sum into a gradient buffer. Each weight is read once and written
once, whatever the population size. Antithetic pairs arrive as one direction with w = w_plus - w_minus.
"""

import triton
import triton.language as tl

from .philox import (
    NOISE_CODES,
    NOISE_RADEMACHER,
    STREAM_SIGN,
    block_words,
    lanes_to_tile,
    normals4,
    row_blocks,
    sign_mask_tile,
    tile_offsets,
    uniform_lanes,
    with_sign,
)
from .rounding import round_to, stochastic_round
from .table import NUM_WARPS, TileTable, addresses, blocks_per_row, read_tile, tile_pointer

MODE_APPLY = 0  # theta <- theta * decay + coef * sum, round to nearest
MODE_APPLY_STOCHASTIC = 1  # the same, stochastic rounding to a 16-bit dtype
MODE_GRADIENT = 2  # out <- coef * sum, theta untouched


@triton.jit(do_not_specialize=["n_directions", "rounding_k0", "rounding_k1"])
def update_kernel(
    param_addresses,
    out_addresses,
    numels,
    tensor_ids,
    tile_tensor,
    tile_start,
    keys,
    weights,
    n_directions: tl.int32,
    coef: tl.float32,
    decay: tl.float32,
    rounding_k0: tl.uint32,
    rounding_k1: tl.uint32,
    DTYPE: tl.constexpr,
    MODE: tl.constexpr,
    NOISE: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCKS_PER_ROW: tl.constexpr,
):
    ROWS: tl.constexpr = BLOCK // (4 * BLOCKS_PER_ROW)
    start, tensor_id, param_address, out_address, count, fast = read_tile(
        param_addresses, out_addresses, numels, tensor_ids, tile_tensor, tile_start, DTYPE, BLOCK
    )

    if NOISE == NOISE_RADEMACHER:  # one tile, already in element order
        sums = (_sign_sum(keys, weights, n_directions, tensor_id, start, ROWS, 4 * BLOCKS_PER_ROW),)
    else:  # the lanes of normals, put into element order in _write
        sums = _gaussian_sums(keys, weights, n_directions, tensor_id, start, ROWS, BLOCKS_PER_ROW)

    offsets = tile_offsets(ROWS, BLOCKS_PER_ROW)
    if MODE == 1:
        u = uniform_lanes(rounding_k0, rounding_k1, tensor_id, 1, start, ROWS, BLOCKS_PER_ROW)
    else:
        u = sums  # unused
    if fast:  # full, aligned tile: unmasked 128-bit accesses
        param = tile_pointer(param_address, start, DTYPE, True)
        out = tile_pointer(out_address, start, DTYPE, True)
        _write(param, out, offsets, None, sums, coef, decay, u, DTYPE, MODE, NOISE, BLOCKS_PER_ROW)
    else:
        param = tile_pointer(param_address, start, DTYPE, False)
        out = tile_pointer(out_address, start, DTYPE, False)
        _write(param, out, offsets, offsets < count, sums, coef, decay, u, DTYPE, MODE, NOISE, BLOCKS_PER_ROW)


@triton.jit
def _gaussian_sums(
    keys, weights, n_directions, tensor_id, start, ROWS: tl.constexpr, BLOCKS_PER_ROW: tl.constexpr
):
    """sum_j w_j eps_j (normals) over the tile, as the 8 lanes (a0..a3, b0..b3) of lanes_to_tile."""
    # The direction loop keeps each block's four lanes apart (a: first block of a row, b: second, with
    # two per row); they are put into element order once, after it.
    first = row_blocks(start, ROWS, BLOCKS_PER_ROW)
    a0 = tl.zeros((ROWS,), dtype=tl.float32)
    a1, a2, a3, b0, b1, b2, b3 = a0, a0, a0, a0, a0, a0, a0
    for j in range(n_directions):
        k0 = tl.load(keys + 2 * j)
        k1 = tl.load(keys + 2 * j + 1)
        w = tl.load(weights + j)
        e0, e1, e2, e3 = normals4(*block_words(k0, k1, tensor_id, 0, first))
        a0, a1, a2, a3 = a0 + w * e0, a1 + w * e1, a2 + w * e2, a3 + w * e3
        if BLOCKS_PER_ROW == 2:
            e0, e1, e2, e3 = normals4(*block_words(k0, k1, tensor_id, 0, first + 1))
            b0, b1, b2, b3 = b0 + w * e0, b1 + w * e1, b2 + w * e2, b3 + w * e3
    return a0, a1, a2, a3, b0, b1, b2, b3


@triton.jit
def _sign_sum(keys, weights, n_directions, tensor_id, start, ROWS: tl.constexpr, WIDTH: tl.constexpr):
    """sum_j w_j s_j (signs) over the [ROWS, WIDTH] tile from `start`: per direction and element one
    shift, one xor and one add after a Philox call per 128 elements; exact sums of +-w_j."""
    total = tl.zeros((ROWS, WIDTH), dtype=tl.float32)
    for j in range(n_directions):
        k0 = tl.load(keys + 2 * j)
        k1 = tl.load(keys + 2 * j + 1)
        w = tl.zeros((ROWS, WIDTH), dtype=tl.float32) + tl.load(weights + j)
        total += with_sign(w, sign_mask_tile(k0, k1, tensor_id, STREAM_SIGN, start, ROWS, WIDTH))
    return total


@triton.jit
def _write(
    param,
    out,
    offsets,
    mask,
    sum_lanes,
    coef,
    decay,
    u_lanes,
    DTYPE: tl.constexpr,
    MODE: tl.constexpr,
    NOISE: tl.constexpr,
    BLOCKS_PER_ROW: tl.constexpr,
):
    """out = round(param * decay + coef * sum) (to nearest, or stochastically with u), or
    round(coef * sum); the lanes put into element order here, in this branch's layout (a sign sum is
    one tile already in element order)."""
    if NOISE == NOISE_RADEMACHER:
        step = coef * sum_lanes[0]
    else:
        step = coef * lanes_to_tile(*sum_lanes, BLOCKS_PER_ROW)
    if MODE == 2:
        tl.store(out + offsets, round_to(step, DTYPE), mask=mask)
    else:
        new = tl.load(param + offsets, mask=mask).to(tl.float32) * decay + step
        if MODE == 1:
            u = lanes_to_tile(*u_lanes, BLOCKS_PER_ROW)
            tl.store(out + offsets, stochastic_round(new, u, DTYPE), mask=mask)
        else:
            tl.store(out + offsets, round_to(new, DTYPE), mask=mask)


def launch_update(
    table: TileTable,
    outputs,
    keys,
    weights,
    coef: float,
    decay: float,
    rounding: tuple[int, int],
    mode: int,
    dtype,
    noise: str = "gaussian",
) -> None:
    """One launch over all tensors of `table`; `keys` int64 [P, 2], `weights` fp32 [P] on the device.

    `noise` ("gaussian" or "rademacher") is the distribution the members were perturbed with.
    """
    out_addresses = table.addresses if outputs is None else addresses(outputs, table.addresses.device)
    update_kernel[(table.n_tiles,)](
        table.addresses,
        out_addresses,
        table.numels,
        table.tensor_ids,
        table.tile_tensor,
        table.tile_start,
        keys,
        weights,
        int(weights.numel()),
        coef,
        decay,
        rounding[0],
        rounding[1],
        DTYPE=dtype,
        MODE=mode,
        NOISE=NOISE_CODES[noise],
        BLOCK=table.block,
        num_warps=NUM_WARPS,
        BLOCKS_PER_ROW=blocks_per_row(dtype.primitive_bitwidth // 8),
    )
