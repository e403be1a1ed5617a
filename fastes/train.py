"""Post-training loops: ES and GRPO on a verifiable task, or GRPO then ES, in one resumable run.

A run directory holds run.json (the run's identity, fastes/rundir.py), config.json, metrics.jsonl (one
line per step), checkpoints/ and, at the end, final/ (a Hugging Face model directory). Everything random
is derived from (seed, phase, step), so a run resumed from a checkpoint continues exactly as the
uninterrupted run would have.
"""

from __future__ import annotations

import copy
import json
import math
import random
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from . import ES, defaults, distributed, linear_weights, rundir
from .analysis.diversity import js_diversity
from .analysis.entropy import token_entropy
from .batched import member_groups, population_batched
from .callbacks import TENSORBOARD_DIR, Callbacks, TensorBoardCallback
from .checkpoint import latest_checkpoint, save_checkpoint, write_atomic
from .config import ConfigError, ESConfig, TrainConfig, dataset_task, es_kwargs
from .errors import FastesError
from .es import CollectiveError
from .generation import eos_token_ids, generate
from .model_sources import resolve_model
from .models import ModelError, format_prompt, is_character_tokenizer, load_model, save_model
from .tasks import DatasetTask, Example, Score, Task, available_tasks, get_task
from .tasks.base import DEFAULT_TEST_PROBLEMS

PHASES = {"es": ("es",), "grpo": ("grpo",), "grpo_es": ("grpo", "es")}
GRPO_CHECKSUM_EVERY = 10  # GRPO steps between the cross-process weight checks (ES has its own)


@dataclass
class Run:
    """What every phase needs: the config, the policy, the task and where to write."""

    cfg: TrainConfig
    model: torch.nn.Module
    tokenizer: Any
    task: Task
    out_dir: Path
    identity: dict[str, Any] = field(default_factory=dict)  # rundir.run_identity, saved in checkpoints
    metrics: list[dict] = field(default_factory=list)
    callbacks: Callbacks = field(default_factory=Callbacks)  # called by the writing process only

    def log(self, record: dict) -> None:
        self.metrics.append(record)
        if distributed.is_writer():  # every rank holds the same (all-reduced) records; one writes them
            rundir.append_metrics(self.out_dir, record)
            self.callbacks.log(record)

    def prompts(self, examples: list[Example]) -> list[str]:
        return render_prompts(self.cfg, self.tokenizer, examples)


def render_prompts(cfg: TrainConfig, tokenizer: Any, examples: list[Example]) -> list[str]:
    """The model's input text for each example: its prompt with the run's chat template and system prompt."""
    return [
        format_prompt(tokenizer, ex.prompt, chat_template=cfg.chat_template, system_prompt=cfg.system_prompt)
        for ex in examples
    ]


def batch_for(run: Run, phase: str, step: int) -> list[Example]:
    """The training prompts of (phase, step): a pure function of the seed, so resume sees the same ones."""
    rng = random.Random(f"{run.cfg.seed}:{phase}:{step}")
    train = run.task.split("train")
    return rng.sample(train, min(run.cfg.batch_size, len(train)))


@torch.no_grad()
def evaluate(run: Run, examples: list[Example]) -> dict[str, Any]:
    """Greedy accuracy and format rate of the current weights on `examples` (shared by the processes),
    and which examples it solves (1.0 / 0.0 each, in order)."""
    rank, world = distributed.rank_and_world()
    mine = examples[rank::world]
    correct, fmt, lenient, scored = [], 0.0, 0.0, []
    lenient_score = getattr(run.task, "lenient_score", None)  # instruct forms read answers leniently too
    batch_size = run.cfg.eval_batch_size
    for start in range(0, len(mine), batch_size):
        chunk = mine[start : start + batch_size]
        gen = generate(run.model, run.tokenizer, run.prompts(chunk), max_new_tokens=run.cfg.max_new_tokens)
        scores = run.task.scores(chunk, gen.texts)
        correct += [s.answer for s in scores]
        fmt += sum(s.format for s in scores)
        scored += scores
        if lenient_score is not None:
            lenient += sum(lenient_score(ex, text).answer for ex, text in zip(chunk, gen.texts))
    every = distributed.gather_strided(torch.tensor(correct, dtype=torch.float64), len(examples)).tolist()
    answer, fmt, lenient = distributed.all_sum([sum(correct), fmt, lenient]).tolist()
    result = {"accuracy": answer / len(examples), "format": fmt / len(examples), "correct": every}
    if lenient_score is not None:
        result["lenient_accuracy"] = lenient / len(examples)
    return {**result, "record": _eval_record(result, reward_parts(run.task, scored))}


