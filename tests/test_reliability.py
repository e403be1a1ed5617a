"""Reliability and security: faults survived, bad input refused with a clear message, nothing lost.

docs/reliability.md is the index: every fault and bad input tried, the behaviour that is defined for it,
and the test (here or elsewhere in tests/) that checks it.
"""

from __future__ import annotations

import datetime
import gc
import json
import math
import multiprocessing
import os
import pickle
import random
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import is_timing

import fastes
from fastes.checkpoint import latest_checkpoint, save_checkpoint
from fastes.errors import ConfigError
from fastes.es.population import PopulationLinear, population_batched
from fastes.models.loading import build_tiny_model, build_tokenizer, load_model, save_model, tiny_model_path
from fastes.run.config import load_config
from fastes.tasks import JsonlTaskError, get_task

# Forked children inherit the imported modules: a run starts in milliseconds instead of the ~10 s that
# importing torch and transformers takes on this machine.
FORK = multiprocessing.get_context("fork")


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit pattern, so -0.0 vs 0.0 and NaN payloads count as differences too."""
    return t.detach().view({4: torch.int32, 2: torch.int16}[t.element_size()]).clone()


# --- crash safety: SIGKILL at random moments ---------------------------------------------------------


@pytest.fixture(scope="module")
def easy_task(tmp_path_factory) -> str:
    """24 fixed 'compare' problems for training, 8 for test (the idea of tests/test_train.py's fixture)."""
    path = tmp_path_factory.mktemp("task") / "compare.jsonl"
    task = get_task("compare")
    rows = [
        {"prompt": e.prompt, "answer": e.answer, "verifier": "exact", "split": "train"}
        for e in task.split("train")[:24]
    ]
    rows += [
        {"prompt": e.prompt, "answer": e.answer, "verifier": "exact", "split": "test"}
        for e in task.split("test")[:8]
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f"jsonl:{path}"


def run_settings(task: str, out_dir: Path) -> dict:
    """GRPO then ES (two phases, optimizer state, phase-boundary checkpoint), tiny and fast."""
    return {
        "algorithm": "grpo_es",
        "task": task,
        "out_dir": str(out_dir),
        "batch_size": 8,
        "max_new_tokens": 3,
        "eval_size": 8,
        "eval_every": 2,
        "checkpoint_every": 3,
        "progress": False,
        "grpo.steps": 4,
        "grpo.num_generations": 4,
        "es.iterations": 6,
        "es.population": 4,
    }


def _train_in_child(settings: dict, resume: bool) -> None:
    from fastes.run.train import train

    torch.set_num_threads(1)
    train(load_config(None, settings), resume=resume)


def metrics(out_dir: Path) -> list[dict]:
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if not is_timing(k)} for line in lines]


def final_weights(out_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(out_dir / "final" / "model.safetensors"))


@pytest.fixture(scope="module")
def straight_run(easy_task, tmp_path_factory):
    """One uninterrupted run, started from an empty working directory; (out_dir, seconds, cwd)."""
    root = tmp_path_factory.mktemp("straight")
    cwd = root / "cwd"
    cwd.mkdir()
    out_dir = root / "run"
    before = os.getcwd()
    os.chdir(cwd)
    try:
        start = time.perf_counter()
        child = FORK.Process(target=_train_in_child, args=(run_settings(easy_task, out_dir), False))
        child.start()
        child.join(300)
        seconds = time.perf_counter() - start
    finally:
        os.chdir(before)
    assert child.exitcode == 0
    return out_dir, seconds, cwd


KILLS = 5
MAX_KILLS = KILLS


def _last_logged_step(out_dir: Path) -> int:
    """The global step of the last complete metrics line (what a resume must cut back to its checkpoint)."""
    last = -1
    path = out_dir / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            last = json.loads(line)["global_step"]
        except json.JSONDecodeError:
            break
    return last


