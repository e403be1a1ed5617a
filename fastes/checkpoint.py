"""Checkpoints that survive a crash at any moment and are never loaded when damaged.

A checkpoint is a directory `step-NNNNNNNN/` under the run's `checkpoints/`, holding
- tensors.safetensors: the model weights and any optimizer tensors (safetensors: no pickle),
- state.json: the loop's plain state (ES state, step counters, config) and the SHA-256 of the tensors.
It is written into a temporary directory and renamed into place, so a reader sees either the whole
checkpoint or none of it. The newest `keep` checkpoints are kept; resuming takes the newest that verifies.
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

TENSORS_FILE = "tensors.safetensors"
STATE_FILE = "state.json"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, truncated or does not match its checksum."""


def _sha256(path: Path) -> str:
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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    # Tied or shared tensors are stored once per name: safetensors refuses aliased storage.
    save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()}, str(tmp / TENSORS_FILE))
    record = {"step": step, "sha256": _sha256(tmp / TENSORS_FILE), "state": state}
    with (tmp / STATE_FILE).open("w") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
    with (tmp / TENSORS_FILE).open("rb") as f:
        os.fsync(f.fileno())
    if final.exists():  # the same step again (a phase boundary); a crash between the two lines
        _discard(final)  # leaves no step-N at all, and a resume takes the previous checkpoint
    os.replace(tmp, final)
    _fsync_dir(root)
    for _, old in _checkpoints(root)[:-keep]:
        _discard(old)
    return final


def load_checkpoint(path: str | Path) -> tuple[int, dict[str, torch.Tensor], dict[str, Any]]:
    """(step, tensors, state) of the checkpoint directory `path`, after verifying its checksum."""
    path = Path(path)
    try:
        record = json.loads((path / STATE_FILE).read_text())
        expected = record["sha256"]
    except (OSError, ValueError, KeyError) as error:
        raise CheckpointError(f"checkpoint {path} is incomplete or corrupt ({STATE_FILE}: {error})") from None
    tensor_file = path / TENSORS_FILE
    if not tensor_file.is_file() or _sha256(tensor_file) != expected:
        raise CheckpointError(
            f"checkpoint {path}: {TENSORS_FILE} is missing or does not match its checksum "
            "(truncated or modified); delete this directory to resume from the previous checkpoint"
        )
    return int(record["step"]), load_file(str(tensor_file)), record["state"]


def latest_checkpoint(run_dir: str | Path) -> tuple[int, dict[str, torch.Tensor], dict[str, Any]] | None:
    """The newest checkpoint of a run that verifies, or None when there is none.

    A damaged newest checkpoint raises CheckpointError rather than silently falling back, so that a
    user learns about it; the message says how to resume from the previous one.
    """
    candidates = _checkpoints(Path(run_dir) / "checkpoints")
    if not candidates:
        return None
    return load_checkpoint(candidates[-1][1])