def _eval_record(result: dict[str, Any], parts: dict[str, float]) -> dict[str, float]:
    """An evaluation's metrics.jsonl keys; with several reward functions also the weighted reward
    (= test_accuracy) and each function's mean under TRL's names."""
    record = {"test_accuracy": result["accuracy"], "test_format": result["format"]}
    if "lenient_accuracy" in result:
        record["test_lenient_accuracy"] = result["lenient_accuracy"]
    if parts:
        record["test_reward"] = result["accuracy"]
        record.update({f"test_{k}": v for k, v in parts.items() if k.endswith("/mean")})
    return record


def reward_parts(task: Task, scores: list[Score]) -> dict[str, float]:
    """rewards/<name>/mean and /std of each reward function over the scores of every process (TRL's
    metrics), for tasks scored by named reward functions; a function's None (NaN) values left out.
    The names come from the task, so that every process joins the sum, also one without scores."""
    names = [f.name for f in task.functions] if isinstance(task, DatasetTask) else []
    if not names:
        return {}
    values = torch.tensor([[s.rewards[n] for n in names] for s in scores], dtype=torch.float64)
    values = values.reshape(len(scores), len(names))  # also when there are no scores
    finite = torch.isfinite(values)
    zeroed = torch.where(finite, values, torch.zeros_like(values))
    count, total = distributed.all_sum(torch.cat([finite.sum(0).double(), zeroed.sum(0)])).view(2, -1)
    mean = total / count  # NaN for a function that scored nothing
    # Two passes: the squared deviations from the mean, not sum(x^2) - n mean^2, which cancels badly.
    squares = distributed.all_sum(torch.where(finite, (values - mean) ** 2, 0.0).sum(0))
    std = (squares / (count - 1)).sqrt()
    parts = {}
    for i, name in enumerate(names):
        parts[f"rewards/{name}/mean"] = float(mean[i])
        parts[f"rewards/{name}/std"] = float(std[i]) if count[i] > 1 else math.nan
    return parts


def paired_gain(before: list[float], after: list[float]) -> tuple[float, float]:
    """Mean per-problem gain of `after` over `before` on the same problems, and its standard error.

    Pairing removes the problem-to-problem variance that two independent accuracies would carry, so a
    gain of 3 standard errors is a real improvement, not a lucky test set.
    """
    diff = torch.tensor(after, dtype=torch.float64) - torch.tensor(before, dtype=torch.float64)
    se = float(diff.std(correction=1) / math.sqrt(len(diff))) if len(diff) > 1 else math.inf
    return float(diff.mean()), se


# --- ES ---------------------------------------------------------------------------------------------


def evolved_weights(model: torch.nn.Module, c: ESConfig) -> list[tuple[str, torch.nn.Parameter]]:
    """The (name, tensor) pairs the config asks ES to evolve (es.evolve, es.include_*)."""
    return linear_weights(
        model,
        names=c.evolve or None,
        include_embeddings=c.include_embeddings,
        include_norms=c.include_norms,
        include_biases=c.include_biases,
    )


def make_es(run: Run) -> ES:
    """The run's ES: the evolved weights of its config, and every ES argument the config sets (es_kwargs)."""
    return ES(evolved_weights(run.model, run.cfg.es), **es_kwargs(run.cfg))


