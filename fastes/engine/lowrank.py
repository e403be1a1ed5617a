"""Low-rank (EGGROLL-style) noise: a matrix's perturbation is eps = A B^T / sqrt(r).

A [out, r] and B [in, r] are standard normals (or +-1 signs with noise "rademacher") from the noise
contract (fastes.engine.noise) on their own streams (STREAM_LOWRANK_A/_B, or STREAM_LOWRANK_SIGN_A/_B),
under the member's key and the tensor's id, so they are as reproducible as the full-rank noise. A
rank-r perturbation costs (out + in) r draws instead of out * in, a population-batched forward adds
sigma (x B) A^T / sqrt(r) to x W^T without forming eps, and the ES update sum_j w_j A_j B_j^T / sqrt(r)
is one pass over each weight (a GEMM off the compiled CPU backend). Tensors that are not matrices
(biases, norms) keep full-rank noise.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from . import cpu_library, noise, ops

Key = tuple[int, int]


def factors(
    key: Key,
    tensor_id: int,
    shape: torch.Size,
    rank: int,
    device: torch.device,
    backend: str = "auto",
    noise_kind: str = "gaussian",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(A [out, r], B [in, r]) fp32 factors of member `key`'s noise for a weight of `shape`.

    Gaussian factors are normals on streams 2 and 3; Rademacher ("sign") factors are +-1 on streams
    5 and 6, so that their product has entries in {-r, ..., r} / sqrt(r), again of unit variance.
    """
    return all_factors(key, [tensor_id], [shape], rank, device, backend, noise_kind)[0]


