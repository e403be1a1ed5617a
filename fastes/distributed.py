"""One training job over several processes (`torchrun`): ranks, devices, one writer, and every collective
that ES and GRPO run.

Under torchrun (WORLD_SIZE > 1 in the environment) `setup` joins the process group: nccl when the run's
device is CUDA (each process takes the GPU of its LOCAL_RANK), gloo on CPU. Without torchrun every
function here is the single-process identity, so the loops read the same either way. Rules:
- one writer: only rank 0 writes files (metrics, config, checkpoints, final/, plots);
- every rank starts from what rank 0 read (`from_writer`): the same checkpoint, the same metrics;
- collectives reduce small tensors of floats (rewards, sums, counts) and, in GRPO, the gradients;
- one timeout rule: every collective here waits at most `timeout` seconds for the other processes (the
  run's `collective_timeout`, set once by `setup`; fastes.ES passes its own `timeout`), then raises
  CollectiveError with one line naming the rank, the collective and what to do (`wait`);
- one weight checksum (`weights_checksum`), compared across processes by `check_same_weights`.
"""

from __future__ import annotations

import datetime
import math
import os
import pickle
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from .errors import ConfigError

T = TypeVar("T")

DEFAULT_TIMEOUT = 1800.0  # seconds; torch's own default for gloo process groups


class CollectiveError(RuntimeError):
    """A cross-process collective failed: another process died or did not answer in time."""


class _Configured:
    """The `timeout` default of the collectives here: the module's setting (`set_timeout`)."""

    def __repr__(self) -> str:
        return "CONFIGURED"


CONFIGURED = _Configured()
_timeout: float | None = DEFAULT_TIMEOUT


def check_timeout(seconds: float | None) -> float | None:
    """`seconds` when it is a positive finite number or None (the process group's own timeout)."""
    if seconds is not None and not (
        isinstance(seconds, (int, float)) and seconds > 0 and math.isfinite(seconds)
    ):
        raise ValueError(f"timeout must be a positive number of seconds or None, got {seconds}")
    return seconds


def set_timeout(seconds: float | None) -> None:
    """Seconds every collective here waits for the other processes (None: the process group's timeout)."""
    global _timeout
    _timeout = check_timeout(seconds)


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) of this process; (0, 1) without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def wait(
    launch: Callable[[], Any],
    what: str,
    *,
    where: str = "",
    timeout: float | None | _Configured = CONFIGURED,
) -> None:
    """Start one asynchronous collective (`launch` returns its work handle) and wait for it, at most
    `timeout` seconds when one is set.

    A process that died or stopped answering makes the others fail here with a CollectiveError whose
    one-line message names the step (`where`, e.g. "ES generation 3"), the rank and the collective
    (`what`), instead of hanging or surfacing a bare transport error.
    """
    limit = _timeout if isinstance(timeout, _Configured) else timeout
    rank, world = rank_and_world()
    try:
        work = launch()
        done = work.wait() if limit is None else work.wait(timeout=datetime.timedelta(seconds=limit))
        if done is False:
            raise RuntimeError("the wait timed out")
    except RuntimeError as error:  # torch.distributed.DistBackendError is a RuntimeError
        within = "the process group's timeout" if limit is None else f"{limit:g} s"
        prefix = f"{where}, " if where else ""
        raise CollectiveError(
            f"{prefix}rank {rank} of {world}: {what} failed: another process died or did not answer "
            f"within {within} ({error}). The process group cannot be used any more: stop every process "
            "and resume from the last checkpoint"
        ) from error


def is_writer() -> bool:
    """True on the one process that writes files: rank 0 (also before the group is joined or after)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


def launched_world_size() -> int:
    """The number of processes torchrun started (1 when not launched by it)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def setup(device: str, timeout: float | None = DEFAULT_TIMEOUT) -> tuple[str, bool]:
    """Join torchrun's process group when there is one; returns (this rank's device, whether we joined).

    device "cuda" (or "cuda:N") becomes cuda:LOCAL_RANK with nccl; anything else keeps its device with gloo.
    `timeout` (the run's collective_timeout) becomes the limit of every collective here, also when the
    group was joined before (a process group of the caller's own).
    """
    set_timeout(timeout)
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
    box: Any = None
    if rank == 0:
        try:
            box = ("ok", _strip_tensors(read()))
        except Exception as error:  # noqa: BLE001 - re-raised on every rank below
            box = ("error", error)
    status, value = _broadcast_object(box)
    if status == "error":
        raise value
    return _broadcast_tensors(value)


