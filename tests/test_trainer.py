"""fastes.ESTrainer / GRPOTrainer: TRL's shape over the loop of `fastes train`. Every config field reaches
the run's TrainConfig, mistakes fail before any work with one line naming the fix, and a trained run
logs TRL's metric names to metrics.jsonl, callbacks and TensorBoard, and resumes without duplicate points."""

import dataclasses
import json
import math

import pytest
import torch
from conftest import is_timing

from fastes import ESConfig, ESTrainer, GRPOConfig, GRPOTrainer
from fastes.errors import ConfigError
from fastes.models.loading import load_model, tiny_model_path
from fastes.run.rundir import RunDirError
from fastes.tasks import DatasetError, RewardFunctionError, task_dataset

MODEL = str(tiny_model_path())
ROWS, CORRECT = task_dataset("countdown", limit=8)
HELD_OUT, _ = task_dataset("countdown", "test", limit=4)


def short(completions, **kwargs):
    return [1.0 if len(c) < 6 else 0.0 for c in completions]


def digits(completions, **kwargs):
    return [float(sum(ch.isdigit() for ch in c)) for c in completions]


def small(tmp_path, config=ESConfig, **extra):
    """A config of a run of a few seconds on the tiny model."""
    sizes = {"population_size": 4} if config is ESConfig else {"num_generations": 2}
    settings = {"max_steps": 2, "per_device_train_batch_size": 4, "max_completion_length": 4, **sizes}
    return config(output_dir=str(tmp_path / "run"), disable_tqdm=True, use_cpu=True, **{**settings, **extra})


