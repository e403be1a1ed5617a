"""The compiled CPU backend ("inductor"): the noise contract through torch.compile's C++ code generation.

It computes exactly what the eager reference (`fastes.noise`, `fastes.ops.*_reference`) specifies, in
bounded chunks: raw Philox words and uniforms are bit-identical to the reference, normals agree to float
tolerance (~1e-6: inductor's vectorised log/sin/cos are not torch's), so the weights of a run agree
with the reference's at float tolerance, not bit for bit. The reference stays the readable
specification and the test oracle.

How it stays fast:
- Philox runs on int32 lanes. AVX2 has no 64-bit multiply, so the reference's int64 products would be
  emulated one lane at a time; here each 32 x 32 -> 64-bit product is assembled from 16-bit halves in
  int32 arithmetic that wraps modulo 2^32 (native 8-lane multiplies).
- One compiled graph (normals, or raw words for the rounding stream), always on a chunk of CHUNK
  elements: the counters (block index words and tensor id of every Philox block), the stream and the
  round keys are tensor inputs, so new keys, tensors and tensor sizes reuse the compiled code. Small
  tensors share a chunk; a partly used chunk computes a few unused lanes.
- Sign noise (noise "rademacher", docs/noise.md 6a) has a second graph on the same chunks, whose
  counters are 128-element sign blocks (every slice on a 128-aligned lane); signs are exact, so its
  perturb and update equal the reference's bit for bit.
- The consumers (perturb, update, fill) run per chunk on chunk-sized slices: the weights are read and
  written once, and no temporary is larger than a chunk.
- inductor writes the thread count (torch.get_num_threads()) into the code; torch.compile guards on it,
  so another thread count compiles once more. Compiled code is cached on disk by inductor (see
  TORCHINDUCTOR_CACHE_DIR): later processes load it in seconds instead of compiling.

Where no C++ compiler is found, or compiling fails, `available()` turns False after one warning and
`fastes.ops` falls back to the eager reference.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from . import noise

CHUNK = 1 << 18  # elements per compiled call (1 MB of fp32): Python overhead per call stays small
BLOCKS = CHUNK // 4  # Philox blocks per chunk
_CACHED_PLAN_ELEMENTS = 1 << 22  # larger layouts build their counters per chunk instead of holding them

Key = tuple[int, int]


def _int32(value: int) -> int:
    """The int32 holding the bit pattern of uint32 `value`."""
    value &= noise.MASK32
    return value - (1 << 32) if value >= 1 << 31 else value


# ---------------------------------------------------------------------------------------------------
# The noise function on int32 lanes (traced and compiled; every value is a uint32 bit pattern)
# ---------------------------------------------------------------------------------------------------


def _mulhilo(m: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low words of the 64-bit product of the uint32 constant m and the words x (int32 lanes).

    lo is the wrapping int32 product. hi is assembled from 16-bit halves (Hacker's Delight, mulhu):
    every partial sum is below 2^32, so wrapping int32 arithmetic holds it exactly; `(v >> 16) & 0xFFFF`
    is the logical shift of a uint32 bit pattern.
    """
    m_hi, m_lo = m >> 16, m & 0xFFFF
    x_hi, x_lo = (x >> 16) & 0xFFFF, x & 0xFFFF
    t = m_hi * x_lo + ((m_lo * x_lo >> 16) & 0xFFFF)
    middle = m_lo * x_hi + (t & 0xFFFF)
    hi = m_hi * x_hi + ((t >> 16) & 0xFFFF) + ((middle >> 16) & 0xFFFF)
    return hi, x * _int32(m)


