"""A model's linear layers on the CPU: which product computes them, chosen for the machine.

`linear(x, weight, bias, term)` computes an nn.Linear layer (fp32, on the CPU) with, optionally, the
low-rank population's term (`cpu_library.LowRankTerm`). It has four products to choose from, by the
rows it is given:
- at a decoding step's rows (fewer than PACKED_MIN_ROWS), the library's few-rows linear
  (`cpu_library.few_rows_linear`), which reads the weight from memory once, in its own layout, for
  cpu_library.FEW_ROWS rows at a time, the others reading it again from the caches;
- a vocabulary-wide output (at least VOCABULARY_ROWS) from PACKED_MIN_ROWS rows, the few-rows linear
  still, and from VOCABULARY_PACKED_MIN_ROWS the packed linear (`Products.vocabulary`); where the
  library's products are not taken, weight-major: (W x^T)^T, the vocabulary as the GEMM's long side;
- at a prefill's many rows (`packs`), the library's packed linear (`cpu_library.packed_linear`);
- else, and wherever the library's product is not the faster one here, torch's `linear`.
A layer whose weight stays in the caches (under MIN_WEIGHT_BYTES) has only the packed linear to choose,
measured apart at a tiny model's sizes (`Products.small_packed`).
The library's products add the term as each output is stored; after torch's product
`cpu_library.lowrank_term` adds it in one pass per row.

Which of them is faster depends on the machine: on a 2-core AMD EPYC the library's products ran
1.1-3x faster than torch's (torch's MKL read a weight again for each row there:
docs/results/decoding-linears-2026-12-06.md, docs/results/packed-linear-2026-12-06.md), while on a
2-core Intel Xeon torch's MKL was 1.1-2.7x faster than the packed linear and as fast as the few-rows
pass (docs/results/cpu-products-2026-12-06.md). So each of fastes' three products is used only where it
measured faster on this machine (`products`): timed once per CPU, torch version, library build and
thread count against torch's `linear` on a SmolLM2-sized block of layers, with and without the low-rank
population's term (plain and ES generation run the same products), and taken where it needs at most
WIN_MARGIN of torch's time. Measuring takes one to two seconds; the answer is kept in the cache
directory beside the library (`cpu-products.json`). FASTES_CPU_PRODUCTS=library or =torch sets the
answer instead (the same products on every machine; the tests use "library").

The materialised population layer (`fastes.es.population.PopulationLinear`) has a fourth choice, made
the same way: the library's member matmul (`cpu_library.member_matmul`, which takes the members' rows
in groups of any size, so that every finished row leaves the batch) or torch's batched matmul (equal
groups: finished rows leave by whole columns). On the AMD EPYC the member matmul ran the tiny model's
population generation 6-7% faster (docs/results/member-matmul-2026-12-06.md); on the Intel Xeon torch's
was 7-37% faster per call and its generation 1.4-6% faster (docs/results/population-overheads-2026-12-06.md).
A small low-rank population layer has a fifth, measured apart, since its alternative is another one: the
member matmul with the shared weight and the members' factors, or torch's linear and then the term's
pass over every output. On the Intel Xeon the first ran the tiny model's low-rank
population generation at 0.944 of plain generation's speed, the second at 0.887, while torch's batched
matmul was the faster materialised product there (docs/results/xeon-tiny-2026-12-07.md).
A plain layer too small for the others has a sixth: the packed linear or torch's `linear`, at a tiny
model's rows. On a 2-core AMD EPYC with AVX-512 (torch's MKL runs its AVX2 code on AMD CPUs) the packed
linear took 0.37-0.56 of torch's time at 512 rows and more, and a tiny model's plain generation ran
1.29x faster (docs/results/epyc-avx512-2026-12-07.md).
A vocabulary-wide output from PACKED_MIN_ROWS rows has a seventh: the library's products (the few-rows
linear, from VOCABULARY_PACKED_MIN_ROWS the packed linear) or, as below those rows, the weight-major
product or torch's `linear`. On the AMD EPYC the library's took 0.40-0.48 of the weight-major product's
time at 128-2048 rows and 0.50-0.58 of torch's `linear`'s (docs/results/vocabulary-head-2026-12-07.md).

The choice changes how a layer's sums are ordered, not what it computes: every product agrees with
torch's to float tolerance, and ES and plain generation run the same products.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import torch

from fastes.checkpoint import write_atomic

from . import cpu_library
from .cpu_library import LowRankTerm

# A weight smaller than this stays in the caches: it takes the packed linear where `small_packed` says so
MIN_WEIGHT_BYTES = 256 * 1024
# The packed linear's rows: from PACKED_MIN_ROWS, and whole 32-column panels (the last columns of another
# width are summed one by one, correct but slow). Below it the few-rows linear: over SmolLM2's
# projections it took 0.25-0.88 of the packed linear's time at 8-96 rows, 1.03x at 128, 1.08-1.29x at
# 160-256 (the AMD EPYC with AVX-512: docs/results/few-rows-linear-2026-12-07.md).
PACKED_MIN_ROWS = 128
SMALL_PACKED_MIN_ROWS = 96  # a weight that stays in the caches (`is_small`): the tiny model's, as before
VOCABULARY_ROWS = 8192  # an output at least this wide is a vocabulary's (measured from 4096 x 256 up)
# A vocabulary-wide output from PACKED_MIN_ROWS rows (`Products.vocabulary`): the few-rows linear below
# this, the packed linear from here. SmolLM2's vocabulary projection took 22.9, 42.6, 59.6 and 250 ms in
# the few-rows linear at 128, 192, 256 and 1024 rows, 30.4, 43.8, 57.1 and 187 in the packed linear
# (docs/results/vocabulary-head-2026-12-07.md)
VOCABULARY_PACKED_MIN_ROWS = 256

CHOICES = ("measure", "library", "torch")  # FASTES_CPU_PRODUCTS's values; "measure" is the default
CACHE_FILE = "cpu-products.json"


class Products(NamedTuple):
    """Which of fastes' own products run on this machine (False: torch's in their place): the first three
    and the last in `linear`, the member matmul in the population layers."""

    few_rows: bool  # the library's few-rows linear, below PACKED_MIN_ROWS rows
    weight_major: bool  # (W x^T)^T for a vocabulary-wide output (torch's mm, the other way round)
    packed: bool  # the library's packed linear, where `packs`
    member_matmul: bool  # the library's member matmul for materialised population layers (else torch.bmm)
    # the member matmul with the shared weight and the members' factors, for a low-rank population layer
    # too small for the others (else the base's product, then `lowrank_term`)
    lowrank_member_matmul: bool
    # the packed linear for a plain layer whose weight stays in the caches (`is_small`), where it `packs`
    # (else torch's linear)
    small_packed: bool
    # the library's products for a vocabulary-wide output from PACKED_MIN_ROWS rows: the few-rows linear,
    # the packed linear from VOCABULARY_PACKED_MIN_ROWS (else weight-major or torch's, as below them)
    vocabulary: bool


def packs(rows: int, weight: torch.Tensor) -> bool:
    """Whether `rows` rows of a layer with this nn.Linear weight [n, k] are the packed linear's to take
    (where `products().packed`, or `small_packed` for a small weight)."""
    least = SMALL_PACKED_MIN_ROWS if is_small(weight) else PACKED_MIN_ROWS
    return rows >= least and weight.shape[0] % 32 == 0


def is_small(weight: torch.Tensor) -> bool:
    """Whether this fp32 weight stays in the caches (under MIN_WEIGHT_BYTES): of the library's products
    only the packed linear may be faster than torch's `linear` for it (`Products.small_packed`)."""
    return weight.numel() * 4 < MIN_WEIGHT_BYTES


