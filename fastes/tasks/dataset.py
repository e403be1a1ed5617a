"""Rows of prompts scored by reward functions: a dataset as TRL's GRPOTrainer takes one.

Rows come as a `datasets.Dataset`, a list of dicts, or a local .jsonl/.json/.csv/.parquet file (read with
the `datasets` library). "prompt" is required: a string, or a list of {"role", "content"} messages. With
messages the prompt is conversational: the chat template applies, and completions reach the reward
functions as [{"role": "assistant", "content": text}], as in TRL. Every other column reaches every reward
function as a keyword argument (a list aligned with `completions`), together with `prompts`.

Reward functions are called as TRL calls them (fastes/tasks/reward_file.py: the arguments passed, async
functions, how None combines); an entry of reward_funcs may also be a reward model
(fastes/tasks/reward_model.py). Each function's own value is kept in Score.rewards under the function's
name (NaN for its None), the weighted sum in Score.answer. Functions are checked by their signatures when
the task is built, never called then. A prompt may repeat: each row's columns travel with the row.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import random
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fastes.errors import FastesError, MissingFileError, MissingPackageError

from .base import Example, check_split
from .registry import get_task
from .reward_file import Rewards, RewardScoredTask
from .reward_model import reward_sources
from .rows import Columns, json_lines, object_row, read_text

DATA_FILES = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}  # suffix: builder
HELD_OUT = 0.2  # share of a data file held out for evaluation when no eval file is given
ROLES = ("system", "user", "assistant", "tool")  # the message roles of chat templates


class DatasetError(FastesError, ValueError):
    """Rows that cannot be trained on as given; the message names the column or row and the fix."""


def dataset_rows(data: Any, what: str) -> list[dict[str, Any]]:
    """The rows of a `datasets.Dataset` or a list of dicts, checked: a "prompt" of text or messages in
    each, the same columns in each, no reserved column names."""
    if type(data).__name__ in ("DatasetDict", "IterableDatasetDict"):
        raise DatasetError(f"{what} is a DatasetDict; pass one split of it, e.g. dataset['train']")
    if hasattr(data, "to_list"):  # datasets.Dataset
        rows = data.to_list()
    elif isinstance(data, (list, tuple)):
        rows = list(data)
    else:
        streamed = type(data).__name__ == "IterableDataset"
        fix = "; make it one with Dataset.from_list(list(dataset))" if streamed else ""
        raise DatasetError(
            f"{what} must be a datasets.Dataset or a list of dicts, got {type(data).__name__}{fix}"
        )
    if not rows:
        raise DatasetError(f"{what} is empty; give it rows with a 'prompt'")
    columns = Columns(DatasetError)
    for i, row in enumerate(rows):
        where = f"{what} row {i}"
        object_row(row, where, DatasetError)
        if "prompt" not in row:
            raise DatasetError(
                f"{what} has no 'prompt' column (row {i} has {', '.join(map(repr, row)) or 'none'}); "
                "rename the column that holds the prompts to 'prompt'"
            )
        _check_prompt(row["prompt"], where)
        columns.check(row, where, f"row {i}")
    if len({isinstance(row["prompt"], list) for row in rows}) > 1:
        raise DatasetError(f"{what} mixes text prompts and message lists; use one kind for every row")
    return rows


def _check_prompt(prompt: Any, where: str) -> None:
    if isinstance(prompt, str):
        if not prompt:
            raise DatasetError(f"{where}: 'prompt' is empty; every row needs a prompt")
        return
    messages = (
        isinstance(prompt, list)
        and prompt
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in prompt
        )
    )
    if not messages:
        raise DatasetError(
            f"{where}: 'prompt' must be text or a list of {{'role': ..., 'content': ...}} messages, "
            f"got {str(prompt)[:80]}"
        )
    for i, message in enumerate(prompt):
        if message["role"] not in ROLES:
            raise DatasetError(
                f"{where}: message {i} has role {message['role']!r}; chat templates know {', '.join(ROLES)}"
            )


def read_data_file(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a local .jsonl, .json, .csv or .parquet file, read with the `datasets` library."""
    path = Path(path)
    builder = DATA_FILES.get(path.suffix.lower())
    if builder is None:
        raise DatasetError(f"{path}: unknown data file type; use one of {', '.join(DATA_FILES)}")
    if not path.is_file():
        raise MissingFileError(f"data file {str(path)!r} does not exist")
    if builder != "parquet":
        _check_text_file(path, builder)
    try:
        import datasets
    except ImportError:
        raise MissingPackageError(
            f"reading {path.name} needs the datasets library: pip install 'fastes[hf]'"
        ) from None
    datasets.disable_progress_bars()
    # A private cache: nothing is left in the user's datasets cache, and an edited file is read afresh.
    with tempfile.TemporaryDirectory() as cache:
        try:
            data = datasets.load_dataset(
                builder, data_files=str(path), split="train", cache_dir=cache, keep_in_memory=True
            )
        except Exception as error:  # noqa: BLE001 - the library raises many kinds for a malformed file
            raise DatasetError(
                f"{path}: cannot be read as {builder} ({type(error).__name__}: {str(error)[:200]})"
            ) from None
        return data.to_list()


