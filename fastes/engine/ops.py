"""Perturb and update many tensors at once, on the Triton kernels, compiled CPU code or the torch reference.

`perturb` and `es_update` are the two operations ES needs, `normal` the noise fill. Each has a plain
torch reference (`perturb_reference`, `es_update_reference`, `fastes.engine.noise.normal`) that a reader can
compare line by line with the Triton kernels in `fastes.engine.kernels` and the compiled CPU backend in
`fastes.engine.cpu_library`; all produce the same noise (`fastes.engine.noise`).

Backends: "triton" (CUDA tensors; or CPU tensors under TRITON_INTERPRET=1 in tests), "cpu" (CPU
tensors: the same contract as a small C library built for this machine, `fastes.engine.cpu_library`), "torch"
(the eager reference, any device). "auto" (default, or the FASTES_BACKEND environment variable) picks
triton on CUDA, cpu on CPU (the reference where no C compiler is available, after one warning) and
the reference elsewhere.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

import torch

from . import chunks, cpu_library, noise

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BACKENDS = ("auto", "triton", "cpu", "torch")
_BLOCK = 1024  # elements per Triton program (a multiple of 4: whole Philox blocks)
# Sign noise: larger tiles, so that each thread's 32 elements share one Philox call per 128 elements
# (python -m benchmarks --static: ~6.6 SASS instructions per element per direction in the update at
# 2048, ~10 at 1024; 4096 needs 168 registers). A multiple of 128: whole sign blocks.
_SIGN_BLOCK = 2048

Key = tuple[int, int]


def check_tensors(tensors: Sequence[torch.Tensor], tensor_ids: Sequence[int], what: str) -> None:
    """Raise a clear error unless the tensors are non-empty, on one device, contiguous and supported."""
    if len(tensors) == 0:
        raise ValueError(f"{what}: no tensors given; pass at least one parameter to evolve")
    if len(tensor_ids) != len(tensors):
        raise ValueError(f"{what}: {len(tensors)} tensors but {len(tensor_ids)} tensor ids")
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(
            f"{what}: tensors are on several devices {sorted(map(str, devices))}; "
            "move the model to one device first (model.to(device))"
        )
    for i, t in enumerate(tensors):
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"{what}: tensor {i} has dtype {t.dtype}; supported dtypes are float32, "
                "bfloat16 and float16 (convert with .to(torch.float32) or .to(torch.bfloat16))"
            )
        if not t.is_contiguous():
            raise ValueError(
                f"{what}: tensor {i} is not contiguous; call .contiguous() on it "
                "(element indices of the noise contract are row-major offsets)"
            )


def resolve_backend(tensors: Sequence[torch.Tensor], backend: str = "auto") -> str:
    """The backend that runs for these tensors: "triton", "cpu" or "torch" (see the module doc)."""
    if backend == "auto":
        backend = os.environ.get("FASTES_BACKEND", "auto")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
    device = tensors[0].device
    if backend == "auto":
        if device.type == "cuda" and _triton_available():
            return "triton"
        backend = "cpu" if device.type == "cpu" else "torch"
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "backend 'triton' on CPU tensors needs the Triton interpreter: set "
            "TRITON_INTERPRET=1 before triton is imported, or use backend='torch'"
        )
    if backend == "cpu":
        if device.type != "cpu":
            raise ValueError(
                f"backend 'cpu' is the compiled CPU backend, but the tensors are on {device}; "
                "use backend='auto' (Triton on CUDA) or 'torch'"
            )
        if not cpu_library.available():  # warned once: no C compiler, or building failed
            return "torch"
    return backend


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


# ---------------------------------------------------------------------------------------------------
# The torch reference
# ---------------------------------------------------------------------------------------------------


def _counters(
    chunk: chunks.Chunk,
    tensor_ids: Sequence[int],
    device: torch.device,
    per_block: int,
    lane_block: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox counters (low words, high words, tensor ids) of `per_block`-element blocks for every lane
    of a chunk planned in `lane_block`-element blocks (default: the same): lane `part.lane + i` holds
    element `part.start + i` of its tensor. Sign noise's rounding uniforms (4 per block) thus take the
    lanes of its noise (128 per block)."""
    lane_block = lane_block or per_block
    columns = []
    for part in chunk.parts:
        span = lane_block * chunks.blocks(part.count, lane_block)  # the part's lanes, padding included
        c0, c1, _, _ = noise._counter_words(span, part.start, device, per_block)
        columns.append((c0, c1, torch.full_like(c0, tensor_ids[part.tensor])))
    c0, c1, ids = (torch.cat(column) for column in zip(*columns))
    return c0, c1, ids


