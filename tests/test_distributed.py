"""`torchrun --nproc_per_node 2 fastes train ...` on CPU (gloo) runs one job: the same result as one
process (member-mode ES bit for bit, batched ES and data-parallel GRPO to float tolerance), one writer,
and an exact resume."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fastes.config import load_config
from fastes.train import train

TIMING_KEYS = {"seconds", "tokens_per_second"}
# sigma large enough that the members score differently on these easy prompts, so ES moves at all
ES = {"es.iterations": 3, "es.population": 4, "es.sigma": 0.02, "es.lr": 5e-5}
GRPO = {"algorithm": "grpo", "grpo.steps": 2, "grpo.num_generations": 4, "grpo.num_iterations": 2}


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> str:
    """8 training prompts of equal length (so every batch is the whole set), 8 test prompts."""
    from fastes.tasks import get_task

    path = tmp_path_factory.mktemp("task") / "compare.jsonl"
    examples = get_task("compare").split("train")[:8] + get_task("compare").split("test")[:8]
    rows = [
        {"prompt": e.prompt, "answer": e.answer, "verifier": "exact", "split": "train" if i < 8 else "test"}
        for i, e in enumerate(examples)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f"jsonl:{path}"


@pytest.fixture(scope="module")
def two_processes(task, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("torchrun")
    script = Path(__file__).with_name("torchrun_jobs.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    # A session of its own, so that on a timeout the workers are stopped with the launcher.
    launcher = subprocess.Popen(
        [*command, str(script), str(root), task],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        output, _ = launcher.communicate(timeout=400)
    except subprocess.TimeoutExpired:
        os.killpg(launcher.pid, signal.SIGKILL)
        raise
    assert launcher.returncode == 0, output[-4000:]
    return root


def one_process(task, out_dir, **options) -> Path:
    common = {
        "task": task,
        "out_dir": str(out_dir),
        "batch_size": 8,
        "max_new_tokens": 3,
        "eval_size": 8,
        "eval_every": 0,
        "progress": False,
    }
    train(load_config(None, {**common, **options}))
    return out_dir


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "final" / "model.safetensors"))


def metrics(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS} for line in lines]


def test_member_mode_es_equals_one_process_bit_for_bit_with_one_writer(two_processes, task, tmp_path):
    single = one_process(task, tmp_path, **ES, **{"es.eval_mode": "member", "checkpoint_every": 1})
    multi = two_processes / "es_member"
    expected, got = weights(single), weights(multi)
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    assert metrics(multi) == metrics(single)  # written once (not once per rank), and the same
    assert len(metrics(multi)) == 1 + 3
    assert (multi / "curve.png").is_file() and (multi / "summary.json").is_file()
    # and the run really moved: not a vacuous comparison
    from fastes.models import tiny_model_path

    base = load_file(str(tiny_model_path() / "model.safetensors"))
    assert any(not torch.equal(base[k], got[k]) for k in got if k in base)


def test_every_rank_resumes_from_the_same_checkpoint(two_processes):
    full, resumed = two_processes / "es_member", two_processes / "es_member_resumed"
    assert all(torch.equal(v, weights(resumed)[k]) for k, v in weights(full).items())
    assert metrics(resumed) == metrics(full)


def test_a_damaged_checkpoint_stops_every_rank_with_one_message(two_processes):
    for rank in (0, 1):
        assert (two_processes / f"es_member_damaged.rank{rank}.exit").read_text() != "0"
        message = (two_processes / f"es_member_damaged.rank{rank}.stderr").read_text()
        assert "step-00000003" in message and "does not match its checksum" in message, message


def test_batched_es_matches_one_process(two_processes, task, tmp_path):
    single = one_process(task, tmp_path, **ES)
    expected, got = weights(single), weights(two_processes / "es_materialised")
    for k in expected:  # the members' batches differ (2 members per process), so rounding may too
        torch.testing.assert_close(got[k], expected[k], rtol=1e-5, atol=1e-6)
    rewards = [[m.get("reward") for m in metrics(run)] for run in (single, two_processes / "es_materialised")]
    assert rewards[0] == rewards[1]


def test_data_parallel_grpo_matches_one_process(two_processes, task, tmp_path):
    single = one_process(task, tmp_path, **GRPO, checkpoint_every=0)
    expected, got = weights(single), weights(two_processes / "grpo")
    for k in expected:  # gradients summed over two processes: float reduction order only
        torch.testing.assert_close(got[k], expected[k], rtol=1e-4, atol=1e-5)
    from fastes.models import tiny_model_path

    base = load_file(str(tiny_model_path() / "model.safetensors"))
    assert any(not torch.equal(base[k], got[k]) for k in got if k in base)
    one, two = metrics(single), metrics(two_processes / "grpo")
    assert [m.get("reward") for m in two] == [m.get("reward") for m in one]  # the same samples
    for a, b in zip(one[1:], two[1:]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-3, abs=1e-6)
        assert b["entropy"] == pytest.approx(a["entropy"], rel=1e-4)


def test_a_world_size_that_does_not_divide_the_population_is_refused(two_processes):
    for rank in (0, 1):  # every process stops with the same one-line configuration error
        assert (two_processes / f"bad_world.rank{rank}.exit").read_text() == "2"
        message = (two_processes / f"bad_world.rank{rank}.stderr").read_text()
        assert "configuration error: es.population = 3" in message, message
        assert "multiple of the world size 2" in message
    assert not (two_processes / "bad_world" / "metrics.jsonl").exists()  # refused before any work


def test_a_dataset_with_weighted_reward_functions_matches_one_process(two_processes, tmp_path):
    """Each function's rewards/<name>/mean is summed over both processes' members (and the evaluation's
    over both processes' rows): the same records as one process."""
    root = two_processes
    options = {
        **ES,
        "dataset": str(root / "dataset_train.jsonl"),
        "eval_dataset": str(root / "dataset_test.jsonl"),
        "reward": f"{root / 'rewards.py'}:exact,{root / 'rewards.py'}:length",
        "reward_weights": "1,0.5",
    }
    single, multi = metrics(one_process("dataset", tmp_path, **options)), metrics(root / "dataset")
    for one, two in zip(single, multi, strict=True):
        assert one.keys() == two.keys()
        for key in [k for k in one if k.startswith(("rewards/", "test_rewards/", "test_reward"))]:
            assert two[key] == pytest.approx(one[key], abs=1e-12), key
    assert "rewards/length/std" in multi[1] and "test_rewards/exact/mean" in multi[-1]