def _check_text_file(path: Path, builder: str) -> None:
    """What the `datasets` library reports badly or not at all, with the file and line: an empty file, a
    file that is not UTF-8, a JSON Lines line that is not one JSON object, a CSV header naming a column
    twice (read as 'answer.1'), without rows, or a row with more or fewer fields than the header, a .json
    file holding one object of columns (a dict of lists)."""
    text = read_text(path, DatasetError)
    if not text.strip():
        raise DatasetError(f"{path}: the file is empty; give it rows, each with a 'prompt'")
    if builder == "csv":
        rows = csv.reader(io.StringIO(text))
        header = next(rows)
        twice = sorted({c for c in header if header.count(c) > 1})
        if twice:
            raise DatasetError(
                f"{path}:1: the header names column {twice[0]!r} twice; give each column its own name"
            )
        found = False
        for row in rows:
            found = found or bool(row)
            if row and len(row) != len(header):
                raise DatasetError(
                    f"{path}:{rows.line_num}: {len(row)} fields, the header has {len(header)}; quote fields "
                    "that hold commas"
                )
        if not found:
            raise DatasetError(f"{path}: the header has no rows below it; give it rows, each with a 'prompt'")
    elif path.suffix.lower() == ".jsonl":
        for _ in json_lines(path, DatasetError, text):  # each line is checked as it is read
            pass
    elif path.suffix.lower() == ".json":
        try:
            whole = json.loads(text)
        except ValueError:
            return  # JSON Lines under a .json name: the library reads those
        if isinstance(whole, dict) and whole and all(isinstance(v, list) for v in whole.values()):
            raise DatasetError(
                f"{path}: holds one object of columns ({', '.join(map(repr, list(whole)[:4]))}: lists); "
                "fastes reads rows: write a list of objects, or one object per line in a .jsonl file"
            )


