"""One evaluation path (fastes/run/evaluation.py): every face renders an example's prompt the same way, and
`fastes eval` of a finished run's final/ with the run's settings reproduces the run's own test figures,
on the built-in tiny model and on a random-weight Llama with a chat template (conftest.chat_llama)."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from fastes import ESConfig, ESTrainer, cli
from fastes.checkpoint import load_checkpoint
from fastes.errors import ConfigError
from fastes.experiment import PRESETS, make_context, plan_budget
from fastes.experiment.progress import Progress
from fastes.models.loading import tiny_model_path
from fastes.run import evaluation
from fastes.run.config import load_config
from fastes.run.evaluation import general_text_corpus, heldout_tasks
from fastes.run.train import train
from fastes.tasks import get_task

TASK = "arithmetic:max_operand=20,operations=+-,n_train=40,n_test=20"


@pytest.fixture
def rendered(monkeypatch):
    """Every prompt list that reaches generation through the evaluation path, call by call."""
    calls: list[list[str]] = []
    real = evaluation.generate_in_chunks

    def spy(model, tokenizer, prompts, **options):
        calls.append(list(prompts))
        return real(model, tokenizer, prompts, **options)

    monkeypatch.setattr(evaluation, "generate_in_chunks", spy)
    return calls


def _run_face(model: Path, out: Path, rendered: list, **settings) -> list[str]:
    """The prompts a run evaluates its base on (its first generation: the base evaluation)."""
    rendered.clear()
    cfg = load_config(
        None,
        {
            "model": str(model),
            "task": TASK,
            "out_dir": str(out),
            "eval_size": 2,
            "batch_size": 1,
            "max_new_tokens": 2,
            "progress": False,
            "es.iterations": 1,
            "es.population": 2,
            **settings,
        },
    )
    train(cfg)
    return rendered[0]


def _eval_face(model: Path, rendered: list, capsys, **settings) -> list[str]:
    rendered.clear()
    flags = [f"--{key}={value}" for key, value in settings.items()]
    argv = ["eval", "--model", str(model), "--task", TASK, "--limit", "2", "--samples", "1", *flags]
    assert cli.main([*argv, "--max_new_tokens", "2"]) == 0
    capsys.readouterr()
    return rendered[0]


def _study_face(model: Path, out: Path, rendered: list, **settings) -> list[str]:
    rendered.clear()
    preset = replace(PRESETS["smollm2-quick"], model=str(model), task=TASK, max_new_tokens=2, **settings)
    plan = plan_budget(preset.es_iterations, preset.population, preset.es_batch, 4, 8)
    ctx = make_context(preset, out, model, "cpu", plan, False, Progress(out, {}))
    ctx.evaluator(model).greedy(ctx.task, ctx.task.split("test")[:2])
    return rendered[0]


def _trainer_face(model: Path, out: Path, rendered: list, prompts: list[str]) -> list[str]:
    """ESTrainer takes rows of prompts: the instruct form's prompt texts, as a user would pass them."""
    rendered.clear()
    rows = [{"prompt": prompt} for prompt in prompts]
    trainer = ESTrainer(
        model=str(model),
        reward_funcs=lambda completions, **columns: [0.0] * len(completions),
        args=ESConfig(output_dir=str(out), max_completion_length=2, disable_tqdm=True),
        train_dataset=rows,
        eval_dataset=rows,
    )
    trainer.evaluate()
    return rendered[0]


