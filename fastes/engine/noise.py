"""The noise contract in plain torch: the one definition every backend must reproduce.

Every ES perturbation is a pure function of (member key, tensor id, element index). This module is the
reference that defines it and runs on any device (backend "torch": the specification, test oracle and
fallback). The Triton kernels in `fastes.engine.kernels.philox` and the compiled CPU backend
`fastes.engine.cpu_library` implement the same stream; docs/noise.md is the written specification.

Integers are carried in int64 tensors holding uint32 values (torch has no full uint32 arithmetic);
products wrap modulo 2^64, which keeps both 32-bit words of every product exact (see _mulhilo).
"""

from __future__ import annotations

import functools
import hashlib
import math

import torch

# Philox4x32-10 constants (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011).
PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9  # key bump: golden ratio
PHILOX_W1 = 0xBB67AE85  # key bump: sqrt(3) - 1
PHILOX_ROUNDS = 10
MASK32 = 0xFFFFFFFF

# The fourth counter word says what a stream is for, so that no two uses ever share counters.
STREAM_NOISE = 0  # perturbation noise eps
STREAM_ROUNDING = 1  # uniforms for stochastic rounding of the update
STREAM_LOWRANK_A = 2  # low-rank factors A and B (fastes.engine.lowrank)
STREAM_LOWRANK_B = 3
STREAM_SIGN = 4  # Rademacher (sign) noise: never shares a counter with the Gaussian streams
STREAM_LOWRANK_SIGN_A = 5  # Rademacher low-rank factors A and B
STREAM_LOWRANK_SIGN_B = 6
DOMAIN_MEMBER_KEY = 0x4D454D42  # "MEMB": counter word 3 when deriving member keys from the run seed
DOMAIN_ROUNDING_KEY = 0x524F554E  # "ROUN": counter word 3 when deriving the stochastic-rounding key

# The distributions of eps: "gaussian" (Box-Muller, 4 elements per Philox block) or "rademacher" (+-1, one
# bit per element, 128 elements per Philox block).
NOISES = ("gaussian", "rademacher")
SIGN_BLOCK = 128  # elements per Philox block of sign noise: 4 words x 32 bits
_ONE_BITS = 0x3F800000  # the fp32 bit pattern of 1.0

# u = (2 * (x >> 9) + 1) * 2^-24: odd multiples of 2^-24, exact in fp32, strictly inside (0, 1).
_UNIFORM_SCALE = 2.0**-24
TWO_PI = 6.283185307179586


def _mulhilo(m: int, x: torch.Tensor | int) -> tuple[torch.Tensor | int, torch.Tensor | int]:
    """High and low 32-bit words of the 64-bit product m * x (m a uint32 constant, x a uint32 value).

    The product can exceed int64. Tensors: int64 multiplication wraps modulo 2^64 (two's complement),
    which keeps the low 64 bits exact, and both words are read from those bits; the known-answer tests
    pin this. Python ints are unbounded, so the same masks give the same words.
    """
    product = m * x
    return (product >> 32) & MASK32, product & MASK32