def _broadcast_object(value: Any) -> Any:
    """Rank 0's picklable `value` on every rank: its size, then its bytes (two broadcasts that take the
    timeout, which dist.broadcast_object_list does not)."""
    rank, _ = rank_and_world()
    device = _device()
    data = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8) if rank == 0 else None
    size = torch.tensor([0 if data is None else data.numel()], dtype=torch.int64, device=device)
    wait(lambda: dist.broadcast(size, src=0, async_op=True), "the broadcast of rank 0's reading")
    if data is not None:
        buffer = data.to(device)
    else:
        buffer = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    wait(lambda: dist.broadcast(buffer, src=0, async_op=True), "the broadcast of rank 0's reading")
    return value if rank == 0 else pickle.loads(buffer.cpu().numpy().tobytes())


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
        wait(lambda: dist.broadcast(buffer, src=0, async_op=True), "the broadcast of rank 0's tensors")
        return value.tensor if value.tensor is not None else buffer.cpu()
    if isinstance(value, dict):
        return {k: _broadcast_tensors(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_broadcast_tensors(v) for v in value)
    return value


def require_same(value: str, what: str) -> None:
    """Every process must hold rank 0's `value` (e.g. a run id); when one differs, all of them raise."""
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


def all_sum(
    values: Iterable[float] | torch.Tensor,
    *,
    where: str = "",
    timeout: float | None | _Configured = CONFIGURED,
) -> torch.Tensor:
    """The element-wise sum over all processes of a small vector (float64, on the CPU)."""
    local = torch.as_tensor(values, dtype=torch.float64)
    if rank_and_world()[1] == 1:
        return local
    total = local.to(_device())
    wait(
        lambda: dist.all_reduce(total, async_op=True), "the all-reduce of a sum", where=where, timeout=timeout
    )
    return total.cpu()


def gather_strided(
    local: torch.Tensor,
    total: int,
    *,
    what: str = "the all-reduce of the members' rows",
    where: str = "",
    timeout: float | None | _Configured = CONFIGURED,
) -> torch.Tensor:
    """Rows rank, rank + world, ... of a [total, ...] tensor, from every process (ES members' rows).

    Every row is non-zero on one process only, so the sum that assembles them is exact.
    """
    rank, world = rank_and_world()
    if world == 1:
        return local
    full = torch.zeros((total, *local.shape[1:]), dtype=torch.float64, device=_device())
    full[rank::world] = local.to(device=full.device, dtype=torch.float64)
    wait(lambda: dist.all_reduce(full, async_op=True), what, where=where, timeout=timeout)
    return full.cpu()


def gather_blocks(
    local: torch.Tensor, *, where: str = "", timeout: float | None | _Configured = CONFIGURED
) -> torch.Tensor:
    """The processes' equal-sized blocks of rows, concatenated in rank order (GRPO's prompt slices)."""
    _, world = rank_and_world()
    if world == 1:
        return local
    device = _device()
    blocks = [torch.empty_like(local, device=device) for _ in range(world)]
    mine = local.to(device)
    wait(
        lambda: dist.all_gather(blocks, mine, async_op=True),
        "the all-gather of the processes' rows",
        where=where,
        timeout=timeout,
    )
    return torch.cat(blocks).cpu()


GRADIENT_BUCKET_ELEMENTS = 1 << 25  # 32 Mi elements per all-reduce of gradients


def sum_gradients(
    params: Iterable[torch.nn.Parameter], *, where: str = "", timeout: float | None | _Configured = CONFIGURED
) -> None:
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
            _sum_bucket(bucket, where, timeout)
            bucket, size = [], 0
        bucket.append(grad)
        size += grad.numel()
    if bucket:
        _sum_bucket(bucket, where, timeout)


def _sum_bucket(grads: list[torch.Tensor], where: str, timeout: float | None | _Configured) -> None:
    flat = torch.cat([g.reshape(-1).to(_device()) for g in grads])
    wait(
        lambda: dist.all_reduce(flat, async_op=True),
        "the all-reduce of the gradients",
        where=where,
        timeout=timeout,
    )
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def weights_checksum(tensors: Iterable[torch.Tensor]) -> int:
    """An exact integer fingerprint of `tensors`: the sum of their bit patterns (as int16 for 2-byte
    dtypes, int32 otherwise). ES and GRPO compare this one number across processes."""
    total = 0
    for p in tensors:
        bits = p.detach().contiguous().view(torch.int16 if p.element_size() == 2 else torch.int32)
        total += int(bits.to(torch.int64).sum())
    return total


SAME_WEIGHTS_FIX = (
    "every rank must start from the same model and apply the same update (same config, seed, fastes and "
    "torch versions)"
)


def check_same_weights(
    params: Iterable[torch.Tensor],
    where: str,
    *,
    fix: str = SAME_WEIGHTS_FIX,
    timeout: float | None | _Configured = CONFIGURED,
) -> None:
    """Raise when the processes hold different weights: `weights_checksum` of `params` on every rank.

    The checksum travels as four 32-bit words (two's complement, 128 bits) in an int64 tensor, so that a
    plain all-gather carries it, which takes the timeout (all_gather_object does not).
    """
    _, world = rank_and_world()
    if world == 1:
        return
    value = weights_checksum(params) % 2**128
    device = _device()
    words = torch.tensor(
        [(value >> (32 * k)) & 0xFFFFFFFF for k in range(4)], dtype=torch.int64, device=device
    )
    slots = [torch.zeros(4, dtype=torch.int64, device=device) for _ in range(world)]
    wait(
        lambda: dist.all_gather(slots, words, async_op=True),
        "the all-gather of the weight checksums",
        where=where,
        timeout=timeout,
    )
    gathered = []
    for slot in slots:
        unsigned = sum(int(w) << (32 * k) for k, w in enumerate(slot.cpu().tolist()))
        gathered.append(unsigned - 2**128 if unsigned >= 2**127 else unsigned)
    if len(set(gathered)) > 1:
        raise RuntimeError(f"weights diverged across processes at {where}: checksums {gathered}; {fix}")
