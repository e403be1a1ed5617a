"""GRPO's TRL options: advantage scaling, several updates per batch with clipping, truncated completions
masked out, the importance-corrected KL, and the metrics TRL logs."""

import copy
import math

import pytest
import torch

from fastes.models.loading import load_model, tiny_model_path
from fastes.run import auto_settings
from fastes.run.config import load_config
from fastes.run.grpo_loop import grpo_advantages, grpo_loss, grpo_step, make_grpo_optimizer
from fastes.run.shared import Run
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
    return Run(auto_settings.resolve(cfg, model, tokenizer), model, tokenizer, get_task("compare"), tmp_path)


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
    from fastes.errors import ConfigError

    with pytest.raises(ConfigError, match="grpo.scale_rewards"):
        load_config(None, {"grpo.scale_rewards": "batchwise", "out_dir": str(tmp_path)})
    with pytest.raises(ConfigError, match="grpo.num_iterations"):
        load_config(None, {"grpo.num_iterations": 0, "out_dir": str(tmp_path)})
    with pytest.raises(ConfigError, match="es.include_norms"):
        load_config(None, {"es.include_norms": True, "es.eval_mode": "lowrank", "out_dir": str(tmp_path)})
    with pytest.raises(ConfigError, match="es.evolve"):
        load_config(None, {"es.evolve": "(", "out_dir": str(tmp_path)})


# --- grpo_loss against the formulas, token by token -------------------------------------------------
# TRL's GRPO loss, written out per token in plain Python floats, independently of
# fastes.run.grpo_loop.grpo_loss:   ratio = exp(logp - old), loss_t = -min(ratio * A, clip(ratio, 1 - eps, 1 +
# eps_high) * A) + beta * k3,   k3 = exp(ref - logp) - (ref - logp) - 1 (times ratio when
# importance-corrected), normalised per completion then over completions ("grpo"), over the tokens ("dapo"),
# or over completions * max_completion_length ("dr_grpo"). d loss_t / d logp: the surrogate's is -A * ratio
# unless the clipped term is the one taken (ratio > 1 + eps_high with A > 0, ratio < 1 - eps with A < 0): then
# 0; k3's is 1 - exp(ref - logp), and (k3' + k3) * ratio when corrected.

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


# --- every TRL 1.16 loss type and option, against its formula ---------------------------------------
# The loss in plain Python floats, term by term, as TRL's GRPOTrainer defines it; `lg` carries the
# gradient and `lc` is the same values held constant (TRL's detach), so that central differences of this
# function in `lg` are the gradient fastes must give.

ALL_LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo", "cispo", "sapo", "luspo", "vespo")


