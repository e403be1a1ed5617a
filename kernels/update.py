"""The ES update of every evolved tensor in one launch.

Per element: regenerate the noise of all P directions in registers, accumulate sum_j w_j * eps_j in fp32,
then either write theta * decay + coef * sum (rounded to nearest, or stochastically with uniforms from
the rounding stream) or write coef * sum into a gradient buffer. Each weight is read once and written
once, whatever the population size. Antithetic pairs arrive as one direction with w = w_plus - w_minus.
"""

import triton
import triton.language as tl

from .philox import normal_tile, uniform_tile
from .rounding import round_to, stochastic_round
from .table import TileTable, addresses, read_tile

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
    BLOCK: tl.constexpr,
):
    start, tensor_id, param, out, offsets, mask = read_tile(
        param_addresses, out_addresses, numels, tensor_ids, tile_tensor, tile_start, DTYPE, BLOCK
    )

    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in range(n_directions):
        k0 = tl.load(keys + 2 * j)
        k1 = tl.load(keys + 2 * j + 1)
        total += tl.load(weights + j) * normal_tile(k0, k1, tensor_id, 0, start, BLOCK)

    if MODE == 2:
        tl.store(out + offsets, round_to(coef * total, DTYPE), mask=mask)
    else:
        theta = tl.load(param + offsets, mask=mask).to(tl.float32)
        new = theta * decay + coef * total
        if MODE == 1:
            u = uniform_tile(rounding_k0, rounding_k1, tensor_id, 1, start, BLOCK)
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
) -> None:
    """One launch over all tensors of `table`; `keys` int64 [P, 2], `weights` fp32 [P] on the device."""
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
        BLOCK=table.block,
    )
