"""The trainer face and the CLI under hostile input: no data loss, no silent corruption, one clear line
for every bad input (docs/reliability.md, "The trainer and the command under hostile input").

Runs use the tiny model for 1-2 steps; the ES-level cases use a few small tensors.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import math
import random
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import fastes
import fastes.errors
import fastes.run.config
import fastes.run.rundir
import fastes.run.train
import fastes.tasks
from fastes import ESConfig, ESTrainer, GRPOConfig, GRPOTrainer
from fastes.errors import NonFiniteUpdateError
from fastes.es.population import population_batched
from fastes.models.loading import tiny_model_path
from fastes.run.grpo_loop import finite_step
from fastes.tasks import task_dataset

MODEL = str(tiny_model_path())
ROWS, CORRECT = task_dataset("countdown", limit=8)


def small(tmp_path: Path, config=ESConfig, **extra):
    """A config of a run of a few seconds on the tiny model, a checkpoint every step."""
    sizes = {"population_size": 4} if config is ESConfig else {"num_generations": 2}
    settings = {"max_steps": 2, "per_device_train_batch_size": 4, "max_completion_length": 4, "save_steps": 1}
    base = {"output_dir": str(tmp_path / "run"), "disable_tqdm": True, "use_cpu": True}
    return config(**{**base, **settings, **sizes, **extra})


def weight_files(run: Path) -> list[Path]:
    return sorted(run.rglob("*.safetensors"))


def assert_all_finite(run: Path) -> None:
    for path in weight_files(run):
        assert all(bool(torch.isfinite(t).all()) for t in load_file(path).values()), path


# --- 1. no non-finite weights ---------------------------------------------------------------------------


def net(dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 4)).to(dtype)


def raw(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().view(-1).view(torch.uint8).clone() for p in model.parameters()]


ABSURD = [
    # (id, ES options, dtype, the setting the message names)
    ("lr", {"lr": 1e300}, torch.float32, "lower lr"),
    ("step size beyond float32", {"lr": 1e38}, torch.float32, "lower lr"),
    ("weight decay", {"lr": 1e-3, "weight_decay": 1e300}, torch.float32, "lower weight_decay"),
    ("fp16 weight decay", {"lr": 1.0, "weight_decay": 1e6}, torch.float16, "lower weight_decay"),
    ("tiny sigma", {"sigma": 1e-300, "lr": 1e-3}, torch.float32, "raise sigma"),
    ("fp16 lr", {"lr": 1e4}, torch.float16, "lower lr"),
    ("bf16 lr", {"lr": 6e37}, torch.bfloat16, "lower lr"),
]
NOISES = [
    {"noise_type": "full", "noise": "gaussian"},
    {"noise_type": "full", "noise": "rademacher"},
    {"noise_type": "lowrank", "noise": "gaussian", "rank": 2},
]


@pytest.mark.parametrize("noise", NOISES, ids=["full", "sign", "lowrank"])
@pytest.mark.parametrize("options, dtype, fix", [c[1:] for c in ABSURD], ids=[c[0] for c in ABSURD])
def test_an_update_that_would_overflow_is_refused_and_the_weights_kept(noise, options, dtype, fix):
    model = net(dtype)
    before = raw(model)
    settings = {"sigma": 0.1, "lr": 0.1, **options}
    es = fastes.ES(fastes.linear_weights(model), population=4, stochastic_rounding=True, **settings, **noise)
    with pytest.raises(NonFiniteUpdateError, match=fix) as refused:
        es.step(torch.tensor([1.0, 0.0, 0.5, 2.0]))
    assert "\n" not in str(refused.value)
    assert all(torch.equal(a, b) for a, b in zip(raw(model), before))
    assert es.generation == 0 and es.history == []


@pytest.mark.parametrize("mode", ["member", "materialised", "lowrank"])
def test_a_sigma_that_would_overflow_the_perturbed_weights_is_refused_in_every_eval_mode(mode):
    model = net()
    before = raw(model)
    noise_type = "lowrank" if mode == "lowrank" else "full"
    es = fastes.ES(fastes.linear_weights(model), sigma=1e38, lr=0.1, population=4, noise_type=noise_type)
    with pytest.raises(NonFiniteUpdateError, match="lower sigma"):
        if mode == "member":
            es.step(lambda: 0.0)
        else:
            with population_batched(es, model, mode=mode):
                pass
    assert all(torch.equal(a, b) for a, b in zip(raw(model), before))


def test_weights_that_are_already_nan_are_refused():
    model = net()
    with torch.no_grad():
        model[0].weight[0, 0] = math.nan
    es = fastes.ES(fastes.linear_weights(model), sigma=0.1, lr=0.1, population=2)
    with pytest.raises(NonFiniteUpdateError, match="'0.weight' are already NaN or inf"):
        next(es.members())


@pytest.mark.parametrize("noise_type", ["full", "lowrank"])
def test_weights_are_read_once_a_generation_and_again_after_a_change(monkeypatch, noise_type):
    """The update's overflow check reuses the perturbation check's read of the weights, and the compiled
    low-rank update measures the next generation's as it writes (no read at all after the first), unless
    a torch op wrote a weight since: a weight made inf between two checks is still refused."""
    reads = []
    real = fastes.es.optimizer._max_abs
    monkeypatch.setattr(fastes.es.optimizer, "_max_abs", lambda p: reads.append(p) or real(p))
    model = net()
    es = fastes.ES(fastes.linear_weights(model), sigma=0.1, lr=0.1, population=2, noise_type=noise_type)
    evolved = len(es.param_groups[0]["params"])
    measured = noise_type == "lowrank" and es.resolved_backend == "cpu"
    for generation in range(3):
        list(es.members())
        es.step(torch.tensor([1.0, 0.0]))
        assert len(reads) == evolved * (1 if measured else generation + 1)
    weight = model[0].weight
    list(es.members())  # the perturbation check of generation 3
    with torch.no_grad():
        weight[0, 0] = math.inf  # between that check and the update's
    before = weight.clone()
    with pytest.raises(NonFiniteUpdateError, match="'0.weight' are already NaN or inf"):
        es.step(torch.tensor([1.0, 0.0]))
    assert torch.equal(weight, before)
    with torch.no_grad():
        weight[0, 0] = 0.0
    es.step(torch.tensor([1.0, 0.0]))
    with torch.no_grad():
        weight[0, 0] = math.inf  # between an update and the next generation's perturbation check
    with pytest.raises(NonFiniteUpdateError, match="'0.weight' are already NaN or inf"):
        list(es.members())


@pytest.mark.parametrize(
    "inner, message",
    [
        (functools.partial(torch.optim.SGD, lr=1e38), "would make '0.weight' NaN or inf .2 tensors in all."),
        (functools.partial(torch.optim.Adam, lr=1e38), "would overflow float32"),  # lr / (1 - beta1)
    ],
    ids=["sgd", "adam"],
)
def test_gradient_mode_undoes_an_inner_step_that_overflows(inner, message):
    model = net()
    before = raw(model)
    es = fastes.ES(fastes.linear_weights(model), sigma=0.1, lr=0.0, population=4, inner_optimizer=inner)
    with pytest.raises(NonFiniteUpdateError, match=f"{message}; lower the inner optimizer's learning rate"):
        es.step(torch.tensor([1.0, 0.0, 0.5, 2.0]))
    assert all(torch.equal(a, b) for a, b in zip(raw(model), before))
    assert es.generation == 0
    tiny_sigma = fastes.ES(
        fastes.linear_weights(model), sigma=1e-300, lr=0.0, population=4, inner_optimizer=inner
    )
    with pytest.raises(NonFiniteUpdateError, match=r"1 / \(population \* sigma\) = .*; raise sigma"):
        tiny_sigma.step(torch.tensor([1.0, 0.0, 0.5, 2.0]))


def test_an_adamw_step_that_overflows_is_undone():
    model = net(torch.float16)
    before = raw(model)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    with pytest.raises(NonFiniteUpdateError, match="GRPO step 3: the optimizer.s step would make .0.weight."):
        finite_step(model, torch.optim.AdamW(model.parameters(), lr=1e6), "GRPO step 3")
    assert all(torch.equal(a, b) for a, b in zip(raw(model), before))
    with pytest.raises(NonFiniteUpdateError, match=r"lower grpo.lr \(1e\+300\)"):
        finite_step(model, torch.optim.AdamW(model.parameters(), lr=1e300), "GRPO step 3")


TRAINER_ABSURD = [
    # What the config can tell is refused when the trainer is built...
    (ESConfig, {"learning_rate": 1e300}, fastes.errors.ConfigError, "^learning_rate: 1e.300 divided by"),
    (
        ESConfig,
        {"learning_rate": 1e-3, "weight_decay": 1e300},
        fastes.errors.ConfigError,
        "^weight_decay: ",
    ),
    (GRPOConfig, {"learning_rate": 1e300}, fastes.errors.ConfigError, "^learning_rate: 1e.300 .times 10"),
    (
        GRPOConfig,
        {"learning_rate": 1e-3, "weight_decay": 1e300},
        fastes.errors.ConfigError,
        "^learning_rate",
    ),
    # ... what depends on the weights, by the step that would write them.
    (
        ESConfig,
        {"learning_rate": 100.0, "dtype": "float16"},
        NonFiniteUpdateError,
        r"lower learning_rate \(100\)",
    ),
    (ESConfig, {"weight_decay": 1e9, "dtype": "float16"}, NonFiniteUpdateError, "lower weight_decay"),
    (ESConfig, {"sigma": 1e300}, NonFiniteUpdateError, "lower sigma"),
    (GRPOConfig, {"learning_rate": 1e6, "dtype": "float16"}, NonFiniteUpdateError, "step would make"),
]


def varied(completions, **kwargs):
    """Rewards that differ between members (the tiny model's answers often do not): an update to take."""
    draw = random.Random(len(completions))
    return [draw.random() for _ in completions]


@pytest.mark.parametrize("config, options, error, message", TRAINER_ABSURD)
def test_absurd_settings_never_reach_a_checkpoint(config, options, error, message, tmp_path):
    trainer = {ESConfig: ESTrainer, GRPOConfig: GRPOTrainer}[config]
    with pytest.raises(error, match=message):
        trainer(MODEL, varied, args=small(tmp_path, config, **options), train_dataset=ROWS).train()
    assert not (tmp_path / "run" / "final").exists()
    assert_all_finite(tmp_path / "run")


def test_the_cli_names_its_own_flag(tmp_path, capsys):
    from fastes import cli

    args = ["train", "--out_dir", str(tmp_path / "run"), "--progress", "false", "--es.iterations", "1"]
    args += ["--es.population", "4", "--batch_size", "2", "--max_new_tokens", "2", "--eval_size", "1"]
    assert cli.main([*args, "--es.lr", "1e300"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fastes: configuration error: es.lr: 1e+300 divided by") and err.count("\n") == 1
    assert not (tmp_path / "run").exists()
    # Decay 1 - lr * weight_decay = -999,999 overflows float16 whatever the rewards.
    assert cli.main([*args, "--es.lr", "1", "--es.weight_decay", "1e6", "--dtype", "float16"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fastes: ES generation 0:") and err.count("\n") == 1
    assert "lower es.weight_decay (1e+06) or es.lr (1)" in err
    assert_all_finite(tmp_path / "run")


# --- 2. typed fields; nothing deleted or overwritten without an explicit overwrite ---------------------


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("overwrite_output_dir", "no", "overwrite_output_dir: must be True or False, got str 'no'"),
        ("use_cpu", "yes", "use_cpu: must be True or False, got str 'yes'"),
        ("disable_tqdm", 1, "disable_tqdm: must be True or False or None, got int 1"),
        ("antithetic", "false", "antithetic: must be True or False"),
        ("max_steps", 2.0, "max_steps: must be a whole number, got float 2.0"),
        ("learning_rate", "1e-3", "learning_rate: must be a number, got str '1e-3'"),
        ("report_to", None, "report_to: must be a string or a list of strings, got NoneType None"),
        (
            "reward_weights",
            1.0,
            r"reward_weights: must be a list of numbers \(one per reward function\) or None",
        ),
        ("output_dir", Path("x"), "output_dir: must be a string, got PosixPath"),
    ],
)
def test_every_field_is_type_checked_at_construction_and_before_training(field, value, message, tmp_path):
    with pytest.raises(fastes.errors.ConfigError, match=message):
        small(tmp_path, **{field: value})
    args = small(tmp_path)
    setattr(args, field, value)  # set after construction: caught before any work
    with pytest.raises(fastes.errors.ConfigError, match=message):
        ESTrainer(MODEL, CORRECT, args=args, train_dataset=ROWS)
    assert not (tmp_path / "run").exists()


def test_a_finished_run_survives_an_overwrite_flag_that_is_not_a_bool(tmp_path):
    ESTrainer(MODEL, CORRECT, args=small(tmp_path, max_steps=1), train_dataset=ROWS).train()
    before = {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()}
    trainer = ESTrainer(MODEL, CORRECT, args=small(tmp_path, max_steps=1), train_dataset=ROWS)
    trainer.args.overwrite_output_dir = "no"
    with pytest.raises(fastes.errors.ConfigError, match="overwrite_output_dir: must be True or False"):
        trainer.train()
    with pytest.raises(fastes.errors.ConfigError, match="overwrite: must be True or False"):
        fastes.run.train.train(trainer.config, overwrite="no")
    assert {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()} == before


def test_save_model_never_overwrites_the_run_its_checkpoints_or_the_starting_model(tmp_path):
    start = tmp_path / "start"
    shutil.copytree(MODEL, start)
    (tmp_path / "link").symlink_to(start)
    trainer = ESTrainer(str(start), CORRECT, args=small(tmp_path, max_steps=1), train_dataset=ROWS)
    trainer.train()
    run = tmp_path / "run"
    other = tmp_path / "other"
    ESTrainer(MODEL, CORRECT, args=small(other, max_steps=1, save_steps=0), train_dataset=ROWS).train()
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    refused = [
        (run, "is the run directory"),
        (run / "checkpoints", "is the run's checkpoints"),
        (run / "checkpoints" / "step-00000001", "is the run's checkpoints"),
        (start, "is the model this run starts from"),
        (tmp_path / "link", "is the model this run starts from"),  # a symlink to it
        (other / "run", r"holds a fastes run \(run.json\)"),
        (tmp_path / "run" / "metrics.jsonl" / "x", "cannot write .*NotADirectoryError|cannot write"),
    ]
    for target, message in refused:
        with pytest.raises(fastes.errors.ConfigError, match=f"save_model: .*{message}"):
            trainer.save_model(str(target))
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    assert trainer.save_model(str(tmp_path / "copy")) == tmp_path / "copy"


def test_out_dirs_that_cannot_hold_a_run_are_refused_before_any_work(tmp_path, monkeypatch):
    (tmp_path / "afile").write_text("keep")
    with pytest.raises(fastes.errors.ConfigError, match="would be under .*afile', which is a file"):
        ESTrainer(
            MODEL, CORRECT, args=ESConfig(output_dir=str(tmp_path / "afile" / "run")), train_dataset=ROWS
        )

    def read_only(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    trainer = ESTrainer(MODEL, CORRECT, args=small(tmp_path), train_dataset=ROWS)
    monkeypatch.setattr(fastes.run.rundir.tempfile, "TemporaryDirectory", read_only)
    with pytest.raises(fastes.run.rundir.RunDirError, match="cannot write in .* \\(Permission denied\\)"):
        trainer.train()
    assert not (tmp_path / "run").exists()


# --- 4. reward values ------------------------------------------------------------------------------------


def returning(value_of):
    """A reward function whose value for each completion is value_of(i)."""

    def reward(completions, **kwargs):
        return [value_of(i) for i in range(len(completions))]

    return reward


@pytest.mark.parametrize(
    "result, message",
    [
        (lambda completions: {c: 1.0 for c in completions}, r"returned dict; it must return a list of 2"),
        (lambda completions: "1.0" * len(completions), "returned str"),
        (lambda completions: ["1.0"] * len(completions), r"reward 0 is '1.0' \(str\), not a finite number"),
        (lambda completions: ["nan"] * len(completions), r"reward 0 is 'nan' \(str\)"),
        (lambda completions: [math.nan] * len(completions), "reward 0 is nan, not a finite number"),
        (lambda completions: [0.0, math.inf], "reward 1 is inf, not a finite number"),
        (lambda completions: [[1.0]] * len(completions), r"reward 0 is \[1.0\] \(list\)"),
        (lambda completions: {1.0, 2.0}, "returned set"),
    ],
    ids=["dict", "str", "strings", "nan string", "nan", "inf", "nested", "set"],
)
def test_rewards_that_are_not_numbers_or_none_are_refused_naming_the_function(result, message):
    def odd(completions, **kwargs):
        return result(completions)

    task = fastes.tasks.DatasetTask(ROWS, [CORRECT, odd])  # not called when built: signatures are read
    with pytest.raises(fastes.tasks.RewardFunctionError, match=f"'odd'.*{message}|odd: .*{message}"):
        task.scores(task.split("train")[:2], ["x", "y"])


@pytest.mark.parametrize("config", [ESConfig, GRPOConfig])
@pytest.mark.parametrize("count", [1, 2], ids=["one function", "two functions"])
def test_a_completion_no_function_scores_gets_0_with_a_warning_everywhere(config, count, tmp_path, caplog):
    """TRL's rule (a nansum over the functions): reward 0, a warning naming the row, and the run goes on."""
    functions = [returning(lambda i: None) for _ in range(count)]
    if count == 2:
        functions[1].__name__ = "other"
    trainer = {ESConfig: ESTrainer, GRPOConfig: GRPOTrainer}[config]
    with caplog.at_level(logging.WARNING):
        trainer(MODEL, functions, args=small(tmp_path, config, max_steps=1), train_dataset=ROWS).train()
    assert re.search(
        r"All reward functions returned None for the following kwargs: .*'prompt': '", caplog.text
    )
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["global_step"] == 1
    if config is ESConfig:  # ES scores the row 0; GRPO leaves it out of its reward mean, as TRL (NaN)
        assert records[-1]["reward"] == 0.0
    else:
        assert math.isnan(records[-1]["reward"])
    assert all(math.isnan(records[-1][f"rewards/{f.__name__}/mean"]) for f in functions)
    assert_all_finite(tmp_path / "run")


def test_none_beside_a_number_leaves_that_term_out(tmp_path):
    half = returning(lambda i: None if i % 2 else 1.0)
    task = fastes.tasks.DatasetTask(ROWS, [half, CORRECT], reward_weights=[1.0, 2.0])
    scores = task.scores(task.split("train")[:2], ["x", "y"])
    assert [s.answer for s in scores] == [1.0, 0.0]  # 1 * 1.0 + 2 * 0.0; the None's term left out


def test_reward_settings_that_cannot_work_are_refused(tmp_path):
    for timeout in (math.inf, 1e300, 0.0):  # SIGALRM cannot be set past ~1e9 s: inf was an OverflowError
        with pytest.raises(
            fastes.tasks.RewardFunctionError, match=r"reward_timeout: must be a number of seconds"
        ):
            ESTrainer(MODEL, CORRECT, args=small(tmp_path, reward_timeout=timeout), train_dataset=ROWS)
    constant = returning(lambda i: 1.0)
    with pytest.raises(fastes.tasks.DatasetError, match="reward_weights: all 2 weights are 0"):
        ESTrainer(
            MODEL, [CORRECT, constant], args=small(tmp_path, reward_weights=[0, 0.0]), train_dataset=ROWS
        )
    assert not (tmp_path / "run").exists()


REWARD_FILE = """
import sys

def exits(completions, **kwargs):
    sys.exit(7)

def nothing(completions, **kwargs):
    return [None] * len(completions)

def as_dict(completions, **kwargs):
    return {"a": 1.0}

def fine(completions, **kwargs):
    return [0.0] * len(completions)
"""


@pytest.mark.parametrize(
    "function, algorithm, message",
    [
        ("exits", "es", r"rewards.py:5: in exits: the function called sys.exit\(7\)"),
        ("as_dict", "es", "returned dict; it must return a list of"),
    ],
)
def test_the_cli_reports_a_reward_mistake_in_one_line_with_status_2(
    function, algorithm, message, tmp_path, capsys
):
    from fastes import cli

    (tmp_path / "rewards.py").write_text(REWARD_FILE)
    (tmp_path / "data.jsonl").write_text("".join(f'{{"prompt": "{r["prompt"]}"}}\n' for r in ROWS))
    args = [
        "train",
        "--dataset",
        str(tmp_path / "data.jsonl"),
        "--reward",
        f"{tmp_path / 'rewards.py'}:{function}",
    ]
    args += ["--out_dir", str(tmp_path / "run"), "--progress", "false", "--algorithm", algorithm]
    args += [
        "--es.iterations",
        "1",
        "--es.population",
        "4",
        "--grpo.steps",
        "1",
        "--grpo.num_generations",
        "2",
    ]
    args += ["--batch_size", "2", "--max_new_tokens", "2"]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("fastes: ") and err.count("\n") == 1
    assert re.search(message, err), err
    assert_all_finite(tmp_path / "run")


# --- 5. callbacks ----------------------------------------------------------------------------------------


def test_transformers_callbacks_get_args_state_and_control(tmp_path, capsys):
    from transformers import PrinterCallback, TrainerCallback, TrainerControl, TrainerState

    class Recording(TrainerCallback):
        def __init__(self):
            self.calls = []

        def record(self, event, args, state, control, **kwargs):
            assert isinstance(state, TrainerState) and isinstance(control, TrainerControl)
            self.calls.append((event, args, state.global_step, state.max_steps, sorted(kwargs)))

        def on_train_begin(self, args, state, control, **kwargs):
            self.record("begin", args, state, control, **kwargs)

        def on_step_end(self, args, state, control, **kwargs):
            self.record("step", args, state, control, **kwargs)

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.record("log", args, state, control, **kwargs)
            assert "reward" in logs or "eval_reward" in logs

        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            self.record("evaluate", args, state, control, **kwargs)
            assert "eval_reward" in metrics

        def on_save(self, args, state, control, **kwargs):
            self.record("save", args, state, control, **kwargs)

        def on_train_end(self, args, state, control, **kwargs):
            self.record("end", args, state, control, **kwargs)

    recording = Recording()
    args = small(tmp_path, max_steps=2, save_steps=0, eval_steps=2)
    trainer = ESTrainer(
        MODEL,
        CORRECT,
        args=args,
        train_dataset=ROWS,
        eval_dataset=ROWS[:2],
        callbacks=[recording, PrinterCallback()],
    )
    trainer.train()
    events = [(event, step) for event, _, step, _, _ in recording.calls]
    assert events == [
        ("begin", 0), ("evaluate", 0), ("log", 0),  # the starting model's evaluation
        ("step", 1), ("log", 1),
        ("step", 2), ("log", 2), ("evaluate", 2), ("log", 2),
        ("save", 2), ("end", 2),
    ]  # fmt: skip
    assert all(a is args and max_steps == 2 for _, a, _, max_steps, _ in recording.calls)
    printed = capsys.readouterr().out
    assert "'reward':" in printed and "'eval_reward':" in printed  # PrinterCallback's on_log


@pytest.mark.parametrize(
    "callbacks, message",
    [
        (
            lambda: [__import__("transformers").PrinterCallback],
            "PrinterCallback is a class; pass an instance",
        ),
        (
            lambda: __import__("transformers").PrinterCallback(),
            "must be a list of callbacks, got PrinterCallback",
        ),
        (lambda: [object()], "has none of the hooks"),
        (lambda: "tensorboard", "must be a list of callbacks, got str"),
    ],
    ids=["class", "not a list", "no hooks", "a string"],
)
def test_anything_else_is_refused_at_construction(callbacks, message, tmp_path):
    with pytest.raises(fastes.errors.ConfigError, match=f"callbacks: .*{message}"):
        ESTrainer(MODEL, CORRECT, args=small(tmp_path), train_dataset=ROWS, callbacks=callbacks())
    assert not (tmp_path / "run").exists()


# --- 3. sizes checked before work starts --------------------------------------------------------------


@pytest.mark.parametrize(
    "config, options, message",
    [
        (
            ESConfig,
            {"population_size": 10**9},
            r"es.population \* batch_size = 4,000,000,000 completions .* GiB",
        ),
        (
            ESConfig,
            {"max_completion_length": 10**6},
            "1000000 tokens do not fit in the model's context of 64",
        ),
        (
            GRPOConfig,
            {"num_generations": 10**8, "per_device_train_batch_size": 4 * 10**8},
            r"batch_size \* grpo.num_generations = 400,000,000 completions .* GiB",
        ),
    ],
    ids=["population", "completion length", "grpo group"],
)
def test_a_step_that_cannot_fit_fails_at_once_with_its_estimate(config, options, message, tmp_path):
    trainer = {ESConfig: ESTrainer, GRPOConfig: GRPOTrainer}[config]
    with pytest.raises(fastes.errors.ConfigError, match=message):
        trainer(MODEL, CORRECT, args=small(tmp_path, config, **options), train_dataset=ROWS).train()
    assert not (tmp_path / "run").exists()


def test_a_step_that_cannot_finish_in_a_day_is_refused(monkeypatch):
    from fastes.models.loading import load_model
    from fastes.run import size_checks
    from fastes.run.config import TrainConfig

    model, _ = load_model(MODEL)
    cfg = TrainConfig(max_new_tokens=12)
    size_checks.check_sizes(cfg, model, ("es", "grpo"), train_rows=100)  # the defaults fit
    monkeypatch.setattr(size_checks, "PEAK_FLOPS", {"cpu": 1.0, "cuda": 1.0})
    with pytest.raises(fastes.errors.ConfigError, match=r"generating them takes at least [\d,]+ hours"):
        size_checks.check_sizes(cfg, model, ("es",), train_rows=100)


# --- 6. one line naming the file, row, column or field ---------------------------------------------------

DATA_FILES = [
    ("empty.jsonl", b"", r"empty.jsonl: the file is empty"),
    (
        "latin.jsonl",
        b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n',
        r"latin.jsonl:2: not UTF-8 text \(byte 0xe9\)",
    ),
    ("ragged.csv", b"prompt,answer\na,1\nb,2,3\n", r"ragged.csv:3: 3 fields, the header has 2"),
    ("dup.csv", b"prompt,answer,answer\na,1,2\n", r"dup.csv:1: the header names column 'answer' twice"),
    ("header.csv", b"prompt,answer\n", r"header.csv: the header has no rows below it"),
    (
        "cut.jsonl",
        b'{"prompt": "a"}\n{"prompt": "b',
        r"cut.jsonl:2: malformed JSON \(Unterminated string",
    ),
    ("dol.json", b'{"prompt": ["a", "b"], "answer": ["1", "2"]}', r"dol.json: holds one object of columns"),
    (
        "wizard.jsonl",
        b'{"prompt": [{"role": "user", "content": "a"}]}\n{"prompt": [{"role": "wizard", "content": "b"}]}\n',
        r"wizard.jsonl row 1: message 0 has role 'wizard'; chat templates know system, user",
    ),
]


@pytest.mark.parametrize("name, content, message", DATA_FILES, ids=[c[0] for c in DATA_FILES])
def test_bad_data_files_are_one_line_naming_the_file_and_place(name, content, message, tmp_path, capsys):
    from fastes import cli

    (tmp_path / name).write_bytes(content)
    (tmp_path / "rewards.py").write_text(REWARD_FILE)
    args = ["train", "--dataset", str(tmp_path / name), "--reward", f"{tmp_path / 'rewards.py'}:fine"]
    assert cli.main([*args, "--out_dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(message, err), err
    assert not (tmp_path / "run").exists()


def test_other_messages_name_what_is_wrong(tmp_path, capsys):
    from fastes import cli

    (tmp_path / "m.gguf").mkdir()
    assert cli.main(["train", "--model", str(tmp_path / "m.gguf"), "--out_dir", str(tmp_path / "run")]) == 2
    assert (
        "m.gguf' is a directory, but a name ending in .gguf is read as a GGUF file" in capsys.readouterr().err
    )
    (tmp_path / "afile").write_text("keep")
    assert cli.main(["train", "--out_dir", str(tmp_path / "afile" / "run")]) == 2
    assert "out_dir: " in capsys.readouterr().err and (tmp_path / "afile").read_text() == "keep"
    trainer = ESTrainer(MODEL, CORRECT, args=small(tmp_path), train_dataset=ROWS)
    with pytest.raises(fastes.tasks.DatasetError, match="eval_dataset is empty"):
        trainer.evaluate(eval_dataset=[])


def test_the_cli_reports_a_mean_reward_as_a_number(tmp_path, capsys):
    from fastes import cli

    (tmp_path / "rewards.py").write_text("def big(completions, **kw):\n    return [3.5] * len(completions)\n")
    (tmp_path / "data.jsonl").write_text("".join(f'{{"prompt": "{r["prompt"]}"}}\n' for r in ROWS))
    args = ["train", "--dataset", str(tmp_path / "data.jsonl"), "--reward", f"{tmp_path / 'rewards.py'}:big"]
    args += ["--out_dir", str(tmp_path / "run"), "--progress", "false", "--es.iterations", "1"]
    assert cli.main([*args, "--es.population", "4", "--batch_size", "2", "--max_new_tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert "base model mean test reward:    3.5" in out and "%" not in out


# --- 8. a fuzz test over the trainer's and the command's inputs -----------------------------------------

_spec = importlib.util.spec_from_file_location(
    "fuzz_trainer", Path(__file__).resolve().parents[1] / "scripts" / "fuzz_trainer.py"
)
fuzz_trainer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fuzz_trainer)


def test_random_datasets_rewards_and_flags_train_or_fail_in_one_line():
    """Exit 0 with finite weights, or one `fastes:` line with status 2; bystander files never change."""
    report = fuzz_trainer.run(n=30, seed=3)
    assert report["findings"] == []
    assert report["statuses"].get(0, 0) >= 5 and report["statuses"].get(2, 0) >= 5  # both paths reached


def test_the_fuzzer_finds_a_traceback_a_lost_file_and_non_finite_weights(tmp_path, monkeypatch):
    """The harness itself can fail: each kind of finding is reported."""
    root = tmp_path
    (root / fuzz_trainer.BYSTANDER).write_text("notes")
    (root / "run" / "final").mkdir(parents=True)
    args = ["train", "--out_dir", str(root / "run")]

    def crash(argv):
        raise KeyError("bug")

    def deletes(argv):
        (root / fuzz_trainer.BYSTANDER).unlink()
        return 0

    def writes_nan(argv):
        from safetensors.torch import save_file

        save_file({"w": torch.tensor([math.nan])}, str(root / "run" / "final" / "model.safetensors"))
        return 0

    def two_lines(argv):
        print("fastes: one\nfastes: two", file=sys.stderr)
        return 2

    for fake, problem in [
        (crash, "raised KeyError"),
        (deletes, "changed or deleted"),
        (writes_nan, "non-finite weights"),
        (two_lines, "status 2 with stderr"),
    ]:
        monkeypatch.setattr(fuzz_trainer.cli, "main", fake)
        assert problem in fuzz_trainer.check(root, args)[1]
        (root / fuzz_trainer.BYSTANDER).write_text("notes")
