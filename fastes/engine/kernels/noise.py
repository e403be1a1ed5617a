"""Fill buffers with noise streams: one tensor's (`launch_fill`: tests of bit-exactness, benchmarks of
normals/s) or many tensors' normals in one launch (`launch_normals`: the low-rank factors)."""

import triton
import triton.language as tl

from .philox import (
    NOISE_CODES,
    NOISE_RADEMACHER,
    bits_tile,
    lanes_to_tile,
    normal_lanes,
    normal_tile,
    sign_tile,
    tile_offsets,
)
from .table import NUM_WARPS, TileTable, read_tile, tile_pointer


@triton.jit(do_not_specialize=["numel", "offset", "k0", "k1", "tensor_id"])
def fill_kernel(
    out,
    numel: tl.int64,
    offset: tl.int64,
    k0: tl.uint32,
    k1: tl.uint32,
    tensor_id: tl.uint32,
    STREAM: tl.constexpr,
    RAW_BITS: tl.constexpr,
    NOISE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Elements [offset + pid * BLOCK, ...) of the stream; offset is a multiple of 4, of 128 for signs.
    pid = tl.program_id(0)
    start = offset + pid.to(tl.int64) * BLOCK
    out = out + pid.to(tl.int64) * BLOCK
    local = tile_offsets(BLOCK // 4, 1)
    mask = local < numel - pid.to(tl.int64) * BLOCK
    if RAW_BITS:
        tl.store(out + local, bits_tile(k0, k1, tensor_id, STREAM, start, BLOCK // 4).to(tl.int64), mask=mask)
    elif NOISE == NOISE_RADEMACHER:
        tl.store(out + local, sign_tile(k0, k1, tensor_id, STREAM, start, BLOCK // 4, 4), mask=mask)
    else:
        tl.store(out + local, normal_tile(k0, k1, tensor_id, STREAM, start, BLOCK // 4, 1), mask=mask)


def launch_fill(
    out,
    key: tuple[int, int],
    tensor_id: int,
    offset: int,
    stream: int,
    raw_bits: bool,
    block: int = 1024,
    noise: str = "gaussian",
) -> None:
    """out[i] = stream element offset + i: int64 words when raw_bits, else fp32 normals or signs (`noise`).

    Signs ("rademacher") need `offset` and `block` to be multiples of 128 (one Philox block of signs).
    """
    align = 128 if noise == "rademacher" and not raw_bits else 4
    for what, value in (("offset", offset), ("block", block)):
        if value % align:
            raise ValueError(f"{what} must be a multiple of {align} (one Philox block), got {value}")
    n = out.numel()
    fill_kernel[(triton.cdiv(n, block),)](
        out,
        n,
        offset,
        key[0],
        key[1],
        tensor_id,
        STREAM=stream,
        RAW_BITS=raw_bits,
        NOISE=NOISE_CODES[noise],
        BLOCK=block,
        num_warps=NUM_WARPS,
    )


@triton.jit(do_not_specialize=["k0", "k1"])  # see fastes/engine/kernels/__init__.py: typed, never specialised
def normals_kernel(
    addresses,
    numels,
    tensor_ids,
    tile_tensor,
    tile_start,
    k0: tl.uint32,
    k1: tl.uint32,
    STREAM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Tile `start` of every tensor of the table: fp32 normals of elements [start, start + BLOCK) of its
    own stream, the values `fill_kernel` writes for that tensor alone."""
    ROWS: tl.constexpr = BLOCK // 4
    start, tensor_id, _, out_address, count, fast = read_tile(
        addresses, addresses, numels, tensor_ids, tile_tensor, tile_start, tl.float32, BLOCK
    )
    offsets = tile_offsets(ROWS, 1)
    lanes = normal_lanes(k0, k1, tensor_id, STREAM, start, ROWS, 1)
    if fast:  # full, aligned tile: unmasked 128-bit stores
        tl.store(tile_pointer(out_address, start, tl.float32, True) + offsets, lanes_to_tile(*lanes, 1))
    else:
        out = tile_pointer(out_address, start, tl.float32, False)
        tl.store(out + offsets, lanes_to_tile(*lanes, 1), mask=offsets < count)


def launch_normals(table: TileTable, key: tuple[int, int], stream: int) -> None:
    """Every fp32 tensor of `table` = elements [0, numel) of its own normal stream `stream` under `key`
    (tensor i's id is table.tensor_ids[i]), in one launch: per tensor, launch_fill's values bit for bit."""
    if table.block % 4:
        raise ValueError(f"block must be a multiple of 4 (one Philox block), got {table.block}")
    if table.n_tiles == 0:
        return
    normals_kernel[(table.n_tiles,)](
        table.addresses,
        table.numels,
        table.tensor_ids,
        table.tile_tensor,
        table.tile_start,
        key[0],
        key[1],
        STREAM=stream,
        BLOCK=table.block,
        num_warps=NUM_WARPS,
    )