def trl_loss(lg, lc, data, o):
    old = lc if data["old"] is None else data["old"].tolist()
    ref = None if data["ref"] is None else data["ref"].tolist()
    adv, mask = data["adv"].tolist(), data["mask"].tolist()
    rows, width = len(lg), len(lg[0])
    eps, high = o["epsilon"], o.get("epsilon_high") or o["epsilon"]
    acc, max_len = o.get("accumulation", 1), o.get("max_completion_length", width)
    counts = [sum(mask[i]) for i in range(rows)]
    total = 0.0
    for i in range(rows):
        a = adv[i]
        tokens = [t for t in range(width) if mask[i][t]]
        per = [0.0] * width
        lr = [lg[i][t] - old[i][t] for t in range(width)]
        if o.get("importance_sampling_level") == "sequence":
            mean = sum(lr[t] for t in tokens) / max(len(tokens), 1)
            ratios = [math.exp(mean)] * width
        else:
            ratios = [math.exp(x) for x in lr]
        drift = sum(old[i][t] - lc[i][t] for t in tokens) / max(len(tokens), 1)
        keep = 1.0
        if o.get("off_policy_mask_threshold", 0) > 0 and a < 0 and drift > o["off_policy_mask_threshold"]:
            keep = 0.0
        for t in tokens:
            r = ratios[t]
            if o["loss_type"] == "cispo":
                w = min(
                    math.exp(lc[i][t] - old[i][t])
                    if o.get("importance_sampling_level") != "sequence"
                    else math.exp(sum(lc[i][u] - old[i][u] for u in tokens) / len(tokens)),
                    high,
                )
                term = -w * a * lg[i][t]
            elif o["loss_type"] == "sapo":
                tau = o.get("sapo_temperature_pos", 1.0) if a > 0 else o.get("sapo_temperature_neg", 1.05)
                term = -(1 / (1 + math.exp(-tau * (r - 1)))) * 4 / tau * a
            elif o["loss_type"] == "vespo":
                seq = sum(min(max(lc[i][u] - old[i][u], -20), 20) for u in tokens)
                log_w = min(max(seq, math.log(1e-8)), 20)
                k = o.get("vespo_k_pos", 2.0) if a >= 0 else o.get("vespo_k_neg", 3.0)
                lam = max(o.get("vespo_lambda_pos", 3.0) if a >= 0 else o.get("vespo_lambda_neg", 2.0), 1e-4)
                term = -math.exp(lam + k * log_w - lam * math.exp(log_w)) * a * lg[i][t]
            else:
                capped = min(r, o["delta"]) if o.get("delta", 0) > 0 else r
                term = -min(capped * a, min(max(r, 1 - eps), 1 + high) * a)
            term *= keep * o.get("entropy_mask", [[1] * width] * rows)[i][t]
            if ref is not None:
                gap = ref[i][t] - lg[i][t]
                k3 = math.exp(gap) - gap - 1
                term += o.get("beta", 0.0) * (k3 * r if o.get("use_bias_correction_kl") else k3)
            per[t] = term
        s = sum(per)
        lt = o["loss_type"]
        if lt in ("grpo", "sapo"):
            total += s / max(counts[i], 1) / rows / acc
        elif lt == "luspo":
            total += s / rows / acc
        elif lt == "bnpo":
            total += s / max(sum(counts), 1) / acc
        elif lt == "dr_grpo":
            total += s / (rows * max_len) / acc
        else:
            total += s / max(o.get("tokens", sum(counts)), 1)
    return total


def check_against_trl(data, **options):
    """fastes' loss and gradient against trl_loss and its central differences."""
    logp = data["logp"].clone().requires_grad_(True)
    extra = {k: v for k, v in options.items() if k != "entropy_mask"}
    mask_t = None if "entropy_mask" not in options else torch.tensor(options["entropy_mask"]).double()
    loss, metrics = grpo_loss(
        logp, data["old"], data["ref"], data["adv"], data["mask"], entropy_mask=mask_t, **extra
    )
    loss.backward()
    lc = data["logp"].tolist()
    assert float(loss.detach()) == pytest.approx(trl_loss(lc, lc, data, options), rel=1e-10, abs=1e-13)
    h = 1e-6
    for i in range(len(lc)):
        for t in range(len(lc[0])):
            up = [row[:] for row in lc]
            down = [row[:] for row in lc]
            up[i][t] += h
            down[i][t] -= h
            numeric = (trl_loss(up, lc, data, options) - trl_loss(down, lc, data, options)) / (2 * h)
            assert float(logp.grad[i, t]) == pytest.approx(numeric, rel=1e-5, abs=1e-8), (i, t)
    return metrics


OPTION_CASES = [  # what each loss type is checked with, beyond its defaults
    {},
    {"beta": 0.3, "use_bias_correction_kl": True, "epsilon_high": 0.28},
    {"importance_sampling_level": "sequence", "beta": 0.1},
    {"delta": 1.5, "off_policy_mask_threshold": 0.05, "accumulation": 3, "max_completion_length": 11},
]


@pytest.mark.parametrize("loss_type", ALL_LOSS_TYPES)
@pytest.mark.parametrize("case", range(len(OPTION_CASES)))
def test_every_loss_type_and_option_matches_trl_formula(loss_type, case):
    data = loss_data(11 + case, 5, 6)
    options = {"loss_type": loss_type, "epsilon": 0.2, **OPTION_CASES[case]}
    if loss_type == "cispo":
        options["epsilon_high"] = 1.5  # cispo caps the ratio itself at epsilon_high (ScaleRL's 5)
    metrics = check_against_trl(data, **options)
    units = float(metrics["clip_units"])
    assert units == (
        5 if options.get("importance_sampling_level") == "sequence" else float(data["mask"].sum())
    )