def _philox_words(counters: torch.Tensor, stream: torch.Tensor, round_keys: torch.Tensor):
    """Philox4x32-10 of counter (c0, c1, tensor id, stream) per block; round r uses round_keys[r]."""
    c0, c1, c2 = counters[0], counters[1], counters[2]
    c3 = stream.expand_as(c0)
    for r in range(noise.PHILOX_ROUNDS):
        hi0, lo0 = _mulhilo(noise.PHILOX_M0, c0)
        hi1, lo1 = _mulhilo(noise.PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ round_keys[r, 0], lo1, hi0 ^ c3 ^ round_keys[r, 1], lo0
    return c0, c1, c2, c3


def _uniform(word: torch.Tensor) -> torch.Tensor:
    """(2 (x >> 9) + 1) 2^-24 with a logical shift of the uint32 bit pattern."""
    return (((word >> 9) & 0x7FFFFF) * 2 + 1).to(torch.float32) * 2.0**-24


def _chunk(counters: torch.Tensor, stream: torch.Tensor, round_keys: torch.Tensor, raw: torch.Tensor):
    """Box-Muller normals of every block, lanes interleaved: [4 * blocks] fp32 (docs/noise.md section 6).

    With `raw` true the same lanes hold the raw output words instead, bit-cast to fp32. One graph serves
    both, so a process compiles once; the raw words are needed only once per update (rounding stream).
    """
    x0, x1, x2, x3 = _philox_words(counters, stream, round_keys)
    r01 = torch.sqrt(-2.0 * torch.log(_uniform(x0)))
    a01 = noise.TWO_PI * _uniform(x1)
    r23 = torch.sqrt(-2.0 * torch.log(_uniform(x2)))
    a23 = noise.TWO_PI * _uniform(x3)
    normals = (r01 * torch.cos(a01), r01 * torch.sin(a01), r23 * torch.cos(a23), r23 * torch.sin(a23))
    lanes = [torch.where(raw, x.view(torch.float32), z) for x, z in zip((x0, x1, x2, x3), normals)]
    return torch.stack(lanes, dim=1).reshape(-1)


def _sign_chunk(counters: torch.Tensor, stream: torch.Tensor, round_keys: torch.Tensor) -> torch.Tensor:
    """Rademacher signs of every sign block, [128 * blocks] fp32 +-1 (docs/noise.md section 6a).

    Element 128 b + 32 w + i is bit i of word w; the bit becomes the sign bit of 1.0 (no shift into the
    sign position of a signed int: the bit is negated and masked instead).
    """
    words = torch.stack(_philox_words(counters, stream, round_keys), dim=1)  # [blocks, 4]
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    bits = (words[:, :, None] >> shifts) & 1  # arithmetic shift; the & 1 keeps the wanted bit only
    sign_bits = (-bits) & -(2**31)
    return (sign_bits | 0x3F800000).view(torch.float32).reshape(-1)


def round_keys(key: Key) -> torch.Tensor:
    """The key schedule, [10, 2] int32: round r uses (k0 + r W0, k1 + r W1) mod 2^32."""
    k0, k1 = key
    return torch.tensor(
        [
            [_int32(k0 + r * noise.PHILOX_W0), _int32(k1 + r * noise.PHILOX_W1)]
            for r in range(noise.PHILOX_ROUNDS)
        ],
        dtype=torch.int32,
    )


# ---------------------------------------------------------------------------------------------------
# Compiling, once, with a fallback
# ---------------------------------------------------------------------------------------------------

_compiled: Callable | None = None
_compiled_sign: Callable | None = None
_compiler_checked = False
_unavailable: str | None = None  # why compiling is impossible here, once known


def _compile(fn: Callable) -> Callable:
    return torch.compile(fn, fullgraph=True, dynamic=False)


def _disable(reason: str) -> None:
    global _unavailable
    _unavailable = reason
    warnings.warn(
        f"fastes: the compiled CPU backend is unavailable ({reason}); using the eager torch reference, "
        "which is several times slower. Install a C++ compiler (g++ or clang++, or set CXX) to enable it, "
        "or pass backend='torch' to silence this warning.",
        RuntimeWarning,
        stacklevel=3,
    )


def available() -> bool:
    """Whether the compiled backend can run here: a C++ compiler is found and nothing failed to compile."""
    global _compiler_checked
    if not _compiler_checked:
        _compiler_checked = True
        try:
            from torch._inductor.cpp_builder import get_cpp_compiler

            get_cpp_compiler()
        except Exception as error:  # InvalidCxxCompiler, or an inductor too old to ask
            _disable(f"no C++ compiler for torch.compile: {type(error).__name__}: {error}".strip(": "))
    return _unavailable is None


class CompileUnavailable(RuntimeError):
    """Compiling failed here; the caller falls back to the reference (a warning was issued)."""


_ran = False  # the compiled graph has run in this process
_RAW = {False: torch.tensor(False), True: torch.tensor(True)}
_STREAMS = [torch.tensor(stream, dtype=torch.int32) for stream in range(7)]  # every fastes.noise stream


@torch.no_grad()
def _run(kind: str, counters: torch.Tensor, stream: int, keys: torch.Tensor) -> torch.Tensor:
    """One chunk through a compiled graph: "normal" gives fp32 normals, "words" int32 raw words (one
    graph), "sign" fp32 Rademacher signs (a second graph, on counters of 128-element sign blocks).

    The first call compiles. Every consumer makes it before writing anything, so when compiling fails
    (no toolchain, a broken one) nothing was written and the caller can fall back to the reference.
    """
    global _compiled, _compiled_sign, _ran
    try:
        stream_word = (
            _STREAMS[stream] if stream < len(_STREAMS) else torch.tensor(_int32(stream), dtype=torch.int32)
        )
        if kind == "sign":
            if _compiled_sign is None:
                _compiled_sign = _compile(_sign_chunk)
            out = _compiled_sign(counters, stream_word, keys)
        else:
            if _compiled is None:
                _compiled = _compile(_chunk)
            out = _compiled(counters, stream_word, keys, _RAW[kind == "words"])
    except Exception as error:
        if _ran:
            raise
        _compiled = _compiled_sign = None
        _disable(f"torch.compile failed: {type(error).__name__}: {str(error)[:300]}")
        raise CompileUnavailable(str(error)) from error
    _ran = True
    return out.view(torch.int32) if kind == "words" else out


# ---------------------------------------------------------------------------------------------------
# Chunk plans: which tensor slices each compiled call covers
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Piece:
    """One compiled call's worth of work: slices of one or more tensors packed into CHUNK lanes.

    `parts` lists (tensor index, first element, element count, first lane); `counters` is the [3, BLOCKS]
    int32 input (block index low and high words, tensor id), or None when built at use (large layouts).
    """

    parts: tuple[tuple[int, int, int, int], ...]
    counters: torch.Tensor | None


_BLOCK_INDEX = torch.arange(BLOCKS, dtype=torch.int32)


def _counters(
    parts: Sequence[tuple[int, int, int, int]], tensor_ids: Sequence[int], per_block: int = 4
) -> torch.Tensor:
    """The [3, CHUNK / per_block] int32 counter input of a chunk: block index low and high words, tensor
    id, for blocks of `per_block` elements (4: normals and words; 128: signs). Lanes are block-aligned.

    Unused blocks (a partly filled chunk) keep zero counters; their lanes are computed and ignored.
    """
    n_blocks = CHUNK // per_block
    words = (
        torch.zeros(3, n_blocks, dtype=torch.int32)
        if len(parts) > 1
        else torch.empty(3, n_blocks, dtype=torch.int32)
    )
    for index, start, n, lane in parts:
        first, count, block = lane // per_block, (n + per_block - 1) // per_block, start // per_block
        if len(parts) == 1 and (first or count < n_blocks):
            words.zero_()
        low, high = block & noise.MASK32, block >> 32
        if low + count <= 1 << 32:  # int32 addition wraps like uint32: the low words, exactly
            torch.add(_BLOCK_INDEX[:count], _int32(low), out=words[0, first : first + count])
            words[1, first : first + count] = _int32(high)
        else:  # the range crosses a multiple of 2^32 blocks: the high word steps inside it
            blocks = _BLOCK_INDEX[:count].to(torch.int64) + block
            words[0, first : first + count] = (blocks & noise.MASK32).to(torch.int32)
            words[1, first : first + count] = (blocks >> 32).to(torch.int32)
        words[2, first : first + count] = _int32(tensor_ids[index])
    return words


_plans: OrderedDict = OrderedDict()  # the last few plans, keyed by layout


def plan(numels: Sequence[int], tensor_ids: Sequence[int], per_block: int = 4) -> list[_Piece]:
    """Pack the tensors' elements into chunks: large tensors are cut at CHUNK, small ones share a chunk.

    Every slice starts on a Philox block (its first element is 0 or a multiple of CHUNK) of `per_block`
    elements (4, or 128 for signs) and on a lane that is a multiple of it, so the lanes of a chunk line
    up with whole blocks.
    """
    signature = (tuple(numels), tuple(tensor_ids), per_block)
    if signature in _plans:
        _plans.move_to_end(signature)
        return _plans[signature]
    keep_counters = sum(numels) <= _CACHED_PLAN_ELEMENTS  # counters cost 3 bytes per element
    pieces: list[_Piece] = []
    parts: list[tuple[int, int, int, int]] = []
    used = 0  # lanes used in the current chunk (a multiple of 4)

    def flush() -> None:
        counters = _counters(parts, tensor_ids, per_block) if keep_counters else None
        pieces.append(_Piece(tuple(parts), counters))
        parts.clear()

    for index, numel in enumerate(numels):
        for start in range(0, numel, CHUNK):
            n = min(CHUNK, numel - start)
            lanes = per_block * ((n + per_block - 1) // per_block)
            if used + lanes > CHUNK:
                flush()
                used = 0
            parts.append((index, start, n, used))
            used += lanes
    if parts:
        flush()
    _plans[signature] = pieces
    if len(_plans) > 16:
        _plans.popitem(last=False)
    return pieces


def _piece_counters(piece: _Piece, tensor_ids: Sequence[int], per_block: int = 4) -> torch.Tensor:
    return piece.counters if piece.counters is not None else _counters(piece.parts, tensor_ids, per_block)


def _noise_chunk(
    noise_kind: str, piece: _Piece, tensor_ids: Sequence[int], keys: torch.Tensor
) -> torch.Tensor:
    """eps of distribution `noise_kind` for the lanes of a chunk planned with its block size."""
    if noise_kind == "rademacher":
        return _run("sign", _piece_counters(piece, tensor_ids, noise.SIGN_BLOCK), noise.STREAM_SIGN, keys)
    return _run("normal", _piece_counters(piece, tensor_ids), noise.STREAM_NOISE, keys)


# ---------------------------------------------------------------------------------------------------
# The consumers: fill, perturb, update
# ---------------------------------------------------------------------------------------------------


def _stream_chunks(kind: str, key: Key, tensor_id: int, numel: int, offset: int, stream: int) -> torch.Tensor:
    if offset < 0 or numel < 0 or offset + numel > 2**66:
        raise ValueError(f"element range [{offset}, {offset + numel}) is outside [0, 2^66)")
    first = offset - offset % 4  # start on a Philox block
    total = offset + numel - first
    out = torch.empty(numel, dtype=torch.float32 if kind == "normal" else torch.int64)
    keys = round_keys(key)
    for start in range(0, total, CHUNK):
        n = min(CHUNK, total - start)
        lanes = _run(kind, _counters([(0, first + start, n, 0)], [tensor_id]), stream, keys)
        # chunk element i is stream element first + start + i; out[j] is stream element offset + j
        lo, hi = max(first + start, offset), first + start + n
        values = lanes[lo - first - start : hi - first - start]
        out[lo - offset : hi - offset] = values if kind == "normal" else values.to(torch.int64) & noise.MASK32
    return out


def normal(
    key: Key, tensor_id: int, numel: int, *, offset: int = 0, stream: int = noise.STREAM_NOISE
) -> torch.Tensor:
    """fp32 normals eps[offset : offset + numel] of `tensor_id` under `key`: noise.normal, compiled."""
    return _stream_chunks("normal", key, tensor_id, numel, offset, stream)


def words(
    key: Key, tensor_id: int, numel: int, *, offset: int = 0, stream: int = noise.STREAM_NOISE
) -> torch.Tensor:
    """Raw uint32 words (as int64) of elements [offset, offset + numel): element e takes word e % 4."""
    return _stream_chunks("words", key, tensor_id, numel, offset, stream)


def uniform(
    key: Key, tensor_id: int, numel: int, *, offset: int = 0, stream: int = noise.STREAM_ROUNDING
) -> torch.Tensor:
    """fp32 uniforms of elements [offset, offset + numel): exactly noise.uniform's."""
    return noise._uniform(words(key, tensor_id, numel, offset=offset, stream=stream))


@torch.no_grad()
def perturb(
    sources: Sequence[torch.Tensor],
    destinations: Sequence[torch.Tensor],
    tensor_ids: Sequence[int],
    key: Key,
    scale: float,
    noise_kind: str = "gaussian",
) -> None:
    """dst = (float32(src) + scale * eps(key, tensor id)) rounded to the tensor's dtype, chunk by chunk."""
    keys = round_keys(key)
    for piece in plan([t.numel() for t in sources], tensor_ids, noise.elements_per_block(noise_kind)):
        eps = _noise_chunk(noise_kind, piece, tensor_ids, keys)
        for index, start, n, lane in piece.parts:
            src = sources[index].view(-1)[start : start + n]
            dst = destinations[index].view(-1)[start : start + n]
            if src.dtype == torch.float32:
                torch.add(src, eps[lane : lane + n], alpha=scale, out=dst)
            else:
                dst.copy_(torch.add(src.to(torch.float32), eps[lane : lane + n], alpha=scale))


@torch.no_grad()
def es_update(
    params: Sequence[torch.Tensor],
    tensor_ids: Sequence[int],
    keys: Sequence[Key],
    weights: Sequence[float],
    *,
    coef: float,
    decay: float = 1.0,
    rounding_key: Key | None = None,
    grads: Sequence[torch.Tensor] | None = None,
    noise_kind: str = "gaussian",
) -> None:
    """theta = theta * decay + coef * sum_j w_j eps_j (or grad = coef * sum), chunk by chunk.

    Per chunk, every direction's noise is regenerated and summed in fp32 in direction order into a
    chunk-sized buffer, then each weight is read and written once.
    """
    schedules = [round_keys(k) for k in keys]
    rounding = None if rounding_key is None or grads is not None else round_keys(rounding_key)
    for piece in plan([p.numel() for p in params], tensor_ids, noise.elements_per_block(noise_kind)):
        total = torch.zeros(CHUNK, dtype=torch.float32)
        for schedule, w in zip(schedules, weights):
            total.add_(_noise_chunk(noise_kind, piece, tensor_ids, schedule), alpha=w)
        u = None
        if rounding is not None and any(params[i].dtype != torch.float32 for i, *_ in piece.parts):
            # The rounding stream has 4 elements per block; sign pieces' lanes are 128-aligned, so
            # 4-block counters at the same lanes give each element its uniform.
            counters = _counters(piece.parts, tensor_ids) if noise_kind == "rademacher" else None
            counters = _piece_counters(piece, tensor_ids) if counters is None else counters
            u = noise._uniform(
                _run("words", counters, noise.STREAM_ROUNDING, rounding).to(torch.int64) & noise.MASK32
            )
        for index, start, n, lane in piece.parts:
            param = params[index]
            step = total[lane : lane + n].mul(coef)
            if grads is not None:
                grads[index].view(-1)[start : start + n] = step
                continue
            flat = param.view(-1)[start : start + n]
            new = flat.to(torch.float32).mul(decay).add_(step)
            if u is not None and param.dtype != torch.float32:
                flat.copy_(noise.stochastic_round(new, param.dtype, u[lane : lane + n]))
            else:
                flat.copy_(new)
