"""Hooks into a training run: your callbacks, and TensorBoard (report_to = "tensorboard").

A callback is any object with some of these methods, called by the process that writes the run directory:

    on_train_begin(global_step)         before the first step; global_step > 0 when a run resumes
    on_step_end(global_step, metrics)   after each training step, with its metrics.jsonl record
    on_evaluate(global_step, metrics)   after each evaluation, with its metrics (test_* in metrics.jsonl)
    on_save(global_step, path)          after a checkpoint or the final model directory is written
    on_train_end(global_step)           after the last step

A transformers.TrainerCallback (PrinterCallback, your subclass) works too: its hooks are called as
transformers' Trainer calls them, (args, state, control, **kwargs), from these (TrainerCallbackAdapter).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

from fastes.errors import ConfigError

HOOKS = ("on_train_begin", "on_step_end", "on_evaluate", "on_save", "on_train_end")
TENSORBOARD_DIR = "tensorboard"  # under the run directory
NOT_CURVES = ("global_step", "step", "phase")  # record keys that are no metric


class Callbacks:
    """The callbacks of one run, each hook called on each of them in order."""

    def __init__(self, callbacks: list[Any] | None = None, *, args: Any = None, max_steps: int = 0) -> None:
        """Checked here, before any work. transformers.TrainerCallback instances are wrapped in a
        TrainerCallbackAdapter that hands them `args` (the trainer's config) and a TrainerState of
        `max_steps` steps."""
        if callbacks is not None and not isinstance(callbacks, (list, tuple)):
            raise ConfigError(
                f"callbacks: must be a list of callbacks, got {type(callbacks).__name__}; pass "
                f"callbacks=[{type(callbacks).__name__}(...)]"
            )
        self.callbacks = []
        trainer_callback = _trainer_callback_class()
        for callback in callbacks or []:
            if isinstance(callback, type):
                raise ConfigError(
                    f"callbacks: {callback.__name__} is a class; pass an instance of it: "
                    f"{callback.__name__}()"
                )
            if trainer_callback is not None and isinstance(callback, trainer_callback):
                callback = TrainerCallbackAdapter(callback, args, max_steps)
            elif not any(callable(getattr(callback, hook, None)) for hook in HOOKS):
                raise ConfigError(
                    f"callbacks: {callback!r} has none of the hooks {', '.join(HOOKS)}; give it at least "
                    "one, or make it a transformers.TrainerCallback"
                )
            self.callbacks.append(callback)

    def fire(self, hook: str, *args: Any) -> None:
        for callback in self.callbacks:
            method = getattr(callback, hook, None)
            if callable(method):
                method(*args)

    def log(self, record: dict[str, Any]) -> None:
        """A metrics.jsonl record: a training step's metrics (it has a reward) and/or an evaluation's."""
        step = record["global_step"]
        evaluation = {k: v for k, v in record.items() if k.startswith("test_")}
        if "reward" in record:
            self.fire("on_step_end", step, {k: v for k, v in record.items() if k not in evaluation})
        if evaluation:
            self.fire("on_evaluate", step, evaluation)


def _trainer_callback_class() -> type | None:
    """transformers.TrainerCallback when transformers is loaded (an instance of it implies it is)."""
    module = sys.modules.get("transformers.trainer_callback")
    return getattr(module, "TrainerCallback", None)


class TrainerCallbackAdapter:
    """A transformers.TrainerCallback driven by fastes' hooks. Each of its hooks is called as transformers'
    Trainer calls it, (args, state, control, **kwargs): `args` the trainer's config (TRL's field names),
    `state` a transformers.TrainerState that follows the run (global_step, max_steps, log_history),
    `control` a transformers.TrainerControl. A step calls on_step_end, then on_log(logs=its metrics); an
    evaluation on_evaluate(metrics=eval_*), then on_log. Hooks without a fastes counterpart (on_step_begin,
    on_epoch_*, on_optimizer_step, on_predict...) are not called, and control's flags are not acted on:
    a run takes its configured number of steps."""

    def __init__(self, callback: Any, args: Any, max_steps: int) -> None:
        from transformers.trainer_callback import TrainerControl, TrainerState

        self.callback, self.args = callback, args
        self.state = TrainerState(max_steps=max_steps)
        self.control = TrainerControl()

    def _call(self, event: str, global_step: int, **kwargs: Any) -> None:
        self.state.global_step = global_step
        getattr(self.callback, event)(self.args, self.state, self.control, **kwargs)

    def _log(self, global_step: int, logs: dict[str, Any]) -> None:
        self.state.log_history.append({**logs, "step": global_step})
        self._call("on_log", global_step, logs=dict(logs))

    def on_train_begin(self, global_step: int) -> None:
        self._call("on_train_begin", global_step)

    def on_step_end(self, global_step: int, metrics: dict[str, Any]) -> None:
        self._call("on_step_end", global_step)
        self._log(global_step, {k: v for k, v in metrics.items() if k not in NOT_CURVES})

    def on_evaluate(self, global_step: int, metrics: dict[str, Any]) -> None:
        evaluation = {f"eval_{k.removeprefix('test_')}": v for k, v in metrics.items()}
        self._call("on_evaluate", global_step, metrics=evaluation)
        self._log(global_step, evaluation)

    def on_save(self, global_step: int, path: Path) -> None:
        self._call("on_save", global_step)

    def on_train_end(self, global_step: int) -> None:
        self._call("on_train_end", global_step)


class TensorBoardCallback:
    """Writes each step's metrics as train/<name> and each evaluation's as eval/<name> (TRL's tags),
    flushed at once so that a running TensorBoard shows them live.

    A resumed run redoes the steps after its checkpoint: the writer is opened with purge_step there, so
    TensorBoard drops the points the interrupted run wrote past it and each curve continues without
    duplicates. `every`: write the training metrics of every this many steps (TRL's logging_steps).
    """

    def __init__(self, log_dir: str | Path, every: int = 1) -> None:
        self.log_dir = Path(log_dir)
        self.every = every
        self.writer = None

    def _open(self, purge_step: int | None = None) -> Any:
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.log_dir), purge_step=purge_step)
        return self.writer

    def on_train_begin(self, global_step: int) -> None:
        self.close()
        self._open(purge_step=global_step + 1 if global_step else 0)

    def on_step_end(self, global_step: int, metrics: dict[str, Any]) -> None:
        if global_step % self.every == 0:
            self._write("train/", global_step, metrics)

    def on_evaluate(self, global_step: int, metrics: dict[str, Any]) -> None:
        self._write("eval/", global_step, {k.removeprefix("test_"): v for k, v in metrics.items()})

    def on_train_end(self, global_step: int) -> None:
        self.close()

    def _write(self, prefix: str, step: int, metrics: dict[str, Any]) -> None:
        writer = self._open()
        for key, value in metrics.items():
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if key not in NOT_CURVES and number and math.isfinite(value):
                writer.add_scalar(prefix + key, value, step)
        writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
