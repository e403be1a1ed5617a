"""GRPO's TRL options: advantage scaling, several updates per batch with clipping, truncated completions
masked out, the importance-corrected KL, and the metrics TRL logs."""

import copy
import math

import pytest
import torch

from fastes import defaults
from fastes.config import load_config
from fastes.grpo import grpo_advantages, grpo_loss, grpo_step, make_grpo_optimizer
from fastes.models import load_model, tiny_model_path
from fastes.run import Run
from fastes.tasks import get_task


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


# --- grpo_loss against the formulas, token by token -------------------------------------------------
# TRL's GRPO loss, written out per token in plain Python floats, independently of fastes.grpo.grpo_loss:
#   ratio = exp(logp - old), loss_t = -min(ratio * A, clip(ratio, 1 - eps, 1 + eps_high) * A) + beta * k3,
#   k3 = exp(ref - logp) - (ref - logp) - 1 (times ratio when importance-corrected),
# normalised per completion then over completions ("grpo"), over the tokens ("dapo"), or over
# completions * max_completion_length ("dr_grpo"). d loss_t / d logp: the surrogate's is -A * ratio unless
# the clipped term is the one taken (ratio > 1 + eps_high with A > 0, ratio < 1 - eps with A < 0): then 0;
# k3's is 1 - exp(ref - logp), and (k3' + k3) * ratio when corrected.

LOSS_TYPES = ("grpo", "dapo", "dr_grpo")


def formula(data, *, loss_type, epsilon, epsilon_high, beta, corrected, max_len):
    """The loss, its gradient with respect to every logp, the masked k3 sum and the clipped-token counts."""
    logp, old, adv, mask = (data[k].tolist() for k in ("logp", "old", "adv", "mask"))  # Python floats
    ref = None if data["ref"] is None else data["ref"].tolist()
    low_bound, high_bound = 1 - epsilon, 1 + (epsilon_high or epsilon)
    rows, width = len(logp), len(logp[0])
    counts = [sum(1 for t in range(width) if mask[i][t]) for i in range(rows)]
    total_tokens = sum(counts)
    loss, kl, low, high = 0.0, 0.0, 0, 0
    grad = [[0.0] * width for _ in range(rows)]
    for i in range(rows):
        a = adv[i]
        for t in range(width):
            if not mask[i][t]:
                continue
            ratio = math.exp(logp[i][t] - old[i][t])
            clipped = min(max(ratio, low_bound), high_bound)
            term = -min(ratio * a, clipped * a)
            clip_taken = (ratio > high_bound and a > 0) or (ratio < low_bound and a < 0)
            d_term = 0.0 if clip_taken else -a * ratio
            low += ratio < low_bound and a < 0
            high += ratio > high_bound and a > 0
            if ref is not None:
                delta = ref[i][t] - logp[i][t]
                k3 = math.exp(delta) - delta - 1
                d_k3 = 1 - math.exp(delta)
                if corrected:
                    k3, d_k3 = k3 * ratio, (d_k3 + k3) * ratio
                term += beta * k3
                d_term += beta * d_k3
                kl += k3
            if loss_type == "grpo":
                scale = 1 / (max(counts[i], 1) * rows)
            elif loss_type == "dapo":
                scale = 1 / max(total_tokens, 1)
            else:
                scale = 1 / (rows * max_len)
            loss += term * scale
            grad[i][t] = d_term * scale
    return loss, grad, kl, low, high


def loss_data(seed, rows, width, with_ref=True):
    """Random log-probabilities whose ratios reach past both clip bounds, random-signed advantages (one
    zero), and a ragged mask: each completion its own length, one completion empty."""
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(rows, width, generator=g, dtype=torch.float64) * 3
    log_ratio = torch.rand(rows, width, generator=g, dtype=torch.float64) * 2.4 - 1.2  # ratio 0.3 to 3.3
    signs = torch.tensor([(-1.0) ** i for i in range(rows)], dtype=torch.float64)
    adv = torch.randn(rows, generator=g, dtype=torch.float64).abs() * signs  # both signs
    adv[seed % rows] = 0.0
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    lengths[(seed + 1) % rows] = 0
    starts = torch.randint(0, width, (rows,), generator=g)  # a completion starts after its prompt
    pos = torch.arange(width)
    mask = ((pos >= starts[:, None]) & (pos < starts[:, None] + lengths[:, None])).double()
    for i in range(rows):  # each completion's first token past the bound its advantage's sign can hit
        if lengths[i] > 0:
            log_ratio[i, starts[i]] = 1.0 if adv[i] > 0 else -1.0  # ratio e > 1.28, or 1/e < 0.8
    ref = logp + (torch.rand(rows, width, generator=g, dtype=torch.float64) - 0.5) if with_ref else None
    return {"logp": logp, "old": logp - log_ratio, "ref": ref, "adv": adv, "mask": mask}


