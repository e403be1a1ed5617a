"""Sign (Rademacher) noise in fastes.ES, the config and the CLI: members, restore, resume, replay, state.

Waiting to be folded into tests/test_es.py and tests/test_config.py (issue #22, item 7); the per-op sign
tests live in the per-op files (test_noise, test_perturb, test_update, test_virtual, test_lowrank,
test_batched, test_compiled, test_benchmarks_quick), parametrised over the noise kind.
"""

import pytest
import torch

import fastes
from fastes import noise
from fastes.cli import main
from fastes.config import ConfigError, load_config


def make_net(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).to(dtype)


def snapshot(net):
    return {k: v.clone() for k, v in net.state_dict().items()}


def reward(net):
    x = torch.linspace(-1, 1, 48).view(8, 6)
    return -((net(x.to(net[0].weight.dtype)).float() - x[:, :1].sin()) ** 2).mean().item()


def test_members_are_exactly_sigma_signs_and_restore_exactly():
    net = make_net()
    es = fastes.ES(fastes.linear_weights(net), sigma=0.25, lr=0.1, population=4, seed=3, noise="rademacher")
    before = snapshot(net)
    for member in es.members():
        with member:
            for name, p in fastes.linear_weights(net):
                s = noise.rademacher(member.key, noise.tensor_id(name), p.numel()).view(p.shape)
                assert torch.equal(p, before[name] + member.sign * 0.25 * s)
        assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())


@pytest.mark.parametrize("dtype, rounding", [(torch.float32, False), (torch.bfloat16, True)])
def test_resume_equals_uninterrupted_and_replay_is_exact(dtype, rounding):
    options = dict(
        sigma=0.05, lr=0.01, population=8, seed=21, stochastic_rounding=rounding, noise="rademacher"
    )
    straight = make_net(dtype=dtype)
    base = snapshot(straight)
    es = fastes.ES(fastes.linear_weights(straight), **options)
    for _ in range(6):
        es.step(lambda: reward(straight))
    assert any(not torch.equal(v, base[k]) for k, v in straight.state_dict().items())

    interrupted = make_net(dtype=dtype)
    es1 = fastes.ES(fastes.linear_weights(interrupted), **options)
    for _ in range(3):
        es1.step(lambda: reward(interrupted))
    state, weights = es1.state_dict(), snapshot(interrupted)
    assert state["noise"] == "rademacher"
    resumed = make_net(seed=99, dtype=dtype)
    resumed.load_state_dict(weights)
    es2 = fastes.ES(fastes.linear_weights(resumed), **options)
    es2.load_state_dict(state)
    for _ in range(3):
        es2.step(lambda: reward(resumed))
    assert all(torch.equal(v, straight.state_dict()[k]) for k, v in resumed.state_dict().items())

    replayed = make_net(seed=99, dtype=dtype)
    replayed.load_state_dict(base)
    fastes.replay(fastes.linear_weights(replayed), es2.state_dict())
    assert all(torch.equal(v, straight.state_dict()[k]) for k, v in replayed.state_dict().items())


def test_loading_a_state_of_the_other_noise_fails_clearly_and_changes_nothing():
    net = make_net()
    sign = fastes.ES(fastes.linear_weights(net), sigma=0.1, lr=0.1, population=4, noise="rademacher")
    sign.step(lambda: reward(net))
    gauss = fastes.ES(fastes.linear_weights(net), sigma=0.1, lr=0.1, population=4)
    with pytest.raises(ValueError, match="saved with noise='rademacher' but this ES uses noise='gaussian'"):
        gauss.load_state_dict(sign.state_dict())
    assert gauss.generation == 0 and gauss.noise == "gaussian"
    with pytest.raises(ValueError, match="saved with noise='gaussian' but this ES uses noise='rademacher'"):
        sign.load_state_dict(gauss.state_dict())
    # A state from before sign noise existed has no "noise" entry: it was Gaussian.
    old = gauss.state_dict()
    del old["noise"]
    gauss.load_state_dict(old)
    with pytest.raises(ValueError, match="saved with noise='gaussian'"):
        sign.load_state_dict(old)


def test_replay_uses_the_recorded_noise():
    net = make_net()
    base = snapshot(net)
    es = fastes.ES(fastes.linear_weights(net), sigma=0.05, lr=0.05, population=4, seed=1, noise="rademacher")
    for _ in range(2):
        es.step(lambda: reward(net))
    as_gaussian = {**es.state_dict(), "noise": "gaussian"}
    other = make_net()
    other.load_state_dict(base)
    fastes.replay(fastes.linear_weights(other), as_gaussian)
    assert not torch.equal(other[0].weight, net[0].weight)  # the noise really decides the weights


def test_config_and_cli_take_the_noise(capsys):
    assert load_config(None, {}).es.noise == "gaussian"
    assert load_config(None, {"es.noise": "rademacher"}).es.noise == "rademacher"
    with pytest.raises(ConfigError, match="es.noise: 'sign' is not one of"):
        load_config(None, {"es.noise": "sign"})
    assert main(["train", "--es.noise", "sign"]) == 2
    assert "es.noise" in capsys.readouterr().err
