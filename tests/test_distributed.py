"""`torchrun --nproc_per_node 2 fastes train ...` on CPU (gloo) runs one job: the same result as one
process (member-mode ES bit for bit, batched ES and data-parallel GRPO to float tolerance), one writer,
and an exact resume."""

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import is_timing
from safetensors.torch import load_file

import fastes
from fastes import cli, distributed
from fastes.run.config import load_config
from fastes.run.train import train

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
    return [{k: v for k, v in json.loads(line).items() if not is_timing(k)} for line in lines]


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
    from fastes.models.loading import tiny_model_path

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
    from fastes.models.loading import tiny_model_path

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


# --- one collective layer for ES and GRPO: the timeout and the weight checksum ------------------------------

FORK = multiprocessing.get_context("fork")


def _join_group(rank: int, init_file: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    # The process group's own timeout is long: the collective timeout is what must bound every wait.
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )


def _grpo_rank(rank: int, init_file: str, task: str, out: str) -> None:
    """One rank of a two-process GRPO run through the command line; rank 1 stops answering in step 1."""
    _join_group(rank, init_file)
    if rank == 1:

        def hang(*args, **kwargs) -> None:  # the other rank waits for these gradients
            Path(out, "hang.started").write_text(str(time.monotonic()))
            time.sleep(120)

        distributed.sum_gradients = hang
    sys.stderr = open(Path(out, f"rank{rank}.stderr"), "w")  # noqa: SIM115 - the CLI ends the process
    code = cli.main(
        ["train", "--task", task, "--out_dir", str(Path(out, "run")), "--batch_size", "8",
         "--max_new_tokens", "3", "--eval_size", "8", "--eval_every", "0", "--progress", "false",
         "--algorithm", "grpo", "--grpo.steps", "2", "--grpo.num_generations", "4",
         "--collective_timeout", "3"]
    )  # fmt: skip
    sys.stderr.flush()
    os._exit(code)


def test_a_hung_grpo_peer_ends_the_run_with_the_one_line_collective_error(task, tmp_path):
    """GRPO's collectives take the same timeout (collective_timeout) and raise the same CollectiveError
    as ES's: the waiting rank prints one line and exits within the timeout instead of hanging."""
    ranks = [
        FORK.Process(target=_grpo_rank, args=(r, str(tmp_path / "init"), task, str(tmp_path))) for r in (0, 1)
    ]
    for p in ranks:
        p.start()
    ranks[0].join(120)
    ended = time.monotonic()
    try:
        assert ranks[0].exitcode is not None, "rank 0 did not end within 120 s"
        assert ranks[1].is_alive(), "the hung rank should still be hanging"
    finally:
        for p in ranks:
            p.kill()
            p.join()
    lines = [line for line in (tmp_path / "rank0.stderr").read_text().splitlines() if line.strip()]
    assert ranks[0].exitcode == 1, lines
    expected = "fastes: GRPO step 0, rank 0 of 2: the all-reduce of the gradients failed: "
    assert lines[-1].startswith(expected), lines
    assert "another process died or did not answer within 3 s" in lines[-1]
    assert lines[-1].endswith("stop every process and resume from the last checkpoint")
    hung_at = float((tmp_path / "hang.started").read_text())
    assert ended - hung_at < 30  # the 3 s timeout, well within the process group's own 60 s


def _diverged_rank(rank: int, init_file: str, out: str) -> None:
    """Rank 1 holds other weights: ES's check and GRPO's check both see it, through one checksum."""
    _join_group(rank, init_file)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    if rank == 1:
        with torch.no_grad():
            net[0].weight[0, 0] += 1.0
    calls = []
    one_checksum = distributed.weights_checksum

    def counted(tensors):
        calls.append(1)
        return one_checksum(tensors)

    distributed.weights_checksum = counted
    errors = []
    es = fastes.ES(fastes.linear_weights(net), sigma=0.1, lr=0.1, population=4, timeout=10.0)
    for check in (
        es.verify_ranks_agree,  # what ES.step runs every checksum_every generations
        lambda: distributed.check_same_weights(net.parameters(), "GRPO step 10"),  # what GRPO runs
    ):
        try:
            check()
            errors.append(None)
        except RuntimeError as error:
            errors.append(str(error))
    Path(out, f"rank{rank}.json").write_text(json.dumps({"errors": errors, "calls": len(calls)}))
    os._exit(0)


def test_es_and_grpo_detect_diverged_weights_with_the_one_checksum(tmp_path):
    net = torch.nn.Linear(3, 4)
    es = fastes.ES(fastes.linear_weights(net), sigma=0.1, lr=0.1, population=2)
    assert es.checksum() == distributed.weights_checksum([net.weight])
    ranks = [
        FORK.Process(target=_diverged_rank, args=(r, str(tmp_path / "init"), str(tmp_path))) for r in (0, 1)
    ]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(60)
        if p.is_alive():
            p.kill()
            p.join()
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["calls"] == 2  # one weights_checksum call per check
        es_error, grpo_error = result["errors"]
        assert es_error.startswith("weights diverged across processes at ES generation 0: checksums [")
        assert "evaluate with the same seed" in es_error
        assert grpo_error.startswith("weights diverged across processes at GRPO step 10: checksums [")