def test_sapo_and_vespo_parameters_and_the_entropy_mask_change_the_loss():
    data = loss_data(5, 4, 7)
    entropy_mask = (torch.rand(4, 7, generator=torch.Generator().manual_seed(1)) > 0.4).double().tolist()
    for options in (
        {"loss_type": "sapo", "sapo_temperature_neg": 2.0, "sapo_temperature_pos": 0.5},
        {
            "loss_type": "vespo",
            "vespo_k_pos": 1.0,
            "vespo_lambda_pos": 0.5,
            "vespo_k_neg": 4.0,
            "vespo_lambda_neg": 1.0,
        },
        {"loss_type": "dapo", "entropy_mask": entropy_mask, "tokens": 13.0},
        {"loss_type": "grpo", "entropy_mask": entropy_mask, "beta": 0.2},
    ):
        check_against_trl(data, epsilon=0.2, **options)


def test_the_off_policy_mask_drops_only_drifted_negative_completions():
    data = loss_data(2, 6, 5)
    drift = {
        i: float(
            ((data["old"] - data["logp"]) * data["mask"]).sum(1)[i] / max(float(data["mask"][i].sum()), 1)
        )
        for i in range(6)
    }
    threshold = sorted(drift.values())[3] - 1e-9  # some completions drift past it, some do not
    dropped = [i for i in range(6) if data["adv"][i] < 0 and drift[i] > threshold]
    kept_negative = [i for i in range(6) if data["adv"][i] < 0 and drift[i] <= threshold]
    assert dropped and (kept_negative or any(data["adv"][i] >= 0 and drift[i] > threshold for i in range(6)))
    grads = []
    for threshold_used in (0.0, threshold):  # off, then on
        logp = data["logp"].clone().requires_grad_(True)
        loss, _ = grpo_loss(
            logp,
            data["old"],
            None,
            data["adv"],
            data["mask"],
            loss_type="cispo",  # no clipped-away tokens: every kept completion has a gradient
            epsilon=0.2,
            epsilon_high=5.0,
            off_policy_mask_threshold=threshold_used,
        )
        loss.backward()
        grads.append(logp.grad)
    for i in range(6):
        if i in dropped:
            assert bool((grads[1][i] == 0).all()) and not bool((grads[0][i] == 0).all())
        else:
            assert torch.equal(grads[1][i], grads[0][i])


def test_entropy_bonus_is_the_mean_entropy_over_the_kept_tokens():
    data = loss_data(4, 3, 5)
    entropies = torch.rand(
        3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(3)
    ).requires_grad_(True)
    keep = (torch.arange(15).view(3, 5) % 2 == 0).double()
    base, _ = grpo_loss(  # the policy term, on the kept tokens only
        data["logp"], None, None, data["adv"], data["mask"], loss_type="dapo", epsilon=0.2, entropy_mask=keep
    )
    loss, _ = grpo_loss(
        data["logp"],
        None,
        None,
        data["adv"],
        data["mask"],
        loss_type="dapo",
        epsilon=0.2,
        entropies=entropies,
        entropy_coef=0.7,
        entropy_mask=keep,
        accumulation=2,
    )
    kept = data["mask"] * keep
    want = float(base) - 0.7 * float((entropies * kept).sum()) / float(kept.sum()) / 2
    assert float(loss) == pytest.approx(want, rel=1e-12)
    loss.backward()
    torch.testing.assert_close(entropies.grad, -0.7 * kept / float(kept.sum()) / 2)