# field: (value, TrainConfig key, expected value there); fields needing others get them in EXTRA.
ES_FIELDS = {
    "output_dir": ("elsewhere", "out_dir", "elsewhere"),
    "max_steps": (3, "es.iterations", 3),
    "learning_rate": (1e-3, "es.lr", 1e-3),
    "lr_scheduler_type": ("cosine", "es.lr_scheduler_type", "cosine"),
    "warmup_steps": (0.1, "es.warmup_steps", 0.1),
    "per_device_train_batch_size": (5, "batch_size", 5),
    "max_completion_length": (7, "max_new_tokens", 7),
    "logging_steps": (3, "logging_steps", 3),
    "save_steps": (4, "checkpoint_every", 4),
    "eval_steps": (2, "eval_every", 2),
    "seed": (7, "seed", 7),
    "report_to": (["tensorboard"], "report_to", "tensorboard"),
    "disable_tqdm": (True, "progress", False),
    "use_cpu": (True, "device", "cpu"),
    "dtype": ("bfloat16", "dtype", "bfloat16"),
    "backend": ("torch", "backend", "torch"),
    "threads": (1, "threads", 1),
    "reward_timeout": (5.0, "reward_timeout", 5.0),
    "population_size": (6, "es.population", 6),
    "sigma": (0.01, "es.sigma", 0.01),
    "weight_decay": (0.1, "es.weight_decay", 0.1),
    "shaping": ("zscore", "es.shaping", "zscore"),
    "antithetic": (False, "es.antithetic", False),
    "stochastic_rounding": (True, "es.stochastic_rounding", True),
    "eval_mode": ("member", "es.eval_mode", "member"),
    "materialise_mb": (64.0, "es.materialise_mb", 64.0),
    "noise_type": ("lowrank", "es.noise_type", "lowrank"),
    "rank": (2, "es.rank", 2),
    "noise": ("rademacher", "es.noise", "rademacher"),
    "evolve": ("q_proj", "es.evolve", "q_proj"),
    "include_embeddings": (True, "es.include_embeddings", True),
    "include_norms": (True, "es.include_norms", True),
    "include_biases": (True, "es.include_biases", True),
    "num_generations": (2, "es.num_generations", 2),
    "temperature": (0.7, "es.temperature", 0.7),
    "top_p": (0.9, "es.top_p", 0.9),
    "ddp_timeout": (60, "collective_timeout", 60.0),
    "top_k": (5, "es.top_k", 5),
    "min_p": (0.1, "es.min_p", 0.1),
    "repetition_penalty": (1.2, "es.repetition_penalty", 1.2),
    "bf16": (True, "dtype", "bfloat16"),
    "num_train_epochs": (5.0, "es.iterations", 3),  # 5 passes over 8 rows, 16 prompts a step
}
GRPO_FIELDS = {
    **{k: v for k, v in ES_FIELDS.items() if k in {f.name for f in dataclasses.fields(GRPOConfig)}},
    "max_steps": (3, "grpo.steps", 3),
    "num_train_epochs": (5.0, "grpo.steps", 20),  # 16 completions: 2 prompts a step
    "learning_rate": (1e-3, "grpo.lr", 1e-3),
    "per_device_train_batch_size": (24, "batch_size", 3),  # completions: 3 prompts x 8 generations
    "num_generations": (4, "grpo.num_generations", 4),
    "temperature": (0.7, "grpo.temperature", 0.7),
    "top_p": (0.9, "grpo.top_p", 0.9),
    "top_k": (5, "grpo.top_k", 5),
    "min_p": (0.1, "grpo.min_p", 0.1),
    "repetition_penalty": (1.2, "grpo.repetition_penalty", 1.2),
    "beta": (0.04, "grpo.beta", 0.04),
    "epsilon": (0.3, "grpo.epsilon", 0.3),
    "epsilon_high": (0.28, "grpo.epsilon_high", 0.28),
    "loss_type": ("grpo", "grpo.loss_type", "grpo"),
    "max_grad_norm": (0.5, "grpo.max_grad_norm", 0.5),
    "weight_decay": (0.1, "grpo.weight_decay", 0.1),
    "num_iterations": (2, "grpo.num_iterations", 2),
    "scale_rewards": ("batch", "grpo.scale_rewards", "batch"),
    "mask_truncated_completions": (True, "grpo.mask_truncated_completions", True),
    "use_bias_correction_kl": (False, "grpo.use_bias_correction_kl", False),
    "lr_scheduler_type": ("cosine", "grpo.lr_scheduler_type", "cosine"),
    "warmup_steps": (0.1, "grpo.warmup_steps", 0.1),
    "adam_beta1": (0.8, "grpo.adam_beta1", 0.8),
    "adam_beta2": (0.99, "grpo.adam_beta2", 0.99),
    "adam_epsilon": (1e-6, "grpo.adam_epsilon", 1e-6),
    "gradient_accumulation_steps": (2, "grpo.gradient_accumulation_steps", 2),
    "steps_per_generation": (2, "grpo.steps_per_generation", 2),
    "generation_batch_size": (32, "batch_size", 4),  # 32 completions, groups of 8
    "delta": (1.5, "grpo.delta", 1.5),
    "sapo_temperature_neg": (1.1, "grpo.sapo_temperature_neg", 1.1),
    "sapo_temperature_pos": (0.9, "grpo.sapo_temperature_pos", 0.9),
    "vespo_k_pos": (1.5, "grpo.vespo_k_pos", 1.5),
    "vespo_lambda_pos": (2.5, "grpo.vespo_lambda_pos", 2.5),
    "vespo_k_neg": (2.5, "grpo.vespo_k_neg", 2.5),
    "vespo_lambda_neg": (1.5, "grpo.vespo_lambda_neg", 1.5),
    "importance_sampling_level": ("sequence", "grpo.importance_sampling_level", "sequence"),
    "multi_objective_aggregation": (
        "normalize_then_sum",
        "grpo.multi_objective_aggregation",
        "normalize_then_sum",
    ),
    "sync_ref_model": (True, "grpo.sync_ref_model", True),
    "ref_model_mixup_alpha": (0.5, "grpo.ref_model_mixup_alpha", 0.5),
    "ref_model_sync_steps": (4, "grpo.ref_model_sync_steps", 4),
    "top_entropy_quantile": (0.5, "grpo.top_entropy_quantile", 0.5),
    "entropy_coef": (0.01, "grpo.entropy_coef", 0.01),
    "off_policy_mask_threshold": (0.3, "grpo.off_policy_mask_threshold", 0.3),
}
EXTRA = {"include_embeddings": {"eval_mode": "member"}, "include_norms": {"eval_mode": "member"}}
EXTRA["include_biases"] = {"eval_mode": "member"}
EXTRA["eval_steps"] = {"eval_strategy": "steps"}
EXTRA["num_train_epochs"] = {"max_steps": -1, "per_device_train_batch_size": 16}
EXTRA["top_p"] = EXTRA["num_generations"] = {"temperature": 1.0}
EXTRA["sync_ref_model"] = EXTRA["ref_model_sync_steps"] = EXTRA["ref_model_mixup_alpha"] = {"beta": 0.04}


def trainer_config(config_class, name, value, tmp_path):
    extra = EXTRA.get(name, {})
    if name == "output_dir":
        value = str(tmp_path / value)
    args = config_class(**{"output_dir": str(tmp_path / "run"), **extra, name: value})
    trainer_class = ESTrainer if config_class is ESConfig else GRPOTrainer
    return trainer_class(MODEL, CORRECT, args=args, train_dataset=ROWS).config


