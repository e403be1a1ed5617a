"""GRPO, as TRL's GRPOTrainer computes it, in four stages that each read on their own:

1. sample_and_score: G completions per prompt, scored; the whole batch's rewards.
2. grpo_advantages: each reward against its group's mean, scaled by a std.
3. grpo_loss: the clipped surrogate (+ beta * k3 KL to the reference), a pure function of tensors,
   applied num_iterations times by `update`.
4. grpo_record: the metrics TRL logs, for metrics.jsonl.

grpo_step runs them in that order. Under torchrun each process takes an equal slice of the prompts;
rewards are gathered, so advantages and metrics are the whole batch's, each loss is divided by the whole
batch's normaliser, and the gradients are summed before clipping: every process takes the step one
process would take (up to the order of float additions).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from . import distributed
from .analysis.entropy import token_entropy
from .es import checked_step
from .generation import Generation, eos_token_ids, generate
from .run import Run, batch_for, reward_parts
from .tasks import Score


def make_grpo_optimizer(run: Run) -> torch.optim.Optimizer:
    g = run.cfg.grpo
    return torch.optim.AdamW(run.model.parameters(), lr=g.lr, weight_decay=g.weight_decay)


def grpo_step(run: Run, optimizer: torch.optim.Optimizer, reference, step: int) -> dict[str, float]:
    """Sample G completions per prompt, then num_iterations clipped-surrogate updates on them (TRL's GRPO).
    `reference` is the frozen model of the KL term (None: beta 0, no KL)."""
    start = time.perf_counter()
    samples = sample_and_score(run, step)
    advantages, std = grpo_advantages(samples.rewards, run.cfg.grpo.scale_rewards)
    batch = completion_tensors(run, samples)
    fit = update(
        run, optimizer, reference, batch, samples.mine(advantages).to(batch.mask.device), samples.where
    )
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
    scores = run.task.scores(repeated, gen.texts)
    local = torch.tensor([s.reward(run.cfg.format_weight) for s in scores], dtype=torch.float64)
    where = f"GRPO step {step}"
    rewards = distributed.gather_blocks(local.view(share, g.num_generations), where=where)  # the whole batch
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError(
            f"GRPO step {step}: {int((~torch.isfinite(rewards)).sum())} completions got a non-finite reward; "
            "fix the reward function so that it returns finite numbers"
        )
    return Samples(gen, scores, rewards, share, rank, where)


# --- 2. advantages ----------------------------------------------------------------------------------


def grpo_advantages(rewards: torch.Tensor, scale_rewards: str) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's advantages of rewards [prompts, G]: r - group mean, divided by (std + 1e-4) where std is the
    group's ("group"), the whole batch's ("batch") or not at all ("none"). Also returns that std per
    completion (the group's for "none"), whose mean TRL logs as reward_std."""
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if scale_rewards == "batch":
        std = rewards.std().expand_as(rewards)
    else:
        std = rewards.std(dim=1, keepdim=True).expand_as(rewards)  # Bessel-corrected, as TRL
    return (centred if scale_rewards == "none" else centred / (std + 1e-4)), std


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
    rows: int | None = None,
    tokens: float | None = None,
    max_completion_length: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """TRL's GRPO loss of a batch of completions, from tensors alone.

    logprobs [B, T]: the policy's per-token log-probabilities (what the gradient flows through);
    old_logprobs: the sampling policy's (None: the current one, detached: one update per batch, ratio 1);
    ref_logprobs: the reference model's (None: no KL term); advantages: one per completion ([B] or
    [B, 1]); mask [B, T]: 1.0 on the completion tokens that count.

    Per token, with ratio = exp(logprobs - old_logprobs):
        -min(ratio * A, clamp(ratio, 1 - epsilon, 1 + epsilon_high) * A) + beta * k3,
        k3 = exp(ref - logprobs) - (ref - logprobs) - 1, times ratio when use_bias_correction_kl.
    epsilon_high 0 means epsilon (symmetric). Then summed over the masked tokens and normalised by
    loss_type: "grpo" each completion by its own token count, then over `rows` completions; "dapo" by
    `tokens`; "dr_grpo" by rows * max_completion_length. `rows` and `tokens` are the whole batch's under
    torchrun (defaults: this batch's, B and mask.sum()); max_completion_length defaults to T.

    The metrics are sums over this batch's masked tokens (the caller divides by the whole batch's token
    count): "kl" (k3; 0 without a reference), "low_clipped" (ratio < 1 - epsilon where A < 0) and
    "high_clipped" (ratio > 1 + epsilon_high where A > 0): TRL's clip-ratio counts.
    """
    rows = mask.shape[0] if rows is None else rows
    tokens = float(mask.sum()) if tokens is None else tokens
    adv = advantages.reshape(-1, 1)
    high = epsilon_high or epsilon  # 0 = symmetric clipping, as TRL's None
    ratio = torch.exp(logprobs - (logprobs.detach() if old_logprobs is None else old_logprobs))
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + high)
    per_token = -torch.min(ratio * adv, clipped * adv)
    kl = torch.zeros((), device=logprobs.device)
    if ref_logprobs is not None:
        delta = ref_logprobs - logprobs
        k3 = torch.exp(delta) - delta - 1  # unbiased, always >= 0
        if use_bias_correction_kl:  # importance-corrected: the samples came from the old policy
            k3 = k3 * ratio
        per_token = per_token + beta * k3
        kl = (k3 * mask).sum()
    if loss_type == "grpo":
        loss = ((per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)).sum() / rows
    elif loss_type == "dapo":
        loss = (per_token * mask).sum() / max(tokens, 1.0)
    elif loss_type == "dr_grpo":  # a constant normaliser, no length bias
        loss = (per_token * mask).sum() / (rows * (max_completion_length or mask.shape[1]))
    else:
        raise ValueError(f"grpo_loss: unknown loss_type {loss_type!r}")
    low_clipped = ((ratio < 1 - epsilon) & (adv < 0)).float() * mask
    high_clipped = ((ratio > 1 + high) & (adv > 0)).float() * mask
    metrics = {"kl": kl.detach(), "low_clipped": low_clipped.sum(), "high_clipped": high_clipped.sum()}
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
    """What the updates measured, summed over the whole batch and the num_iterations updates."""

    loss: float
    low_clipped: float
    high_clipped: float
    kl: float
    grad_norm: float
    entropy_sum: float  # this process's: the first update's entropy times its generated tokens


