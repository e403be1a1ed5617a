"""The one chunk plan (fastes/engine/chunks.py) that the torch reference and the C library both walk."""

from __future__ import annotations

import pytest

from fastes.engine import chunks

NUMELS = [1, 5, 4099, chunks.CHUNK + 3, 70, 0, 2 * chunks.CHUNK, 129]


@pytest.mark.parametrize("per_block", [4, 128])
def test_every_element_once_on_whole_blocks_within_a_chunk(per_block):
    covered = {index: [] for index in range(len(NUMELS))}
    for chunk in chunks.plan(NUMELS, per_block):
        assert 0 < chunk.lanes <= chunks.CHUNK
        lane = 0
        for part in chunk.parts:
            assert part.lane == lane, "slices are packed from lane 0 without gaps"
            assert part.start % chunks.CHUNK == 0 and part.lane % per_block == 0
            covered[part.tensor].append((part.start, part.count))
            lane += per_block * chunks.blocks(part.count, per_block)
        assert lane == chunk.lanes
    for index, numel in enumerate(NUMELS):
        expected = [(s, min(chunks.CHUNK, numel - s)) for s in range(0, numel, chunks.CHUNK)]
        assert covered[index] == expected


def test_a_layout_is_planned_once():
    assert chunks.plan([3, 7], 4) is chunks.plan((3, 7), 4)
    assert chunks.plan([3, 7], 4) is not chunks.plan([3, 7], 128)
