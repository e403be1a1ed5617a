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

    # each matrix's (inputs [members, r, in], outputs [members, r, out])
    per_matrix: list[tuple[torch.Tensor, torch.Tensor]]
    buffers: tuple[torch.Tensor, torch.Tensor]  # the two flat buffers they are views of


class DirectionFactors:
    """Every noise direction's factors of a list of matrices, in one buffer (made on the CPU by two library
    calls, where a call a key and side cost more than its noise), from which a population's layer sides
    and the update's joined operands are copied, a matrix at a time.

    `values` [directions, lanes]: direction d's A of matrix i ([out_i, r], row-major, as `factors` gives
    it) from values[d, a_starts[i]] on, its B ([in_i, r]) from values[d, b_starts[i]] on; the A factors
    all lie before `a_lanes`, the B factors after.
    """

    def __init__(
        self,
        values: torch.Tensor,
        a_starts: Sequence[int],
        b_starts: Sequence[int],
        a_lanes: int,
        shapes: Sequence[torch.Size],
        rank: int,
    ) -> None:
        self.values, self.rank, self.a_lanes = values, rank, a_lanes
        self.a_starts, self.b_starts = tuple(a_starts), tuple(b_starts)
        self.shapes = [tuple(shape) for shape in shapes]

    def pair(self, direction: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Direction `direction`'s (A, B) of matrix i: `factors(key of that direction, ...)`."""
        (rows, columns), row, r = self.shapes[i], self.values[direction], self.rank
        a, b = self.a_starts[i], self.b_starts[i]
        return row[a : a + rows * r].view(rows, r), row[b : b + columns * r].view(columns, r)

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
        buffers, a copy each; with `into` (an answer for the same members and matrices), its buffers are
        written again and it is returned (layers that view them then hold these factors)."""
        device, r = self.values.device, self.rank
        chosen = self.values.index_select(0, torch.tensor(directions, device=device))  # [members, lanes]
        per_member = (torch.tensor(scales, dtype=torch.float32, device=device) / math.sqrt(r))[:, None, None]
        sides = []  # each matrix's (inputs' start in A or B, in, outputs' start, out)
        for (rows, columns), a, b, swap in zip(self.shapes, self.a_starts, self.b_starts, transposed):
            sides.append((a, rows, b, columns) if swap else (b, columns, a, rows))
        if into is None:
            into = _sides_buffers([(n_in, n_out) for _, n_in, _, n_out in sides], len(directions), r, device)
        for (inputs, outputs), (in_start, n_in, out_start, n_out) in zip(into.per_matrix, sides):
            inputs.copy_(_factor(chosen, in_start, n_in, r))
            torch.mul(_factor(chosen, out_start, n_out, r), per_member, out=outputs)
        return into

    def joined(self, direction_scales: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """For each matrix, every direction's factors side by side: (A [out, D r] with direction d's
        columns d r ... d r + r - 1 scaled by direction_scales[d], B [in, D r], the transpose of a
        contiguous [D r, in]), so that A B^T is the whole update sum_d scale_d A_d B_d^T in one product."""
        directions, r = self.values.shape[0], self.rank
        scaled = self.values[:, : self.a_lanes] * direction_scales[:, None]
        joined = []
        for (rows, columns), a, b in zip(self.shapes, self.a_starts, self.b_starts):
            a_all = _factor(scaled, a, rows, r).permute(2, 0, 1).reshape(rows, directions * r).contiguous()
            b_t = _factor(self.values, b, columns, r).reshape(directions * r, columns).contiguous()
            joined.append((a_all, b_t.T))
        return joined


def _factor(rows: torch.Tensor, start: int, length: int, rank: int) -> torch.Tensor:
    """[len(rows), r, length]: the factor [length, r] (row-major) that starts at `start` of each row,
    transposed (a view)."""
    return rows[:, start : start + length * rank].view(-1, length, rank).transpose(1, 2)


def _sides_buffers(
    sizes: list[tuple[int, int]], members: int, rank: int, device: torch.device
) -> MemberSides:
    """Two flat buffers for population layers' sides of (in, out) `sizes`, and each one's row-major views."""
    inputs = torch.empty(members * rank * sum(n for n, _ in sizes), device=device)
    outputs = torch.empty(members * rank * sum(n for _, n in sizes), device=device)
    per_matrix, at_in, at_out = [], 0, 0
    for n_in, n_out in sizes:
        per_matrix.append(
            (
                inputs[at_in : at_in + members * rank * n_in].view(members, rank, n_in),
                outputs[at_out : at_out + members * rank * n_out].view(members, rank, n_out),
            )
        )
        at_in, at_out = at_in + members * rank * n_in, at_out + members * rank * n_out
    return MemberSides(per_matrix, (inputs, outputs))


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
    # the compiled call's layout (whole Philox blocks) whichever way the values are made: nothing reads
    # the lanes between the factors
    (a_starts, a_lanes), (b_starts, b_lanes) = map(cpu_library.whole_tensors_lanes, (a_sizes, b_sizes))
    values = torch.empty(len(keys), a_lanes + b_lanes, dtype=torch.float32, device=device)
    b_starts = tuple(a_lanes + start for start in b_starts)
    compiled = (
        noise.check_noise(noise_kind) == "gaussian"
        and ops.resolve_backend([torch.empty(0, device=device)], backend) == "cpu"
    )
    if compiled:
        cpu_library.normals_into(values[:, :a_lanes], keys, tensor_ids, a_sizes, noise.STREAM_LOWRANK_A)
        cpu_library.normals_into(values[:, a_lanes:], keys, tensor_ids, b_sizes, noise.STREAM_LOWRANK_B)
        return DirectionFactors(values, a_starts, b_starts, a_lanes, shapes, rank)
    for row, key in zip(values, keys):
        pairs = all_factors(key, tensor_ids, shapes, rank, device, backend, noise_kind)
        for (a, b), a_start, b_start in zip(pairs, a_starts, b_starts):
            row[a_start : a_start + a.numel()] = a.reshape(-1)
            row[b_start : b_start + b.numel()] = b.reshape(-1)
    return DirectionFactors(values, a_starts, b_starts, a_lanes, shapes, rank)


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
    joined = factors.joined(_direction_scales(weights, coef, factors.rank, factors.values.device))
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


def _direction_scales(weights: Sequence[float], coef: float, rank: int, device: torch.device) -> torch.Tensor:
    """coef w_j / sqrt(r) for direction j: its columns' scale in the joined A."""
    return torch.tensor(list(weights), dtype=torch.float32, device=device) * (coef / math.sqrt(rank))


def _column_scales(weights: Sequence[float], coef: float, rank: int, device: torch.device) -> torch.Tensor:
    """coef w_j / sqrt(r) for column j*r+i of the joined A, so that one product gives the whole step."""
    return _direction_scales(weights, coef, rank, device).repeat_interleave(rank)


def _joined(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The directions' factors side by side: (A [out, P r] with its columns scaled, B [in, P r], the
    transpose of a contiguous [P r, in]: laid out as `DirectionFactors.joined` gives them)."""
    return torch.cat([a for a, _ in pairs], dim=1) * scales, torch.cat([b.T for _, b in pairs]).T