def update(run: Run, optimizer, reference, batch: Batch, adv: torch.Tensor, where: str) -> Fit:
    """num_iterations optimizer steps on grpo_loss over the same completions; adv [rows, 1]: this
    process's advantages; `where` ("GRPO step N") names the step in a failed collective's message. The
    old and reference log-probabilities are taken once, before the first."""
    g = run.cfg.grpo
    with torch.no_grad():
        old_logp = None  # with one update per batch the old policy is the current one
        if g.num_iterations > 1:
            old_logp, _ = completion_logprobs(run.model, batch.input_ids, batch.attention, g.temperature)
        ref_logp = None
        if reference is not None:
            ref_logp, _ = completion_logprobs(reference, batch.input_ids, batch.attention, g.temperature)
    entropy_sum = 0.0
    totals = torch.zeros(4, dtype=torch.float64)  # loss, low-clipped, high-clipped, kl: whole batch
    grad_norms = 0.0
    run.model.train()
    for iteration in range(g.num_iterations):
        logp, logits = completion_logprobs(run.model, batch.input_ids, batch.attention, g.temperature)
        if iteration == 0 and batch.generated.any():  # the policy's entropy, whatever is masked
            generated = float(batch.generated.sum())
            entropy_sum = float(token_entropy(logits.detach(), batch.generated)) * generated
        loss, measured = grpo_loss(
            logp,
            old_logp,
            ref_logp,
            adv,
            batch.mask,
            loss_type=g.loss_type,
            epsilon=g.epsilon,
            epsilon_high=g.epsilon_high,
            beta=g.beta,
            use_bias_correction_kl=g.use_bias_correction_kl,
            rows=batch.rows,
            tokens=batch.tokens,
            max_completion_length=run.cfg.max_new_tokens,
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        distributed.sum_gradients(run.model.parameters(), where=where)
        grad_norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), g.max_grad_norm)
        finite_step(run.model, optimizer, where)
        parts = [loss.detach(), measured["low_clipped"], measured["high_clipped"], measured["kl"]]
        totals += distributed.all_sum([float(x) for x in parts], where=where)
        grad_norms += float(grad_norm)  # the same on every process: the gradients were summed
    run.model.eval()
    loss, low, high, kl = totals.tolist()
    return Fit(loss, low, high, kl, grad_norms, entropy_sum)


def finite_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, where: str) -> None:
    """optimizer.step(), refused when it would make a weight NaN or inf (fastes.es.checked_step): the
    weights are put back and the run stops with one line naming the settings."""
    group = optimizer.param_groups[0]
    fix = f"lower {{lr}} ({group['lr']:g}) or {{weight_decay}} ({group['weight_decay']:g})"
    named = [(name, p) for name, p in model.named_parameters() if p.grad is not None]
    checked_step(optimizer, named, where, fix, {"lr": "grpo.lr", "weight_decay": "grpo.weight_decay"})


# --- 4. log -----------------------------------------------------------------------------------------


def grpo_record(
    run: Run, samples: Samples, std: torch.Tensor, batch: Batch, fit: Fit, seconds: float
) -> dict[str, float]:
    """The step's metrics under TRL's names: rewards, entropy, KL, loss, clipping, lengths, time."""
    n = run.cfg.grpo.num_iterations
    rows = batch.rows
    per_token = n * max(batch.tokens, 1.0)
    generated = float(batch.generated.sum())
    entropy_sum, generated_count = distributed.all_sum(
        [fit.entropy_sum, generated], where=samples.where
    ).tolist()
    low, high = fit.low_clipped / per_token, fit.high_clipped / per_token
    group_std = samples.rewards.std(dim=1)
    return {
        "reward": float(samples.rewards.mean()),
        "reward_std": float(std.mean()),  # TRL's: the std advantages are scaled by, averaged
        "frac_reward_zero_std": float(group_std.isclose(torch.zeros_like(group_std)).double().mean()),
        "entropy": entropy_sum / max(generated_count, 1.0),
        "kl": fit.kl / per_token,
        "loss": fit.loss / n,
        "grad_norm": fit.grad_norm / n,
        "clip_ratio": low + high,  # TRL's region_mean: tokens where the clip is active
        "clip_ratio/low_mean": low,
        "clip_ratio/high_mean": high,
        "completion_length": batch.lengths / rows,
        "completions/clipped_ratio": batch.truncated / rows,
        **reward_parts(run.task, samples.scores),
        "seconds": seconds,
        "tokens_per_second": batch.lengths / seconds,
    }
