"""Low-rank noise: factors from the noise contract, factored forward, GEMM update, ES with it."""

import math

import pytest
import torch
from conftest import NOISE_KINDS

import fastes
from fastes import lowrank, noise
from fastes.batched import LowRankLinear, population_batched


def test_noise_matrix_is_the_scaled_product_of_contract_factors():
    key, tid = noise.member_key(1, 2, 3), noise.tensor_id("w")
    a, b = lowrank.factors(key, tid, torch.Size((30, 20)), 4, "cpu")
    torch.testing.assert_close(a.flatten(), noise.normal(key, tid, 120, stream=noise.STREAM_LOWRANK_A))
    torch.testing.assert_close(b.flatten(), noise.normal(key, tid, 80, stream=noise.STREAM_LOWRANK_B))
    eps = lowrank.noise_matrix(key, tid, torch.Size((30, 20)), 4, "cpu")
    torch.testing.assert_close(eps, a @ b.T / 2)
    assert torch.linalg.matrix_rank(eps) == 4
    big = lowrank.noise_matrix(key, tid, torch.Size((400, 300)), 8, "cpu")
    assert abs(float(big.var()) - 1) < 0.1  # entries have unit variance, like full-rank noise


def test_low_rank_sign_factors():
    key, tid, shape = noise.member_key(3, 1, 2), 11, torch.Size((30, 20))
    a, b = lowrank.factors(key, tid, shape, 4, "cpu", noise_kind="rademacher")
    assert torch.equal(a.flatten(), noise.rademacher(key, tid, 120, stream=noise.STREAM_LOWRANK_SIGN_A))
    assert torch.equal(b.flatten(), noise.rademacher(key, tid, 80, stream=noise.STREAM_LOWRANK_SIGN_B))
    eps = lowrank.noise_matrix(key, tid, shape, 4, "cpu", noise_kind="rademacher")
    assert torch.equal(eps, a @ b.T / 2)
    assert set((eps * 2).unique().tolist()) <= {-4.0, -2.0, 0.0, 2.0, 4.0}  # sums of 4 signs, over sqrt(4)
    big = lowrank.noise_matrix(key, tid, torch.Size((400, 300)), 8, "cpu", noise_kind="rademacher")
    assert abs(big.mean().item()) < 0.02 and abs(big.var().item() - 1) < 0.05
    # Rank 1 sign factors give a sign matrix.
    assert set(
        lowrank.noise_matrix(key, tid, shape, 1, "cpu", noise_kind="rademacher").unique().tolist()
    ) == {-1.0, 1.0}


def test_update_equals_the_plain_formula():
    w = torch.randn(6, 5)
    before = w.clone()
    keys = [noise.member_key(0, 0, j) for j in range(3)]
    weights = [0.5, -1.0, 2.0]
    lowrank.update(w, 7, keys, weights, coef=0.1, decay=0.9, rank=2)
    expected = before.double() * 0.9
    for key, weight in zip(keys, weights):
        a, b = lowrank.factors(key, 7, w.shape, 2, "cpu")
        expected += 0.1 * weight * (a.double() @ b.double().T) / math.sqrt(2)
    torch.testing.assert_close(w.double(), expected, rtol=0, atol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("noise_kind", NOISE_KINDS)
def test_factored_forward_equals_materialised_low_rank_weights(tiny, noise_kind):
    model, tokenizer = tiny
    es = fastes.ES(
        fastes.linear_weights(model), sigma=0.05, lr=0.01, population=4, seed=2, noise=noise_kind,
        noise_type="lowrank", rank=2,
    )  # fmt: skip
    batch = tokenizer(["cd 2 4 8 > 24:", "12+34="], return_tensors="pt", padding=True)
    expected = []
    for member in es.members():
        with member:
            expected.append(model(**batch).logits)
    grouped = {k: v.repeat(es.population, 1) for k, v in batch.items()}
    with population_batched(es, model, mode="lowrank"):
        assert sum(isinstance(m, LowRankLinear) for m in model.modules()) == len(es.param_groups[0]["params"])
        factored = model(**grouped).logits
    with population_batched(es, model, mode="materialised"):
        materialised = model(**grouped).logits
    torch.testing.assert_close(factored, torch.cat(expected), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(materialised, torch.cat(expected), rtol=1e-4, atol=1e-4)


def test_modes_refuse_the_other_noise_type(tiny):
    model, _ = tiny
    full = fastes.ES(fastes.linear_weights(model), sigma=0.05, lr=0.01, population=2)
    with (
        pytest.raises(ValueError, match="needs ES\\(noise_type='lowrank'\\)"),
        population_batched(full, model, mode="lowrank"),
    ):
        pass
    low = fastes.ES(
        fastes.linear_weights(model),
        sigma=0.05,
        lr=0.01,
        population=2,
        noise_type="lowrank",
        backend="triton",
    )
    with pytest.raises(ValueError, match="full-rank noise"), population_batched(low, model, mode="virtual"):
        pass
    with pytest.raises(ValueError, match="unknown noise_type"):
        fastes.ES(fastes.linear_weights(model), sigma=0.05, lr=0.01, population=2, noise_type="sparse")


def test_low_rank_es_improves_a_toy_objective_and_replays_exactly():
    torch.manual_seed(0)
    layer = torch.nn.Linear(12, 10, bias=True)
    target = torch.randn(10, 12) * 0.3
    base = {k: v.clone() for k, v in layer.state_dict().items()}

    def reward() -> float:
        return -((layer.weight - target) ** 2).sum().item() - (layer.bias**2).sum().item()

    params = fastes.linear_weights(layer, include_biases=True)  # the bias keeps full-rank noise
    es = fastes.ES(params, sigma=0.05, lr=0.02, population=16, seed=5, noise_type="lowrank", rank=1)
    start = reward()
    for _ in range(40):
        es.step(reward)
    assert reward() > start + 0.2 * abs(start)
    trained = {k: v.clone() for k, v in layer.state_dict().items()}
    layer.load_state_dict(base)
    fastes.replay(fastes.linear_weights(layer, include_biases=True), es.state_dict())
    assert all(torch.equal(v, trained[k]) for k, v in layer.state_dict().items())
