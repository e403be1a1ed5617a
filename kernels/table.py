"""A multi-tensor launch: which tile of which tensor each program handles, written and read in one place.

All evolved tensors go through a single kernel launch. Rather than copying them into one flat buffer
(which would change how the model owns its parameters), the kernels read a small table of raw
addresses: program p handles elements [tile_start[p], tile_start[p] + BLOCK) of tensor tile_tensor[p].
The table costs a few bytes per tile and is rebuilt only when the set of tensors changes.
"""

from __future__ import annotations

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


def build_tile_table(tensors: Sequence[torch.Tensor], tensor_ids: Sequence[int], block: int) -> TileTable:
    """Tile every tensor into BLOCK-element pieces (the last one masked) and list all tiles in order."""
    device = tensors[0].device
    numels = [t.numel() for t in tensors]
    tiles_per_tensor = [(n + block - 1) // block for n in numels]
    tile_tensor = torch.repeat_interleave(
        torch.arange(len(tensors), dtype=torch.int32), torch.tensor(tiles_per_tensor, dtype=torch.int64)
    )
    tile_start = torch.cat([torch.arange(k, dtype=torch.int64) * block for k in tiles_per_tensor])
    return TileTable(
        addresses=addresses(tensors, device),
        numels=torch.tensor(numels, dtype=torch.int64, device=device),
        tensor_ids=torch.tensor(list(tensor_ids), dtype=torch.int64, device=device),
        tile_tensor=tile_tensor.to(device),
        tile_start=tile_start.to(device),
        block=block,
    )


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
    """This program's tile: (start, tensor id, source and output pointers, int64 offsets, mask)."""
    pid = tl.program_id(0)
    t = tl.load(tile_tensor + pid)
    start = tl.load(tile_start + pid)
    source = tl.load(addresses + t).to(tl.pointer_type(DTYPE))
    out = tl.load(out_addresses + t).to(tl.pointer_type(DTYPE))
    offsets = start + tl.arange(0, BLOCK).to(tl.int64)
    return start, tl.load(tensor_ids + t), source, out, offsets, offsets < tl.load(numels + t)
