"""Diversity of a population of models, measured as a Jensen-Shannon divergence.

Generalised Jensen-Shannon divergence of n distributions P_1..P_n (entropies H in nats, 0 ln 0 = 0):

    JSD(P_1..P_n) = H(mean_i P_i) - mean_i H(P_i)

It is 0 when all P_i are equal and at most ln n (ln 2 for two outcomes).

Verifier projection: instead of comparing full text distributions, look only at what the verifier says.
On prompt x, member i's outcome is Bernoulli(p_i^x), p_i^x the share of its samples the verifier accepts
(or its 0/1 greedy outcome). With the binary entropy h(p) = -p ln p - (1-p) ln(1-p),

    JS^x = h(mean_i p_i^x) - mean_i h(p_i^x)

averaged over prompts; dividing by ln 2 puts it in [0, 1]. High values mean members solve different
prompts, which is what lets a population cover more problems than any single member.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from numpy.typing import ArrayLike

# Members "agree" on a prompt when their acceptance rates span less than this.
AGREEMENT_TOLERANCE = 1e-12


def _to_numpy(values: ArrayLike | torch.Tensor) -> np.ndarray:
    """A float64 numpy copy of an array-like or a torch tensor (on any device)."""
    if isinstance(values, torch.Tensor):
        values = values.detach().to("cpu", torch.float64).numpy()
    return np.asarray(values, dtype=np.float64)


def _xlogx(x: np.ndarray) -> np.ndarray:
    """x * ln x elementwise, with 0 * ln 0 = 0."""
    safe = np.where(x > 0, x, 1.0)
    return np.where(x > 0, x * np.log(safe), 0.0)


def binary_entropy(p: ArrayLike) -> np.ndarray:
    """h(p) = -p ln p - (1 - p) ln(1 - p) in nats, elementwise, with 0 ln 0 = 0 (so h(0) = h(1) = 0)."""
    p = _to_numpy(p)
    return -_xlogx(p) - _xlogx(1.0 - p)


def shannon_entropy(distributions: ArrayLike) -> np.ndarray:
    """Shannon entropy H(P) = -sum_v P_v ln P_v in nats over the last axis, with 0 ln 0 = 0."""
    return -_xlogx(_to_numpy(distributions)).sum(axis=-1)


def generalized_js(distributions: ArrayLike | torch.Tensor) -> float | np.ndarray:
    """Generalised Jensen-Shannon divergence JSD = H(mean_i P_i) - mean_i H(P_i), in nats.

    distributions: [n, V], one probability vector per row (non-negative, each row summing to 1 within
    1e-6); extra leading axes [..., n, V] give one value per leading index. Returns a float for a 2-D
    input, else an array of the leading shape. Tiny negative values from rounding are clipped to 0.
    """
    p = _to_numpy(distributions)
    if p.ndim < 2 or p.shape[-2] == 0 or p.shape[-1] == 0:
        raise ValueError(f"distributions must have shape [..., n, V] with n, V >= 1, got {p.shape}")
    if np.any(~np.isfinite(p)) or np.any(p < 0):
        raise ValueError("distributions must be finite and non-negative")
    if np.any(np.abs(p.sum(axis=-1) - 1.0) > 1e-6):
        raise ValueError("each distribution (row) must sum to 1")
    divergence = shannon_entropy(p.mean(axis=-2)) - shannon_entropy(p).mean(axis=-1)
    divergence = np.maximum(divergence, 0.0)
    return float(divergence) if divergence.ndim == 0 else divergence


@dataclass(frozen=True)
class JSDiversity:
    """Verifier-projected JS diversity of a population (see js_diversity)."""

    mean_nats: float  # mean over prompts of JS^x, in nats (0 .. ln 2)
    normalized: float  # mean_nats / ln 2, in [0, 1]
    per_prompt: np.ndarray  # JS^x for each prompt, in nats
    agreement: float  # share of prompts on which all members have the same acceptance rate


def js_diversity(acceptance: ArrayLike | torch.Tensor) -> JSDiversity:
    """Verifier-projected JS diversity: JS^x = h(mean_i p_i^x) - mean_i h(p_i^x), h the binary entropy.

    acceptance: [members, prompts], p_i^x in [0, 1] = share of member i's samples on prompt x that the
    verifier accepts (or its 0/1 greedy outcome). Returns the mean over prompts in nats and divided by
    ln 2, the per-prompt values, and the share of prompts where the members agree: max_i p_i - min_i p_i
    below 1e-12 (for 0/1 outcomes: all members fail or all succeed). Such prompts have JS^x = 0.
    Tiny negative values from rounding are clipped to 0.
    """
    p = _to_numpy(acceptance)
    if p.ndim != 2 or p.shape[0] == 0 or p.shape[1] == 0:
        raise ValueError(f"acceptance must be a [members, prompts] matrix, both >= 1, got shape {p.shape}")
    if np.any(~np.isfinite(p)) or np.any(p < 0) or np.any(p > 1):
        raise ValueError("acceptance rates must lie in [0, 1]")
    per_prompt = binary_entropy(p.mean(axis=0)) - binary_entropy(p).mean(axis=0)
    per_prompt = np.maximum(per_prompt, 0.0)
    agree = (p.max(axis=0) - p.min(axis=0)) < AGREEMENT_TOLERANCE
    mean_nats = float(per_prompt.mean())
    return JSDiversity(
        mean_nats=mean_nats,
        normalized=mean_nats / math.log(2.0),
        per_prompt=per_prompt,
        agreement=float(agree.mean()),
    )
