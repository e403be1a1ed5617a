"""Checkpoints that survive a crash at any moment and are never loaded when damaged.

A checkpoint is a directory `step-NNNNNNNN/` under the run's `checkpoints/`, holding
- tensors.safetensors: the model weights and any optimizer tensors (safetensors: no pickle),
- state.json: the loop's plain state (ES state, step counters, config, metrics), the step, the SHA-256
  of the tensors, and a SHA-256 over all of that, so a changed digit anywhere is caught.
It is written into a temporary directory, synced to disk and renamed into place, so a reader sees either
the whole checkpoint or none of it. The newest `keep` checkpoints are kept; resuming takes the newest.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from .errors import FastesError

TENSORS_FILE = "tensors.safetensors"
STATE_FILE = "state.json"


class CheckpointError(FastesError, RuntimeError):
    """A checkpoint is missing, truncated or does not match its checksum."""


def write_atomic(path: Path, text: str) -> None:
    """Replace `path` by `text` so that a crash at any moment leaves the old file or the new one, on disk."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_sha256(path: Path) -> str:
    """SHA-256 of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every step-N directory under `root`, oldest first (by number, not by name)."""
    found = []
    for path in root.glob("step-*") if root.is_dir() else []:
        digits = path.name[len("step-") :]
        if digits.isascii() and digits.isdigit() and path.is_dir():
            found.append((int(digits), path))
    return sorted(found)


def _discard(path: Path) -> None:
    """Delete a checkpoint directory: renamed out of the step-* names first (atomic), then removed, so a
    crash midway never leaves a half-deleted directory that a resume would take for a checkpoint."""
    trash = path.with_name(f".trash-{path.name}")
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def remove_leftovers(run_dir: str | Path) -> None:
    """Delete what a crash can leave behind: half-written (.tmp-) and half-deleted (.trash-) checkpoints."""
    root = Path(run_dir) / "checkpoints"
    for path in root.glob(".t*-step-*") if root.is_dir() else []:
        if path.name.startswith((".tmp-step-", ".trash-step-")):
            shutil.rmtree(path, ignore_errors=True)


def checkpoint_steps(run_dir: str | Path) -> list[int]:
    """The steps of the checkpoints under `run_dir`, oldest first (not verified)."""
    return [step for step, _ in _checkpoints(Path(run_dir) / "checkpoints")]


def _state_digest(step: int, tensors_sha256: str, state: dict[str, Any]) -> str:
    """SHA-256 over everything in state.json but itself (JSON floats round-trip exactly)."""
    body = {"step": step, "tensors_sha256": tensors_sha256, "state": state}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def save_checkpoint(
    run_dir: str | Path, step: int, tensors: dict[str, torch.Tensor], state: dict[str, Any], keep: int = 2
) -> Path:
    """Atomically write checkpoint `step` and delete all but the newest `keep` checkpoints.

    Checkpoints of later steps than `step` belong to a run that this one replaced (a run resumes from its
    newest checkpoint, so its own later steps cannot exist yet): they are deleted first, so that a resume
    can never pick them up instead of this run's own.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"checkpoint step must be a non-negative integer, got {step!r}")
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:08d}"
    tmp = root / f".tmp-step-{step:08d}"
    for later, stale in _checkpoints(root):
        if later > step:
            _discard(stale)
    remove_leftovers(run_dir)
    tmp.mkdir()
    # Tied or shared tensors are stored once per name: safetensors refuses aliased storage.
    save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()}, str(tmp / TENSORS_FILE))
    tensors_sha256 = file_sha256(tmp / TENSORS_FILE)
    record = {
        "step": step,
        "tensors_sha256": tensors_sha256,
        "state": state,
        "sha256": _state_digest(step, tensors_sha256, state),
    }
    with (tmp / STATE_FILE).open("w") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
    with (tmp / TENSORS_FILE).open("rb") as f:
        os.fsync(f.fileno())
    if final.exists():  # the same step again (a phase boundary); a crash between the two lines
        _discard(final)  # leaves no step-N at all, and a resume takes the previous checkpoint
    os.replace(tmp, final)
    fsync_dir(root)
    for _, old in _checkpoints(root)[:-keep]:
        _discard(old)
    return final


def load_checkpoint(path: str | Path) -> tuple[int, dict[str, torch.Tensor], dict[str, Any]]:
    """(step, tensors, state) of the checkpoint directory `path`, after verifying both files' checksums
    and that the directory's name is the step recorded inside it."""
    path = Path(path)
    fix = "delete this directory to resume from the previous checkpoint"
    try:
        record = json.loads((path / STATE_FILE).read_text())
        step, tensors_sha256, state = record["step"], record["tensors_sha256"], record["state"]
        intact = record["sha256"] == _state_digest(step, tensors_sha256, state)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointError(
            f"checkpoint {path} is incomplete or corrupt ({STATE_FILE}: {error}); {fix}"
        ) from None
    if not intact:
        raise CheckpointError(
            f"checkpoint {path}: {STATE_FILE} does not match its checksum (modified); {fix}"
        )
    if path.name != f"step-{step:08d}":
        raise CheckpointError(f"checkpoint {path} records step {step}, not the step in its name; {fix}")
    tensor_file = path / TENSORS_FILE
    if not tensor_file.is_file() or file_sha256(tensor_file) != tensors_sha256:
        raise CheckpointError(
            f"checkpoint {path}: {TENSORS_FILE} is missing or does not match its checksum "
            f"(truncated or modified); {fix}"
        )
    return step, load_file(str(tensor_file)), state


def tensors_under(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint holds under `prefix` (a run saves "model." and "reference." ones), named
    without it."""
    return {name[len(prefix) :]: t for name, t in tensors.items() if name.startswith(prefix)}


def latest_checkpoint(run_dir: str | Path) -> tuple[int, dict[str, torch.Tensor], dict[str, Any]] | None:
    """The newest checkpoint of a run that verifies, or None when there is none.

    A damaged newest checkpoint raises CheckpointError rather than silently falling back, so that a
    user learns about it; the message says how to resume from the previous one.
    """
    candidates = _checkpoints(Path(run_dir) / "checkpoints")
    if not candidates:
        return None
    return load_checkpoint(candidates[-1][1])
