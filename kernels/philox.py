"""The noise contract on the Triton side: one definition shared by every kernel.

Line for line the same stream as `fastes.noise` (the torch reference) and docs/noise.md. The Philox rounds
are written out here rather than taken from `tl.philox`/`tl.randn`, so that the bits -> uniform -> normal
mapping belongs to fastes and cannot change with the Triton version.
"""

import triton
import triton.language as tl

PHILOX_M0 = tl.constexpr(0xD2511F53)
PHILOX_M1 = tl.constexpr(0xCD9E8D57)
PHILOX_W0 = tl.constexpr(0x9E3779B9)
PHILOX_W1 = tl.constexpr(0xBB67AE85)
UNIFORM_SCALE = tl.constexpr(2.0**-24)
TWO_PI = tl.constexpr(6.283185307179586)


@triton.jit
def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 of uint32 counters (c0..c3) under uint32 key (k0, k1); returns four uint32 words."""
    for round_index in tl.static_range(10):
        if round_index > 0:
            k0 = k0 + PHILOX_W0
            k1 = k1 + PHILOX_W1
        m0 = tl.full(c0.shape, PHILOX_M0, tl.uint32)
        m1 = tl.full(c2.shape, PHILOX_M1, tl.uint32)
        hi0 = tl.umulhi(m0, c0)
        lo0 = m0 * c0
        hi1 = tl.umulhi(m1, c2)
        lo1 = m1 * c2
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


@triton.jit
def uniform_from_bits(word):
    """(2 * (x >> 9) + 1) * 2^-24: exact in fp32, strictly inside (0, 1)."""
    return ((word >> 9) * 2 + 1).to(tl.float32) * UNIFORM_SCALE


@triton.jit
def _block_words(k0, k1, tensor_id, STREAM: tl.constexpr, start, BLOCK: tl.constexpr):
    """Philox words of the BLOCK // 4 counter blocks covering elements [start, start + BLOCK).

    `start` is an int64 multiple of 4; block b = e // 4 is split into two 32-bit counter words, so element
    indices are 64-bit throughout.
    """
    blocks = start // 4 + tl.arange(0, BLOCK // 4).to(tl.int64)
    c0 = (blocks & 0xFFFFFFFF).to(tl.uint32)
    c1 = (blocks >> 32).to(tl.uint32)
    c2 = tl.zeros_like(c0) + tensor_id.to(tl.uint32)
    c3 = tl.full(c0.shape, STREAM, tl.uint32)
    return philox4x32_10(c0, c1, c2, c3, k0.to(tl.uint32), k1.to(tl.uint32))


@triton.jit
def _interleave4(a, b, c, d, BLOCK: tl.constexpr):
    """[a0, b0, c0, d0, a1, b1, ...]: lane j of block i goes to element 4i + j."""
    return tl.reshape(tl.join(tl.join(a, c), tl.join(b, d)), (BLOCK,))


@triton.jit
def normal_tile(k0, k1, tensor_id, STREAM: tl.constexpr, start, BLOCK: tl.constexpr):
    """fp32 standard normals of elements [start, start + BLOCK) of one tensor under one member key."""
    x0, x1, x2, x3 = _block_words(k0, k1, tensor_id, STREAM, start, BLOCK)
    r01 = tl.sqrt(-2.0 * tl.log(uniform_from_bits(x0)))
    a01 = TWO_PI * uniform_from_bits(x1)
    r23 = tl.sqrt(-2.0 * tl.log(uniform_from_bits(x2)))
    a23 = TWO_PI * uniform_from_bits(x3)
    return _interleave4(r01 * tl.cos(a01), r01 * tl.sin(a01), r23 * tl.cos(a23), r23 * tl.sin(a23), BLOCK)


@triton.jit
def uniform_tile(k0, k1, tensor_id, STREAM: tl.constexpr, start, BLOCK: tl.constexpr):
    """fp32 uniforms of elements [start, start + BLOCK): element e takes output word e % 4 of its block."""
    x0, x1, x2, x3 = _block_words(k0, k1, tensor_id, STREAM, start, BLOCK)
    return _interleave4(
        uniform_from_bits(x0), uniform_from_bits(x1), uniform_from_bits(x2), uniform_from_bits(x3), BLOCK
    )


@triton.jit
def bits_tile(k0, k1, tensor_id, STREAM: tl.constexpr, start, BLOCK: tl.constexpr):
    """The raw uint32 stream of elements [start, start + BLOCK), for bit-exact tests against the reference."""
    x0, x1, x2, x3 = _block_words(k0, k1, tensor_id, STREAM, start, BLOCK)
    return _interleave4(x0, x1, x2, x3, BLOCK)


@triton.jit
def normal_at(k0, k1, tensor_id, STREAM: tl.constexpr, elements):
    """fp32 normals of arbitrary int64 element indices (any shape): lane e % 4 of Philox block e // 4.

    Used where a tile's elements are not 4-aligned runs (e.g. a [BN, BK] tile of a weight matrix whose
    row length is not a multiple of 4); each element computes its block's four words and keeps its lane.
    """
    blocks = elements >> 2
    lane = elements & 3
    c0 = (blocks & 0xFFFFFFFF).to(tl.uint32)
    c1 = (blocks >> 32).to(tl.uint32)
    c2 = tl.zeros_like(c0) + tensor_id.to(tl.uint32)
    c3 = tl.full(c0.shape, STREAM, tl.uint32)
    x0, x1, x2, x3 = philox4x32_10(c0, c1, c2, c3, k0.to(tl.uint32), k1.to(tl.uint32))
    first_pair = lane < 2
    radius = tl.sqrt(-2.0 * tl.log(uniform_from_bits(tl.where(first_pair, x0, x2))))
    angle = TWO_PI * uniform_from_bits(tl.where(first_pair, x1, x3))
    return radius * tl.where((lane & 1) == 0, tl.cos(angle), tl.sin(angle))


# ---------------------------------------------------------------------------------------------------
# Rademacher (sign) noise: one bit per element, 128 elements per Philox block (docs/noise.md section 7b)
# ---------------------------------------------------------------------------------------------------

SIGN_BLOCK = tl.constexpr(128)  # elements per Philox block of sign noise: 4 words x 32 bits
STREAM_SIGN = tl.constexpr(4)  # fastes.noise.STREAM_SIGN
NOISE_GAUSSIAN = tl.constexpr(0)  # values of the kernels' NOISE argument (fastes.noise.NOISES order)
NOISE_RADEMACHER = tl.constexpr(1)
NOISE_CODES = {"gaussian": 0, "rademacher": 1}


@triton.jit
def sign_mask_tile(k0, k1, tensor_id, STREAM: tl.constexpr, start, BLOCK: tl.constexpr):
    """uint32 masks of elements [start, start + BLOCK): 0x80000000 where eps = -1, 0 where eps = +1.

    `start` and BLOCK are multiples of 128. One Philox call per 128 elements: its words, in order, hold
    the elements' bits least significant first; the bit lands in the IEEE sign position, so callers
    flip a float's sign with one xor (`with_sign`).
    """
    blocks = start // SIGN_BLOCK + tl.arange(0, BLOCK // SIGN_BLOCK).to(tl.int64)
    c0 = (blocks & 0xFFFFFFFF).to(tl.uint32)
    c1 = (blocks >> 32).to(tl.uint32)
    c2 = tl.zeros_like(c0) + tensor_id.to(tl.uint32)
    c3 = tl.full(c0.shape, STREAM, tl.uint32)
    x0, x1, x2, x3 = philox4x32_10(c0, c1, c2, c3, k0.to(tl.uint32), k1.to(tl.uint32))
    words = _interleave4(x0, x1, x2, x3, BLOCK // 32)  # word 4b + w: elements 128b + 32w .. + 31
    return _spread_bits(words, BLOCK // 32)


@triton.jit
def _spread_bits(words, WORDS: tl.constexpr):
    """[WORDS] uint32 -> [WORDS * 32] sign masks: element 32i + j takes bit j of word i, moved to bit 31."""
    shifts = (31 - tl.arange(0, 32)).to(tl.uint32)
    masks = (words[:, None] << shifts[None, :]) & 0x80000000
    return tl.reshape(masks, (WORDS * 32,))


@triton.jit
def with_sign(value, mask):
    """fp32 `value` with its sign flipped where `mask` (from sign_mask_tile) is set: value * eps, exactly."""
    return (value.to(tl.uint32, bitcast=True) ^ mask).to(tl.float32, bitcast=True)


@triton.jit
def sign_tile(k0, k1, tensor_id, STREAM: tl.constexpr, start, BLOCK: tl.constexpr):
    """fp32 Rademacher signs (+1 / -1) of elements [start, start + BLOCK) (multiples of 128)."""
    mask = sign_mask_tile(k0, k1, tensor_id, STREAM, start, BLOCK)
    return with_sign(tl.full((BLOCK,), 1.0, tl.float32), mask)


@triton.jit
def sign_at(k0, k1, tensor_id, STREAM: tl.constexpr, elements):
    """fp32 signs of arbitrary int64 element indices (any shape): each element computes its own block."""
    blocks = elements >> 7
    c0 = (blocks & 0xFFFFFFFF).to(tl.uint32)
    c1 = (blocks >> 32).to(tl.uint32)
    c2 = tl.zeros_like(c0) + tensor_id.to(tl.uint32)
    c3 = tl.full(c0.shape, STREAM, tl.uint32)
    x0, x1, x2, x3 = philox4x32_10(c0, c1, c2, c3, k0.to(tl.uint32), k1.to(tl.uint32))
    word_index = (elements >> 5) & 3
    word = tl.where(word_index < 2, tl.where(word_index == 0, x0, x1), tl.where(word_index == 2, x2, x3))
    bit = (word >> (elements & 31).to(tl.uint32)) & 1
    return 1.0 - 2.0 * bit.to(tl.float32)


@triton.jit
def sign_words_at(k0, k1, tensor_id, STREAM: tl.constexpr, word_starts):
    """The uint32 word holding the signs of elements w .. w + 31, for int64 starts w (multiples of 32)."""
    blocks = word_starts >> 7
    c0 = (blocks & 0xFFFFFFFF).to(tl.uint32)
    c1 = (blocks >> 32).to(tl.uint32)
    c2 = tl.zeros_like(c0) + tensor_id.to(tl.uint32)
    c3 = tl.full(c0.shape, STREAM, tl.uint32)
    x0, x1, x2, x3 = philox4x32_10(c0, c1, c2, c3, k0.to(tl.uint32), k1.to(tl.uint32))
    word_index = (word_starts >> 5) & 3
    return tl.where(word_index < 2, tl.where(word_index == 0, x0, x1), tl.where(word_index == 2, x2, x3))


@triton.jit
def scaled_noise_tile(k0, k1, tensor_id, start, scale, NOISE: tl.constexpr, BLOCK: tl.constexpr):
    """scale * eps for elements [start, start + BLOCK) on the perturbation stream of distribution NOISE.

    Sign noise multiplies exactly (a sign flip of `scale`), so it costs one xor per element after the
    Philox call that serves 128 elements.
    """
    if NOISE == NOISE_RADEMACHER:
        scales = tl.zeros((BLOCK,), tl.float32) + scale  # a tensor to bitcast, even for a Python float
        step = with_sign(scales, sign_mask_tile(k0, k1, tensor_id, STREAM_SIGN, start, BLOCK))
    else:
        step = scale * normal_tile(k0, k1, tensor_id, 0, start, BLOCK)
    return step