def is_plain_linear(module: torch.nn.Module) -> bool:
    """Whether `module` computes x W^T + b and nothing more: an nn.Linear itself (no subclass with a forward
    of its own) without hooks, which another product may compute in its place."""
    return type(module) is torch.nn.Linear and not (module._forward_hooks or module._forward_pre_hooks)


def linear_applies(module: torch.nn.Module) -> bool:
    """Whether `linear` computes `module` at least as fast as its own forward: a plain nn.Linear
    (`is_plain_linear`) with a contiguous fp32 CPU weight, not a small one (`is_small`) unless the packed
    linear measured faster for small weights on this machine."""
    return (
        is_plain_linear(module)
        and module.weight.device.type == "cpu"
        and module.weight.dtype == torch.float32
        and module.weight.is_contiguous()
        and (not is_small(module.weight) or products(torch.get_num_threads()).small_packed)
    )


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, term: LowRankTerm | None = None
) -> torch.Tensor:
    """x weight^T (+ bias) (+ `term`) for x [rows, k] and an nn.Linear weight [n, k] (contiguous, fp32 on
    the CPU), by the product this machine runs fastest for its rows (see the module's docstring). A
    vocabulary-wide output without a term may be a transposed view (the caller's copy of the logits
    reads it)."""
    rows = x.shape[0]
    use = products(torch.get_num_threads())
    if is_small(weight):  # in the caches: the packed linear or torch's
        if use.small_packed and packs(rows, weight):
            return cpu_library.packed_linear(x, weight, bias, term)
        y = torch.nn.functional.linear(x, weight, bias)
    elif 1 <= rows < PACKED_MIN_ROWS and use.few_rows:
        return cpu_library.few_rows_linear(x, weight, bias, term)
    elif weight.shape[0] >= VOCABULARY_ROWS and use.vocabulary and rows >= PACKED_MIN_ROWS:
        if rows >= VOCABULARY_PACKED_MIN_ROWS and packs(rows, weight):
            return cpu_library.packed_linear(x, weight, bias, term)
        return cpu_library.few_rows_linear(x, weight, bias, term)
    elif weight.shape[0] >= VOCABULARY_ROWS and use.weight_major:
        y = torch.mm(weight, x.T).T
        if bias is not None:
            y = y + bias
    elif use.packed and packs(rows, weight):
        return cpu_library.packed_linear(x, weight, bias, term)
    else:
        y = torch.nn.functional.linear(x, weight, bias)
    return y if term is None else cpu_library.lowrank_term(x.contiguous(), y.contiguous(), term)


