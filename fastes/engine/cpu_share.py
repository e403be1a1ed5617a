"""fastes processes on one machine share its cores instead of spinning against each other.

torch's intra-op threads (OpenMP) spin for a while when they wait for work. Two processes that each run
as many such threads as there are cores slow each other several times over, far more than running one
after the other (docs/backends.md has the figures). So every `fastes` command registers its process in
a folder of the cache (one empty file per process id) and, at most once a second when it generates,
sets its torch threads to cores // (registered fastes processes alive): alone it uses every core, two
side by side take half each, and a finished one gives its share back to the others.

Left alone: a process whose user set OMP_NUM_THREADS (torchrun sets it to 1 for each of its processes);
FASTES_THREADS=N fixes a command's threads at N. Library users who never call `register` are left alone.
"""

from __future__ import annotations

import atexit
import os
import time
from pathlib import Path

import torch

from .cpu_library import cache_dir

CHECK_EVERY_S = 1.0
_state: dict = {"folder": None, "checked": 0.0}


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def register() -> None:
    """Take part in sharing the cores (the CLI calls this first), or apply FASTES_THREADS."""
    if os.environ.get("FASTES_THREADS"):
        torch.set_num_threads(max(1, int(os.environ["FASTES_THREADS"])))
        return
    if os.environ.get("OMP_NUM_THREADS") or _state["folder"] is not None:
        return
    folder = cache_dir() / "processes"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / str(os.getpid())).touch()
    except OSError:  # a read-only cache: run as torch would, unshared
        return
    atexit.register(unregister)
    _state["folder"] = folder
    share_cores(force=True)


def unregister() -> None:
    """Stop sharing (at exit): the other fastes processes take this one's cores back."""
    folder = _state["folder"]
    if folder is not None:
        (folder / str(os.getpid())).unlink(missing_ok=True)
        _state["folder"] = None


def _alive(entry: Path) -> bool:
    """Whether a registry file names a running process (a killed one's file is removed here). A
    killed process's id reused by another program counts until that program ends."""
    if not entry.name.isdigit():
        return False
    try:
        os.kill(int(entry.name), 0)
    except ProcessLookupError:
        entry.unlink(missing_ok=True)
        return False
    except PermissionError:  # another user's process
        return True
    return True


def share_cores(force: bool = False) -> int | None:
    """Set this process's torch threads to its share of the cores; the thread count, or None when
    this process does not share (not registered). Checks at most once a second unless `force`."""
    folder = _state["folder"]
    if folder is None:
        return None
    now = time.monotonic()
    if not force and now - _state["checked"] < CHECK_EVERY_S:
        return torch.get_num_threads()
    _state["checked"] = now
    running = sum(_alive(entry) for entry in folder.iterdir())
    threads = max(1, cores() // max(1, running))
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads
