import json

import pytest
import torch

from fastes.models import load_model
from fastes.pretrain import _rows, pretrain
from fastes.tasks import get_task


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
