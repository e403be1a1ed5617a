"""Users' rows: the one reader of the rows files that tasks load, and the checks every row gets.

A JSONL task file (`jsonl.py`), a JSONL file of prompts and columns for a reward function
(`reward_file.py`) and a dataset's rows or data file (`dataset.py`) are read and checked here: the text
(UTF-8), each line (one JSON object), and the columns (no reserved name; the same in every row). Each
task then gives a row its own meaning. Errors are raised as the calling task's own error type, naming
the file and line (or the row) and the fix.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# What TRL passes every reward function by keyword besides the columns: no column may take these names.
RESERVED = ("prompts", "completions", "completion_ids", "trainer_state", "log_metric", "log_extra")

ErrorType = type[Exception]


def read_text(path: Path, error: ErrorType) -> str:
    """The file's text; a file that is not UTF-8 raises `error` naming the line of the first bad byte."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as bad:
        line = data[: bad.start].count(b"\n") + 1
        raise error(
            f"{path}:{line}: not UTF-8 text (byte {data[bad.start]:#04x}); save the file as UTF-8"
        ) from None


def json_lines(path: Path, error: ErrorType, text: str | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-blank line of a JSON Lines file (`text`: its text, when the
    caller has read it already). A line that is not one JSON object raises `error` naming the line."""
    text = read_text(path, error) if text is None else text
    # split("\n"), not splitlines(): the latter also breaks at characters such as U+2028 inside strings.
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as bad:
            raise error(
                f"{where}: malformed JSON ({bad.msg} at column {bad.colno}); each line must be one complete "
                "JSON object"
            ) from None
        except (RecursionError, ValueError) as bad:  # hostile nesting depth, integers too long to parse
            raise error(
                f"{where}: unreadable JSON ({type(bad).__name__}: {str(bad)[:80]}); keep lines to plain "
                "objects with short strings and numbers"
            ) from None
        yield number, object_row(row, where, error)


def object_row(row: Any, where: str, error: ErrorType) -> dict[str, Any]:
    """`row` if it is an object of columns (a dict), else `error` naming `where`."""
    if not isinstance(row, dict):
        kind = type(row).__name__
        raise error(f'{where}: expected a JSON object (a dict) {{"prompt": ..., ...}}, got a {kind}')
    return row


class Columns:
    """The columns of a set of rows: the first row's, which may take no reserved name and which every
    later row must repeat."""

    def __init__(self, error: ErrorType) -> None:
        self.error = error
        self.names: list[str] = []
        self._first = ""  # the first row's name

    def check(self, row: dict[str, Any], where: str, name: str) -> None:
        """Raise `error`, prefixed by `where`, unless `row` has the columns the rows have had so far;
        `name` names the row in later messages ("line 1", "row 0")."""
        columns = sorted(row)
        if not self._first:
            clash = [c for c in columns if c in RESERVED]
            if clash:
                raise self.error(
                    f"{where}: column {clash[0]!r} is reserved: the trainer passes it to the reward "
                    "functions itself; rename that column"
                )
            self.names, self._first = columns, name
        elif columns != self.names:
            raise self.error(
                f"{where} has columns {columns}, {self._first} has {self.names}; give every row the "
                "same columns"
            )