def test_sigkill_at_random_moments_then_resume_equals_the_uninterrupted_run(
    easy_task, straight_run, tmp_path
):
    """SIGKILLs at seeded random moments (mid-generation, mid-eval, mid-checkpoint, between a metrics line
    and its checkpoint: wherever they land), each followed by --resume, end with the uninterrupted run's
    weights and metrics, bit for bit."""
    straight, seconds, _ = straight_run
    settings = run_settings(easy_task, tmp_path / "crashed")
    out_dir = Path(settings["out_dir"])
    total_steps = settings["grpo.steps"] + settings["es.iterations"]
    rng = random.Random(20240611)
    resumed_from: list[int] = []  # the checkpoint step each resume starts from (0: none yet)
    kills = ahead = 0  # ahead: kills that left metrics lines newer than the newest checkpoint
    finished = False
    for _attempt in range(4 * MAX_KILLS):
        done = resumed_from[-1] if resumed_from else 0
        # A random moment within what is left of the run (its duration measured on the straight run).
        delay = rng.uniform(0.05, 0.9) * seconds * (total_steps - done + 1) / (total_steps + 1)
        # A kill during model loading leaves nothing to resume (the run starts writing after its checks).
        resume = (out_dir / "run.json").is_file()
        child = FORK.Process(target=_train_in_child, args=(settings, resume))
        child.start()
        child.join(delay)
        if child.exitcode is not None:  # the run finished before the kill
            assert child.exitcode == 0
            if kills >= KILLS:
                finished = True
                break
            shutil.rmtree(out_dir)  # start over, drawing new moments
            kills = ahead = 0
            resumed_from = []
            continue
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        kills += 1
        found = latest_checkpoint(out_dir)
        resumed_from.append(found[0] if found else 0)
        ahead += _last_logged_step(out_dir) > resumed_from[-1]
        if kills >= KILLS:
            break
    # Where a kill lands is wall-clock luck; the metrics-ahead-of-checkpoint case is also pinned
    # deterministically in tests/test_train.py::test_resume_cuts_metrics_back_to_the_checkpoint.
    assert kills >= KILLS, f"only {kills} kills landed before the run finished"
    if not finished:
        _train_in_child(settings, resume=True)

    a, b = final_weights(straight), final_weights(out_dir)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert metrics(out_dir) == metrics(straight)
    print(f"{kills} kills ({ahead} with metrics ahead); resumed from checkpoint steps {resumed_from}")


def test_a_run_writes_only_under_its_out_dir(straight_run):
    out_dir, _, cwd = straight_run
    assert list(cwd.iterdir()) == []  # nothing in the working directory
    assert sorted(p.name for p in out_dir.parent.iterdir()) == ["cwd", "run"]
    names = {p.relative_to(out_dir).parts[0] for p in out_dir.rglob("*")}
    expected = {"checkpoints", "config.json", "final", "metrics.jsonl", "run.json", "summary.json"}
    assert names == expected | {"base_test.json"}
    assert not any(p.name.startswith((".tmp-", ".trash-")) for p in out_dir.rglob("*"))


def test_a_metrics_line_cut_short_by_a_crash_is_found(tmp_path):
    """read_metrics stops at the first damaged line and says which (a resume then rewrites the file from
    its checkpoint: tests/test_runs.py)."""
    from fastes.run.rundir import read_metrics

    lines = [json.dumps({"global_step": i, "reward": 0.5}) for i in range(3)]
    (tmp_path / "metrics.jsonl").write_text(lines[0] + "\n" + lines[1] + "\n" + lines[2][:9])
    records, problem = read_metrics(tmp_path)
    assert [m["global_step"] for m in records] == [0, 1] and problem == "line 3 is damaged"
    (tmp_path / "metrics.jsonl").write_text(lines[0] + "\n" + lines[1][:5] + "\n" + lines[2] + "\n")
    assert read_metrics(tmp_path) == ([json.loads(lines[0])], "line 2 is damaged")


def test_a_fresh_run_over_an_old_one_never_resumes_the_old_ones_checkpoints(tmp_path):
    """Checkpoints of later steps belong to a replaced run: they are dropped when the new run saves, so
    --resume continues the new run (before the fix the old step-6 outranked the new step-1 and the new
    run's own checkpoints were the ones deleted)."""
    for step in (5, 6):
        save_checkpoint(tmp_path, step, {"w": torch.full((2,), float(step))}, {"run": "old"})
    save_checkpoint(tmp_path, 1, {"w": torch.zeros(2)}, {"run": "new"})
    step, tensors, state = latest_checkpoint(tmp_path)
    assert (step, state) == (1, {"run": "new"}) and torch.equal(tensors["w"], torch.zeros(2))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000001"]


