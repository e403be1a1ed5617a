"""What the phases of a run share: the Run itself, the prompts of a step, and the reward functions' metrics.

fastes/run/train.py (the loop, ES) and fastes/run/grpo_loop.py (GRPO) both import from here, never from each
other's helpers, so that no module imports back the one importing it.
"""

from __future__ import annotations

import functools
import gc
import math
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fastes import distributed
from fastes.models.adapters import StartingAdapter
from fastes.tasks import DatasetTask, Example, Score, Task

from . import rundir
from .callbacks import Callbacks
from .config import TrainConfig
from .evaluation import render_prompts


@dataclass
class Run:
    """What every phase needs: the config, the policy, the task and where to write."""

    cfg: TrainConfig
    model: torch.nn.Module
    tokenizer: Any
    task: Task
    out_dir: Path
    identity: dict[str, Any] = field(default_factory=dict)  # rundir.run_identity, saved in checkpoints
    metrics: list[dict] = field(default_factory=list)
    callbacks: Callbacks = field(default_factory=Callbacks)  # called by the writing process only
    test: list[Example] = field(default_factory=list)  # the held-out examples evaluated (eval_size)
    # GRPO's KL reference (beta > 0): the starting model, frozen, called like the model: a copy, or with
    # a PEFT adapter fastes.models.adapters.StartingAdapter (no copy)
    reference: torch.nn.Module | StartingAdapter | None = None

    def log(self, record: dict) -> None:
        self.metrics.append(record)
        if distributed.is_writer():  # every rank holds the same (all-reduced) records; one writes them
            rundir.append_metrics(self.out_dir, record)
            self.callbacks.log(record)

    def prompts(self, examples: list[Example]) -> list[str]:
        return render_prompts(self.cfg, self.tokenizer, examples)


@contextmanager
def long_lived_objects_frozen() -> Iterator[None]:
    """Keep every object that exists now out of the cyclic garbage collector's full passes, for the block.

    When the loop starts, ~390k objects are tracked (the model's modules and parameters, the tokenizer,
    the task, the imported libraries), and they live as long as the run. Each full pass would walk them
    all: 140-170 ms on SmolLM2 or on the tiny model, once every few dozen iterations, landing in whatever
    phase happens to trigger it (docs/backends.md). Objects made inside the block are collected as usual.
    A caller that froze objects itself keeps them frozen after the block.
    """
    frozen_before = gc.get_freeze_count()
    gc.freeze()
    try:
        yield
    finally:
        if not frozen_before:
            gc.unfreeze()


@functools.lru_cache(maxsize=16)  # an ES iteration asks every time: building the scheduler costs ~0.1 ms
def learning_rates(
    lr: float, scheduler_type: str, warmup_steps: float, total_steps: int
) -> Callable[[int], float]:
    """The learning rate of step n (from 0) as transformers' get_scheduler gives it over `total_steps`
    steps, with warmup_steps (a count >= 1, or a fraction of total_steps). A function of n alone, so a
    resumed run and replay() see the same rates as an uninterrupted run (GRPO's optimizer steps, ES's
    iterations)."""
    from transformers import get_scheduler

    warmup = int(warmup_steps) if warmup_steps >= 1 else math.ceil(total_steps * warmup_steps)
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    factor = get_scheduler(
        scheduler_type, probe, num_warmup_steps=warmup, num_training_steps=total_steps
    ).lr_lambdas[0]
    return lambda n: lr * factor(n)


def batch_for(run: Run, phase: str, step: int) -> list[Example]:
    """The training prompts of (phase, step): a pure function of the seed, so resume sees the same ones."""
    rng = random.Random(f"{run.cfg.seed}:{phase}:{step}")
    train = run.task.split("train")
    return rng.sample(train, min(run.cfg.batch_size, len(train)))


def reward_parts(task: Task, scores: list[Score]) -> dict[str, Any]:
    """rewards/<name>/mean and /std of each reward function over the scores of every process (TRL's
    metrics), for tasks scored by named reward functions; a function's None (NaN) values left out.
    The names come from the task, so that every process joins the sum, also one without scores.
    Also what the reward functions logged while scoring them: each log_metric name's mean over every
    process, and log_extra's columns (this process's completions, in scoring order) under "log_extra"."""
    metrics, extras = task.logged()
    parts = _logged_means(metrics)
    if extras:
        parts["log_extra"] = extras
    names = [f.name for f in task.functions] if isinstance(task, DatasetTask) else []
    if not names:
        return parts
    values = torch.tensor([[s.rewards[n] for n in names] for s in scores], dtype=torch.float64)
    values = values.reshape(len(scores), len(names))  # also when there are no scores
    finite = torch.isfinite(values)
    zeroed = torch.where(finite, values, torch.zeros_like(values))
    count, total = distributed.all_sum(torch.cat([finite.sum(0).double(), zeroed.sum(0)])).view(2, -1)
    mean = total / count  # NaN for a function that scored nothing
    # Two passes: the squared deviations from the mean, not sum(x^2) - n mean^2, which cancels badly.
    squares = distributed.all_sum(torch.where(finite, (values - mean) ** 2, 0.0).sum(0))
    std = (squares / (count - 1)).sqrt()
    for i, name in enumerate(names):
        parts[f"rewards/{name}/mean"] = float(mean[i])
        parts[f"rewards/{name}/std"] = float(std[i]) if count[i] > 1 else math.nan
    return parts


def _logged_means(metrics: dict[str, list[float]]) -> dict[str, float]:
    """Each logged metric's mean over its values on every process (TRL averages a step's values)."""
    names = sorted(metrics)
    if distributed.rank_and_world()[1] > 1:  # every process sums the same names, in the same order
        every: list[list[str]] = [[] for _ in range(distributed.rank_and_world()[1])]
        torch.distributed.all_gather_object(every, names)
        names = sorted({name for ranks in every for name in ranks})
    if not names:
        return {}
    local = [x for name in names for x in (math.fsum(metrics.get(name, [])), len(metrics.get(name, [])))]
    totals = distributed.all_sum(local).view(-1, 2).tolist()
    return {name: total / count for name, (total, count) in zip(names, totals) if count}
