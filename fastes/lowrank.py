"""Low-rank (EGGROLL-style) noise: a matrix's perturbation is eps = A B^T / sqrt(r).

A [out, r] and B [in, r] are standard normals (or +-1 signs with noise "rademacher") from the noise
contract (fastes.noise) on their own streams (STREAM_LOWRANK_A/_B, or STREAM_LOWRANK_SIGN_A/_B),
under the member's key and the tensor's id, so they are as reproducible as the full-rank noise. A
rank-r perturbation costs (out + in) r draws instead of out * in, a population-batched forward adds
sigma (x B) A^T / sqrt(r) to x W^T without forming eps, and the ES update sum_j w_j A_j B_j^T / sqrt(r)
is one GEMM. Tensors that are not matrices (biases, norms) keep full-rank noise.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from . import noise, ops

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
    out_features, in_features = shape
    if noise.check_noise(noise_kind) == "rademacher":  # signs cost nothing to make: the reference
        streams = (noise.STREAM_LOWRANK_SIGN_A, noise.STREAM_LOWRANK_SIGN_B)
        a = noise.rademacher(key, tensor_id, out_features * rank, stream=streams[0], device=device)
        b = noise.rademacher(key, tensor_id, in_features * rank, stream=streams[1], device=device)
    else:
        options = {"device": device, "backend": backend}
        a = ops.normal(key, tensor_id, out_features * rank, stream=noise.STREAM_LOWRANK_A, **options)
        b = ops.normal(key, tensor_id, in_features * rank, stream=noise.STREAM_LOWRANK_B, **options)
    return a.view(out_features, rank), b.view(in_features, rank)


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
    keys: Sequence[Key],
    weights: Sequence[float],
    *,
    coef: float,
    decay: float,
    rank: int,
    rounding_key: Key | None = None,
    grad: torch.Tensor | None = None,
    backend: str = "auto",
    noise_kind: str = "gaussian",
) -> None:
    """theta = theta * decay + coef * sum_j w_j A_j B_j^T / sqrt(r), as one [out, P r] x [P r, in] GEMM.

    With `grad`, coef * sum is written there instead; `rounding_key` rounds 16-bit results
    stochastically (uniforms from the rounding stream, as the full-rank update). The factors come from
    `backend` (fastes.ops); the uniforms are exact on every backend, so the reference computes them.
    """
    pairs = [factors(key, tensor_id, param.shape, rank, param.device, backend, noise_kind) for key in keys]
    scale = torch.tensor(list(weights), dtype=torch.float32, device=param.device).repeat_interleave(rank)
    a_all = torch.cat([a for a, _ in pairs], dim=1) * scale  # [out, P r], column j*r+i scaled by w_j
    b_all = torch.cat([b for _, b in pairs], dim=1)  # [in, P r]
    step = coef / math.sqrt(rank) * (a_all @ b_all.T)
    if grad is not None:
        grad.copy_(step.to(grad.dtype))
        return
    new = param.to(torch.float32) * decay + step
    if rounding_key is not None and param.dtype != torch.float32:
        u = noise.uniform(rounding_key, tensor_id, param.numel(), device=param.device).view(param.shape)
        param.copy_(noise.stochastic_round(new, param.dtype, u))
    else:
        param.copy_(new.to(param.dtype))
