"""Before any work: can one step of the run fit in memory and finish in reasonable time?

A population, a batch or a generation length far beyond the machine (es.population 10^9) used to run
for minutes without a word and leave a half-written run directory. The estimates here are on the low
side (fastes.run.auto_settings' prompt length, no Python overheads, a peak speed no device here reaches), so a
run is refused only when it clearly cannot fit:

    context   max_new_tokens within the model's context (max_position_embeddings)
    device    one generate call's KV cache and logits (fastes.run.auto_settings.row_bytes per row) in the
              memory available now: ES generates at least one member's batch_size rows per call, GRPO
              batch_size * grpo.num_generations rows (this process's share under torchrun)
    host      every completion of a step is held with its text, token ids and score until the step ends:
              ~HOST_BYTES_PER_COMPLETION + HOST_BYTES_PER_TOKEN * max_new_tokens each, in the machine's RAM
    time      2 * parameters FLOP per generated token at PEAK_FLOPS (more than any device reaches here)
              must stay under MAX_STEP_SECONDS
"""

from __future__ import annotations

import os

import torch

from fastes import distributed
from fastes.errors import ConfigError

from .auto_settings import available_memory, row_bytes
from .config import TrainConfig

HOST_BYTES_PER_COMPLETION = 400  # its text, Score and list entries
HOST_BYTES_PER_TOKEN = 40  # a token id in a Python list, and its characters
PEAK_FLOPS = {"cuda": 2e15, "cpu": 1e13}
MAX_STEP_SECONDS = 86_400.0  # one step longer than a day: no reasonable run


def check_sizes(cfg: TrainConfig, model: torch.nn.Module, phases: tuple[str, ...], train_rows: int) -> None:
    """Raise a ConfigError naming the settings and the estimate when a step of a phase cannot fit. A step
    takes min(batch_size, train_rows) prompts (fastes.run.shared.batch_for)."""
    context = getattr(model.config, "max_position_embeddings", None)  # GPT-2's n_positions too
    if context and cfg.max_new_tokens > context:
        raise ConfigError(
            f"max_new_tokens: {cfg.max_new_tokens} tokens do not fit in the model's context of {context} "
            f"tokens (max_position_embeddings); lower max_new_tokens"
        )
    world = distributed.rank_and_world()[1]
    params = sum(p.numel() for p in model.parameters())
    device, host = available_memory(cfg.device), os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for phase in phases:
        prompts = min(cfg.batch_size, train_rows)
        if phase == "es":
            keys, total, per_call = "es.population * batch_size", cfg.es.population * prompts, prompts
        else:
            keys = "batch_size * grpo.num_generations"
            total = per_call = prompts * cfg.grpo.num_generations
        mine, per_call = total // world, max(1, per_call // world)  # this process's share
        tokens = f"max_new_tokens = {cfg.max_new_tokens}"
        step = f"{keys} = {total:,} completions of {tokens} per {phase.upper()} step"
        host_bytes = mine * (HOST_BYTES_PER_COMPLETION + HOST_BYTES_PER_TOKEN * cfg.max_new_tokens)
        estimates = {
            "the KV cache of one generate call": (per_call * row_bytes(model, cfg), device, "free memory"),
            "holding a step's completions": (host_bytes, host, "RAM"),
        }
        for what, (needed, have, kind) in estimates.items():
            if needed > have:
                raise ConfigError(
                    f"{step}: {what} needs at least {needed / 2**30:,.1f} GiB, more than the "
                    f"{have / 2**30:,.1f} GiB of {kind} here; lower them"
                )
        peak = PEAK_FLOPS["cuda" if cfg.device.startswith("cuda") else "cpu"]
        seconds = 2.0 * params * mine * cfg.max_new_tokens / peak
        if seconds > MAX_STEP_SECONDS:
            raise ConfigError(
                f"{step}: generating them takes at least {seconds / 3600:,.0f} hours (2 x {params:,} "
                f"parameters FLOP per token at {peak:.0e} FLOP/s, more than this device reaches); lower them"
            )
