"""The run directory: it belongs to one run, and what a resume reads from it is checked first.

A run's identity is its config, its seed (part of the config) and a fingerprint of the model it starts
from. It is written to run.json when the run starts and into every checkpoint. A fresh run refuses a
directory that already holds something (unless told to overwrite a previous run), and a resume refuses
settings or a starting model that differ from the run's own, naming each difference. Only the run's
length (es.iterations, grpo.steps) may be raised.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fastes.checkpoint import CheckpointError, fsync_dir, remove_leftovers, write_atomic
from fastes.errors import FastesError
from fastes.version import __version__

from .config import TrainConfig, config_dict, config_from_dict

RUN_FILE = "run.json"
# Every name a run writes under its out_dir (temporary names included): all that --overwrite removes.
RUN_NAMES = (
    RUN_FILE,
    "config.json",
    "metrics.jsonl",
    "summary.json",
    "base_test.json",
    "checkpoints",
    "final",
    "curve.png",
    "tensorboard",
    *(f"{name}.tmp" for name in (RUN_FILE, "config.json", "metrics.jsonl", "summary.json", "base_test.json")),
    ".tmp-final",
    ".trash-final",
)
LENGTH_KEYS = ("es.iterations", "grpo.steps")  # may be raised on resume: the run continues further
# Keys that change neither the weights nor the metrics: a resume may change them freely.
FREE_KEYS = ("out_dir", "progress", "checkpoint_every", "report_to", "logging_steps")


class RunDirError(FastesError, ValueError):
    """The run directory does not fit what was asked: not empty, nothing to resume, or another run."""


def model_fingerprint(model_dir: str | Path) -> str:
    """SHA-256 of a model directory's config.json and weight files (names and bytes)."""
    digest = hashlib.sha256()
    root = Path(model_dir)
    names = ["config.json", *sorted(p.name for p in root.glob("*.safetensors*"))]
    for name in names:
        digest.update(name.encode() + b"\0")
        with (root / name).open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def weights_fingerprint(model: torch.nn.Module) -> str:
    """SHA-256 of a loaded model's tensors (names, dtypes, shapes and bytes): the starting model of a
    run given a model object, which has no files to fingerprint."""
    digest = hashlib.sha256(type(model).__name__.encode())
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"\0{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
        digest.update(tensor.view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def run_identity(
    cfg: TrainConfig, model_dir: Path, *, model_sha: str | None = None, task_sha: str | None = None
) -> dict[str, Any]:
    """What makes a run this run: config, seed and starting model; run_id is a short hash of them (the
    run's length left out, since a run may be extended). `model_sha` fingerprints a model given as an
    object (model_dir then only describes it); `task_sha` the rows and reward functions of a task that
    the config does not name (a dataset given in code, or a data file's content)."""
    config = config_dict(cfg)
    fingerprint = model_sha or model_fingerprint(model_dir)
    identifying = {k: v for k, v in _flat(config).items() if k not in LENGTH_KEYS + FREE_KEYS}
    hashed = {"config": identifying, "start_model": fingerprint}
    if task_sha:  # only then, so that the run_id of every other run stays what it was
        hashed["task"] = task_sha
    text = json.dumps(hashed, sort_keys=True)
    identity = {
        "run_id": hashlib.sha256(text.encode()).hexdigest()[:12],
        "start_model": {"path": str(model_dir), "sha256": fingerprint},
        "fastes_version": __version__,
        "config": config,
        # where the run's relative paths (a jsonl task, reward files) were read from: `fastes eval --run`
        # reads them there from any directory; not identity, since a run may be resumed from elsewhere
        "working_directory": os.getcwd(),
    }
    if task_sha:
        identity["task_sha256"] = task_sha
    return identity


def saved_identity(
    out_dir: str | Path, remedy: str = "start a new run with --overwrite"
) -> dict[str, Any] | None:
    """The identity in out_dir/run.json, or None when there is no run.json; a damaged one's error
    offers restoring it or `remedy`."""
    path = Path(out_dir) / RUN_FILE
    if not path.is_file():
        return None
    try:
        identity = json.loads(path.read_text())
        config_from_dict(identity["config"])
        return identity
    except (ValueError, KeyError, TypeError) as error:
        raise RunDirError(
            f"{path} is damaged ({error}); the run cannot be identified. Restore it, or {remedy}"
        ) from None


def check_writable(out_dir: Path) -> None:
    """Before any work: the run directory can be created and written. A directory is made and removed in
    its nearest existing ancestor (permissions, a read-only file system, /proc: only trying tells)."""
    existing = next(p for p in (out_dir.absolute(), *out_dir.absolute().parents) if p.exists())
    try:
        tempfile.TemporaryDirectory(dir=existing, prefix=".fastes-probe-").cleanup()
    except OSError as error:
        raise RunDirError(
            f"out_dir {str(out_dir)!r}: cannot write in {str(existing)!r} ({error.strerror or error}); "
            "choose a directory you can write to"
        ) from None


def check_fresh(out_dir: Path, overwrite: bool) -> list[Path]:
    """Refuse a directory that holds anything, unless it holds only a previous run and `overwrite` is
    set; returns what must be removed (nothing is removed here: that waits until every check passed)."""
    if not out_dir.is_dir():
        return []
    # What a crash left half-written is no run (clean() deletes it).
    present = [p for p in sorted(out_dir.iterdir()) if not _temporary(p.name)]
    if not present:
        return []
    if (out_dir / "config.json").is_file() and not (out_dir / RUN_FILE).is_file():
        # A model's config.json, or a run of an older fastes: never replaced.
        raise RunDirError(
            f"out_dir {str(out_dir)!r} holds a config.json that no fastes run wrote (a model directory?); "
            "a run would overwrite it. Choose a new or empty out_dir"
        )
    foreign = [p.name for p in present if p.name not in RUN_NAMES]
    if foreign:
        raise RunDirError(
            f"out_dir {str(out_dir)!r} holds files that are not a fastes run's ({', '.join(foreign[:5])}"
            f"{', ...' if len(foreign) > 5 else ''}); a run would overwrite or mix with them. Choose a new "
            "or empty out_dir"
        )
    if not overwrite:
        raise RunDirError(
            f"out_dir {str(out_dir)!r} already holds a run ({', '.join(p.name for p in present)}); continue "
            "it with --resume, choose another out_dir, or pass --overwrite to delete that run"
        )
    return present


def remove_run(out_dir: Path, paths: list[Path]) -> None:
    """Delete a previous run's files (--overwrite), saying what goes."""
    if not paths:
        return
    described = []
    for path in paths:
        if path.name == "checkpoints":
            described.append(f"checkpoints/ ({len(list(path.glob('step-*')))} checkpoints)")
        else:
            described.append(path.name + ("/" if path.is_dir() else ""))
    print(f"fastes: --overwrite: removing the previous run in {out_dir}: {', '.join(described)}")
    for path in paths:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()


def check_resume(
    identity: dict[str, Any], saved: dict[str, Any], out_dir: Path, finished: tuple[str, ...] = ()
) -> None:
    """Refuse to continue a run with other settings or another starting model than its own.

    `finished` lists the length keys of phases that have already ended (they can no longer change).
    """
    changes = config_changes(saved["config"], identity["config"], finished)
    if changes:
        raise RunDirError(
            f"--resume: the settings differ from those the run in {out_dir} started with: "
            f"{'; '.join(changes)}. A run continues with its own settings: drop these flags, or start a "
            "new run in another out_dir"
        )
    if saved["start_model"]["sha256"] != identity["start_model"]["sha256"]:
        raise RunDirError(
            f"--resume: the starting model {identity['start_model']['path']} has changed since the run "
            f"in {out_dir} started (its config.json or weights differ); restore it, or start a new run"
        )
    if saved.get("task_sha256") != identity.get("task_sha256"):
        raise RunDirError(
            f"--resume: the dataset or reward functions differ from those the run in {out_dir} started "
            "with (rows, function names or weights); give the same ones, or start a new run"
        )


def config_changes(
    saved: dict[str, Any], current: dict[str, Any], finished: tuple[str, ...] = ()
) -> list[str]:
    """'key: old -> new' for every setting a resume may not change."""
    before, after = _flat(config_dict(config_from_dict(saved))), _flat(current)
    changes = []
    for key, old in before.items():
        new = after[key]
        if new == old or key in FREE_KEYS:
            continue
        if key in LENGTH_KEYS and key not in finished and new > old:
            continue
        why = ""
        if key in LENGTH_KEYS:
            why = " (that phase has ended)" if key in finished else " (a run can be extended, not shortened)"
        changes.append(f"{key}: {old!r} -> {new!r}{why}")
    return changes


def _flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def start_run(out_dir: Path, identity: dict[str, Any]) -> None:
    """Write run.json and config.json of a new run (atomically, synced)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(out_dir / RUN_FILE, json.dumps(identity, indent=2))
    write_atomic(out_dir / "config.json", json.dumps(identity["config"], indent=2))


def clean(out_dir: Path) -> None:
    """Remove what a crash can leave: half-written files and half-written or half-deleted checkpoints
    and final/ directories."""
    remove_leftovers(out_dir)
    for name in filter(_temporary, RUN_NAMES):
        path = out_dir / name
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def _temporary(name: str) -> bool:
    return name in RUN_NAMES and (name.endswith(".tmp") or name.startswith((".tmp-", ".trash-")))


def read_metrics(out_dir: Path) -> tuple[list[dict], str | None]:
    """The complete lines of out_dir/metrics.jsonl, up to the first damaged one, and what was wrong."""
    path = out_dir / "metrics.jsonl"
    if not path.is_file():
        return [], "missing"
    records = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by a crash, or damaged
            return records, f"line {number} is damaged"
    return records, None


def restore_metrics(out_dir: Path, saved: list[dict], step: int) -> None:
    """Rewrite metrics.jsonl as the checkpoint of `step` recorded it (the lines after it are redone);
    says so when the file had lost or changed any of those lines."""
    records, problem = read_metrics(out_dir)
    if records[: len(saved)] != saved:
        what = problem or "its lines differ from the checkpoint's"
        print(f"fastes: {out_dir / 'metrics.jsonl'}: {what}; rewritten from checkpoint step {step}")
    write_metrics(out_dir, saved)


def write_metrics(out_dir: Path, records: list[dict]) -> None:
    write_atomic(out_dir / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in records))


def append_metrics(out_dir: Path, record: dict) -> None:
    with (out_dir / "metrics.jsonl").open("a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def replace_dir(out_dir: Path, name: str, write: Callable[[Path], Any]) -> Path:
    """Write a directory through .tmp-<name> with `write(path)` and swap it in, so that out_dir/name is
    always whole: the old one until the new one is complete."""
    final, tmp, trash = out_dir / name, out_dir / f".tmp-{name}", out_dir / f".trash-{name}"
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp)
    if final.exists():
        os.replace(final, trash)
    os.replace(tmp, final)
    fsync_dir(out_dir)
    shutil.rmtree(trash, ignore_errors=True)
    return final


def checkpoint_identity(state: dict[str, Any], path: Path, saved: dict[str, Any] | None) -> dict[str, Any]:
    """The identity a checkpoint records, checked against run.json when both exist."""
    recorded = state.get("run")
    if recorded is None:
        raise CheckpointError(f"checkpoint {path} records no run identity (an older format); start a new run")
    if saved is not None and saved["run_id"] != recorded["run_id"]:
        raise RunDirError(
            f"checkpoint {path} belongs to run {recorded['run_id']}, but {path.parent.parent / RUN_FILE} "
            f"to run {saved['run_id']}; the directory mixes two runs. Start a new run with --overwrite"
        )
    return recorded