def test_high_entropy_mask_keeps_the_top_quantile():
    from fastes.run.grpo_loop import high_entropy_mask

    entropies = torch.tensor([[0.1, 0.5, 0.9, 0.3], [0.7, 0.2, 0.8, 0.4]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.float64)
    values = sorted([0.1, 0.5, 0.9, 0.7, 0.2, 0.8, 0.4])  # the masked ones
    for quantile in (0.0, 0.2, 0.5, 1.0):
        position = (1 - quantile) * (len(values) - 1)  # linear interpolation, as torch.quantile
        below, frac = int(math.floor(position)), position - math.floor(position)
        upper = values[min(below + 1, len(values) - 1)]
        threshold = values[below] + frac * (upper - values[below])
        want = [[bool(mask[i][t]) and entropies[i][t] >= threshold for t in range(4)] for i in range(2)]
        assert high_entropy_mask(entropies, mask, quantile).tolist() == want
    assert int(high_entropy_mask(entropies, mask, 0.0).sum()) == 1  # only the highest


def test_normalize_then_sum_follows_gdpo():
    nan = math.nan
    per_function = torch.tensor(
        [[[1.0, 0.0], [0.0, 1.0], [1.0, nan]], [[0.5, 2.0], [0.5, 0.0], [0.0, 1.0]]], dtype=torch.float64
    )  # [prompts, G, functions], one None
    weights = torch.tensor([1.0, 0.5], dtype=torch.float64)
    summed = []
    for p in range(2):
        row = []
        for g in range(3):
            total = 0.0
            for k in range(2):
                group = [
                    float(per_function[p, j, k]) for j in range(3) if not math.isnan(per_function[p, j, k])
                ]
                mean = sum(group) / len(group)
                std = math.sqrt(sum((x - mean) ** 2 for x in group) / (len(group) - 1))
                value = float(per_function[p, g, k])
                if not math.isnan(value):
                    total += weights[k].item() * (value - mean) / (std + 1e-4)
            row.append(total)
        summed.append(row)
    flat = [x for row in summed for x in row]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((x - mean) ** 2 for x in flat) / (len(flat) - 1))
    want = torch.tensor([[(x - mean) / (std + 1e-4) for x in row] for row in summed], dtype=torch.float64)
    rewards = torch.nansum(per_function * weights, dim=-1)
    for scale in ("group", "none"):  # scale_rewards plays no part, as in TRL
        adv, used = grpo_advantages(
            rewards, scale, per_function=per_function, weights=weights, aggregation="normalize_then_sum"
        )
        torch.testing.assert_close(adv, want)
        assert float(used[0, 0]) == pytest.approx(std)


def test_learning_rate_schedules_follow_transformers():
    from fastes.run.shared import learning_rates

    linear = learning_rates(1e-3, "linear", 2, 10)
    want = [1e-3 * n / 2 for n in range(2)] + [1e-3 * (10 - n) / 8 for n in range(2, 10)]
    assert [linear(n) for n in range(10)] == pytest.approx(want)
    ratio = learning_rates(1e-3, "cosine", 0.25, 8)  # 2 steps
    assert ratio(1) == pytest.approx(5e-4) and ratio(2) == pytest.approx(1e-3)
    assert ratio(5) == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi * 3 / 6)))
    constant = learning_rates(3e-4, "constant", 0, 5)
    assert all(constant(n) == 3e-4 for n in range(5))


def test_micro_batches_with_accumulation_take_the_same_step(tmp_path):
    """spg = GA = 2: two half micro-batches accumulate into the one optimizer step the whole batch takes:
    the same loss and gradient (so the normalisers divide the halves right), for each kind of normaliser."""
    for loss_type in ("dapo", "grpo", "dr_grpo", "luspo"):
        records = []
        for k in (1, 2):
            run = make_run(tmp_path, loss_type=loss_type, gradient_accumulation_steps=k, lr=1e-3)
            records.append(grpo_step(run, make_grpo_optimizer(run), None, 0))
        assert records[1]["loss"] == pytest.approx(records[0]["loss"], rel=1e-5, abs=1e-7), loss_type
        assert records[1]["grad_norm"] == pytest.approx(records[0]["grad_norm"], rel=1e-4), loss_type
        assert records[1]["reward"] == records[0]["reward"]


def test_several_optimizer_steps_per_generation_and_a_schedule(tmp_path):
    """spg = 2, GA = 1: two optimizer steps per GRPO step, the second off-policy (old log-probabilities
    kept, so it can clip); the lr follows the schedule over steps * 2 optimizer steps."""
    run = make_run(
        tmp_path,
        steps_per_generation=2,
        epsilon=0.01,
        lr=3e-3,
        steps=3,
        lr_scheduler_type="linear",
        loss_type="bnpo",
    )
    optimizer = make_grpo_optimizer(run)
    seen = []
    original = optimizer.step

    def spy(*args, **kwargs):
        seen.append(optimizer.param_groups[0]["lr"])
        return original(*args, **kwargs)

    optimizer.step = spy
    records = [grpo_step(run, optimizer, None, step) for step in range(2)]
    assert seen == pytest.approx([3e-3 * (6 - n) / 6 for n in range(4)])
    assert any(r["clip_ratio"] > 0 for r in records)


