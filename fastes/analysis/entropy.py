"""Token entropy of a language model's next-token distributions (the "entropy" metric of TRL's GRPO logs).

At each position the model's distribution over the full vocabulary is q = softmax(logits / T) and its
entropy in nats is

    H = -sum_v q_v * ln q_v        (with 0 * ln 0 = 0)

computed from log_softmax for stability. The reported value is the mean of H over completion tokens
(positions where the mask is true). A collapsing policy drives it towards 0; a uniform one has ln V.
"""

from __future__ import annotations

import torch

# Rows (positions) handled at once: bounds the fp32 working copy of the logits for large vocabularies.
ROWS_PER_CHUNK = 1024


def _entropy_of_rows(rows: torch.Tensor, temperature: float) -> torch.Tensor:
    """Entropy in nats of softmax(rows / temperature) for each row of a [M, V] tensor, in fp32."""
    log_q = torch.log_softmax(rows.float() / temperature, dim=-1)
    q = log_q.exp()
    # Where q underflows to 0 (or a logit is -inf) the term is 0 * ln 0 = 0, not nan.
    q_log_q = torch.where(q > 0, q * log_q, torch.zeros_like(q))
    return -q_log_q.sum(dim=-1)


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def token_entropies(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Per-position entropy H = -sum_v q_v ln q_v of q = softmax(logits / temperature), in nats.

    logits: [..., V]. Returns an fp32 tensor of shape [...] (the vocabulary dimension reduced).
    """
    _check_temperature(temperature)
    rows = logits.reshape(-1, logits.shape[-1])
    pieces = [_entropy_of_rows(chunk, temperature) for chunk in rows.split(ROWS_PER_CHUNK)]
    if not pieces:
        return torch.empty(logits.shape[:-1], dtype=torch.float32, device=logits.device)
    return torch.cat(pieces).reshape(logits.shape[:-1])


def token_entropy(logits: torch.Tensor, mask: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Mean token entropy over masked positions: mean_{t: mask_t} ( -sum_v q_tv ln q_tv ), in nats.

    logits: [..., V] (e.g. [batch, seq, V]); mask: [...] with the same leading shape, true (or 1) on
    completion tokens; q_t = softmax(logits_t / temperature). Only masked rows are converted to fp32,
    a chunk at a time. Returns a 0-dim fp32 tensor on the logits' device; NaN when the mask selects
    no position.
    """
    _check_temperature(temperature)
    if mask.shape != logits.shape[:-1]:
        raise ValueError(
            f"mask shape {tuple(mask.shape)} must equal logits shape without the vocabulary "
            f"dimension {tuple(logits.shape[:-1])}"
        )
    rows = logits[mask.to(device=logits.device, dtype=torch.bool)]
    if rows.shape[0] == 0:
        return torch.full((), float("nan"), dtype=torch.float32, device=logits.device)
    total = torch.zeros((), dtype=torch.float32, device=logits.device)
    for chunk in rows.split(ROWS_PER_CHUNK):
        total = total + _entropy_of_rows(chunk, temperature).sum()
    return total / rows.shape[0]
