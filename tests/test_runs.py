"""Runs you can trust: a run directory belongs to one run, resume is exact in every mode or refused with
a reason, damaged files are caught, and every user error is one `fastes: ...` line (docs/reliability.md).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from conftest import hold_after_checkpoint, is_timing
from safetensors.torch import load_file, save_file

import fastes
from fastes.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from fastes.cli import build_parser, main
from fastes.errors import ConfigError, FastesError, MissingFileError
from fastes.models.loading import ModelError, load_model, tiny_model_path
from fastes.run.config import config_dict, flag_specs, load_config
from fastes.run.es_loop import make_es
from fastes.run.rundir import RunDirError, config_changes
from fastes.run.train import train
from fastes.tasks import get_task

FORK = multiprocessing.get_context("fork")


@pytest.fixture(scope="module")
def easy_task(tmp_path_factory) -> str:
    """16 fixed 'compare' problems for training, 4 for test: every run here is a few seconds."""
    path = tmp_path_factory.mktemp("task") / "compare.jsonl"
    task = get_task("compare")
    rows = [{"prompt": e.prompt, "answer": e.answer, "verifier": "exact"} for e in task.split("train")[:16]]
    for row in rows:
        row["split"] = "train"
    rows += [
        {"prompt": e.prompt, "answer": e.answer, "verifier": "exact", "split": "test"}
        for e in task.split("test")[:4]
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f"jsonl:{path}"


def settings(task: str, out_dir: Path, **extra) -> dict:
    return {
        "task": task,
        "out_dir": str(out_dir),
        "batch_size": 8,
        "max_new_tokens": 3,
        "eval_size": 4,
        "eval_every": 1,
        "checkpoint_every": 1,
        "progress": False,
        "es.iterations": 2,
        "es.population": 4,
        "grpo.steps": 2,
        "grpo.num_generations": 4,
        **extra,
    }


def metrics(out_dir: Path) -> list[dict]:
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if not is_timing(k)} for line in lines]


def weights(out_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out_dir / "final" / "model.safetensors"))


def same_weights(a: Path, b: Path) -> bool:
    wa, wb = weights(a), weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.fixture(scope="module")
def finished_run(easy_task, tmp_path_factory) -> tuple[Path, dict]:
    """A finished 2-iteration ES run (checkpoints at steps 1 and 2); tests copy it before changing it."""
    out_dir = tmp_path_factory.mktemp("finished") / "run"
    run_settings = settings(easy_task, out_dir)
    train(load_config(None, run_settings))
    return out_dir, run_settings


def copy_run(finished_run, to: Path) -> tuple[Path, dict]:
    source, run_settings = finished_run
    shutil.copytree(source, to)
    return to, {**run_settings, "out_dir": str(to)}


# --- a run directory belongs to one run ------------------------------------------------------------------


def test_a_fresh_run_refuses_a_directory_holding_a_run_unless_overwrite(finished_run, tmp_path, capsys):
    out_dir, run_settings = copy_run(finished_run, tmp_path / "run")
    before = (out_dir / "metrics.jsonl").read_text()
    refused = r"already holds a run \(base_test.json, checkpoints, config.json, .*--resume"
    with pytest.raises(RunDirError, match=refused):
        train(load_config(None, {**run_settings, "seed": 1}))
    assert (out_dir / "metrics.jsonl").read_text() == before  # nothing lost
    capsys.readouterr()
    train(load_config(None, {**run_settings, "seed": 1, "es.iterations": 1}), overwrite=True)
    said = capsys.readouterr().out
    removed = "base_test.json, checkpoints/ (2 checkpoints)"
    assert f"--overwrite: removing the previous run in {out_dir}: {removed}" in said
    assert "metrics.jsonl" in said and "final/" in said
    assert [m["global_step"] for m in metrics(out_dir)] == [0, 1]  # only the new run is left
    assert json.loads((out_dir / "run.json").read_text())["config"]["seed"] == 1
    assert [p.name for p in (out_dir / "checkpoints").iterdir()] == ["step-00000001"]


def test_the_demo_runs_again_in_its_own_directory(easy_task, tmp_path, monkeypatch, capsys):
    """`fastes demo` twice (the quickstart's command run again) replaces its previous run in runs/demo."""
    monkeypatch.chdir(tmp_path)
    flags = [f"--{k}={v}" for k, v in settings(easy_task, tmp_path).items() if k != "out_dir"]
    assert main(["demo", *flags, "--seed=1"]) == 0
    assert main(["demo", *flags, "--seed=2"]) == 0
    assert "--overwrite: removing the previous run in runs/demo" in capsys.readouterr().out
    assert json.loads((tmp_path / "runs/demo/run.json").read_text())["config"]["seed"] == 2
    # Another directory keeps the rule: a run there is never replaced without --overwrite.
    assert main(["demo", *flags, "--out_dir=elsewhere"]) == 0
    assert main(["demo", *flags, "--out_dir=elsewhere", "--seed=3"]) == 2


def test_other_files_and_model_directories_are_never_overwritten(easy_task, tmp_path):
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("keep me")
    with pytest.raises(RunDirError, match=r"holds files that are not a fastes run's \(todo.txt\)"):
        train(load_config(None, settings(easy_task, notes)), overwrite=True)
    model_dir = tmp_path / "other_model"  # a model directory that is not the one the run starts from
    shutil.copytree(tiny_model_path(), model_dir)
    config = (model_dir / "config.json").read_text()
    with pytest.raises(RunDirError, match="holds a config.json that no fastes run wrote"):
        train(load_config(None, settings(easy_task, model_dir)), overwrite=True)
    assert (model_dir / "config.json").read_text() == config and (notes / "todo.txt").is_file()


def test_resume_refuses_changed_settings_naming_each_key(finished_run, easy_task, tmp_path):
    out_dir, run_settings = copy_run(finished_run, tmp_path / "run")
    changed = {
        **run_settings,
        "es.sigma": 0.01,
        "es.population": 8,
        "seed": 1,
        "algorithm": "grpo",
        "es.iterations": 1,
    }
    with pytest.raises(RunDirError) as error:
        train(load_config(None, changed), resume=True)
    message = str(error.value)
    for part in (
        "es.sigma: 0.002 -> 0.01",
        "es.population: 4 -> 8",
        "seed: 0 -> 1",
        "algorithm: 'es' -> 'grpo'",
        "es.iterations: 2 -> 1 (a run can be extended, not shortened)",
    ):
        assert part in message
    with pytest.raises(RunDirError, match=r"task: 'jsonl:.*' -> 'countdown'"):
        train(load_config(None, {**run_settings, "task": "countdown"}), resume=True)
    # Settings that change neither the weights nor the metrics may differ.
    moved = tmp_path / "moved"
    out_dir.rename(moved)
    train(load_config(None, {**run_settings, "out_dir": str(moved), "checkpoint_every": 2}), resume=True)


def test_a_finished_phase_keeps_its_length():
    saved = config_dict(load_config(None, {"algorithm": "grpo_es"}))
    longer = config_dict(load_config(None, {"algorithm": "grpo_es", "grpo.steps": 50, "es.iterations": 70}))
    assert config_changes(saved, longer) == []
    assert config_changes(saved, longer, finished=("grpo.steps",)) == [
        "grpo.steps: 40 -> 50 (that phase has ended)"
    ]


def test_extending_a_finished_run_equals_the_longer_run(finished_run, easy_task, tmp_path, capsys):
    out_dir, run_settings = copy_run(finished_run, tmp_path / "run")
    run_id = json.loads((out_dir / "run.json").read_text())["run_id"]
    capsys.readouterr()
    train(load_config(None, {**run_settings, "es.iterations": 3}), resume=True)
    assert f"Resuming run {run_id} from step 2 ({out_dir})" in capsys.readouterr().out
    straight = tmp_path / "straight"
    train(load_config(None, {**run_settings, "out_dir": str(straight), "es.iterations": 3}))
    assert same_weights(out_dir, straight) and metrics(out_dir) == metrics(straight)
    assert json.loads((out_dir / "run.json").read_text())["run_id"] == run_id  # the length is not identity


def test_a_changed_starting_model_is_refused(easy_task, tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_path(), model_dir)
    run_settings = settings(easy_task, tmp_path / "run", model=str(model_dir), **{"es.iterations": 1})
    train(load_config(None, run_settings))
    tensors = load_file(str(model_dir / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(RunDirError, match=f"the starting model {model_dir} has changed since the run"):
        train(load_config(None, run_settings), resume=True)


def test_a_checkpoint_of_another_run_is_refused(finished_run, tmp_path):
    out_dir, run_settings = copy_run(finished_run, tmp_path / "run")
    identity = json.loads((out_dir / "run.json").read_text())
    (out_dir / "run.json").write_text(json.dumps({**identity, "run_id": "0123456789ab"}))
    with pytest.raises(RunDirError, match="but .*run.json to run 0123456789ab; the directory mixes two runs"):
        train(load_config(None, run_settings), resume=True)
    (out_dir / "run.json").write_text('{"run_id": "0123')
    with pytest.raises(RunDirError, match=r"run.json is damaged \(.*\); the run cannot be identified"):
        train(load_config(None, run_settings), resume=True)


def test_resume_with_nothing_to_resume_says_so(easy_task, tmp_path, capsys):
    for out_dir in (tmp_path / "missing", tmp_path / "empty"):
        (tmp_path / "empty").mkdir(exist_ok=True)
        with pytest.raises(RunDirError, match="holds no run to resume .*start a new run without --resume"):
            train(load_config(None, settings(easy_task, out_dir)), resume=True)
    # Killed while writing run.json: only a temporary file, which is no run, so a fresh start is fine.
    (tmp_path / "empty" / "run.json.tmp").write_text('{"run_id": "01')
    train(load_config(None, settings(easy_task, tmp_path / "empty", **{"es.iterations": 1})))
    assert not (tmp_path / "empty" / "run.json.tmp").exists()
    # Killed before its first checkpoint: the run starts over, and says so. Leftovers of crashes go.
    run_settings = settings(easy_task, tmp_path / "run", checkpoint_every=0, **{"es.iterations": 1})
    train(load_config(None, run_settings))
    (tmp_path / "run" / "checkpoints" / ".trash-step-00000003").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / ".tmp-step-00000004").mkdir()
    (tmp_path / "run" / ".tmp-final").mkdir()
    (tmp_path / "run" / "metrics.jsonl.tmp").write_text("half")
    capsys.readouterr()
    train(load_config(None, run_settings), resume=True)
    assert "from step 0: no checkpoint was written yet, so it starts over" in capsys.readouterr().out
    assert not [p for p in (tmp_path / "run").rglob("*") if ".tmp" in p.name or ".trash" in p.name]


# --- exact resume in every mode ---------------------------------------------------------------------------


def _train_in_child(run_settings: dict, hold_at: int) -> None:
    torch.set_num_threads(1)
    hold_after_checkpoint(hold_at)
    train(load_config(None, run_settings))


def kill_after_checkpoint(run_settings: dict, step: int) -> None:
    """Run in a forked child and SIGKILL it once checkpoint `step` exists."""
    child = FORK.Process(target=_train_in_child, args=(run_settings, step))
    child.start()
    target = Path(run_settings["out_dir"]) / "checkpoints" / f"step-{step:08d}"
    deadline = time.monotonic() + 120
    while not target.exists() and child.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    assert target.exists(), "the run ended before the checkpoint it was to be killed after"
    assert not (Path(run_settings["out_dir"]) / "final").exists()  # killed, not finished


MODES = {
    "grpo with a KL reference": {"algorithm": "grpo", "grpo.steps": 4, "grpo.beta": 0.5, "grpo.lr": 1e-3},
    "grpo with micro-batches, a schedule and a synced reference": {
        "algorithm": "grpo",
        "grpo.steps": 4,
        "grpo.beta": 0.5,
        "grpo.lr": 1e-3,
        "grpo.loss_type": "bnpo",
        "grpo.steps_per_generation": 2,  # two optimizer steps per step, on shuffled halves
        "grpo.lr_scheduler_type": "linear",
        "grpo.warmup_steps": 1,
        "grpo.sync_ref_model": True,
        "grpo.ref_model_sync_steps": 3,  # mid-step and across the checkpoint
    },
    "es member by member": {"es.iterations": 4, "es.eval_mode": "member"},
    "es with a warmup and cosine schedule": {
        "es.iterations": 4,
        "es.lr": 1e-3,
        "es.lr_scheduler_type": "cosine",
        "es.warmup_steps": 1,
    },
    "es low-rank bf16 stochastic rounding": {
        "es.iterations": 4,
        "es.noise_type": "lowrank",
        "es.eval_mode": "lowrank",
        "es.rank": 2,
        "dtype": "bfloat16",
        "es.stochastic_rounding": True,
        "es.lr": 1e-3,
    },
}


@pytest.mark.parametrize("mode", MODES)
def test_sigkill_then_resume_equals_the_uninterrupted_run_in_every_mode(easy_task, tmp_path, mode):
    run_settings = settings(easy_task, tmp_path / "straight", **MODES[mode])
    train(load_config(None, run_settings))
    crashed = {**run_settings, "out_dir": str(tmp_path / "crashed")}
    kill_after_checkpoint(crashed, step=2)
    train(load_config(None, crashed), resume=True)
    assert same_weights(tmp_path / "straight", tmp_path / "crashed")
    assert metrics(tmp_path / "crashed") == metrics(tmp_path / "straight")
    if "grpo.beta" in MODES[mode]:  # the KL is measured against the starting model after the resume too
        assert all(m["kl"] > 0 for m in metrics(tmp_path / "crashed")[3:])


def _flat_es_state(state: dict) -> dict:
    """An ES state as fastes wrote it before the options had one entry: at its top level."""
    flat = {k: v for k, v in state.items() if k != "options"}
    return {**flat, **{k: v for k, v in state["options"].items() if k not in ("sigma", "lr", "weight_decay")}}


def test_resume_of_a_run_whose_checkpoint_has_the_earlier_es_state_is_exact(easy_task, tmp_path):
    """A run directory written before ES states kept their options in one entry still resumes, exactly."""
    run_settings = settings(easy_task, tmp_path / "straight", **MODES["es low-rank bf16 stochastic rounding"])
    train(load_config(None, run_settings))
    old = tmp_path / "old"
    shutil.copytree(tmp_path / "straight", old)
    shutil.rmtree(old / "final")
    step, tensors, state = load_checkpoint(old / "checkpoints" / "step-00000003")
    assert set(state["es"]["options"]) >= {"noise_type", "rank", "stochastic_rounding", "seed"}
    state["es"] = _flat_es_state(state["es"])
    save_checkpoint(old, step, tensors, state)  # deletes step 4: the run resumes from step 3
    train(load_config(None, {**run_settings, "out_dir": str(old)}), resume=True)
    assert same_weights(tmp_path / "straight", old)
    assert metrics(old) == metrics(tmp_path / "straight")


# --- the whole checkpoint is verified ---------------------------------------------------------------------


def _state_file(path: Path) -> tuple[Path, dict]:
    return path / "state.json", json.loads((path / "state.json").read_text())


@pytest.mark.parametrize("field", ["step", "generation", "seed", "history"])
def test_a_changed_digit_in_state_json_is_refused(tmp_path, field):
    state = {"es": {"generation": 3, "seed": 7, "history": [{"weights": [0.25, -0.5]}]}}
    save_checkpoint(tmp_path, 1, {"w": torch.zeros(2)}, state)
    path = save_checkpoint(tmp_path, 2, {"w": torch.ones(2)}, state)
    state_file, record = _state_file(path)
    if field == "step":
        record["step"] = 3
    elif field == "history":
        record["state"]["es"]["history"][0]["weights"][1] = -0.6
    else:
        record["state"]["es"][field] += 1
    state_file.write_text(json.dumps(record))
    with pytest.raises(CheckpointError, match="step-00000002: state.json does not match its checksum"):
        latest_checkpoint(tmp_path)
    assert load_checkpoint(tmp_path / "checkpoints" / "step-00000001")[0] == 1  # the previous one is kept


def test_a_checkpoint_directory_must_carry_its_own_step(tmp_path):
    path = save_checkpoint(tmp_path, 2, {"w": torch.ones(2)}, {})
    path.rename(path.with_name("step-00000005"))
    with pytest.raises(CheckpointError, match="step-00000005 records step 2, not the step in its name"):
        latest_checkpoint(tmp_path)


@pytest.mark.parametrize("damage", ["deleted", "damaged middle line"])
def test_lost_or_damaged_metrics_are_rewritten_from_the_checkpoint(finished_run, tmp_path, capsys, damage):
    out_dir, run_settings = copy_run(finished_run, tmp_path / "run")
    expected = metrics(out_dir)
    path = out_dir / "metrics.jsonl"
    if damage == "deleted":
        path.unlink()
    else:
        lines = path.read_text().splitlines()
        lines[1] = lines[1][:10]
        path.write_text("\n".join(lines) + "\n")
    capsys.readouterr()
    train(load_config(None, run_settings), resume=True)
    said = capsys.readouterr().out
    assert ("missing" if damage == "deleted" else "line 2 is damaged") in said
    assert "rewritten from checkpoint step 2" in said
    assert metrics(out_dir) == expected


# --- model directories ------------------------------------------------------------------------------------


def _edit_weights(model_dir: Path, edit) -> None:
    tensors = load_file(str(model_dir / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})


WEIGHT_DAMAGE = {
    "a missing tensor": (lambda t: t.pop("model.norm.weight"), r"1 missing tensors \(model.norm.weight\)"),
    "fewer layers": (
        lambda t: [t.pop(k) for k in list(t) if ".layers.1." in k],
        r"9 missing tensors \(model.layers.1.input_layernorm.weight, ",
    ),
    "an unexpected tensor": (
        lambda t: t.update({"model.extra.weight": torch.zeros(2)}),
        r"1 unexpected tensors \(model.extra.weight\)",
    ),
    "a wrong shape": (
        lambda t: t.update({"model.norm.weight": torch.ones(3)}),
        r"1 tensors of the wrong shape \(model.norm.weight: \(3,\) in the file, \(64,\) in config.json\)",
    ),
}


@pytest.mark.parametrize("damage", WEIGHT_DAMAGE)
def test_weights_that_do_not_fit_the_config_are_refused(tmp_path, damage):
    edit, message = WEIGHT_DAMAGE[damage]
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_path(), model_dir)
    _edit_weights(model_dir, edit)
    with pytest.raises(ModelError, match=f"{model_dir}: the weights do not match config.json: {message}"):
        load_model(model_dir)


def test_tokenizer_files_missing_or_invalid_get_clear_errors(tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_path(), model_dir)
    (model_dir / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(ModelError, match=r"tokenizer.json is not valid JSON \(Expecting value: line 1"):
        load_model(model_dir)
    (model_dir / "tokenizer.json").write_text('{"version": "1.0"}')  # JSON, but not a tokenizer
    with pytest.raises(ModelError, match="the tokenizer cannot be loaded"):
        load_model(model_dir)
    (model_dir / "tokenizer.json").unlink()
    with pytest.raises(MissingFileError, match="has no tokenizer files .*tokenizer.json, tokenizer.model"):
        load_model(model_dir)


# --- impossible settings are refused before any work --------------------------------------------------------


def test_impossible_settings_are_refused_before_any_work(easy_task, tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")  # as on a user's CPU machine
    with pytest.raises(ConfigError, match="es.eval_mode: 'virtual' runs a Triton kernel and needs a CUDA"):
        load_config(None, {"es.eval_mode": "virtual"})
    with pytest.raises(ConfigError, match="backend: 'triton' needs a CUDA device"):
        load_config(None, {"backend": "triton"})
    assert load_config(None, {"es.eval_mode": "virtual", "algorithm": "grpo"})  # GRPO never uses it
    with pytest.raises(ConfigError, match="collective_timeout: must be > 0"):
        load_config(None, {"collective_timeout": 0.0})

    def no_work(*args, **kwargs):
        raise AssertionError("the run started working before its checks were done")

    monkeypatch.setattr("fastes.run.train.evaluate", no_work)
    only_test = tmp_path / "only_test.jsonl"
    only_test.write_text('{"prompt": "1+1=", "answer": "2", "verifier": "numeric", "split": "test"}\n')
    with pytest.raises(ConfigError, match="has no train problems"):
        train(load_config(None, settings(f"jsonl:{only_test}", tmp_path / "a")))

    def nothing_to_evolve(model, **selection):
        raise ValueError(f"{type(model).__name__} has no nn.Linear weights to evolve")

    monkeypatch.setattr("fastes.run.es_loop.linear_weights", nothing_to_evolve)
    with pytest.raises(ModelError, match="has no nn.Linear weights to evolve. ES cannot train it"):
        train(load_config(None, settings(easy_task, tmp_path / "b")))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # nothing written


# --- the command line ---------------------------------------------------------------------------------------


def one_error_line(capsys, argv: list[str]) -> str:
    """Run the CLI; it must exit with status 2 and print exactly one `fastes: ...` line to stderr."""
    try:
        code = main(argv)
    except SystemExit as exit:  # argparse
        code = exit.code
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("fastes: "), err
    return err


def test_every_user_error_is_one_line_with_status_2(finished_run, easy_task, tmp_path, capsys):
    out_dir, run_settings = copy_run(finished_run, tmp_path / "run")
    flags = [f"--{k}={v}" for k, v in run_settings.items()]
    assert "already holds a run" in one_error_line(capsys, ["train", *flags])
    both = ["train", "--out_dir", str(out_dir), "--resume", "--overwrite"]
    assert "--overwrite deletes it: choose one" in one_error_line(capsys, both)
    missing = ["train", "--task", easy_task, "--out_dir", str(tmp_path / "none"), "--resume"]
    assert "holds no run to resume" in one_error_line(capsys, missing)
    state_file, record = _state_file(out_dir / "checkpoints" / "step-00000002")
    record["state"]["es"]["generation"] = 7
    state_file.write_text(json.dumps(record))
    err = one_error_line(capsys, ["train", "--out_dir", str(out_dir), "--resume"])
    assert "step-00000002: state.json does not match its checksum" in err and "delete this directory" in err
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_path(), broken)
    (broken / "tokenizer.json").unlink()
    assert "has no tokenizer files" in one_error_line(capsys, ["eval", "--model", str(broken)])
    assert "argument --limit: must be > 0, got 0" in one_error_line(capsys, ["eval", "--limit", "0"])
    assert "argument --limit: must be > 0, got -5" in one_error_line(capsys, ["eval", "--limit=-5"])
    assert "task: 'sudoku' does not exist" in one_error_line(capsys, ["eval", "--task", "sudoku"])
    assert "unrecognized arguments: --es.sigmaa" in one_error_line(capsys, ["train", "--es.sigmaa", "1"])
    experiment = tmp_path / "experiment"
    (experiment / "runs" / "es").mkdir(parents=True)
    err = one_error_line(capsys, ["experiment", "--preset", "quick", "--out", str(experiment)])
    assert "is not empty (runs/)" in err and "--overwrite" in err
    assert (experiment / "runs" / "es").is_dir()  # nothing deleted


def test_resume_from_the_command_line_takes_the_runs_own_settings(finished_run, tmp_path, capsys):
    """`--resume` needs only --out_dir: the saved settings are the base, and flags given now must agree."""
    out_dir, _ = copy_run(finished_run, tmp_path / "run")
    assert main(["train", "--out_dir", str(out_dir), "--resume", "--es.iterations", "3"]) == 0
    assert [m["global_step"] for m in metrics(out_dir)] == [0, 1, 2, 3]
    err = one_error_line(capsys, ["train", "--out-dir", str(out_dir), "--resume", "--es.shaping", "zscore"])
    assert "es.shaping: 'centered_rank' -> 'zscore'" in err


def _cli_in_child(argv: list[str], stderr_file: str, hold_at: int) -> None:
    # A forked child inherits the test process's signal state, which earlier tests' libraries may have
    # changed: Ctrl-C must behave here as in a fresh `fastes` process.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    sys.stderr = open(stderr_file, "w")  # noqa: SIM115 (the process ends with os._exit)
    torch.set_num_threads(1)
    hold_after_checkpoint(hold_at)  # still going when the signal comes, however fast the run
    code = main(argv)
    sys.stderr.flush()
    os._exit(code)


def test_ctrl_c_ends_with_one_line_telling_how_to_resume(easy_task, tmp_path):
    run_settings = settings(easy_task, tmp_path / "run", **{"es.iterations": 4})
    argv = ["train", *[f"--{k}={v}" for k, v in run_settings.items()]]
    child = FORK.Process(target=_cli_in_child, args=(argv, str(tmp_path / "stderr"), 1))
    child.start()
    first = tmp_path / "run" / "checkpoints" / "step-00000001"
    deadline = time.monotonic() + 120
    while not first.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(child.pid, signal.SIGINT)
    child.join(60)
    assert child.exitcode == 130
    lines = [line for line in (tmp_path / "stderr").read_text().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("fastes: interrupted; its newest checkpoint is step 1")
    command = lines[0].split("Continue with: ")[1]
    assert command == f"fastes train --out_dir {shlex.quote(str(tmp_path / 'run'))} --resume"
    assert main(shlex.split(command)[1:]) == 0  # and it does
    assert [m["global_step"] for m in metrics(tmp_path / "run")] == list(range(5))


def test_python_dash_m_fastes_is_the_command():
    done = subprocess.run([sys.executable, "-m", "fastes", "--version"], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == f"fastes {fastes.__version__}"


def test_version_help_and_flag_spellings(capsys):
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.strip() == f"fastes {fastes.__version__}"
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--es.sigma FLOAT noise scale (default: 0.002)" in text
    assert "--overwrite" in text and "--resume" in text
    for key, _ in flag_specs():  # every flag has a help line
        assert f"--{key} " in text
    parse = build_parser().parse_args
    from fastes.cli import _normalise_flags

    dashes = parse(_normalise_flags(["train", "--out-dir", "x", "--es.eval-mode", "member"]))
    underscores = parse(["train", "--out_dir", "x", "--es.eval_mode", "member"])
    assert vars(dashes) == vars(underscores)
    assert vars(parse(_normalise_flags(["eval", "--max-new-tokens", "5", "--task-seed", "2"]))) == vars(
        parse(["eval", "--max_new_tokens", "5", "--task_seed", "2"])
    )


def test_experiment_overwrite_says_what_it_replaces(tmp_path, capsys):
    from fastes.experiment.runner import _read_out, _start

    (tmp_path / "runs").mkdir()
    (tmp_path / "report.md").write_text("old")
    with pytest.raises(ConfigError, match=r"is not empty \(report.md, runs/\) and holds no experiment"):
        _read_out(tmp_path, {}, overwrite=False)
    _start(tmp_path, _read_out(tmp_path, {}, overwrite=True), overwrite=True)
    assert "replacing the experiment in" in capsys.readouterr().out and not (tmp_path / "runs").exists()
    assert _read_out(tmp_path / "new", {}, overwrite=False).done == {}  # a new directory needs no --overwrite


# --- multi-process faults -----------------------------------------------------------------------------------


def test_the_collective_timeout_has_a_default_and_a_config_key(easy_task, tmp_path):
    net = torch.nn.Linear(2, 2)
    assert fastes.ES(fastes.linear_weights(net), sigma=0.1, lr=0.1, population=2).timeout == 1800.0
    cfg = load_config(None, settings(easy_task, tmp_path, collective_timeout=5.0))
    assert config_dict(cfg)["collective_timeout"] == 5.0

    class FakeRun:
        model = torch.nn.Sequential(torch.nn.Linear(2, 2))

    cfg.es.noise_type = "full"  # what a run resolves "auto" to for a model this small
    FakeRun.cfg = cfg
    assert make_es(FakeRun).timeout == 5.0


RANK_SCRIPT = textwrap.dedent(
    """
    import datetime, os, sys, time
    import torch.distributed as dist
    import fastes.run.train
    from fastes.cli import main

    rank, init, task, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    if rank == 1:  # stops answering in its second iteration
        real = fastes.run.train.es_iteration
        def hang(run, es, step):
            if step == 1:
                time.sleep(120)
            return real(run, es, step)
        fastes.run.train.es_iteration = hang
    sys.exit(main(["train", "--task", task, "--out_dir", f"{out}/rank{rank}", "--batch_size", "4",
                   "--max_new_tokens", "2", "--eval_size", "2", "--eval_every", "0", "--progress", "false",
                   "--es.iterations", "3", "--es.population", "4", "--es.eval_mode", "member",
                   "--collective_timeout", "3"]))
    """
)


@pytest.mark.slow
def test_a_rank_that_fails_on_a_hung_peer_exits_promptly(easy_task, tmp_path):
    """torch waits for a lost peer at interpreter shutdown; the CLI prints its one line and leaves."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    ranks = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), str(tmp_path / "init"), easy_task, str(tmp_path)],
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    try:
        _, err = ranks[0].communicate(timeout=100)
        assert ranks[1].poll() is None, "the hung rank should still be hanging"
    finally:
        for p in ranks:
            p.kill()
            p.wait()
    lines = [line for line in err.splitlines() if line.strip()]
    assert ranks[0].returncode == 1
    assert lines[-1].startswith("fastes: ES generation 1, rank 0 of 2: the all-reduce of the rewards failed")
    assert "within 3 s" in lines[-1]


def test_a_missing_optional_package_is_a_user_error(monkeypatch):
    real = __import__("importlib").import_module

    def without_reasoning_gym(name, *args):
        if name == "reasoning_gym":
            raise ImportError("No module named 'reasoning_gym'")
        return real(name, *args)

    monkeypatch.setattr("importlib.import_module", without_reasoning_gym)
    with pytest.raises(FastesError, match="pip install reasoning-gym"):
        get_task("reasoning_gym:leg_counting")


def test_fastes_errors_are_the_user_errors():
    """What the CLI turns into one line: configuration, run directory, checkpoint, model and task errors."""
    from fastes.tasks import JsonlTaskError

    for error in (ConfigError, RunDirError, CheckpointError, ModelError, MissingFileError, JsonlTaskError):
        assert issubclass(error, FastesError)