def train_value(cfg, key):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


@pytest.mark.parametrize(
    "config_class,table", [(ESConfig, ES_FIELDS), (GRPOConfig, GRPO_FIELDS)], ids=["es", "grpo"]
)
def test_every_field_reaches_the_run_config(config_class, table, tmp_path):
    fields = dataclasses.fields(config_class)
    one_to_one = {f.name for f in fields if "sets" in f.metadata}
    assert one_to_one <= set(table) <= {f.name for f in fields}  # a new mapped field needs a row here
    for name, (value, key, expected) in table.items():
        cfg = trainer_config(config_class, name, value, tmp_path)
        if name == "output_dir":
            expected = str(tmp_path / expected)
        assert train_value(cfg, key) == expected, name
        assert cfg.algorithm == config_class.ALGORITHM and cfg.task == "dataset"


@pytest.mark.parametrize(
    "make,message",
    [
        (
            lambda t: ESConfig(output_dir=t, population_size=1),
            r"^population_size: must be at least 2, got 1$",
        ),
        (lambda t: ESConfig(output_dir=t, max_completion_length=-1), r"^max_completion_length: must be >= 1"),
        (
            lambda t: ESConfig(output_dir=t, learning_rate="fast"),
            r"^learning_rate: must be a number, got str",
        ),
        (lambda t: ESConfig(output_dir=t, report_to="wandb"), r"^report_to: 'wandb' is not supported; use"),
        (lambda t: ESConfig(output_dir=t, report_to=["none", "mlflow"]), r"^report_to: 'mlflow' is not"),
        (lambda t: ESConfig(output_dir=t, logging_steps=0), r"^logging_steps: must be at least 1"),
        (
            lambda t: GRPOConfig(output_dir=t, per_device_train_batch_size=5, num_generations=2),
            r"multiple of 2",
        ),
        (lambda t: GRPOConfig(output_dir=t, num_generations=1, per_device_train_batch_size=4), r"^num_gener"),
    ],
)
def test_config_mistakes_name_the_field_before_any_work(make, message, tmp_path):
    with pytest.raises(ConfigError, match=message):  # a field of the wrong type: already when built
        args = make(str(tmp_path / "run"))
        trainer = GRPOTrainer if isinstance(args, GRPOConfig) else ESTrainer
        trainer(MODEL, CORRECT, args=args, train_dataset=ROWS)
    assert not (tmp_path / "run").exists()


def broken_count(completions, **kwargs):
    return [1.0]


def words(completions, **kwargs):
    return ["yes" for _ in completions]


def needs_level(completions, level, **kwargs):
    return [float(x) for x in level]


@pytest.mark.parametrize(
    "rows,funcs,message",
    [
        (
            [{"question": "1+1"}],
            CORRECT,
            r"has no 'prompt' column \(row 0 has 'question'\); rename the column",
        ),
        ([{"prompt": 3}], CORRECT, r"'prompt' must be text or a list of"),
        ([{"prompt": [{"role": "user"}]}], CORRECT, r"'prompt' must be text or a list of"),
        ([{"prompt": "a"}, {"prompt": [{"role": "user", "content": "b"}]}], CORRECT, "mixes text prompts"),
        ([{"prompt": "a", "completions": 1}], CORRECT, r"column 'completions'.*rename that column"),
        ([{"prompt": "a", "x": 1}, {"prompt": "b"}], CORRECT, r"row 1 has columns \['prompt'\]"),
        ([], CORRECT, "train_dataset is empty"),
        ("rows.jsonl", CORRECT, "must be a datasets.Dataset or a list of dicts, got str"),
        (ROWS, lambda: [], r"<lambda>: the function must take a 'completions' argument"),
        (ROWS, lambda completions, /: [], r"takes 'completions' by position only; .* remove the '/'"),
        (ROWS, needs_level, r"needs 'level', which the data does not have as columns"),
        (ROWS, [], "reward_funcs is empty"),
        (ROWS, [short, short], "two reward functions are named 'short'"),
    ],
)
def test_data_and_reward_mistakes_fail_before_any_work(rows, funcs, message, tmp_path):
    with pytest.raises((DatasetError, RewardFunctionError), match=message):
        ESTrainer(MODEL, funcs, args=ESConfig(output_dir=str(tmp_path / "run")), train_dataset=rows)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "function, message",
    [
        (broken_count, r"broken_count'?: returned list of length 1; it must return a list of 2 numbers"),
        (words, r"reward 0 is 'yes' \(str\), not a finite number"),
    ],
)
def test_what_a_signature_cannot_show_fails_at_the_first_call(function, message, tmp_path):
    """Functions are not called when the trainer is built (TRL does not either): a wrong return value is
    refused at the first scoring call, naming the function."""
    trainer = ESTrainer(MODEL, function, args=small(tmp_path), train_dataset=ROWS)
    with pytest.raises(RewardFunctionError, match=message):
        trainer.task.scores(trainer.task.split("train")[:2], ["1", "2"])


