"""User tasks from a JSONL file, one problem per line:

    {"prompt": "cd 3 5 7 > 22:", "answer": "22", "verifier": "countdown", "numbers": [3, 5, 7]}
    {"prompt": "2+2=", "answer": 4, "verifier": "numeric", "split": "test"}
    {"prompt": "capital of france?", "answer": "paris", "verifier": "exact"}

Keys:
  prompt    (required) the text the model sees
  answer    (required) string, or a JSON number; for "countdown" the target
  verifier  (required) "exact" (the answer text must match), "numeric" (a plain number equal to the
            answer, see verify.parse_number) or "countdown" (see countdown.py)
  numbers   (countdown only, required) the list of numbers to use
  split     (optional) "train" or "test"; lines without it are assigned by a seeded shuffle, a
            `test_fraction` of them to test
  solution  (optional) a correct completion, used for supervised pretraining; defaults to the answer, or
            for countdown to an expression found by search (up to 4 numbers); ';' is appended if missing
  meta      (optional) any JSON object, kept in Example.meta["user"]

Every line is checked when the file is loaded, so a mistake fails early with "<path>:<line>: problem"
and how to fix it, instead of producing a task that can never be solved. Blank lines are skipped.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from fastes.errors import FastesError, MissingFileError

from .base import ALPHABET, Example, Score, Task, outside_alphabet
from .countdown import solve_countdown
from .rows import json_lines
from .verify import ANSWER_END, parse_number, score_countdown, score_exact, score_numeric

VERIFIERS = ("exact", "numeric", "countdown")
_REQUIRED_KEYS = ("prompt", "answer", "verifier")
_OPTIONAL_KEYS = ("split", "numbers", "solution", "meta")
_MAX_SEARCH_NUMBERS = 4  # solve_countdown is quick up to here


class JsonlTaskError(FastesError, ValueError):
    """A JSONL task file that cannot be used; the message names the file, the line and the fix."""


def _score_row(verifier: str, meta: dict[str, Any], answer: str, completion: str) -> Score:
    if verifier == "countdown":
        return score_countdown(meta["numbers"], meta["target"], completion)
    if verifier == "numeric":
        return score_numeric(meta["value"], completion)
    return score_exact(answer, completion)


def _parse_row(row: dict[str, Any], where: str, strict_alphabet: bool) -> tuple[Example, str | None]:
    """Check one line's object and turn it into an Example; also return its explicit split, if any."""

    def fail(problem: str) -> JsonlTaskError:
        return JsonlTaskError(f"{where}: {problem}")

    for key in _REQUIRED_KEYS:
        if key not in row:
            raise fail(f"missing key {key!r}; every line needs {', '.join(map(repr, _REQUIRED_KEYS))}")
    unknown = sorted(set(row) - set(_REQUIRED_KEYS) - set(_OPTIONAL_KEYS))
    if unknown:
        raise fail(
            f"unknown key(s) {', '.join(map(repr, unknown))}; allowed keys are "
            f'{", ".join(_REQUIRED_KEYS + _OPTIONAL_KEYS)} (put extra data under "meta")'
        )

    prompt, verifier = row["prompt"], row["verifier"]
    if not isinstance(prompt, str) or prompt == "":
        raise fail("'prompt' must be a non-empty string")
    if verifier not in VERIFIERS:
        raise fail(f"unknown verifier {verifier!r}; use one of {', '.join(map(repr, VERIFIERS))}")
    answer = row["answer"]
    # bool is an int in Python, but `true` is surely a mistake for a numeric answer.
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise fail(f"'answer' must be a string or a number, got {json.dumps(answer)}")
    answer = str(answer)
    if ANSWER_END in answer or "\n" in answer:
        raise fail(f"'answer' must not contain {ANSWER_END!r} or a newline, since those end a model's answer")
    split = row.get("split")
    if split is not None and split not in ("train", "test"):
        raise fail(f'\'split\' must be "train" or "test", got {json.dumps(split)}')
    user_meta = row.get("meta", {})
    if not isinstance(user_meta, dict):
        raise fail("'meta' must be a JSON object")
    if "numbers" in row and verifier != "countdown":
        raise fail("'numbers' is only used by the \"countdown\" verifier; remove it or change the verifier")

    meta: dict[str, Any] = {"verifier": verifier, "user": user_meta}
    if verifier in ("numeric", "countdown"):
        value = parse_number(answer)
        if value is None:
            raise fail(f'answer {answer!r} is not a number like 12, -3.5 or 7/2; for text use "exact"')
        meta["value"] = value
    if verifier == "countdown":
        numbers = row.get("numbers")
        if (
            not isinstance(numbers, list)
            or not numbers
            or not all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 10**6 for n in numbers)
        ):
            raise fail("countdown needs 'numbers': a non-empty list of integers in 0..999999, e.g. [3, 5, 7]")
        meta["numbers"] = tuple(numbers)
        meta["target"] = meta["value"]

    solution = row.get("solution")
    if solution is not None and not isinstance(solution, str):
        raise fail("'solution' must be a string")
    if solution is None and verifier == "countdown":
        if len(meta["numbers"]) > _MAX_SEARCH_NUMBERS:
            raise fail(f"add a 'solution': with more than {_MAX_SEARCH_NUMBERS} numbers none is searched for")
        solution = solve_countdown(meta["numbers"], meta["target"])
        if solution is None:
            raise fail(f"no expression of {list(meta['numbers'])} reaches {answer}; fix numbers or target")
    if solution is None:
        solution = answer
    if not solution.endswith(ANSWER_END):
        solution += ANSWER_END
    if _score_row(verifier, meta, answer, solution).answer != 1.0:
        raise fail(f"solution {solution!r} is not scored as correct for answer {answer!r}; fix or remove it")

    if strict_alphabet:
        bad = outside_alphabet(prompt + solution)
        if bad:
            raise fail(
                f"characters {bad!r} are not in the character-level tokenizer's alphabet {ALPHABET!r}; "
                "rewrite the line with those characters only, or pass strict_alphabet=False when the model "
                "has its own tokenizer"
            )
    return Example(prompt=prompt, answer=answer, solution=solution, meta=meta), split


