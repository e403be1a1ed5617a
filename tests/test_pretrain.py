import argparse
import inspect
import json

import pytest
import torch

from fastes.cli import main
from fastes.models.loading import load_model, tiny_model_path
from fastes.run.pretrain import SHIPPED_STYLE_MIX, _rows, pretrain
from fastes.tasks import get_task
from fastes.tasks.base import Score


def test_short_pretrain_lowers_loss_and_writes_a_loadable_directory(tmp_path):
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    metrics = pretrain(tmp_path, steps=30, batch_size=16, tasks=["reverse"], eval_examples=4, progress=False)
    assert torch.equal(torch.random.get_rng_state(), before)  # the caller's RNG is untouched
    assert metrics["loss"] < 0.7 * metrics["initial_loss"]
    assert set(metrics["greedy_accuracy"]) == {"reverse"}
    assert json.loads((tmp_path / "pretrain.json").read_text())["loss"] == metrics["loss"]
    model, tok = load_model(tmp_path)
    assert sum(p.numel() for p in model.parameters()) == metrics["params"]
    assert tok.padding_side == "left"


def test_pretrain_is_deterministic_for_a_seed(tmp_path):
    kw = dict(steps=3, batch_size=4, tasks=["compare"], eval_examples=2, progress=False)
    a = pretrain(tmp_path / "a", seed=1, **kw)
    b = pretrain(tmp_path / "b", seed=1, **kw)
    c = pretrain(tmp_path / "c", seed=2, **kw)
    assert a["initial_loss"] == b["initial_loss"] and a["loss"] == b["loss"]
    assert a["loss"] != c["loss"]
    wa = load_model(tmp_path / "a")[0].state_dict()
    wb = load_model(tmp_path / "b")[0].state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_distractor_rows_put_that_share_on_wrong_but_well_formed_solutions():
    task = get_task("countdown", n_train=40, n_test=0)
    plain = _rows(task, 0.0, seed=0)
    assert [(p, s) for p, s, _ in plain] == [(ex.prompt, ex.solution) for ex in task.split("train")]
    rows = _rows(task, 0.3, seed=0)
    assert sum(w for _, _, w in rows) == pytest.approx(1.0)
    by_prompt = {ex.prompt: ex for ex in task.split("train")}
    wrong = [(p, s, w) for p, s, w in rows if s != by_prompt[p].solution]
    assert len(wrong) >= 35  # nearly every problem has a wrong expression over its numbers
    assert sum(w for _, _, w in wrong) == pytest.approx(0.3 * len(wrong) / 40)
    for prompt, solution, _ in wrong:
        assert task.score(by_prompt[prompt], solution).format == 1.0
        assert task.score(by_prompt[prompt], solution).answer == 0.0
    assert _rows(get_task("compare", n_train=5, n_test=0), 0.3, seed=0) == _rows(
        get_task("compare", n_train=5, n_test=0), 0.0, seed=0
    )  # other tasks keep their plain rows


def test_style_mix_puts_that_share_on_the_unverifiable_style_and_keeps_the_rest():
    task = get_task("countdown", n_train=40, n_test=0)
    examples = {ex.prompt: ex for ex in task.split("train")}
    rows = _rows(task, 0.0, seed=0, style_mix=0.4)
    assert sum(w for _, _, w in rows) == pytest.approx(1.0)
    plain = [(p, s, w) for p, s, w in rows if s == examples[p].solution]
    styled = [(p, s, w) for p, s, w in rows if s != examples[p].solution]
    assert len(plain) == len(styled) == 40  # every problem in both styles
    assert sum(w for _, _, w in styled) == pytest.approx(0.4)
    for prompt, text, _ in styled:
        ex = examples[prompt]
        assert text == ex.solution[:-1] + f"={ex.meta['target']};"
        assert task.score(ex, text) == Score(0.0, 0.0)  # the verifier refuses the style
    # with distractors too, each kind keeps its share and is split by style
    mixed = _rows(task, 0.3, seed=0, style_mix=0.4)
    assert sum(w for _, _, w in mixed) == pytest.approx(1.0)
    assert sum(w for p, s, w in mixed if s == examples[p].solution) == pytest.approx(0.6 * 0.7, abs=0.03)
    other = get_task("reverse", n_train=5, n_test=0)
    assert _rows(other, 0.0, seed=0, style_mix=0.4) == _rows(other, 0.0, seed=0)


def test_a_share_outside_0_1_is_refused_before_any_work(tmp_path, capsys):
    for bad in (-0.1, 1.0, float("nan")):
        with pytest.raises(ValueError, match="style_mix is a share"):
            pretrain(tmp_path / "x", steps=1, tasks=["reverse"], style_mix=bad, progress=False)
    assert not (tmp_path / "x").exists()
    with pytest.raises(SystemExit) as exit:
        main(["pretrain", "--out", str(tmp_path / "y"), "--style_mix", "1.5"])
    err = capsys.readouterr().err.strip()
    assert exit.value.code == 2 and len(err.splitlines()) == 1 and "[0, 1)" in err, err
    assert not (tmp_path / "y").exists()


def test_style_mix_is_recorded(tmp_path):
    kw = dict(steps=2, batch_size=4, tasks=["countdown"], eval_examples=2, progress=False)
    assert pretrain(tmp_path, style_mix=0.5, **kw)["style_mix"] == 0.5
    assert json.loads((tmp_path / "pretrain.json").read_text())["style_mix"] == 0.5


def test_the_default_recipe_rebuilds_the_shipped_model():
    shipped = json.loads((tiny_model_path() / "pretrain.json").read_text())
    defaults = {k: v.default for k, v in inspect.signature(pretrain).parameters.items()}
    assert shipped["style_mix"] == SHIPPED_STYLE_MIX == defaults["style_mix"]
    assert (shipped["steps"], shipped["seed"], shipped["distractors"]) == (
        defaults["steps"],
        defaults["seed"],
        defaults["distractors"],
    )


def test_fastes_pretrain_and_the_module_take_the_same_flags():
    from fastes.cli import build_parser
    from fastes.run.pretrain import add_arguments

    module = argparse.ArgumentParser()
    add_arguments(module)
    command = build_parser()._subparsers._group_actions[0].choices["pretrain"]
    flags = {a.dest: (a.option_strings, a.default, a.required) for a in module._actions}
    assert flags == {a.dest: (a.option_strings, a.default, a.required) for a in command._actions}
    assert {"distractors", "threads", "style_mix", "out"} <= set(flags)
