"""What a run tells its user: where each iteration's time went, a warning when nothing can be learned, and
`fastes eval` for real models (a user reward, a batch size, format rate, completion length, examples)."""

from __future__ import annotations

import json

import pytest

from fastes import cli
from fastes.run.config import load_config
from fastes.run.train import NO_SIGNAL_STEPS, NoSignal, train


def run_config(tmp_path, **extra):
    return load_config(
        None,
        {
            "task": "countdown",
            "out_dir": str(tmp_path / "run"),
            "batch_size": 4,
            "max_new_tokens": 3,
            "eval_size": 4,
            "eval_every": 0,
            "checkpoint_every": 0,
            "progress": False,
            "es.population": 4,
            **extra,
        },
    )


def test_every_es_iteration_records_where_its_time_went(tmp_path):
    train(run_config(tmp_path, **{"es.iterations": 2}))
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line) for line in lines][1:]
    for record in steps:
        parts = [record[f"time/{p}"] for p in ("generation", "noise", "scoring", "update")]
        assert all(seconds >= 0 for seconds in parts) and record["time/generation"] > 0
        assert sum(parts) <= record["seconds"] * 1.01  # the parts lie inside the iteration
        assert 0 <= record["format"] <= 1


@pytest.mark.parametrize("mode", ["member", "materialised"])
def test_every_es_iteration_records_its_longest_completion(tmp_path, monkeypatch, mode):
    """The batch decodes until its longest completion ends, so the record names that length: the longest
    of every member's completions, as ES's own generate calls returned them."""
    import fastes.run.es_loop as es_loop

    calls = []
    generate = es_loop.generate
    monkeypatch.setattr(es_loop, "generate", lambda *a, **k: calls.append(generate(*a, **k)) or calls[-1])
    train(run_config(tmp_path, **{"es.iterations": 2, "es.eval_mode": mode, "max_new_tokens": 6}))
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][1:]
    per_iteration = len(calls) // len(steps)
    assert per_iteration == (4 if mode == "member" else 1)
    for index, record in enumerate(steps):
        made = calls[index * per_iteration : (index + 1) * per_iteration]
        assert record["completion_tokens_max"] == max(max(gen.lengths) for gen in made)
    assert all(1 <= record["completion_tokens_max"] <= 6 for record in steps)


def test_a_run_without_signal_says_so_once(tmp_path, capsys):
    # A sigma far below float resolution: every member answers as the base does, reward_std is 0.
    train(run_config(tmp_path, **{"es.iterations": NO_SIGNAL_STEPS + 2, "es.sigma": 1e-30}))
    err = capsys.readouterr().err
    assert err.count("scored the same for 3 ES steps in a row") == 1
    assert "fastes eval --show" in err and "max_new_tokens" in err


def test_the_no_signal_counter():
    counter = NoSignal()
    flat, varied = {"reward_std": 0.0}, {"reward_std": 0.1}
    assert [counter.update(flat) for _ in range(NO_SIGNAL_STEPS)][-1]  # reached: warn
    assert not counter.update(flat)  # once per streak
    assert not counter.update(varied) and counter.streak == 0
    assert counter.update({"frac_reward_zero_std": 1.0}) is False and counter.streak == 1  # GRPO's metric


@pytest.fixture
def reward_files(tmp_path):
    rows = [{"prompt": f"cmp {i} {9 - i}:", "answer": "<" if i < 5 else ">"} for i in range(10)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "rewards.py").write_text(
        "def starts(completions, answer, **columns):\n"
        "    return [float(c.startswith(a)) for c, a in zip(completions, answer)]\n"
    )
    return tmp_path


def test_eval_takes_a_reward_a_batch_size_and_shows_examples(reward_files, capsys):
    code = cli.main(
        [
            "eval",
            "--task",
            f"jsonl:{reward_files / 'data.jsonl'}",
            "--reward",
            f"{reward_files / 'rewards.py'}:starts",
            "--eval_batch_size",
            "1",
            "--samples",
            "1",
            "--limit",
            "2",
            "--show",
            "2",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and out.count("--- prompt:") == 2 and out.count("--- completion:") == 2
    result = json.loads(out[out.index("{") :])
    assert result["examples"] == 2 and 0 <= result["greedy_accuracy"] <= 1
    assert result["mean_completion_tokens"] > 0 and result["max_new_tokens"] == 12
    assert "format_rate" in result


def test_eval_pass_at_k_does_not_depend_on_the_batch_size(capsys):
    """The samples of prompt i are the same rows whatever the calls they are generated in."""
    results = []
    for batch in ("2", "64"):
        args = ["eval", "--task", "countdown", "--limit", "8", "--samples", "4", "--eval_batch_size", batch]
        assert cli.main(args) == 0
        out = capsys.readouterr().out
        results.append(json.loads(out[out.index("{") :]))
    assert results[0]["pass_at_k"] == results[1]["pass_at_k"]
    assert results[0]["greedy_accuracy"] == results[1]["greedy_accuracy"]


def test_eval_of_an_instruct_form(capsys):
    code = cli.main(
        ["eval", "--task", "compare", "--prompt_style", "instruct", "--limit", "3", "--samples", "1"]
    )
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["prompt_style"] == "instruct" and result["max_new_tokens"] == 48


def test_eval_errors_are_one_line(tmp_path, capsys):
    assert cli.main(["eval", "--task", "arithmetic:max_operand=2", "--limit", "2", "--samples", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fastes: configuration error: task:") and "\n" not in err
    assert cli.main(["eval", "--model", str(tmp_path / "nope.gguf")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_the_runs_plot_shows_format_and_lenient_accuracy_beside_accuracy(tmp_path, monkeypatch):
    from fastes.analysis import plots

    drawn = {}
    monkeypatch.setattr(plots, "plot_metric_over_steps", lambda lines, path, **_: drawn.update(lines) or path)
    metrics = [
        {"global_step": 0, "test_accuracy": 0.3, "test_format": 0.9, "test_lenient_accuracy": 0.4},
        {"global_step": 1, "reward": 0.5},
        {
            "global_step": 2,
            "reward": 0.7,
            "test_accuracy": 0.5,
            "test_format": 1.0,
            "test_lenient_accuracy": 0.5,
        },
    ]
    cli._curve_plot(metrics, tmp_path / "curve.png", "arithmetic")
    assert drawn["train reward"] == ([1, 2], [0.5, 0.7])
    assert drawn["test accuracy"] == ([0, 2], [0.3, 0.5])
    assert drawn["test format rate"] == ([0, 2], [0.9, 1.0])
    assert drawn["test lenient accuracy"] == ([0, 2], [0.4, 0.5])
    drawn.clear()
    cli._curve_plot(metrics[1:2], tmp_path / "curve.png", "countdown")  # no evaluation yet: reward alone
    assert list(drawn) == ["train reward"]
