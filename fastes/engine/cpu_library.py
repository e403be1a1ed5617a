"""The compiled CPU backend ("cpu"): the noise contract as a small C library, built once per machine.

It computes exactly what the eager reference (`fastes.engine.noise`, `fastes.engine.ops.*_reference`)
specifies, in bounded chunks: raw Philox words, uniforms and signs are bit-identical to the reference; normals
agree to float tolerance (within 2 ulps, ~1e-6: the library uses the Triton kernels' branch-free ln / cos /
sin, the reference torch's), so the weights of a run agree with the reference's at float tolerance, not bit
for bit. The reference stays the readable specification and the test oracle.

How it stays fast:
- fastes/engine/csrc/noise_cpu.c: Philox on four blocks per AVX2 register (one vpmuludq gives both words of
  four products; other CPUs get portable C that the compiler vectorises), Box-Muller on the tile's
  words, all in L1-sized tiles. Built with the system C compiler (cc, gcc or clang; $CC) for this
  CPU in well under a second, cached under `cache_dir()`, loaded with ctypes.
- The input is a small table of tensor slices (first Philox block, first lane, blocks, tensor id); the
  library makes every block's counter itself, so any key, tensor and size runs the same code (nothing
  is ever rebuilt) and no per-element counters are held. The slices come from the one chunk plan
  (`fastes.engine.chunks`): small tensors share a chunk; only the lanes in use are computed. Chunk-sized
  outputs go to reused per-thread buffers (a fresh megabyte per chunk costs page faults comparable to
  the noise itself).
- The update regenerates every direction's noise and sums it inside the library, tile by tile: one
  call per chunk, whatever the population; then each weight is read and written once.
- Threads: each call is split into block ranges over torch.get_num_threads() Python threads (ctypes
  releases the GIL), so torch.set_num_threads applies at once.

The same library holds the products the CPU's generation runs (sections at the end, each in torch's
own OpenMP threads): the materialised population's member matmul, and the products a model's linear
layers may take (the few-rows linear of decoding steps, the packed linear of many rows, each with the
low-rank population's term, and that term alone after torch's product); `fastes.engine.cpu_linear`
chooses among them and torch's own for this machine.

Where no C compiler is found, or building fails, `available()` turns False after one warning and
`fastes.engine.ops` falls back to the eager reference.
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import hashlib
import itertools
import math
import os
import platform
import shutil
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from . import chunks, noise

Key = tuple[int, int]


def _int32(value: int) -> int:
    """The int32 holding the bit pattern of uint32 `value`."""
    value &= noise.MASK32
    return value - (1 << 32) if value >= 1 << 31 else value


# ---------------------------------------------------------------------------------------------------
# The compiled library: built once per machine, cached on disk, called through ctypes
# ---------------------------------------------------------------------------------------------------

# The noise contract, the low-rank ES update (fastes.engine.lowrank.update), the materialised
# population's matmul (fastes.es.population.PopulationLinear) and the few-rows linear of late decoding
# steps (fastes.models.decoding_linears)
SOURCES = tuple(
    Path(__file__).with_name("csrc") / name
    for name in (
        "noise_cpu.c",
        "lowrank_cpu.c",
        "member_matmul_cpu.c",
        "few_rows_linear_cpu.c",
        "packed_linear_cpu.c",
    )
)
HEADERS = (Path(__file__).with_name("csrc") / "products.h",)  # included by sources: part of a build's hash
# No -ffast-math: the uniforms, the log's exponent split and the angle reduction rely on exact IEEE
# arithmetic; -ffp-contract=off leaves the source's explicit fmaf calls as the only fused multiply-adds,
# so the normals are the same bits on every CPU.
_FLAGS = ["-O3", "-std=c11", "-shared", "-fPIC", "-fno-math-errno", "-ffp-contract=off"]
_ARCH_FLAGS = {"x86_64": ["-march=native"], "AMD64": ["-march=native"], "aarch64": ["-mcpu=native"]}
# The products' threads (member_matmul, few_rows_linear, packed_linear): OpenMP's, in the runtime torch
# loaded. A compiler without OpenMP builds the library without it, and they run on the calling thread.
_OPENMP = ["-fopenmp"]
_POINTER, _I64, _U32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint32
_FLOAT = ctypes.c_float
# Every function starts (part table, [part addresses,] parts, first lane block, end lane block, stream
# word, round keys); see the signatures in noise_cpu.c.
_SIGNATURES = {
    "fastes_words": [_POINTER, _I64, _I64, _I64, _U32, _POINTER, _POINTER],
    "fastes_eps": [_POINTER, _I64, _I64, _I64, _U32, _POINTER, _I64, _POINTER],
    "fastes_eps_keys": [_POINTER, _I64, _I64, _I64, _U32, _POINTER, _I64, _I64, _POINTER, _I64],
    "fastes_eps_sum": [_POINTER, _I64, _I64, _I64, _U32, _POINTER, _POINTER, _I64, _I64, _POINTER],
    "fastes_perturb_f32": [_POINTER, _POINTER, _I64, _I64, _I64, _U32, _POINTER, _I64, _FLOAT],
    "fastes_update_f32": [_POINTER, _POINTER, _I64, _I64, _I64, _U32, _POINTER, _POINTER, _I64, _I64]
    + [_FLOAT, _FLOAT],
    # (w, a, b transposed, columns, a's columns, decay, first row, end row): lowrank_cpu.c
    "fastes_lowrank_update_f32": [_POINTER] * 3 + [_I64, _I64, _FLOAT, _I64, _I64],
    # (x, w, bias or NULL, y, row offsets, rows, k, n, members, inputs or NULL, outputs or NULL, rank,
    # threads): member_matmul_cpu.c
    "fastes_member_matmul_f32": [_POINTER] * 5 + [_I64] * 4 + [_POINTER] * 2 + [_I64] * 2,
    # (x, w, bias or NULL, y, rows, k, n, inputs, outputs or NULL, offsets, rank, members, threads):
    # few_rows_linear_cpu.c, packed_linear_cpu.c; (x, inputs, outputs, y, offsets, rows, k, n, rank,
    # members, threads): packed_linear_cpu.c
    "fastes_few_rows_linear_f32": [_POINTER] * 4 + [_I64] * 3 + [_POINTER] * 3 + [_I64] * 3,
    "fastes_packed_linear_f32": [_POINTER] * 4 + [_I64] * 3 + [_POINTER] * 3 + [_I64] * 3,
    "fastes_lowrank_term_f32": [_POINTER] * 5 + [_I64] * 6,
}

# the functions that return a value (the others return nothing)
_RESULTS = {
    "fastes_lowrank_update_f32": _FLOAT,
    "fastes_member_matmul_f32": _I64,
    "fastes_few_rows_linear_f32": _I64,
    "fastes_packed_linear_f32": _I64,
    "fastes_lowrank_term_f32": _I64,
}

_library: ctypes.CDLL | None = None
_unavailable: str | None = None  # why the library cannot be built here, once known


class CompileUnavailable(RuntimeError):
    """The compiled library cannot be built here (a warning was issued); use the reference."""


def cache_dir() -> Path:
    """Where built libraries are kept: $FASTES_CACHE_DIR, else $XDG_CACHE_HOME/fastes or ~/.cache/fastes."""
    if os.environ.get("FASTES_CACHE_DIR"):
        return Path(os.environ["FASTES_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fastes"


def _compiler() -> str:
    """$CC when set (it must work), else the first of cc, gcc, clang on PATH."""
    if os.environ.get("CC"):
        return os.environ["CC"]
    for name in ("cc", "gcc", "clang"):
        if shutil.which(name):
            return name
    raise FileNotFoundError("no C compiler found (tried cc, gcc, clang)")


def cpu_identity() -> str:
    """What -march=native depends on: the CPU model and feature flags (Linux), else the platform."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(
            sorted({line for line in lines if line.startswith(("model name", "flags", "Features"))})
        )
    except OSError:
        return platform.processor() + platform.machine()