def test_a_crash_while_replacing_a_checkpoint_never_leaves_a_half_deleted_one(tmp_path, monkeypatch):
    """Re-saving the same step (a phase boundary) deletes the old directory; a crash halfway through
    that deletion must leave either checkpoint, never a damaged newest one that blocks --resume."""
    save_checkpoint(tmp_path, 1, {"w": torch.zeros(2)}, {"n": 1})
    save_checkpoint(tmp_path, 2, {"w": torch.ones(2)}, {"n": 2})
    real_rmtree = shutil.rmtree

    def crash_halfway(path, *args, **kwargs):
        path = Path(path)
        if (path / "state.json").is_file():  # delete one file of the checkpoint, then die
            (path / "state.json").unlink()
            raise KeyboardInterrupt("killed")
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr("fastes.checkpoint.shutil.rmtree", crash_halfway)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 2, {"w": torch.full((2,), 2.0)}, {"n": 3})
    monkeypatch.undo()
    step, _, state = latest_checkpoint(tmp_path)  # no CheckpointError
    assert (step, state) == (1, {"n": 1})


def test_checkpoint_steps_cannot_name_other_paths(tmp_path):
    for step in (-1, "../../x", 1.5, True):
        with pytest.raises(ValueError, match="non-negative integer"):
            save_checkpoint(tmp_path, step, {"w": torch.zeros(1)}, {})
    (tmp_path / "checkpoints" / "step-evil").mkdir(
        parents=True
    )  # names that are not step-<digits> are ignored
    assert latest_checkpoint(tmp_path) is None


# --- exactness under load ------------------------------------------------------------------------------

CYCLES = int(os.environ.get("FASTES_RELIABILITY_CYCLES", "10000"))


def mixed_dtype_model() -> torch.nn.Module:
    """Three linear layers in fp32, bf16 and fp16 (ES evolves them in one group: one noise call for all),
    their weights seeded with -0.0, subnormals and large values as well as ordinary ones."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(5, 7).float(), torch.nn.Linear(7, 3).bfloat16(), torch.nn.Linear(3, 4).half()
    )
    with torch.no_grad():
        for layer in model:
            flat = layer.weight.view(-1)
            tiny = torch.finfo(layer.weight.dtype).tiny
            flat[:4] = torch.tensor([-0.0, tiny / 4, -tiny, 1000.0])
    return model


def test_ten_thousand_member_cycles_restore_every_dtype_bit_for_bit():
    """10,000 members entered and exited (every 7th raising inside): each exit leaves the fp32, bf16 and
    fp16 weights in their own storage with their exact bits."""
    model = mixed_dtype_model()
    before = {name: bits(p) for name, p in model.named_parameters()}
    pointers = {name: p.data_ptr() for name, p in model.named_parameters()}
    es = fastes.ES(
        fastes.linear_weights(model), sigma=0.5, lr=0.0, population=CYCLES, seed=3, backend="torch"
    )
    for cycle, member in enumerate(es.members()):
        try:
            with member:
                if cycle % 97 == 0:  # the perturbation really is applied ...
                    assert not torch.equal(bits(model[0].weight), before["0.weight"])
                if cycle % 7 == 0:  # ... and the exit restores even when the body raises
                    raise RuntimeError("evaluation failed")
        except RuntimeError:
            pass
        for name, p in model.named_parameters():
            assert p.data_ptr() == pointers[name], f"cycle {cycle}: {name} storage changed"
            assert torch.equal(bits(p), before[name]), f"cycle {cycle}: {name} changed"
    assert cycle + 1 == CYCLES


def test_batched_enter_exit_cycles_restore_every_dtype_bit_for_bit():
    """10,000 population_batched enter/exits (two member perturbations each), every exit putting the
    original nn.Linear modules back with untouched weights, also when the body raises."""
    model = mixed_dtype_model()
    before = {name: bits(p) for name, p in model.named_parameters()}
    modules = list(model)
    es = fastes.ES(fastes.linear_weights(model), sigma=0.5, lr=0.0, population=2, seed=4, backend="torch")
    for cycle in range(CYCLES):
        try:
            with population_batched(es, model):
                if cycle % 97 == 0:
                    swapped = model[1]
                    assert isinstance(swapped, PopulationLinear)
                    assert not torch.equal(bits(swapped.weights[0]), before["1.weight"])
                if cycle % 7 == 0:
                    raise RuntimeError("generation failed")
        except RuntimeError:
            pass
        assert list(model) == modules, f"cycle {cycle}: modules not put back"
        for name, p in model.named_parameters():
            assert torch.equal(bits(p), before[name]), f"cycle {cycle}: {name} changed"


@pytest.mark.parametrize("mode", ["member", "lowrank"])
def test_low_rank_noise_restores_bit_for_bit_too(mode):
    """noise_type="lowrank" (300 cycles: its noise costs two Philox calls per matrix) in member mode
    and in population_batched(mode='lowrank'), which never materialises a perturbed weight."""
    model = mixed_dtype_model()
    before = {name: bits(p) for name, p in model.named_parameters()}
    es = fastes.ES(
        fastes.linear_weights(model), sigma=0.5, lr=0.0, population=2, seed=5, noise_type="lowrank", rank=2
    )
    for cycle in range(300):
        if mode == "member":
            for member in es.members():
                with member:
                    if cycle == 0:
                        assert not torch.equal(bits(model[2].weight), before["2.weight"])
        else:
            with population_batched(es, model, mode="lowrank"):
                assert not isinstance(model[0], torch.nn.Linear)
        for name, p in model.named_parameters():
            assert torch.equal(bits(p), before[name]), f"cycle {cycle}: {name} changed"


def _rss_bytes() -> int:
    gc.collect()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux /proc")
def test_long_runs_hold_no_growing_memory():
    """160 generations after a warm-up, alternating member-by-member and population-batched evaluation:
    resident memory grows by less than a fifth of what keeping one work buffer per generation would."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 64))
    x = torch.randn(16, 64)
    es = fastes.ES(fastes.linear_weights(model), sigma=0.01, lr=0.01, population=4, backend="torch")

    def generation(i: int) -> None:
        if i % 2:
            es.step(lambda: -model(x).pow(2).mean().item())
            return
        with torch.no_grad(), population_batched(es, model) as members:
            out = model(x.repeat(len(members), 1)).view(len(members), len(x), -1)
        es.step(-out.pow(2).mean(dim=(1, 2)).double())

    for i in range(20):
        generation(i)
    start = _rss_bytes()
    generations = 160
    for i in range(generations):
        generation(i)
    growth = _rss_bytes() - start
    leak_per_generation = sum(p.numel() * p.element_size() for _, p in fastes.linear_weights(model))
    bound = 8 * 2**20
    assert bound < leak_per_generation * generations / 2  # a one-buffer-per-generation leak would fail
    assert growth < bound, f"RSS grew by {growth / 2**20:.1f} MiB over {generations} generations"


