"""Your own reward function as a task: `fastes train --task jsonl:data.jsonl --reward rewards.py:score`.

rewards.py holds a function with TRL's signature, called once per batch of completions:

    def score(completions: list[str], answer: list[str], **columns) -> list[float]:
        return [1.0 if c.strip().startswith(a) else 0.0 for c, a in zip(completions, answer)]

data.jsonl has one JSON object per line: "prompt" (required, the text the model sees), "split" (optional,
"train" or "test"; lines without one are split by a seeded shuffle, `test_fraction` to test), and any
other keys: the columns. Every line has the same columns; each is passed to the function as a list
aligned with `completions` (the completion's own row's value), together with `prompts`.

The function runs with a per-call time limit (`timeout` seconds, on the main thread); whatever it raises
(sys.exit included) is reported with its file and line. It must return a list of one finite number per
completion, or None where it does not apply (TRL's convention); anything else (a dict, strings, NaN, inf,
nested lists) is refused naming the function and the value. A completion that no function scores (this
one function returned None) has no reward: that is refused too, in ES and GRPO alike.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import math
import numbers
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import FastesError
from .base import Example, Score, Task
from .jsonl import assign_splits

RESERVED = ("completions", "prompts")  # argument names the function gets from fastes itself
MAX_TIMEOUT = 1e9  # seconds (31 years): SIGALRM's timer cannot be set much further


class RewardFunctionError(FastesError, ValueError):
    """A user reward function that cannot be loaded, failed, timed out or returned the wrong thing."""


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
            # functools.partial and callable objects have no __name__; their type names them.
            self.name = getattr(spec, "__name__", type(spec).__name__)
            source = inspect.getsourcefile(spec) if inspect.isfunction(spec) else None
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

    def _accepted_names(self) -> set[str] | None:
        """The keyword arguments the function takes; None when it takes **kwargs (anything)."""
        try:
            parameters = inspect.signature(self.function).parameters.values()
        except (TypeError, ValueError):  # some builtins have no signature: pass them everything
            return None
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
            return None
        return {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}

    def check_columns(self, columns: list[str]) -> None:
        """Before any work: the function must take `completions` and every argument it needs must exist."""
        names = {"completions", "prompts", *columns}
        if self.accepted is not None and "completions" not in self.accepted:
            raise RewardFunctionError(
                f"{self}: the function must take a 'completions' argument (TRL's signature)"
            )
        try:
            parameters = inspect.signature(self.function).parameters.values()
        except (TypeError, ValueError):
            parameters = []
        required = {
            p.name
            for p in parameters
            if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        }
        missing = sorted(required - names)
        if missing:
            raise RewardFunctionError(
                f"{self}: the function needs {', '.join(map(repr, missing))}, which the data does not "
                f"have as columns (it has {', '.join(map(repr, columns)) or 'none'}); add them, "
                "or give the function **kwargs"
            )

    def __call__(self, completions: list[str], prompts: list[str], columns: dict[str, list]) -> list[float]:
        arguments = {"completions": completions, "prompts": prompts, **columns}
        if self.accepted is not None:  # pass only what the function takes (TRL passes everything)
            arguments = {k: v for k, v in arguments.items() if k in self.accepted}
        try:
            with _time_limit(self.timeout):
                result = self.function(**arguments)
        except _Timeout:
            raise RewardFunctionError(
                f"{self}: one call on {len(completions)} completions took longer than {self.timeout:g} s; "
                "make it faster or raise reward_timeout"
            ) from None
        except SystemExit as error:  # would end the whole run, silently
            raise RewardFunctionError(
                f"{self._where(error)}: in {self.name}: the function called sys.exit({error.code!r}); a "
                "reward function must return its rewards (raise an exception to report a problem)"
            ) from None
        except Exception as error:  # noqa: BLE001 - reported with the user's file and line
            raise RewardFunctionError(
                f"{self._where(error)}: in {self.name}: {type(error).__name__}: {error}"
            ) from None
        return self._check_result(result, len(completions))

    def _check_result(self, result: Any, expected: int) -> list[float]:
        """One finite number per completion, or None (kept as NaN: "does not apply")."""
        if hasattr(result, "tolist") and getattr(result, "ndim", None) == 1:  # a numpy array or a tensor
            result = result.tolist()
        values = list(result) if isinstance(result, (list, tuple)) else None
        if values is None or len(values) != expected:
            got = f"{type(result).__name__}" + (f" of length {len(values)}" if values is not None else "")
            raise RewardFunctionError(
                f"{self}: returned {got}; it must return a list of {expected} numbers (or None where it "
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
                    f"{self}: reward {i} is {repr(value)[:80]}{kind}, not a finite number; return a "
                    "number per completion, or None where the function does not apply"
                )
        return rewards

    def _where(self, error: BaseException) -> str:
        """file:line of the deepest frame of the traceback inside the reward file (else the file itself)."""
        frames = [
            f for f in traceback.extract_tb(error.__traceback__) if Path(f.filename).resolve() == self.path
        ]
        return f"{self.path}:{frames[-1].lineno}" if frames else str(self)

    def __str__(self) -> str:
        return f"{self.path}:{self.name}" if self.path else f"reward function {self.name!r}"


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


class RewardTask(Task):
    """Prompts and columns from a JSONL file, scored by a user reward function.

    Score(format=0, answer=reward), so the training reward is the function's value whatever the
    format_weight, and "test accuracy" is the mean reward on the test split.
    """

    def __init__(
        self, path: str | Path, reward: str, seed: int = 0, test_fraction: float = 0.2, timeout: float = 60.0
    ) -> None:
        if not 0.0 <= test_fraction <= 1.0:
            raise ValueError(f"test_fraction must be between 0 and 1, got {test_fraction}")
        self.name = f"jsonl:{path}"
        self.function = RewardFunction(reward, timeout=timeout)
        rows, self.columns = _read_rows(Path(path))
        self.function.check_columns(self.columns)
        self._splits = assign_splits(rows, seed, test_fraction)

    def scores(self, examples: list[Example], completions: list[str]) -> list[Score]:
        if not examples:
            return []
        columns = {c: [ex.meta["columns"][c] for ex in examples] for c in self.columns}
        rewards = self.function(list(completions), [ex.prompt for ex in examples], columns)
        require_scored(rewards, examples, [self.function])
        return [Score(format=0.0, answer=r) for r in rewards]

    def score(self, example: Example, completion: str) -> Score:
        return self.scores([example], [completion])[0]


def require_scored(totals: list[float], examples: list[Example], functions: list[RewardFunction]) -> None:
    """Refuse a completion whose reward is NaN: every function returned None for it ("does not apply"),
    so nothing scores it. The same with one function as with several, in ES and GRPO."""
    for i, total in enumerate(totals):
        if math.isnan(total):
            which = f"{functions[0]} returned" if len(functions) == 1 else "every reward function returned"
            raise RewardFunctionError(
                f"{which} None (does not apply) for completion {i} of prompt "
                f"{str(examples[i].prompt)[:60]!r}, so it has no reward; return a number for it (e.g. 0.0)"
            )


def _read_rows(path: Path) -> tuple[list[tuple[Example, str | None]], list[str]]:
    """(example, explicit split) per line, and the column names; every problem names its file:line."""
    if not path.is_file():
        raise FileNotFoundError(f"task file {str(path)!r} not found; check the path after 'jsonl:'")
    rows, columns, seen = [], None, {}
    for number, line in enumerate(path.read_text(encoding="utf-8").split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, RecursionError, ValueError) as error:
            raise RewardFunctionError(f"{where}: not one JSON object ({str(error)[:80]})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"]:
            raise RewardFunctionError(f'{where}: each line needs a non-empty "prompt" string')
        split = row.pop("split", None)
        if split not in (None, "train", "test"):
            raise RewardFunctionError(f'{where}: "split" must be "train" or "test", got {json.dumps(split)}')
        prompt = row.pop("prompt")
        if columns is None:
            columns = sorted(row)
            clash = [c for c in columns if c in RESERVED]
            if clash:
                raise RewardFunctionError(
                    f"{where}: column {clash[0]!r} is reserved (fastes passes it); rename it"
                )
        elif sorted(row) != columns:
            raise RewardFunctionError(
                f"{where}: columns {sorted(row)} differ from the first line's {columns}; "
                "every line needs the same"
            )
        if prompt in seen:
            raise RewardFunctionError(f"{where}: prompt already on line {seen[prompt]}; each prompt once")
        seen[prompt] = number
        rows.append((Example(prompt=prompt, answer="", solution="", meta={"columns": row}), split))
    if not rows:
        raise RewardFunctionError(f"{path}: no prompts found; write one JSON object per line")
    return rows, columns or []
