"""Verifiable tasks and the registry that builds them by name.

    task = get_task("countdown", seed=0, n_numbers=4)
    example = task.split("train")[0]
    task.score(example, example.solution)  # Score(format=1.0, answer=1.0)

Names (registry.py):
  countdown, arithmetic       trained on by ES / GRPO (TRAINABLE_TASKS)
  reverse, compare            pretraining only, for held-out / forgetting evaluation (HELD_OUT_TASKS)
  <built-in>:key=value,...    a built-in task with constructor options, e.g. arithmetic:max_digits=1
  jsonl:<path>                user tasks from a JSONL file (see jsonl.py); with reward="file.py:function",
                              prompts and columns scored by your own function (see reward_file.py)
  reasoning_gym:<dataset>     a reasoning-gym dataset; needs `pip install reasoning-gym`
Rows and reward functions as TRL takes them (a datasets.Dataset or list of dicts, several weighted
functions) make a DatasetTask (dataset.py); task_dataset(name) gives a built-in task in that form.
Options are passed to the task's constructor (n_train, n_test and task-specific ones).
style="instruct" asks a built-in task's problems in words for instruct models (see instruct.py).
"""

from __future__ import annotations

from .arithmetic import ArithmeticTask
from .base import ALPHABET, Example, GeneratedTask, Score, Task
from .countdown import CountdownTask, solve_countdown
from .dataset import DatasetError, DatasetTask, task_dataset
from .heldout import CompareTask, ReverseTask
from .instruct import InstructTask, stated_answer
from .jsonl import JsonlTask, JsonlTaskError
from .reasoning_gym import ReasoningGymTask
from .registry import HELD_OUT_TASKS, STYLES, TRAINABLE_TASKS, available_tasks, get_task, parse_task_options
from .reward_file import RewardFunction, RewardFunctionError, RewardTask
from .reward_model import RewardModel
from .verify import (
    ParsedExpr,
    extract_answer,
    parse_expression,
    parse_number,
    score_countdown,
    score_exact,
    score_numeric,
)

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
    "InstructTask",
    "JsonlTask",
    "JsonlTaskError",
    "ParsedExpr",
    "ReasoningGymTask",
    "ReverseTask",
    "RewardFunction",
    "RewardFunctionError",
    "RewardModel",
    "RewardTask",
    "STYLES",
    "Score",
    "Task",
    "available_tasks",
    "extract_answer",
    "get_task",
    "parse_expression",
    "parse_number",
    "parse_task_options",
    "score_countdown",
    "score_exact",
    "score_numeric",
    "solve_countdown",
    "stated_answer",
    "task_dataset",
]