def test_trainer_argument_mistakes(tmp_path):
    args = ESConfig(output_dir=str(tmp_path / "run"))
    with pytest.raises(DatasetError, match="reward_weights has 1 values for 2 reward functions"):
        ESTrainer(MODEL, [CORRECT, short], args=ESConfig(reward_weights=[1.0]), train_dataset=ROWS)
    with pytest.raises(ConfigError, match="takes a fastes.ESConfig, got fastes.GRPOConfig"):
        ESTrainer(MODEL, CORRECT, args=GRPOConfig(), train_dataset=ROWS)
    with pytest.raises(ConfigError, match="`train_dataset` is required"):
        ESTrainer(MODEL, CORRECT, args=args)
    with pytest.raises(
        ConfigError, match="expected a model directory, a .gguf file, .* transformers model, got int"
    ):
        ESTrainer(42, CORRECT, args=args, train_dataset=ROWS)
    model, _ = load_model(MODEL)
    loaded = ESTrainer(
        model, CORRECT, args=args, train_dataset=ROWS
    )  # the tokenizer of its directory, as TRL
    assert loaded.processing_class is not None
    model.config._name_or_path = ""  # built in memory: no directory to find one in
    with pytest.raises(ConfigError, match="processing_class: a loaded model needs its tokenizer"):
        ESTrainer(model, CORRECT, args=args, train_dataset=ROWS)
    with pytest.raises(ConfigError, match="callbacks: .* has none of the hooks"):
        ESTrainer(MODEL, CORRECT, args=args, train_dataset=ROWS, callbacks=[object()])
    with pytest.raises(ConfigError, match="is neither a model directory, a .gguf file nor a shipped model"):
        ESTrainer(str(tmp_path / "nowhere"), CORRECT, args=args, train_dataset=ROWS)
    with pytest.raises(ConfigError, match="resume_from_checkpoint: 'x'; .* pass True"):
        ESTrainer(MODEL, CORRECT, args=args, train_dataset=ROWS).train(resume_from_checkpoint="x")
    assert not (tmp_path / "run").exists()


class Recorder:
    """A callback that records every hook call."""

    def __init__(self):
        self.calls = []

    def on_train_begin(self, step):
        self.calls.append(("begin", step))

    def on_step_end(self, step, metrics):
        self.calls.append(("step", step, metrics))

    def on_evaluate(self, step, metrics):
        self.calls.append(("evaluate", step, metrics))

    def on_save(self, step, path):
        self.calls.append(("save", step, path.name))

    def on_train_end(self, step):
        self.calls.append(("end", step))


