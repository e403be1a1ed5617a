"""Reward functions called as TRL's GRPOTrainer calls them (async ones awaited concurrently; prompts,
completions, completion_ids, columns, trainer_state, log_metric, log_extra), and reward models."""

import asyncio
import json

import pytest
import torch

from fastes import ESConfig, ESTrainer, GRPOConfig, GRPOTrainer
from fastes.models.loading import build_tokenizer, load_model, tiny_model_path
from fastes.tasks import DatasetTask, RewardFunctionError, RewardModel, task_dataset

MODEL = str(tiny_model_path())
ROWS, CORRECT = task_dataset("countdown", limit=8)
TRAINERS = {"es": (ESTrainer, ESConfig), "grpo": (GRPOTrainer, GRPOConfig)}


def small(tmp_path, algorithm, **extra):
    trainer, config = TRAINERS[algorithm]
    sizes = {"population_size": 2} if algorithm == "es" else {"num_generations": 2}
    settings = {"max_steps": 2, "per_device_train_batch_size": 4, "max_completion_length": 4, **sizes}
    args = config(output_dir=str(tmp_path / "run"), disable_tqdm=True, use_cpu=True, **{**settings, **extra})
    return trainer, args


def records(tmp_path):
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


# --- async functions ------------------------------------------------------------------------------------


def concurrent_pair():
    """Two async reward functions that each wait (up to 2 s) for the other to have started: awaited one
    after the other, the first would see only itself."""
    started = []

    async def wait_for_both():
        for _ in range(200):
            if len(started) == 2:
                return True
            await asyncio.sleep(0.01)
        return False

    async def first(completions, **kwargs):
        started.append("first")
        return [float(await wait_for_both())] * len(completions)

    async def second(completions, **kwargs):
        started.append("second")
        return [float(await wait_for_both())] * len(completions)

    return [first, second], started


def test_async_functions_are_awaited_concurrently():
    functions, started = concurrent_pair()
    task = DatasetTask(ROWS, functions)
    scores = task.scores(task.split("train")[:2], ["1", "2"])
    assert sorted(started) == ["first", "second"]
    assert [s.rewards for s in scores] == [{"first": 1.0, "second": 1.0}] * 2  # both saw the other start


def test_async_functions_work_inside_a_running_event_loop():
    """A notebook runs an event loop: scoring from inside one must not try to start another."""
    functions, _ = concurrent_pair()
    task = DatasetTask(ROWS, [*functions, CORRECT])

    async def main():
        return task.scores(task.split("train")[:2], ["1", "2"])

    scores = asyncio.run(main())
    assert [s.rewards["first"] for s in scores] == [1.0, 1.0]


def test_an_async_function_that_fails_or_hangs_is_reported_by_name():
    async def broken(completions, **kwargs):
        raise KeyError("missing")

    async def hangs(completions, **kwargs):
        await asyncio.sleep(60)

    task = DatasetTask(ROWS, broken)
    with pytest.raises(RewardFunctionError, match=r"test_rewards.py:\d+: in broken: KeyError: 'missing'"):
        task.scores(task.split("train")[:1], ["1"])
    task = DatasetTask(ROWS, hangs, timeout=0.2)
    with pytest.raises(RewardFunctionError, match=r"hangs: one call on 1 completions took longer than 0.2 s"):
        task.scores(task.split("train")[:1], ["1"])


# --- what every function is passed -----------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ["es", "grpo"])
def test_functions_get_trainer_state_and_the_generated_ids(algorithm, tmp_path):
    calls = []

    def spy(completions, prompts, completion_ids, trainer_state, answer, **kwargs):
        calls.append((trainer_state.global_step, completions, completion_ids))
        return [0.0] * len(completions)

    trainer, args = small(tmp_path, algorithm)
    trainer(MODEL, spy, args=args, train_dataset=ROWS).train()
    assert [step for step, _, _ in calls] == [0, 1]  # no eval_dataset: the two training steps' calls
    _, tokenizer = load_model(MODEL)
    per_call = 4 * 2 if algorithm == "es" else 4  # ES: 4 prompts for each of 2 members
    for _, completions, ids in calls:
        assert len(ids) == len(completions) == per_call
        for text, row in zip(completions, ids):
            generated = row[:-1] if row and row[-1] == tokenizer.eos_token_id else row
            assert generated == tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_trainer_state_set_by_the_trainer_is_the_one_passed():
    from transformers import TrainerState

    seen = []

    def spy(completions, trainer_state, **kwargs):
        seen.append(trainer_state)
        return [0.0] * len(completions)

    task = DatasetTask(ROWS, spy)
    state = TrainerState(global_step=7)
    task.trainer_state = state
    task.scores(task.split("train")[:1], ["1"])
    task.at_step(8)
    assert seen == [state] and state.global_step == 8