# --- bad input: a table of cases -------------------------------------------------------------------------
# Each case is (input, expected exception and message) or a defined non-error behaviour. Cases already
# tested elsewhere are listed in docs/reliability.md with the test that covers them, not repeated here.


def _config_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


CONFIG_CASES = [
    ("toml nan", "[es]\nsigma = nan\n", {}, "es.sigma: must be a finite number, got nan"),
    ("toml inf lr", "[grpo]\nlr = inf\n", {}, "grpo.lr: must be a finite number, got inf"),
    ("toml -inf weight", "format_weight = -inf\n", {}, "format_weight: must be a finite number"),
    ("unknown section", "[ess]\nsigma = 0.1\n", {}, "unknown config key 'ess'"),
    ("string for a table", 'es = "fast"\n', {}, "es must be a table"),
    ("float for int", "", {"es.population": 4.0}, "es.population must be int, got float 4.0"),
    ("string for float", "", {"grpo.lr": "1e-3"}, "grpo.lr must be float, got str"),
    (
        "negative weight decay",
        "",
        {"es.weight_decay": -0.1},
        "es.weight_decay: must be a non-negative finite number",
    ),
    ("grpo weight decay", "", {"grpo.weight_decay": -1.0}, "grpo.weight_decay: must be >= 0"),
    ("negative seed", "", {"seed": -1}, r"seed: must be in \[0, 2\^32\)"),
    ("huge seed", "", {"seed": 2**64}, r"seed: must be in \[0, 2\^32\)"),
    ("negative eval_every", "", {"eval_every": -1}, "eval_every: must be >= 0"),
    ("top_p above 1", "", {"grpo.top_p": 1.5}, r"grpo.top_p: must be in \(0, 1\]"),
    ("epsilon 1", "", {"grpo.epsilon": 1.0}, r"grpo.epsilon: must be in \[0, 1\)"),
    ("jsonl without a path", "", {"task": "jsonl:"}, "task: 'jsonl:' does not exist"),
    ("built-in task, bad option", "", {"task": "countdown:x"}, "task: task option 'x' is not key=value"),
    ("empty out_dir", "", {"out_dir": ""}, "out_dir: must name a run directory"),
    ("NUL in out_dir", "", {"out_dir": "runs/a\x00b"}, "out_dir: contains a NUL byte"),
    ("unknown device", "", {"device": "tpu"}, "device: 'tpu' is not a torch device"),
    ("eval mode", "", {"es.eval_mode": "fast"}, "es.eval_mode: 'fast' is not one of"),
]


