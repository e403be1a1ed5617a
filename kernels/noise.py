"""Fill a buffer with one tensor's noise stream: for tests (bit-exactness) and benchmarks (normals/s)."""

import triton
import triton.language as tl

from .philox import NOISE_CODES, NOISE_RADEMACHER, bits_tile, normal_tile, sign_tile


@triton.jit
def fill_kernel(
    out,
    numel,
    offset,
    k0,
    k1,
    tensor_id,
    STREAM: tl.constexpr,
    RAW_BITS: tl.constexpr,
    NOISE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Elements [offset + pid * BLOCK, ...) of the stream; offset is a multiple of 4 (128 for signs).
    pid = tl.program_id(0)
    start = offset + pid.to(tl.int64) * BLOCK
    local = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = local < numel
    if RAW_BITS:
        tl.store(out + local, bits_tile(k0, k1, tensor_id, STREAM, start, BLOCK).to(tl.int64), mask=mask)
    elif NOISE == NOISE_RADEMACHER:
        tl.store(out + local, sign_tile(k0, k1, tensor_id, STREAM, start, BLOCK), mask=mask)
    else:
        tl.store(out + local, normal_tile(k0, k1, tensor_id, STREAM, start, BLOCK), mask=mask)


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
    )