def es_iteration(run: Run, es: ES, step: int) -> dict[str, float]:
    """Score every member on one batch of prompts (greedy), then take the ES step.

    eval_mode "member" generates member by member under each member's perturbation; "materialised" and
    "virtual" generate for the whole population in one call (fastes.batched), rows grouped by member;
    materialised mode in groups whose perturbed weights fit in es.materialise_mb (big models: one each).
    Under torchrun each process evaluates its members (es.members()) and es.step all-reduces the rewards.
    """
    examples = batch_for(run, "es", step)
    prompts = run.prompts(examples)
    max_new = run.cfg.max_new_tokens
    start = time.perf_counter()
    timer = PartTimer()
    texts, tokens = [], 0
    mode = run.cfg.es.eval_mode
    if mode != "member":
        for group in member_groups(es, mode, run.cfg.es.materialise_mb * 2**20):
            with ExitStack() as stack:
                with timer("noise"):  # the members' weights (materialised) or noise factors (lowrank)
                    members = stack.enter_context(population_batched(es, run.model, mode=mode, members=group))
                with timer("generation"):
                    gen = generate(run.model, run.tokenizer, prompts * len(members), max_new_tokens=max_new)
            texts += [gen.texts[i * len(prompts) : (i + 1) * len(prompts)] for i in range(len(members))]
            tokens += gen.num_tokens
    else:
        for member in es.members():
            with ExitStack() as stack:
                with timer("noise"):  # perturb in place
                    stack.enter_context(member)
                with timer("generation"):
                    gen = generate(run.model, run.tokenizer, prompts, max_new_tokens=max_new)
                with timer("noise"):  # restore, exactly
                    stack.close()
            texts.append(gen.texts)
            tokens += gen.num_tokens
    with timer("scoring"):
        flat = run.task.scores(examples * len(texts), [t for member_texts in texts for t in member_texts])
    scores = [flat[i * len(examples) : (i + 1) * len(examples)] for i in range(len(texts))]
    weights = [[s.reward(run.cfg.format_weight) for s in row] for row in scores]
    with timer("update"):
        rewards = es.step(torch.tensor(weights, dtype=torch.float64))
    answers = torch.tensor([[s.answer for s in row] for row in scores], dtype=torch.float64)
    well_formed = distributed.all_sum([sum(s.format for s in flat), len(flat)]).tolist()
    answers = distributed.gather_strided(answers, es.population)
    tokens = int(distributed.all_sum([tokens])[0])
    seconds = time.perf_counter() - start
    per_member = rewards.mean(dim=1)
    record = {
        "reward": float(per_member.mean()),
        "reward_std": float(per_member.std(correction=0)),
        "reward_max": float(per_member.max()),
        "format": well_formed[0] / well_formed[1],
    }
    # JS diversity is defined on acceptance rates in [0, 1]: verifier outcomes, not any user reward.
    if bool(((answers >= 0) & (answers <= 1)).all()):
        diversity = js_diversity(answers)
        record.update(js_diversity=float(diversity.normalized), members_agree=float(diversity.agreement))
    record.update(reward_parts(run.task, flat))
    return {**record, "seconds": seconds, "tokens_per_second": tokens / seconds, **timer.record()}