@pytest.mark.parametrize(
    "text, overrides, message", [c[1:] for c in CONFIG_CASES], ids=[c[0] for c in CONFIG_CASES]
)
def test_bad_config_values_name_the_key(tmp_path, text, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(_config_file(tmp_path, text) if text else None, overrides)


def test_out_dir_must_not_be_a_file_or_the_starting_model(tmp_path):
    afile = tmp_path / "notes.txt"
    afile.write_text("keep me")
    with pytest.raises(ConfigError, match="exists and is not a directory"):
        load_config(None, {"out_dir": str(afile)})
    model = tmp_path / "model"
    save_model(build_tiny_model(), build_tokenizer(), model)
    with pytest.raises(ConfigError, match="would overwrite the model directory"):
        load_config(None, {"model": str(model), "out_dir": str(model)})  # config.json would be replaced
    shutil.copytree(model, tmp_path / "run" / "final")  # a finished run's model, trained on further
    with pytest.raises(ConfigError, match="would overwrite the model directory"):
        load_config(None, {"model": str(tmp_path / "run" / "final"), "out_dir": str(tmp_path / "run")})
    with pytest.raises(ConfigError, match="would overwrite the model directory"):
        load_config(None, {"out_dir": str(tiny_model_path())})  # the built-in model is the default
    # A path that walks up is the user's own choice of directory and is accepted as such.
    assert load_config(None, {"out_dir": str(tmp_path / "a" / ".." / "b")}).out_dir.endswith("b")
    assert afile.read_text() == "keep me"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_device_without_cuda_is_refused_at_once():
    with pytest.raises(ConfigError, match="torch sees no CUDA device"):
        load_config(None, {"device": "cuda"})


def make_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


NAN, INF = float("nan"), float("inf")


def f64(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


REWARD_CASES = [
    # (id, shaping, rewards for a population of 4, exception, message)
    ("-inf", "centered_rank", f64([1.0, -INF, 0.0, 0.5]), ValueError, r"non-finite reward for members \[1\]"),
    ("nan per prompt", "group_zscore", f64([[1, 2], [NAN, 1], [0, 0], [1, 1]]), ValueError, "non-finite"),
    ("one too many", "centered_rank", f64([1.0] * 5), ValueError, r"expected rewards for 4 members.*\(5,\)"),
    ("rows wrong", "group_zscore", f64([[1.0, 2.0]] * 3), ValueError, r"expected rewards for 4.*\(3, 2\)"),
    ("three dims", "zscore", torch.ones(4, 2, 2), ValueError, r"expected rewards.*\(4, 2, 2\)"),
    ("scalar", "raw", 1.0, ValueError, r"expected rewards.*got shape \(\)"),
    ("no prompts", "centered_rank", torch.ones(4, 0), ValueError, "with at least one prompt"),
    ("empty", "centered_rank", [], ValueError, r"got shape \(0,\)"),
    ("1-D for group_zscore", "group_zscore", f64([1.0, 2.0, 3.0, 4.0]), ValueError, r"\[members, prompts\]"),
    ("strings", "centered_rank", ["a", "b", "c", "d"], (TypeError, ValueError), None),
    ("None", "centered_rank", None, (TypeError, ValueError), None),
    ("z-score overflow", "zscore", f64([1e308, 1e308, -1e308, -1e308]), ValueError, "rewards overflow"),
]


@pytest.mark.parametrize(
    "shaping, rewards, error, message", [c[1:] for c in REWARD_CASES], ids=[c[0] for c in REWARD_CASES]
)
def test_bad_rewards_raise_and_leave_the_weights_and_generation_alone(shaping, rewards, error, message):
    net = make_net()
    before = {k: bits(v) for k, v in net.state_dict().items()}
    es = fastes.ES(fastes.linear_weights(net), sigma=0.1, lr=0.1, population=4, shaping=shaping)
    with pytest.raises(error, match=message):
        es.step(rewards)
    assert es.generation == 0 and es.history == []
    assert all(torch.equal(bits(v), before[k]) for k, v in net.state_dict().items())


@pytest.mark.parametrize("shaping", ["centered_rank", "zscore", "group_zscore"])
def test_defined_reward_behaviours(shaping):
    """Huge-but-finite rewards rank fine; bool and int rewards are numbers; all-equal (tests/test_es.py)
    gives no update."""
    net = make_net()
    es = fastes.ES(fastes.linear_weights(net), sigma=0.1, lr=0.1, population=4, shaping=shaping)
    ints = torch.tensor([[1, 0], [0, 1], [1, 1], [0, 0]])
    assert torch.equal(es.step(ints), ints.double())
    assert es.generation == 1
    if shaping == "centered_rank":
        es.step(torch.tensor([1e308, 1e308, -1e308, -1e308], dtype=torch.float64))
        assert all(math.isfinite(w) for w in es.history[-1]["weights"])


def test_a_reward_closure_that_returns_nonsense_restores_the_weights():
    net = make_net()
    before = {k: bits(v) for k, v in net.state_dict().items()}
    es = fastes.ES(fastes.linear_weights(net), sigma=0.1, lr=0.1, population=4)
    for bad in (lambda: "high", lambda: None, lambda: float("nan")):
        with pytest.raises((TypeError, ValueError)):
            es.step(bad)
        assert all(torch.equal(bits(v), before[k]) for k, v in net.state_dict().items())
    assert es.generation == 0


TENSOR_CASES = [
    (
        "meta next to cpu",
        [torch.zeros(3), torch.zeros(3, device="meta")],
        ValueError,
        r"several devices \['cpu', 'meta'\]",
    ),
    ("float64", [torch.zeros(3, dtype=torch.float64)], TypeError, "dtype torch.float64; supported"),
    ("int32", [torch.zeros(3, dtype=torch.int32)], TypeError, "dtype torch.int32; supported"),
    ("float8", [torch.zeros(3, dtype=torch.float8_e4m3fn)], TypeError, "float8_e4m3fn; supported"),
    ("not contiguous", [torch.zeros(3, 4).T], ValueError, "not contiguous"),
    ("not a tensor", [[1.0, 2.0]], TypeError, "is a list, not a tensor"),
]


@pytest.mark.parametrize(
    "tensors, error, message", [c[1:] for c in TENSOR_CASES], ids=[c[0] for c in TENSOR_CASES]
)
def test_unsupported_parameters_are_refused_when_the_es_is_built(tensors, error, message):
    with pytest.raises(error, match=message):
        fastes.ES([(f"t{i}", t) for i, t in enumerate(tensors)], sigma=0.1, lr=0.1, population=2)


def test_model_level_bad_inputs():
    with pytest.raises(ValueError, match="has no projection weights to evolve"):
        fastes.linear_weights(torch.nn.Sequential(torch.nn.Tanh(), torch.nn.LayerNorm(4)))
    half_meta = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2, device="meta"))
    with pytest.raises(ValueError, match="several devices"):
        fastes.ES(fastes.linear_weights(half_meta), sigma=0.1, lr=0.1, population=2)
    # Defined: ES evolves finite weights only; NaN weights are refused before the first member and kept.
    nan = torch.full((4,), float("nan"))
    es = fastes.ES([("w", nan)], sigma=0.1, lr=0.0, population=2)
    with pytest.raises(fastes.errors.NonFiniteUpdateError, match="'w' are already NaN or inf"):
        next(es.members())
    assert torch.isnan(nan).all()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    shutil.copytree(tiny_model_path(), path, dirs_exist_ok=True)
    return path


