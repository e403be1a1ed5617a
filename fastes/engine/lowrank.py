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
    if _compiled_in_place(param, grad, backend):
        largest = cpu_library.lowrank_update(param, a_all, b_all, decay)
        ops.mark_written([param])
        return largest
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
    return None


@torch.no_grad()
def update_all(
    params: Sequence[torch.Tensor],
    tensor_ids: Sequence[int],
    pairs: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]],
    weights: Sequence[float],
    *,
    coef: float,
    decay: float,
    rank: int,
    rounding_key: Key | None = None,
    grads: Sequence[torch.Tensor | None] | None = None,
    backend: str = "auto",
) -> list[float | None]:
    """`update` of every tensor i (its directions' factors `pairs[i]`, its gradient buffer `grads[i]`).

    The fp32 weights that the compiled CPU backend updates in place go through it in one call, all their
    rows split over its threads at once: a model has hundreds of weights, and handing each to the threads
    on its own costs as much as a small weight's pass. Returns what `update` returns, tensor by tensor.
    """
    grads = [None] * len(params) if grads is None else grads
    options = {"coef": coef, "decay": decay, "rank": rank, "rounding_key": rounding_key, "backend": backend}
    measured: list[float | None] = [None] * len(params)
    compiled = []
    for i, (param, grad) in enumerate(zip(params, grads)):
        if _compiled_in_place(param, grad, backend):
            compiled.append(i)
        else:
            measured[i] = update(param, tensor_ids[i], pairs[i], weights, grad=grad, **options)
    if compiled:
        scales = _column_scales(weights, coef, rank, params[compiled[0]].device)
        passes = [(params[i], *_joined(pairs[i], scales)) for i in compiled]
        for i, largest in zip(compiled, cpu_library.lowrank_update_all(passes, decay)):
            measured[i] = largest
        ops.mark_written([params[i] for i in compiled])
    return measured


def _compiled_in_place(param: torch.Tensor, grad: torch.Tensor | None, backend: str) -> bool:
    """Whether the compiled CPU library updates this weight in place (fp32, no gradient buffer)."""
    return grad is None and param.dtype == torch.float32 and ops.resolve_backend([param], backend) == "cpu"


def _column_scales(weights: Sequence[float], coef: float, rank: int, device: torch.device) -> torch.Tensor:
    """coef w_j / sqrt(r) for column j*r+i of the joined A, so that one product gives the whole step."""
    scale = torch.tensor(list(weights), dtype=torch.float32, device=device) * (coef / math.sqrt(rank))
    return scale.repeat_interleave(rank)


def _joined(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The directions' factors side by side: (A [out, P r] with its columns scaled, B [in, P r])."""
    return torch.cat([a for a, _ in pairs], dim=1) * scales, torch.cat([b for _, b in pairs], dim=1)
