"""The noise contract on the Triton side: one definition shared by every kernel.

Line for line the same stream as `fastes.engine.noise` (the torch reference) and docs/noise.md. The Philox
rounds are written out here rather than taken from `tl.philox`/`tl.randn`, so that the bits -> uniform ->
normal mapping belongs to fastes and cannot change with the Triton version.

The pieces, in the order a kernel uses them:
- `block_words`: the four Philox words of each counter block (4 consecutive elements);
- a mapping from the four words of a block to the four values of its elements: `normals4` (Gaussian,
  Box-Muller) and `uniforms4` (stochastic rounding); another noise type is another such mapping,
  with `*_lanes` / `*_tile` helpers like `normal_lanes` / `normal_tile`;
- `lanes_to_tile`: lane j of block i to element 4i + j. Tiles are shaped [rows, 16 bytes of elements]
  and the lanes are joined as trailing dimensions that stay in each thread's registers, so this moves
  no data (no shared memory) and a row is one 128-bit access.

Cost on sm_90 (python -m benchmarks --static): ~36 SASS instructions per normal, of which Philox is
about 4 per round per block of 4 (one wide multiply per product, one 3-input xor per word). Every
operation whose result must match the reference exactly is integer or exact fp32 arithmetic; only
log, sqrt and the sin/cos polynomials round differently (docs/noise.md, section 10).
"""

import triton
import triton.language as tl

PHILOX_M0 = tl.constexpr(0xD2511F53)
PHILOX_M1 = tl.constexpr(0xCD9E8D57)
PHILOX_W0 = tl.constexpr(0x9E3779B9)
PHILOX_W1 = tl.constexpr(0xBB67AE85)
TWO_PI = tl.constexpr(6.283185307179586)  # rounded to fp32 where used: 6.2831855, as in the reference
ONE_MINUS_HALF_ULP = tl.constexpr(1.0 - 2.0**-24)  # exact in fp32
# Reduction of an angle in [0, 2 pi] by multiples of pi / 2: round-to-integer by adding 1.5 * 2^23, and
# pi / 2 split into an fp32 head and the remainder so that angle - n * pi/2 is exact with one fma each.
ROUND_TO_INT = tl.constexpr(12582912.0)
TWO_OVER_PI = tl.constexpr(0.6366197723675814)
HALF_PI_HEAD = tl.constexpr(1.5707963705062866)
HALF_PI_TAIL = tl.constexpr(-4.371139000186243e-08)
# ln(u) = e ln 2 + log1p(f) with u = 2^e (1 + f), 1 + f in [2/3, 4/3): log1p(f) = f - f^2 / 2 + f^3 P(f),
# P of degree 7 fitted here (relative minimax on [-1/3, 1/3]; ~1 fp32 ulp).
LN2 = tl.constexpr(0.6931471805599453)
LOG_C0 = tl.constexpr(0.3333320617675781)
LOG_C1 = tl.constexpr(-0.24999888241291046)
LOG_C2 = tl.constexpr(0.20010776817798615)
LOG_C3 = tl.constexpr(-0.16676408052444458)
LOG_C4 = tl.constexpr(0.1400090754032135)
LOG_C5 = tl.constexpr(-0.12240584194660187)
LOG_C6 = tl.constexpr(0.14005349576473236)
LOG_C7 = tl.constexpr(-0.12648257613182068)
# Minimax polynomials of sin(r) / r and cos(r) in r^2 on [-pi/4, pi/4] (the classic single-precision
# Cephes coefficients; error below one fp32 ulp there).
SIN_C1 = tl.constexpr(-1.6666654611e-1)
SIN_C2 = tl.constexpr(8.3321608736e-3)
SIN_C3 = tl.constexpr(-1.9515295891e-4)
COS_C1 = tl.constexpr(4.166664568298827e-2)
COS_C2 = tl.constexpr(-1.388731625493765e-3)
COS_C3 = tl.constexpr(2.443315711809948e-5)


@triton.jit
def _mulhilo(m: tl.constexpr, x):
    """(hi, lo) words of the 64-bit product m * x: one wide multiply instead of a high and a low one."""
    product = x.to(tl.uint64) * m
    return (product >> 32).to(tl.uint32), product.to(tl.uint32)


