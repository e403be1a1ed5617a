"""GRPO's TRL options: advantage scaling, several updates per batch with clipping, truncated completions
masked out, the importance-corrected KL, and the metrics TRL logs."""

import copy

import pytest
import torch

from fastes import defaults
from fastes.config import load_config
from fastes.models import load_model, tiny_model_path
from fastes.tasks import get_task
from fastes.grpo import grpo_advantages, grpo_step, make_grpo_optimizer
from fastes.run import Run


def test_advantages_and_reward_std_follow_trl():
    rewards = torch.tensor(
        [[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.5, 0.0, 0.0]], dtype=torch.float64
    )
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    group_std = rewards.std(dim=1, keepdim=True)  # Bessel-corrected
    adv, std = grpo_advantages(rewards, "group")
    torch.testing.assert_close(adv, centred / (group_std + 1e-4))
    torch.testing.assert_close(std, group_std.expand_as(rewards))
    adv, std = grpo_advantages(rewards, "batch")
    torch.testing.assert_close(adv, centred / (rewards.std() + 1e-4))
    assert float(std.mean()) == pytest.approx(float(rewards.std()))
    adv, std = grpo_advantages(rewards, "none")
    torch.testing.assert_close(adv, centred)
    torch.testing.assert_close(std, group_std.expand_as(rewards))  # logged even when not used
    assert adv[1].abs().max() == 0  # a zero-spread group teaches nothing


def make_run(tmp_path, **grpo):
    cfg = load_config(
        None,
        {
            "algorithm": "grpo",
            "task": "compare",
            "out_dir": str(tmp_path),
            "batch_size": 8,
            "max_new_tokens": 4,
            "progress": False,
            **{f"grpo.{k}": v for k, v in grpo.items()},
        },
    )
    model, tokenizer = load_model(tiny_model_path())
    return Run(defaults.resolve(cfg, model, tokenizer), model, tokenizer, get_task("compare"), tmp_path)


def weights(run):
    return {k: v.clone() for k, v in run.model.state_dict().items()}


def test_one_update_per_batch_never_clips_and_several_do(tmp_path):
    run = make_run(tmp_path, num_iterations=1, epsilon=0.01, lr=3e-3)
    record = grpo_step(run, make_grpo_optimizer(run), None, 0)
    assert record["clip_ratio"] == 0  # the old policy is the current one: ratio 1
    run = make_run(tmp_path, num_iterations=3, epsilon=0.01, lr=3e-3)
    record = grpo_step(run, make_grpo_optimizer(run), None, 0)
    assert record["clip_ratio"] > 0
    assert record["clip_ratio"] == pytest.approx(
        record["clip_ratio/low_mean"] + record["clip_ratio/high_mean"]
    )
    wide = make_run(tmp_path, num_iterations=3, epsilon=0.01, epsilon_high=10.0, lr=3e-3)
    record = grpo_step(wide, make_grpo_optimizer(wide), None, 0)
    assert record["clip_ratio/high_mean"] == 0 and record["clip_ratio/low_mean"] > 0


def test_truncated_completions_can_be_masked_out_of_the_loss(tmp_path):
    run = make_run(tmp_path, mask_truncated_completions=True)
    run.cfg.max_new_tokens = 1  # no completion can end (with EOS) in one token
    before = weights(run)
    record = grpo_step(run, make_grpo_optimizer(run), None, 0)
    assert record["completions/clipped_ratio"] == 1.0
    assert record["loss"] == 0
    assert all(torch.equal(v, before[k]) for k, v in weights(run).items())
    unmasked = make_run(tmp_path)
    unmasked.cfg.max_new_tokens = 1
    grpo_step(unmasked, make_grpo_optimizer(unmasked), None, 0)
    assert any(not torch.equal(v, before[k]) for k, v in weights(unmasked).items())


def test_importance_corrected_kl_changes_the_update(tmp_path):
    records, results = [], []
    for corrected in (False, True):
        run = make_run(tmp_path, beta=0.5, use_bias_correction_kl=corrected, num_iterations=2, lr=3e-3)
        reference = copy.deepcopy(run.model).requires_grad_(False)
        with torch.no_grad():  # move the policy away from the reference, so that the KL is not zero
            for p in run.model.parameters():
                p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        records.append(grpo_step(run, make_grpo_optimizer(run), reference, 0))
        results.append(weights(run))
    assert records[0]["kl"] > 0
    assert any(not torch.equal(results[0][k], results[1][k]) for k in results[0])
    assert records[0]["reward"] == records[1]["reward"]  # the same samples


def test_config_refuses_bad_grpo_options(tmp_path):
    from fastes.config import ConfigError

    with pytest.raises(ConfigError, match="grpo.scale_rewards"):
        load_config(None, {"grpo.scale_rewards": "batchwise", "out_dir": str(tmp_path)})
    with pytest.raises(ConfigError, match="grpo.num_iterations"):
        load_config(None, {"grpo.num_iterations": 0, "out_dir": str(tmp_path)})
    with pytest.raises(ConfigError, match="es.include_norms"):
        load_config(None, {"es.include_norms": True, "es.eval_mode": "lowrank", "out_dir": str(tmp_path)})
    with pytest.raises(ConfigError, match="es.evolve"):
        load_config(None, {"es.evolve": "(", "out_dir": str(tmp_path)})
