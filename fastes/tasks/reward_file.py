"""Reward functions called as TRL's GRPOTrainer calls them, and your own one as a task:
`fastes train --task jsonl:data.jsonl --reward rewards.py:score`.

rewards.py holds a function with TRL's signature, called once per batch of completions:

    def score(completions: list[str], answer: list[str], **kwargs) -> list[float]:
        return [1.0 if c.strip().startswith(a) else 0.0 for c, a in zip(completions, answer)]

Every function gets, by keyword, what TRL passes: `prompts`, `completions`, `completion_ids` (the
generated token ids of each completion), every column of the data (a list aligned with `completions`: the
completion's own row's value), `trainer_state` (a transformers TrainerState whose global_step is the steps
taken so far), and `log_metric(name, value)` / `log_extra(column, values)`. A function without **kwargs
gets only the arguments it names. `async def` functions are awaited, concurrently with each other, on an
event loop of their own (so scoring works whether or not the caller runs an event loop).

data.jsonl has one JSON object per line: "prompt" (required, the text the model sees), "split" (optional,
"train" or "test"; lines without one are split by a seeded shuffle, `test_fraction` to test), and any
other keys: the columns. Every line has the same columns; a prompt may repeat (each line keeps its own
columns).

Each call has a time limit (`timeout` seconds: SIGALRM on the main thread for a plain function, a
cancellation for an async one); whatever a function raises (sys.exit included) is reported with its file
and line. It must return a list of one finite number per completion, or None where it does not apply
(TRL's convention); anything else (a dict, strings, NaN, inf, nested lists) is refused naming the function
and the value. Several functions combine as in TRL: reward = sum of weight_i * r_i over the functions that
return a number; a completion that no function scores gets 0 with a warning naming its row, and the run
goes on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import importlib.util
import inspect
import json
import logging
import math
import numbers
import signal
import sys
import threading
import traceback
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastes.errors import FastesError

from .base import Example, Score, Task
from .jsonl import assign_splits
from .rows import RESERVED, Columns, json_lines

logger = logging.getLogger(__name__)
MAX_TIMEOUT = 1e9  # seconds (31 years): SIGALRM's timer cannot be set much further
ASYNC_GRACE = 5.0  # seconds past the timeout before an async function that blocks its event loop is given up


class RewardFunctionError(FastesError, ValueError):
    """A user reward function that cannot be loaded, failed, timed out or returned the wrong thing."""


def callable_name(function: Callable[..., Any]) -> str:
    """TRL's name for a reward function: a partial's wrapped function's, else __name__, else the class's."""
    while isinstance(function, functools.partial):
        function = function.func
    return getattr(function, "__name__", type(function).__name__)


def is_async_callable(function: Callable[..., Any]) -> bool:
    """Whether calling `function` gives a coroutine: an async def, a partial of one, or an object whose
    __call__ is one."""
    while isinstance(function, functools.partial):
        function = function.func
    call = type(function).__call__ if not inspect.isroutine(function) else None  # a callable object's
    return inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(call)


class RewardFunction:
    """A reward function, `path.py:name` from a Python file or a callable given in code, called with a
    time limit per call."""

    def __init__(self, spec: str | Callable[..., Any], timeout: float = 60.0) -> None:
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, numbers.Real)
            or not 0 < timeout <= MAX_TIMEOUT
        ):
            raise RewardFunctionError(
                f"reward_timeout: must be a number of seconds in (0, {MAX_TIMEOUT:g}], got {timeout!r}"
            )
        self.timeout = timeout
        if callable(spec):
            self.function = spec
            self.name = callable_name(spec)
            inner = spec.func if isinstance(spec, functools.partial) else spec
            source = inspect.getsourcefile(inner) if inspect.isfunction(inner) else None
            self.path = Path(source).resolve() if source else None
        else:
            path_text, colon, name = str(spec).rpartition(":")
            if not colon or not path_text.endswith(".py") or not name.isidentifier():
                raise RewardFunctionError(
                    f"reward {spec!r}: expected FILE.py:FUNCTION, e.g. rewards.py:score"
                )
            self.path = Path(path_text).resolve()
            self.name = name
            self.function = self._load()
        self.is_async = is_async_callable(self.function)
        self.parameters = self._parameters()
        self.accepted = self._accepted_names()

    def _load(self) -> Callable[..., Any]:
        if not self.path.is_file():
            raise RewardFunctionError(f"reward file {str(self.path)!r} does not exist")
        module_name = f"fastes_user_reward_{abs(hash(str(self.path)))}"
        spec = importlib.util.spec_from_file_location(module_name, self.path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # dataclasses and pickling look modules up by name
        try:
            spec.loader.exec_module(module)
        except SyntaxError as error:
            raise RewardFunctionError(f"{self.path}:{error.lineno}: syntax error: {error.msg}") from None
        except (Exception, SystemExit) as error:  # noqa: BLE001 - reported with the user's file and line
            raise RewardFunctionError(
                f"{self._where(error)}: importing the reward file failed: {type(error).__name__}: {error}"
            ) from None
        function = getattr(module, self.name, None)
        if not callable(function):
            found = sorted(
                n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_")
            )
            raise RewardFunctionError(
                f"{self.path} has no function {self.name!r}; "
                f"functions defined there: {', '.join(found) or 'none'}"
            )
        return function

    def _parameters(self) -> list[inspect.Parameter] | None:
        try:
            return list(inspect.signature(self.function).parameters.values())
        except (TypeError, ValueError):  # some builtins have no signature: nothing can be checked
            return None

    def _accepted_names(self) -> set[str] | None:
        """The keyword arguments the function takes; None when it takes **kwargs (anything) or has no
        signature to read."""
        if self.parameters is None or any(p.kind is p.VAR_KEYWORD for p in self.parameters):
            return None
        return {p.name for p in self.parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}

    def check_columns(self, columns: list[str]) -> None:
        """Before any work, by reading the signature (the function is not called): it must take
        `completions`, and every argument it requires must be one TRL passes or a column."""
        required = [p for p in self.parameters or [] if p.default is p.empty]
        by_position = [p.name for p in required if p.kind is p.POSITIONAL_ONLY]
        if by_position:
            raise RewardFunctionError(
                f"{self}: the function takes {', '.join(map(repr, by_position))} by position only; reward "
                "functions are called by keyword (TRL's way): remove the '/' from its signature"
            )
        if self.accepted is not None and "completions" not in self.accepted:
            raise RewardFunctionError(
                f"{self}: the function must take a 'completions' argument (TRL's signature)"
            )
        names = {*RESERVED, *columns}
        missing = [p.name for p in required if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        missing = sorted(set(missing) - names)
        if missing:
            raise RewardFunctionError(
                f"{self}: the function needs {', '.join(map(repr, missing))}, which the data does not "
                f"have as columns (it has {', '.join(map(repr, columns)) or 'none'}); add them, "
                "or give the function **kwargs"
            )

    def _taken(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """The arguments the function takes (TRL passes everything: a function without **kwargs would fail
        there on the first name it does not take)."""
        if self.accepted is None:
            return arguments
        return {k: v for k, v in arguments.items() if k in self.accepted}

    def __call__(self, arguments: dict[str, Any], count: int) -> list[float]:
        """Call a plain function on `count` completions with `arguments` (names as TRL passes them)."""
        try:
            with _time_limit(self.timeout):
                result = self.function(**self._taken(arguments))
        except _Timeout:
            raise self._too_slow(count) from None
        except (Exception, SystemExit) as error:  # noqa: BLE001 - reported with the user's file and line
            raise self._failed(error) from None
        return self._check_result(result, count)

    async def acall(self, arguments: dict[str, Any], count: int) -> list[float]:
        """Await an async function, cancelled after the time limit."""
        try:
            call = asyncio.ensure_future(self.function(**self._taken(arguments)))
            done, _ = await asyncio.wait({call}, timeout=self.timeout)
            if not done:  # not wait_for: a TimeoutError the function raises itself is its own failure
                call.cancel()
                raise self._too_slow(count)
            result = call.result()
        except RewardFunctionError:
            raise
        except (Exception, SystemExit) as error:  # noqa: BLE001 - reported with the user's file and line
            raise self._failed(error) from None
        return self._check_result(result, count)

    def _too_slow(self, count: int) -> RewardFunctionError:
        return RewardFunctionError(
            f"{self}: one call on {count} completions took longer than {self.timeout:g} s; "
            "make it faster or raise reward_timeout"
        )

    def _failed(self, error: BaseException) -> RewardFunctionError:
        if isinstance(error, SystemExit):  # would end the whole run, silently
            return RewardFunctionError(
                f"{self._where(error)}: in {self.name}: the function called sys.exit({error.code!r}); a "
                "reward function must return its rewards (raise an exception to report a problem)"
            )
        return RewardFunctionError(f"{self._where(error)}: in {self.name}: {type(error).__name__}: {error}")

    def _check_result(self, result: Any, expected: int) -> list[float]:
        """One finite number per completion, or None (kept as NaN: "does not apply")."""
        return check_rewards(result, expected, str(self))

    def _where(self, error: BaseException) -> str:
        """file:line of the deepest frame of the traceback inside the reward file (else the file itself)."""
        frames = [
            f
            for f in traceback.extract_tb(error.__traceback__)
            if self.path and Path(f.filename).resolve() == self.path
        ]
        return f"{self.path}:{frames[-1].lineno}" if frames else str(self)

    def __str__(self) -> str:
        return f"{self.path}:{self.name}" if self.path else f"reward function {self.name!r}"


def check_rewards(result: Any, expected: int, who: str) -> list[float]:
    """`result` as one float per completion, None kept as NaN ("does not apply"); anything else refused,
    naming `who` and the value."""
    if hasattr(result, "tolist") and getattr(result, "ndim", None) == 1:  # a numpy array or a tensor
        result = result.tolist()
    values = list(result) if isinstance(result, (list, tuple)) else None
    if values is None or len(values) != expected:
        got = f"{type(result).__name__}" + (f" of length {len(values)}" if values is not None else "")
        raise RewardFunctionError(
            f"{who}: returned {got}; it must return a list of {expected} numbers (or None where it "
            "does not apply), one per completion"
        )
    rewards = []
    for i, value in enumerate(values):
        if value is None:  # TRL's "not applicable"
            rewards.append(math.nan)
        elif isinstance(value, numbers.Real) and math.isfinite(value):
            rewards.append(float(value))
        else:
            kind = "" if isinstance(value, numbers.Real) else f" ({type(value).__name__})"
            raise RewardFunctionError(
                f"{who}: reward {i} is {repr(value)[:80]}{kind}, not a finite number; return a "
                "number per completion, or None where the function does not apply"
            )
    return rewards


class Rewards:
    """Weighted reward functions (and reward models, fastes/tasks/reward_model.py) scoring a batch of
    completions as TRL's GRPOTrainer does: plain ones in order, then the async ones concurrently."""

    def __init__(self, functions: list[Any], weights: list[float]) -> None:
        self.functions, self.weights = functions, weights
        self.trainer_state: Any = None  # the trainer may set its own; else one is made on first use
        self.tokenizer: Any = None  # re-tokenises completions when a caller has no token ids
        self.metrics: dict[str, list[float]] = defaultdict(list)  # log_metric's values since logged()
        self.extras: dict[str, list[Any]] = defaultdict(list)  # log_extra's columns since logged()

    def state(self) -> Any:
        if self.trainer_state is None:
            from transformers import TrainerState

            self.trainer_state = TrainerState()
        return self.trainer_state

    def log_metric(self, name: str, value: float) -> None:
        """TRL's log_metric: a scalar for this step's metrics, averaged over the step's calls."""
        if not isinstance(name, str) or not name:
            raise RewardFunctionError(f"log_metric: the name must be a non-empty string, got {name!r}")
        try:
            self.metrics[name].append(float(value))
        except (TypeError, ValueError):
            raise RewardFunctionError(
                f"log_metric({name!r}, ...): {repr(value)[:60]} is not a number; log one number per call"
            ) from None

    def log_extra(self, column: str, values: list[Any]) -> None:
        """TRL's log_extra: a column of per-completion values for the step's completion log."""
        if not isinstance(column, str) or not column:
            raise RewardFunctionError(f"log_extra: the column must be a non-empty string, got {column!r}")
        self.extras[column].extend(values)

    def score(
        self,
        prompts: list[Any],
        texts: list[str],
        completion_ids: list[list[int]] | None,
        columns: dict[str, list[Any]],
        conversational: bool = False,
    ) -> list[Score]:
        """Each function's value (NaN for its None) and their weighted sum, per completion."""
        count = len(texts)
        if completion_ids is None and self.tokenizer is not None:
            # A caller without the generated ids (a single score() call): the completion re-tokenised, which
            # can differ from the sampled ids where a text has several tokenisations.
            completion_ids = self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]
        completions: list[Any] = list(texts)
        if conversational:  # TRL's completions of message prompts are messages
            completions = [[{"role": "assistant", "content": text}] for text in texts]
        arguments = {"prompts": prompts, "completions": completions, **columns}
        if completion_ids is not None:
            arguments["completion_ids"] = [list(ids) for ids in completion_ids]
        arguments.update(trainer_state=self.state(), log_metric=self.log_metric, log_extra=self.log_extra)
        values = {f.name: f(arguments, count) for f in self.functions if not f.is_async}
        waiting = [f for f in self.functions if f.is_async]
        if waiting:
            values.update(_run_concurrently(waiting, arguments, count))
        scores = []
        for i in range(count):
            parts = {f.name: values[f.name][i] for f in self.functions}
            terms = [w * parts[f.name] for f, w in zip(self.functions, self.weights)]
            # TRL's nansum: a None (NaN) term is left out, and a row without any gets 0.
            total = math.fsum(t for t in terms if not math.isnan(t))
            scores.append(Score(format=0.0, answer=total, rewards=parts))
        unscored = [i for i, s in enumerate(scores) if all(math.isnan(v) for v in s.rewards.values())]
        if unscored:
            i = unscored[0]
            row = {c: v[i] for c, v in columns.items()}
            row.update(prompt=prompts[i], completion=completions[i])
            # TRL's words and channel (a logger warning), which its users' tests look for.
            logger.warning(
                f"All reward functions returned None for the following kwargs: {row} ({len(unscored)} of "
                f"{count} completions unscored this call). Return a number for at least one function"
            )
        return scores

    def logged(self) -> tuple[dict[str, list[float]], dict[str, list[Any]]]:
        metrics, extras = dict(self.metrics), dict(self.extras)
        self.metrics.clear()
        self.extras.clear()
        return metrics, extras


