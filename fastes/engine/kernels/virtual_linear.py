"""A population-batched linear layer whose noise never touches memory.

y[rows of member m] = x W_m^T with W_m = round(W + scale_m * eps_m): each program regenerates its
[BLOCK_N, BLOCK_K] tile of member m's noise in registers from the noise contract, adds it to the weight
tile and multiplies. The base weights are only read, no per-member copy exists, and the perturbed tile is
rounded to the weight dtype first, so a member sees exactly the weights member-by-member evaluation
would give it (up to the matmul's summation order).
"""

import os

import triton
import triton.language as tl

from .philox import (
    NOISE_CODES,
    NOISE_RADEMACHER,
    STREAM_SIGN,
    block_words,
    normal_at,
    normals4,
    sign_at,
    sign_words_at,
)
from .rounding import round_to


@triton.jit(do_not_specialize=["tensor_id", "rows_per_member"])
def virtual_linear_kernel(
    x,
    weight,
    y,
    keys,
    scales,
    tensor_id: tl.uint32,
    rows_per_member: tl.int32,
    K,
    N,
    stride_x,
    stride_w,
    stride_y,
    DTYPE: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TRANSPOSED: tl.constexpr,
    RUNS_OF_4: tl.constexpr,
    NOISE: tl.constexpr,
    ROWS_WORD_ALIGNED: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    member = tl.program_id(2)
    k0 = tl.load(keys + 2 * member)
    k1 = tl.load(keys + 2 * member + 1)
    scale = tl.load(scales + member)

    local_rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = member.to(tl.int64) * rows_per_member + local_rows
    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_ok = local_rows < rows_per_member
    col_ok = cols < N

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        ks = (k_start + tl.arange(0, BLOCK_K)).to(tl.int64)
        k_ok = ks < K
        a = tl.load(
            x + rows[:, None] * stride_x + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0
        )
        w_mask = col_ok[:, None] & k_ok[None, :]
        if TRANSPOSED:  # a Conv1D weight [K, N]: element (k, n) is at k * stride + n, noise index k N + n
            w_offsets = ks[None, :] * stride_w + cols[:, None]
        else:
            w_offsets = cols[:, None] * stride_w + ks[None, :]
        w = tl.load(weight + w_offsets, mask=w_mask, other=0.0).to(tl.float32)
        # Whole Philox blocks (one per 4 elements) when the weight's contiguous axis is a multiple of 4.
        if NOISE == NOISE_RADEMACHER:
            eps = _sign_noise(
                k0, k1, tensor_id, cols, ks, k_start, K, N, TRANSPOSED, ROWS_WORD_ALIGNED, BLOCK_N, BLOCK_K
            )
        elif RUNS_OF_4 and TRANSPOSED:  # a [BLOCK_K, BLOCK_N] run of the [K, N] weight, then transposed
            blocks = (ks[:, None] * N + pid_n * BLOCK_N) // 4 + tl.arange(0, BLOCK_N // 4)[None, :]
            e0, e1, e2, e3 = normals4(*block_words(k0, k1, tensor_id, 0, blocks))
            eps = tl.trans(tl.reshape(tl.join(tl.join(e0, e2), tl.join(e1, e3)), (BLOCK_K, BLOCK_N)))
        elif RUNS_OF_4:  # a tile row is BLOCK_K // 4 whole Philox blocks
            blocks = (cols[:, None] * K + k_start) // 4 + tl.arange(0, BLOCK_K // 4)[None, :]
            e0, e1, e2, e3 = normals4(*block_words(k0, k1, tensor_id, 0, blocks))
            eps = tl.reshape(tl.join(tl.join(e0, e2), tl.join(e1, e3)), (BLOCK_N, BLOCK_K))
        elif TRANSPOSED:  # otherwise each element computes its block and keeps its lane
            eps = normal_at(k0, k1, tensor_id, 0, ks[None, :] * N + cols[:, None])
        else:
            eps = normal_at(k0, k1, tensor_id, 0, cols[:, None] * K + ks[None, :])
        # Round like a stored perturbed weight; masked lanes stay 0 so they add nothing.
        b = tl.where(w_mask, round_to(w + scale * eps, DTYPE).to(tl.float32), 0.0)
        if DOT_IN_FP32:  # fp32 weights (no tf32 shortcut), or the interpreter (its 16-bit dot is wrong)
            acc += tl.dot(a.to(tl.float32), tl.trans(b), input_precision="ieee")
        else:  # 16-bit operands multiply exactly into the fp32 accumulator: same result, tensor cores
            acc += tl.dot(a, tl.trans(b.to(DTYPE)))
    out_mask = row_ok[:, None] & col_ok[None, :]
    tl.store(y + rows[:, None] * stride_y + cols[None, :], round_to(acc, DTYPE), mask=out_mask)


@triton.jit
def _sign_noise(
    k0,
    k1,
    tensor_id,
    cols,
    ks,
    k_start,
    K,
    N,
    TRANSPOSED: tl.constexpr,
    ROWS_WORD_ALIGNED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Signs (fp32 +-1) of the weight elements of a [BLOCK_N, BLOCK_K] tile (noise index n K + k, or
    k N + n for a transposed Conv1D weight)."""
    if TRANSPOSED:
        eps = sign_at(k0, k1, tensor_id, STREAM_SIGN, ks[None, :] * N + cols[:, None])
    elif ROWS_WORD_ALIGNED:  # K % 32 == 0: each row's 32 consecutive signs are one Philox word
        word_starts = cols[:, None] * K + (k_start + 32 * tl.arange(0, BLOCK_K // 32))[None, :]
        words = sign_words_at(k0, k1, tensor_id, STREAM_SIGN, word_starts)  # [BLOCK_N, BLOCK_K // 32]
        bits = (words[:, :, None] >> tl.arange(0, 32).to(tl.uint32)[None, None, :]) & 1
        eps = 1.0 - 2.0 * tl.reshape(bits, (BLOCK_N, BLOCK_K)).to(tl.float32)
    else:
        eps = sign_at(k0, k1, tensor_id, STREAM_SIGN, cols[:, None] * K + ks[None, :])
    return eps


def launch_virtual_linear(
    x,
    weight,
    y,
    keys,
    scales,
    tensor_id: int,
    rows_per_member: int,
    dtype,
    block_m: int | None = None,
    block_n: int = 32,
    block_k: int = 32,
    transposed: bool = False,
    noise: str = "gaussian",
) -> None:
    """y = per-member perturbed x W^T; x [members * rows_per_member, K], weight [N, K], y [rows, N].

    `transposed`: the weight is a Conv1D's [K, N] and y = x W (its noise follows that layout).
    `noise`: the distribution of eps, "gaussian" or "rademacher".
    By default one M-tile covers all of a member's rows (up to 128), so each member's noise tile is
    generated once rather than once per M-tile.
    """
    if block_m is None:
        block_m = min(128, max(16, triton.next_power_of_2(rows_per_member)))
    members = keys.shape[0]
    k_in, n_out = weight.shape if transposed else weight.shape[::-1]
    runs_of_4 = (n_out if transposed else k_in) % 4 == 0
    rows_word_aligned = not transposed and k_in % 32 == 0 and block_k % 32 == 0  # signs: whole words
    whole_blocks = rows_word_aligned if noise == "rademacher" else runs_of_4 and not transposed
    grid = (triton.cdiv(rows_per_member, block_m), triton.cdiv(n_out, block_n), members)
    dot_in_fp32 = dtype == tl.float32 or os.environ.get("TRITON_INTERPRET") == "1"
    # The per-element and transposed noise paths hold more per element: more warps keep them in
    # registers (no spills for sm_90 / sm_80 / gfx942 in benchmarks/aot.py).
    tuning = {"num_warps": 4 if whole_blocks else 8}
    if dot_in_fp32:
        # The fp32 dot runs on FMAs: prefetching the next K tiles into registers (software pipelining,
        # Triton's default) made the 128-row tile spill (255 registers, ~640 bytes on sm_90). Noise
        # generation, not the loads, bounds this loop, so nothing is prefetched.
        tuning["num_stages"] = 1
    virtual_linear_kernel[grid](
        x,
        weight,
        y,
        keys,
        scales,
        tensor_id,
        rows_per_member,
        k_in,
        n_out,
        x.stride(0),
        weight.stride(0),
        y.stride(0),
        DTYPE=dtype,
        DOT_IN_FP32=dot_in_fp32,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        TRANSPOSED=transposed,
        RUNS_OF_4=runs_of_4,
        NOISE=NOISE_CODES[noise],
        ROWS_WORD_ALIGNED=rows_word_aligned,
        **tuning,
    )
