"""Which slice of which tensor goes into which chunk, at which lane: the one chunk plan.

The torch reference (`fastes.engine.ops`) computes noise one vectorised Philox call per chunk and the
C library (`fastes.engine.cpu_library`) makes one call per chunk; both walk the same plan and build
only their own inputs from its parts (Philox counters, or the library's part table).

Large tensors are cut at CHUNK elements, small ones share a chunk. Every slice starts on a Philox
block (its first element is 0 or a multiple of CHUNK, which is a multiple of every block size) and
on a lane that is a multiple of the block size, so the lanes of a chunk line up with whole blocks.
Only the packing depends on the block size: slices are padded to whole blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

CHUNK = 1 << 18  # lanes per chunk: 1 MB of fp32 per call, so per-call Python overhead stays small
_CACHED_PLANS = 16  # plans kept, the least recently used dropped first: a run asks for a few layouts


class Part(NamedTuple):
    """One tensor slice in a chunk."""

    tensor: int  # index into the list of tensors planned
    start: int  # first element of the slice in its tensor
    count: int  # elements in the slice
    lane: int  # first lane of the slice in its chunk


@dataclass(frozen=True)
class Chunk:
    """Slices packed from lane 0 without gaps, each padded to whole blocks; `lanes` of them in use."""

    parts: tuple[Part, ...]
    lanes: int


def blocks(n: int, per_block: int) -> int:
    """The number of `per_block`-element blocks that hold n elements."""
    return (n + per_block - 1) // per_block


_plans: OrderedDict[tuple, tuple[Chunk, ...]] = OrderedDict()


def plan(numels: Sequence[int], per_block: int = 4) -> tuple[Chunk, ...]:
    """The chunks of tensors of `numels` elements in blocks of `per_block` (4, or 128 for signs).

    Cached by layout: ES asks for the same sizes every generation.
    """
    signature = (tuple(numels), per_block)
    if signature in _plans:
        _plans.move_to_end(signature)
        return _plans[signature]
    chunks: list[Chunk] = []
    parts: list[Part] = []
    used = 0  # lanes used in the current chunk
    for index, numel in enumerate(numels):
        for start in range(0, numel, CHUNK):
            count = min(CHUNK, numel - start)
            lanes = per_block * blocks(count, per_block)
            if used + lanes > CHUNK:
                chunks.append(Chunk(tuple(parts), used))
                parts, used = [], 0
            parts.append(Part(index, start, count, used))
            used += lanes
    if parts:
        chunks.append(Chunk(tuple(parts), used))
    _plans[signature] = tuple(chunks)
    if len(_plans) > _CACHED_PLANS:
        _plans.popitem(last=False)
    return _plans[signature]
