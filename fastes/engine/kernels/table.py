"""A multi-tensor launch: which tile of which tensor each program handles, written and read in one place.

All evolved tensors go through a single kernel launch. Rather than copying them into one flat buffer
(which would change how the model owns its parameters), the kernels read a small table of raw
addresses: program p handles elements [tile_start[p], tile_start[p] + BLOCK) of tensor tile_tensor[p].
The table costs a few bytes per tile and is rebuilt only when the set of tensors changes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class TileTable:
    """Per-tensor columns (address, numel, tensor id) and per-program columns (tensor, start)."""

    addresses: torch.Tensor  # int64 [T]
    numels: torch.Tensor  # int64 [T]
    tensor_ids: torch.Tensor  # int64 [T], uint32 values
    tile_tensor: torch.Tensor  # int32 [tiles]
    tile_start: torch.Tensor  # int64 [tiles], multiples of BLOCK
    block: int

    @property
    def n_tiles(self) -> int:
        return int(self.tile_tensor.numel())


def addresses(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The data pointers of `tensors` as an int64 column the kernels cast back to pointers."""
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=device)


def _tile_columns(numels: Sequence[int], block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-program columns (tile_tensor int32, tile_start int64) of tensors of `numels` elements."""
    tiles_per_tensor = [(n + block - 1) // block for n in numels]
    tile_tensor = torch.repeat_interleave(
        torch.arange(len(numels), dtype=torch.int32), torch.tensor(tiles_per_tensor, dtype=torch.int64)
    )
    starts = [torch.arange(k, dtype=torch.int64) * block for k in tiles_per_tensor]
    tile_start = torch.cat([torch.zeros(0, dtype=torch.int64), *starts])
    return tile_tensor, tile_start


def build_tile_table(tensors: Sequence[torch.Tensor], tensor_ids: Sequence[int], block: int) -> TileTable:
    """Tile every tensor into BLOCK-element pieces (the last one masked) and list all tiles in order."""
    device = tensors[0].device
    numels = [t.numel() for t in tensors]
    tile_tensor, tile_start = _tile_columns(numels, block)
    return TileTable(
        addresses=addresses(tensors, device),
        numels=torch.tensor(numels, dtype=torch.int64, device=device),
        tensor_ids=torch.tensor(list(tensor_ids), dtype=torch.int64, device=device),
        tile_tensor=tile_tensor.to(device),
        tile_start=tile_start.to(device),
        block=block,
    )


# Segments of a flat buffer start at multiples of 4 elements (16 bytes for fp32), so that every full
# tile of every segment takes the kernels' aligned 128-bit path.
SEGMENT_ALIGN = 4


def segment_starts(numels: Sequence[int]) -> tuple[list[int], int]:
    """Element offsets of consecutive segments of `numels` elements in one flat buffer, each a multiple
    of SEGMENT_ALIGN, and the buffer's total length."""
    starts, total = [], 0
    for n in numels:
        starts.append(total)
        total += -(-n // SEGMENT_ALIGN) * SEGMENT_ALIGN
    return starts, total


def build_flat_table(
    numels: Sequence[int], tensor_ids: Sequence[int], block: int, element_size: int, device
) -> TileTable:
    """The table of segments of one flat buffer (laid out by `segment_starts`) not yet allocated: its
    address column holds byte offsets into the buffer; `at(table, buffer)` makes it the buffer's."""
    starts, _ = segment_starts(numels)
    tile_tensor, tile_start = _tile_columns(numels, block)
    return TileTable(
        addresses=torch.tensor([s * element_size for s in starts], dtype=torch.int64, device=device),
        numels=torch.tensor(list(numels), dtype=torch.int64, device=device),
        tensor_ids=torch.tensor(list(tensor_ids), dtype=torch.int64, device=device),
        tile_tensor=tile_tensor.to(device),
        tile_start=tile_start.to(device),
        block=block,
    )


def at(table: TileTable, buffer: torch.Tensor) -> TileTable:
    """A flat table (`build_flat_table`) with its byte offsets made addresses into `buffer`."""
    return dataclasses.replace(table, addresses=table.addresses + buffer.data_ptr())


# Warps per program of the elementwise kernels: 2 warps give each thread 16 of a 1024-element tile, so
# the per-program work (tile table reads, the key schedule in uniform registers) is shared by more
# elements (python -m benchmarks --static: ~4 instructions per element fewer than with 4 warps).
NUM_WARPS = 2


def blocks_per_row(element_size: int) -> int:
    """Philox blocks (4 elements) per tile row so that one row is one 16-byte access: 1 for fp32, 2 for
    16-bit types."""
    return max(1, 16 // element_size // 4)


@triton.jit
def read_tile(
    addresses,
    out_addresses,
    numels,
    tensor_ids,
    tile_tensor,
    tile_start,
    DTYPE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """This program's tile: (start, tensor id, source and output addresses, count of valid elements, fast).

    `fast` is true for a full tile whose two tensors are 16-byte aligned (checked here, on the device,
    from the raw addresses): such a tile may be loaded and stored unmasked with 128-bit accesses (see
    `tile_pointer`). Offsets inside a tile are int32; only `start` is int64.
    """
    pid = tl.program_id(0)
    t = tl.load(tile_tensor + pid)
    start = tl.load(tile_start + pid) // BLOCK * BLOCK  # a multiple of BLOCK, and the compiler knows it
    source_address = tl.load(addresses + t)
    out_address = tl.load(out_addresses + t)
    count = tl.minimum(tl.load(numels + t) - start, BLOCK).to(tl.int32)
    fast = (count == BLOCK) & (((source_address | out_address) & 15) == 0)
    return start, tl.load(tensor_ids + t), source_address, out_address, count, fast


@triton.jit
def tile_pointer(address, start, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """Pointer to element `start` of the tensor at raw `address`; ALIGNED tells the compiler that the
    caller checked address % 16 == 0, so that it emits 128-bit accesses.

    (The hint is attached to the pointer computed here: `tl.multiple_of` on the result of another jit
    function call was seen to mark every value that call returned, Triton 3.9.)
    """
    pointer = address.to(tl.pointer_type(DTYPE)) + start
    if ALIGNED:
        pointer = tl.multiple_of(pointer, 16)
    return pointer
