"""The low-rank population linear layer: y = x W^T + bias + the members' rank-r term.

Member m owns rows m R .. (m + 1) R - 1 and adds sum_i (x . inputs[m, i]) outputs[m, i] to each of its
rows (outputs carry scale_m / sqrt(r)). `lowrank_linear_kernel` computes y one [BLOCK_M, BLOCK_N] tile
at a time and adds sum_i p[row, i] outputs[member, i] and the bias in its epilogue, before the one store
of y (done after the GEMM instead, the term is extra passes over y). The r products p of each row with
its member's input factors come one of two ways, whichever the cost model prices lower
(`products_first`, benchmarks/model_iteration.py):
- summed inside the GEMM's K loop (the x tile is already in registers), but then every column tile
  redoes them: r FMAs per input feature, row and column tile, on the CUDA cores;
- or first, by `lowrank_products_kernel`: one more launch that reads x once and writes p [rows, r] in
  fp32, which the GEMM's epilogue reads; its K loop is then the plain GEMM.
A Triton kernel computes p rather than a torch.bmm on the [members, R, K] view: with r columns the bmm
is a matrix-vector shape whose 16-bit output would round p to x's dtype, and an fp32 bmm needs an fp32
copy of x (three passes over x's size instead of the one read the cost model prices).
"""

import os

import torch
import triton
import triton.language as tl

from .rounding import round_to

PRODUCT_ROWS = 4  # rows per program of the products kernel: 512 programs for a 2048-row decode step
PRODUCT_K = 256  # its K step: 8 elements of x per thread with 4 warps (16 bytes in 16 bit: one load)
# Products first pays when the column tiles' recomputation (r x tiles FMAs per input feature and row on
# the CUDA cores) costs more than one read of x (2 bytes per input feature and row): at the fp32-FLOPs-
# to-copy-bandwidth ratio of an H100 / H200 (67 TFLOPS over 3.0 / 4.3 TB/s: 22 / 16 FLOPs per byte) that
# is r x tiles above ~16-22. Twice that leaves room for the extra launch (3 us in the cost model): at a
# 2048-row decode step on an H200 it pays from K of about 3000 at the threshold, of about 800 at 76 tiles
# (gate and up of Qwen2.5-0.5B), and a prefill's rows hide the launch.
PRODUCTS_FIRST_TILES = 32
BLOCK_N = 64  # the GEMM's tile width


def products_first(rank: int, n_out: int, block_n: int = BLOCK_N) -> bool:
    """Whether the layer computes its products in a launch of their own rather than in each column tile."""
    return rank * triton.cdiv(n_out, block_n) >= PRODUCTS_FIRST_TILES


