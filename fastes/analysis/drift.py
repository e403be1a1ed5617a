"""How far a trained model has drifted from its base: token-level KL and perplexity.

Token KL: at each masked position t, with p_t = softmax(logits_p_t) (usually the trained model) and
q_t = softmax(logits_q_t) (usually the base model),

    KL(p_t || q_t) = sum_v p_tv * (ln p_tv - ln q_tv)        (terms with p_tv = 0 are 0)

averaged over masked positions. Perplexity of a corpus: exp(total negative log-likelihood / tokens).
"""

from __future__ import annotations

import math

import torch

# Rows (positions) handled at once: bounds the fp32 working copies of the logits.
ROWS_PER_CHUNK = 1024


def _check_mask(mask: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """The mask as a bool tensor on the logits' device, after checking it matches logits[..., 0]."""
    if mask.shape != logits.shape[:-1]:
        raise ValueError(
            f"mask shape {tuple(mask.shape)} must equal logits shape without the vocabulary "
            f"dimension {tuple(logits.shape[:-1])}"
        )
    return mask.to(device=logits.device, dtype=torch.bool)


def _kl_of_rows(rows_p: torch.Tensor, rows_q: torch.Tensor) -> torch.Tensor:
    """KL(softmax(rows_p) || softmax(rows_q)) for each row of two [M, V] tensors, in fp32."""
    log_p = torch.log_softmax(rows_p.float(), dim=-1)
    log_q = torch.log_softmax(rows_q.float(), dim=-1)
    p = log_p.exp()
    terms = torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p))
    return terms.sum(dim=-1)


def token_kl(logits_p: torch.Tensor, logits_q: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean token-level KL(p || q) = mean_{t: mask_t} sum_v p_tv (ln p_tv - ln q_tv), in nats.

    logits_p, logits_q: [..., V] of the same shape (p = softmax(logits_p), q = softmax(logits_q));
    mask: [...], true on the positions to average. Exactly 0 for identical logits, > 0 otherwise.
    Returns a 0-dim fp32 tensor; NaN when the mask selects no position.
    """
    if logits_p.shape != logits_q.shape:
        raise ValueError(f"logits shapes differ: {tuple(logits_p.shape)} vs {tuple(logits_q.shape)}")
    keep = _check_mask(mask, logits_p)
    rows_p = logits_p[keep]
    rows_q = logits_q.to(logits_p.device)[keep]
    if rows_p.shape[0] == 0:
        return torch.full((), float("nan"), dtype=torch.float32, device=logits_p.device)
    total = torch.zeros((), dtype=torch.float32, device=logits_p.device)
    for chunk_p, chunk_q in zip(rows_p.split(ROWS_PER_CHUNK), rows_q.split(ROWS_PER_CHUNK), strict=True):
        total = total + _kl_of_rows(chunk_p, chunk_q).sum()
    return total / rows_p.shape[0]


def masked_nll(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> tuple[float, int]:
    """Summed negative log-likelihood -sum_{t: mask_t} ln softmax(logits_t)[targets_t] and the token count.

    logits: [..., V]; targets: [...] token ids already aligned with the logits (logits at t predict
    targets at t: shift before calling); mask: [...], true on the tokens to score.
    Feed the result to perplexity().
    """
    keep = _check_mask(mask, logits)
    if targets.shape != logits.shape[:-1]:
        raise ValueError(f"targets shape {tuple(targets.shape)} must equal {tuple(logits.shape[:-1])}")
    rows = logits[keep]
    row_targets = targets.to(logits.device)[keep]
    total = 0.0
    chunks = zip(rows.split(ROWS_PER_CHUNK), row_targets.split(ROWS_PER_CHUNK), strict=True)
    for chunk, chunk_targets in chunks:
        log_probs = torch.log_softmax(chunk.float(), dim=-1)
        total -= float(log_probs.gather(-1, chunk_targets.long().unsqueeze(-1)).sum())
    return total, int(rows.shape[0])


def perplexity(nll_sum: float | torch.Tensor, n_tokens: int) -> float:
    """Perplexity = exp(nll_sum / n_tokens), nll_sum the summed per-token negative log-likelihood in nats."""
    if n_tokens <= 0:
        raise ValueError(f"n_tokens must be > 0, got {n_tokens}")
    mean_nll = float(nll_sum) / n_tokens
    try:
        return math.exp(mean_nll)
    except OverflowError:  # a mean NLL above ~709 nats: perplexity beyond the float range
        return math.inf
