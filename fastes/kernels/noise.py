"""Fill a buffer with one tensor's noise stream: for tests (bit-exactness) and benchmarks (normals/s)."""

import triton
import triton.language as tl

from .philox import NOISE_CODES, NOISE_RADEMACHER, bits_tile, normal_tile, sign_tile, tile_offsets
from .table import NUM_WARPS


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