def test_every_face_renders_an_example_the_same_way(chat_llama, tmp_path, rendered, capsys):
    examples = get_task(TASK, style="instruct").split("test")[:2]
    assert examples[0].prompt.startswith("Calculate ") and '"Answer:"' in examples[0].prompt
    expected = [f"<|im_start|>user\n{ex.prompt}<|im_end|>\n<|im_start|>assistant\n" for ex in examples]
    # ESTrainer renders rows as written: the other faces are asked for no answer prefix to match it.
    bare = {"answer_prefix": ""}
    faces = {
        "run": _run_face(chat_llama, tmp_path / "run", rendered, **bare),
        "fastes eval": _eval_face(chat_llama, rendered, capsys, **bare),
        "ESTrainer.evaluate": _trainer_face(
            chat_llama, tmp_path / "trainer", rendered, [e.prompt for e in examples]
        ),
        "study": _study_face(chat_llama, tmp_path / "study", rendered, **bare),
    }
    for face, prompts in faces.items():
        assert prompts == expected, face

    # The run's own prompt settings reach every face that takes them (ESTrainer takes rows as written).
    settings = {
        "system_prompt": "Be brief.",
        "instruction": 'Put the number after "Answer:".',
        "answer_prefix": "The result:",
    }
    faces = {
        "run": _run_face(chat_llama, tmp_path / "run2", rendered, **settings),
        "fastes eval": _eval_face(chat_llama, rendered, capsys, **settings),
        "study": _study_face(chat_llama, tmp_path / "study2", rendered, **settings),
    }
    question = examples[0].prompt.rpartition(" and write")[0]
    first = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
        f'{question}. Put the number after "Answer:".<|im_end|>\n<|im_start|>assistant\nThe result:'
    )
    for face, prompts in faces.items():
        assert prompts[0] == first, face


def _eval_result(capsys, argv: list[str]) -> dict:
    """`fastes eval` with these arguments: its JSON result."""
    code = cli.main(["eval", *argv])
    out_text = capsys.readouterr().out
    assert code == 0
    return json.loads(out_text[out_text.index("{") :])


def _summary_and_eval(model: Path, out: Path, capsys, settings: dict) -> tuple[dict, dict]:
    cfg = load_config(
        None,
        {
            "model": str(model),
            "out_dir": str(out),
            "eval_size": 12,
            "batch_size": 4,
            "progress": False,
            "es.iterations": 2,
            "es.population": 4,
            "es.sigma": 0.05,
            **settings,
        },
    )
    train(cfg)
    summary = json.loads((out / "summary.json").read_text())
    flags = [f"--{key}={value}" for key, value in settings.items()]
    return summary, _eval_result(
        capsys, ["--model", str(out / "final"), "--limit", "12", "--samples", "1", *flags]
    )


def test_eval_of_a_finished_run_reproduces_its_summary_tiny_model(tmp_path, capsys):
    settings = {"model": str(tiny_model_path()), "task": "countdown"}
    summary, result = _summary_and_eval(tiny_model_path(), tmp_path / "run", capsys, settings)
    assert summary["final_test_accuracy"] > 0  # a figure that can disagree
    assert result["greedy_accuracy"] == summary["final_test_accuracy"]
    assert result["format_rate"] == summary["final_test_format"]


def _tiny_run_with_checkpoints(out: Path) -> None:
    """Two ES iterations of the tiny model, a checkpoint after each."""
    overrides = {"model": str(tiny_model_path()), "task": "countdown", "out_dir": str(out), "eval_size": 12}
    overrides |= {"batch_size": 4, "progress": False, "checkpoint_every": 1, "es.iterations": 2}
    train(load_config(None, {**overrides, "es.population": 4, "es.sigma": 0.05}))