def scalars(log_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()  # drops the points a resumed run purged
    return [(e.step, e.value) for e in events.Scalars(tag)] if tag in events.Tags()["scalars"] else []


def test_es_trainer_trains_logs_evaluates_and_saves(tmp_path):
    recorder = Recorder()
    seen = {}

    def correct(completions, prompts, answer, **kwargs):  # the columns arrive as keyword arguments
        seen.update(prompts=prompts, answer=answer)
        return CORRECT(completions, prompts)

    args = small(
        tmp_path,
        report_to="tensorboard",
        reward_weights=[1.0, 0.5],
        save_steps=1,
        eval_strategy="steps",
        eval_steps=1,
    )
    trainer = ESTrainer(
        MODEL, [correct, short], args=args, train_dataset=ROWS, eval_dataset=HELD_OUT, callbacks=[recorder]
    )
    assert trainer.config.eval_size == len(HELD_OUT)
    output = trainer.train()
    assert output.global_step == trainer.summary["steps"] == trainer.state.global_step == 2
    assert seen["answer"] == [{r["prompt"]: r["answer"] for r in ROWS + HELD_OUT}[p] for p in seen["prompts"]]

    history = trainer.state.log_history
    steps = [r for r in history if "reward" in r and "train_runtime" not in r]  # the last: the end record
    for record in steps:
        parts = record["rewards/correct/mean"], record["rewards/short/mean"]
        assert all(0 <= p <= 1 for p in parts) and record["rewards/short/std"] >= 0
    assert history[0]["eval_reward"] == history[0]["eval_accuracy"] and history[0]["step"] == 0
    assert math.isclose(
        history[0]["eval_reward"],
        history[0]["eval_rewards/correct/mean"] + 0.5 * history[0]["eval_rewards/short/mean"],
    )
    final = history[-1]  # TRL's end-of-training record; ES's loss is minus the mean reward
    assert final["step"] == 2 and final["train_runtime"] > 0 and final["epoch"] == 2 * 4 / len(ROWS)
    assert final["train_loss"] == output.training_loss == pytest.approx(-sum(r["reward"] for r in steps) / 2)

    kinds = [c[0] for c in recorder.calls]
    assert kinds == [
        "begin",
        "evaluate",
        "step",
        "evaluate",
        "save",
        "step",
        "evaluate",
        "save",
        "save",
        "end",
    ]
    assert recorder.calls[0] == ("begin", 0) and recorder.calls[-2] == ("save", 2, "final")
    assert recorder.calls[2][2]["reward"] == steps[0]["reward"]
    assert recorder.calls[3][2]["test_reward"] == history[2]["eval_reward"]

    log_dir = tmp_path / "run" / "tensorboard"
    assert [s for s, _ in scalars(log_dir, "train/reward")] == [1, 2]
    assert [v for _, v in scalars(log_dir, "train/rewards/short/mean")] == pytest.approx(
        [r["rewards/short/mean"] for r in steps]
    )
    assert [s for s, _ in scalars(log_dir, "eval/reward")] == [0, 1, 2]

    metrics = trainer.evaluate(num_samples=4)
    assert metrics["eval_samples"] == len(HELD_OUT)
    assert 0 <= metrics["eval_rewards/correct/accuracy"] == metrics["eval_rewards/correct/mean"] <= 1
    curve = [metrics[f"eval_rewards/short/pass@{k}"] for k in (1, 2, 4)]
    assert curve == sorted(curve) and all(0 <= p <= 1 for p in curve)
    assert recorder.calls[-1][0] == "evaluate" and "test_reward" in recorder.calls[-1][2]
    other = trainer.evaluate(eval_dataset=ROWS[:2], metric_key_prefix="train")
    assert other["train_samples"] == 2 and "train_rewards/correct/mean" in other

    assert trainer.save_model().name == "final"
    saved = trainer.save_model(tmp_path / "copy")
    reloaded, _ = load_model(saved)
    for (name, a), b in zip(trainer.model.state_dict().items(), reloaded.state_dict().values()):
        assert torch.equal(a, b), name
    with pytest.raises(ConfigError, match="is the run directory"):
        trainer.save_model(tmp_path / "run")


def test_evaluate_needs_rows(tmp_path):
    trainer = ESTrainer(MODEL, CORRECT, args=small(tmp_path), train_dataset=ROWS)
    with pytest.raises(ConfigError, match="no eval_dataset; pass one"):
        trainer.evaluate()
    with pytest.raises(ConfigError, match="num_samples: must be a whole number >= 1"):
        trainer.evaluate(HELD_OUT, num_samples=0)


def test_resume_continues_exactly_and_tensorboard_has_no_duplicates(tmp_path):
    def run(steps, resume=False, rows=ROWS):
        args = small(tmp_path, max_steps=steps, save_steps=2, report_to="tensorboard")
        trainer = ESTrainer(MODEL, [CORRECT, short], args=args, train_dataset=rows)
        trainer.train(resume_from_checkpoint=resume)
        *steps, final = trainer.state.log_history  # the last: TRL's end-of-training record
        assert "train_runtime" in final
        return [{k: v for k, v in r.items() if not is_timing(k)} for r in steps]

    first = run(3)  # checkpoint at step 2; step 3 is written, then redone by the resume
    with pytest.raises(RunDirError, match="already holds a run"):
        run(3)
    with pytest.raises(RunDirError, match="dataset or reward functions differ"):
        run(4, resume=True, rows=ROWS[:6])
    resumed = run(4, resume=True)
    assert resumed[:3] == first  # no test split: every record is a training step
    log_dir = tmp_path / "run" / "tensorboard"
    points = scalars(log_dir, "train/reward")
    assert [s for s, _ in points] == [1, 2, 3, 4]
    assert [v for _, v in points[:3]] == pytest.approx([r["reward"] for r in first])


def test_a_loaded_model_is_trained_in_place_and_fingerprinted(tmp_path):
    model, tokenizer = load_model(MODEL)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    args = small(tmp_path, max_steps=1, sigma=0.05, learning_rate=0.05, max_completion_length=6)
    trainer = ESTrainer(model, digits, args=args, train_dataset=ROWS, processing_class=tokenizer)
    trainer.train()
    assert trainer.model is model
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["start_model"]["path"] == "<in-memory LlamaForCausalLM>"
    args = small(tmp_path, max_steps=2, sigma=0.05, learning_rate=0.05, max_completion_length=6)
    trained = ESTrainer(model, digits, args=args, train_dataset=ROWS, processing_class=tokenizer)
    with pytest.raises(RunDirError, match="starting model .* has changed"):
        trained.train(resume_from_checkpoint=True)


def test_grpo_trainer_samples_groups_of_the_completions_asked_for(tmp_path):
    args = small(tmp_path, GRPOConfig, max_steps=1, per_device_train_batch_size=4)
    trainer = GRPOTrainer(MODEL, [CORRECT, short], args=args, train_dataset=ROWS)
    assert trainer.config.batch_size == 2 and trainer.config.grpo.num_generations == 2
    trainer.train()
    record = trainer.state.log_history[-2]  # the step; [-1] is the end-of-training record
    assert {"reward", "reward_std", "frac_reward_zero_std", "rewards/short/mean", "entropy"} <= set(record)


def test_chat_prompts_apply_the_template_and_completions_are_messages(tmp_path):
    from fastes.models.loading import format_prompt
    from fastes.tasks import DatasetTask

    seen = {}

    def record(completions, prompts, **kwargs):
        seen.update(completions=completions, prompts=prompts)
        return [0.0] * len(completions)

    chat = [
        {"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": r["prompt"]}]}
        for r in ROWS
    ]
    task = DatasetTask(chat, record)
    examples = task.split("train")[:2]
    task.scores(examples, ["12", "3"])
    assert seen["completions"] == [
        [{"role": "assistant", "content": "12"}],
        [{"role": "assistant", "content": "3"}],
    ]
    assert seen["prompts"] == [chat[0]["prompt"], chat[1]["prompt"]]

    _, tokenizer = load_model(MODEL)
    assert format_prompt(tokenizer, chat[0]["prompt"]) == "be brief\n" + ROWS[0]["prompt"]
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }};{% endfor %}a:"
    assert format_prompt(tokenizer, chat[0]["prompt"]) == f"s:be brief;u:{ROWS[0]['prompt']};a:"


