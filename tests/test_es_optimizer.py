"""fastes.ES as a torch.optim.Optimizer: LR schedulers, step hooks, resume and replay with a schedule."""

import copy

import pytest
import torch
from test_es import make_net, quadratic_reward, snapshot, target_for

import fastes

OPTIONS = dict(sigma=0.05, lr=0.02, population=8, seed=5, weight_decay=0.1)


def scheduled_run(net, generations, es=None, schedule=None, **options):
    """ES with CosineAnnealingLR over 6 generations; returns the ES, the scheduler and each update's lr."""
    target = target_for(net)
    es = es or fastes.ES(fastes.linear_weights(net), **{**OPTIONS, **options})
    schedule = schedule or torch.optim.lr_scheduler.CosineAnnealingLR(es, T_max=6)
    used = []
    for _ in range(generations):
        used.append(es.param_groups[0]["lr"])
        es.step(lambda: quadratic_reward(net, target))
        schedule.step()
    return es, schedule, used


def test_es_is_a_torch_optimizer_and_a_scheduler_sets_the_lr_of_the_next_update():
    net = make_net()
    es, schedule, used = scheduled_run(net, 4)
    assert isinstance(es, torch.optim.Optimizer)
    assert used[0] == OPTIONS["lr"] and used[1] < used[0] and used == sorted(used, reverse=True)
    assert [h["param_groups"][0]["lr"] for h in es.history] == used
    assert schedule.get_last_lr()[0] == es.param_groups[0]["lr"]

    # The same lr values set by hand give the same weights, bit for bit; a constant lr does not.
    by_hand, constant = make_net(), make_net()
    target = target_for(by_hand)
    manual = fastes.ES(fastes.linear_weights(by_hand), **OPTIONS)
    fixed = fastes.ES(fastes.linear_weights(constant), **OPTIONS)
    for lr in used:
        manual.param_groups[0]["lr"] = lr
        manual.step(lambda: quadratic_reward(by_hand, target))
        fixed.step(lambda: quadratic_reward(constant, target))
    assert all(torch.equal(a, b) for a, b in zip(snapshot(net).values(), snapshot(by_hand).values()))
    assert not all(torch.equal(a, b) for a, b in zip(snapshot(net).values(), snapshot(constant).values()))


@pytest.mark.parametrize("dtype,rounding", [(torch.float32, False), (torch.bfloat16, True)])
def test_replay_is_exact_when_the_lr_changed_between_generations(dtype, rounding):
    net = make_net(dtype=dtype)
    base = snapshot(net)
    es, _, _ = scheduled_run(net, 6, stochastic_rounding=rounding)
    replayed = make_net(seed=99, dtype=dtype)
    replayed.load_state_dict(base)
    fastes.replay(fastes.linear_weights(replayed), es.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(snapshot(replayed).values(), snapshot(net).values()))

    # Without the recorded lr values, replay would use the last lr for every generation: not the run.
    state = es.state_dict()
    for record in state["history"]:
        del record["param_groups"]
    stale = make_net(seed=99, dtype=dtype)
    stale.load_state_dict(base)
    fastes.replay(fastes.linear_weights(stale), state)
    assert not all(torch.equal(a, b) for a, b in zip(snapshot(stale).values(), snapshot(net).values()))


def test_resume_with_the_schedulers_state_equals_the_uninterrupted_run():
    straight = make_net()
    scheduled_run(straight, 6)

    stopped = make_net()
    es, schedule, _ = scheduled_run(stopped, 3)
    saved = copy.deepcopy(
        {"es": es.state_dict(), "schedule": schedule.state_dict(), "net": snapshot(stopped)}
    )
    resumed = make_net(seed=99)  # a new process: other weights until loaded
    resumed.load_state_dict(saved["net"])
    es2 = fastes.ES(fastes.linear_weights(resumed), **OPTIONS)
    schedule2 = torch.optim.lr_scheduler.CosineAnnealingLR(es2, T_max=6)
    es2.load_state_dict(saved["es"])
    schedule2.load_state_dict(saved["schedule"])
    assert es2.param_groups[0]["lr"] == es.param_groups[0]["lr"]
    scheduled_run(resumed, 3, es=es2, schedule=schedule2)
    assert all(torch.equal(a, b) for a, b in zip(snapshot(resumed).values(), snapshot(straight).values()))