def all_factors(
    key: Key,
    tensor_ids: Sequence[int],
    shapes: Sequence[torch.Size],
    rank: int,
    device: torch.device,
    backend: str = "auto",
    noise_kind: str = "gaussian",
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`factors(key, tensor_ids[i], shapes[i], ...)` for every i: the A factors of all tensors in one
    noise call and the B factors in another (a model has hundreds of small factors; a call each costs
    more than the noise)."""
    a_sizes = [shape[0] * rank for shape in shapes]
    b_sizes = [shape[1] * rank for shape in shapes]
    if noise.check_noise(noise_kind) == "rademacher":  # signs cost nothing to make: the reference
        a = [
            noise.rademacher(key, t, n, stream=noise.STREAM_LOWRANK_SIGN_A, device=device)
            for t, n in zip(tensor_ids, a_sizes)
        ]
        b = [
            noise.rademacher(key, t, n, stream=noise.STREAM_LOWRANK_SIGN_B, device=device)
            for t, n in zip(tensor_ids, b_sizes)
        ]
    else:
        options = {"device": device, "backend": backend}
        a = ops.normals(key, tensor_ids, a_sizes, stream=noise.STREAM_LOWRANK_A, **options)
        b = ops.normals(key, tensor_ids, b_sizes, stream=noise.STREAM_LOWRANK_B, **options)
    return [(x.view(shape[0], rank), y.view(shape[1], rank)) for x, y, shape in zip(a, b, shapes)]


class MemberSides(NamedTuple):
    """A population's low-rank layer sides (`DirectionFactors.member_sides`)."""

    per_matrix: list[
        tuple[torch.Tensor, torch.Tensor]
    ]  # (inputs [members, r, in], outputs [members, r, out])
    buffers: tuple[torch.Tensor, torch.Tensor]  # the two flat buffers they are views of


class DirectionFactors:
    """Every noise direction's factors of a list of matrices, in one buffer: a population's layers and the
    update take theirs by a few gathers over it, not a few small ops per matrix (a model has hundreds).

    `values` [directions, lanes]: direction d's A of matrix i ([out_i, r], row-major, as `factors` gives
    it) from values[d, a_starts[i]] on, its B ([in_i, r]) from values[d, b_starts[i]] on.
    """

    def __init__(
        self,
        values: torch.Tensor,
        a_starts: Sequence[int],
        b_starts: Sequence[int],
        shapes: Sequence[torch.Size],
        rank: int,
    ) -> None:
        self.values, self.rank = values, rank
        self.layout = _Layout(
            tuple(a_starts), tuple(b_starts), tuple(tuple(s) for s in shapes), rank, values.shape[1]
        )

    def _gathered(self, index: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """values.flatten()[index], into `out` when given (index_select: 2-3x faster than take here)."""
        flat = self.values.view(-1)
        return flat.index_select(0, index) if out is None else torch.index_select(flat, 0, index, out=out)

    def pair(self, direction: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Direction `direction`'s (A, B) of matrix i: `factors(key of that direction, ...)`."""
        (out_features, in_features), r = self.layout.shapes[i], self.rank
        row = self.values[direction]
        a, b = self.layout.a_starts[i], self.layout.b_starts[i]
        return row[a : a + out_features * r].view(out_features, r), row[b : b + in_features * r].view(
            in_features, r
        )

    def member_sides(
        self,
        directions: Sequence[int],
        scales: Sequence[float],
        transposed: Sequence[bool],
        into: MemberSides | None = None,
    ) -> MemberSides:
        """For each matrix, the population layer's (inputs [members, r, in], outputs [members, r, out]) of
        the members whose directions and scales are given, scale_m / sqrt(r) folded into the outputs: the
        term sum_j (x inputs[m, j]) outputs[m, j] is member m's scale_m x eps^T. A transposed matrix
        (Conv1D's [in, out]) takes its inputs from A and its outputs from B. Row-major views of two flat
        buffers, made by one gather each; with `into` (an answer for the same members and matrices), its
        buffers are written again and it is returned (layers that view them then hold these factors)."""
        plan = _sides_plan(self.layout, tuple(directions), tuple(transposed), self.values.device)
        inputs, outputs = (None, None) if into is None else into.buffers
        inputs = self._gathered(plan.inputs, inputs)
        scales_t = torch.tensor(scales, dtype=torch.float32, device=self.values.device)
        per_member = scales_t / math.sqrt(self.rank)
        outputs = self._gathered(plan.outputs, outputs).mul_(per_member.index_select(0, plan.output_members))
        if into is not None:
            return into
        members, r = len(directions), self.rank
        per_matrix = [
            (
                inputs[i0 : i0 + members * r * n_in].view(members, r, n_in),
                outputs[o0 : o0 + members * r * n_out].view(members, r, n_out),
            )
            for i0, n_in, o0, n_out in plan.views
        ]
        return MemberSides(per_matrix, (inputs, outputs))

    def joined(self, column_scales: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """For each matrix, every direction's factors side by side: (A [out, D r] with column d r + j
        scaled by column_scales[d r + j], B [in, D r], the transpose of a contiguous [D r, in]), so that
        A B^T is the whole update sum_d scale_d A_d B_d^T in one product."""
        plan = _joined_plan(self.layout, self.values.shape[0], self.values.device)
        a_all = self._gathered(plan.a).mul_(column_scales.index_select(0, plan.a_columns))
        b_t = self._gathered(plan.b_t)
        columns = self.values.shape[0] * self.rank
        return [
            (
                a_all[a0 : a0 + n_out * columns].view(n_out, columns),
                b_t[b0 : b0 + columns * n_in].view(columns, n_in).T,
            )
            for a0, n_out, b0, n_in in plan.views
        ]


def direction_factors(
    keys: Sequence[Key],
    tensor_ids: Sequence[int],
    shapes: Sequence[torch.Size],
    rank: int,
    device: torch.device,
    backend: str = "auto",
    noise_kind: str = "gaussian",
) -> DirectionFactors:
    """`all_factors(keys[d], ...)` for every direction d, in one `DirectionFactors`. Gaussian factors on
    the compiled CPU backend take one library call per direction and factor side (all matrices at once,
    written in place); elsewhere each direction's `all_factors`, copied in."""
    a_sizes = tuple(shape[0] * rank for shape in shapes)
    b_sizes = tuple(shape[1] * rank for shape in shapes)
    compiled = (
        noise.check_noise(noise_kind) == "gaussian"
        and ops.resolve_backend([torch.empty(0, device=device)], backend) == "cpu"
    )
    if compiled:
        (a_starts, a_lanes), (b_starts, b_lanes) = map(cpu_library.whole_tensors_lanes, (a_sizes, b_sizes))
    else:
        a_starts, a_lanes = _end_to_end(a_sizes)
        b_starts, b_lanes = _end_to_end(b_sizes)
    values = torch.empty(len(keys), a_lanes + b_lanes, dtype=torch.float32, device=device)
    b_starts = tuple(a_lanes + start for start in b_starts)
    if compiled:
        cpu_library.normals_into(values[:, :a_lanes], keys, tensor_ids, a_sizes, noise.STREAM_LOWRANK_A)
        cpu_library.normals_into(values[:, a_lanes:], keys, tensor_ids, b_sizes, noise.STREAM_LOWRANK_B)
        return DirectionFactors(values, a_starts, b_starts, shapes, rank)
    for row, key in zip(values, keys):
        pairs = all_factors(key, tensor_ids, shapes, rank, device, backend, noise_kind)
        for (a, b), a_start, b_start in zip(pairs, a_starts, b_starts):
            row[a_start : a_start + a.numel()] = a.reshape(-1)
            row[b_start : b_start + b.numel()] = b.reshape(-1)
    return DirectionFactors(values, a_starts, b_starts, shapes, rank)


def _end_to_end(sizes: Sequence[int]) -> tuple[tuple[int, ...], int]:
    """Where each of `sizes` starts when laid end to end, and their total."""
    starts = tuple(itertools.accumulate(sizes, initial=0))
    return starts[:-1], starts[-1]


class _Layout(NamedTuple):
    """What a DirectionFactors' gathers depend on (the same every generation: their plans are cached)."""

    a_starts: tuple[int, ...]
    b_starts: tuple[int, ...]
    shapes: tuple[tuple[int, int], ...]
    rank: int
    row: int  # lanes a direction


class _SidesPlan(NamedTuple):
    inputs: torch.Tensor  # flat indices into values: every matrix's [members, r, in], one after another
    outputs: torch.Tensor  # likewise [members, r, out]
    output_members: torch.Tensor  # the member of each output value
    views: tuple[tuple[int, int, int, int], ...]  # matrix i's (inputs start, in, outputs start, out)


class _JoinedPlan(NamedTuple):
    a: torch.Tensor  # flat indices into values: every matrix's [out, D r], one after another
    a_columns: torch.Tensor  # the column d r + j of each of them
    b_t: torch.Tensor  # likewise [D r, in]
    views: tuple[tuple[int, int, int, int], ...]  # matrix i's (A start, out, B^T start, in)


def _side(start: int, length: int, layout: _Layout, directions: torch.Tensor) -> torch.Tensor:
    """Indices of [len(directions), r, length]: element (m, j, c) of a factor [length, r] that starts at
    `start` of each direction's row, direction directions[m]."""
    r = layout.rank
    within = torch.arange(length)[None, None, :] * r + torch.arange(r)[None, :, None]
    return directions[:, None, None] * layout.row + start + within


@functools.lru_cache(maxsize=32)
def _sides_plan(
    layout: _Layout, directions: tuple[int, ...], transposed: tuple[bool, ...], device: torch.device
) -> _SidesPlan:
    chosen = torch.tensor(directions, dtype=torch.int64)
    inputs, outputs, views, at_in, at_out = [], [], [], 0, 0
    for (rows, columns), a, b, swap in zip(layout.shapes, layout.a_starts, layout.b_starts, transposed):
        (in_start, n_in), (out_start, n_out) = (
            ((a, rows), (b, columns)) if swap else ((b, columns), (a, rows))
        )
        inputs.append(_side(in_start, n_in, layout, chosen).reshape(-1))
        outputs.append(_side(out_start, n_out, layout, chosen).reshape(-1))
        views.append((at_in, n_in, at_out, n_out))
        at_in, at_out = at_in + inputs[-1].numel(), at_out + outputs[-1].numel()
    members = [
        torch.arange(len(directions)).repeat_interleave(layout.rank * n_out) for _, _, _, n_out in views
    ]
    gathers = (torch.cat(t).to(device) for t in (inputs, outputs, members))
    return _SidesPlan(*gathers, tuple(views))


@functools.lru_cache(maxsize=32)
def _joined_plan(layout: _Layout, directions: int, device: torch.device) -> _JoinedPlan:
    every = torch.arange(directions)
    a_parts, column_parts, b_parts, views, at_a, at_b = [], [], [], [], 0, 0
    for (rows, columns), a, b in zip(layout.shapes, layout.a_starts, layout.b_starts):
        # A [out, D r]: element (o, d r + j) is direction d's A[o, j]
        a_parts.append(_side(a, rows, layout, every).permute(2, 0, 1).reshape(-1))
        column_parts.append(torch.arange(directions * layout.rank).repeat(rows))
        # B^T [D r, in]: element (d r + j, c) is direction d's B[c, j]
        b_parts.append(_side(b, columns, layout, every).reshape(-1))
        views.append((at_a, rows, at_b, columns))
        at_a, at_b = at_a + a_parts[-1].numel(), at_b + b_parts[-1].numel()
    gathers = (torch.cat(t).to(device) for t in (a_parts, column_parts, b_parts))
    return _JoinedPlan(*gathers, tuple(views))


def noise_matrix(
    key: Key,
    tensor_id: int,
    shape: torch.Size,
    rank: int,
    device: torch.device,
    backend: str = "auto",
    noise_kind: str = "gaussian",
) -> torch.Tensor:
    """eps = A B^T / sqrt(r), materialised (fp32): entries have unit variance, like full-rank noise."""
    a, b = factors(key, tensor_id, shape, rank, device, backend, noise_kind)
    return a @ b.T / math.sqrt(rank)


@torch.no_grad()
def perturb(
    source: torch.Tensor,
    destination: torch.Tensor,
    tensor_id: int,
    key: Key,
    scale: float,
    rank: int,
    backend: str = "auto",
    noise_kind: str = "gaussian",
    twin: torch.Tensor | None = None,
) -> None:
    """destination = source + scale * A B^T / sqrt(r), rounded to the weight's dtype; with `twin`, the
    antithetic member's weights from the same noise too (the bits a call with -scale writes)."""
    eps = noise_matrix(key, tensor_id, source.shape, rank, source.device, backend, noise_kind)
    base = source.to(torch.float32)
    destination.copy_((base + scale * eps).to(source.dtype))
    if twin is not None:
        twin.copy_((base + -scale * eps).to(source.dtype))


@torch.no_grad()
def update(
    param: torch.Tensor,
    tensor_id: int,
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
    weights: Sequence[float],
    *,
    coef: float,
    decay: float,
    rank: int,
    rounding_key: Key | None = None,
    grad: torch.Tensor | None = None,
    backend: str = "auto",
) -> float | None:
    """theta = theta * decay + coef * sum_j w_j A_j B_j^T / sqrt(r), as one [out, P r] x [P r, in] GEMM.

    `pairs` are the directions' factors (A_j, B_j) of this tensor (`factors`), in the order of `weights`.
    With `grad`, coef * sum is written there instead; `rounding_key` rounds 16-bit results
    stochastically (uniforms from the rounding stream, as the full-rank update). An fp32 weight is
    updated in place: on the compiled CPU backend in one pass over it (fastes/engine/csrc/lowrank_cpu.c),
    elsewhere by a GEMM with beta = decay. Returns max |theta| after the update where that pass measured it
    (NaN if theta holds NaN or inf), else None.
    """
    a_all, b_all = _joined(pairs, _column_scales(weights, coef, rank, param.device))
    if _compiled_in_place(param, grad, ops.resolve_backend([param], backend)):
        largest = cpu_library.lowrank_update(param, a_all, b_all, decay)
        ops.mark_written([param])
        return largest
    _update_by_torch(param, tensor_id, a_all, b_all, decay, rounding_key, grad)
    return None


def _update_by_torch(
    param: torch.Tensor,
    tensor_id: int,
    a_all: torch.Tensor,
    b_all: torch.Tensor,
    decay: float,
    rounding_key: Key | None,
    grad: torch.Tensor | None,
) -> None:
    """`update` off the compiled pass, from the joined factors: a GEMM with beta = decay."""
    if grad is not None:
        grad.copy_((a_all @ b_all.T).to(grad.dtype))
    elif param.dtype == torch.float32:
        param.addmm_(a_all, b_all.T, beta=decay)
    else:
        new = torch.addmm(param.to(torch.float32), a_all, b_all.T, beta=decay)
        if rounding_key is not None:
            u = noise.uniform(rounding_key, tensor_id, param.numel(), device=param.device).view(param.shape)
            param.copy_(noise.stochastic_round(new, param.dtype, u))
        else:
            param.copy_(new.to(param.dtype))


@torch.no_grad()
def update_all(
    params: Sequence[torch.Tensor],
    tensor_ids: Sequence[int],
    factors: DirectionFactors,
    weights: Sequence[float],
    *,
    coef: float,
    decay: float,
    rounding_key: Key | None = None,
    grads: Sequence[torch.Tensor | None] | None = None,
    backend: str = "auto",
) -> list[float | None]:
    """`update` of every tensor i, its directions' factors in `factors` (matrix i of it; direction d
    weighted by weights[d]), its gradient buffer `grads[i]`.

    The directions' factors of all tensors are joined by two gathers. The fp32 weights that the compiled
    CPU backend updates in place go through it in one call, all their rows split over its threads at once:
    a model has hundreds of weights, and handing each to the threads on its own costs as much as a small
    weight's pass. Returns what `update` returns, tensor by tensor.
    """
    grads = [None] * len(params) if grads is None else grads
    measured: list[float | None] = [None] * len(params)
    if not params:
        return measured
    joined = factors.joined(_column_scales(weights, coef, factors.rank, factors.values.device))
    resolved = ops.resolve_backend(params, backend)  # one device: resolved once, not per tensor
    compiled = []
    for i, (param, grad, (a_all, b_all)) in enumerate(zip(params, grads, joined)):
        if _compiled_in_place(param, grad, resolved):
            compiled.append(i)
        else:
            _update_by_torch(param, tensor_ids[i], a_all, b_all, decay, rounding_key, grad)
    if compiled:
        passes = [(params[i], *joined[i]) for i in compiled]
        for i, largest in zip(compiled, cpu_library.lowrank_update_all(passes, decay)):
            measured[i] = largest
        ops.mark_written([params[i] for i in compiled])
    return measured


def _compiled_in_place(param: torch.Tensor, grad: torch.Tensor | None, resolved: str) -> bool:
    """Whether the compiled CPU library updates this weight in place (the resolved backend "cpu", fp32,
    no gradient buffer)."""
    return grad is None and param.dtype == torch.float32 and resolved == "cpu"


def _column_scales(weights: Sequence[float], coef: float, rank: int, device: torch.device) -> torch.Tensor:
    """coef w_j / sqrt(r) for column j*r+i of the joined A, so that one product gives the whole step."""
    scale = torch.tensor(list(weights), dtype=torch.float32, device=device) * (coef / math.sqrt(rank))
    return scale.repeat_interleave(rank)


def _joined(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The directions' factors side by side: (A [out, P r] with its columns scaled, B [in, P r], the
    transpose of a contiguous [P r, in]: laid out as `DirectionFactors.joined` gives them)."""
    return torch.cat([a for a, _ in pairs], dim=1) * scales, torch.cat([b.T for _, b in pairs]).T
