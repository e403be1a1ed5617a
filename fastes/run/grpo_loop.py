"""GRPO, as TRL's GRPOTrainer computes it, in four stages that each read on their own:

1. sample_and_score: G completions per prompt, scored; the whole batch's rewards.
2. grpo_advantages: each reward against its group's mean, scaled by a std (or each reward function
   normalised in its group first: multi_objective_aggregation).
3. grpo_loss: the loss of one micro-batch (TRL's loss types), a pure function of tensors, applied by
   `update`: the step's completions are shuffled into steps_per_generation micro-batches, passed over
   num_iterations times, with an optimizer step every gradient_accumulation_steps micro-batches.
4. grpo_record: the metrics TRL logs, for metrics.jsonl.

A GRPO step is one generation: batch_size prompts, num_generations completions each, and the
optimizer steps taken on them (GRPOSettings.optimizer_steps(): one by default).

grpo_step runs them in that order. Under torchrun each process takes an equal slice of the prompts;
rewards are gathered, so advantages and metrics are the whole batch's, each loss is divided by the whole
batch's normaliser, and the gradients are summed before clipping: every process takes the step one
process would take (up to the order of float additions; with steps_per_generation > 1 each process
shuffles its own completions into the micro-batches, as TRL does).
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

import torch

from fastes import distributed
from fastes.analysis.entropy import token_entropies, token_entropy
from fastes.errors import ConfigError
from fastes.es.optimizer import checked_step
from fastes.models.generation import Generation, eos_token_ids, generate
from fastes.tasks import Example, Score
from fastes.tasks.dataset import DatasetTask

from .shared import Run, batch_for, learning_rates, reward_parts


def make_grpo_optimizer(run: Run) -> torch.optim.Optimizer:
    g = run.cfg.grpo
    trained = [p for p in run.model.parameters() if p.requires_grad]  # with a PEFT adapter: its tensors
    return torch.optim.AdamW(
        trained, lr=g.lr, betas=(g.adam_beta1, g.adam_beta2), eps=g.adam_epsilon, weight_decay=g.weight_decay
    )


def grpo_step(run: Run, optimizer: torch.optim.Optimizer, reference, step: int) -> dict[str, float]:
    """Sample G completions per prompt, then TRL's optimizer steps on them. `reference` is the model of
    the KL term (None: beta 0, no KL); with sync_ref_model it is moved towards the policy in place."""
    start = time.perf_counter()
    g = run.cfg.grpo
    samples = sample_and_score(run, step)
    advantages, std = grpo_advantages(
        samples.rewards,
        g.scale_rewards,
        per_function=samples.per_function,
        weights=samples.weights,
        aggregation=g.multi_objective_aggregation,
    )
    batch = completion_tensors(run, samples)
    adv = samples.mine(advantages).to(batch.mask.device)
    fit = update(run, optimizer, reference, batch, adv, samples.where, step)
    return grpo_record(run, samples, std, batch, fit, time.perf_counter() - start)


# --- 1. sample and score ----------------------------------------------------------------------------


@dataclass
class Samples:
    """One step's completions: this process's share of the prompts, and the whole batch's rewards."""

    gen: Generation  # this process's completions, G per prompt, prompt by prompt
    scores: list[Score]  # theirs
    rewards: torch.Tensor  # [prompts, G] float64: every process's
    share: int  # prompts per process; this one's are rows rank * share ... of `rewards`
    rank: int
    where: str  # "GRPO step N": what a failed collective's message names
    # normalize_then_sum only: [prompts, G, functions] each reward function's value (NaN: its None)
    per_function: torch.Tensor | None = None
    weights: torch.Tensor | None = None  # [functions]: the task's reward weights

    def mine(self, advantages: torch.Tensor) -> torch.Tensor:
        """This process's rows of a [prompts, G] tensor, as a float32 column: one value per completion."""
        return advantages[self.rank * self.share : (self.rank + 1) * self.share].reshape(-1, 1).float()