@pytest.mark.parametrize("algorithm", ["es", "grpo"])
def test_log_metric_reaches_metrics_jsonl_and_log_extra_the_step_record(algorithm, tmp_path):
    def lengths(completions, log_metric, log_extra, **kwargs):
        log_metric("length/called", 2.0)
        log_metric("length/called", 4.0)  # a step's values are averaged, as TRL does
        log_extra("length", [len(c) for c in completions])
        return [0.0] * len(completions)

    trainer, args = small(tmp_path, algorithm)
    trainer(MODEL, lengths, args=args, train_dataset=ROWS).train()
    steps = [r for r in records(tmp_path) if "reward" in r]
    assert [r["length/called"] for r in steps] == [3.0, 3.0]
    per_step = 4 * 2 if algorithm == "es" else 4  # ES: 4 prompts for each of 2 members
    assert all(len(r["log_extra"]["length"]) == per_step for r in steps)  # one per completion scored


def test_log_metric_refuses_a_value_that_is_no_number():
    def bad(completions, log_metric, **kwargs):
        log_metric("m", "high")
        return [0.0] * len(completions)

    task = DatasetTask(ROWS, bad)
    with pytest.raises(
        RewardFunctionError, match=r"in bad: .*log_metric\('m', \.\.\.\): 'high' is not a number"
    ):
        task.scores(task.split("train")[:1], ["1"])


# --- signatures, not calls, at construction ---------------------------------------------------------------


def test_functions_are_not_called_when_the_trainer_is_built(tmp_path):
    calls = []

    def picky(completions, **kwargs):
        calls.append(completions)
        if not all(completions):
            raise ValueError("an empty completion")
        return [1.0] * len(completions)

    trainer, args = small(tmp_path, "es")
    built = trainer(MODEL, picky, args=args, train_dataset=ROWS)
    assert calls == []
    assert [s.answer for s in built.task.scores(built.task.split("train")[:2], ["1", "2"])] == [1.0, 1.0]


# --- repeated prompts ------------------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ["es", "grpo"])
def test_a_repeated_prompt_is_scored_with_its_own_rows_columns(algorithm, tmp_path):
    rows = [{"prompt": ROWS[0]["prompt"], "level": level} for level in (1, 5, 1, 5)]

    def level(completions, level, **kwargs):
        return [float(x) for x in level]

    task = DatasetTask(rows, level)
    assert [s.answer for s in task.scores(task.split("train"), ["x"] * 4)] == [1.0, 5.0, 1.0, 5.0]
    trainer, args = small(tmp_path, algorithm, max_steps=1)
    trainer(MODEL, level, args=args, train_dataset=rows).train()
    assert records(tmp_path)[-1]["reward"] == pytest.approx(3.0)  # the mean of all four rows' levels


# --- reward models ---------------------------------------------------------------------------------------