def _build(compiler: str) -> Path:
    """Compile SOURCES for this machine (or reuse the cached build): the path of the shared library.

    Falls back to no OpenMP, then to portable flags, when the compiler refuses them. The file is written
    under a temporary name and renamed, so processes building at the same time never load a partial file.
    """
    source = b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    arch = _ARCH_FLAGS.get(platform.machine(), [])
    errors = []
    tried = [[*_FLAGS, *arch, *_OPENMP], [*_FLAGS, *arch], [*_FLAGS, *_OPENMP], _FLAGS]
    for flags in [f for i, f in enumerate(tried) if f not in tried[:i]]:
        identity = "\0".join([compiler, *flags, cpu_identity(), sys.platform]).encode()
        digest = hashlib.sha256(source + identity).hexdigest()[:16]
        path = cache_dir() / f"noise_cpu-{digest}.so"
        if path.exists():
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        done = subprocess.run(
            [compiler, *flags, *map(str, SOURCES), "-o", str(partial)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode == 0:
            os.replace(partial, path)
            return path
        partial.unlink(missing_ok=True)
        errors.append(
            done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"
        )
    raise RuntimeError(f"{compiler} failed: {errors[-1]}")


def _load() -> ctypes.CDLL:
    """The library, built on first use; raises CompileUnavailable (after one warning) where it cannot be."""
    global _library, _unavailable
    if _library is not None:
        return _library
    if _unavailable is None:
        try:
            library = ctypes.CDLL(str(_build(_compiler())))
            for name, argtypes in _SIGNATURES.items():
                getattr(library, name).argtypes = argtypes
                getattr(library, name).restype = _RESULTS.get(name)
            _library = library
            return library
        except (OSError, RuntimeError, subprocess.SubprocessError) as error:
            _unavailable = f"{type(error).__name__}: {error}"
            warnings.warn(
                f"fastes: the compiled CPU backend is unavailable ({_unavailable}); using the eager torch "
                "reference, which is several times slower. Install a C compiler (gcc or clang, or set CC; "
                "builds go to $FASTES_CACHE_DIR, default ~/.cache/fastes, which must be writable) to "
                "enable it, or pass backend='torch' to silence this warning.",
                RuntimeWarning,
                stacklevel=4,
            )
    raise CompileUnavailable(_unavailable)


def available() -> bool:
    """Whether the compiled backend runs here: the library is built (or cached) and loads."""
    try:
        _load()
    except CompileUnavailable:
        return False
    return True


# ---------------------------------------------------------------------------------------------------
# Calling it on a chunk, split across threads
# ---------------------------------------------------------------------------------------------------

_MIN_BLOCKS_PER_THREAD = 2048  # below this, starting a thread costs more than it saves
_pool: ThreadPoolExecutor | None = None


def _parallel(
    call: Callable[[int, int], None], n_blocks: int, min_per_thread: int = _MIN_BLOCKS_PER_THREAD
) -> None:
    """call(lo, hi) over lane blocks (or other units of work) [0, n_blocks) in up to
    torch.get_num_threads() contiguous ranges of at least `min_per_thread`.

    ctypes releases the GIL during a foreign call, so Python threads run the library in parallel; the
    calling thread takes the first range itself.
    """
    global _pool
    threads = min(torch.get_num_threads(), n_blocks // min_per_thread)
    if threads <= 1:
        call(0, n_blocks)
        return
    if _pool is None or _pool._max_workers < threads - 1:
        _pool = ThreadPoolExecutor(max_workers=threads - 1, thread_name_prefix="fastes-noise")
    step = -(-n_blocks // threads)
    bounds = [(lo, min(lo + step, n_blocks)) for lo in range(0, n_blocks, step)]
    futures = [_pool.submit(call, lo, hi) for lo, hi in bounds[1:]]
    call(*bounds[0])
    for future in futures:
        future.result()


_scratch_buffers = threading.local()  # per calling thread: two threads running ES never share one


def _scratch(kind: str, lanes: int) -> torch.Tensor:
    """A reused buffer of `lanes` values for one kind of output ("words": int32, else fp32; "total" is the
    update's sum). Allocating a fresh megabyte per chunk costs page faults comparable to the noise
    itself; callers use a chunk's buffer before asking for the next one of its kind."""
    buffers = _scratch_buffers.__dict__
    if kind not in buffers:
        buffers[kind] = torch.empty(chunks.CHUNK, dtype=torch.int32 if kind == "words" else torch.float32)
    return buffers[kind][:lanes]


def _run(
    kind: str,
    table: torch.Tensor,
    stream: int,
    keys: torch.Tensor,
    n_blocks: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Lane blocks [0, n_blocks) of a chunk through the library: "normal" gives fp32 normals, "words"
    int32 raw words, "sign" fp32 Rademacher signs (a table of 128-element sign blocks); lane order.
    Written into `out` when given (contiguous, of the right dtype and size), else a scratch buffer."""
    library = _load()
    per_block = noise.SIGN_BLOCK if kind == "sign" else 4
    out = _scratch(kind, per_block * n_blocks) if out is None else out
    stream_word, args = stream & noise.MASK32, (table.data_ptr(), len(table))

    def call(lo: int, hi: int) -> None:
        if kind == "words":
            library.fastes_words(*args, lo, hi, stream_word, keys.data_ptr(), out.data_ptr())
        else:
            library.fastes_eps(*args, lo, hi, stream_word, keys.data_ptr(), per_block, out.data_ptr())

    _parallel(call, n_blocks)
    return out


def _run_sum(
    noise_kind: str,
    table: torch.Tensor,
    keys: torch.Tensor,
    weights: torch.Tensor,
    total: torch.Tensor,
    n_blocks: int,
) -> None:
    """total[lanes] = sum_d weights[d] eps_d over lane blocks [0, n_blocks), in direction order (keys:
    [D, 10, 2]); one call covers every direction."""
    library, per_block = _load(), noise.elements_per_block(noise_kind)
    args = (keys.data_ptr(), weights.data_ptr(), len(weights), per_block, total.data_ptr())

    def call(lo: int, hi: int) -> None:
        library.fastes_eps_sum(
            table.data_ptr(), len(table), lo, hi, noise.perturbation_stream(noise_kind), *args
        )

    _parallel(call, n_blocks)


def transposed_columns(destination: torch.Tensor) -> int:
    """How the library writes a destination (fastes.engine.ops.perturb checks the layouts): 0 when it
    is contiguous, else its column count (it is the transpose of a contiguous 2-d tensor: the
    materialised layer's [in, out] buffers)."""
    return 0 if destination.is_contiguous() else destination.shape[1]


@functools.lru_cache(maxsize=64)
def _whole_tensors_table(
    numels: tuple[int, ...], tensor_ids: tuple[int, ...], per_block: int
) -> tuple[torch.Tensor, int]:
    """The part table of whole tensors laid end to end (no chunks: nothing is buffered) and its number
    of blocks, for one library call over all of them in place. ES asks for the same every generation."""
    starts, lanes = whole_tensors_lanes(numels, per_block)
    parts = [chunks.Part(index, 0, numel, start) for index, (numel, start) in enumerate(zip(numels, starts))]
    return _table(parts, tensor_ids, per_block), lanes // per_block


@functools.lru_cache(maxsize=64)
def whole_tensors_lanes(numels: tuple[int, ...], per_block: int = 4) -> tuple[tuple[int, ...], int]:
    """Where each of these tensors starts when laid end to end on whole Philox blocks of `per_block`
    lanes, and the lanes of all of them: the layout of one library call over whole tensors."""
    starts, lane = [], 0
    for numel in numels:
        starts.append(lane)
        lane += per_block * chunks.blocks(numel, per_block)
    return tuple(starts), lane


def _io_table(
    sources: Sequence[torch.Tensor],
    destinations: Sequence[torch.Tensor],
    twins: Sequence[torch.Tensor] | None = None,
) -> torch.Tensor:
    """The io table of `_whole_tensors_table`'s parts: a row per tensor, its source, destination and twin
    addresses, elements, destination layout (IO_COLUMNS in noise_cpu.c)."""
    io = []
    for index, (s, d) in enumerate(zip(sources, destinations)):
        twin_address = twins[index].data_ptr() if twins is not None else 0  # laid out as d (ops.perturb)
        io.append((s.data_ptr(), d.data_ptr(), s.numel(), twin_address, transposed_columns(d)))
    return torch.tensor(io, dtype=torch.int64)


def round_keys(key: Key) -> torch.Tensor:
    """The key schedule, [10, 2] int32: round r uses (k0 + r W0, k1 + r W1) mod 2^32."""
    return round_keys_of([key])[0]


def round_keys_of(keys: Sequence[Key]) -> torch.Tensor:
    """`round_keys` of each key, [len(keys), 10, 2], in one tensor."""
    return torch.tensor([_schedule(key) for key in keys], dtype=torch.int32).view(-1, noise.PHILOX_ROUNDS, 2)


@functools.lru_cache(maxsize=1024)  # a generation's keys are asked for by its evaluation and its update
def _schedule(key: Key) -> tuple[int, ...]:
    """round_keys(key), flattened: (k0, k1, k0 + W0, k1 + W1, ...) as int32 bit patterns."""
    k0, k1 = key
    rounds = range(noise.PHILOX_ROUNDS)
    return tuple(_int32(k + r * w) for r in rounds for k, w in ((k0, noise.PHILOX_W0), (k1, noise.PHILOX_W1)))


# ---------------------------------------------------------------------------------------------------
# The library's part table: which tensor slices each compiled call covers
# ---------------------------------------------------------------------------------------------------


def _table(parts: Sequence[chunks.Part], tensor_ids: Sequence[int], per_block: int) -> torch.Tensor:
    """The library's [parts, 4] int64 table for blocks of `per_block` elements (4: normals and words;
    128: signs): first block of the slice in its tensor (a uint64 carried as its int64 bit pattern: element
    offsets reach 2^66), first lane block, number of blocks, tensor id."""
    rows = []
    for index, start, n, lane in parts:
        block = start // per_block
        rows.append(
            (
                block - (1 << 64) if block >= 1 << 63 else block,
                lane // per_block,
                chunks.blocks(n, per_block),
                tensor_ids[index],
            )
        )
    return torch.tensor(rows, dtype=torch.int64)


@functools.lru_cache(maxsize=16)
def _planned(
    numels: tuple[int, ...], tensor_ids: tuple[int, ...], per_block: int
) -> tuple[tuple[chunks.Chunk, torch.Tensor], ...]:
    """Each chunk of the plan with its part table, built once per layout: ES asks for the same layout
    every generation, and building a 135M-parameter model's ~600 tables costs ~5 ms a pass."""
    plan = chunks.plan(numels, per_block)
    return tuple((chunk, _table(chunk.parts, tensor_ids, per_block)) for chunk in plan)


def _noise_chunk(noise_kind: str, table: torch.Tensor, lanes: int, keys: torch.Tensor) -> torch.Tensor:
    """eps of distribution `noise_kind` for the lanes of a chunk planned with its block size."""
    kind = "sign" if noise_kind == "rademacher" else "normal"
    stream, per_block = noise.perturbation_stream(noise_kind), noise.elements_per_block(noise_kind)
    return _run(kind, table, stream, keys, lanes // per_block)


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
    for start in range(0, total, chunks.CHUNK):
        n = min(chunks.CHUNK, total - start)
        table = _table([(0, first + start, n, 0)], [tensor_id], 4)
        if kind == "normal" and first == offset and n % 4 == 0:  # whole blocks, in place: no copy
            _run(kind, table, stream, keys, n // 4, out[start : start + n])
            continue
        lanes = _run(kind, table, stream, keys, chunks.blocks(n, 4))
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


def normals(key: Key, tensor_ids: Sequence[int], numels: Sequence[int], stream: int) -> list[torch.Tensor]:
    """normal(key, tensor_ids[i], numels[i], stream=stream) for every i, in as few library calls as the
    chunk plan packs them into (small tensors share a call): one call per tensor costs more than its noise.
    A tensor that lies whole in one chunk is a view of that chunk's lanes (as on a GPU, views of one
    buffer): a copy and an allocation per tensor cost a tiny model's factors more than their noise."""
    keys = round_keys(key)
    out: list[torch.Tensor | None] = [None] * len(numels)
    for chunk, table in _planned(tuple(numels), tuple(tensor_ids), 4):
        lanes = torch.empty(chunk.lanes, dtype=torch.float32)  # kept: the tensors below are views of it
        _run("normal", table, stream, keys, chunk.lanes // 4, lanes)
        for index, start, n, lane in chunk.parts:
            if n == numels[index]:
                out[index] = lanes[lane : lane + n]
                continue
            if out[index] is None:  # a large tensor, cut over several chunks
                out[index] = torch.empty(numels[index], dtype=torch.float32)
            out[index][start : start + n] = lanes[lane : lane + n]
    return [torch.empty(0, dtype=torch.float32) if t is None else t for t in out]


def normals_into(
    out: torch.Tensor, keys: Sequence[Key], tensor_ids: Sequence[int], numels: Sequence[int], stream: int
) -> None:
    """normal(keys[d], tensor_ids[i], numels[i], stream=stream) for every d and i, written into row d of
    `out` (fp32 [len(keys), whole_tensors_lanes(numels)[1]], its rows contiguous, any row stride) from
    `whole_tensors_lanes(numels)[0][i]` on, in one library call: the low-rank factors of all of a model's
    matrices in every direction (fastes.engine.lowrank.direction_factors; a call a direction cost ~10 us
    each). The lanes between tensors hold more of each tensor's stream."""
    if out.dtype != torch.float32 or out.shape[0] != len(keys) or out.stride(1) != 1:
        raise ValueError(
            f"normals_into: out {tuple(out.shape)} is not fp32 [keys, lanes] with contiguous rows"
        )
    table, n_blocks = _whole_tensors_table(tuple(numels), tuple(tensor_ids), 4)
    if out.shape[1] != 4 * n_blocks:
        raise ValueError(f"normals_into: out has {out.shape[1]} lanes a key, the tensors take {4 * n_blocks}")
    library, schedules, stream_word = _load(), round_keys_of(keys), stream & noise.MASK32
    arguments = (len(keys), 4, out.data_ptr(), out.stride(0))

    def call(lo: int, hi: int) -> None:
        library.fastes_eps_keys(
            table.data_ptr(), len(table), lo, hi, stream_word, schedules.data_ptr(), *arguments
        )

    _parallel(call, n_blocks, max(1, _MIN_BLOCKS_PER_THREAD // max(1, len(keys))))


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


def library_perturbs(sources: Sequence[torch.Tensor]) -> bool:
    """Whether these sources take `perturb_each`'s one library call (all fp32), which writes transposed
    destinations and twins itself; else `perturb`, chunk by chunk."""
    return all(t.dtype == torch.float32 for t in sources)


@torch.no_grad()
def perturb(
    sources: Sequence[torch.Tensor],
    destinations: Sequence[torch.Tensor],
    tensor_ids: Sequence[int],
    key: Key,
    scale: float,
    noise_kind: str = "gaussian",
) -> None:
    """dst = (float32(src) + scale * eps(key, tensor id)) rounded to the tensor's dtype, for sources that
    are not all fp32 (all fp32 take `perturb_each`'s one library call, twins and transposed destinations
    included): chunk by chunk into contiguous destinations (fastes.engine.ops.perturb makes a second call
    for twins), the library's noise, then torch's rounding to the tensor's dtype.
    """
    keys = round_keys(key)
    per_block = noise.elements_per_block(noise_kind)
    for chunk, table in _planned(tuple(t.numel() for t in sources), tuple(tensor_ids), per_block):
        eps = _noise_chunk(noise_kind, table, chunk.lanes, keys)
        for index, start, n, lane in chunk.parts:
            src = sources[index].view(-1)[start : start + n]
            dst = destinations[index].view(-1)[start : start + n]
            if src.dtype == torch.float32:
                torch.add(src, eps[lane : lane + n], alpha=scale, out=dst)
            else:
                dst.copy_(torch.add(src.to(torch.float32), eps[lane : lane + n], alpha=scale))


@torch.no_grad()
def perturb_each(
    sources: Sequence[torch.Tensor],
    tensor_ids: Sequence[int],
    writes: Sequence[tuple[Key, float, Sequence[torch.Tensor], Sequence[torch.Tensor] | None]],
    noise_kind: str = "gaussian",
) -> None:
    """`perturb` of fp32 sources (`library_perturbs`) for each (key, scale, destinations, twins) of
    `writes`, in one library pass over all their tiles (the noise of a tile never leaves L1), split over
    the threads as one range: one member of a small model is too little work to split, several side
    by side are not. A destination may be the transpose of a contiguous tensor (`transposed_columns`),
    and twins are written in the same pass."""
    library = _load()
    per_block = noise.elements_per_block(noise_kind)
    table, n_blocks = _whole_tensors_table(tuple(t.numel() for t in sources), tuple(tensor_ids), per_block)
    stream = noise.perturbation_stream(noise_kind)
    calls = []
    for key, scale, destinations, twins in writes:
        io, keys = _io_table(sources, destinations, twins), round_keys(key)

        def call(
            lo: int, hi: int, io: torch.Tensor = io, keys: torch.Tensor = keys, scale: float = scale
        ) -> None:
            library.fastes_perturb_f32(
                table.data_ptr(), io.data_ptr(), len(table), lo, hi, stream, keys.data_ptr(), per_block, scale
            )

        calls.append(call)
    if n_blocks:
        _parallel(_one_range(calls, n_blocks), n_blocks * len(calls))


def _one_range(calls: Sequence[Callable[[int, int], None]], n_blocks: int) -> Callable[[int, int], None]:
    """call(lo, hi) over [0, len(calls) * n_blocks): the calls' block ranges laid end to end, each call
    given the part of [lo, hi) that falls in its own [0, n_blocks)."""

    def call(lo: int, hi: int) -> None:
        for index in range(lo // n_blocks, -(-hi // n_blocks)):
            start = index * n_blocks
            calls[index](max(lo - start, 0), min(hi - start, n_blocks))

    return call


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
    """theta = theta * decay + coef * sum_j w_j eps_j (or grad = coef * sum).

    The library regenerates every direction's noise per L1-sized tile and sums it in fp32 in direction
    order. All fp32 (and no grads): one call over every tensor applies it in place, each weight read and
    written once. Otherwise chunk by chunk: the library's sums, then torch's rounding (nearest or
    stochastic) to the tensor's dtype, or the gradient.
    """
    schedules = torch.stack([round_keys(k) for k in keys])
    weight_column = torch.tensor(list(weights), dtype=torch.float32)
    rounding = None if rounding_key is None or grads is not None else round_keys(rounding_key)
    per_block = noise.elements_per_block(noise_kind)
    if grads is None and all(p.dtype == torch.float32 for p in params):
        library = _load()
        table, n_blocks = _whole_tensors_table(tuple(p.numel() for p in params), tuple(tensor_ids), per_block)
        io = _io_table(params, params)
        args = (
            noise.perturbation_stream(noise_kind),
            schedules.data_ptr(),
            weight_column.data_ptr(),
            len(weights),
        )

        def call(lo: int, hi: int) -> None:
            library.fastes_update_f32(
                table.data_ptr(), io.data_ptr(), len(table), lo, hi, *args, per_block, coef, decay
            )

        _parallel(call, n_blocks)
        return
    for chunk, table in _planned(tuple(p.numel() for p in params), tuple(tensor_ids), per_block):
        total = _scratch("total", chunk.lanes)
        _run_sum(noise_kind, table, schedules, weight_column, total, chunk.lanes // per_block)
        u = None
        if rounding is not None and any(params[i].dtype != torch.float32 for i, *_ in chunk.parts):
            # The rounding stream has 4 elements per block; sign chunks' lanes are 128-aligned, so a
            # 4-element table at the same lanes gives each element its uniform.
            words_table = _table(chunk.parts, tensor_ids, 4) if noise_kind == "rademacher" else table
            words = _run("words", words_table, noise.STREAM_ROUNDING, rounding, chunk.lanes // 4)
            u = noise._uniform(words.to(torch.int64) & noise.MASK32)
        for index, start, n, lane in chunk.parts:
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


# ---------------------------------------------------------------------------------------------------
# The low-rank ES update
# ---------------------------------------------------------------------------------------------------

_LOWRANK_MIN_FLOPS_PER_THREAD = 1 << 20  # below this, a thread costs more than it saves


def lowrank_update(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, decay: float) -> float:
    """w = w * decay + a @ b.T in place, one pass over w (fp32, contiguous): w [rows, cols], a [rows, K],
    b [cols, K]. Returns max |w| after the update (NaN if w holds NaN or inf). See csrc/lowrank_cpu.c."""
    return lowrank_update_all([(w, a, b)], decay)[0]


def lowrank_update_all(
    updates: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], decay: float
) -> list[float]:
    """`lowrank_update(w, a, b, decay)` for every (w, a, b), all tensors' rows split over the threads at
    once: a model has hundreds of weights, and a hand-off to a thread per weight costs as much as the
    pass over a small one. Returns each w's max |w| after the update (NaN if it holds NaN or inf)."""
    if not updates:
        return []
    library = _load()
    calls = [(w.data_ptr(), a.contiguous(), b.T.contiguous(), w.shape[1]) for w, a, b in updates]
    ends = list(itertools.accumulate(w.shape[0] for w, _, _ in updates))  # tensor i: global rows < ends[i]
    largest: list[list[float]] = [[] for _ in updates]

    def call(lo: int, hi: int) -> None:  # global rows [lo, hi), tensor by tensor
        index = bisect.bisect_right(ends, lo)
        while lo < hi:
            start = ends[index - 1] if index else 0
            w, a, bt, cols = calls[index]
            end = min(hi, ends[index])
            rank = a.shape[1]
            result = library.fastes_lowrank_update_f32(
                w, a.data_ptr(), bt.data_ptr(), cols, rank, decay, lo - start, end - start
            )
            largest[index].append(result)
            lo, index = end, index + 1

    flops_per_row = 2 * sum(w.numel() * a.shape[1] for w, a, _ in updates) / ends[-1]
    _parallel(call, ends[-1], max(1, int(_LOWRANK_MIN_FLOPS_PER_THREAD / flops_per_row)))
    return [
        math.nan if any(math.isnan(m) for m in values) else max(values, default=0.0) for values in largest
    ]


# ---------------------------------------------------------------------------------------------------
# The materialised population's matmul
# ---------------------------------------------------------------------------------------------------


_MATMUL_MIN_FLOPS_PARALLEL = 1 << 19  # below this, waking torch's threads costs more than it saves


def _matmul_threads(rows: int, k: int, n: int) -> int:
    """The OpenMP threads for a product of [rows, k] and [k, n]: torch's count, or one when it is small."""
    return torch.get_num_threads() if 2 * rows * k * n >= _MATMUL_MIN_FLOPS_PARALLEL else 1


def _matmul_operands(
    name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x and the bias, contiguous, for the library's products, which take fp32 CPU tensors and a weight
    read where it lies (contiguous). The caller holds them while the library reads them."""
    tensors = [x, weight] if bias is None else [x, weight, bias]
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors) or not weight.is_contiguous():
        raise ValueError(f"{name} takes fp32 CPU tensors and a contiguous weight")
    return x.contiguous(), None if bias is None else bias.contiguous()


def member_matmul(
    x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x[i] @ w[m] (+ bias) for the rows offsets[m] <= i < offsets[m + 1] of x [rows, k]: torch.bmm over
    the members' row groups, which may differ in size. w [members, k, n] (contiguous), offsets int64
    [members + 1] from 0 to rows, bias [n]; fp32 on the CPU. See csrc/member_matmul_cpu.c for why it can
    be faster than torch's batched matmul at these sizes; `cpu_linear.products` says whether it is on
    this machine. A layer that applies the same weights at every token holds a `MemberMatmul`.

    It runs in torch's own OpenMP threads (torch.get_num_threads() of them): the library is built with
    -fopenmp and so links libgomp.so.1, which the loader finds already loaded with torch. Threads of our
    own beside torch's pool contended with its spinning threads (SmolLM2's materialised generation at
    0.62x of plain generation, against 0.96x with torch.bmm: docs/results/member-matmul-2026-12-06.md)."""
    if x.dim() != 2:
        raise ValueError(f"member_matmul: x {tuple(x.shape)} is not [rows, k]")
    return MemberMatmul(w, bias)(x, offsets)


class MemberMatmul:
    """x[i] @ w_m (+ bias) for the rows of each member m (offsets[m] <= i < offsets[m + 1]), with the
    weights and bias checked once: a population layer applies the same weights at every token, where the
    checks and reshapes around the library's call cost more than the call itself at a tiny model's
    decoding steps (docs/results/tiny-lowrank-2026-12-07.md).

    The members' weights are `weights` [members, k, n], or, with `factors` (inputs [members, r, k] and
    outputs [members, r, n], the members' scales folded in), weights [k, n] that every member shares
    and member m's w + sum_j inputs[m, j]^T outputs[m, j]: its term added to its rows' sums, or for a
    member with many rows its weight formed once (csrc/member_matmul_cpu.c). fp32, contiguous, on the
    CPU; bias [n]. The tensors must not be resized or moved while in use."""

    __slots__ = ("weights", "bias", "factors", "_arguments")

    def __init__(
        self,
        weights: torch.Tensor,
        bias: torch.Tensor | None = None,
        factors: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        k, n = weights.shape[-2:] if weights.dim() >= 2 else (-1, -1)
        members = factors[0].shape[0] if factors is not None else weights.shape[0]
        inputs, outputs = factors if factors is not None else (None, None)
        expected = (
            weights.dim() == (2 if factors is not None else 3)
            and (bias is None or bias.shape == (n,))
            and (
                factors is None
                or (
                    inputs.dim() == 3
                    and inputs.shape[::2] == (members, k)
                    and outputs.shape == (members, inputs.shape[1], n)
                )
            )
        )
        if not expected:
            shapes = ", ".join(
                f"{name} {None if t is None else tuple(t.shape)}"
                for name, t in (("w", weights), ("bias", bias), ("inputs", inputs), ("outputs", outputs))
            )
            raise ValueError(
                f"member_matmul: {shapes} are not [members, k, n] and [n] (or [k, n], [n], [members, r, k] "
                "and [members, r, n] with factors)"
            )
        tensors = [t for t in (weights, bias, inputs, outputs) if t is not None]
        if any(t.dtype != torch.float32 or not t.is_cpu or not t.is_contiguous() for t in tensors):
            raise ValueError("member_matmul takes contiguous fp32 CPU tensors")
        self.weights, self.bias, self.factors = weights, bias, factors
        addresses = [None if t is None else t.data_ptr() for t in (weights, bias, inputs, outputs)]
        rank = 0 if inputs is None else inputs.shape[1]
        self._arguments = (*addresses, members, k, n, rank)

    def __call__(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """y [..., n] for x [..., k] (its rows flattened: member m's are offsets[m] <= i < offsets[m + 1])."""
        weights, bias, inputs, outputs, members, k, n, rank = self._arguments
        if x.shape[-1] != k or offsets.shape != (members + 1,):
            raise ValueError(
                f"member_matmul: x {tuple(x.shape)}, w {tuple(self.weights.shape)} and offsets "
                f"{tuple(offsets.shape)} do not match"
            )
        if x.dtype != torch.float32 or not x.is_cpu:
            raise ValueError("member_matmul takes contiguous fp32 CPU tensors")
        if offsets.dtype != torch.int64 or not offsets.is_contiguous():
            raise ValueError("member_matmul takes the row offsets as a contiguous int64 tensor")
        x = x.contiguous()
        rows = x.numel() // k
        y = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
        threads = _matmul_threads(rows, k, n)
        status = _load().fastes_member_matmul_f32(
            x.data_ptr(),
            weights,
            bias,
            y.data_ptr(),
            offsets.data_ptr(),
            rows,
            k,
            n,
            members,
            inputs,
            outputs,
            rank,
            threads,
        )
        if status == -2:
            raise ValueError(f"member_matmul: the row offsets {offsets.tolist()} do not split {rows} rows")
        if status == -1:
            raise MemoryError(
                f"member_matmul could not allocate its buffers ({rows} x {rank} products, the {rows} rows' "
                "members)"
            )
        return y


# ---------------------------------------------------------------------------------------------------
# Products for a model's linear layers, with or without the low-rank population's term (which of them
# a layer takes on this machine: fastes.engine.cpu_linear)
# ---------------------------------------------------------------------------------------------------


class LowRankTerm:
    """The members' rank-r term of a low-rank population layer: row i of member m (offsets[m] <= i <
    offsets[m + 1]) gets (x[i] . inputs[m, j]) outputs[m, j] for each j < r. inputs [members, r, in],
    outputs [members, r, out] (the members' scales folded in), offsets int64 [members + 1] from 0 to
    the rows; all contiguous, on the CPU.

    A layer makes one per grouping of its rows and passes it at every decoding step: the checks run on
    its first use (`arguments`) and their answer is kept. (Made and checked at every call, the term cost
    62 us a call at SmolLM2's decoding steps, 31 us since: docs/results/population-overheads-2026-12-07.md,
    section 1.) The tensors must not be resized or moved while the term is in use."""

    __slots__ = ("inputs", "outputs", "offsets", "_checked")

    def __init__(self, inputs: torch.Tensor, outputs: torch.Tensor, offsets: torch.Tensor) -> None:
        self.inputs, self.outputs, self.offsets = inputs, outputs, offsets
        self._checked: tuple[int, int, tuple] | None = None  # (k, n, the library's arguments)

    def arguments(self, name: str, k: int, n: int) -> tuple:
        """(inputs, outputs, offsets, rank, members) as the library takes them (addresses), the term
        checked against a product of width k and n on its first use with them; `name` is the caller's,
        for the error."""
        if self._checked is None or self._checked[:2] != (k, n):
            self._checked = (k, n, self._check(name, k, n))
        return self._checked[2]

    def _check(self, name: str, k: int, n: int) -> tuple:
        members, rank = self.inputs.shape[:2]
        if (
            self.inputs.shape != (members, rank, k)
            or self.outputs.shape != (members, rank, n)
            or self.offsets.shape != (members + 1,)
        ):
            raise ValueError(
                f"{name}: the term's inputs {tuple(self.inputs.shape)}, outputs {tuple(self.outputs.shape)} "
                f"and offsets {tuple(self.offsets.shape)} do not match a product of {k} inputs and {n} "
                "outputs"
            )
        if not all(
            t.dtype == torch.float32 and t.is_cpu and t.is_contiguous() for t in (self.inputs, self.outputs)
        ):
            raise ValueError(f"{name} takes the term's factors as contiguous fp32 CPU tensors")
        if self.offsets.dtype != torch.int64 or not self.offsets.is_contiguous():
            raise ValueError(f"{name} takes the term's row offsets as a contiguous int64 tensor")
        addresses = (t.data_ptr() for t in (self.inputs, self.outputs, self.offsets))
        return (*addresses, rank, members)


def _term_arguments(name: str, term: LowRankTerm | None, k: int, n: int) -> tuple:
    """The term's arguments for the library (`LowRankTerm.arguments`); None and zeros without a term."""
    return (None, None, None, 0, 0) if term is None else term.arguments(name, k, n)


def _offsets_refused(name: str, term: LowRankTerm, rows: int) -> ValueError:
    return ValueError(f"{name}: the term's row offsets {term.offsets.tolist()} do not split {rows} rows")


def _linear_product(
    name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, term: LowRankTerm | None
) -> tuple[torch.Tensor, int]:
    """(y, the library's status) of fastes_<name>_f32, the few-rows or packed linear of x [rows, k] and an
    nn.Linear weight [n, k] with `term`; offsets that do not split the rows (status -2) raise here."""
    (rows, k), n = x.shape, weight.shape[0]
    x, bias = _matmul_operands(name, x, weight, bias)
    y = torch.empty(rows, n, dtype=torch.float32)
    status = getattr(_load(), f"fastes_{name}_f32")(
        x.data_ptr(),
        weight.data_ptr(),
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        rows,
        k,
        n,
        *_term_arguments(name, term, k, n),
        _matmul_threads(rows, k, n),
    )
    if status == -2:
        raise _offsets_refused(name, term, rows)
    return y, status


FEW_ROWS = 8  # the input rows one pass of few_rows_linear serves (FEW_ROWS in csrc/few_rows_linear_cpu.c)


def few_rows_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, term: LowRankTerm | None = None
) -> torch.Tensor:
    """x weight^T (+ bias) (+ `term`), as torch's `linear`, for x [rows, k] and an nn.Linear weight [n, k]
    (contiguous); fp32 on the CPU. The weight is read from memory once, in its own layout, for FEW_ROWS
    rows at a time, each block of it read again from the caches by the next FEW_ROWS: at a decoding
    step's rows BLAS reads the weight once per row, or packs it for a GEMM whose rows are too few to pay
    for the packing (csrc/few_rows_linear_cpu.c). In torch's own OpenMP threads, as member_matmul."""
    rows, k = x.shape if x.dim() == 2 else (0, -1)
    n = weight.shape[0]
    if weight.shape != (n, k) or rows < 1 or k < 1:
        raise ValueError(
            f"few_rows_linear takes rows of the weight's width; got x {tuple(x.shape)} and weight "
            f"{tuple(weight.shape)}"
        )
    y, failed = _linear_product("few_rows_linear", x, weight, bias, term)
    if failed:
        raise MemoryError(f"few_rows_linear could not allocate {rows} x {term.inputs.shape[1]} products")
    return y


def packed_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, term: LowRankTerm | None = None
) -> torch.Tensor:
    """x weight^T (+ bias), as torch's `linear`, for x [rows, k] and an nn.Linear weight [n, k]
    (contiguous); with `term`, each row's low-rank term added as its outputs are stored, where adding it
    after torch's GEMM is one more pass over an output that lies in memory; fp32 on the CPU. Faster than
    torch's `linear` at SmolLM2's sizes on an AMD EPYC (csrc/packed_linear_cpu.c). In torch's own OpenMP
    threads, as member_matmul."""
    rows, k = x.shape if x.dim() == 2 else (0, -1)
    n = weight.shape[0]
    if weight.shape != (n, k) or rows < 1 or k < 1:
        raise ValueError(
            f"packed_linear takes rows of the weight's width; got x {tuple(x.shape)} and weight "
            f"{tuple(weight.shape)}"
        )
    y, failed = _linear_product("packed_linear", x, weight, bias, term)
    if failed:
        rank = 0 if term is None else term.inputs.shape[1]
        raise MemoryError(
            f"packed_linear could not allocate its buffers ({k} x 32 floats a thread, {rows} x {rank} "
            "products)"
        )
    return y


def lowrank_term(x: torch.Tensor, y: torch.Tensor, term: LowRankTerm) -> torch.Tensor:
    """y[i] += sum_j (x[i] . inputs[m, j]) outputs[m, j] for the rows of each member m (`term`), in place;
    returns y. x [rows, k] and y [rows, n], contiguous fp32 CPU tensors: the term after a base product
    computed elsewhere, in one pass per row where torch takes a batched matmul and a multiply-add per
    rank, and equal row groups only (csrc/packed_linear_cpu.c). In torch's own OpenMP threads, as
    member_matmul."""
    rows, n = y.shape if y.dim() == 2 else (-1, -1)
    k = x.shape[-1]
    if x.shape != (rows, k):
        raise ValueError(f"lowrank_term: x {tuple(x.shape)} and y {tuple(y.shape)} do not match")
    if not all(t.dtype == torch.float32 and t.is_cpu and t.is_contiguous() for t in (x, y)):
        raise ValueError("lowrank_term takes x and y as contiguous fp32 CPU tensors")
    inputs, outputs, offsets, rank, members = _term_arguments("lowrank_term", term, k, n)
    threads = torch.get_num_threads() if rows > 1 else 1  # even at a decoding step's 16 rows: measured
    refused = _load().fastes_lowrank_term_f32(
        x.data_ptr(), inputs, outputs, y.data_ptr(), offsets, rows, k, n, rank, members, threads
    )
    if refused == -2:
        raise _offsets_refused("lowrank_term", term, rows)
    return y