@triton.jit
def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 of uint32 counters (c0..c3) under uint32 key (k0, k1); returns four uint32 words."""
    for round_index in tl.static_range(10):
        if round_index > 0:
            k0 = k0 + PHILOX_W0
            k1 = k1 + PHILOX_W1
        hi0, lo0 = _mulhilo(PHILOX_M0, c0)
        hi1, lo1 = _mulhilo(PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


@triton.jit
def block_words(k0, k1, tensor_id, STREAM: tl.constexpr, blocks):
    """The four Philox words of counter blocks `blocks` (int64, any shape) of one tensor and stream.

    Block b covers elements 4b .. 4b + 3; its index is split into two 32-bit counter words, so element
    indices are 64-bit throughout.
    """
    c0 = (blocks & 0xFFFFFFFF).to(tl.uint32)
    c1 = (blocks >> 32).to(tl.uint32)
    c2 = tl.zeros_like(c0) + tensor_id.to(tl.uint32)
    c3 = tl.full(c0.shape, STREAM, tl.uint32)
    return philox4x32_10(c0, c1, c2, c3, k0.to(tl.uint32), k1.to(tl.uint32))


@triton.jit
def uniform_from_bits(word):
    """(2 * (x >> 9) + 1) * 2^-24, exact: the top 23 bits as the mantissa of a float in [1, 2), minus
    1 - 2^-24 (an exact subtraction). Strictly inside (0, 1); no integer-to-float conversion."""
    return ((word >> 9) | 0x3F800000).to(tl.float32, bitcast=True) - ONE_MINUS_HALF_ULP


@triton.jit
def _log_unit(u):
    """ln(u) for fastes' uniforms, normal floats in [2^-24, 1): no zero, denormal, inf or NaN to handle,
    which is what libdevice's logf spends a third of its instructions on."""
    bits = u.to(tl.int32, bitcast=True)
    exponent = (bits - 0x3F2AAAAB) >> 23  # arithmetic shift: u = 2^exponent * m, m in [2/3, 4/3)
    f = (bits - (exponent << 23)).to(tl.float32, bitcast=True) - 1.0  # exact
    p = tl.fma(LOG_C7, f, LOG_C6)
    p = tl.fma(p, f, LOG_C5)
    p = tl.fma(p, f, LOG_C4)
    p = tl.fma(p, f, LOG_C3)
    p = tl.fma(p, f, LOG_C2)
    p = tl.fma(p, f, LOG_C1)
    p = tl.fma(p, f, LOG_C0)
    log1p_f = tl.fma(f * f, tl.fma(f, p, -0.5), f)
    return tl.fma(exponent.to(tl.float32), LN2, log1p_f)


@triton.jit
def _cos_sin(angle):
    """(cos, sin) of an fp32 angle in [0, 2 pi]: exact reduction to [-pi/4, pi/4] plus a quadrant, then
    polynomials. About 1 ulp from correctly rounded; no table, no branch, no special-function unit."""
    shifted = tl.fma(angle, TWO_OVER_PI, ROUND_TO_INT)
    quadrant = shifted.to(tl.int32, bitcast=True)  # the rounded multiple of pi/2 in the low bits
    n = shifted - ROUND_TO_INT
    r = tl.fma(-n, HALF_PI_HEAD, angle)
    r = tl.fma(-n, HALF_PI_TAIL, r)
    z = r * r
    sin_r = tl.fma(r * z, tl.fma(tl.fma(SIN_C3, z, SIN_C2), z, SIN_C1), r)
    cos_r = tl.fma(z * z, tl.fma(tl.fma(COS_C3, z, COS_C2), z, COS_C1), tl.fma(z, -0.5, 1.0))
    # Quadrant q: (cos, sin)(r + q pi/2) = (cos_r, sin_r), (-sin_r, cos_r), (-cos_r, -sin_r), (sin_r, -cos_r).
    odd = (quadrant & 1) != 0
    cos_a = tl.where(odd, sin_r, cos_r)
    sin_a = tl.where(odd, cos_r, sin_r)
    cos_a = tl.where(((quadrant + 1) & 2) != 0, -cos_a, cos_a)
    sin_a = tl.where((quadrant & 2) != 0, -sin_a, sin_a)
    return cos_a, sin_a


@triton.jit
def box_muller(radius_word, angle_word):
    """Two standard normals r cos(a), r sin(a) with r = sqrt(-2 ln u(x_r)), a = 2 pi u(x_a) (fp32)."""
    radius = tl.sqrt(-2.0 * _log_unit(uniform_from_bits(radius_word)))
    cos_a, sin_a = _cos_sin(TWO_PI * uniform_from_bits(angle_word))
    return radius * cos_a, radius * sin_a


@triton.jit
def normals4(x0, x1, x2, x3):
    """The Gaussian noise type: lanes 0, 1 from words (x0, x1), lanes 2, 3 from (x2, x3)."""
    e0, e1 = box_muller(x0, x1)
    e2, e3 = box_muller(x2, x3)
    return e0, e1, e2, e3


@triton.jit
def uniforms4(x0, x1, x2, x3):
    """The uniform stream (stochastic rounding): lane j is u(x_j)."""
    return uniform_from_bits(x0), uniform_from_bits(x1), uniform_from_bits(x2), uniform_from_bits(x3)


