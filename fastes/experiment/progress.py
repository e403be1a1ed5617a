"""What an experiment has finished, kept in its directory so that a stopped experiment continues.

progress.json holds the experiment's identity (its settings and starting model) and every finished
piece of work by key: a probe of an arm at a segment end, an arm, the evaluation of one model, one
masked evaluation of the sparsity stage, one run of the sweep, and the seconds each stage took. Run
again after Ctrl-C or a kill, the same command reads it back and redoes none of it; an arm stopped
between probes continues from its run's newest checkpoint (fastes.run.train resumes exactly).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastes.checkpoint import write_atomic

PROGRESS_FILE = "progress.json"


class Progress:
    """Finished work by key, saved after every piece (a rename: a kill never leaves half a file)."""

    def __init__(self, out_dir: Path, identity: dict[str, Any]) -> None:
        self.path = out_dir / PROGRESS_FILE
        self.identity = identity
        self.done: dict[str, Any] = {}
        self.seconds: dict[str, float] = {}

    @staticmethod
    def saved_identity(out_dir: Path) -> dict[str, Any] | None:
        """The identity of the experiment recorded in out_dir; None when there is none."""
        path = out_dir / PROGRESS_FILE
        return json.loads(path.read_text())["identity"] if path.is_file() else None

    def load(self) -> None:
        """Read back what an earlier start of the same experiment finished."""
        if self.path.is_file():
            saved = json.loads(self.path.read_text())
            self.done, self.seconds = saved["done"], saved["seconds"]

    def save(self) -> None:
        state = {"identity": self.identity, "done": self.done, "seconds": self.seconds}
        write_atomic(self.path, json.dumps(state, indent=1))

    def get(self, key: str) -> Any:
        return self.done.get(key)

    def put(self, key: str, value: Any) -> Any:
        """Record finished work; returns `value` as read back from JSON (tuples become lists), so that a
        continued experiment sees exactly what an uninterrupted one does."""
        self.done[key] = json.loads(json.dumps(value))
        self.save()
        return self.done[key]

    def once(self, key: str, work: Callable[..., Any], *args: Any) -> Any:
        """work(*args), computed only when no earlier start recorded its result under `key`."""
        return self.done[key] if key in self.done else self.put(key, work(*args))

    def add_seconds(self, stage: str, seconds: float) -> None:
        """Time spent on `stage`, summed over every start of the experiment."""
        self.seconds[stage] = round(self.seconds.get(stage, 0.0) + seconds, 1)
        self.save()