class PartTimer:
    """Seconds spent in each named part of an iteration: `with timer("noise"): ...`, then record()."""

    PARTS = ("generation", "noise", "scoring", "update")

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(self.PARTS, 0.0)

    @contextmanager
    def __call__(self, part: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[part] += time.perf_counter() - start

    def record(self) -> dict[str, float]:
        """{"time/generation": s, ...}: the metric names of metrics.jsonl."""
        return {f"time/{part}": seconds for part, seconds in self.seconds.items()}


# --- GRPO -------------------------------------------------------------------------------------------


def completion_logprobs(
    model, input_ids, attention_mask, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probabilities of input_ids[:, 1:] and the temperature-scaled logits predicting them."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float() / temperature
    logp = torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return logp, logits


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


def grpo_step(run: Run, optimizer: torch.optim.Optimizer, reference, step: int) -> dict[str, float]:
    """Sample G completions per prompt, then num_iterations clipped-surrogate updates on them (TRL's GRPO).

    Under torchrun each process takes an equal slice of the prompts; rewards are gathered, so advantages
    and metrics are the whole batch's, each loss is divided by the whole batch's normaliser, and the
    gradients are summed before clipping: every process takes the step one process would take (up to the
    order of float additions).
    """
    g = run.cfg.grpo
    rank, world = distributed.rank_and_world()
    examples = batch_for(run, "grpo", step)
    share = len(examples) // world
    mine = examples[rank * share : (rank + 1) * share]
    start = time.perf_counter()
    run.model.eval()
    gen = generate(
        run.model,
        run.tokenizer,
        run.prompts(mine),
        max_new_tokens=run.cfg.max_new_tokens,
        temperature=g.temperature,
        top_p=g.top_p,
        seed=run.cfg.seed * 1_000_003 + step,
        num_return_sequences=g.num_generations,
        first_row=rank * share * g.num_generations,
    )
    repeated = [ex for ex in mine for _ in range(g.num_generations)]
    scores = run.task.scores(repeated, gen.texts)
    local = torch.tensor([s.reward(run.cfg.format_weight) for s in scores], dtype=torch.float64)
    rewards = distributed.gather_blocks(local.view(share, g.num_generations))  # the whole batch
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError(
            f"GRPO step {step}: {int((~torch.isfinite(rewards)).sum())} completions got a non-finite reward; "
            "fix the reward function so that it returns finite numbers"
        )
    advantages, std = grpo_advantages(rewards, g.scale_rewards)
    device = run.model.device
    adv = advantages[rank * share : (rank + 1) * share].reshape(-1, 1).float().to(device)

    input_ids, attention, completion = completion_batch(gen, run.tokenizer.pad_token_id, device)
    eos = set(eos_token_ids(run.model, run.tokenizer))
    truncated = torch.tensor([not ids or ids[-1] not in eos for ids in gen.completion_ids], device=device)
    mask = completion[:, 1:].float()
    if g.mask_truncated_completions:  # a cut-off completion has no final answer to be judged on
        mask = mask * (~truncated)[:, None]
    rows = len(examples) * g.num_generations
    tokens, lengths, n_truncated = distributed.all_sum(
        [float(mask.sum()), float(sum(gen.lengths)), float(truncated.sum())]
    ).tolist()

    with torch.no_grad():
        old_logp = None  # with one update per batch the old policy is the current one
        if g.num_iterations > 1:
            old_logp, _ = completion_logprobs(run.model, input_ids, attention, g.temperature)
        ref_logp = None
        if reference is not None:
            ref_logp, _ = completion_logprobs(reference, input_ids, attention, g.temperature)
    high = g.epsilon_high or g.epsilon  # 0 = symmetric clipping, as TRL's None
    generated = completion[:, 1:]  # every generated token (entropy is the policy's, whatever is masked)
    entropy_sum = 0.0
    totals = torch.zeros(4, dtype=torch.float64)  # loss, low-clipped, high-clipped, kl: whole batch
    grad_norms = 0.0
    run.model.train()
    for iteration in range(g.num_iterations):
        logp, logits = completion_logprobs(run.model, input_ids, attention, g.temperature)
        if iteration == 0 and generated.any():
            entropy_sum = float(token_entropy(logits.detach(), generated)) * float(generated.sum())
        ratio = torch.exp(logp - (logp.detach() if old_logp is None else old_logp))
        clipped = torch.clamp(ratio, 1 - g.epsilon, 1 + high)
        per_token = -torch.min(ratio * adv, clipped * adv)
        kl = torch.zeros((), device=device)
        if ref_logp is not None:
            delta = ref_logp - logp
            k3 = torch.exp(delta) - delta - 1  # unbiased, always >= 0
            if g.use_bias_correction_kl:  # importance-corrected: samples came from the old policy
                k3 = k3 * ratio
            per_token = per_token + g.beta * k3
            kl = (k3 * mask).sum()
        if g.loss_type == "grpo":
            loss = ((per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)).sum() / rows
        elif g.loss_type == "dapo":
            loss = (per_token * mask).sum() / max(tokens, 1.0)
        else:  # dr_grpo: a constant normaliser, no length bias
            loss = (per_token * mask).sum() / (rows * run.cfg.max_new_tokens)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        distributed.sum_gradients(run.model.parameters())
        grad_norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), g.max_grad_norm)
        optimizer.step()
        low_clipped = ((ratio < 1 - g.epsilon) & (adv < 0)).float() * mask
        high_clipped = ((ratio > 1 + high) & (adv > 0)).float() * mask
        parts = [loss.detach(), low_clipped.sum(), high_clipped.sum(), kl.detach()]
        totals += distributed.all_sum([float(x) for x in parts])
        grad_norms += float(grad_norm)  # the same on every process: the gradients were summed
    run.model.eval()

    seconds = time.perf_counter() - start
    n = g.num_iterations
    per_token = n * max(tokens, 1.0)
    entropy_sum, generated_count = distributed.all_sum([entropy_sum, float(generated.sum())]).tolist()
    low, high_share = float(totals[1]) / per_token, float(totals[2]) / per_token
    group_std = rewards.std(dim=1)
    return {
        "reward": float(rewards.mean()),
        "reward_std": float(std.mean()),  # TRL's: the std advantages are scaled by, averaged
        "frac_reward_zero_std": float(group_std.isclose(torch.zeros_like(group_std)).double().mean()),
        "entropy": entropy_sum / max(generated_count, 1.0),
        "kl": float(totals[3]) / per_token,
        "loss": float(totals[0]) / n,
        "grad_norm": grad_norms / n,
        "clip_ratio": low + high_share,  # TRL's region_mean: tokens where the clip is active
        "clip_ratio/low_mean": low,
        "clip_ratio/high_mean": high_share,
        "completion_length": lengths / rows,
        "completions/clipped_ratio": n_truncated / rows,
        **reward_parts(run.task, scores),
        "seconds": seconds,
        "tokens_per_second": lengths / seconds,
    }