def sample_and_score(run: Run, step: int) -> Samples:
    """Sample G completions for each of this process's prompts of (grpo, step) and score them; every
    process gets every reward. A non-finite reward stops the run (it would poison the advantages)."""
    g = run.cfg.grpo
    rank, world = distributed.rank_and_world()
    examples = batch_for(run, "grpo", step)
    share = len(examples) // world
    micro_batches = g.generation_steps()
    if share * g.num_generations % micro_batches:
        raise ConfigError(
            f"grpo.steps_per_generation: {micro_batches} micro-batches do not split each process's "
            f"{share * g.num_generations} completions ({share} prompts of the {len(examples)} a step "
            f"takes, times num_generations) equally; choose a divisor"
        )
    mine = examples[rank * share : (rank + 1) * share]
    run.model.eval()
    gen = generate(
        run.model,
        run.tokenizer,
        run.prompts(mine),
        max_new_tokens=run.cfg.max_new_tokens,
        temperature=g.temperature,
        top_p=g.top_p,
        top_k=g.top_k,
        min_p=g.min_p,
        repetition_penalty=g.repetition_penalty,
        seed=run.cfg.seed * 1_000_003 + step,
        num_return_sequences=g.num_generations,
        first_row=rank * share * g.num_generations,
    )
    repeated = [ex for ex in mine for _ in range(g.num_generations)]
    scores = run.task.scores(repeated, gen.texts, completion_ids=gen.completion_ids)
    local = torch.tensor([_reward(run, s) for s in scores], dtype=torch.float64)
    where = f"GRPO step {step}"
    rewards = distributed.gather_blocks(local.view(share, g.num_generations), where=where)  # the whole batch
    if bool(torch.isinf(rewards).any()):
        raise ValueError(
            f"GRPO step {step}: {int(torch.isinf(rewards).sum())} completions got an infinite reward; "
            "fix the reward function so that it returns finite numbers"
        )
    samples = Samples(gen, scores, rewards, share, rank, where)
    if g.multi_objective_aggregation == "normalize_then_sum":
        values, weights = reward_functions(run, scores)
        local_parts = values.view(share, g.num_generations, len(weights))
        samples.per_function = distributed.gather_blocks(local_parts, where=where)
        samples.weights = weights
    return samples


def _reward(run: Run, score: Score) -> float:
    """A completion's reward; NaN where every reward function returned None (TRL leaves such a
    completion out of its group's mean and std, and gives it advantage 0)."""
    if score.rewards and all(math.isnan(v) for v in score.rewards.values()):
        return math.nan
    return score.reward(run.cfg.format_weight)


def reward_functions(run: Run, scores: list[Score]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each reward function's value per completion [completions, functions] (NaN: its None) and the
    weights; a built-in task is one reward function of weight 1 (its format-weighted reward)."""
    task = run.task
    if isinstance(task, DatasetTask):
        names = [f.name for f in task.functions]
        values = [[s.rewards[n] for n in names] for s in scores]
        return torch.tensor(values, dtype=torch.float64).view(-1, len(names)), torch.tensor(
            task.weights, dtype=torch.float64
        )
    values = [[s.reward(run.cfg.format_weight)] for s in scores]
    return torch.tensor(values, dtype=torch.float64).view(-1, 1), torch.ones(1, dtype=torch.float64)


# --- 2. advantages ----------------------------------------------------------------------------------


def nanstd(values: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """Bessel-corrected std ignoring NaNs; NaN where fewer than two values count."""
    dims = tuple(range(values.dim())) if dim is None else (dim,)
    mean = torch.nanmean(values, dim=dims, keepdim=True)
    count = (~torch.isnan(values)).sum(dim=dims, keepdim=True)
    variance = torch.nansum((values - mean) ** 2, dim=dims, keepdim=True) / (count - 1).clamp(min=1)
    std = torch.where(count > 1, variance.sqrt(), torch.full_like(variance, math.nan))
    return std if keepdim else std.squeeze(dims)


def grpo_advantages(
    rewards: torch.Tensor,
    scale_rewards: str,
    *,
    per_function: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    aggregation: str = "sum_then_normalize",
) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's advantages of rewards [prompts, G], and the std per completion they were divided by (the
    group's for "none"), whose zeros TRL counts as frac_reward_zero_std.

    sum_then_normalize: r - group mean, divided by (std + 1e-4) where std is the group's ("group"), the
    whole batch's ("batch") or not at all ("none"). normalize_then_sum (GDPO) reads per_function
    [prompts, G, functions] instead: each function's value minus its group mean, over (its group std +
    1e-4), summed with `weights`; then that sum minus the batch mean, over (the batch std + 1e-4),
    whatever scale_rewards says. NaN values (a function's None) are left out of means, stds and sums.
    """
    if aggregation == "normalize_then_sum":
        if per_function is None or weights is None:
            raise ValueError("grpo_advantages: normalize_then_sum needs per_function and weights")
        centred = per_function - torch.nanmean(per_function, dim=1, keepdim=True)
        normalised = centred / (nanstd(per_function, dim=1, keepdim=True) + 1e-4)
        summed = torch.nansum(normalised * weights.to(normalised), dim=-1)
        std = nanstd(summed).expand_as(summed)
        advantages = (summed - torch.nanmean(summed)) / (std + 1e-4)
        return torch.nan_to_num(advantages, nan=0.0), std
    # NaN rewards (unscored completions) are left out of means and stds and get advantage 0; without
    # them nanmean and nanstd are mean and std.
    centred = rewards - torch.nanmean(rewards, dim=1, keepdim=True)
    if scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards)
    else:
        std = nanstd(rewards, dim=1, keepdim=True).expand_as(rewards)  # Bessel-corrected, as TRL
    advantages = centred if scale_rewards == "none" else centred / (std + 1e-4)
    return torch.where(torch.isnan(rewards), torch.zeros_like(advantages), advantages), std


