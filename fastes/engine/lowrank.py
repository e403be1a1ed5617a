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
) -> None:
    """destination = source + scale * A B^T / sqrt(r), rounded to the weight's dtype."""
    eps = noise_matrix(key, tensor_id, source.shape, rank, source.device, backend, noise_kind)
    destination.copy_((source.to(torch.float32) + scale * eps).to(source.dtype))


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
    # column j*r+i of A is scaled by coef w_j / sqrt(r), so that one GEMM gives the whole step
    scale = torch.tensor(list(weights), dtype=torch.float32, device=param.device) * (coef / math.sqrt(rank))
    a_all = torch.cat([a for a, _ in pairs], dim=1) * scale.repeat_interleave(rank)  # [out, P r]
    b_all = torch.cat([b for _, b in pairs], dim=1)  # [in, P r]
    if grad is not None:
        grad.copy_((a_all @ b_all.T).to(grad.dtype))
    elif param.dtype == torch.float32 and ops.resolve_backend([param], backend) == "cpu":
        return cpu_library.lowrank_update(param, a_all, b_all, decay)
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