@triton.jit
def add_products(
    sums,
    a,
    inputs,
    factor_rows,
    k_start,
    K,
    mask,
    RANK: tl.constexpr,
    RANK_BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One K step of the rows' products: sums[:, i] += a . inputs[member, i, k_start : k_start + BLOCK_K]
    for each row of the fp32 x tile `a`, `factor_rows` holding where each row's member's factors start."""
    ranks = tl.arange(0, RANK_BLOCK)
    for i in tl.static_range(RANK):
        offsets = factor_rows[:, None] + (k_start + i * K + tl.arange(0, BLOCK_K))[None, :]
        factor = tl.load(inputs + offsets, mask=mask, other=0.0)
        partial = tl.sum(a * factor.to(tl.float32), axis=1)
        sums += tl.where(ranks[None, :] == i, partial[:, None], 0.0)
    return sums


@triton.jit(do_not_specialize=["rows", "rows_per_member"])
def lowrank_products_kernel(
    x,
    inputs,
    products,
    rows: tl.int32,
    rows_per_member: tl.int32,
    K,
    stride_x,
    RANK: tl.constexpr,
    RANK_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows32 = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ids = rows32.to(tl.int64)  # x can pass 2^31 elements
    row_ok = row_ids < rows
    # A program may straddle members: factor loads are per row. A 32-bit division (a 64-bit one is a
    # subroutine call with a stack frame), and 32-bit offsets into the small factors (members * r * K).
    factor_rows = (rows32 // rows_per_member) * (RANK * K)
    ranks = tl.arange(0, RANK_BLOCK)  # RANK rounded up to a power of two, as tl.arange needs
    sums = tl.zeros((BLOCK_M, RANK_BLOCK), dtype=tl.float32)  # column i: x . inputs[member, i]
    for k_start in range(0, K, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        mask = row_ok[:, None] & (ks < K)[None, :]
        a = tl.load(x + row_ids[:, None] * stride_x + ks[None, :], mask=mask, other=0.0).to(tl.float32)
        sums = add_products(sums, a, inputs, factor_rows, k_start, K, mask, RANK, RANK_BLOCK, BLOCK_K)
    out_mask = row_ok[:, None] & (ranks < RANK)[None, :]
    tl.store(products + row_ids[:, None] * RANK + ranks[None, :], sums, mask=out_mask)


@triton.jit(do_not_specialize=["rows", "rows_per_member"])
def lowrank_linear_kernel(
    x,
    weight,
    bias,
    inputs,
    products,
    outputs,
    y,
    rows: tl.int32,
    rows_per_member: tl.int32,
    K,
    N,
    stride_x,
    stride_w,
    stride_y,
    DTYPE: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    RANK: tl.constexpr,
    RANK_BLOCK: tl.constexpr,
    PRODUCTS_GIVEN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    TRANSPOSED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # M tiles vary fastest: the programs that run together share one weight tile (read once from HBM)
    # while all of x, the smaller operand at decode, stays in L2.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows32 = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ids = rows32.to(tl.int64)  # y can pass 2^31 elements
    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_ok = row_ids < rows
    col_ok = cols < N
    # A tile may straddle members: factor loads are per row. A 32-bit division (a 64-bit one is a
    # subroutine call with a stack frame), and 32-bit offsets into the small factors (members * r * K).
    member = rows32 // rows_per_member
    factor_rows = member * (RANK * K)  # where each row's member's input factors start
    ranks = tl.arange(0, RANK_BLOCK)  # RANK rounded up to a power of two, as tl.arange needs

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    sums = tl.zeros((BLOCK_M, RANK_BLOCK), dtype=tl.float32)  # column i: x . inputs[member, i]
    for k_start in range(0, K, BLOCK_K):
        ks = (k_start + tl.arange(0, BLOCK_K)).to(tl.int64)
        k_ok = ks < K
        a_mask = row_ok[:, None] & k_ok[None, :]
        a = tl.load(x + row_ids[:, None] * stride_x + ks[None, :], mask=a_mask, other=0.0)
        if TRANSPOSED:  # a Conv1D weight [K, N]: y = x W
            w_offsets = ks[:, None] * stride_w + cols[None, :]
        else:
            w_offsets = cols[None, :] * stride_w + ks[:, None]
        w = tl.load(weight + w_offsets, mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        if DOT_IN_FP32:  # fp32 weights (no tf32 shortcut), or the interpreter (its 16-bit dot is wrong)
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:  # 16-bit operands multiply exactly into the fp32 accumulator: tensor cores
            acc += tl.dot(a, w)
        if not PRODUCTS_GIVEN:
            a32 = a.to(tl.float32)
            sums = add_products(sums, a32, inputs, factor_rows, k_start, K, a_mask, RANK, RANK_BLOCK, BLOCK_K)

    out_mask = row_ok[:, None] & col_ok[None, :]
    for i in tl.static_range(RANK):
        if PRODUCTS_GIVEN:
            product = tl.load(products + row_ids * RANK + i, mask=row_ok, other=0.0)
        else:
            product = tl.sum(tl.where(ranks[None, :] == i, sums, 0.0), axis=1)
        factor = tl.load(outputs + (member[:, None] * RANK + i) * N + cols[None, :], mask=out_mask, other=0.0)
        acc += product[:, None] * factor.to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y + row_ids[:, None] * stride_y + cols[None, :], round_to(acc, DTYPE), mask=out_mask)


def launch_lowrank_products(x: torch.Tensor, inputs: torch.Tensor, products: torch.Tensor) -> None:
    """products[row, i] = x[row] . inputs[member(row), i] in fp32; x [members * R, K] (member m's rows
    the m-th block of R), inputs [members, r, K], products [members * R, r] fp32; all contiguous."""
    rows, k_in = x.shape
    members, rank, _ = inputs.shape
    lowrank_products_kernel[(triton.cdiv(rows, PRODUCT_ROWS),)](
        x,
        inputs,
        products,
        rows,
        rows // members,
        k_in,
        x.stride(0),
        RANK=rank,
        RANK_BLOCK=triton.next_power_of_2(rank),
        BLOCK_M=PRODUCT_ROWS,
        BLOCK_K=PRODUCT_K,
        num_warps=4,
    )


def launch_lowrank_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    inputs: torch.Tensor,
    outputs: torch.Tensor,
    y: torch.Tensor,
    dtype,
    transposed: bool = False,
    block_m: int | None = None,
    block_n: int = BLOCK_N,
    block_k: int = 32,
    first: bool | None = None,
) -> None:
    """y = x W^T + bias + each member's rank-r term; x [members * R, K] (member m's rows the m-th block
    of R), weight [N, K] ([K, N] when `transposed`, a Conv1D: y = x W), bias [N] or None, inputs
    [members, r, K], outputs [members, r, N] (scales folded in), y [members * R, N]; all contiguous.

    The products run first, in a launch of their own, when `first` (default: `products_first`), else
    inside the GEMM's K loop. By default a GEMM tile is as high as the rows need, from 16 up to 64.
    """
    rows, k_in = x.shape
    members, rank, n_out = outputs.shape
    if first is None:
        first = products_first(rank, n_out, block_n)
    products = None
    if first:
        products = torch.empty(rows, rank, dtype=torch.float32, device=x.device)
        launch_lowrank_products(x, inputs, products)
    if block_m is None:
        block_m = min(64, max(16, triton.next_power_of_2(rows)))
    dot_in_fp32 = dtype == tl.float32 or os.environ.get("TRITON_INTERPRET") == "1"
    grid = (triton.cdiv(rows, block_m), triton.cdiv(n_out, block_n))
    # Each thread holds its share of the x tile and, summing the products in the K loop, of r factor
    # tiles per K step: 8 warps for the 64-row tile keep that in registers. The fp32 dot runs on FMAs:
    # there prefetching the next K tile (Triton's software pipelining) made the 64-row tile spill, and
    # leaving it out made ptxas spill one value of the 16-row tile at rank 8 on sm_80; with the products
    # given, the 64-row tile spilled 16 bytes on sm_90 at 1 stage (at rank 8 also at 2) and none at
    # Triton's default 3 (benchmarks/aot.py: no spills for sm_90, sm_80, gfx942).
    tuning = {"num_warps": 8 if block_m > 32 else 4}
    if dot_in_fp32:
        tuning["num_stages"] = (3 if first else 1) if block_m > 32 else 2
    lowrank_linear_kernel[grid](
        x,
        weight,
        bias,
        inputs,
        products,
        outputs,
        y,
        rows,
        rows // members,
        k_in,
        n_out,
        x.stride(0),
        weight.stride(0),
        y.stride(0),
        DTYPE=dtype,
        DOT_IN_FP32=dot_in_fp32,
        RANK=rank,
        RANK_BLOCK=triton.next_power_of_2(rank),
        PRODUCTS_GIVEN=first,
        HAS_BIAS=bias is not None,
        TRANSPOSED=transposed,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        **tuning,
    )
