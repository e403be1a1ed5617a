"""Population-batched evaluation equals member-by-member evaluation of the same members."""

import pytest
import torch
from conftest import NOISE_KINDS

import fastes
from fastes.es.population import PopulationLinear, member_groups, population_batched
from fastes.models.generation import generate

PROMPTS = ["cd 2 4 8 > 24:", "12+34=", "rev 123:", "cmp 5 7:"]


def make_es(model, population=4, seed=0, noise="gaussian"):
    return fastes.ES(
        fastes.linear_weights(model), sigma=0.05, lr=0.01, population=population, seed=seed, noise=noise
    )


@torch.no_grad()
@pytest.mark.parametrize("noise_kind", NOISE_KINDS)
def test_batched_logits_equal_member_by_member(tiny, noise_kind):
    model, tokenizer = tiny
    es = make_es(model, noise=noise_kind)
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    expected = []
    for member in es.members():
        with member:
            expected.append(model(**batch).logits)
    grouped = {k: v.repeat(es.population, 1) for k, v in batch.items()}  # rows grouped by member
    with population_batched(es, model) as members:
        assert [m.index for m in members] == list(range(es.population))
        logits = model(**grouped).logits
    torch.testing.assert_close(logits, torch.cat(expected), rtol=1e-4, atol=1e-5)
    # The members really differ from each other, so the comparison above is not vacuous.
    assert (expected[0] - expected[1]).abs().max() > 1e-3


def test_batched_greedy_generations_are_identical(tiny):
    model, tokenizer = tiny
    es = make_es(model, population=6, seed=3)
    expected = []
    for member in es.members():
        with member:
            expected += generate(model, tokenizer, PROMPTS, max_new_tokens=8).texts
    with population_batched(es, model) as members:
        got = generate(model, tokenizer, PROMPTS * len(members), max_new_tokens=8).texts
    assert got == expected


def test_materialised_groups_fit_the_memory_budget_and_generate_the_same(tiny):
    model, tokenizer = tiny
    es = make_es(model, population=6, seed=4)
    copy = sum(p.numel() * p.element_size() for group in es.param_groups for p in group["params"])
    assert [len(g) for g in member_groups(es, "materialised", 2.5 * copy)] == [2, 2, 2]
    assert [len(g) for g in member_groups(es, "materialised", 0.1 * copy)] == [1] * 6  # at least one
    assert [len(g) for g in member_groups(es, "materialised", 100 * copy)] == [6]
    assert [len(g) for g in member_groups(es, "lowrank", 0.1 * copy)] == [6]  # nothing materialised
    with population_batched(es, model) as members:
        together = generate(model, tokenizer, PROMPTS * len(members), max_new_tokens=8).texts
    grouped = []
    for group in member_groups(es, "materialised", 2.5 * copy):
        with population_batched(es, model, members=group) as members:
            assert members == group
            grouped += generate(model, tokenizer, PROMPTS * len(members), max_new_tokens=8).texts
    assert grouped == together


def test_modules_are_put_back_and_weights_untouched(tiny):
    model, _ = tiny
    before = {k: v.clone() for k, v in model.state_dict().items()}
    modules = dict(model.named_modules())
    es = make_es(model)
    with pytest.raises(RuntimeError, match="inside"), population_batched(es, model):
        assert any(isinstance(m, PopulationLinear) for m in model.modules())
        raise RuntimeError("inside")
    assert not any(isinstance(m, PopulationLinear) for m in model.modules())
    assert all(modules[name] is m for name, m in model.named_modules())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