# --- 3. the loss ------------------------------------------------------------------------------------


def completion_logprobs(
    model, input_ids, attention_mask, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probabilities of input_ids[:, 1:] and the temperature-scaled logits predicting them."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float() / temperature
    logp = torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return logp, logits


def completion_batch(gen, pad_token_id: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded prompt + completion rows: input ids, attention mask, and where the completions are."""
    rows = [p + c for p, c in zip(gen.prompt_ids, gen.completion_ids)]
    width = max(map(len, rows))
    input_ids = torch.tensor([r + [pad_token_id] * (width - len(r)) for r in rows], device=device)
    attention = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], device=device)
    completion = torch.zeros_like(input_ids, dtype=torch.bool)
    for i, (p, c) in enumerate(zip(gen.prompt_ids, gen.completion_ids)):
        completion[i, len(p) : len(p) + len(c)] = True  # EOS included
    return input_ids, attention, completion


def high_entropy_mask(
    entropies: torch.Tensor, mask: torch.Tensor, quantile: float, pool: torch.Tensor | None = None
) -> torch.Tensor:
    """TRL's top_entropy_quantile mask: the masked tokens whose entropy is at least the (1 - quantile)
    quantile (linear interpolation) of `pool`, the entropies of every masked token of the micro-batch
    (default: this one's; under torchrun every process's). Quantile 0 keeps the highest, 1 all."""
    pool = entropies[mask.bool()] if pool is None else pool
    if pool.numel() == 0:
        return torch.zeros_like(mask, dtype=torch.bool)
    exact = entropies.dtype in (torch.float32, torch.float64)  # what torch.quantile computes in
    threshold = torch.quantile(pool.to(entropies.dtype if exact else torch.float32), 1 - quantile)
    return (entropies * mask >= threshold) & mask.bool()


def vespo_weights(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    k_pos: float,
    lambda_pos: float,
    k_neg: float,
    lambda_neg: float,
) -> torch.Tensor:
    """VESPO's weight per completion [B, 1], phi(w) = exp(lambda + k ln w - lambda w) (phi(1) = 1) of the
    sequence ratio w = exp(sum of the masked token log-ratios), each clamped as TRL does; (k, lambda) by
    the advantage's sign (>= 0: the _pos pair). A constant: no gradient flows through it."""
    with torch.no_grad():
        floor = math.log(1e-8)
        summed = (log_ratio.clamp(-20.0, 20.0) * mask).sum(dim=-1, keepdim=True)
        log_w = summed.clamp(floor, 20.0)
        nonneg = advantages >= 0
        k = torch.where(nonneg, log_w.new_tensor(k_pos), log_w.new_tensor(k_neg))
        lam = torch.where(nonneg, log_w.new_tensor(lambda_pos), log_w.new_tensor(lambda_neg)).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    ref_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str,
    epsilon: float,
    epsilon_high: float = 0.0,
    beta: float = 0.0,
    use_bias_correction_kl: bool = False,
    importance_sampling_level: str = "token",
    delta: float = 0.0,
    sapo_temperature_neg: float = 1.05,
    sapo_temperature_pos: float = 1.0,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
    off_policy_mask_threshold: float = 0.0,
    entropy_mask: torch.Tensor | None = None,
    entropies: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    rows: int | None = None,
    tokens: float | None = None,
    micro_tokens: float | None = None,
    entropy_tokens: float | None = None,
    accumulation: int = 1,
    max_completion_length: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """TRL's GRPO loss of one micro-batch of completions, from tensors alone.

    logprobs [B, T]: the policy's per-token log-probabilities (what the gradient flows through);
    old_logprobs: the sampling policy's (None: the current one, detached: ratio 1); ref_logprobs: the
    reference model's (None: no KL term); advantages: one per completion ([B] or [B, 1]); mask [B, T]:
    1.0 on the completion tokens that count.

    The ratio r = exp(logprobs - old_logprobs) per token, or per completion with importance_sampling_level
    "sequence" (exp of the masked mean log-ratio). Per token, by loss_type:
      grpo, dapo, dr_grpo, bnpo, luspo: -min(r' A, clamp(r, 1 - epsilon, 1 + epsilon_high) A), where r' is
        r capped at delta when delta > 0 (two-sided clipping);
      cispo: -sg(min(r, epsilon_high)) A logprobs (sg: no gradient);
      sapo: -sigmoid(tau (r - 1)) 4 / tau A, tau = sapo_temperature_pos where A > 0, else _neg;
      vespo: -phi A logprobs, phi = vespo_weights(...) per completion.
    epsilon_high 0 means epsilon, as TRL's None. That term is multiplied by the off-policy mask (with
    off_policy_mask_threshold > 0: 0 for a completion with A < 0 whose masked mean of old_logprobs -
    logprobs exceeds it) and by entropy_mask (top_entropy_quantile), then beta * k3 is added, k3 =
    exp(ref - logprobs) - (ref - logprobs) - 1, times r when use_bias_correction_kl.

    Then the masked sum, normalised: grpo and sapo each completion by its own token count, then over
    `rows` completions; luspo each completion's sum over `rows`; bnpo by `micro_tokens`; dr_grpo by rows *
    max_completion_length; all of these also by `accumulation` (gradient_accumulation_steps); dapo, cispo
    and vespo by `tokens` (TRL's num_items_in_batch brought to one accumulation window: the step's tokens
    * gradient_accumulation_steps / steps_per_generation). Minus entropy_coef times the mean of
    `entropies` over the mask (times entropy_mask) divided by `entropy_tokens` and `accumulation`.
    rows, tokens, micro_tokens and entropy_tokens are the whole micro-batch's under torchrun (defaults:
    this one's); max_completion_length defaults to T.

    The metrics are sums over this micro-batch (the caller divides by the whole step's counts): "kl"
    (masked k3), "low_clipped" (r < 1 - epsilon where A < 0) and "high_clipped" (r > 1 + epsilon_high
    where A > 0), counted over "clip_units" (masked tokens, or completions at the sequence level);
    "cispo_clipped" (r > epsilon_high where A > 0); "phi" (vespo's weights summed over completions).
    """
    rows = mask.shape[0] if rows is None else rows
    tokens = float(mask.sum()) if tokens is None else tokens
    micro_tokens = float(mask.sum()) if micro_tokens is None else micro_tokens
    adv = advantages.reshape(-1, 1)
    high = epsilon_high or epsilon  # 0 = symmetric clipping, as TRL's None
    old = logprobs.detach() if old_logprobs is None else old_logprobs
    log_ratio = logprobs - old
    if importance_sampling_level == "sequence":  # one ratio per completion (GSPO)
        log_ratio_used = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
        units = torch.ones_like(log_ratio_used)
    else:
        log_ratio_used, units = log_ratio, mask
    ratio = torch.exp(log_ratio_used)
    metrics: dict[str, torch.Tensor] = {}
    if loss_type in ("grpo", "dapo", "dr_grpo", "bnpo", "luspo"):
        clipped = torch.clamp(ratio, 1 - epsilon, 1 + high)
        capped = ratio.clamp(max=delta) if delta > 0 else ratio
        per_token = -torch.min(capped * adv, clipped * adv)
        metrics["low_clipped"] = (((capped < 1 - epsilon) & (adv < 0)).float() * units).sum()
        metrics["high_clipped"] = (((capped > 1 + high) & (adv > 0)).float() * units).sum()
    elif loss_type == "cispo":
        per_token = -ratio.clamp(max=high).detach() * adv * logprobs
        metrics["cispo_clipped"] = (((ratio > high) & (adv > 0)).float() * units).sum()
    elif loss_type == "sapo":
        tau = torch.where(
            adv > 0, ratio.new_tensor(sapo_temperature_pos), ratio.new_tensor(sapo_temperature_neg)
        )
        per_token = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * adv
    elif loss_type == "vespo":
        phi = vespo_weights(
            log_ratio,
            adv,
            mask,
            k_pos=vespo_k_pos,
            lambda_pos=vespo_lambda_pos,
            k_neg=vespo_k_neg,
            lambda_neg=vespo_lambda_neg,
        )
        per_token = -phi * adv * logprobs
        metrics["phi"] = phi.sum()
    else:
        raise ValueError(f"grpo_loss: unknown loss_type {loss_type!r}")
    metrics["clip_units"] = units.sum() if units is mask else torch.tensor(float(mask.shape[0]))
    if off_policy_mask_threshold > 0:  # drop what was sampled far from the policy and is pushed down
        drift = torch.nan_to_num(old - logprobs.detach(), nan=0.0)
        mean_drift = (drift * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
        per_token = per_token * ((adv >= 0) | (mean_drift <= off_policy_mask_threshold)).to(per_token)
    if entropy_mask is not None:
        per_token = per_token * entropy_mask.to(per_token)
    kl = torch.zeros((), device=logprobs.device)
    if ref_logprobs is not None:
        gap = ref_logprobs - logprobs
        k3 = torch.exp(gap) - gap - 1  # unbiased, always >= 0
        if use_bias_correction_kl:  # importance-corrected: the samples came from the old policy
            k3 = k3 * ratio
        per_token = per_token + beta * k3
        kl = (k3 * mask).sum()
    metrics["kl"] = kl.detach()
    summed = per_token * mask  # [B, T] whatever the ratio's shape
    if loss_type in ("grpo", "sapo"):
        loss = (summed.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).sum() / rows / accumulation
    elif loss_type == "luspo":  # a completion's loss grows with its length
        loss = summed.sum() / rows / accumulation
    elif loss_type == "bnpo":
        loss = summed.sum() / max(micro_tokens, 1.0) / accumulation
    elif loss_type == "dr_grpo":  # a constant normaliser, no length bias
        loss = summed.sum() / (rows * (max_completion_length or mask.shape[1])) / accumulation
    else:  # dapo, cispo, vespo
        loss = summed.sum() / max(tokens, 1.0)
    if entropy_coef != 0 and entropies is not None:
        kept = mask if entropy_mask is None else mask * entropy_mask.to(mask)
        count = float(kept.sum()) if entropy_tokens is None else entropy_tokens
        loss = loss - entropy_coef * (entropies * kept).sum() / max(count, 1.0) / accumulation
    return loss, metrics


@dataclass
class Batch:
    """This process's completions as tensors for the loss, and the whole batch's counts."""

    input_ids: torch.Tensor  # [completions, width]: this process's prompt + completion rows, right-padded
    attention: torch.Tensor
    generated: torch.Tensor  # [completions, width - 1] bool: the generated tokens (of input_ids[:, 1:])
    mask: torch.Tensor  # [completions, width - 1] float: the generated tokens the loss counts
    rows: int  # completions in the whole batch
    tokens: float  # masked tokens in the whole batch
    lengths: float  # generated tokens in the whole batch
    truncated: float  # completions cut at max_new_tokens in the whole batch


def completion_tensors(run: Run, samples: Samples) -> Batch:
    """The completions as input ids and masks (without the cut-off ones under mask_truncated_completions)."""
    gen, device = samples.gen, run.model.device
    input_ids, attention, completion = completion_batch(gen, run.tokenizer.pad_token_id, device)
    eos = set(eos_token_ids(run.model, run.tokenizer))
    truncated = torch.tensor([not ids or ids[-1] not in eos for ids in gen.completion_ids], device=device)
    mask = completion[:, 1:].float()
    if run.cfg.grpo.mask_truncated_completions:  # a cut-off completion has no final answer to be judged on
        mask = mask * (~truncated)[:, None]
    tokens, lengths, n_truncated = distributed.all_sum(
        [float(mask.sum()), float(sum(gen.lengths)), float(truncated.sum())], where=samples.where
    ).tolist()
    rows = samples.rewards.numel()
    return Batch(input_ids, attention, completion[:, 1:], mask, rows, tokens, lengths, n_truncated)


@dataclass
class Fit:
    """What the updates measured, summed over the whole batch and every pass over it."""

    loss: float  # summed over the optimizer steps
    low_clipped: float
    high_clipped: float
    clip_units: float  # what the clip counts are out of: tokens, or completions at the sequence level
    cispo_clipped: float
    phi: float  # vespo's weights, summed over completions and passes
    kl: float
    grad_norm: float  # summed over the optimizer steps
    optimizer_steps: int
    entropy_sum: float  # this process's: the first pass's entropy times its generated tokens


def micro_batches(batch: Batch, adv: torch.Tensor, count: int, seed: str) -> list[tuple[torch.Tensor, ...]]:
    """This process's completions cut into `count` equal micro-batches, after a seeded shuffle (TRL
    shuffles the generation batch before splitting it); one micro-batch is the batch as it is."""
    parts = (batch.input_ids, batch.attention, batch.generated, batch.mask, adv)
    if count == 1:
        return [parts]
    order = list(range(len(adv)))
    random.Random(seed).shuffle(order)  # a function of (seed, step, rank): a resume shuffles alike
    index = torch.tensor(order, device=adv.device)
    shuffled = [t[index] for t in parts]
    return list(zip(*(t.chunk(count) for t in shuffled)))


def gather_values(values: torch.Tensor, where: str) -> torch.Tensor:
    """Every process's 1-D `values` (lengths may differ), concatenated."""
    rank, world = distributed.rank_and_world()
    if world == 1:
        return values
    counts = torch.zeros(world, dtype=torch.float64)
    counts[rank] = values.numel()
    counts = distributed.all_sum(counts, where=where).long()
    padded = torch.full((int(counts.max()),), math.nan, dtype=torch.float64)
    padded[: values.numel()] = values.detach().double().cpu()
    gathered = distributed.gather_blocks(padded[None], where=where)
    return torch.cat([gathered[i, : counts[i]] for i in range(world)]).to(values)


def update(run: Run, optimizer, reference, batch: Batch, adv: torch.Tensor, where: str, step: int = 0) -> Fit:
    """The step's optimizer steps on grpo_loss, as TRL's trainer takes them: the completions are split
    into steps_per_generation micro-batches, passed over num_iterations times; every
    gradient_accumulation_steps micro-batches the summed gradients are clipped and one optimizer step
    is taken (with the scheduled learning rate; with sync_ref_model the reference is mixed towards the
    policy every ref_model_sync_steps of them). adv [rows, 1]: this process's advantages; `where`
    ("GRPO step N") names the step in a failed collective's message. The old and reference
    log-probabilities are taken before the first pass; the old ones only when the policy changes
    between the sampling and a pass (otherwise the ratio is 1, as TRL)."""
    g = run.cfg.grpo
    rank, _ = distributed.rank_and_world()
    spg, accumulation = g.generation_steps(), g.gradient_accumulation_steps
    passes = spg * g.num_iterations
    chunks = micro_batches(batch, adv, spg, f"{run.cfg.seed}:grpo-micro-batches:{step}:{rank}")
    olds, refs = [None] * spg, [None] * spg
    with torch.no_grad():
        for i, (input_ids, attention, *_rest) in enumerate(chunks):
            if passes != accumulation:  # more than one optimizer step on these samples
                olds[i] = completion_logprobs(run.model, input_ids, attention, g.temperature)[0]
            if reference is not None:
                refs[i] = completion_logprobs(reference, input_ids, attention, g.temperature)[0]
    # Normalisers: each micro-batch's completions and tokens over every process.
    counts = distributed.all_sum(
        [float(len(c[4])) for c in chunks] + [float(c[3].sum()) for c in chunks], where=where
    )
    micro_rows, micro_tokens = counts[:spg].tolist(), counts[spg:].tolist()
    window_tokens = batch.tokens * accumulation / spg  # dapo, cispo, vespo: TRL's num_items_in_batch
    total_steps = g.steps * g.optimizer_steps()
    lr_at = learning_rates(g.lr, g.lr_scheduler_type, g.warmup_steps, total_steps)
    per_step = g.optimizer_steps()
    entropy_needed = g.top_entropy_quantile < 1 or g.entropy_coef != 0
    entropy_sum = 0.0
    totals = torch.zeros(7, dtype=torch.float64)  # loss, low, high, units, cispo, phi, kl: whole batch
    grad_norms = 0.0
    run.model.train()
    optimizer.zero_grad(set_to_none=True)
    for j in range(passes):
        i = j % spg
        input_ids, attention, generated, mask, mb_adv = chunks[i]
        logp, logits = completion_logprobs(run.model, input_ids, attention, g.temperature)
        if j < spg and generated.any():  # the policy's entropy on the first pass, whatever is masked
            entropy_sum += float(token_entropy(logits.detach(), generated)) * float(generated.sum())
        entropies = entropy_mask = entropy_tokens = None
        if entropy_needed:
            with torch.set_grad_enabled(g.entropy_coef != 0):  # the bonus's gradient flows through them
                entropies = token_entropies(logits)
            if g.top_entropy_quantile < 1:
                pool = gather_values(entropies.detach()[mask.bool()], where)
                entropy_mask = high_entropy_mask(entropies.detach(), mask, g.top_entropy_quantile, pool)
            kept = mask if entropy_mask is None else mask * entropy_mask
            entropy_tokens = float(distributed.all_sum([float(kept.sum())], where=where)[0])
        loss, measured = grpo_loss(
            logp,
            olds[i],
            refs[i],
            mb_adv,
            mask,
            loss_type=g.loss_type,
            epsilon=g.epsilon,
            epsilon_high=g.epsilon_high,
            beta=g.beta,
            use_bias_correction_kl=g.use_bias_correction_kl,
            importance_sampling_level=g.importance_sampling_level,
            delta=g.delta,
            sapo_temperature_neg=g.sapo_temperature_neg,
            sapo_temperature_pos=g.sapo_temperature_pos,
            vespo_k_pos=g.vespo_k_pos,
            vespo_lambda_pos=g.vespo_lambda_pos,
            vespo_k_neg=g.vespo_k_neg,
            vespo_lambda_neg=g.vespo_lambda_neg,
            off_policy_mask_threshold=g.off_policy_mask_threshold,
            entropy_mask=entropy_mask,
            entropies=entropies,
            entropy_coef=g.entropy_coef,
            rows=int(micro_rows[i]),
            tokens=window_tokens,
            micro_tokens=micro_tokens[i],
            entropy_tokens=entropy_tokens,
            accumulation=accumulation,
            max_completion_length=run.cfg.max_new_tokens,
        )
        loss.backward()
        names = ("low_clipped", "high_clipped", "clip_units", "cispo_clipped", "phi", "kl")
        totals += distributed.all_sum(
            [float(loss.detach())] + [float(measured.get(n, 0.0)) for n in names], where=where
        )
        if (j + 1) % accumulation == 0:  # an optimizer step
            distributed.sum_gradients(run.model.parameters(), where=where)
            grad_norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), g.max_grad_norm)
            grad_norms += float(grad_norm)  # the same on every process: the gradients were summed
            n = step * per_step + j // accumulation  # the run's optimizer steps before this one
            for group in optimizer.param_groups:
                group["lr"] = lr_at(n)
            finite_step(run.model, optimizer, where)
            optimizer.zero_grad(set_to_none=True)
            if g.sync_ref_model and reference is not None and (n + 1) % g.ref_model_sync_steps == 0:
                mix_into(reference, run.model, g.ref_model_mixup_alpha)
    run.model.eval()
    loss, low, high, units, cispo, phi, kl = totals.tolist()
    return Fit(loss, low, high, units, cispo, phi, kl, grad_norms, per_step, entropy_sum)


def mix_into(reference: torch.nn.Module, model: torch.nn.Module, alpha: float) -> None:
    """TR-DPO's reference update, as TRL's sync_ref_model: reference = alpha * policy + (1 - alpha) *
    reference, parameter by parameter."""
    with torch.no_grad():
        for ref, p in zip(reference.parameters(), model.parameters(), strict=True):
            ref.mul_(1.0 - alpha).add_(p.detach(), alpha=alpha)


def finite_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, where: str) -> None:
    """optimizer.step(), refused when it would make a weight NaN or inf (fastes.es.optimizer.checked_step):
    the weights are put back and the run stops with one line naming the settings."""
    group = optimizer.param_groups[0]
    fix = f"lower {{lr}} ({group['lr']:g}) or {{weight_decay}} ({group['weight_decay']:g})"
    named = [(name, p) for name, p in model.named_parameters() if p.grad is not None]
    checked_step(optimizer, named, where, fix, {"lr": "grpo.lr", "weight_decay": "grpo.weight_decay"})


