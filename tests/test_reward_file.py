"""Your own reward function (TRL's signature) as a task, for ES and GRPO; its mistakes are reported with
the file and line, before any work where the signature shows them."""

import json
import logging
import math
import re
import time

import pytest

from fastes import cli
from fastes.errors import ConfigError
from fastes.run.config import load_config
from fastes.run.train import train
from fastes.tasks import RewardFunctionError, get_task

REWARDS = """
def score(completions, answer, **columns):
    assert set(columns) == {"prompts", "level", "trainer_state", "log_metric", "log_extra"}, columns
    return [float(c.strip().startswith(a)) for c, a in zip(completions, answer)]

def length(completions, **kwargs):
    return [len(c) / 10 for c in completions]

def broken(completions, **kwargs):
    values = [1.0 for c in completions]
    return values[0] / 0

def slow(completions, **kwargs):
    import time
    time.sleep(30)

def short(completions, **kwargs):
    return [1.0]

def words(completions, **kwargs):
    return ["yes" for c in completions]

def nan(completions, **kwargs):
    return [None] * len(completions)

def own_row(completions, prompts, level, completion_ids, **kwargs):
    # the row's own level, whatever its prompt; completion_ids must be the generated ones
    assert len(completion_ids) == len(completions)
    return [float(x) for x in level]

def needs_topic(completions, topic):
    return [0.0] * len(completions)
"""


@pytest.fixture()
def files(tmp_path):
    rewards = tmp_path / "rewards.py"
    rewards.write_text(REWARDS)
    data = tmp_path / "data.jsonl"
    rows = [
        {"prompt": f"cmp {i} {9 - i}:", "answer": "<" if i < 9 - i else ">", "level": i % 3}
        for i in range(10)
    ]
    rows[0]["split"] = "test"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path, f"jsonl:{data}", str(rewards)


def test_the_function_gets_completions_prompts_and_columns(files):
    _, task, rewards = files
    t = get_task(task, reward=f"{rewards}:score")
    test = t.split("test")
    assert test[0].prompt == "cmp 0 9:" and len(t.split("train")) + len(test) == 10
    examples = t.split("train")[:3]
    scores = t.scores(examples, [ex.meta["columns"]["answer"] + ";" for ex in examples[:2]] + ["?"])
    assert [s.reward(0.1) for s in scores] == [1.0, 1.0, 0.0]  # the function's value, format weight aside
    assert t.score(examples[0], "x").answer == 0.0


@pytest.mark.parametrize(
    "function,message",
    [
        ("broken", r"rewards.py:11: in broken: ZeroDivisionError: float division by zero"),
        ("short", r"returned list of length 1; it must return a list of 3 numbers"),
        ("words", r"reward 0 is 'yes' \(str\), not a finite number"),
    ],
)
def test_failures_name_the_file_and_line(files, function, message):
    _, task, rewards = files
    t = get_task(task, reward=f"{rewards}:{function}")
    with pytest.raises(RewardFunctionError, match=message):
        t.scores(t.split("train")[:3], ["a", "b", "c"])


def test_a_call_that_takes_too_long_is_stopped(files):
    _, task, rewards = files
    t = get_task(task, reward=f"{rewards}:slow", timeout=0.3)
    start = time.perf_counter()
    with pytest.raises(
        RewardFunctionError, match=r"longer than 0.3 s; make it faster or raise reward_timeout"
    ):
        t.scores(t.split("train")[:2], ["a", "b"])
    assert time.perf_counter() - start < 5