def classifier(seed=0):
    """A random-weight tiny Qwen2 sequence classifier with one label, on the character tokenizer."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    tokenizer = (
        build_tokenizer()
    )  # offline; loaded back from beside a Qwen2 config.json it reads text otherwise
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    return Qwen2ForSequenceClassification(config).eval(), tokenizer


def by_hand(model, tokenizer, texts):
    with torch.no_grad():
        return [
            float(model(**tokenizer(t, return_tensors="pt", add_special_tokens=False)).logits[0, 0])
            for t in texts
        ]


def test_a_reward_model_scores_prompt_and_completion_as_calling_it_by_hand(tmp_path):
    model, tokenizer = classifier()
    model.save_pretrained(tmp_path / "judge")
    tokenizer.save_pretrained(tmp_path / "judge")
    task = DatasetTask(ROWS, [str(tmp_path / "judge"), CORRECT], reward_processing_classes=[tokenizer, None])
    examples, completions = task.split("train")[:3], ["1+2", "7", ""]
    scores = task.scores(examples, completions)
    texts = [ex.prompt + c for ex, c in zip(examples, completions)]
    expected = by_hand(model, tokenizer, texts)
    assert [s.rewards["judge"] for s in scores] == pytest.approx(expected, abs=1e-5)
    assert [s.answer for s in scores] == pytest.approx(
        [e + s.rewards["countdown"] for e, s in zip(expected, scores)]
    )
    assert len(set(expected)) == 3  # the texts differ, and so do their rewards

    loaded = DatasetTask(ROWS, model, reward_processing_classes=tokenizer)  # a model object and its tokenizer
    assert [s.answer for s in loaded.scores(examples, completions)] == pytest.approx(expected, abs=1e-5)

    # Without a tokenizer, the one saved in the model's directory (as transformers loads it from there).
    from transformers import AutoTokenizer

    own = DatasetTask(ROWS, str(tmp_path / "judge"))
    saved = AutoTokenizer.from_pretrained(tmp_path / "judge")
    assert [s.answer for s in own.scores(examples, completions)] == pytest.approx(
        by_hand(model, saved, texts), abs=1e-5
    )


def test_a_reward_model_reads_chat_prompts_through_its_template():
    model, tokenizer = classifier()
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }};{% endfor %}"
    chat = [{"prompt": [{"role": "user", "content": r["prompt"]}]} for r in ROWS]
    task = DatasetTask(chat, model, reward_processing_classes=[tokenizer])
    examples = task.split("train")[:2]
    scores = task.scores(examples, ["12", "3"])
    texts = [f"u:{r['prompt']};a:{c};" for r, c in zip(ROWS, ["12", "3"])]
    assert [s.answer for s in scores] == pytest.approx(by_hand(model, tokenizer, texts), abs=1e-5)


def test_reward_model_mistakes_are_one_line(tmp_path):
    model, tokenizer = classifier()
    with pytest.raises(
        RewardFunctionError, match="reward_processing_classes has 1 entries for 2 reward functions"
    ):
        DatasetTask(ROWS, [model, CORRECT], reward_processing_classes=[tokenizer])
    with pytest.raises(
        RewardFunctionError, match="neither a directory holding a reward model .* nor FILE.py:FUNCTION"
    ):
        DatasetTask(ROWS, str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(RewardFunctionError, match="a directory without config.json"):
        DatasetTask(ROWS, str(tmp_path / "empty"))
    with pytest.raises(
        RewardFunctionError, match="no tokenizer given .* pass its tokenizer in reward_processing"
    ):
        DatasetTask(ROWS, model)  # built in memory: no directory to load its tokenizer from


def test_a_reward_model_is_named_after_its_directory(tmp_path):
    model, tokenizer = classifier()
    model.save_pretrained(tmp_path / "my-judge")
    tokenizer.save_pretrained(tmp_path / "my-judge")
    reward = DatasetTask(ROWS, str(tmp_path / "my-judge") + "/").functions[0]
    assert isinstance(reward, RewardModel) and reward.name == "my-judge"
    assert not reward.model.training


@pytest.mark.parametrize("algorithm", ["es", "grpo"])
def test_es_and_grpo_train_on_a_reward_model(algorithm, tmp_path):
    model, tokenizer = classifier()
    model.save_pretrained(tmp_path / "judge")
    tokenizer.save_pretrained(tmp_path / "judge")
    trainer, args = small(tmp_path, algorithm)
    trainer(MODEL, [str(tmp_path / "judge")], args=args, train_dataset=ROWS).train()
    steps = [r for r in records(tmp_path) if "reward" in r]
    assert len(steps) == 2 and all(r["reward"] == r["rewards/judge/mean"] for r in steps)
    assert all(torch.isfinite(torch.tensor(r["reward"])) for r in steps)
