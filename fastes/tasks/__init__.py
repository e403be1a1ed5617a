"""Verifiable tasks and the registry that builds them by name.

    task = get_task("countdown", seed=0, n_numbers=4)
    example = task.split("train")[0]
    task.score(example, example.solution)  # Score(format=1.0, answer=1.0)

Names:
  countdown, arithmetic       trained on by ES / GRPO (TRAINABLE_TASKS)
  reverse, compare            pretraining only, for held-out / forgetting evaluation (HELD_OUT_TASKS)
  jsonl:<path>                user tasks from a JSONL file (see jsonl.py); with reward="file.py:function",
                              prompts and columns scored by your own function (see reward_file.py)
  reasoning_gym:<dataset>     a reasoning-gym dataset; needs `pip install reasoning-gym`
Rows and reward functions as TRL takes them (a datasets.Dataset or list of dicts, several weighted
functions) make a DatasetTask (dataset.py); task_dataset(name) gives a built-in task in that form.
Options are passed to the task's constructor (n_train, n_test and task-specific ones).
"""

from __future__ import annotations

from typing import Any

from .arithmetic import ArithmeticTask
from .base import ALPHABET, Example, GeneratedTask, Score, Task
from .countdown import CountdownTask, solve_countdown
from .dataset import DatasetError, DatasetTask, task_dataset
from .heldout import CompareTask, ReverseTask
from .jsonl import JsonlTask, JsonlTaskError
from .reasoning_gym import ReasoningGymTask  # imports the package only when a task is created
from .reward_file import RewardFunction, RewardFunctionError, RewardTask
from .verify import (
    ParsedExpr,
    extract_answer,
    parse_expression,
    parse_number,
    score_countdown,
    score_exact,
    score_numeric,
)

TRAINABLE_TASKS = ("countdown", "arithmetic")
HELD_OUT_TASKS = ("reverse", "compare")

_BUILT_IN: dict[str, type[GeneratedTask]] = {
    "countdown": CountdownTask,
    "arithmetic": ArithmeticTask,
    "reverse": ReverseTask,
    "compare": CompareTask,
}
_PREFIXES = ("jsonl:<path>", "reasoning_gym:<dataset>")


def available_tasks() -> tuple[str, ...]:
    """Every name get_task accepts, with the prefixed forms shown as patterns."""
    return (*_BUILT_IN, *_PREFIXES)


def get_task(name: str, seed: int = 0, reward: str | None = None, **options: Any) -> Task:
    """Build the task called `name` with the given seed; options go to the task's constructor.

    `reward` ("file.py:function") scores a "jsonl:<path>" task's prompts with your own function.
    """
    if reward:
        kind, _, rest = name.partition(":")
        if kind != "jsonl" or not rest:
            raise ValueError(f"a reward function scores a 'jsonl:<path>' task of prompts, not {name!r}")
        return RewardTask(rest, reward, seed=seed, **options)
    if name in _BUILT_IN:
        return _BUILT_IN[name](seed=seed, **options)
    kind, _, rest = name.partition(":")
    if kind == "jsonl" and rest:
        return JsonlTask(rest, seed=seed, **options)
    if kind == "reasoning_gym" and rest:
        return ReasoningGymTask(rest, seed=seed, **options)
    raise ValueError(f"unknown task {name!r}; available tasks: {', '.join(available_tasks())}")


__all__ = [
    "ALPHABET",
    "HELD_OUT_TASKS",
    "TRAINABLE_TASKS",
    "ArithmeticTask",
    "CompareTask",
    "CountdownTask",
    "DatasetError",
    "DatasetTask",
    "Example",
    "GeneratedTask",
    "JsonlTask",
    "JsonlTaskError",
    "ParsedExpr",
    "ReasoningGymTask",
    "ReverseTask",
    "RewardFunction",
    "RewardFunctionError",
    "RewardTask",
    "Score",
    "Task",
    "available_tasks",
    "extract_answer",
    "get_task",
    "parse_expression",
    "parse_number",
    "score_countdown",
    "score_exact",
    "score_numeric",
    "solve_countdown",
    "task_dataset",
]