class DatasetTask(RewardScoredTask):
    """Prompts and columns scored by one or more weighted reward functions or reward models (TRL's
    reward_funcs and reward_processing_classes)."""

    def __init__(
        self,
        train_dataset: Any,
        reward_funcs: Any,  # a callable, "FILE.py:FUNCTION", a reward model (or its directory), or a list
        *,
        reward_weights: Sequence[float] | None = None,
        eval_dataset: Any = None,
        timeout: float = 60.0,
        name: str = "dataset",
        reward_processing_classes: Any = None,
    ) -> None:
        self.name = name
        if isinstance(reward_funcs, (list, tuple)) and not reward_funcs:
            raise DatasetError("reward_funcs is empty; give at least one reward function")
        functions = reward_sources(reward_funcs, reward_processing_classes, timeout)
        names = [f.name for f in functions]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise DatasetError(
                f"two reward functions are named {twice[0]!r}; their metrics (rewards/<name>/mean) would "
                "mix: give each function its own name"
            )
        self.rewards = Rewards(functions, _weights(reward_weights, len(functions)))
        train = dataset_rows(train_dataset, "train_dataset")
        test = dataset_rows(eval_dataset, "eval_dataset") if eval_dataset is not None else []
        self.columns = [c for c in sorted(train[0]) if c != "prompt"]
        self.conversational = isinstance(train[0]["prompt"], list)
        if test and (
            sorted(test[0]) != sorted(train[0]) or isinstance(test[0]["prompt"], list) != self.conversational
        ):
            raise DatasetError(
                f"eval_dataset has columns {sorted(test[0])}, train_dataset {sorted(train[0])} (and "
                "prompts of the same kind are needed); the reward functions need the same columns in both"
            )
        for function in functions:
            function.check_columns(self.columns)
        self._rows = {"train": train, "test": test}
        self._splits = {which: [self._example(row) for row in rows] for which, rows in self._rows.items()}

    @classmethod
    def from_files(
        cls,
        path: str | Path,
        rewards: Sequence[str],
        *,
        eval_path: str | Path | None = None,
        reward_weights: Sequence[float] | None = None,
        seed: int = 0,
        timeout: float = 60.0,
    ) -> DatasetTask:
        """The task of a data file and reward functions given as FILE.py:FUNCTION (or a reward model's
        directory). Without an eval file, a seeded 20% of the rows (at least one, of two or more) is held
        out for evaluation."""
        rows = dataset_rows(read_data_file(path), str(path))  # rows named by their place in the file
        if eval_path:
            train, test = rows, dataset_rows(read_data_file(eval_path), str(eval_path))
        else:
            order = list(range(len(rows)))
            random.Random(f"dataset:{seed}").shuffle(order)
            n_test = max(1, round(len(rows) * HELD_OUT)) if len(rows) > 1 else 0
            test = [rows[i] for i in sorted(order[:n_test])]
            train = [rows[i] for i in sorted(order[n_test:])]
        return cls(
            train,
            list(rewards),
            reward_weights=reward_weights,
            eval_dataset=test or None,
            timeout=timeout,
            name=f"dataset:{path}",
        )

    def _example(self, row: dict[str, Any]) -> Example:
        columns = {c: row[c] for c in self.columns}
        return Example(prompt=row["prompt"], answer="", solution="", meta={"columns": columns})

    def fingerprint(self) -> str:
        """SHA-256 of the rows, the reward functions' names and the weights: a resume must see the same."""
        content = {"rows": self._rows, "rewards": [f.name for f in self.functions], "weights": self.weights}
        return hashlib.sha256(json.dumps(content, sort_keys=True, default=str).encode()).hexdigest()


def _weights(weights: Sequence[float] | None, count: int) -> list[float]:
    if weights is None:
        return [1.0] * count
    values = list(weights)
    if len(values) != count:
        raise DatasetError(
            f"reward_weights has {len(values)} values for {count} reward functions; "
            "give one weight per function"
        )
    for value in values:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise DatasetError(f"reward_weights: {value!r} is not a finite number")
    if not any(values):
        raise DatasetError(
            f"reward_weights: all {len(values)} weights are 0, so every reward would be 0 and nothing "
            "could be learned; give at least one function a non-zero weight"
        )
    return [float(v) for v in values]


def task_dataset(
    name: str, split: str = "train", *, seed: int = 0, limit: int | None = None
) -> tuple[list[dict[str, Any]], Callable[..., list[float]]]:
    """A built-in task as TRL takes one: rows {"prompt", "answer"} of `split`, and the task's verifier as
    a reward function (1.0 for a correct completion, else 0.0) named after the task.

        rows, reward = task_dataset("countdown")
        ESTrainer(model, reward_funcs=reward, train_dataset=rows, ...)
    """
    task = get_task(name, seed=seed)
    check_split(split)
    problems = {ex.prompt: ex for which in ("train", "test") for ex in task.split(which)}

    def reward(completions: list[str], prompts: list[str], **columns: Any) -> list[float]:
        unknown = [p for p in prompts if p not in problems]
        if unknown:
            raise ValueError(f"{unknown[0]!r} is not a {name} problem of seed {seed}")
        return [task.score(problems[p], c).answer for p, c in zip(prompts, completions)]

    reward.__name__ = reward.__qualname__ = name
    rows = [{"prompt": ex.prompt, "answer": ex.answer} for ex in task.split(split)[:limit]]
    return rows, reward
