"""The registry that builds a task from its name (the names are listed in fastes/tasks/__init__.py)."""

from __future__ import annotations

from typing import Any

from .arithmetic import ArithmeticTask
from .base import GeneratedTask, Task
from .countdown import CountdownTask
from .heldout import CompareTask, ReverseTask
from .instruct import InstructTask
from .jsonl import JsonlTask
from .reasoning_gym import ReasoningGymTask  # imports the package only when a task is created
from .reward_file import RewardTask

TRAINABLE_TASKS = ("countdown", "arithmetic")
HELD_OUT_TASKS = ("reverse", "compare")

_BUILT_IN: dict[str, type[GeneratedTask]] = {
    "countdown": CountdownTask,
    "arithmetic": ArithmeticTask,
    "reverse": ReverseTask,
    "compare": CompareTask,
}
_PREFIXES = ("jsonl:<path>", "reasoning_gym:<dataset>")
STYLES = ("plain", "instruct")


def parse_task_options(text: str) -> dict[str, Any]:
    """ "max_digits=1,operations=+-" -> {"max_digits": 1, "operations": "+-"} (integers become ints)."""
    options: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key.strip().isidentifier():
            raise ValueError(f"task option {item!r} is not key=value (e.g. arithmetic:max_digits=1)")
        value = value.strip()
        options[key.strip()] = int(value) if value.lstrip("-").isdigit() else value
    return options


def available_tasks() -> tuple[str, ...]:
    """Every name get_task accepts, with the prefixed forms shown as patterns."""
    return (*_BUILT_IN, *_PREFIXES)


def get_task(
    name: str,
    seed: int = 0,
    reward: str | None = None,
    style: str = "plain",
    instruction: str = "",
    answer_prefix: str | None = None,
    **options: Any,
) -> Task:
    """Build the task called `name` with the given seed; options go to the task's constructor.

    `reward` ("file.py:function") scores a "jsonl:<path>" task's prompts with your own function.
    `style` "instruct" asks a built-in task in words, with `instruction` (default: the task's own)
    asking for the answer format and `answer_prefix` (default: the task's own; "" for none) starting the
    reply; prompts of other tasks are used as written.
    """
    if style not in STYLES:
        raise ValueError(f"unknown prompt style {style!r}; use one of {', '.join(STYLES)}")
    kind, _, rest = name.partition(":")
    if reward:
        if kind != "jsonl" or not rest:
            raise ValueError(f"a reward function scores a 'jsonl:<path>' task of prompts, not {name!r}")
        return RewardTask(rest, reward, seed=seed, **options)
    if kind in _BUILT_IN:
        try:
            task = _BUILT_IN[kind](seed=seed, **{**options, **parse_task_options(rest)})  # the name's win
        except TypeError as error:  # an option in the name that the constructor does not take
            if not rest:
                raise
            raise ValueError(f"task {name!r}: {error}") from None
        return InstructTask(task, instruction, answer_prefix) if style == "instruct" else task
    if instruction or answer_prefix:
        raise ValueError(
            f"an instruction or answer prefix belongs to a built-in task's instruct form; write it into "
            f"the prompts of {name!r}"
        )
    if kind == "jsonl" and rest:
        return JsonlTask(rest, seed=seed, **options)
    if kind == "reasoning_gym" and rest:
        return ReasoningGymTask(rest, seed=seed, **options)
    raise ValueError(f"unknown task {name!r}; available tasks: {', '.join(available_tasks())}")