NO_SIGNAL_STEPS = 3  # steps in a row where every member (ES) or every group (GRPO) scored alike


class NoSignal:
    """Counts the steps in a row that had nothing to learn from: every ES member scored the same
    (reward_std 0), or every GRPO group's completions did (frac_reward_zero_std 1)."""

    def __init__(self) -> None:
        self.streak = 0

    def update(self, record: dict[str, Any]) -> bool:
        """Count `record`'s step; True when the streak has just reached NO_SIGNAL_STEPS (warn once)."""
        flat = record.get("frac_reward_zero_std", 0.0) == 1.0 or record.get("reward_std", 1.0) == 0.0
        self.streak = self.streak + 1 if flat else 0
        return self.streak == NO_SIGNAL_STEPS

    def warning(self, phase: str) -> str:
        who = "every member" if phase == "es" else "every group of completions"
        return (
            f"fastes: warning: {who} scored the same for {NO_SIGNAL_STEPS} {phase.upper()} steps in a row "
            "(reward_std 0), so nothing can be learned. Usual causes: the task is too hard or too easy for "
            "the model (look at its answers: fastes eval --show 5), answers cut short by max_new_tokens, a "
            "prompt form the verifier does not read (prompt_style, chat_template), or a sigma too small to "
            "change any answer"
        )


def progress_fields(record: dict[str, Any], no_signal: bool) -> dict[str, str]:
    """The progress bar's postfix: phase, reward, test accuracy, and where the step's time went."""
    fields = {
        "phase": record["phase"],
        "reward": f"{record['reward']:.3f}",
        "test": f"{record.get('test_accuracy', float('nan')):.3f}",
    }
    if no_signal:
        fields["signal"] = "NONE"
    parts = {part: record.get(f"time/{part}") for part in PartTimer.PARTS}
    if all(seconds is not None for seconds in parts.values()):
        fields["time"] = " ".join(f"{part} {seconds:.1f}s" for part, seconds in parts.items())
    return fields


def make_grpo_optimizer(run: Run) -> torch.optim.Optimizer:
    g = run.cfg.grpo
    return torch.optim.AdamW(run.model.parameters(), lr=g.lr, weight_decay=g.weight_decay)


# --- the run ----------------------------------------------------------------------------------------


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """AdamW state split into tensors (for safetensors) and plain JSON (param groups, tensor names)."""
    state = optimizer.state_dict()
    tensors, layout = {}, {}
    for index, values in state["state"].items():
        for name, value in values.items():
            tensors[f"optimizer.{index}.{name}"] = value
            layout.setdefault(str(index), []).append(name)
    return tensors, {"param_groups": state["param_groups"], "layout": layout}


def _load_optimizer(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], saved: dict) -> None:
    state = {
        int(i): {n: tensors[f"optimizer.{i}.{n}"] for n in names} for i, names in saved["layout"].items()
    }
    optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})


def _checkpoint(run: Run, global_step: int, phase_index: int, step: int, es: ES | None, optimizer) -> None:
    if not distributed.is_writer():  # every process holds the same state; one writes it
        return
    tensors = {f"model.{k}": v for k, v in run.model.state_dict().items()}
    state: dict[str, Any] = {
        "phase_index": phase_index,
        "step": step,
        "run": run.identity,
        "metrics": run.metrics,  # metrics.jsonl up to here: rewritten from this on resume
    }
    if es is not None:
        state["es"] = es.state_dict()
    if optimizer is not None:
        opt_tensors, state["optimizer"] = _optimizer_tensors(optimizer)
        tensors.update(opt_tensors)
    path = save_checkpoint(run.out_dir, global_step, tensors, state)
    run.callbacks.fire("on_save", global_step, path)


def check_task(task: Task, cfg: TrainConfig) -> None:
    # Rows given as a dataset may come without held-out rows: such a run skips evaluation, as TRL does.
    splits = ("train",) if isinstance(task, DatasetTask) else ("train", "test")
    for split in splits:
        try:
            examples = task.split(split)  # a generated task draws its problems now
        except ValueError as error:
            if isinstance(error, FastesError):
                raise
            raise ConfigError(f"task: {error}") from None
        if not examples:
            raise ConfigError(f"task: {cfg.task!r} has no {split} problems; add some, or choose another task")


def _check_evolvable(model: torch.nn.Module, model_dir: Path, es: ESConfig) -> None:
    try:
        evolved_weights(model, es)
    except ValueError as error:
        if es.evolve:  # the name filter matches nothing
            raise ConfigError(f"es.evolve: {error}") from None
        raise ModelError(f"{model_dir}: {error}. ES cannot train it; use algorithm = 'grpo'") from None


