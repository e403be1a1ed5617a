"""End-to-end training on the shipped tiny model: ES and GRPO learn, and a killed run resumes exactly."""

import gc
import json
import math
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import is_timing
from safetensors.torch import load_file

from fastes.errors import FastesError
from fastes.models.loading import load_model
from fastes.run.config import load_config
from fastes.run.train import paired_gain, train
from fastes.tasks import get_task
from fastes.tasks.setup import make_task


@pytest.fixture(scope="module")
def easy_task(tmp_path_factory) -> str:
    """24 fixed 'compare' problems (the tiny model gets nearly all right): every batch is the whole set."""
    path = tmp_path_factory.mktemp("task") / "compare.jsonl"
    examples = get_task("compare").split("train")[:24]
    rows = [{"prompt": e.prompt, "answer": e.answer, "verifier": "exact", "split": "train"} for e in examples]
    rows += [
        {"prompt": e.prompt, "answer": e.answer, "verifier": "exact", "split": "test"}
        for e in get_task("compare").split("test")[:8]
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f"jsonl:{path}"


@pytest.fixture(scope="module")
def style_task(tmp_path_factory) -> str:
    """24 fixed countdown problems: the shipped base answers about half of them in a style the verifier
    refuses ("expression=target;", see fastes/run/pretrain.py), so post-training has a reward to climb."""
    path = tmp_path_factory.mktemp("task") / "countdown.jsonl"
    task = get_task("countdown")
    chosen = {"train": task.split("train")[:24], "test": task.split("test")[:8]}
    rows = [
        {"prompt": e.prompt, "answer": e.answer, "verifier": "countdown", "numbers": list(e.meta["numbers"])}
        | {"split": split}
        for split, examples in chosen.items()
        for e in examples
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f"jsonl:{path}"


def metrics(out_dir) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def common(task: str, out_dir, **extra) -> dict:
    return {
        "task": task,
        "out_dir": str(out_dir),
        "batch_size": 24,
        "max_new_tokens": 3,
        "eval_size": 8,
        "eval_every": 0,
        "checkpoint_every": 0,
        "progress": False,
        **extra,
    }


def test_a_run_gives_the_callers_thread_count_back(easy_task, tmp_path):
    """train() runs a tiny model on one thread (more only synchronise); the caller's own count, here
    two, is back afterwards, also when the run fails."""
    torch.set_num_threads(2)
    try:
        train(
            load_config(None, common(easy_task, tmp_path / "run", **{"es.iterations": 1, "es.population": 2}))
        )
        assert torch.get_num_threads() == 2
        with pytest.raises(FastesError):  # the directory now holds a run
            train(load_config(None, common(easy_task, tmp_path / "run", **{"es.iterations": 1})))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(1)  # the suite's (conftest)


class FrozenCounts:
    """A callback that records how many objects the garbage collector holds frozen at each step."""

    def __init__(self):
        self.counts = []

    def on_step_end(self, step, metrics):
        self.counts.append(gc.get_freeze_count())


def test_the_steps_run_with_the_objects_made_before_them_frozen(easy_task, tmp_path):
    """The model, tokenizer and task (and the imported libraries) are kept out of full garbage
    collections while the steps run, and the caller's collector is as it was afterwards, also when a
    step fails; a caller's own frozen objects stay frozen."""
    recorder = FrozenCounts()
    settings = common(easy_task, tmp_path / "run", **{"es.iterations": 2, "es.population": 2})
    assert gc.get_freeze_count() == 0
    train(load_config(None, settings), callbacks=[recorder])
    assert len(recorder.counts) == 2 and all(count > 1000 for count in recorder.counts)
    assert gc.get_freeze_count() == 0

    def failing(step, metrics):
        raise RuntimeError("a callback fails")

    recorder.on_step_end = failing
    settings["out_dir"] = str(tmp_path / "failing")
    with pytest.raises(RuntimeError, match="a callback fails"):
        train(load_config(None, settings), callbacks=[recorder])
    assert gc.get_freeze_count() == 0

    gc.freeze()  # the caller's
    try:
        frozen = gc.get_freeze_count()
        settings["out_dir"] = str(tmp_path / "caller")
        train(load_config(None, settings))
        assert gc.get_freeze_count() >= frozen
    finally:
        gc.unfreeze()


def test_es_follows_its_learning_rate_schedule(easy_task, tmp_path):
    """es.lr_scheduler_type with warmup: each iteration's step uses the schedule's rate (transformers'
    linear warmup then cosine decay over es.iterations), and metrics.jsonl records it."""
    settings = {"es.iterations": 5, "es.population": 4, "es.lr": 1e-3}
    schedule = {"es.lr_scheduler_type": "cosine", "es.warmup_steps": 2}
    train(load_config(None, common(easy_task, tmp_path / "cosine", **settings, **schedule)))
    rates = [m["lr"] for m in metrics(tmp_path / "cosine") if m["phase"] == "es"]
    cosine = [0.5 * (1 + math.cos(math.pi * (n - 2) / 3)) for n in range(2, 5)]
    assert rates == pytest.approx([1e-3 * factor for factor in (0.0, 0.5, *cosine)])
    train(load_config(None, common(easy_task, tmp_path / "constant", **settings)))
    rates_of = ("cosine", "constant")
    assert [m["lr"] for m in metrics(tmp_path / "constant") if m["phase"] == "es"] == [1e-3] * 5
    cosine, constant = (load_file(tmp_path / name / "final" / "model.safetensors") for name in rates_of)
    assert any(not torch.equal(cosine[k], constant[k]) for k in cosine)


def test_es_improves_the_training_reward(style_task, tmp_path):
    settings = {"es.iterations": 8, "es.population": 16, "es.sigma": 0.002, "es.lr": 5e-5}
    cfg = load_config(None, common(style_task, tmp_path, max_new_tokens=12, **settings))
    summary = train(cfg)
    rewards = [m["reward"] for m in metrics(tmp_path) if m["phase"] == "es"]
    assert len(rewards) == 8
    assert sum(rewards[-2:]) / 2 > rewards[0] + 0.05, rewards
    model, _ = load_model(summary["model_dir"])  # the result is a normal HF directory
    assert model.config.model_type == "llama"
    # the gain is paired: the same test problems before and after
    base = json.loads((tmp_path / "base_test.json").read_text())
    assert len(base) == summary["test_problems"] == 8
    change = summary["final_test_accuracy"] - summary["base_test_accuracy"]
    assert summary["test_gain"] == pytest.approx(change)


def test_grpo_improves_the_training_reward(style_task, tmp_path):
    cfg = load_config(
        None,
        common(
            style_task,
            tmp_path,
            algorithm="grpo",
            max_new_tokens=12,
            **{"grpo.steps": 10, "grpo.lr": 3e-4, "grpo.num_generations": 8, "grpo.beta": 0.04},
        ),
    )
    train(cfg)
    records = [m for m in metrics(tmp_path) if m["phase"] == "grpo"]
    rewards = [m["reward"] for m in records]
    assert sum(rewards[-3:]) / 3 > rewards[0] + 0.04, rewards
    for key in ("entropy", "kl", "frac_reward_zero_std", "clip_ratio", "completion_length"):
        assert key in records[0]


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo"])
def test_grpo_loss_types_run(easy_task, tmp_path, loss_type):
    cfg = load_config(
        None, common(easy_task, tmp_path, algorithm="grpo", **{"grpo.steps": 1, "grpo.loss_type": loss_type})
    )
    train(cfg)
    assert metrics(tmp_path)[-1]["phase"] == "grpo"


def test_sequential_grpo_then_es_is_one_run(easy_task, tmp_path):
    cfg = load_config(
        None,
        common(
            easy_task,
            tmp_path,
            algorithm="grpo_es",
            **{"grpo.steps": 2, "es.iterations": 2, "es.population": 4},
        ),
    )
    summary = train(cfg)
    assert [m["phase"] for m in metrics(tmp_path)] == ["base", "grpo", "grpo", "es", "es"]
    assert summary["steps"] == 4


# `fastes train ARGS` that holds once it has written checkpoint STEP (conftest.hold_after_checkpoint)
_HELD_TRAIN = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from conftest import hold_after_checkpoint
from fastes.cli import main
hold_after_checkpoint(int(sys.argv[1]))
sys.exit(main(["train", *sys.argv[2:]]))
"""


def _run_and_kill(args: list[str], checkpoint_dir, kill_after_step: int) -> None:
    """Start `fastes train` in a subprocess and SIGKILL it once checkpoint `kill_after_step` exists."""
    process = subprocess.Popen(
        [sys.executable, "-c", _HELD_TRAIN, str(kill_after_step), *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    target = checkpoint_dir / f"step-{kill_after_step:08d}"
    deadline = time.monotonic() + 300
    while not target.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert target.exists(), "the run ended before reaching the checkpoint it was to be killed after"
    assert not (checkpoint_dir.parent / "final").exists()  # killed, not finished


@pytest.mark.parametrize("algorithm", ["es", "grpo_es"])
def test_killed_run_resumes_to_the_uninterrupted_result(easy_task, tmp_path, algorithm):
    settings = common(
        easy_task,
        tmp_path,
        algorithm=algorithm,
        checkpoint_every=1,
        eval_every=2,
        **{"es.iterations": 4, "es.population": 4, "grpo.steps": 2},
    )
    straight = tmp_path / "straight"
    train(load_config(None, {**settings, "out_dir": str(straight)}))

    crashed = tmp_path / "crashed"
    flags = [f"--{k}={v}" for k, v in {**settings, "out_dir": str(crashed)}.items()]
    _run_and_kill(flags, crashed / "checkpoints", kill_after_step=2)
    train(load_config(None, {**settings, "out_dir": str(crashed)}), resume=True)

    a = load_file(str(straight / "final" / "model.safetensors"))
    b = load_file(str(crashed / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)

    def comparable(records):
        return [{k: v for k, v in r.items() if not is_timing(k)} for r in records]

    assert comparable(metrics(crashed)) == comparable(metrics(straight))


def test_resume_cuts_metrics_back_to_the_checkpoint(easy_task, tmp_path):
    """A crash after metrics lines were written but before their checkpoint: resume redoes those steps."""
    settings = common(easy_task, tmp_path, checkpoint_every=2, **{"es.iterations": 4, "es.population": 4})
    straight = tmp_path / "straight"
    train(load_config(None, {**settings, "out_dir": str(straight)}))
    crashed = tmp_path / "crashed"
    train(load_config(None, {**settings, "out_dir": str(crashed), "es.iterations": 3}))
    # Steps 1-3 are logged, the newest checkpoint is step 2: step 3's line is ahead of it.
    assert [m["global_step"] for m in metrics(crashed)] == [0, 1, 2, 3]
    shutil.rmtree(crashed / "final")
    train(load_config(None, {**settings, "out_dir": str(crashed)}), resume=True)
    a = load_file(str(straight / "final" / "model.safetensors"))
    b = load_file(str(crashed / "final" / "model.safetensors"))
    assert all((a[k] == b[k]).all() for k in a)

    def comparable(records):
        return [{k: v for k, v in r.items() if not is_timing(k)} for r in records]

    assert comparable(metrics(crashed)) == comparable(metrics(straight))


def test_paired_gain_and_its_standard_error():
    assert paired_gain([0, 0, 1, 1], [1, 1, 1, 1]) == (0.5, pytest.approx(0.5 / 2 * (4 / 3) ** 0.5))
    gain, se = paired_gain([0, 1, 0, 1], [0, 1, 0, 1])
    assert gain == 0 and se == 0
    # one problem flipped each way: no gain, a non-zero error
    gain, se = paired_gain([1, 0, 1, 1], [0, 1, 1, 1])
    assert gain == 0 and se > 0


def test_a_built_in_task_draws_as_many_test_problems_as_eval_size_asks_for():
    def split(which: str, **settings) -> list:
        cfg = load_config(None, {"task": "countdown", "prompt_style": "plain", **settings})
        return make_task(cfg).split(which)

    default, larger = split("test"), split("test", eval_size=500)
    assert len(default) == 200 and len(larger) == 500
    assert larger[:200] == default  # the same first problems: test problems are drawn after train ones
    assert split("train", eval_size=500) == split("train")