def test_a_built_in_task_as_dataset_and_reward():
    rows, reward = task_dataset("countdown", "test", limit=3)
    from fastes.tasks import get_task

    solutions = [ex.solution for ex in get_task("countdown").split("test")[:3]]
    prompts = [r["prompt"] for r in rows]
    assert reward.__name__ == "countdown" and set(rows[0]) == {"prompt", "answer"}
    assert reward(solutions, prompts) == [1.0, 1.0, 1.0]
    assert reward(["nonsense"] * 3, prompts) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="is not a countdown problem"):
        reward(["1"], ["what?"])


def test_a_datasets_dataset_is_taken_as_is(tmp_path):
    datasets = pytest.importorskip("datasets", reason="the hf extra is not installed")
    trainer = ESTrainer(MODEL, CORRECT, args=small(tmp_path), train_dataset=datasets.Dataset.from_list(ROWS))
    assert [ex.prompt for ex in trainer.task.split("train")] == [r["prompt"] for r in ROWS]
    with pytest.raises(
        DatasetError, match=r"is a DatasetDict; pass one split of it, e.g. dataset\['train'\]"
    ):
        ESTrainer(
            MODEL, CORRECT, train_dataset=datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)})
        )


# --- the same from the command line: --dataset FILE, several --reward, --reward_weights, --report_to ---

REWARDS = """
def correct(completions, answer, **kwargs):
    return [float(c.strip().startswith(a)) for c, a in zip(completions, answer)]

def length(completions, **kwargs):
    return [len(c) / 10 for c in completions]
"""


@pytest.fixture()
def files(tmp_path):
    (tmp_path / "rewards.py").write_text(REWARDS)
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return tmp_path


def cli_args(root, *extra):
    return [
        "train", "--dataset", str(root / "data.jsonl"), "--out_dir", str(root / "run"), "--progress", "false",
        "--es.iterations", "1", "--es.population", "4", "--batch_size", "4", "--max_new_tokens", "3",
        *extra,
    ]  # fmt: skip