def test_sync_ref_model_mixes_the_policy_into_the_reference(tmp_path):
    run = make_run(
        tmp_path,
        beta=0.1,
        sync_ref_model=True,
        ref_model_sync_steps=2,
        ref_model_mixup_alpha=0.25,
        steps_per_generation=2,
    )
    reference = copy.deepcopy(run.model).requires_grad_(False)
    before = {k: v.clone() for k, v in reference.state_dict().items()}
    grpo_step(run, make_grpo_optimizer(run), reference, 0)  # optimizer steps 1 and 2: a sync after the 2nd
    for name, p in run.model.named_parameters():
        want = 0.75 * before[name] + 0.25 * p.detach()
        torch.testing.assert_close(dict(reference.named_parameters())[name], want)
        assert not torch.equal(want, before[name])


def test_config_refuses_bad_new_grpo_options(tmp_path):
    from fastes.errors import ConfigError

    bad = {
        "grpo.loss_type": "ppo",
        "grpo.multi_objective_aggregation": "mean",
        "grpo.importance_sampling_level": "batch",
        "grpo.delta": 0.5,
        "grpo.top_entropy_quantile": 1.5,
        "grpo.off_policy_mask_threshold": -1.0,
        "grpo.sync_ref_model": True,  # beta 0: no reference
        "grpo.ref_model_sync_steps": 0,
        "grpo.gradient_accumulation_steps": 3,  # does not divide steps_per_generation * num_iterations
        "grpo.steps_per_generation": 3,  # 64 * 8 completions are not 3 equal micro-batches
        "grpo.lr_scheduler_type": "reduce_lr_on_plateau",
        "grpo.warmup_steps": 2.5,
        "grpo.adam_beta2": 1.0,
        "grpo.adam_epsilon": 0.0,
    }
    for key, value in bad.items():
        extra = {"grpo.steps_per_generation": 2} if key == "grpo.gradient_accumulation_steps" else {}
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as error:
            load_config(None, {"algorithm": "grpo", key: value, **extra, "out_dir": str(tmp_path)})
        assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "options",
    [
        {"loss_type": "cispo", "epsilon_high": 5.0, "num_iterations": 2},
        {"loss_type": "sapo", "num_iterations": 2, "multi_objective_aggregation": "normalize_then_sum"},
        {"loss_type": "vespo", "num_iterations": 2, "top_entropy_quantile": 0.2, "entropy_coef": 0.01},
        {"loss_type": "luspo", "importance_sampling_level": "sequence", "num_iterations": 2, "delta": 1.5},
        {
            "loss_type": "grpo",
            "off_policy_mask_threshold": 0.01,
            "num_iterations": 2,
            "steps_per_generation": 4,
            "gradient_accumulation_steps": 2,
        },
    ],
)
def test_every_option_runs_a_step_and_logs_trl_metrics(tmp_path, options):
    run = make_run(tmp_path, lr=3e-3, **options)
    before = weights(run)
    record = grpo_step(run, make_grpo_optimizer(run), None, 0)
    assert any(not torch.equal(v, before[k]) for k, v in weights(run).items())
    assert all(math.isfinite(v) for v in record.values())
    named = {"cispo": "cispo_clip_ratio", "vespo": "vespo/phi_seq_mean", "sapo": "loss"}
    assert named.get(options["loss_type"], "clip_ratio/high_mean") in record


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_unscored_completions_are_left_out_of_the_advantages_as_trl_does(scale):
    """A completion every reward function returned None for (NaN) counts in no mean or std and gets
    advantage 0; the others get what they would get without it."""
    from fastes.run.grpo_loop import grpo_advantages

    with_gap = torch.tensor([[1.0, math.nan, 3.0], [0.0, 2.0, 7.0]], dtype=torch.float64)
    advantages, _ = grpo_advantages(with_gap, scale)
    assert advantages[0, 1] == 0.0
    group = torch.tensor([1.0, 3.0], dtype=torch.float64)
    spread = {
        "group": group.std(),
        "batch": torch.tensor([1.0, 3.0, 0.0, 2.0, 7.0]).double().std(),
        "none": None,
    }
    expected = group - group.mean()
    if spread[scale] is not None:
        expected = expected / (spread[scale] + 1e-4)
    assert torch.allclose(advantages[0, [0, 2]], expected)
    full, _ = grpo_advantages(with_gap[1:], scale if scale != "batch" else "group")
    if scale != "batch":
        assert torch.allclose(advantages[1], full[0])