def _resume_point(
    out_dir: Path, identity: dict[str, Any], phases: tuple[str, ...]
) -> tuple[tuple[int, dict, dict] | None, str]:
    """The newest checkpoint of the run in out_dir (None: none written yet), after checking that this is
    the same run: same settings (the length may grow) and the same starting model."""
    saved = rundir.saved_identity(out_dir)
    found = latest_checkpoint(out_dir)
    if found is None and saved is None:
        raise rundir.RunDirError(
            f"--resume: {out_dir} holds no run to resume (no {rundir.RUN_FILE}, no checkpoints); "
            "start a new run without --resume"
        )
    recorded, finished = saved, ()
    if found is not None:
        step, _, state = found
        recorded = rundir.checkpoint_identity(state, out_dir / "checkpoints" / f"step-{step:08d}", saved)
        ended = phases[: state["phase_index"]]
        finished = tuple("grpo.steps" if p == "grpo" else "es.iterations" for p in ended)
    rundir.check_resume(identity, recorded, out_dir, finished)
    return found, recorded["run_id"]


def train(
    cfg: TrainConfig,
    *,
    resume: bool = False,
    overwrite: bool = False,
    model: torch.nn.Module | None = None,
    tokenizer: Any = None,
    task: Task | None = None,
    callbacks: list[Any] | None = None,
) -> dict[str, Any]:
    """Run the configured post-training; returns base and final test metrics.

    `model` and `tokenizer` (loaded objects, trained in place) replace loading cfg.model; without
    cfg.model the run's identity fingerprints the model's weights instead of its files. A tokenizer
    alone replaces the one in cfg.model's directory. `task` replaces make_task(cfg) (rows and reward
    functions given in code: fastes.ESTrainer). `callbacks` get the run's hooks (fastes/callbacks.py),
    after TensorBoard's when cfg.report_to asks for it.

    A new run needs a new or empty out_dir; `overwrite` lets it replace a previous run there. `resume`
    continues the run in out_dir from its newest checkpoint, exactly, with that run's own settings (only
    es.iterations / grpo.steps may be raised). Everything that can be checked is checked before any work.
    Under torchrun the processes run one job (fastes.distributed): ES shares the population, GRPO the
    prompts of each batch, rank 0 alone reads and writes the run directory, and the others get what it
    read (the checkpoint to resume from).
    """
    device, joined = distributed.setup(cfg.device, cfg.collective_timeout)  # ES and GRPO alike
    try:
        result = _train(
            cfg,
            resume=resume,
            overwrite=overwrite,
            device=device,
            given=(model, tokenizer),
            task=task,
            callbacks=callbacks,
        )
    except CollectiveError:
        raise  # the group is broken: leaving it would wait for the lost peer (the CLI exits at once)
    except BaseException:
        distributed.teardown(joined)
        raise
    distributed.teardown(joined)
    return result


def make_task(cfg: TrainConfig, strict_alphabet: bool = True) -> Task:
    """The configured task; with `reward`, a JSONL file of prompts scored by the user's function; with
    `dataset`, a data file scored by one or more weighted reward functions.

    A built-in task draws at least `eval_size` test problems. Its test problems are drawn after the
    train ones, so the first 200 (the default) are the same whatever the count. `cfg.prompt_style` must
    be resolved (fastes.defaults); JSONL prompts are held to the character model's alphabet only when
    `strict_alphabet` (the model has the character tokenizer).
    """
    if cfg.dataset:
        return dataset_task(cfg)
    if cfg.task == "dataset":
        raise ConfigError(
            "task: 'dataset' takes its rows from `dataset` (a data file) or from code (fastes.ESTrainer); "
            "set dataset = 'data.jsonl'"
        )
    if cfg.reward:
        return get_task(cfg.task, seed=cfg.task_seed, reward=cfg.reward, timeout=cfg.reward_timeout)
    kind = cfg.task.partition(":")[0]
    try:
        if kind in available_tasks():
            return get_task(
                cfg.task,
                seed=cfg.task_seed,
                style=cfg.prompt_style,
                instruction=cfg.instruction,
                n_test=max(DEFAULT_TEST_PROBLEMS, cfg.eval_size),
            )
        if kind == "jsonl":
            return get_task(cfg.task, seed=cfg.task_seed, strict_alphabet=strict_alphabet)
        return get_task(cfg.task, seed=cfg.task_seed)
    except ValueError as error:
        if isinstance(error, FastesError):
            raise
        raise ConfigError(f"task: {error}") from None