def test_step_hooks_run_around_every_step_and_a_pre_hook_can_change_the_rewards():
    net = make_net()
    es = fastes.ES(fastes.linear_weights(net), **OPTIONS)
    calls = []
    es.register_step_pre_hook(lambda opt, args, kwargs: calls.append(("pre", opt.generation)))
    handle = es.register_step_post_hook(lambda opt, args, kwargs: calls.append(("post", opt.generation)))
    rewards = torch.arange(8, dtype=torch.float64)
    es.step(rewards)
    assert calls == [("pre", 0), ("post", 1)]
    handle.remove()
    es.step(rewards)
    assert calls[-1] == ("pre", 1)

    # A pre-hook that reverses the rewards (args holds the optimizer first) makes their update.
    hooked, plain = make_net(), make_net()
    with_hook = fastes.ES(fastes.linear_weights(hooked), **OPTIONS)
    with_hook.register_step_pre_hook(lambda opt, args, kwargs: ((opt, args[1].flip(0)), kwargs))
    with_hook.step(rewards)
    fastes.ES(fastes.linear_weights(plain), **OPTIONS).step(rewards.flip(0))
    assert all(torch.equal(a, b) for a, b in zip(snapshot(hooked).values(), snapshot(plain).values()))


def test_param_groups_are_fixed_once_a_generation_ran_and_a_copy_keeps_everything():
    net = make_net()
    first, second = fastes.linear_weights(net)
    es = fastes.ES([first], **OPTIONS)
    es.add_param_group({"params": [second], "lr": 0.0})
    assert [g["names"] for g in es.param_groups] == [["0.weight"], ["2.weight"]]
    with pytest.raises(ValueError, match="same name"):
        es.add_param_group({"params": [second]})
    es.step(torch.zeros(8, dtype=torch.float64))
    with pytest.raises(ValueError, match="fixed once a generation has run"):
        es.add_param_group({"params": [("extra", torch.zeros(2, 2))]})
    twin = copy.deepcopy(es)
    assert twin.population == es.population and twin.generation == 1 and twin.history == es.history


def loss_saving_the_weights(net: torch.nn.Module) -> torch.Tensor:
    """A loss whose graph saved the second layer's weight (for the input's gradient)."""
    return net(torch.randn(4, 3, requires_grad=True)).square().sum()


@pytest.mark.parametrize("noise_type", ["full", "lowrank"])
@pytest.mark.parametrize("backend", ["cpu", "triton", "torch"])
def test_a_graph_that_saved_a_weight_refuses_backward_after_the_update_as_after_torch_optims(
    backend, noise_type
):
    """The compiled library and the Triton kernels write through raw pointers, which torch's version
    counters do not see: ES bumps them for every tensor it wrote, so a backward through a weight saved
    before the update fails loudly, as after torch.optim's in-place update, instead of using new values."""
    if backend == "cpu" and not fastes.engine.cpu_library.available():
        pytest.skip("no C compiler here: the compiled CPU library cannot be built")
    net = make_net()  # torch.optim's convention, which ES follows
    loss = loss_saving_the_weights(net)
    for p in net.parameters():
        p.grad = torch.ones_like(p)
    torch.optim.SGD(net.parameters(), lr=0.1).step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()

    net = make_net()
    loss = loss_saving_the_weights(net)
    es = fastes.ES(fastes.linear_weights(net), **OPTIONS, noise_type=noise_type, backend=backend)
    es.step(torch.linspace(0.0, 1.0, OPTIONS["population"]))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("backend", ["cpu", "triton", "torch"])
def test_perturb_and_update_bump_the_versions_of_what_they_write_and_nothing_else(backend):
    from fastes.engine import ops

    if backend == "cpu" and not fastes.engine.cpu_library.available():
        pytest.skip("no C compiler here: the compiled CPU library cannot be built")
    source = torch.randn(5, 7)
    destination, twin = torch.empty(7, 5).t(), torch.empty(7, 5).t()  # transposed, as materialised members
    versions = source._version, destination._version, twin._version
    ops.perturb([source], [destination], [3], (1, 2), 0.1, backend=backend, twins=[twin])
    assert source._version == versions[0]
    assert destination._version > versions[1] and twin._version > versions[2]

    param, grad = torch.randn(5, 7), torch.zeros(5, 7)
    versions = param._version, grad._version
    ops.es_update([param], [3], [(1, 2)], [1.0], coef=0.1, grads=[grad], backend=backend)
    assert param._version == versions[0] and grad._version > versions[1]
    ops.es_update([param], [3], [(1, 2)], [1.0], coef=0.1, backend=backend)
    assert param._version > versions[0]