@triton.jit
def lanes_to_tile(a0, a1, a2, a3, b0, b1, b2, b3, BLOCKS_PER_ROW: tl.constexpr):
    """Element order from lane order: [rows, 4 * BLOCKS_PER_ROW] from the four lanes of the first
    block of each row (a0..a3, [rows]) and, with 2 blocks per row, of the second (b0..b3).

    Lane j of a row's block v goes to element 4v + j. The dimensions `tl.join` adds live in each
    thread's registers, so this moves no data between threads (no shared memory, no barrier).
    """
    if BLOCKS_PER_ROW == 1:
        joined = tl.join(tl.join(a0, a2), tl.join(a1, a3))  # [rows, j // 2, j % 2]
        return tl.reshape(joined, (joined.shape[0], 4))
    else:
        low = tl.join(tl.join(a0, b0), tl.join(a2, b2))  # [rows, v, j // 2] for even j
        high = tl.join(tl.join(a1, b1), tl.join(a3, b3))
        joined = tl.join(low, high)  # [rows, v, j // 2, j % 2]
        return tl.reshape(joined, (joined.shape[0], 8))


@triton.jit
def tile_offsets(ROWS: tl.constexpr, BLOCKS_PER_ROW: tl.constexpr):
    """int32 element offsets of a [ROWS, 4 * BLOCKS_PER_ROW] tile relative to its first element."""
    width: tl.constexpr = 4 * BLOCKS_PER_ROW
    return tl.arange(0, ROWS)[:, None] * width + tl.arange(0, width)[None, :]


@triton.jit
def row_blocks(start, ROWS: tl.constexpr, BLOCKS_PER_ROW: tl.constexpr):
    """The first counter block of each row of that tile (int64 [ROWS]); `start` is a multiple of 4.
    The second block of a row, with 2 per row, is this plus one."""
    return start // 4 + tl.arange(0, ROWS).to(tl.int64) * BLOCKS_PER_ROW


@triton.jit
def normal_lanes(
    k0, k1, tensor_id, STREAM: tl.constexpr, start, ROWS: tl.constexpr, BLOCKS_PER_ROW: tl.constexpr
):
    """The normals of the [ROWS, 4 * BLOCKS_PER_ROW] tile of consecutive elements from `start`, in lane
    order: (a0, a1, a2, a3, b0, b1, b2, b3), each [ROWS] (b = a when one block per row).

    Kernels keep lanes until the branch that stores them, and put them in element order there
    (`lanes_to_tile`): interleaved before a branch, the compiler may convert the tile through shared
    memory for the masked path's layout on every path.
    """
    first = row_blocks(start, ROWS, BLOCKS_PER_ROW)
    a0, a1, a2, a3 = normals4(*block_words(k0, k1, tensor_id, STREAM, first))
    b0, b1, b2, b3 = a0, a1, a2, a3
    if BLOCKS_PER_ROW == 2:
        b0, b1, b2, b3 = normals4(*block_words(k0, k1, tensor_id, STREAM, first + 1))
    return a0, a1, a2, a3, b0, b1, b2, b3


@triton.jit
def uniform_lanes(
    k0, k1, tensor_id, STREAM: tl.constexpr, start, ROWS: tl.constexpr, BLOCKS_PER_ROW: tl.constexpr
):
    """The uniforms of the same tile in lane order: element e takes output word e % 4 of its block."""
    first = row_blocks(start, ROWS, BLOCKS_PER_ROW)
    a0, a1, a2, a3 = uniforms4(*block_words(k0, k1, tensor_id, STREAM, first))
    b0, b1, b2, b3 = a0, a1, a2, a3
    if BLOCKS_PER_ROW == 2:
        b0, b1, b2, b3 = uniforms4(*block_words(k0, k1, tensor_id, STREAM, first + 1))
    return a0, a1, a2, a3, b0, b1, b2, b3


@triton.jit
def normal_tile(
    k0, k1, tensor_id, STREAM: tl.constexpr, start, ROWS: tl.constexpr, BLOCKS_PER_ROW: tl.constexpr
):
    """fp32 normals of the [ROWS, 4 * BLOCKS_PER_ROW] tile of consecutive elements from `start`."""
    lanes = normal_lanes(k0, k1, tensor_id, STREAM, start, ROWS, BLOCKS_PER_ROW)
    return lanes_to_tile(*lanes, BLOCKS_PER_ROW)


@triton.jit
def bits_tile(k0, k1, tensor_id, STREAM: tl.constexpr, start, ROWS: tl.constexpr):
    """The raw uint32 stream of a [ROWS, 4] tile from `start`, for bit-exact tests against the reference."""
    x0, x1, x2, x3 = block_words(k0, k1, tensor_id, STREAM, row_blocks(start, ROWS, 1))
    return lanes_to_tile(x0, x1, x2, x3, x0, x1, x2, x3, 1)