# --- 4. log -----------------------------------------------------------------------------------------


def grpo_record(
    run: Run, samples: Samples, std: torch.Tensor, batch: Batch, fit: Fit, seconds: float
) -> dict[str, float]:
    """The step's metrics under TRL's names: rewards, entropy, KL, loss, clipping, lengths, time. The
    loss and grad_norm are means over the step's optimizer steps, the rest over its passes."""
    g = run.cfg.grpo
    rows = batch.rows
    generated = float(batch.generated.sum())
    entropy_sum, generated_count = distributed.all_sum(
        [fit.entropy_sum, generated], where=samples.where
    ).tolist()
    record = {
        "reward": float(torch.nanmean(samples.rewards)),  # unscored completions left out, as TRL
        "reward_std": float(nanstd(samples.rewards)),  # TRL's: the spread of the batch's rewards
        "frac_reward_zero_std": float(std.isclose(torch.zeros_like(std)).double().mean()),
        "entropy": entropy_sum / max(generated_count, 1.0),
        "kl": fit.kl / (g.num_iterations * max(batch.tokens, 1.0)),
        "loss": fit.loss / fit.optimizer_steps,
        "grad_norm": fit.grad_norm / fit.optimizer_steps,
    }
    units = max(fit.clip_units, 1.0)
    if g.loss_type == "cispo":
        record["cispo_clip_ratio"] = fit.cispo_clipped / units
    elif g.loss_type == "vespo":
        record["vespo/phi_seq_mean"] = fit.phi / (g.num_iterations * rows)
    elif g.loss_type != "sapo":
        low, high = fit.low_clipped / units, fit.high_clipped / units
        record["clip_ratio"] = low + high  # TRL's region_mean: tokens where the clip is active
        record["clip_ratio/low_mean"] = low
        record["clip_ratio/high_mean"] = high
    return {
        **record,
        "completion_length": batch.lengths / rows,
        "completions/clipped_ratio": batch.truncated / rows,
        **reward_parts(run.task, samples.scores),
        "seconds": seconds,
        "tokens_per_second": batch.lengths / seconds,
    }


