"""Fitness shaping: turn a population's rewards into the weights of the ES update.

Every method maps an all-equal reward vector to all-zero weights (never NaN), so a generation in which
no member is better than another leaves the weights where they are.
"""

from __future__ import annotations

import torch

SHAPINGS = ("centered_rank", "zscore", "group_zscore", "raw")
ZSCORE_EPS = 1e-8


def centered_rank(rewards: torch.Tensor) -> torch.Tensor:
    """Ranks scaled to [-0.5, 0.5] (rank / (N - 1) - 0.5), tied rewards sharing their average rank."""
    n = rewards.numel()
    order = torch.argsort(rewards, stable=True)
    ranks = torch.empty(n, dtype=torch.float64)
    ranks[order] = torch.arange(n, dtype=torch.float64)
    # Ties: every member of a group of equal rewards gets the mean rank of the group.
    _, group, counts = torch.unique(rewards, return_inverse=True, return_counts=True)
    group_rank_sum = torch.zeros(counts.numel(), dtype=torch.float64).index_add_(0, group, ranks)
    ranks = group_rank_sum[group] / counts[group].to(torch.float64)
    return ranks / (n - 1) - 0.5


def zscore(rewards: torch.Tensor) -> torch.Tensor:
    """(r - mean) / (std + 1e-8) with the population (biased) standard deviation."""
    r = rewards.to(torch.float64)
    centered = r - r.mean()
    if torch.all(centered == 0):
        return torch.zeros_like(r)
    return centered / (r.std(correction=0) + ZSCORE_EPS)


def group_zscore(rewards: torch.Tensor) -> torch.Tensor:
    """Per-prompt z-score: normalise each prompt's column across members, then average over prompts.

    `rewards` is [members, prompts]; prompts on which every member scores the same contribute nothing.
    """
    if rewards.dim() != 2:
        raise ValueError(
            "shaping 'group_zscore' needs per-prompt rewards of shape [members, prompts]; "
            f"got shape {tuple(rewards.shape)}"
        )
    return torch.stack([zscore(column) for column in rewards.T.to(torch.float64)], dim=1).mean(dim=1)


def shape_rewards(rewards: torch.Tensor, method: str) -> torch.Tensor:
    """float64 weights [members] from rewards [members] or [members, prompts].

    Per-prompt rewards are averaged over prompts first, except for 'group_zscore' which normalises each
    prompt separately. 'raw' uses the (mean) rewards as they are: with antithetic sampling only the
    differences r+ - r- enter the update, so equal rewards still give a zero step.
    """
    if method not in SHAPINGS:
        raise ValueError(f"unknown shaping {method!r}; choose one of {SHAPINGS}")
    if method == "group_zscore":
        return group_zscore(rewards)
    r = rewards.to(torch.float64)
    if r.dim() == 2:
        r = r.mean(dim=1)
    if method == "centered_rank":
        return centered_rank(r)
    if method == "zscore":
        return zscore(r)
    return r