@triton.jit
def normal_at(k0, k1, tensor_id, STREAM: tl.constexpr, elements):
    """fp32 normals of arbitrary int64 element indices (any shape): lane e % 4 of Philox block e // 4.

    For tiles whose elements are not runs of whole blocks (a weight tile whose row length is not a
    multiple of 4): each element computes its block's words and keeps its lane, 4x the Philox work.
    """
    x0, x1, x2, x3 = block_words(k0, k1, tensor_id, STREAM, elements >> 2)
    lane = elements & 3
    first_pair = lane < 2
    e_cos, e_sin = box_muller(tl.where(first_pair, x0, x2), tl.where(first_pair, x1, x3))
    return tl.where((lane & 1) == 0, e_cos, e_sin)


# ---------------------------------------------------------------------------------------------------
# Rademacher (sign) noise: one bit per element, 128 elements per Philox block (docs/noise.md section 6a)
# ---------------------------------------------------------------------------------------------------

SIGN_BLOCK = tl.constexpr(128)  # elements per Philox block of sign noise: 4 words x 32 bits
STREAM_SIGN = tl.constexpr(4)  # fastes.engine.noise.STREAM_SIGN
NOISE_GAUSSIAN = tl.constexpr(0)  # values of the kernels' NOISE argument (fastes.engine.noise.NOISES order)
NOISE_RADEMACHER = tl.constexpr(1)
NOISE_CODES = {"gaussian": 0, "rademacher": 1}


@triton.jit
def sign_mask_tile(k0, k1, tensor_id, STREAM: tl.constexpr, start, ROWS: tl.constexpr, WIDTH: tl.constexpr):
    """uint32 masks of the [ROWS, WIDTH] tile of consecutive elements from `start`: 0x80000000 where
    eps = -1, 0 where eps = +1 (the IEEE sign bit, applied with one xor by `with_sign`).

    `start` and ROWS * WIDTH are multiples of 128 and WIDTH divides 32. One Philox call per 128
    elements (`block_words` on sign blocks); its words, in order, hold the elements' bits least
    significant first. A row of WIDTH elements lies inside one word.
    """
    WORDS: tl.constexpr = ROWS * WIDTH // 32
    ROWS_PER_WORD: tl.constexpr = 32 // WIDTH
    blocks = start // SIGN_BLOCK + tl.arange(0, WORDS // 4).to(tl.int64)
    x0, x1, x2, x3 = block_words(k0, k1, tensor_id, STREAM, blocks)
    words = tl.reshape(tl.join(tl.join(x0, x2), tl.join(x1, x3)), (WORDS,))  # word 4b + w of block b
    bit = tl.arange(0, ROWS_PER_WORD)[:, None] * WIDTH + tl.arange(0, WIDTH)[None, :]  # in its word
    masks = (words[:, None, None] << (31 - bit).to(tl.uint32)[None, :, :]) & 0x80000000
    return tl.reshape(masks, (ROWS, WIDTH))


@triton.jit
def with_sign(value, mask):
    """fp32 `value` with its sign flipped where `mask` (from sign_mask_tile) is set: value * eps, exactly."""
    return (value.to(tl.uint32, bitcast=True) ^ mask).to(tl.float32, bitcast=True)


@triton.jit
def signed(value, mask):
    """The scalar `value` times each sign of a mask tile, as an fp32 tile: one xor per element."""
    return with_sign(tl.zeros(mask.shape, tl.float32) + value, mask)


@triton.jit
def sign_tile(k0, k1, tensor_id, STREAM: tl.constexpr, start, ROWS: tl.constexpr, WIDTH: tl.constexpr):
    """fp32 Rademacher signs (+1 / -1) of the [ROWS, WIDTH] tile from `start` (see sign_mask_tile)."""
    mask = sign_mask_tile(k0, k1, tensor_id, STREAM, start, ROWS, WIDTH)
    return with_sign(tl.full((ROWS, WIDTH), 1.0, tl.float32), mask)


@triton.jit
def sign_words_at(k0, k1, tensor_id, STREAM: tl.constexpr, word_starts):
    """The uint32 word holding the signs of elements w .. w + 31, for int64 starts w (multiples of 32)."""
    x0, x1, x2, x3 = block_words(k0, k1, tensor_id, STREAM, word_starts >> 7)
    word_index = (word_starts >> 5) & 3
    return tl.where(word_index < 2, tl.where(word_index == 0, x0, x1), tl.where(word_index == 2, x2, x3))


@triton.jit
def sign_at(k0, k1, tensor_id, STREAM: tl.constexpr, elements):
    """fp32 signs of arbitrary int64 element indices (any shape): each element computes its own block."""
    word = sign_words_at(k0, k1, tensor_id, STREAM, elements & ~31)
    bit = (word >> (elements & 31).to(tl.uint32)) & 1
    return 1.0 - 2.0 * bit.to(tl.float32)