def load_jsonl_examples(path: str | Path, strict_alphabet: bool = True) -> list[tuple[Example, str | None]]:
    """Read and check every line of a JSONL task file: (example, explicit split or None) per line."""
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(
            f"JSONL task file {str(path)!r} not found or not a file; check the path after 'jsonl:'"
        )
    rows: list[tuple[Example, str | None]] = []
    first_line_of: dict[str, int] = {}
    for number, row in json_lines(path, JsonlTaskError):
        where = f"{path}:{number}"
        example, split = _parse_row(row, where, strict_alphabet)
        earlier = first_line_of.get(example.prompt)
        if earlier is not None:
            raise JsonlTaskError(
                f"{where}: prompt {example.prompt!r} already appears on line {earlier}; "
                "each prompt may appear only once, so train and test stay disjoint"
            )
        first_line_of[example.prompt] = number
        rows.append((example, split))
    if not rows:
        raise JsonlTaskError(f"{path}: no tasks found; the file is empty, write one JSON object per line")
    return rows


def assign_splits(
    rows: list[tuple[Example, str | None]], seed: int, test_fraction: float
) -> dict[str, list[Example]]:
    """Rows with a "split" keep it; the others are shuffled (seeded) and test_fraction of them go to test."""
    splits = {which: [example for example, split in rows if split == which] for which in ("train", "test")}
    unassigned = [example for example, split in rows if split is None]
    # A seeded shuffle, so the assignment is the same every run but can be varied with the seed.
    random.Random(f"jsonl:{seed}").shuffle(unassigned)
    n_test = round(len(unassigned) * test_fraction)
    splits["test"] += unassigned[:n_test]
    splits["train"] += unassigned[n_test:]
    return splits


class JsonlTask(Task):
    """A task read from a JSONL file (format in this module's docstring)."""

    def __init__(
        self, path: str | Path, seed: int = 0, test_fraction: float = 0.2, strict_alphabet: bool = True
    ) -> None:
        if not 0.0 <= test_fraction <= 1.0:
            raise ValueError(f"test_fraction must be between 0 and 1, got {test_fraction}")
        self.name = f"jsonl:{path}"
        rows = load_jsonl_examples(path, strict_alphabet=strict_alphabet)
        self._splits = assign_splits(rows, seed, test_fraction)

    def score(self, example: Example, completion: str) -> Score:
        return _score_row(example.meta["verifier"], example.meta, example.answer, completion)
