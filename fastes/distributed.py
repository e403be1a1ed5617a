"""One training job over several processes (`torchrun`): ranks, devices, one writer, and the collectives
the training loops need.

Under torchrun (WORLD_SIZE > 1 in the environment) `setup` joins the process group: nccl when the run's
device is CUDA (each process takes the GPU of its LOCAL_RANK), gloo on CPU. Without torchrun every
function here is the single-process identity, so the loops read the same either way. Rules:
- one writer: only rank 0 writes files (metrics, config, checkpoints, final/, plots);
- every rank starts from what rank 0 read (`from_writer`): the same checkpoint, the same metrics;
- collectives reduce small tensors of floats (rewards, sums, counts) and, in GRPO, the gradients.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) of this process; (0, 1) without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_writer() -> bool:
    """True on the one process that writes files: rank 0 (also before the group is joined or after)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


def launched_world_size() -> int:
    """The number of processes torchrun started (1 when not launched by it)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def setup(device: str) -> tuple[str, bool]:
    """Join torchrun's process group when there is one; returns (this rank's device, whether we joined).

    device "cuda" (or "cuda:N") becomes cuda:LOCAL_RANK with nccl; anything else keeps its device with gloo.
    """
    if launched_world_size() == 1 or dist.is_initialized():
        return device, False
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.device(device).type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"LOCAL_RANK {local_rank} but this node has {torch.cuda.device_count()} GPUs; start at most "
                "one process per GPU (torchrun --nproc_per_node N)"
            )
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
        dist.init_process_group("nccl", device_id=torch.device(device))
    else:
        dist.init_process_group("gloo")
    return device, True


def teardown(joined: bool) -> None:
    """Leave the process group if `setup` joined it."""
    if joined and dist.is_initialized():
        dist.destroy_process_group()


def require_divisible(count: int, what: str, fix: str) -> None:
    """A clear error, before any work, when `count` cannot be shared equally by the processes."""
    from .config import ConfigError

    _, world = rank_and_world()
    if count % world:
        raise ConfigError(
            f"{what} = {count} cannot be shared by {world} processes: it must be a multiple of the world "
            f"size {world}; {fix}"
        )


def _device() -> torch.device:
    """Where collectives run: the current GPU with nccl, the CPU with gloo."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def from_writer(read: Callable[[], T]) -> T:
    """Run `read` on rank 0 and give every rank its result (tensors in dicts travel as tensors).

    An exception raised by `read` on rank 0 is raised on every rank, so no process waits forever.
    """
    rank, world = rank_and_world()
    if world == 1:
        return read()
    box: list[Any] = [None]
    if rank == 0:
        try:
            box[0] = ("ok", _strip_tensors(read()))
        except Exception as error:  # noqa: BLE001 - re-raised on every rank below
            box[0] = ("error", error)
    dist.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status == "error":
        raise value
    return _broadcast_tensors(value)


class _TensorSlot:
    """A placeholder for a tensor sent separately by dist.broadcast (no pickling of large weights)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.shape, self.dtype, self.tensor = tuple(tensor.shape), tensor.dtype, tensor

    def __getstate__(self) -> dict:
        return {"shape": self.shape, "dtype": self.dtype, "tensor": None}


def _strip_tensors(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _TensorSlot(value)
    if isinstance(value, dict):
        return {k: _strip_tensors(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_strip_tensors(v) for v in value)
    return value


def _broadcast_tensors(value: Any) -> Any:
    """Fill every _TensorSlot of `value` (in a fixed traversal order) from rank 0."""
    if isinstance(value, _TensorSlot):
        device = _device()
        if value.tensor is not None:  # rank 0
            buffer = value.tensor.to(device)
        else:
            buffer = torch.empty(value.shape, dtype=value.dtype, device=device)
        dist.broadcast(buffer, src=0)
        return value.tensor if value.tensor is not None else buffer.cpu()
    if isinstance(value, dict):
        return {k: _broadcast_tensors(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_broadcast_tensors(v) for v in value)
    return value


def require_same(value: str, what: str) -> None:
    """Every process must hold rank 0's `value` (e.g. a run id); when one differs, all of them raise."""
    from .config import ConfigError

    _, world = rank_and_world()
    if world == 1:
        return
    differs = int(all_sum([float(value != from_writer(lambda: value))])[0])
    if differs:
        raise ConfigError(
            f"{differs} of {world} processes have other {what} than rank 0; give every process the same "
            "config, flags and model (on several machines, a --resume that reads its settings from out_dir "
            "needs out_dir on a filesystem every machine sees)"
        )