def fastes_loss(data, *, old=True, **options):
    logp = data["logp"].clone().requires_grad_(True)
    loss, metrics = grpo_loss(
        logp, data["old"] if old else None, data["ref"], data["adv"], data["mask"], **options
    )
    loss.backward()
    return loss.detach(), logp.grad, metrics


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("seed", range(4))
def test_grpo_loss_matches_the_formulas_token_by_token(loss_type, seed):
    rows, width = [(5, 5), (4, 7), (6, 9), (7, 3)][seed]
    data = loss_data(seed, rows, width)
    clip_seen = [0, 0]
    cases = [  # (beta, epsilon_high, importance-corrected KL)
        (0.0, 0.0, False),  # no KL weight, symmetric clipping
        (0.04, 0.0, False),  # k3 KL
        (0.3, 0.28, False),  # clip-higher
        (0.3, 0.28, True),  # the importance-corrected KL
    ]
    for beta, epsilon_high, corrected in cases:
        options = dict(loss_type=loss_type, epsilon=0.2, epsilon_high=epsilon_high, beta=beta)
        max_len = width + 3  # dr_grpo's constant: the generation limit, above the widest completion
        loss, grad, metrics = fastes_loss(
            data, **options, use_bias_correction_kl=corrected, max_completion_length=max_len
        )
        want, want_grad, kl, low, high = formula(data, **options, corrected=corrected, max_len=max_len)
        assert float(loss) == pytest.approx(want, rel=1e-12, abs=1e-14)
        torch.testing.assert_close(grad, torch.tensor(want_grad, dtype=torch.float64), rtol=1e-12, atol=1e-14)
        assert float(metrics["kl"]) == pytest.approx(kl, rel=1e-12)
        assert (float(metrics["low_clipped"]), float(metrics["high_clipped"])) == (low, high)
        clip_seen = [clip_seen[0] + low, clip_seen[1] + high]
    assert clip_seen[0] > 0 and clip_seen[1] > 0  # both bounds were active: the checks above bite


def test_grpo_loss_without_a_reference_or_old_policy():
    data = loss_data(7, 4, 6, with_ref=False)
    for loss_type in LOSS_TYPES:
        loss, grad, metrics = fastes_loss(
            data, loss_type=loss_type, epsilon=0.2, beta=0.5, max_completion_length=6
        )
        want, want_grad, _, low, high = formula(
            data, loss_type=loss_type, epsilon=0.2, epsilon_high=0.0, beta=0.5, corrected=False, max_len=6
        )
        assert float(loss) == pytest.approx(want, rel=1e-12)  # no reference: no KL, whatever beta
        torch.testing.assert_close(grad, torch.tensor(want_grad, dtype=torch.float64), rtol=1e-12, atol=1e-14)
        assert float(metrics["kl"]) == 0 and low + high > 0
        # One update per batch: the old policy is the current one, ratio 1, so nothing is clipped and the
        # loss is -A averaged as the loss type says, with gradient -A per token.
        loss, grad, metrics = fastes_loss(
            data, old=False, loss_type=loss_type, epsilon=0.2, max_completion_length=6
        )
        ones = {**data, "old": data["logp"]}
        want, want_grad, _, _, _ = formula(
            ones, loss_type=loss_type, epsilon=0.2, epsilon_high=0.0, beta=0.0, corrected=False, max_len=6
        )
        assert float(loss) == pytest.approx(want, rel=1e-12, abs=1e-15)
        torch.testing.assert_close(grad, torch.tensor(want_grad, dtype=torch.float64), rtol=1e-12, atol=1e-14)
        assert float(metrics["low_clipped"]) == float(metrics["high_clipped"]) == 0


def test_grpo_loss_normalisers_are_the_whole_batch_under_torchrun():
    """Passed `rows` and `tokens` (the whole batch's, under torchrun) replace this batch's own."""
    data = loss_data(3, 4, 5)
    options = dict(epsilon=0.2, beta=0.1, max_completion_length=8)
    own = {t: float(fastes_loss(data, loss_type=t, **options)[0]) for t in LOSS_TYPES}
    # As if three processes held batches like this one: grpo and dr_grpo read rows, dapo tokens.
    whole = {"rows": 4 * 3, "tokens": float(data["mask"].sum()) * 3}
    tensors = (data["logp"], data["old"], data["ref"], data["adv"], data["mask"])
    got = {t: float(grpo_loss(*tensors, loss_type=t, **whole, **options)[0]) for t in LOSS_TYPES}
    assert got == pytest.approx({t: own[t] / 3 for t in LOSS_TYPES}, rel=1e-12)
    adv_column = {**data, "adv": data["adv"][:, None]}  # one advantage per completion, as a column
    assert float(fastes_loss(adv_column, loss_type="grpo", **options)[0]) == pytest.approx(
        own["grpo"], rel=1e-15
    )
    with pytest.raises(ValueError, match="ppo"):
        grpo_loss(data["logp"], None, None, data["adv"], data["mask"], loss_type="ppo", epsilon=0.2)