# ---------------------------------------------------------------------------------------------------
# The choice: measured once per machine and kept on disk
# ---------------------------------------------------------------------------------------------------


@functools.cache
def products(threads: int) -> Products:
    """The products taken at `threads` torch threads: FASTES_CPU_PRODUCTS's, or this machine's measured
    answer (from the cache file, else measured now and written there)."""
    setting = os.environ.get("FASTES_CPU_PRODUCTS", "measure")
    if setting not in CHOICES:
        raise ValueError(f"FASTES_CPU_PRODUCTS must be one of {', '.join(CHOICES)}; got {setting!r}")
    if setting != "measure":
        return Products(*[setting == "library"] * len(Products._fields))
    if not cpu_library.available():  # no C compiler here (one warning): torch's products throughout
        return Products(*[False] * len(Products._fields))
    key = machine_key(threads)
    known = _cached_answer(key)
    if known is not None:
        return known
    # processes that start together (torchrun's ranks) measure one at a time, undisturbed, and the later
    # ones take the first one's answer: every process on the machine runs the same products
    with _cache_lock():
        known = _cached_answer(key)
        if known is not None:
            return known
        timings = measure(threads)
        chosen = Products(*(library_wins(timings[name]) for name in Products._fields))
        _write_cache(key, {**chosen._asdict(), "seconds": timings})
    return chosen


def machine_key(threads: int) -> str:
    """What the answer depends on: the CPU (model and features), torch's version (its BLAS), the
    library's sources, this file (how it is measured) and the thread count."""
    files = (*cpu_library.SOURCES, *cpu_library.HEADERS, Path(__file__))
    sources = b"".join(path.read_bytes() for path in files)
    identity = "\0".join([cpu_library.cpu_identity(), torch.__version__, str(threads)]).encode()
    return hashlib.sha256(sources + identity).hexdigest()[:16]