_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def _event_loop() -> asyncio.AbstractEventLoop:
    """The event loop async reward functions run on: its own thread's, so that scoring works whether or not
    the caller runs a loop (a notebook does), and clients a function keeps between calls stay on one loop."""
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="fastes-async-rewards", daemon=True).start()
        return _loop


def _run_concurrently(functions: list[Any], arguments: dict[str, Any], count: int) -> dict[str, list[float]]:
    """Await every async function at once (asyncio.gather), each with its time limit."""
    global _loop

    async def every() -> list[list[float]]:
        return await asyncio.gather(*(f.acall(arguments, count) for f in functions))

    future = asyncio.run_coroutine_threadsafe(every(), _event_loop())
    limit = max(f.timeout for f in functions) + ASYNC_GRACE
    try:
        results = future.result(timeout=limit)
    except concurrent.futures.TimeoutError:
        # A function that blocks (time.sleep in an async def) cannot be cancelled: leave its loop behind.
        future.cancel()
        with _loop_lock:
            _loop = None
        names = ", ".join(repr(f.name) for f in functions)
        raise RewardFunctionError(
            f"async reward functions {names} blocked their event loop past the time limit ({limit:g} s); "
            "await instead of blocking (e.g. asyncio.sleep, not time.sleep) or raise reward_timeout"
        ) from None
    return {f.name: values for f, values in zip(functions, results)}


