import json

import torch

from fastes.models import load_model
from fastes.pretrain import pretrain


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