def test_cli_trains_on_a_data_file_with_weighted_reward_functions(files, capsys):
    from fastes import cli

    rewards = files / "rewards.py"
    args = cli_args(files, "--reward", f"{rewards}:correct", f"{rewards}:length", "--reward_weights", "1,0.5")
    assert cli.main([*args, "--report_to", "tensorboard"]) == 0
    records = [json.loads(line) for line in (files / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["test_reward"] == pytest.approx(
        records[0]["test_rewards/correct/mean"] + 0.5 * records[0]["test_rewards/length/mean"]
    )
    assert {"rewards/correct/mean", "rewards/length/mean", "rewards/length/std"} <= set(records[1])
    config = json.loads((files / "run" / "config.json").read_text())
    assert config["task"] == "dataset" and config["reward_weights"] == "1,0.5"
    assert [s for s, _ in scalars(files / "run" / "tensorboard", "train/reward")] == [1]
    # 8 rows: a seeded 20% (2) held out for evaluation
    run = json.loads((files / "run" / "summary.json").read_text())
    assert run["test_problems"] == 2


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--report_to", "wandb"], "report_to: 'wandb' is not supported; use 'tensorboard' or 'none'"),
        (["--reward_weights", "1,2"], "reward_weights has 2 values for 1 reward functions"),
        (["--reward_weights", "one"], "reward_weights: 'one' is not a comma-separated list of numbers"),
        (["--reward", "{r}:nope"], "has no function 'nope'"),
        (["--logging_steps", "0"], "logging_steps: must be at least 1"),
        ([], "dataset: needs reward functions"),
    ],
)
def test_cli_mistakes_are_one_line_before_any_work(files, extra, message, capsys):
    from fastes import cli

    rewards = files / "rewards.py"
    given = [e.replace("{r}", str(rewards)) for e in extra]
    if "--reward" not in given and message != "dataset: needs reward functions":
        given += ["--reward", f"{rewards}:correct"]
    assert cli.main(cli_args(files, *given)) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (files / "run").exists()


def test_config_keys_of_a_dataset_run(files):
    from fastes.run.config import load_config
    from fastes.run.train import train

    base = {"out_dir": str(files / "run"), "reward": f"{files / 'rewards.py'}:correct"}
    data = str(files / "data.jsonl")
    cases = [
        ({"dataset": data}, "dataset: replaces the task: set task = 'dataset' too"),
        ({"eval_dataset": data}, "eval_dataset: holds the held-out rows of `dataset`"),
        ({"reward_weights": "1", "task": "countdown", "reward": ""}, "reward_weights: weighs the reward"),
        (
            {"task": f"jsonl:{data}", "reward": base["reward"] + "," + base["reward"]},
            "several reward functions",
        ),
        (
            {"task": "dataset", "dataset": str(files / "data.txt")},
            "unknown data file type; use one of .jsonl",
        ),
        ({"task": "dataset", "dataset": str(files / "none.csv")}, "data file .* does not exist"),
    ]
    for options, message in cases:
        with pytest.raises(ConfigError, match=message):
            load_config(None, {**base, **options})
    cfg = load_config(None, {"out_dir": str(files / "run"), "task": "dataset"})
    with pytest.raises(ConfigError, match="task: 'dataset' takes its rows from `dataset`"):
        train(cfg)
    assert not (files / "run").exists()


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".parquet"])
def test_data_files_are_read_through_datasets(suffix, tmp_path):
    datasets = pytest.importorskip("datasets", reason="the hf extra is not installed")
    from fastes.tasks.dataset import read_data_file

    rows = [{"prompt": r["prompt"], "answer": f"= {r['answer']}"} for r in ROWS]  # CSV infers numbers
    path = tmp_path / f"data{suffix}"
    if suffix == ".json":  # one JSON array of objects
        path.write_text(json.dumps(rows))
    elif suffix == ".jsonl":
        datasets.Dataset.from_list(rows).to_json(path)
    else:
        getattr(datasets.Dataset.from_list(rows), f"to_{suffix[1:]}")(path)
    assert read_data_file(path) == rows


def test_trl_and_fastes_take_the_same_script(tmp_path):
    """examples/side_by_side.py runs as written with TRL's GRPOTrainer and with fastes' GRPOTrainer and
    ESTrainer, and they log the same names."""
    pytest.importorskip("trl", reason="TRL is not installed (pip install 'fastes[trl]')")
    import runpy
    from pathlib import Path

    script = runpy.run_path(str(Path(__file__).resolve().parents[1] / "examples" / "side_by_side.py"))
    final = {}
    for which in ("trl", "grpo", "es"):
        history = script["main"](which, str(tmp_path / which), max_steps=2)
        steps = [r for r in history if "rewards/countdown/mean" in r and "train_runtime" not in r]
        assert len(steps) == 2, which
        for record in steps:  # the same metric names, from the same reward functions
            assert {"reward", "reward_std", "rewards/short/mean", "step", "epoch"} <= set(record), which
            assert 0 <= record["rewards/short/mean"] <= 1
        final[which] = history[-1]
    assert set(final["trl"]) <= set(final["grpo"]) | {"total_flos"}  # TRL's end-of-training record
    assert {"train_loss", "train_runtime"} <= set(final["es"])