@pytest.mark.parametrize("mode", ["materialised", "lowrank"])
def test_a_population_layer_registers_its_base_and_nothing_else(mode):
    """A population layer sets its plain attributes past nn.Module's checks; its base projection is
    still its one submodule, and its state is the base's (no tensor of its own becomes a buffer)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5))
    es = fastes.ES(
        fastes.linear_weights(model, warn=False),
        sigma=0.1,
        lr=0.01,
        population=4,
        noise_type="lowrank" if mode == "lowrank" else "full",
    )
    with population_batched(es, model, mode=mode):
        layer = model[0]
        assert [name for name, _ in layer.named_children()] == ["base"]
        assert sorted(layer.state_dict()) == ["base.bias", "base.weight"]
        assert list(layer.buffers()) == [] and len(list(layer.parameters())) == 2


def test_batched_mode_refuses_non_linear_parameters_and_bad_row_counts(tiny):
    model, tokenizer = tiny
    es = fastes.ES(fastes.linear_weights(model, include_norms=True), sigma=0.05, lr=0.01, population=2)
    only_projections = r"projection weights \(nn.Linear, Conv1D\) only"
    with pytest.raises(ValueError, match=only_projections), population_batched(es, model):
        pass
    es = make_es(model)
    batch = tokenizer(PROMPTS[:3], return_tensors="pt", padding=True)
    with pytest.raises(ValueError, match="multiple of 4 rows"), population_batched(es, model):
        model(**batch)


@torch.no_grad()
@pytest.mark.parametrize("transposed", [False, True])
def test_members_weights_are_held_in_the_batched_matmuls_layout(transposed):
    """A materialised layer keeps its members' weights [members, in, out], contiguous (the layout
    torch's CPU batched matmul runs fastest), for nn.Linear and Conv1D alike, and computes each member's
    rows with its own weight."""
    torch.manual_seed(0)
    members, rows, in_features, out_features = 3, 5, 7, 4
    base = torch.nn.Linear(in_features, out_features, bias=True)
    per_member = torch.randn(members, out_features, in_features)
    given = per_member.transpose(1, 2).contiguous() if transposed else per_member  # the weight's own layout
    layer = PopulationLinear(base, given, transposed)
    assert layer.weights.shape == (members, in_features, out_features) and layer.weights.is_contiguous()
    x = torch.randn(members * rows, in_features)
    expected = torch.cat(
        [
            torch.nn.functional.linear(x[m * rows : (m + 1) * rows], per_member[m], base.bias)
            for m in range(members)
        ]
    )
    torch.testing.assert_close(layer(x), expected, rtol=1e-6, atol=1e-6)


@torch.no_grad()
def test_materialised_antithetic_pairs_are_written_from_one_pass_over_their_noise(tiny, monkeypatch):
    """Building the members' weights writes an antithetic pair from one pass over its noise (the twin
    from the same noise); a member whose twin is not in the group gets a write of its own; all of them
    in one call. The logits equal member by member evaluation's."""
    from fastes.engine import ops

    model, tokenizer = tiny
    es = make_es(model, population=6, seed=5)
    every = list(es.members())
    group = [every[0], every[1], every[3], every[4]]  # pair (0, 1); 3 and 4 without their twins
    calls = []
    perturb_each = ops.perturb_each

    def counted(sources, tensor_ids, writes, **kwargs):
        calls.append([write.twins is not None for write in writes])
        return perturb_each(sources, tensor_ids, writes, **kwargs)

    monkeypatch.setattr(ops, "perturb_each", counted)
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    grouped = {k: v.repeat(len(group), 1) for k, v in batch.items()}
    with population_batched(es, model, members=group):
        logits = model(**grouped).logits
    assert calls == [[True, False, False]]
    expected = []
    for member in group:
        with member:
            expected.append(model(**batch).logits)
    torch.testing.assert_close(logits, torch.cat(expected), rtol=1e-4, atol=1e-5)


@torch.no_grad()
def test_materialised_low_rank_pairs_make_their_noise_once(tiny, monkeypatch):
    """With low-rank noise, an antithetic pair's weights come from one product of its factors per tensor
    (the twin with -sigma), and the logits equal member by member evaluation's."""
    from fastes.engine import lowrank

    model, tokenizer = tiny
    es = fastes.ES(
        fastes.linear_weights(model), sigma=0.05, lr=0.01, population=4, seed=3, noise_type="lowrank", rank=2
    )
    members = list(es.members())
    made = []
    noise_matrix = lowrank.noise_matrix
    monkeypatch.setattr(lowrank, "noise_matrix", lambda *args: made.append(args[:2]) or noise_matrix(*args))
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    grouped = {k: v.repeat(len(members), 1) for k, v in batch.items()}
    with population_batched(es, model, mode="materialised", members=members):
        logits = model(**grouped).logits
    tensors = len(es.param_groups[0]["params"])
    assert len(made) == len(set(made)) == 2 * tensors  # two pairs, one product per tensor each
    expected = []
    for member in members:
        with member:
            expected.append(model(**batch).logits)
    torch.testing.assert_close(logits, torch.cat(expected), rtol=1e-4, atol=1e-5)
