"""A run's task and rewards from its settings: checked before any work, then built (make_task).

The run config (`fastes.run.config`) holds the settings and calls `check_settings` when it validates
them; this module knows what they mean: whether a task name exists, a built-in task's options, the
reward functions and their weights, the data files. Mistakes raise a ConfigError naming the setting.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

from fastes.errors import ConfigError, FastesError

from .base import DEFAULT_TEST_PROBLEMS, Task
from .dataset import DatasetTask
from .registry import available_tasks, get_task, parse_task_options


class TaskSettings(Protocol):
    """The settings that choose a run's task and rewards (fastes.run.config.TrainConfig has them)."""

    task: str
    task_seed: int
    dataset: str
    eval_dataset: str
    reward: str
    reward_weights: str
    reward_timeout: float
    prompt_style: str
    instruction: str
    answer_prefix: str
    eval_size: int


def task_exists(name: str) -> bool:
    """A built-in task name exactly, or a prefixed form ("jsonl:<path>") with something after the colon."""
    kind, _, rest = name.partition(":")
    prefixed = {t.partition(":")[0] for t in available_tasks() if ":" in t}
    built_in = {t for t in available_tasks() if ":" not in t}
    return kind in built_in or (kind in prefixed and rest != "")


def reward_specs(reward: str) -> list[str]:
    """The FILE.py:FUNCTION entries of `reward` (comma-separated)."""
    return [entry.strip() for entry in reward.split(",") if entry.strip()]


def parse_weights(text: str) -> list[float] | None:
    """The numbers of `reward_weights` ("1,0.5"); None when empty (every function weighs 1)."""
    if not text.strip():
        return None
    try:
        return [float(part) for part in text.split(",")]
    except ValueError:
        raise ConfigError(
            f"reward_weights: {text!r} is not a comma-separated list of numbers, e.g. 1,0.5"
        ) from None


def dataset_task(settings: TaskSettings) -> DatasetTask:
    """The DatasetTask of `settings.dataset`, scored by `settings.reward`'s functions with their weights."""
    return DatasetTask.from_files(
        settings.dataset,
        reward_specs(settings.reward),
        eval_path=settings.eval_dataset or None,
        reward_weights=parse_weights(settings.reward_weights),
        seed=settings.task_seed,
        timeout=settings.reward_timeout,
    )


def check_settings(settings: TaskSettings) -> None:
    """The task exists and its options parse; the reward functions load and the data files read now,
    so that a mistake fails before any work."""
    # "dataset": rows from the `dataset` file, or given in code to fastes.run.train.train (fastes.ESTrainer).
    if not (task_exists(settings.task) or settings.task == "dataset"):
        raise ConfigError(
            f"task: {settings.task!r} does not exist; available: {', '.join(available_tasks())}, dataset"
        )
    _check_task_options(settings.task)
    if settings.dataset:
        _check_dataset(settings)
    else:
        _check_reward(settings)


def _check_task_options(task: str) -> None:
    """A built-in task's options in its name ("arithmetic:max_digits=1") are key=value pairs."""
    kind, _, rest = task.partition(":")
    if kind in available_tasks() and rest:
        try:
            parse_task_options(rest)
        except ValueError as error:
            raise ConfigError(f"task: {error}") from None


def _check_dataset(settings: TaskSettings) -> None:
    """Read the data files and load the reward functions now."""
    if settings.task != "dataset":
        raise ConfigError(
            f"dataset: replaces the task: set task = 'dataset' too (it is {settings.task!r}); `--dataset` "
            "on the command line does that"
        )
    if settings.reward == "":
        raise ConfigError("dataset: needs reward functions: reward = 'rewards.py:score[,more.py:f]'")
    _check_timeout(settings.reward_timeout)
    try:
        dataset_task(settings)
    except (ValueError, OSError, ImportError) as error:
        raise ConfigError(f"dataset: {error}") from None


def _check_reward(settings: TaskSettings) -> None:
    """Without a dataset: one reward function scoring a jsonl:<path> task, loaded now with its file."""
    if settings.eval_dataset:
        raise ConfigError("eval_dataset: holds the held-out rows of `dataset`; set dataset too")
    if settings.reward_weights:
        raise ConfigError("reward_weights: weighs the reward functions of `dataset`; set it too")
    if not settings.reward:
        return
    _check_timeout(settings.reward_timeout)
    if len(reward_specs(settings.reward)) != 1:
        raise ConfigError(
            "reward: several reward functions need a dataset: give it as dataset = 'data.jsonl'"
        )
    if not settings.task.startswith("jsonl:"):
        raise ConfigError(f"reward: scores a jsonl:<path> task of prompts, not {settings.task!r}")
    try:
        get_task(
            settings.task, seed=settings.task_seed, reward=settings.reward, timeout=settings.reward_timeout
        )
    except (ValueError, OSError) as error:
        raise ConfigError(f"reward: {error}") from None


def _check_timeout(timeout: float) -> None:
    if not timeout > 0:
        raise ConfigError(f"reward_timeout: must be > 0 seconds, got {timeout}")


def make_task(cfg: TaskSettings, strict_alphabet: bool = True) -> Task:
    """The configured task; with `reward`, a JSONL file of prompts scored by the user's function; with
    `dataset`, a data file scored by one or more weighted reward functions.

    A built-in task draws at least `eval_size` test problems. Its test problems are drawn after the
    train ones, so the first 200 (the default) are the same whatever the count. `cfg.prompt_style` must
    be resolved (fastes.run.auto_settings resolves a run's); JSONL prompts are held to the character
    model's alphabet only when `strict_alphabet` (the model has the character tokenizer).
    """
    if cfg.dataset:
        return dataset_task(cfg)
    if cfg.task == "dataset":
        raise ConfigError(
            "task: 'dataset' takes its rows from `dataset` (a data file) or from code (fastes.ESTrainer); "
            "set dataset = 'data.jsonl'"
        )
    if cfg.reward:
        return get_task(cfg.task, seed=cfg.task_seed, reward=cfg.reward, timeout=cfg.reward_timeout)
    kind = cfg.task.partition(":")[0]
    with task_errors():
        if kind in available_tasks():
            return get_task(
                cfg.task,
                seed=cfg.task_seed,
                style=cfg.prompt_style,
                instruction=cfg.instruction,
                answer_prefix=None if cfg.answer_prefix == "auto" else cfg.answer_prefix,
                n_test=max(DEFAULT_TEST_PROBLEMS, cfg.eval_size),
            )
        if kind == "jsonl":
            return get_task(cfg.task, seed=cfg.task_seed, strict_alphabet=strict_alphabet)
        return get_task(cfg.task, seed=cfg.task_seed)


@contextmanager
def task_errors() -> Iterator[None]:
    """A ValueError from building a task is an error in the config's `task` (fastes' own errors, which
    already say what to fix, pass as they are)."""
    try:
        yield
    except ValueError as error:
        if isinstance(error, FastesError):
            raise
        raise ConfigError(f"task: {error}") from None