def _copy(tiny_dir: Path, to: Path) -> Path:
    shutil.copytree(tiny_dir, to)
    return to


def test_damaged_model_files_get_errors_naming_the_directory(tiny_dir, tmp_path):
    truncated = _copy(tiny_dir, tmp_path / "truncated")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=f"{truncated}: the safetensors weights cannot be read"):
        load_model(truncated)
    elsewhere = _copy(tiny_dir, tmp_path / "symlinked")  # weights that are a link to some other file
    (elsewhere / "model.safetensors").unlink()
    (elsewhere / "model.safetensors").symlink_to(tmp_path / "truncated" / "config.json")
    with pytest.raises(ValueError, match="cannot be read"):
        load_model(elsewhere)
    broken = _copy(tiny_dir, tmp_path / "broken")
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config.json is not valid JSON \(Expecting property name"):
        load_model(broken)
    no_tokenizer = _copy(tiny_dir, tmp_path / "no_tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (no_tokenizer / name).unlink()
    with pytest.raises((OSError, ValueError)):
        load_model(no_tokenizer)


def test_a_float64_checkpoint_is_refused_by_es_with_a_clear_dtype_error(tiny_dir, tmp_path):
    model, tokenizer = load_model(tiny_dir)
    save_model(model.to(torch.float64), tokenizer, tmp_path / "f64")
    loaded, _ = load_model(tmp_path / "f64")  # dtype=None keeps the checkpoint's own dtype
    with pytest.raises(TypeError, match="dtype torch.float64; supported"):
        fastes.ES(fastes.linear_weights(loaded), sigma=0.1, lr=0.1, population=2)


def _write_jsonl(path: Path, text: str) -> str:
    path.write_text(text)
    return f"jsonl:{path}"


GOOD_LINE = '{"prompt": "1+1=", "answer": "2", "verifier": "numeric"}\n'
TASK_CASES = [
    ("byte order mark", "\ufeff" + GOOD_LINE, JsonlTaskError, "malformed JSON .*BOM"),
    (
        "NaN numeric answer",
        '{"prompt": "a", "answer": NaN, "verifier": "numeric"}\n',
        JsonlTaskError,
        "'nan' is not a number",
    ),
    (
        "1e400 answer",
        '{"prompt": "a", "answer": 1e400, "verifier": "numeric"}\n',
        JsonlTaskError,
        "'inf' is not a number",
    ),
    ("a bare number line", "42\n", JsonlTaskError, "expected a JSON object"),
    ("two objects on a line", GOOD_LINE.strip() + GOOD_LINE, JsonlTaskError, "malformed JSON"),
    ("truncated line", GOOD_LINE[:20], JsonlTaskError, "malformed JSON"),
    ("NUL byte in JSON", GOOD_LINE.replace("1+1", "1\x001"), JsonlTaskError, "malformed JSON"),
    (
        "huge countdown numbers",
        '{"prompt": "a", "answer": "24", "verifier": "countdown", "numbers": [999999, 999998]}\n',
        JsonlTaskError,
        "no expression of",
    ),
]


@pytest.mark.parametrize("text, error, message", [c[1:] for c in TASK_CASES], ids=[c[0] for c in TASK_CASES])
def test_bad_task_files_name_the_line(tmp_path, text, error, message):
    with pytest.raises(error, match=message):
        get_task(_write_jsonl(tmp_path / "task.jsonl", text))


def test_task_paths_that_are_not_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found or not a file"):
        get_task(f"jsonl:{tmp_path}")  # a directory
    with pytest.raises(ValueError, match="unknown task 'jsonl:'"):
        get_task("jsonl:")


def test_defined_task_behaviours(tmp_path):
    # NaN in an "exact" answer is the text "nan"; a test-only file has an empty train split.
    task = get_task(
        _write_jsonl(tmp_path / "a.jsonl", '{"prompt": "a", "answer": NaN, "verifier": "exact"}\n')
    )
    assert task.split("train")[0].answer == "nan"
    only_test = GOOD_LINE.replace("}", ', "split": "test"}')
    assert get_task(_write_jsonl(tmp_path / "b.jsonl", only_test)).split("train") == []


@pytest.mark.parametrize(
    "text",
    [
        "[" * 100_000 + "]" * 100_000 + "\n",  # RecursionError from json.loads
        '{"prompt": "a", "answer": ' + "9" * 5000 + ', "verifier": "numeric"}\n',  # int digits limit
    ],
    ids=["deep nesting", "5000-digit number"],
)
def test_hostile_task_lines_get_a_task_error(tmp_path, text):
    """Hostile lines raise the task error naming the file and line, not a bare RecursionError/ValueError."""
    with pytest.raises(JsonlTaskError, match=r"task\.jsonl:1: unreadable JSON"):
        get_task(_write_jsonl(tmp_path / "task.jsonl", text))


# --- untrusted files ---------------------------------------------------------------------------------


def _refuse(*args, **kwargs):
    raise AssertionError("pickle-based loading was called")


def test_loading_never_unpickles(tiny_dir, tmp_path, monkeypatch):
    """A directory with both pytorch_model.bin and model.safetensors loads the safetensors; torch.load
    and pickle are never called, neither for the model nor for resuming a checkpoint."""
    both = _copy(tiny_dir, tmp_path / "both")
    torch.save({"not": torch.zeros(1)}, both / "pytorch_model.bin")
    save_checkpoint(tmp_path / "run", 1, {"model.w": torch.ones(2)}, {"step": 1})
    for target in ("torch.load", "torch.serialization.load", "pickle.load", "pickle.loads"):
        monkeypatch.setattr(target, _refuse)
    model, _ = load_model(both)
    assert model.config.model_type == "llama"
    step, tensors, _ = latest_checkpoint(tmp_path / "run")
    assert step == 1 and torch.equal(tensors["model.w"], torch.ones(2))
    assert pickle.loads is _refuse  # the patch was in force


@pytest.mark.parametrize("model_type", ["llama", "evil_llama"])
def test_custom_code_in_a_checkpoint_is_never_run(tiny_dir, tmp_path, model_type):
    """config.json / tokenizer_config.json with auto_map pointing at a module in the directory: without
    trust_remote_code the module is never imported. A known model_type loads the library's own class; an
    unknown one is refused."""
    evil = _copy(tiny_dir, tmp_path / "evil")
    marker = tmp_path / "code-ran"
    (evil / "evil.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        "from transformers import LlamaConfig as EvilConfig, LlamaForCausalLM as EvilModel\n"
    )
    config = json.loads((evil / "config.json").read_text())
    config["model_type"] = model_type
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}
    (evil / "config.json").write_text(json.dumps(config))
    tokenizer_config = json.loads((evil / "tokenizer_config.json").read_text())
    tokenizer_config["auto_map"] = {"AutoTokenizer": ["evil.EvilModel", None]}
    (evil / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if model_type == "llama":
        model, _ = load_model(evil)
        assert type(model).__module__.startswith("transformers.")
    else:
        with pytest.raises((ValueError, OSError, KeyError)):
            load_model(evil)
    assert not marker.exists()


# --- multi-process faults ------------------------------------------------------------------------------


def _rank_worker(rank: int, fault: str, init_file: str, result_file: str) -> None:
    """Two-process ES on gloo. Rank 1 misbehaves in generation 2: `die` exits, `hang` stops answering."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    # The process group's own timeout is long; the ES timeout (3 s) is what must bound the wait.
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=60),
    )
    net = make_net()
    es = fastes.ES(
        fastes.linear_weights(net), sigma=0.1, lr=0.1, population=4, seed=1, checksum_every=1, timeout=3.0
    )

    def reward() -> float:
        if rank == 1 and es.generation == 2:
            if fault == "die":
                os._exit(0)
            time.sleep(120)
        return -net(torch.ones(1, 3)).pow(2).sum().item()

    try:
        for _ in range(5):
            es.step(reward)
        outcome = {"error": None}
    except RuntimeError as error:
        outcome = {"error": str(error), "generation": es.generation}
    outcome["at"] = time.monotonic()
    Path(result_file).write_text(json.dumps(outcome))
    os._exit(0)  # no destroy_process_group: the peer is gone


@pytest.mark.parametrize("fault", ["die", "hang"])
def test_a_rank_that_dies_or_hangs_makes_the_others_fail_fast(tmp_path, fault):
    result = tmp_path / "rank0.json"
    ranks = [
        FORK.Process(target=_rank_worker, args=(r, fault, str(tmp_path / "init"), str(result)))
        for r in range(2)
    ]
    started = time.monotonic()
    for p in ranks:
        p.start()
    ranks[0].join(60)
    for p in ranks:
        if p.is_alive():
            p.kill()
        p.join()
    assert result.is_file(), "rank 0 neither finished nor raised within 60 s"
    outcome = json.loads(result.read_text())
    assert outcome["error"] is not None
    assert "ES generation 2, rank 0 of 2: the all-reduce of the rewards failed" in outcome["error"]
    assert "another process died or did not answer within 3 s" in outcome["error"]
    assert outcome["generation"] == 2  # the failed generation was not applied
    assert outcome["at"] - started < 30  # well within the process group's 60 s timeout


def test_timeout_option_is_checked():
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="timeout must be a positive number of seconds"):
            fastes.ES(fastes.linear_weights(make_net()), sigma=0.1, lr=0.1, population=2, timeout=bad)