def test_eval_of_a_runs_checkpoint_evaluates_the_weights_it_holds(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    _tiny_run_with_checkpoints(out)
    evaluated = []  # the weights of each model fastes eval evaluates

    class Recording(evaluation.Evaluator):
        def __init__(self, cfg, model, tokenizer) -> None:
            evaluated.append({name: t.clone() for name, t in model.state_dict().items()})
            super().__init__(cfg, model, tokenizer)

    monkeypatch.setattr(evaluation, "Evaluator", Recording)
    final = _eval_result(capsys, ["--run", str(out), "--samples", "2"])
    # the newest checkpoint holds the final weights: the same weights and figures, and the step
    newest = _eval_result(capsys, ["--run", str(out), "--checkpoint", "--samples", "2"])
    assert newest == {"checkpoint_step": 2, **final}
    assert all(torch.equal(evaluated[1][name], t) for name, t in evaluated[0].items())
    # checkpoint 1's weights (not the final ones), written out as a model directory for --model: the same
    _, tensors, _ = load_checkpoint(out / "checkpoints" / "step-00000001")
    weights = {name[len("model.") :]: t for name, t in tensors.items() if name.startswith("model.")}
    assert any(not torch.equal(weights[name], t) for name, t in evaluated[0].items())
    shutil.copytree(tiny_model_path(), tmp_path / "step-1")
    save_file(weights, tmp_path / "step-1" / "model.safetensors")
    by_model = _eval_result(
        capsys, ["--run", str(out), "--model", str(tmp_path / "step-1"), "--samples", "2"]
    )
    first = _eval_result(capsys, ["--run", str(out), "--checkpoint", "1", "--samples", "2"])
    assert first == {"checkpoint_step": 1, **by_model}
    assert all(torch.equal(evaluated[3][name], weights[name]) for name in evaluated[3])
    assert all(torch.equal(evaluated[2][name], weights[name]) for name in evaluated[2])


def test_eval_of_a_checkpoint_refuses_what_it_cannot_take_in_one_line(tmp_path, capsys):
    out = tmp_path / "run"
    _tiny_run_with_checkpoints(out)
    refusals = {
        ("--checkpoint",): "give --run, and no --model",  # no run
        ("--run", str(out), "--checkpoint", "--model", str(tiny_model_path())): "give --run, and no --model",
        ("--run", str(out), "--checkpoint", "7"): "keeps the checkpoints of steps 1, 2",
        ("--run", str(out), "--checkpoint", "one"): "keeps the checkpoints of steps 1, 2",
        ("--run", str(tmp_path), "--checkpoint"): "has no checkpoint yet",
    }
    for argv, message in refusals.items():
        assert cli.main(["eval", *argv, "--samples", "1"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
    # a damaged checkpoint is refused, not evaluated
    tensors = out / "checkpoints" / "step-00000002" / "tensors.safetensors"
    tensors.write_bytes(tensors.read_bytes()[:-8])
    assert cli.main(["eval", "--run", str(out), "--checkpoint", "--samples", "1"]) == 2
    assert "does not match its checksum" in capsys.readouterr().err
    # an unfinished run: --run alone names --checkpoint, which evaluates the newest checkpoint there is
    shutil.rmtree(out / "final")
    assert cli.main(["eval", "--run", str(out), "--samples", "1"]) == 2
    assert "evaluate its newest checkpoint with --checkpoint" in capsys.readouterr().err
    assert (
        _eval_result(capsys, ["--run", str(out), "--checkpoint", "1", "--samples", "1"])["checkpoint_step"]
        == 1
    )


def test_a_checkpoint_of_an_adapter_is_refused_in_one_line():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="holds 1 tensors, not the whole model .1 missing, e.g. '0.bias'"):
        cli.load_run_weights(model, 3, {"0.weight": torch.zeros(2, 2)}, "runs/x")


def test_eval_of_a_finished_run_reproduces_its_summary_chat_llama(chat_llama, tmp_path, capsys):
    # A reward that differs between completions of a random model, so the accuracy is not simply 0.
    rows = [{"prompt": f"Tell Me Something About {i}!"} for i in range(30)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "rewards.py").write_text(
        "def variety(completions, **columns):\n    return [len(set(c)) / 10 for c in completions]\n"
    )
    settings = {
        "task": f"jsonl:{tmp_path / 'prompts.jsonl'}",
        "reward": f"{tmp_path / 'rewards.py'}:variety",
        "system_prompt": "Answer in one word.",
        "max_new_tokens": 6,
    }
    summary, result = _summary_and_eval(chat_llama, tmp_path / "run", capsys, settings)
    assert summary["final_test_accuracy"] > 0
    assert result["greedy_accuracy"] == summary["final_test_accuracy"]
    assert result["prompt_style"] == "instruct"

    # --run takes the run's trained model, task, reward, prompts and test size from its directory
    by_run = _eval_result(capsys, ["--run", str(tmp_path / "run"), "--samples", "1"])
    assert by_run == result
    # a flag given beside --run wins over the run's setting
    fewer = _eval_result(capsys, ["--run", str(tmp_path / "run"), "--samples", "1", "--limit", "3"])
    assert fewer["examples"] == 3 and fewer["task"] == result["task"]
    # the model the run started from, evaluated with the run's settings
    base = _eval_result(
        capsys, ["--run", str(tmp_path / "run"), "--samples", "1", "--model", str(chat_llama)]
    )
    assert base["greedy_accuracy"] == summary["base_test_accuracy"]


def test_eval_of_a_run_reads_its_relative_paths_where_the_run_read_them(
    chat_llama, tmp_path, capsys, monkeypatch
):
    project = tmp_path / "project"
    project.mkdir()
    rows = [{"prompt": f"Say Something About {i}!"} for i in range(20)]
    (project / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (project / "rewards.py").write_text(
        "def variety(completions, **columns):\n    return [len(set(c)) / 10 for c in completions]\n"
    )
    monkeypatch.chdir(project)  # the run is started with paths relative to its directory
    settings = {"task": "jsonl:prompts.jsonl", "reward": "rewards.py:variety", "max_new_tokens": 6}
    summary, _ = _summary_and_eval(chat_llama, project / "run", capsys, settings)
    assert summary["final_test_accuracy"] > 0

    monkeypatch.chdir(tmp_path)  # where neither file is
    by_run = _eval_result(capsys, ["--run", str(project / "run"), "--samples", "1"])
    assert by_run["greedy_accuracy"] == summary["final_test_accuracy"]
    assert by_run["task"] == f"jsonl:{project / 'prompts.jsonl'}"

    # a run.json from before the working directory was recorded: its paths are read as they are, here
    # relative to this directory, and the error names a file it did not find
    run_json = project / "run" / "run.json"
    identity = json.loads(run_json.read_text())
    del identity["working_directory"]
    run_json.write_text(json.dumps(identity))
    assert cli.main(["eval", "--run", str(project / "run"), "--samples", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert str(tmp_path / "rewards.py") in err or str(tmp_path / "prompts.jsonl") in err
    assert "\n" not in err

    # a run whose rows were given in code (ESTrainer) names no file to read them from
    code_rows = {**identity, "config": {**identity["config"], "task": "dataset", "reward": ""}}
    run_json.write_text(json.dumps(code_rows))
    assert cli.main(["eval", "--run", str(project / "run"), "--samples", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "rows were given in code" in err and "--dataset FILE" in err and "\n" not in err
    rows_given = [
        "--dataset",
        str(project / "prompts.jsonl"),
        "--reward",
        f"{project / 'rewards.py'}:variety",
    ]
    beside = _eval_result(capsys, ["--run", str(project / "run"), "--samples", "1", *rows_given])
    assert beside["examples"] > 0

    # a damaged run.json: one line, and a way to evaluate without it
    run_json.write_text('{"run_id": "01')
    assert cli.main(["eval", "--run", str(project / "run"), "--samples", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "is damaged" in err and "--model" in err and "--overwrite" not in err and "\n" not in err


def test_eval_of_a_dataset_run_takes_its_data_files_and_reward_weights(
    chat_llama, tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    rows = [{"prompt": f"Name A Thing Like {i}!", "size": i % 4} for i in range(30)]
    Path("data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    Path("rewards.py").write_text(
        "def variety(completions, size, **columns):\n"
        "    return [len(set(c)) / 10 + s for c, s in zip(completions, size)]\n"
    )
    settings = {
        "task": "dataset",
        "dataset": "data.jsonl",
        "reward": "rewards.py:variety",
        "reward_weights": "0.5",
        "max_new_tokens": 6,
    }
    summary, by_flags = _summary_and_eval(chat_llama, tmp_path / "run", capsys, settings)
    assert summary["final_test_accuracy"] > 0
    assert by_flags["greedy_accuracy"] == summary["final_test_accuracy"]

    # --dataset replaces the task, as it does for `fastes train`
    flags = ["--dataset", "data.jsonl", "--reward", "rewards.py:variety", "--reward_weights", "0.5"]
    no_task = _eval_result(
        capsys,
        [
            "--model",
            str(tmp_path / "run" / "final"),
            "--limit",
            "12",
            "--samples",
            "1",
            "--max_new_tokens",
            "6",
            *flags,
        ],
    )
    assert no_task == by_flags

    monkeypatch.chdir(tmp_path / "run")  # where neither file is
    by_run = _eval_result(capsys, ["--run", str(tmp_path / "run"), "--samples", "1"])
    assert by_run["greedy_accuracy"] == summary["final_test_accuracy"]
    unweighted = _eval_result(
        capsys, ["--run", str(tmp_path / "run"), "--samples", "1", "--reward_weights", "1"]
    )
    assert unweighted["greedy_accuracy"] == pytest.approx(2 * by_run["greedy_accuracy"])


def test_eval_of_a_directory_without_a_finished_run_says_so_in_one_line(tmp_path, capsys):
    assert cli.main(["eval", "--run", str(tmp_path), "--samples", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "holds no fastes run (no run.json)" in err and "\n" not in err

    out = tmp_path / "run"
    train(
        load_config(
            None,
            {
                "out_dir": str(out),
                "eval_size": 4,
                "batch_size": 4,
                "progress": False,
                "es.iterations": 1,
                "es.population": 2,
            },
        )
    )
    (out / "final").rename(tmp_path / "moved")  # as if the run had stopped before its end
    assert cli.main(["eval", "--run", str(out), "--samples", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "has no trained model in final/ yet" in err and "--resume" in err and "\n" not in err
    # with a model named, the run's settings serve without final/
    named = _eval_result(capsys, ["--run", str(out), "--samples", "1", "--model", str(tmp_path / "moved")])
    assert named["examples"] == 4


def test_eval_reports_the_lenient_reading_of_an_instruct_form(capsys):
    args = ["eval", "--task", "arithmetic", "--prompt_style", "instruct", "--limit", "3", "--samples", "1"]
    assert cli.main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert 0 <= result["lenient_accuracy"] <= 1 and result["lenient_accuracy"] >= result["greedy_accuracy"]


def test_heldout_tasks_are_asked_in_the_runs_style():
    cfg = load_config(None, {"prompt_style": "instruct"})
    tasks = heldout_tasks(cfg, ("countdown", "compare"), 250)
    for name, task in tasks.items():
        examples = task.split("test")
        assert len(examples) >= 250, name
        assert examples[0].prompt.endswith(task.task.instruction), name
        assert examples[0].meta["answer_prefix"] == "Answer:" and hasattr(task, "lenient_score"), name
    plain = heldout_tasks(load_config(None, {"prompt_style": "plain"}), ("compare",), 10)["compare"]
    assert "Answer" not in plain.split("test")[0].prompt


def test_an_answer_prefix_ends_the_rendered_prompt(chat_llama):
    from transformers import AutoTokenizer

    chat_tokenizer = AutoTokenizer.from_pretrained(chat_llama)
    cfg = load_config(None, {"prompt_style": "instruct"})
    examples = get_task("compare", n_train=2, n_test=1, style="instruct").split("train")
    templated = evaluation.render_prompts(cfg, chat_tokenizer, examples)
    assert templated[0].endswith("<|im_start|>assistant\nAnswer:")
    plain = evaluation.render_prompts(replace(cfg, chat_template="off"), chat_tokenizer, examples)
    assert plain[0] == f"{examples[0].prompt} Answer:"  # no template: the reply follows the question
    none = get_task("compare", n_train=2, n_test=1, style="instruct", answer_prefix="").split("train")
    assert evaluation.render_prompts(cfg, chat_tokenizer, none)[0].endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize(
    "settings, advice",
    [
        ({"task": "arithmetic", "prompt_style": "instruct"}, "--answer_prefix 'Answer:'"),
        ({"task": "compare", "prompt_style": "instruct", "answer_prefix": ""}, "--answer_prefix auto"),
    ],
)
def test_eval_says_when_the_model_states_few_answers(settings, advice, capsys):
    # The tiny character model, asked in words, states no answer the verifier can read.
    flags = [f"--{key}={value}" for key, value in settings.items()]
    assert cli.main(["eval", "--limit", "3", "--samples", "1", *flags]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert result["format_rate"] < 0.5
    lines = [line for line in captured.err.splitlines() if line.startswith("fastes eval:")]
    assert len(lines) == 1 and "% of the problems" in lines[0] and advice in lines[0]


def test_the_general_text_corpus():
    pairs = general_text_corpus()
    assert len(pairs) >= 10
    for context, continuation in pairs:
        assert context.endswith(".") and continuation.startswith(" ") and len(continuation) > 80
        assert context.isascii() and continuation.isascii()