def _philox_rounds(c0, c1, c2, c3, k0, k1):
    """The ten rounds on uint32 values: Python ints or int64 tensors (the same operators serve both)."""
    for round_index in range(PHILOX_ROUNDS):
        if round_index > 0:
            k0 = (k0 + PHILOX_W0) & MASK32
            k1 = (k1 + PHILOX_W1) & MASK32
        hi0, lo0 = _mulhilo(PHILOX_M0, c0)
        hi1, lo1 = _mulhilo(PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def philox4x32(
    c0: torch.Tensor | int,
    c1: torch.Tensor | int,
    c2: torch.Tensor | int,
    c3: torch.Tensor | int,
    k0: torch.Tensor | int,
    k1: torch.Tensor | int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox4x32-10 of counter (c0, c1, c2, c3) under key (k0, k1).

    Arguments are uint32 values as ints or int64 tensors (broadcast together); returns the four output
    words as int64 tensors with values in [0, 2^32).
    """
    words = [torch.as_tensor(v, dtype=torch.int64) for v in (c0, c1, c2, c3, k0, k1)]
    device = next((w.device for w in words if w.dim() > 0), words[0].device)
    return _philox_rounds(*(w.to(device) & MASK32 for w in torch.broadcast_tensors(*words)))


def _split64(value: int) -> tuple[int, int]:
    if not 0 <= value < 2**64:
        raise ValueError(f"expected an integer in [0, 2^64), got {value}")
    return value & MASK32, value >> 32


def _derive_key(seed: int, c0: int, c1: int, c2: int, domain: int) -> tuple[int, int]:
    s0, s1 = _split64(seed)
    w0, w1, _, _ = _philox_rounds(c0, c1, c2, domain, s0, s1)  # plain ints: a key costs microseconds
    return w0, w1


@functools.lru_cache(maxsize=4096)  # each iteration asks for its members' keys several times (~15 us each)
def member_key(seed: int, generation: int, index: int) -> tuple[int, int]:
    """Philox key (k0, k1) of noise direction `index` in ES generation `generation` of run `seed`.

    With antithetic sampling, members 2j and 2j+1 share direction j (signs +1 and -1).
    """
    g0, g1 = _split64(generation)
    if not 0 <= index <= MASK32:
        raise ValueError(f"member index must be in [0, 2^32), got {index}")
    return _derive_key(seed, index, g0, g1, DOMAIN_MEMBER_KEY)


def rounding_key(seed: int, generation: int) -> tuple[int, int]:
    """Philox key of the stochastic-rounding uniforms used by the update of `generation`."""
    g0, g1 = _split64(generation)
    return _derive_key(seed, 0, g0, g1, DOMAIN_ROUNDING_KEY)


def tensor_id(name: str) -> int:
    """Stable 32-bit id of a tensor: the first 4 bytes of SHA-256(name), little-endian.

    Derived from the parameter's name alone, so a tensor's noise never depends on which other tensors
    are evolved or in what order they are listed.
    """
    return int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:4], "little")


def _uniform(word: torch.Tensor) -> torch.Tensor:
    """Map uint32 words to fp32 uniforms (2 * (x >> 9) + 1) * 2^-24, in [2^-24, 1 - 2^-24]."""
    return ((word >> 9) * 2 + 1).to(torch.float32) * _UNIFORM_SCALE


def _box_muller(u_radius: torch.Tensor, u_angle: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    radius = torch.sqrt(-2.0 * torch.log(u_radius))
    angle = TWO_PI * u_angle
    return radius * torch.cos(angle), radius * torch.sin(angle)


def _counter_words(
    numel: int, offset: int, device: torch.device | str, per_block: int = 4
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Block counters covering elements [offset, offset + numel): block b holds elements
    per_block * b .. per_block * (b + 1) - 1 (4 for normals and uniforms, SIGN_BLOCK for signs).

    Returns (low words, high words, first element of the first block, number of blocks).
    """
    if offset < 0 or numel < 0 or offset + numel > 2**66:
        raise ValueError(f"element range [{offset}, {offset + numel}) is outside [0, 2^66)")
    first_block = offset // per_block
    n_blocks = (offset + numel + per_block - 1) // per_block - first_block
    blocks = first_block + torch.arange(n_blocks, dtype=torch.int64, device=device)
    # Block indices above 2^63 would not fit int64; 2^64 blocks is far beyond any tensor anyway.
    return blocks & MASK32, blocks >> 32, first_block * per_block, n_blocks


def normal_from_counters(
    key: tuple[int, int], c0: torch.Tensor, c1: torch.Tensor, tensor: torch.Tensor | int, stream: int
) -> torch.Tensor:
    """The four normals of each Philox block (c0, c1, tensor, stream), flattened: [4 * blocks] fp32.

    Output words (x0, x1) give two normals by Box-Muller for lanes 0 and 1, (x2, x3) for lanes 2 and 3.
    Several tensors can share one call by passing a tensor of per-block tensor ids.
    """
    x0, x1, x2, x3 = philox4x32(c0, c1, tensor, stream, key[0], key[1])
    z0, z1 = _box_muller(_uniform(x0), _uniform(x1))
    z2, z3 = _box_muller(_uniform(x2), _uniform(x3))
    return torch.stack((z0, z1, z2, z3), dim=1).reshape(-1)


def normal(
    key: tuple[int, int],
    tensor: int,
    numel: int,
    *,
    offset: int = 0,
    stream: int = STREAM_NOISE,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Standard normals eps[offset : offset + numel] of tensor id `tensor` under member `key` (fp32).

    Element e uses lane e % 4 of Philox counter (e // 4 low word, e // 4 high word, tensor, stream).
    """
    c0, c1, start, _ = _counter_words(numel, offset, device)
    lanes = normal_from_counters(key, c0, c1, tensor, stream)
    return lanes[offset - start : offset - start + numel]


def uniform_from_counters(
    key: tuple[int, int], c0: torch.Tensor, c1: torch.Tensor, tensor: torch.Tensor | int, stream: int
) -> torch.Tensor:
    """fp32 uniforms of each Philox block, flattened: element 4b + j takes output word j of block b."""
    return _uniform(torch.stack(philox4x32(c0, c1, tensor, stream, key[0], key[1]), dim=1).reshape(-1))


def uniform(
    key: tuple[int, int],
    tensor: int,
    numel: int,
    *,
    offset: int = 0,
    stream: int = STREAM_ROUNDING,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """fp32 uniforms for elements [offset, offset + numel) of tensor id `tensor` under `key`."""
    c0, c1, start, _ = _counter_words(numel, offset, device)
    return uniform_from_counters(key, c0, c1, tensor, stream)[offset - start : offset - start + numel]


def sign_from_counters(
    key: tuple[int, int], c0: torch.Tensor, c1: torch.Tensor, tensor: torch.Tensor | int, stream: int
) -> torch.Tensor:
    """The 128 signs (+-1, fp32) of each sign block (c0, c1, tensor, stream), flattened: [128 * blocks].

    Element 128 b + 32 w + i takes bit i (least significant first) of output word w of block b; a set
    bit means -1, a clear bit +1 (the bit is the IEEE sign bit of eps).
    """
    words = torch.stack(philox4x32(c0, c1, tensor, stream, key[0], key[1]), dim=1)  # [blocks, 4]
    # int32 from here: the same 32 bits read as signed (exact), so that the expansion to one lane per
    # element moves 4 bytes per element rather than 8.
    words = (words - ((words >> 31) << 32)).to(torch.int32)
    to_sign_bit = (31 - torch.arange(32, dtype=torch.int32, device=words.device)).view(1, 1, 32)
    sign_bits = (words[:, :, None] << to_sign_bit) & -(2**31)  # bit i of the word -> bit 31 of lane i
    return (sign_bits | _ONE_BITS).view(torch.float32).reshape(-1)  # 1.0 with that sign bit


def rademacher(
    key: tuple[int, int],
    tensor: int,
    numel: int,
    *,
    offset: int = 0,
    stream: int = STREAM_SIGN,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Rademacher signs eps[offset : offset + numel] (+1 or -1, fp32) of tensor id `tensor` under `key`.

    Element e is bit e % 32 of word (e % 128) // 32 of Philox counter (e // 128 low word, e // 128 high
    word, tensor, stream): one Philox call gives 128 elements.
    """
    c0, c1, start, _ = _counter_words(numel, offset, device, SIGN_BLOCK)
    return sign_from_counters(key, c0, c1, tensor, stream)[offset - start : offset - start + numel]


def noise_from_counters(
    kind: str, key: tuple[int, int], c0: torch.Tensor, c1: torch.Tensor, tensor: torch.Tensor | int
) -> torch.Tensor:
    """eps of distribution `kind` for the blocks (c0, c1) on its perturbation stream (4 or 128 per block)."""
    if kind == "rademacher":
        return sign_from_counters(key, c0, c1, tensor, perturbation_stream(kind))
    return normal_from_counters(key, c0, c1, tensor, perturbation_stream(kind))


def perturbation_stream(kind: str) -> int:
    """The stream word of eps of distribution `kind`: STREAM_NOISE (normals) or STREAM_SIGN (signs)."""
    return STREAM_SIGN if kind == "rademacher" else STREAM_NOISE


def elements_per_block(kind: str) -> int:
    """How many elements of distribution `kind` one Philox block gives: 4 normals or 128 signs."""
    return SIGN_BLOCK if kind == "rademacher" else 4


def max_abs(kind: str) -> float:
    """The largest |eps| noise of distribution `kind` can take: signs 1; normals the Box-Muller radius of
    the smallest uniform, 2^-24 (5.77), plus 1% for the GPUs' approximate log and sqrt. ES refuses a step
    that this bound says could overflow the weights, before taking it."""
    if check_noise(kind) == "rademacher":
        return 1.0
    return 1.01 * math.sqrt(-2.0 * math.log(_UNIFORM_SCALE))


def check_noise(kind: str) -> str:
    if kind not in NOISES:
        raise ValueError(f"unknown noise {kind!r}; choose one of {NOISES}")
    return kind


def sample(
    kind: str, key: tuple[int, int], tensor: int, numel: int, *, offset: int = 0, device="cpu"
) -> torch.Tensor:
    """eps[offset : offset + numel] of distribution `kind` ("gaussian" or "rademacher"), fp32."""
    if check_noise(kind) == "rademacher":
        return rademacher(key, tensor, numel, offset=offset, device=device)
    return normal(key, tensor, numel, offset=offset, device=device)


def stochastic_round(value: torch.Tensor, dtype: torch.dtype, u: torch.Tensor) -> torch.Tensor:
    """Round fp32 `value` to `dtype` (bf16/fp16) up or down with probability given by the distance.

    Let q be the round-to-nearest result and n the neighbour of q on the other side of value; the result
    is n when u < |value - q| / |n - q|, else q. E[result] = value, and the same u gives the same result.
    """
    nearest = value.to(dtype)
    magnitude = nearest.abs()
    towards_zero = magnitude.to(torch.float32) > value.abs()
    # Adjacent magnitudes are adjacent integers in the bit pattern of a non-negative float.
    step = torch.where(towards_zero, -1, 1).to(torch.int16)
    neighbour_magnitude = (magnitude.view(torch.int16) + step).view(dtype)
    gap = (neighbour_magnitude.to(torch.float32) - magnitude.to(torch.float32)).abs()
    distance = (value.abs() - magnitude.to(torch.float32)).abs()
    take_neighbour = u * gap < distance  # u < distance / gap without a division (inf gap -> never)
    rounded = torch.where(take_neighbour, neighbour_magnitude, magnitude)
    return torch.where(value < 0, -rounded, rounded).where(torch.isfinite(value), nearest)