# --- evaluation -------------------------------------------------------------------------------------


@torch.no_grad()
def eval_loss(run: Run, examples: list[Example], reference=None, seed: int = 0) -> float:
    """TRL's eval_loss: GRPO's loss on num_generations sampled completions of each example, at the current
    policy (ratio 1, as on-policy samples have), with the KL term when there is a reference; nothing is
    trained. One process, one micro-batch: the evaluation of a trainer."""
    g = run.cfg.grpo
    gen = generate(
        run.model,
        run.tokenizer,
        run.prompts(examples),
        max_new_tokens=run.cfg.max_new_tokens,
        temperature=g.temperature,
        top_p=g.top_p,
        seed=seed,
        num_return_sequences=g.num_generations,
    )
    repeated = [ex for ex in examples for _ in range(g.num_generations)]
    scores = run.task.scores(repeated, gen.texts, completion_ids=gen.completion_ids)
    rewards = torch.tensor([_reward(run, s) for s in scores], dtype=torch.float64)
    advantages, _ = grpo_advantages(rewards.view(len(examples), g.num_generations), g.scale_rewards)
    input_ids, attention, completion = completion_batch(gen, run.tokenizer.pad_token_id, run.model.device)
    logp, _ = completion_logprobs(run.model, input_ids, attention, g.temperature)
    ref = (
        None if reference is None else completion_logprobs(reference, input_ids, attention, g.temperature)[0]
    )
    loss, _ = grpo_loss(
        logp,
        None,
        ref,
        advantages.reshape(-1, 1).float().to(logp.device),
        completion[:, 1:].float(),
        loss_type=g.loss_type,
        epsilon=g.epsilon,
        epsilon_high=g.epsilon_high,
        beta=g.beta if ref is not None else 0.0,
        use_bias_correction_kl=g.use_bias_correction_kl,
        importance_sampling_level=g.importance_sampling_level,
        delta=g.delta,
        sapo_temperature_neg=g.sapo_temperature_neg,
        sapo_temperature_pos=g.sapo_temperature_pos,
        vespo_k_pos=g.vespo_k_pos,
        vespo_lambda_pos=g.vespo_lambda_pos,
        vespo_k_neg=g.vespo_k_neg,
        vespo_lambda_neg=g.vespo_lambda_neg,
        max_completion_length=run.cfg.max_new_tokens,
    )
    return float(loss)