def _read_cache() -> dict:
    """The cache file's answers by machine key; an empty dict where it is missing or damaged (it is only a
    cache: the answer is measured again and the file rewritten)."""
    try:
        answers = json.loads((cpu_library.cache_dir() / CACHE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return answers if isinstance(answers, dict) else {}


def _cached_answer(key: str) -> Products | None:
    """The cache file's answer for `key`, or None where it has none (or a damaged one)."""
    known = _read_cache().get(key)
    if isinstance(known, dict) and all(isinstance(known.get(name), bool) for name in Products._fields):
        return Products(*(known[name] for name in Products._fields))
    return None


@contextlib.contextmanager
def _cache_lock() -> Iterator[None]:
    """Hold an exclusive lock on the cache file's lock file (POSIX; elsewhere, or where the directory
    cannot be written, no lock)."""
    try:
        import fcntl

        path = cpu_library.cache_dir() / (CACHE_FILE + ".lock")
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a")  # held until the lock is released
    except (ImportError, OSError):
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _write_cache(key: str, answer: dict) -> None:
    """Add `answer` under `key` (written atomically: a reader never sees half a file); a cache directory
    that cannot be written only means measuring again next time."""
    path = cpu_library.cache_dir() / CACHE_FILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps({**_read_cache(), key: answer}, indent=1))
    except OSError:
        pass


# A SmolLM2-sized block (k = 576: q and o, k and v, gate and up, down) for the few-rows linear and the
# packed linear, and a vocabulary-wide output for the weight-major product at _VOCABULARY_BATCH rows and
# (its first _VOCABULARY_PART rows: streamed from memory as the whole, in a third of the time) for the
# library's products at _VOCABULARY_ROWS; the low-rank population's term of _MEMBERS members, rank 1
# (its default)
_BLOCK = [(576, 576), (576, 576), (192, 576), (192, 576), (1536, 576), (1536, 576), (576, 1536)]
_VOCABULARY = (49152, 576)  # SmolLM2's
_FEW, _MANY, _VOCABULARY_BATCH, _MEMBERS = (1, 4, cpu_library.FEW_ROWS, 64), 256, 64, 8
_VOCABULARY_PART, _VOCABULARY_ROWS = 16384, (160, VOCABULARY_PACKED_MIN_ROWS)  # few-rows, packed
# The materialised layer's products, (members, rows a member, in, out): a tiny model's block (hidden 64,
# MLP 256; materialised is a small model's default mode) at a decode step of the demo's 16 members x 32
# rows and at its prefill (20 positions a row), and a SmolLM2-sized weight at 8 members of 8 rows. The
# small plain layer's: the same block at the same rows, all members' rows in one product.
_TINY_MEMBERS, _TINY_ROWS, _TINY_BLOCK = 16, (32, 640), ((64, 64), (64, 256), (256, 64))
_MEMBER_SHAPES = [(_TINY_MEMBERS, rows, k, n) for rows in _TINY_ROWS for k, n in _TINY_BLOCK] + [
    (8, 8, 576, 576)
]


def measure(threads: int, repeats: int = 7) -> dict[str, dict[str, float]]:
    """Seconds (medians of `repeats` timings taken in turns, after a warm-up) of each of fastes' products
    and torch's in its place, at `threads` torch threads: {"few_rows" | "weight_major" | "packed" |
    "member_matmul" | "lowrank_member_matmul" | "small_packed" | "vocabulary": {"library": s, "torch":
    s, ...}}. The few-rows linear and the packed linear are also timed with the low-rank population's
    term ("library with term", "torch with term": torch's product, then `lowrank_term`), since plain and
    ES generation run the same products; the member matmul against torch's batched matmul of equal
    groups; the member matmul with the members' factors against torch's linear, then `lowrank_term`; the
    packed linear of a small weight against torch's linear; the few-rows and the packed linear of a
    vocabulary-wide output at rows of each's range against torch's linear (the weight-major product,
    slower than torch's linear from 128 rows on the AMD EPYC, is measured at 64 rows only)."""
    generator = torch.Generator().manual_seed(0)

    def tensor(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    def term(rows: int, n: int, k: int) -> LowRankTerm:
        offsets = torch.tensor([rows * m // _MEMBERS for m in range(_MEMBERS + 1)])
        return LowRankTerm(tensor(_MEMBERS, 1, k), tensor(_MEMBERS, 1, n), offsets)

    block = [tensor(n, k) for n, k in _BLOCK]
    # (x, weight, term) for every product of the few-rows linear's rows and of the packed linear's
    few = [(tensor(rows, w.shape[1]), w, term(rows, *w.shape)) for rows in _FEW for w in block]
    many = [(tensor(_MANY, w.shape[1]), w, term(_MANY, *w.shape)) for w in block]
    vocabulary, batch = tensor(*_VOCABULARY), tensor(_VOCABULARY_BATCH, _VOCABULARY[1])
    part = vocabulary[:_VOCABULARY_PART]
    wide_rows, packed_rows = (tensor(rows, _VOCABULARY[1]) for rows in _VOCABULARY_ROWS)
    # (x, the members' weights [members, in, out], where each member's rows start) for the member matmul
    grouped = [
        (tensor(members * rows, k), tensor(members, k, n), torch.arange(0, members * rows + 1, rows))
        for members, rows, k, n in _MEMBER_SHAPES
    ]
    # the small low-rank layer's two ways at the tiny model's shapes, as the layer holds them: its member
    # matmul (the shared weight [in, out] and the members' rank-1 factors), or the base's product on the
    # nn.Linear weight [out, in], then the term
    lowrank = []
    for x, w, starts in grouped:
        members, k, n = w.shape
        if members == _TINY_MEMBERS:
            inputs, outputs = tensor(members, 1, k), tensor(members, 1, n)
            product = cpu_library.MemberMatmul(w[0], None, (inputs, outputs))
            lowrank.append((x, starts, product, w[0].T.contiguous(), LowRankTerm(inputs, outputs, starts)))
    small = [(tensor(_TINY_MEMBERS * rows, k), tensor(n, k)) for rows in _TINY_ROWS for k, n in _TINY_BLOCK]
    torch_linear = torch.nn.functional.linear

    def with_and_without_term(library: Callable, products: list) -> dict[str, Callable[[], object]]:
        return {
            "library": lambda: [library(x, w) for x, w, _ in products],
            "torch": lambda: [torch_linear(x, w) for x, w, _ in products],
            "library with term": lambda: [library(x, w, None, t) for x, w, t in products],
            "torch with term": lambda: [
                cpu_library.lowrank_term(x, torch_linear(x, w), t) for x, w, t in products
            ],
        }

    calls = {
        "few_rows": with_and_without_term(cpu_library.few_rows_linear, few),
        # the decoding loop copies the logits out after either (fastes.models.decoding): so does this
        "weight_major": {
            "library": lambda: torch.mm(vocabulary, batch.T).T.contiguous(),
            "torch": lambda: torch_linear(batch, vocabulary).clone(),
        },
        "packed": with_and_without_term(cpu_library.packed_linear, many),
        "member_matmul": {
            "library": lambda: [cpu_library.member_matmul(x, w, starts, None) for x, w, starts in grouped],
            "torch": lambda: [torch.bmm(x.view(w.shape[0], -1, x.shape[1]), w) for x, w, _ in grouped],
        },
        "lowrank_member_matmul": {
            "library": lambda: [product(x, starts) for x, starts, product, _, _ in lowrank],
            "torch": lambda: [
                cpu_library.lowrank_term(x, torch_linear(x, w), t) for x, _, _, w, t in lowrank
            ],
        },
        "small_packed": {
            "library": lambda: [cpu_library.packed_linear(x, w) for x, w in small],
            "torch": lambda: [torch_linear(x, w) for x, w in small],
        },
        "vocabulary": {
            "library": lambda: [
                cpu_library.few_rows_linear(wide_rows, part),
                cpu_library.packed_linear(packed_rows, part),
            ],
            "torch": lambda: [torch_linear(wide_rows, part), torch_linear(packed_rows, part)],
        },
    }
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return {name: _medians(product_calls, repeats) for name, product_calls in calls.items()}
    finally:
        torch.set_num_threads(previous)


# How much less time fastes' product must take to be chosen: near-ties, which timings on a busy machine
# would settle either way from one measurement to the next, keep torch's
WIN_MARGIN = 0.97


def library_wins(seconds: dict[str, float]) -> bool:
    """Whether fastes' product took at most WIN_MARGIN of torch's time, over every way both were timed."""
    library = sum(s for name, s in seconds.items() if name.startswith("library"))
    return library < WIN_MARGIN * sum(s for name, s in seconds.items() if name.startswith("torch"))


def _medians(calls: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """The median seconds of `repeats` timings of each call, taken in turns."""
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():  # warm: lazy allocations, the library's first load
        call()
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            seconds[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in seconds.items()}