@torch.no_grad()
def perturb_reference(
    sources: Sequence[torch.Tensor],
    destinations: Sequence[torch.Tensor],
    tensor_ids: Sequence[int],
    key: Key,
    scale: float,
    noise_kind: str = "gaussian",
) -> None:
    """dst = (float32(src) + scale * eps(key, tensor id)) rounded to the tensor's dtype."""
    per_block = noise.elements_per_block(noise_kind)
    for chunk in chunks.plan([t.numel() for t in sources], per_block):
        c0, c1, ids = _counters(chunk, tensor_ids, sources[0].device, per_block)
        eps = noise.noise_from_counters(noise_kind, key, c0, c1, ids)
        for index, start, n, at in chunk.parts:
            theta = sources[index].view(-1)[start : start + n].to(torch.float32)
            perturbed = theta + scale * eps[at : at + n]
            destinations[index].view(-1)[start : start + n] = perturbed.to(sources[index].dtype)


@torch.no_grad()
def es_update_reference(
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
    """theta = theta * decay + coef * sum_j w_j eps_j (or grad = coef * sum_j w_j eps_j).

    The sum is accumulated in fp32 in direction order; with `rounding_key` a 16-bit result is rounded
    stochastically with uniforms from the rounding stream, otherwise to nearest.
    """
    per_block, device = noise.elements_per_block(noise_kind), params[0].device
    stochastic = rounding_key is not None and grads is None
    for chunk in chunks.plan([p.numel() for p in params], per_block):
        c0, c1, ids = _counters(chunk, tensor_ids, device, per_block)
        total = torch.zeros(chunk.lanes, device=device)
        for key, w in zip(keys, weights):
            eps = noise.noise_from_counters(noise_kind, key, c0, c1, ids)
            total += torch.tensor(w, dtype=torch.float32) * eps
        u = None
        if stochastic:  # the rounding stream has 4 elements per block, at the lanes of the noise
            u = noise.uniform_from_counters(
                rounding_key, *_counters(chunk, tensor_ids, device, 4, per_block), noise.STREAM_ROUNDING
            )
        for index, start, n, at in chunk.parts:
            param = params[index]
            step = coef * total[at : at + n]
            if grads is not None:
                grads[index].view(-1)[start : start + n] = step.to(param.dtype)
                continue
            flat = param.view(-1)
            new = flat[start : start + n].to(torch.float32) * decay + step
            if u is not None and param.dtype != torch.float32:
                flat[start : start + n] = noise.stochastic_round(new, param.dtype, u[at : at + n])
            else:
                flat[start : start + n] = new.to(param.dtype)


# ---------------------------------------------------------------------------------------------------
# Dispatch
# ---------------------------------------------------------------------------------------------------

_tables: OrderedDict = OrderedDict()  # the last few tile tables, keyed by tensor layout


def _tile_table(tensors: Sequence[torch.Tensor], tensor_ids: Sequence[int], noise_kind: str = "gaussian"):
    from .kernels import build_tile_table

    block = _SIGN_BLOCK if noise_kind == "rademacher" else _BLOCK

    signature = (block, *((t.data_ptr(), t.numel(), tid) for t, tid in zip(tensors, tensor_ids)))
    table = _tables.get(signature)
    if table is None:
        table = build_tile_table(tensors, tensor_ids, block)
        _tables[signature] = table
        if len(_tables) > 16:
            _tables.popitem(last=False)
    return table


def _flat_table(numels: Sequence[int], tensor_ids: Sequence[int], device: torch.device):
    """The tile table of fp32 segments of `numels` in one flat buffer (byte offsets), cached by layout:
    low-rank factors ask for the same sizes and ids every generation."""
    from .kernels.table import build_flat_table

    signature = ("flat", _BLOCK, str(device), tuple(numels), tuple(tensor_ids))
    table = _tables.get(signature)
    if table is None:
        table = build_flat_table(numels, tensor_ids, _BLOCK, 4, device)
        _tables[signature] = table
        if len(_tables) > 16:
            _tables.popitem(last=False)
    return table


_columns: OrderedDict = OrderedDict()  # address columns of recent destination sets (ES work buffers)


def _address_column(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The device-side address column of `tensors`, cached: ES perturbs into the same buffers every time."""
    from .kernels.table import addresses

    signature = tuple(t.data_ptr() for t in tensors)
    column = _columns.get(signature)
    if column is None:
        column = _columns[signature] = addresses(tensors, tensors[0].device)
        if len(_columns) > 16:
            _columns.popitem(last=False)
    return column


def triton_dtype(dtype: torch.dtype):
    """The triton.language dtype of a supported torch dtype."""
    import triton.language as tl

    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


def _by_dtype(*columns: Sequence) -> dict[torch.dtype, list[list]]:
    """Split parallel columns (the first holds the tensors) into one group per dtype.

    Each kernel launch handles a single dtype, so a model with mixed dtypes costs one launch per dtype.
    """
    groups: dict[torch.dtype, list[list]] = {}
    for row in zip(*columns):
        group = groups.setdefault(row[0].dtype, [[] for _ in columns])
        for column, value in zip(group, row):
            column.append(value)
    return groups


class Write(NamedTuple):
    """One member's perturbed weights for `perturb_each`: sources + scale * eps(key) into `destinations`,
    and with `twins`, sources - scale * eps into them (its antithetic twin's, from the same noise)."""

    key: Key
    scale: float
    destinations: Sequence[torch.Tensor]
    twins: Sequence[torch.Tensor] | None = None


def perturb(
    sources: Sequence[torch.Tensor],
    destinations: Sequence[torch.Tensor],
    tensor_ids: Sequence[int],
    key: Key,
    scale: float,
    *,
    noise_kind: str = "gaussian",
    backend: str = "auto",
    twins: Sequence[torch.Tensor] | None = None,
) -> None:
    """Write sources + scale * eps(key) into destinations (may be the sources: in place).

    `noise_kind` is the distribution of eps: "gaussian" or "rademacher" (+-1). One kernel launch per
    dtype covers every tensor. With `twins` (one per source), each twin also gets sources - scale * eps
    from the same noise: an antithetic member's weights, the same bits as a second call with -scale.
    A destination (and its twin) may be contiguous, or a 2-d destination the transpose of a contiguous
    tensor: the materialised layer holds the members' [out, in] weights as [in, out] (the compiled CPU
    library writes them so directly; other backends through a contiguous copy).
    """
    perturb_each(
        sources, tensor_ids, [Write(key, scale, destinations, twins)], noise_kind=noise_kind, backend=backend
    )


def perturb_each(
    sources: Sequence[torch.Tensor],
    tensor_ids: Sequence[int],
    writes: Sequence[Write],
    *,
    noise_kind: str = "gaussian",
    backend: str = "auto",
) -> None:
    """`perturb` for several members' `writes` of the same sources: what one call per write would write.

    On the compiled CPU backend (fp32) all of them are one pass split over the threads: a small model's
    member is too little work to split (a thread costs more than it saves), but its members side by
    side are not (the tiny model's 16 members: one library call per antithetic pair, each on one thread,
    cost 2-3x the noise itself: docs/results/iteration-overheads-2026-12-07.md)."""
    noise.check_noise(noise_kind)
    check_tensors(sources, tensor_ids, "perturb")
    for write in writes:
        _check_write(sources, write)
    outputs = [t for w in writes for t in (*w.destinations, *(w.twins or ()))]
    chosen = resolve_backend(sources, backend)
    if chosen == "cpu" and cpu_library.library_perturbs(sources):
        cpu_library.perturb_each(sources, tensor_ids, writes, noise_kind)
    else:
        for key, scale, destinations, twins in writes:
            _perturb_staged(sources, destinations, twins, tensor_ids, key, scale, noise_kind, chosen)
    mark_written(outputs)


def _check_write(sources: Sequence[torch.Tensor], write: Write) -> None:
    """Raise a clear error unless `write`'s destinations (and twins) can take the sources' values."""
    destinations, twins = write.destinations, write.twins
    pairs = list(zip(sources, destinations)) + (list(zip(destinations, twins)) if twins is not None else [])
    counts_match = len(destinations) == len(sources) and (twins is None or len(twins) == len(sources))
    if not counts_match or any(
        d.shape != s.shape or d.dtype != s.dtype or d.device != s.device or not _writable_layout(d)
        for s, d in pairs
    ):
        raise ValueError(
            "perturb: each destination must have its source's shape, dtype and device (a twin its "
            "destination's), and be contiguous or the transpose of a contiguous 2-d tensor"
        )
    if twins is not None and any(d.is_contiguous() != t.is_contiguous() for d, t in zip(destinations, twins)):
        raise ValueError(
            "perturb: a twin must be laid out as its destination is (both contiguous or transposed)"
        )
    if not math.isfinite(write.scale):
        raise ValueError(f"perturb: scale must be finite, got {write.scale}")


def mark_written(tensors: Sequence[torch.Tensor]) -> None:
    """Bump the version counters of tensors written in place by the compiled library or a Triton kernel.

    They write through raw pointers, which torch's counters do not see (an in-place torch op bumps
    them). Bumped, a backward that saved one of these tensors before the write fails loudly, as after
    torch.optim's in-place update, instead of using the new values."""
    torch.autograd.graph.increment_version(list(tensors))


def _perturb_staged(
    sources: Sequence[torch.Tensor],
    destinations: Sequence[torch.Tensor],
    twins: Sequence[torch.Tensor] | None,
    tensor_ids: Sequence[int],
    key: Key,
    scale: float,
    noise_kind: str,
    backend: str,
) -> None:
    """`perturb` on a backend that writes contiguous tensors: a transposed destination (or twin) is
    written through a contiguous copy."""
    outputs = list(destinations) + (list(twins) if twins is not None else [])
    staged = [
        d if d.is_contiguous() else torch.empty_like(d, memory_format=torch.contiguous_format)
        for d in outputs
    ]
    signed = [(staged[: len(sources)], scale)]
    if twins is not None:
        signed.append((staged[len(sources) :], -scale))
    for targets, value in signed:
        _perturb_contiguous(sources, targets, tensor_ids, key, value, noise_kind, backend)
    for destination, written in zip(outputs, staged):
        if written is not destination:
            destination.copy_(written)


def _writable_layout(destination: torch.Tensor) -> bool:
    """Contiguous, or the transpose of a contiguous 2-d tensor."""
    return destination.is_contiguous() or (
        destination.dim() == 2 and destination.stride() == (1, destination.shape[0])
    )


def _perturb_contiguous(
    sources: Sequence[torch.Tensor],
    destinations: Sequence[torch.Tensor],
    tensor_ids: Sequence[int],
    key: Key,
    scale: float,
    noise_kind: str,
    backend: str,
) -> None:
    """`perturb` into contiguous destinations on the resolved `backend`."""
    if backend == "cpu":
        cpu_library.perturb(sources, destinations, tensor_ids, key, scale, noise_kind)
        return
    if backend == "torch":
        perturb_reference(sources, destinations, tensor_ids, key, scale, noise_kind)
        return
    from .kernels import launch_perturb

    in_place = all(s.data_ptr() == d.data_ptr() for s, d in zip(sources, destinations))
    for dtype, (srcs, dsts, ids) in _by_dtype(sources, destinations, tensor_ids).items():
        table = _tile_table(srcs, ids, noise_kind)
        dst_addresses = table.addresses if in_place else _address_column(dsts)
        launch_perturb(table, dst_addresses, key, scale, triton_dtype(dtype), noise_kind)


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
    backend: str = "auto",
) -> None:
    """The fused ES update over all tensors (see es_update_reference for the exact formula).

    With `grads`, coef * sum_j w_j eps_j is written there and params are left unchanged. `noise_kind`
    ("gaussian" or "rademacher") must be the one the members were perturbed with.
    """
    noise.check_noise(noise_kind)
    check_tensors(params, tensor_ids, "es_update")
    if len(keys) != len(weights) or len(keys) == 0:
        raise ValueError(
            f"es_update: need one weight per key and at least one key, got {len(keys)} keys "
            f"and {len(weights)} weights"
        )
    bad = [w for w in weights if not math.isfinite(w)]
    if bad or not math.isfinite(coef) or not math.isfinite(decay):
        raise ValueError(
            f"es_update: weights, coef and decay must be finite (got non-finite {bad[:3]}, "
            f"coef={coef}, decay={decay}); check the rewards for NaN/inf"
        )
    if grads is not None and (
        len(grads) != len(params)
        or any(
            g.shape != p.shape or g.dtype != p.dtype or g.device != p.device or not g.is_contiguous()
            for p, g in zip(params, grads)
        )
    ):
        raise ValueError(
            "es_update: need one grad per parameter, contiguous, with its parameter's shape, dtype and device"
        )
    chosen = resolve_backend(params, backend)
    options = {
        "coef": coef,
        "decay": decay,
        "rounding_key": rounding_key,
        "grads": grads,
        "noise_kind": noise_kind,
    }
    if chosen == "cpu":
        cpu_library.es_update(params, tensor_ids, keys, weights, **options)
    elif chosen == "torch":
        es_update_reference(params, tensor_ids, keys, weights, **options)
    else:
        _es_update_triton(params, tensor_ids, keys, weights, **options)
    mark_written(params if grads is None else grads)


def _es_update_triton(
    params: Sequence[torch.Tensor],
    tensor_ids: Sequence[int],
    keys: Sequence[Key],
    weights: Sequence[float],
    *,
    coef: float,
    decay: float,
    rounding_key: Key | None,
    grads: Sequence[torch.Tensor] | None,
    noise_kind: str,
) -> None:
    """`es_update` on the Triton kernels: one launch per dtype."""
    from .kernels import MODE_APPLY, MODE_APPLY_STOCHASTIC, MODE_GRADIENT, launch_update

    device = params[0].device
    key_column = torch.tensor(list(keys), dtype=torch.int64, device=device)
    weight_column = torch.tensor(list(weights), dtype=torch.float32, device=device)
    outs = list(grads) if grads is not None else [None] * len(params)
    for dtype, (ps, ids, gs) in _by_dtype(params, tensor_ids, outs).items():
        if grads is not None:
            mode = MODE_GRADIENT
        elif rounding_key is not None and dtype != torch.float32:
            mode = MODE_APPLY_STOCHASTIC
        else:
            mode = MODE_APPLY
        launch_update(
            _tile_table(ps, ids, noise_kind),
            None if grads is None else gs,
            key_column,
            weight_column,
            coef,
            decay,
            rounding_key or (0, 0),
            mode,
            triton_dtype(dtype),
            noise_kind,
        )


def normal(
    key: Key,
    tensor_id: int,
    numel: int,
    *,
    offset: int = 0,
    stream: int = noise.STREAM_NOISE,
    device: torch.device | str = "cpu",
    backend: str = "auto",
) -> torch.Tensor:
    """fp32 normals eps[offset : offset + numel] of `tensor_id` under `key` on `device` (the noise fill).

    The same values as `fastes.engine.noise.normal` (to float tolerance), from the backend chosen for
    `device`.
    """
    chosen = resolve_backend([torch.empty(0, device=device)], backend)
    if chosen == "cpu":
        return cpu_library.normal(key, tensor_id, numel, offset=offset, stream=stream)
    if chosen == "triton" and offset % 4 == 0:
        from .kernels import launch_fill

        out = torch.empty(numel, dtype=torch.float32, device=device)
        if numel:
            launch_fill(out, key, tensor_id, offset, stream, False)
        return out
    return noise.normal(key, tensor_id, numel, offset=offset, stream=stream, device=device)


def normals(
    key: Key,
    tensor_ids: Sequence[int],
    numels: Sequence[int],
    *,
    stream: int,
    device: torch.device | str = "cpu",
    backend: str = "auto",
) -> list[torch.Tensor]:
    """`normal(key, tensor_ids[i], numels[i])` for several tensors: one compiled call for many on CPU,
    one kernel launch for all on a GPU (views of one flat buffer)."""
    chosen = resolve_backend([torch.empty(0, device=device)], backend)
    if chosen == "cpu":
        return cpu_library.normals(key, tensor_ids, numels, stream)
    if chosen == "triton" and len(numels):
        from .kernels import launch_normals
        from .kernels.table import at, segment_starts

        starts, total = segment_starts(numels)
        flat = torch.empty(total, dtype=torch.float32, device=device)
        launch_normals(at(_flat_table(numels, tensor_ids, flat.device), flat), key, stream)
        return [flat[start : start + n] for start, n in zip(starts, numels)]
    return [
        normal(key, tid, numel, stream=stream, device=device, backend=backend)
        for tid, numel in zip(tensor_ids, numels)
    ]