def check_world_size(cfg: TrainConfig, task: Task) -> None:
    """Before any work: the processes must be able to share the population and the prompts equally."""
    phases = PHASES[cfg.algorithm]
    if "es" in phases:
        distributed.require_divisible(
            cfg.es.population, "es.population", "each process evaluates an equal share of the members"
        )
    if "grpo" in phases:
        prompts = min(cfg.batch_size, len(task.split("train")))
        distributed.require_divisible(
            prompts, "GRPO prompts per step (batch_size)", "each process samples an equal share of them"
        )


def _train(
    cfg: TrainConfig,
    *,
    resume: bool,
    overwrite: bool,
    device: str,
    given: tuple[torch.nn.Module | None, Any],
    task: Task | None,
    callbacks: list[Any] | None,
) -> dict[str, Any]:
    if resume and overwrite:
        raise rundir.RunDirError("--resume continues the run in out_dir, --overwrite deletes it: choose one")
    out_dir = Path(cfg.out_dir)
    model, tokenizer = given
    if model is not None and tokenizer is None:
        raise ConfigError("model: a loaded model needs its tokenizer too (processing_class)")
    in_memory = model is not None and not cfg.model  # no files to fingerprint: its weights' hash instead
    if in_memory:
        model_dir = Path(f"<in-memory {type(model).__name__}>")
    else:
        model_dir = resolve_model(cfg.model)  # a .gguf file or a shipped model: its converted directory
    phases = PHASES[cfg.algorithm]
    lengths = [cfg.grpo.steps if p == "grpo" else cfg.es.iterations for p in phases]
    torch.manual_seed(cfg.seed)
    if model is None:
        model, loaded = load_model(model_dir, dtype=cfg.dtype, device=device)
        tokenizer = tokenizer or loaded

    # Settings left on auto are chosen now, once, by rank 0 for every process (free memory differs between
    # them), and saved with the run: a resume takes them from there. The choices are valid by
    # construction (tests/test_prompting.py), so the files that `cfg` names are not read again here.
    def choose() -> TrainConfig:
        saved_run = rundir.saved_identity(out_dir) if resume else None
        return defaults.resolve(cfg, model, tokenizer, saved_run["config"] if saved_run else None)

    cfg = distributed.from_writer(choose)
    task = task or make_task(cfg, strict_alphabet=is_character_tokenizer(tokenizer))
    check_task(task, cfg)
    check_world_size(cfg, task)
    hooks = Callbacks(callbacks)  # checked before any work
    if cfg.report_to == "tensorboard":
        hooks.callbacks.insert(0, TensorBoardCallback(out_dir / TENSORBOARD_DIR, every=cfg.logging_steps))
    identity = rundir.run_identity(
        cfg,
        model_dir,
        model_sha=rundir.weights_fingerprint(model) if in_memory else None,
        task_sha=task.fingerprint() if isinstance(task, DatasetTask) else None,
    )
    distributed.require_same(identity["run_id"], "settings or starting model")
    # Rank 0 reads the run directory; every rank gets what it found (or the error it raised).
    if resume:
        found, run_id = distributed.from_writer(lambda: _resume_point(out_dir, identity, phases))
    else:
        found, previous = None, distributed.from_writer(lambda: rundir.check_fresh(out_dir, overwrite))
    writer = distributed.is_writer()
    if "es" in phases:
        _check_evolvable(model, model_dir, cfg.es)
    # A tiny model's matmuls are too small to share: extra threads only add synchronisation.
    small = sum(p.numel() for p in model.parameters()) < 5_000_000
    torch.set_num_threads(cfg.threads or (1 if small else torch.get_num_threads()))
    run = Run(cfg, model, tokenizer, task, out_dir, identity, callbacks=hooks)
    test = task.split("test")[: cfg.eval_size]
    # GRPO's KL reference is the starting model, also when the run resumes with trained weights.
    reference = None
    if "grpo" in phases and cfg.grpo.beta > 0:
        reference = copy.deepcopy(model).eval().requires_grad_(False)

    # Where to start: from scratch, or just after the newest checkpoint.
    first_phase, first_step, saved = 0, 0, None
    if writer:
        if not resume:
            rundir.remove_run(out_dir, previous)
        rundir.clean(out_dir)
        rundir.start_run(out_dir, identity)  # on resume: records a raised length
    if found is not None:
        global_step, tensors, saved = found
        if writer:
            print(f"Resuming run {run_id} from step {global_step} ({out_dir})")
        model.load_state_dict({k[len("model.") :]: v for k, v in tensors.items() if k.startswith("model.")})
        first_phase, first_step = saved["phase_index"], saved["step"]
        run.metrics = list(saved["metrics"])
        if writer:
            rundir.restore_metrics(out_dir, run.metrics, global_step)
    else:
        if resume and writer:
            print(f"Resuming run {run_id} from step 0: no checkpoint was written yet, so it starts over")
        if writer:
            rundir.write_metrics(out_dir, [])
    global_step = sum(lengths[:first_phase]) + first_step
    if writer:
        hooks.fire("on_train_begin", global_step)
    if found is None and test:
        base = evaluate(run, test)
        if writer:  # the base's per-problem results, for the paired gain at the end
            write_atomic(out_dir / "base_test.json", json.dumps(base["correct"]))
        run.log({"global_step": 0, "phase": "base", "step": 0, **base["record"]})

    last_eval = None
    no_signal = NoSignal()
    quiet = not cfg.progress or not distributed.is_writer()
    bar = tqdm(total=sum(lengths), initial=global_step, disable=quiet, desc=cfg.algorithm)
    for phase_index in range(first_phase, len(phases)):
        phase = phases[phase_index]
        es = make_es(run) if phase == "es" else None
        optimizer = make_grpo_optimizer(run) if phase == "grpo" else None
        start_step = first_step if phase_index == first_phase else 0
        if saved is not None and phase_index == first_phase:
            # A checkpoint at a phase boundary carries no optimizer state: the next phase starts fresh.
            if es is not None and "es" in saved:
                es.load_state_dict(saved["es"])
            if optimizer is not None and "optimizer" in saved:
                _load_optimizer(optimizer, tensors, saved["optimizer"])
        for step in range(start_step, lengths[phase_index]):
            record = (
                es_iteration(run, es, step) if es is not None else grpo_step(run, optimizer, reference, step)
            )
            global_step += 1
            record = {"global_step": global_step, "phase": phase, "step": step + 1, **record}
            last = step + 1 == lengths[phase_index]
            if test and (cfg.eval_every and (step + 1) % cfg.eval_every == 0 or last):
                result = last_eval = evaluate(run, test)
                record.update(result["record"])
            run.log(record)
            if no_signal.update(record) and distributed.is_writer():
                tqdm.write(no_signal.warning(phase), file=sys.stderr)
            bar.set_postfix(progress_fields(record, no_signal.streak >= NO_SIGNAL_STEPS), refresh=False)
            bar.update(1)  # shows this step's postfix
            if phase == "grpo" and (step + 1) % GRPO_CHECKSUM_EVERY == 0:
                distributed.check_same_weights(model.parameters(), f"GRPO step {step + 1}")
            if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
                _checkpoint(run, global_step, phase_index, step + 1, es, optimizer)
        if phase_index + 1 < len(phases):  # a phase boundary is a checkpoint: the next phase starts fresh
            _checkpoint(run, global_step, phase_index + 1, 0, None, None)
        saved = None
    bar.close()
    if writer:
        final_dir = rundir.replace_dir(out_dir, "final", lambda path: save_model(model, tokenizer, path))
        hooks.fire("on_save", global_step, final_dir)
        hooks.fire("on_train_end", global_step)
    final = last_eval or (evaluate(run, test) if test else None)
    base_file = out_dir / "base_test.json"  # absent in run directories of older fastes versions
    base_correct = json.loads(base_file.read_text()) if base_file.is_file() else None
    gain, gain_se = math.nan, math.nan
    if base_correct and final:
        gain, gain_se = paired_gain(base_correct, final["correct"])
    base = run.metrics[0] if test else {}  # without held-out rows (a dataset without eval_dataset): none
    final = final or {}
    summary = {
        "base_test_accuracy": base.get("test_accuracy"),
        "final_test_accuracy": final.get("accuracy"),
        "test_gain": gain,
        "test_gain_se": gain_se,
        "test_problems": len(test),
        # What the gain is made of: answers in the verifiable format, and answers right when read leniently
        "base_test_format": base.get("test_format"),
        "final_test_format": final.get("format"),
        "base_test_lenient_accuracy": base.get("test_lenient_accuracy"),
        "final_test_lenient_accuracy": final.get("lenient_accuracy"),
        "steps": global_step,
        "out_dir": str(out_dir),
        "model_dir": str(out_dir / "final"),
    }
    if writer:
        write_atomic(out_dir / "summary.json", json.dumps(summary, indent=2))
    return summary