def all_sum(values: Iterable[float] | torch.Tensor) -> torch.Tensor:
    """The element-wise sum over all processes of a small vector (float64, on the CPU)."""
    local = torch.as_tensor(values, dtype=torch.float64)
    if rank_and_world()[1] == 1:
        return local
    total = local.to(_device())
    dist.all_reduce(total)
    return total.cpu()


def gather_strided(local: torch.Tensor, total: int) -> torch.Tensor:
    """Rows rank, rank + world, ... of a [total, ...] tensor, from every process (ES members' rows).

    Every row is non-zero on one process only, so the sum that assembles them is exact.
    """
    rank, world = rank_and_world()
    if world == 1:
        return local
    full = torch.zeros((total, *local.shape[1:]), dtype=torch.float64, device=_device())
    full[rank::world] = local.to(device=full.device, dtype=torch.float64)
    dist.all_reduce(full)
    return full.cpu()


def gather_blocks(local: torch.Tensor) -> torch.Tensor:
    """The processes' equal-sized blocks of rows, concatenated in rank order (GRPO's prompt slices)."""
    _, world = rank_and_world()
    if world == 1:
        return local
    device = _device()
    blocks = [torch.empty_like(local, device=device) for _ in range(world)]
    dist.all_gather(blocks, local.to(device))
    return torch.cat(blocks).cpu()


GRADIENT_BUCKET_ELEMENTS = 1 << 25  # 32 Mi elements per all-reduce of gradients


def sum_gradients(params: Iterable[torch.nn.Parameter]) -> None:
    """Replace each parameter's gradient by its sum over the processes (data-parallel GRPO).

    The per-process losses are already divided by the global normaliser, so the sum is the gradient of
    the whole batch. Gradients travel in flat buckets of one dtype of about GRADIENT_BUCKET_ELEMENTS
    elements: few collectives, and about one bucket of extra memory.
    """
    if rank_and_world()[1] == 1:
        return
    bucket: list[torch.Tensor] = []
    size = 0
    for grad in [p.grad for p in params if p.grad is not None]:
        if bucket and (grad.dtype != bucket[0].dtype or size >= GRADIENT_BUCKET_ELEMENTS):
            _sum_bucket(bucket)
            bucket, size = [], 0
        bucket.append(grad)
        size += grad.numel()
    if bucket:
        _sum_bucket(bucket)


def _sum_bucket(grads: list[torch.Tensor]) -> None:
    flat = torch.cat([g.reshape(-1).to(_device()) for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def check_same_weights(params: Iterable[torch.Tensor], where: str) -> None:
    """Raise when the processes hold different weights (an exact integer checksum of their bits)."""
    _, world = rank_and_world()
    if world == 1:
        return
    total = 0
    for p in params:
        bits = p.detach().contiguous().view(torch.int16 if p.element_size() == 2 else torch.int32)
        total += int(bits.to(torch.int64).sum())
    words = torch.tensor([(total % 2**128 >> (32 * k)) & 0xFFFFFFFF for k in range(4)], dtype=torch.int64)
    slots = [torch.zeros(4, dtype=torch.int64, device=_device()) for _ in range(world)]
    dist.all_gather(slots, words.to(_device()))
    if len({tuple(s.tolist()) for s in slots}) > 1:
        raise RuntimeError(
            f"weights diverged across processes at {where}; every rank must start from the same model and "
            "apply the same update (same config, same fastes and torch versions)"
        )