def test_mistakes_fail_when_the_config_is_built(files):
    root, task, rewards = files
    bad = root / "bad.py"
    bad.write_text("def score(completions):\n    return [\n")
    cases = [
        ({"reward": f"{rewards}:nope"}, "has no function 'nope'; functions defined there: broken"),
        ({"reward": f"{bad}:score"}, r"bad.py:2: syntax error"),
        ({"reward": "rewards.txt"}, "expected FILE.py:FUNCTION"),
        ({"reward": f"{rewards}:needs_topic"}, "needs 'topic', which the data does not have"),
        ({"reward": f"{rewards}:score", "task": "countdown"}, "scores a jsonl:<path> task"),
        ({"reward": f"{rewards}:score", "reward_timeout": 0.0}, "reward_timeout: must be > 0"),
    ]
    for options, message in cases:
        with pytest.raises(ConfigError, match=message):
            load_config(None, {"task": task, "out_dir": str(root / "run"), **options})
    lines = (root / "data.jsonl").read_text().splitlines()
    (root / "data.jsonl").write_text("\n".join([lines[0], '{"prompt": "x", "answer": "1"}']))
    different = r"data.jsonl:2 has columns \['answer', 'prompt'\], line 1 has \['answer', 'level', 'prompt'\]"
    with pytest.raises(ConfigError, match=different):
        load_config(None, {"task": task, "reward": f"{rewards}:score", "out_dir": str(root / "run")})
    code = cli.main(["train", "--task", task, "--reward", f"{rewards}:nope", "--out_dir", str(root / "run")])
    assert code == 2


def common(root, task, rewards, **extra):
    return {
        "task": task,
        "reward": f"{rewards}:length",
        "out_dir": str(root / "run"),
        "batch_size": 4,
        "max_new_tokens": 3,
        "eval_size": 2,
        "progress": False,
        **extra,
    }


@pytest.mark.parametrize("algorithm", ["es", "grpo"])
def test_es_and_grpo_train_on_the_function(files, algorithm):
    root, task, rewards = files
    options = {"es.iterations": 2, "es.population": 4} if algorithm == "es" else {"grpo.steps": 1}
    summary = train(load_config(None, common(root, task, rewards, algorithm=algorithm, **options)))
    records = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == (3 if algorithm == "es" else 2)
    assert all(0 <= r["reward"] <= 0.3 for r in records[1:])  # len(completion) / 10, at most 3 tokens
    assert 0 <= summary["final_test_accuracy"] <= 0.3  # the mean reward on the test split


@pytest.mark.parametrize("algorithm", ["es", "grpo"])
def test_none_for_every_completion_warns_and_the_run_goes_on(files, algorithm, caplog):
    """TRL's rule: a completion no function scores gets reward 0 and a warning naming its row."""
    root, task, rewards = files
    options = {"es.iterations": 1, "es.population": 4} if algorithm == "es" else {"grpo.steps": 1}
    cfg = load_config(
        None,
        common(root, task, rewards, algorithm=algorithm, eval_size=1, **options, reward=f"{rewards}:nan"),
    )
    with caplog.at_level(logging.WARNING):
        train(cfg)
    assert re.search(
        r"All reward functions returned None for the following kwargs: .* 'prompt': 'cmp", caplog.text
    )
    records = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["reward"] == 0.0 if algorithm == "es" else math.isnan(records[-1]["reward"])


@pytest.mark.parametrize("algorithm", ["es", "grpo"])
def test_a_prompt_may_repeat_with_its_own_columns(tmp_path, algorithm):
    """Two lines with one prompt and different levels: each completion is scored with its own line's."""
    (tmp_path / "rewards.py").write_text(REWARDS)
    rows = [{"prompt": "same:", "level": level, "split": "train"} for level in (1, 5, 1, 5)]
    rows.append({"prompt": "same:", "level": 0, "split": "test"})
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    t = get_task(f"jsonl:{tmp_path / 'data.jsonl'}", reward=f"{tmp_path / 'rewards.py'}:own_row")
    train_rows = t.split("train")
    scores = t.scores(train_rows, ["x"] * 4, completion_ids=[[1]] * 4)
    assert [s.answer for s in scores] == [ex.meta["columns"]["level"] for ex in train_rows]
    assert sorted(s.answer for s in scores) == [1, 1, 5, 5]
    options = {"es.iterations": 1, "es.population": 2} if algorithm == "es" else {"grpo.steps": 1}
    run = common(tmp_path, f"jsonl:{tmp_path / 'data.jsonl'}", tmp_path / "rewards.py", **options)
    train(load_config(None, {**run, "reward": f"{tmp_path / 'rewards.py'}:own_row", "algorithm": algorithm}))
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    step = records[-1]
    # A batch of the 4 rows (ES: every member on them; GRPO: every completion of each): mean level 3.
    assert step["reward"] == pytest.approx(3.0)