class _Timeout(Exception):
    pass


class _time_limit:
    """Raise _Timeout in the main thread after `seconds` (SIGALRM); elsewhere no limit can be imposed."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.armed = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()

    def __enter__(self) -> None:
        if self.armed:
            self.previous = signal.signal(signal.SIGALRM, self._expire)
            signal.setitimer(signal.ITIMER_REAL, self.seconds)

    def __exit__(self, *exc_info: object) -> None:
        if self.armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.previous)

    @staticmethod
    def _expire(signum: int, frame: object) -> None:
        raise _Timeout


class RewardScoredTask(Task):
    """A task whose examples carry their row's columns (Example.meta["columns"]) and whose completions are
    scored by `rewards`: Score(format=0, answer=weighted reward, rewards={name: value}), so the training
    reward is the weighted sum whatever the format_weight."""

    rewards: Rewards
    columns: list[str]
    conversational = False  # message prompts: completions reach the functions as messages

    @property
    def functions(self) -> list[Any]:
        return self.rewards.functions

    @property
    def weights(self) -> list[float]:
        return self.rewards.weights

    @property
    def trainer_state(self) -> Any:
        """The transformers TrainerState passed to the functions; a trainer may set its own."""
        return self.rewards.state()

    @trainer_state.setter
    def trainer_state(self, state: Any) -> None:
        self.rewards.trainer_state = state

    def scores(
        self, examples: list[Example], completions: list[str], completion_ids: list[list[int]] | None = None
    ) -> list[Score]:
        if not examples:
            return []
        prompts = [ex.prompt for ex in examples]
        columns = {c: [ex.meta["columns"][c] for ex in examples] for c in self.columns}  # each row's own
        return self.rewards.score(prompts, list(completions), completion_ids, columns, self.conversational)

    def score(self, example: Example, completion: str) -> Score:
        return self.scores([example], [completion])[0]

    def attach(self, *, tokenizer: Any = None, device: Any = None) -> None:
        self.rewards.tokenizer = tokenizer
        for function in self.functions:
            if device is not None and hasattr(function, "to"):  # reward models run on the run's device
                function.to(device)

    def at_step(self, global_step: int, max_steps: int | None = None) -> None:
        state = self.rewards.state()
        state.global_step = global_step
        if max_steps is not None:
            state.max_steps = max_steps
        self.rewards.logged()  # what an evaluation outside the loop logged belongs to no step

    def logged(self) -> tuple[dict[str, list[float]], dict[str, list[Any]]]:
        return self.rewards.logged()


class RewardTask(RewardScoredTask):
    """Prompts and columns from a JSONL file, scored by a user reward function; "test accuracy" is the mean
    reward on the test split."""

    def __init__(
        self, path: str | Path, reward: str, seed: int = 0, test_fraction: float = 0.2, timeout: float = 60.0
    ) -> None:
        if not 0.0 <= test_fraction <= 1.0:
            raise ValueError(f"test_fraction must be between 0 and 1, got {test_fraction}")
        self.name = f"jsonl:{path}"
        function = RewardFunction(reward, timeout=timeout)
        rows, self.columns = _read_rows(Path(path))
        function.check_columns(self.columns)
        self.rewards = Rewards([function], [1.0])
        self._splits = assign_splits(rows, seed, test_fraction)


def _read_rows(path: Path) -> tuple[list[tuple[Example, str | None]], list[str]]:
    """(example, explicit split) per line, and the column names; every problem names its file:line."""
    if not path.is_file():
        raise FileNotFoundError(f"task file {str(path)!r} not found; check the path after 'jsonl:'")
    rows, columns = [], Columns(RewardFunctionError)
    for number, row in json_lines(path, RewardFunctionError):
        where = f"{path}:{number}"
        if not isinstance(row.get("prompt"), str) or not row["prompt"]:
            raise RewardFunctionError(f'{where}: each line needs a non-empty "prompt" string')
        split = row.pop("split", None)  # a line's own split is no column: lines may leave it out
        if split not in (None, "train", "test"):
            raise RewardFunctionError(f'{where}: "split" must be "train" or "test", got {json.dumps(split)}')
        columns.check(row, where, f"line {number}")
        prompt = row.pop("prompt")
        rows.append((Example(prompt=prompt, answer="", solution="", meta={"columns": row}), split))
    if not rows:
        raise RewardFunctionError(f"{path}: no prompts found; write one JSON object per line")
    return rows, [c for c in columns.names if c != "prompt"]