def test_reward_file_tokenizer_and_overwrite_arguments(tmp_path):
    (tmp_path / "rewards.py").write_text(REWARDS)
    _, tokenizer = load_model(MODEL)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # marks it as given
    args = small(tmp_path, max_steps=1, overwrite_output_dir=True)
    funcs = [f"{tmp_path / 'rewards.py'}:length", short]  # a FILE.py:FUNCTION string loads from a file
    trainer = ESTrainer(MODEL, funcs, args=args, train_dataset=ROWS, processing_class=tokenizer)
    trainer.train()
    assert "rewards/length/mean" in trainer.state.log_history[-2]
    assert trainer.processing_class.chat_template == tokenizer.chat_template  # saved with final/, reloaded
    trainer.train()  # overwrite_output_dir: the previous run in output_dir is replaced
    with pytest.raises(ConfigError, match="temperature: sampling for Pass@K needs temperature > 0"):
        trainer.evaluate(HELD_OUT, num_samples=2, temperature=0.0)


def test_task_dataset_seed_and_limit():
    rows, _ = task_dataset("countdown", limit=5)
    other, _ = task_dataset("countdown", seed=1, limit=5)
    assert len(rows) == len(other) == 5 and rows != other
    with pytest.raises(ValueError, match="unknown split 'dev'"):
        task_dataset("countdown", "dev")


@pytest.mark.parametrize("section, config_class", [("es", ESConfig), ("grpo", GRPOConfig)])
def test_every_option_of_the_run_config_section_has_a_trainer_field(section, config_class):
    """A new [es] or [grpo] option fails here until the TRL-style config sets it too."""
    from fastes.run import config

    internal = dataclasses.fields({"es": config.ESSettings, "grpo": config.GRPOSettings}[section])
    reachable = set(config_class.keys().values()) | set(config_class.SPECIAL)
    assert {f"{section}.{f.name}" for f in internal} - reachable == set()


def test_es_num_generations_samples_each_prompt_per_member_reproducibly(tmp_path):
    seen = []

    def count(completions, **kwargs):
        seen.append(list(completions))
        return [float(len(c)) for c in completions]

    def run(name, **settings):
        args = small(
            tmp_path / name, max_steps=1, population_size=4, per_device_train_batch_size=3, **settings
        )
        ESTrainer(MODEL, count, args=args, train_dataset=ROWS).train()
        return seen[-1]

    sampled = run("a", num_generations=2)  # TRL's temperature 1.0 when several are asked for
    assert len(sampled) == 4 * 3 * 2  # members x prompts x samples
    assert run("b", num_generations=2) == sampled  # seeded by the run's seed and the step
    assert run("c", num_generations=2, seed=1) != sampled
    greedy = run("d")
    assert len(greedy) == 4 * 3
    with pytest.raises(ConfigError, match="es.num_generations|num_generations"):
        ESTrainer(
            MODEL, count, args=small(tmp_path / "e", num_generations=2, temperature=0.0), train_dataset=ROWS
        )


def test_grpo_evaluate_reports_trls_eval_loss_for_each_eval_dataset(tmp_path):
    args = small(tmp_path, GRPOConfig, max_steps=1, per_device_train_batch_size=4, beta=0.04)
    trainer = GRPOTrainer(MODEL, [CORRECT, short], args=args, train_dataset=ROWS, eval_dataset=HELD_OUT)
    assert trainer.ref_model is not None and not any(p.requires_grad for p in trainer.ref_model.parameters())
    before = {n: p.clone() for n, p in trainer.model.named_parameters()}
    metrics = trainer.evaluate()
    assert math.isfinite(metrics["eval_loss"]) and "eval_reward" in metrics
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())  # nothing trained
    assert trainer.evaluate()["eval_loss"] == metrics["eval_loss"]  # seeded by the run's seed and step
    both = trainer.evaluate({"a": HELD_OUT, "b": ROWS[:2]})
    assert both["eval_a_loss"] == metrics["eval_loss"] and math.isfinite(both["eval_b_loss"])
    es = ESTrainer(MODEL, CORRECT, args=small(tmp_path / "es"), train_dataset=ROWS).evaluate(HELD_OUT)
    assert es["eval_loss"] == -es["eval_reward"]  # ES minimises no loss: minus the reward, as train_loss
