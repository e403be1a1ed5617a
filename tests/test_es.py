"""fastes.ES: the optimizer-like object, on toy objectives with the torch backend."""

import functools
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import NOISE_KINDS

import fastes
from fastes.engine import noise
from fastes.es.shaping import centered_rank, group_zscore, shape_rewards, zscore


def make_net(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).to(dtype)


def quadratic_reward(net: torch.nn.Module, target: dict[str, torch.Tensor]) -> float:
    """-||W - W*||^2 over the linear weights: maximised at the target weights."""
    return -sum(((p.float() - target[n]) ** 2).sum().item() for n, p in fastes.linear_weights(net))


def target_for(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(123)
    return {n: torch.randn(p.shape, generator=gen) * 0.3 for n, p in fastes.linear_weights(net)}


def snapshot(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs"


@pytest.mark.parametrize("shaping", ["centered_rank", "zscore", "raw"])
def test_es_improves_quadratic_with_every_shaping(shaping):
    net = make_net()
    target = target_for(net)
    es = fastes.ES(fastes.linear_weights(net), sigma=0.05, lr=0.01, population=16, seed=3, shaping=shaping)
    start = quadratic_reward(net, target)
    for _ in range(25):
        es.step(lambda: quadratic_reward(net, target))
    assert quadratic_reward(net, target) > start + 0.25 * abs(start)


def test_group_zscore_improves_with_per_prompt_rewards():
    net = make_net()
    target = target_for(net)

    def per_prompt() -> list[float]:  # two "prompts": the two layers' distances separately
        return [-((p.float() - target[n]) ** 2).sum().item() for n, p in fastes.linear_weights(net)]

    es = fastes.ES(
        fastes.linear_weights(net), sigma=0.05, lr=0.01, population=16, seed=3, shaping="group_zscore"
    )
    start = quadratic_reward(net, target)
    for _ in range(25):
        es.step(per_prompt)
    assert quadratic_reward(net, target) > start + 0.25 * abs(start)


@pytest.mark.parametrize("antithetic", [True, False])
def test_update_equals_plain_es_formula(antithetic):
    net = make_net()
    before = snapshot(net)
    sigma, lr, n = 0.02, 0.1, 6
    es = fastes.ES(
        fastes.linear_weights(net),
        sigma=sigma,
        lr=lr,
        population=n,
        seed=11,
        antithetic=antithetic,
        shaping="raw",
    )
    rewards = torch.tensor([0.3, -1.0, 2.0, 0.5, -0.25, 1.5], dtype=torch.float64)
    es.step(rewards)
    for name, p in fastes.linear_weights(net):
        total = torch.zeros(p.numel(), dtype=torch.float64)
        for i in range(n):
            direction, sign = (i // 2, (-1) ** i) if antithetic else (i, 1)
            key = noise.member_key(11, 0, direction)
            eps = noise.normal(key, noise.tensor_id(name), p.numel()).double()
            total += sign * rewards[i] * eps
        expected = before[name].double().view(-1) + lr / (n * sigma) * total
        torch.testing.assert_close(p.detach().double().view(-1), expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("noise_kind", NOISE_KINDS)
def test_member_weights_are_the_perturbation_and_restore_exactly(noise_kind):
    net = make_net()
    before = snapshot(net)
    es = fastes.ES(fastes.linear_weights(net), sigma=0.1, lr=0.0, population=4, seed=5, noise=noise_kind)
    for member in es.members():
        with member:
            for name, p in fastes.linear_weights(net):
                eps = noise.sample(noise_kind, member.key, noise.tensor_id(name), p.numel()).view(p.shape)
                expected = before[name] + member.sign * 0.1 * eps
                if noise_kind == "rademacher":  # sign arithmetic is exact: every weight moves by sigma
                    assert torch.equal(p.detach(), expected)
                else:
                    torch.testing.assert_close(p.detach(), expected)
        assert_same_weights(snapshot(net), before)


def test_member_restores_when_the_body_raises():
    net = make_net()
    before = snapshot(net)
    es = fastes.ES(fastes.linear_weights(net), sigma=0.1, lr=0.1, population=2)
    member = next(es.members())
    with pytest.raises(RuntimeError, match="boom"), member:
        raise RuntimeError("boom")
    assert_same_weights(snapshot(net), before)


def test_nested_members_are_refused():
    es = fastes.ES(fastes.linear_weights(make_net()), sigma=0.1, lr=0.1, population=2)
    first, second = es.members()
    with first, pytest.raises(RuntimeError, match="already applied"), second:
        pass


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_restore_is_exact_after_thousands_of_members(dtype):
    layer = torch.nn.Linear(16, 16).to(dtype)
    before = layer.weight.detach().clone()
    es = fastes.ES([("w", layer.weight)], sigma=1e-3, lr=0.0, population=2000, seed=9)
    for member in es.members():
        with member:
            pass
    assert torch.equal(layer.weight.detach(), before)


def test_noise_of_a_tensor_does_not_depend_on_the_other_evolved_tensors():
    net_a, net_b = make_net(), make_net()
    only_first = fastes.ES([fastes.linear_weights(net_a)[0]], sigma=0.1, lr=0.0, population=2, seed=1)
    both = fastes.ES(fastes.linear_weights(net_b)[::-1], sigma=0.1, lr=0.0, population=2, seed=1)
    with next(only_first.members()), next(both.members()):
        assert torch.equal(net_a[0].weight, net_b[0].weight)


def test_shaping_methods():
    r = torch.tensor([3.0, 1.0, 1.0, 7.0])
    torch.testing.assert_close(
        centered_rank(r), torch.tensor([1 / 6, -1 / 3, -1 / 3, 0.5], dtype=torch.float64)
    )
    z = zscore(r)
    assert abs(float(z.mean())) < 1e-12 and abs(float(z.std(correction=0)) - 1) < 1e-6
    grouped = group_zscore(torch.tensor([[1.0, 5.0], [3.0, 5.0]]))  # second prompt: all equal
    torch.testing.assert_close(grouped, torch.tensor([-0.5, 0.5], dtype=torch.float64), atol=1e-6, rtol=0)
    for method in fastes.SHAPINGS:
        equal = torch.full((4, 3), 2.5) if method == "group_zscore" else torch.full((4,), 2.5)
        shaped = shape_rewards(equal, method)
        assert torch.isfinite(shaped).all()
        if method != "raw":
            assert torch.all(shaped == 0)


@pytest.mark.parametrize("shaping", list(fastes.SHAPINGS))
def test_all_equal_rewards_leave_weights_unchanged(shaping):
    net = make_net()
    before = snapshot(net)
    es = fastes.ES(fastes.linear_weights(net), sigma=0.1, lr=0.5, population=4, shaping=shaping)
    es.step(torch.full((4, 2), 1.0) if shaping == "group_zscore" else torch.ones(4))
    assert_same_weights(snapshot(net), before)


def test_nonfinite_rewards_error_by_default_and_can_be_dropped():
    net = make_net()
    before = snapshot(net)
    es = fastes.ES(fastes.linear_weights(net), sigma=0.1, lr=0.1, population=6)
    with pytest.raises(ValueError, match=r"non-finite reward for members \[2\]"):
        es.step(torch.tensor([1.0, 0.0, float("nan"), 2.0, 0.5, 0.1]))
    assert_same_weights(snapshot(net), before)
    assert es.generation == 0
    dropping = fastes.ES(
        fastes.linear_weights(net), sigma=0.1, lr=0.1, population=6, nonfinite="drop", shaping="raw"
    )
    dropping.step(torch.tensor([1.0, 0.0, float("inf"), 2.0, 0.5, 0.1]))
    assert dropping.history[-1]["members"] == 4  # the pair (2, 3) is left out
    assert dropping.history[-1]["weights"][1] == 0.0
    with pytest.raises(ValueError, match="fewer than 2 members"):
        dropping.step(torch.tensor([float("nan")] * 6))


def test_bad_arguments_get_clear_errors():
    params = fastes.linear_weights(make_net())
    cases = [
        (dict(population=1), "population: must be at least 2"),
        (dict(population=5), "population: antithetic sampling needs an even population"),
        (dict(sigma=0.0), "sigma: must be a positive"),
        (dict(lr=float("nan")), "lr: must be a non-negative finite number"),
        (dict(weight_decay=-0.1), "weight_decay: must be a non-negative"),
        (dict(shaping="rank"), "shaping: 'rank' is not one of"),
        (dict(noise_type="sparse"), "noise_type: 'sparse' is not one of"),
        (dict(rank=0), "rank: must be at least 1"),
        (dict(noise="uniform"), "noise: 'uniform' is not one of"),
        (dict(nonfinite="skip"), "unknown nonfinite policy"),
        (dict(seed=-1), "seed: must be"),
    ]
    for overrides, message in cases:
        kwargs = dict(sigma=0.1, lr=0.1, population=4) | overrides
        with pytest.raises(ValueError, match=message):
            fastes.ES(params, **kwargs)
    with pytest.raises(ValueError, match="empty parameter list"):
        fastes.ES([], sigma=0.1, lr=0.1, population=4)
    with pytest.raises(ValueError, match="same name"):
        fastes.ES([("w", params[0][1]), ("w", params[1][1])], sigma=0.1, lr=0.1, population=4)
    with pytest.raises(TypeError, match="dtype torch.float64"):
        fastes.ES([torch.zeros(3, dtype=torch.float64)], sigma=0.1, lr=0.1, population=4)
    with pytest.raises(ValueError, match="unknown keys"):
        fastes.ES([{"params": [params[0][1]], "momentum": 0.9}], sigma=0.1, lr=0.1, population=4)
    es = fastes.ES(params, sigma=0.1, lr=0.1, population=4)
    with pytest.raises(ValueError, match="expected rewards for 4 members"):
        es.step(torch.ones(3))


def test_param_groups_take_their_own_sigma_and_lr():
    net = make_net()
    first, second = fastes.linear_weights(net)
    es = fastes.ES(
        [{"params": [first], "sigma": 0.2}, {"params": [second], "lr": 0.0}], sigma=0.1, lr=0.05, population=4
    )
    assert [g["sigma"] for g in es.param_groups] == [0.2, 0.1]
    assert [g["lr"] for g in es.param_groups] == [0.05, 0.0]
    before = second[1].detach().clone()
    es.step(torch.tensor([1.0, 0.0, 0.5, 2.0]))
    assert torch.equal(second[1].detach(), before)  # lr 0: untouched


def run_es(net, iterations, es=None, **kwargs):
    target = target_for(net)
    es = es or fastes.ES(fastes.linear_weights(net), **kwargs)
    for _ in range(iterations):
        es.step(lambda: quadratic_reward(net, target))
    return es


@pytest.mark.parametrize("noise_kind", NOISE_KINDS)
@pytest.mark.parametrize("dtype,rounding", [(torch.float32, False), (torch.bfloat16, True)])
def test_resume_from_state_dict_equals_uninterrupted_run_and_replay_is_exact(dtype, rounding, noise_kind):
    options = dict(sigma=0.05, lr=0.01, population=8, seed=21, stochastic_rounding=rounding, weight_decay=0.1)
    options["noise"] = noise_kind
    straight = make_net(dtype=dtype)
    base = snapshot(straight)
    run_es(straight, 6, **options)

    interrupted = make_net(dtype=dtype)
    es = run_es(interrupted, 3, **options)
    saved_state, saved_weights = es.state_dict(), snapshot(interrupted)
    assert saved_state["options"]["noise"] == noise_kind
    resumed = make_net(seed=99, dtype=dtype)  # fresh process: other weights until loaded
    resumed.load_state_dict(saved_weights)
    es2 = fastes.ES(fastes.linear_weights(resumed), **options)
    es2.load_state_dict(saved_state)
    run_es(resumed, 3, es=es2)
    assert_same_weights(snapshot(resumed), snapshot(straight))

    replayed = make_net(seed=99, dtype=dtype)
    replayed.load_state_dict(base)
    fastes.replay(fastes.linear_weights(replayed), es2.state_dict())
    assert_same_weights(snapshot(replayed), snapshot(straight))
    assert len(str(es2.state_dict()["history"])) < 2000  # the whole run's log is small


# An ES.state_dict() as fastes wrote it before the options had one entry ("options"): run_es(make_net(), 3,
# **OLD_OPTIONS), printed by that version. Checkpoints of runs started then hold this form.
OLD_OPTIONS = dict(
    sigma=0.05,
    lr=0.01,
    population=6,
    antithetic=False,
    shaping="zscore",
    seed=21,
    weight_decay=0.1,
    noise="rademacher",
    backend="torch",
)
OLD_STATE = {
    "backend": "torch",
    "seed": 21,
    "generation": 3,
    "population": 6,
    "antithetic": False,
    "shaping": "zscore",
    "stochastic_rounding": False,
    "noise_type": "full",
    "rank": 1,
    "noise": "rademacher",
    "param_groups": [{"sigma": 0.05, "lr": 0.01, "weight_decay": 0.1, "names": ["0.weight", "2.weight"]}],
    "history": [
        {
            "generation": 0,
            "weights": [
                -0.021504441276192665,
                -1.1180226802825928,
                -0.008653141558170319,
                -0.026832936331629753,
                2.0120134353637695,
                -0.8370002508163452,
            ],
            "members": 6,
        },
        {
            "generation": 1,
            "weights": [
                -1.4489219188690186,
                -1.0636643171310425,
                0.6444180607795715,
                1.5002869367599487,
                0.05082609876990318,
                0.3170550465583801,
            ],
            "members": 6,
        },
        {
            "generation": 2,
            "weights": [
                -0.38168877363204956,
                1.5729092359542847,
                0.7023884654045105,
                -0.9357025623321533,
                -1.3600287437438965,
                0.4021223783493042,
            ],
            "members": 6,
        },
    ],
    "inner_optimizer": None,
}


def test_state_dict_options_are_the_constructor_arguments_that_rebuild_the_es():
    import inspect

    from fastes.es.optimizer import RUN_OPTIONS

    es = run_es(make_net(), 2, **OLD_OPTIONS)
    state = es.state_dict()
    assert tuple(state["options"]) == RUN_OPTIONS
    assert set(RUN_OPTIONS) <= set(inspect.signature(fastes.ES.__init__).parameters)
    assert state["options"] == {
        **{k: v for k, v in OLD_OPTIONS.items() if k != "backend"},
        "stochastic_rounding": False,
        "noise_type": "full",
        "rank": 1,
    }
    # ES(params, **options) is the same ES: it takes the same steps from the same weights.
    a, b = make_net(seed=5), make_net(seed=5)
    run_es(a, 2, es=fastes.ES(fastes.linear_weights(a), **state["options"], backend="torch"))
    run_es(b, 2, **OLD_OPTIONS)
    assert_same_weights(snapshot(a), snapshot(b))


def test_a_state_written_before_options_had_one_entry_resumes_and_replays_exactly():
    from fastes.es.optimizer import saved_options

    straight = make_net()
    run_es(straight, 5, **OLD_OPTIONS)
    resumed = make_net()
    run_es(resumed, 3, **OLD_OPTIONS)  # the weights the old run's checkpoint holds next to its state
    es = fastes.ES(fastes.linear_weights(resumed), **OLD_OPTIONS)
    es.load_state_dict(OLD_STATE)
    assert es.generation == 3 and es.options == es.state_dict()["options"]
    run_es(resumed, 2, es=es)
    assert_same_weights(snapshot(resumed), snapshot(straight))

    replayed, three = make_net(), make_net()
    fastes.replay(fastes.linear_weights(replayed), OLD_STATE, backend="torch")
    run_es(three, 3, **OLD_OPTIONS)
    assert_same_weights(snapshot(replayed), snapshot(three))
    # The old form's options are taken from it, and states from before sign noise were Gaussian.
    assert saved_options(OLD_STATE) == es.options
    before_signs = {k: v for k, v in OLD_STATE.items() if k != "noise"}
    assert saved_options(before_signs)["noise"] == "gaussian"
    with pytest.raises(ValueError, match="noise='gaussian' but this ES uses noise='rademacher'"):
        fastes.ES(fastes.linear_weights(make_net()), **OLD_OPTIONS).load_state_dict(before_signs)


def test_a_state_with_options_this_version_does_not_know_is_refused():
    es = run_es(make_net(), 1, **OLD_OPTIONS)
    state = es.state_dict()
    state["options"]["sparsity"] = 0.5
    with pytest.raises(ValueError, match=r"options \['sparsity'\] that this version of fastes does not know"):
        fastes.ES(fastes.linear_weights(make_net()), **OLD_OPTIONS).load_state_dict(state)


def test_the_run_config_sets_es_arguments_from_one_mapping():
    """Each ES argument the config sets is marked on its field (metadata "es_kwarg"); make_es passes them
    all, and every option a state records (RUN_OPTIONS) can be set from the config."""
    import inspect

    from fastes.es.optimizer import RUN_OPTIONS
    from fastes.run.config import TrainConfig, es_kwargs

    kwargs = es_kwargs(TrainConfig())
    assert set(kwargs) <= set(inspect.signature(fastes.ES.__init__).parameters)
    assert set(RUN_OPTIONS) <= set(kwargs)
    assert kwargs["timeout"] == TrainConfig().collective_timeout and kwargs["seed"] == TrainConfig().seed
    cfg = TrainConfig()
    cfg.es.noise, cfg.es.noise_type, cfg.es.sigma = "rademacher", "full", 0.5
    es = fastes.ES(fastes.linear_weights(make_net()), **es_kwargs(cfg))
    assert (es.noise, es.noise_type, es.defaults["sigma"]) == ("rademacher", "full", 0.5)


def test_loading_a_state_of_the_other_noise_fails_clearly_and_changes_nothing():
    net = make_net()
    sign = run_es(net, 1, sigma=0.1, lr=0.1, population=4, noise="rademacher")
    gauss = fastes.ES(fastes.linear_weights(net), sigma=0.1, lr=0.1, population=4)
    with pytest.raises(ValueError, match="saved with noise='rademacher' but this ES uses noise='gaussian'"):
        gauss.load_state_dict(sign.state_dict())
    assert gauss.generation == 0 and gauss.noise == "gaussian"
    with pytest.raises(ValueError, match="saved with noise='gaussian' but this ES uses noise='rademacher'"):
        sign.load_state_dict(gauss.state_dict())
    # A state from before sign noise existed has no "noise" entry: it was Gaussian.
    old = gauss.state_dict()
    del old["options"]["noise"]
    gauss.load_state_dict(old)
    with pytest.raises(ValueError, match="saved with noise='gaussian'"):
        sign.load_state_dict(old)


def test_replay_uses_the_recorded_noise():
    net = make_net()
    base = snapshot(net)
    state = run_es(net, 2, sigma=0.05, lr=0.05, population=4, seed=1, noise="rademacher").state_dict()
    as_gaussian = {**state, "options": {**state["options"], "noise": "gaussian"}}
    other = make_net()
    other.load_state_dict(base)
    fastes.replay(fastes.linear_weights(other), as_gaussian)
    assert not torch.equal(other[0].weight, net[0].weight)  # the noise really decides the weights


def test_load_state_dict_refuses_other_parameters():
    es = fastes.ES(fastes.linear_weights(make_net()), sigma=0.1, lr=0.1, population=4)
    other = fastes.ES([("w", torch.zeros(3))], sigma=0.1, lr=0.1, population=4)
    with pytest.raises(ValueError, match="different parameters"):
        other.load_state_dict(es.state_dict())


def test_gradient_mode_writes_the_es_gradient_and_adam_steps():
    net = make_net()
    target = target_for(net)
    adam = functools.partial(torch.optim.Adam, lr=0.02)
    es = fastes.ES(
        fastes.linear_weights(net), sigma=0.05, lr=0.0, population=16, seed=4, inner_optimizer=adam
    )
    start = quadratic_reward(net, target)
    for _ in range(25):
        es.step(lambda: quadratic_reward(net, target))
    assert quadratic_reward(net, target) > start + 0.25 * abs(start)
    assert "state" in es.state_dict()["inner_optimizer"]

    # The gradient handed to the inner optimizer is -1/(N sigma) sum_i w_i eps_i.
    net = make_net()
    before = snapshot(net)
    sgd = functools.partial(torch.optim.SGD, lr=1.0)
    es = fastes.ES(
        fastes.linear_weights(net),
        sigma=0.05,
        lr=0.0,
        population=4,
        seed=4,
        shaping="raw",
        inner_optimizer=sgd,
    )
    es.step(torch.tensor([1.0, 0.0, 0.0, 0.0]))
    name, p = fastes.linear_weights(net)[0]
    eps = noise.normal(noise.member_key(4, 0, 0), noise.tensor_id(name), p.numel()).view(p.shape)
    torch.testing.assert_close(p.detach(), before[name] + 1.0 / (4 * 0.05) * eps)  # SGD: theta - lr * grad


def test_linear_weights_selection_on_a_transformers_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    names = [n for n, _ in fastes.linear_weights(model)]
    assert len(names) == 2 * 7  # q, k, v, o, gate, up, down per layer; tied lm_head is the embedding
    assert all(n.endswith("proj.weight") for n in names)
    with_embeddings = [n for n, _ in fastes.linear_weights(model, include_embeddings=True)]
    assert "model.embed_tokens.weight" in with_embeddings
    with_norms = [n for n, _ in fastes.linear_weights(model, include_norms=True)]
    assert sum("norm" in n for n in with_norms) == 2 * 2 + 1
    with pytest.raises(ValueError, match="no projection weights"):
        fastes.linear_weights(torch.nn.Sequential(torch.nn.ReLU()))


# --- two processes (gloo) -------------------------------------------------------------------------


def _distributed_worker(rank: int, world: int, init_file: str, out_file: str, diverge: bool) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        net = make_net()
        if diverge and rank == 1:
            with torch.no_grad():
                net[0].weight[0, 0] += 1.0
        target = target_for(net)
        es = fastes.ES(
            fastes.linear_weights(net), sigma=0.05, lr=0.01, population=8, seed=7, checksum_every=2
        )
        try:
            for _ in range(4):
                es.step(lambda: quadratic_reward(net, target))
        except RuntimeError as error:
            torch.save({"error": str(error)}, f"{out_file}.{rank}")
            return
        torch.save(
            {"weights": snapshot(net), "members": [m.index for m in es.members()]}, f"{out_file}.{rank}"
        )
    finally:
        dist.destroy_process_group()


def _run_two_processes(tmp_path, diverge: bool) -> list[dict]:
    out = str(tmp_path / "result")
    mp.spawn(_distributed_worker, args=(2, str(tmp_path / "init"), out, diverge), nprocs=2, join=True)
    return [torch.load(f"{out}.{rank}") for rank in range(2)]


def test_two_gloo_processes_give_the_weights_of_one_process(tmp_path):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    results = _run_two_processes(tmp_path, diverge=False)
    single = make_net()
    run_es(single, 4, sigma=0.05, lr=0.01, population=8, seed=7)
    assert results[0]["members"] == [0, 2, 4, 6] and results[1]["members"] == [1, 3, 5, 7]
    for result in results:
        assert_same_weights(result["weights"], snapshot(single))


def test_diverged_ranks_are_detected_by_the_checksum(tmp_path):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    results = _run_two_processes(tmp_path, diverge=True)
    for result in results:
        assert "diverged" in result["error"]
