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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from . import ES, linear_weights, rundir
from .analysis.diversity import js_diversity
from .analysis.entropy import token_entropy
from .batched import population_batched
from .checkpoint import latest_checkpoint, save_checkpoint, write_atomic
from .config import ConfigError, TrainConfig
from .generation import generate
from .models import ModelError, format_prompt, load_model, save_model, tiny_model_path
from .tasks import Example, Task, get_task

PHASES = {"es": ("es",), "grpo": ("grpo",), "grpo_es": ("grpo", "es")}


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

    def log(self, record: dict) -> None:
        self.metrics.append(record)
        rundir.append_metrics(self.out_dir, record)

    def prompts(self, examples: list[Example]) -> list[str]:
        return [format_prompt(self.tokenizer, ex.prompt) for ex in examples]


def batch_for(run: Run, phase: str, step: int) -> list[Example]:
    """The training prompts of (phase, step): a pure function of the seed, so resume sees the same ones."""
    rng = random.Random(f"{run.cfg.seed}:{phase}:{step}")
    train = run.task.split("train")
    return rng.sample(train, min(run.cfg.batch_size, len(train)))


@torch.no_grad()
def evaluate(run: Run, examples: list[Example], batch_size: int = 256) -> dict[str, Any]:
    """Greedy accuracy and format rate of the current weights on `examples`, and which ones it solves."""
    correct, fmt = [], 0.0
    for start in range(0, len(examples), batch_size):
        chunk = examples[start : start + batch_size]
        gen = generate(run.model, run.tokenizer, run.prompts(chunk), max_new_tokens=run.cfg.max_new_tokens)
        scores = [run.task.score(ex, text) for ex, text in zip(chunk, gen.texts)]
        correct += [s.answer for s in scores]
        fmt += sum(s.format for s in scores)
    return {"accuracy": sum(correct) / len(examples), "format": fmt / len(examples), "correct": correct}


def paired_gain(before: list[float], after: list[float]) -> tuple[float, float]:
    """Mean per-problem gain of `after` over `before` on the same problems, and its standard error.

    Pairing removes the problem-to-problem variance that two independent accuracies would carry, so a
    gain of 3 standard errors is a real improvement, not a lucky test set.
    """
    diff = torch.tensor(after, dtype=torch.float64) - torch.tensor(before, dtype=torch.float64)
    se = float(diff.std(correction=1) / math.sqrt(len(diff))) if len(diff) > 1 else math.inf
    return float(diff.mean()), se


# --- ES ---------------------------------------------------------------------------------------------


def evolved_weights(model: torch.nn.Module, evolve: str) -> list[tuple[str, torch.nn.Parameter]]:
    """The (name, tensor) pairs ES evolves: the kinds in `evolve` ("linear", "embeddings", "norms",
    joined with "+"). A tied output projection counts as an embedding, as in fastes.linear_weights."""
    kinds = set(evolve.split("+"))
    linear = {id(p) for _, p in linear_weights(model)}
    chosen = linear_weights(model, include_embeddings="embeddings" in kinds, include_norms="norms" in kinds)
    return [(n, p) for n, p in chosen if "linear" in kinds or id(p) not in linear]


def make_es(run: Run) -> ES:
    c = run.cfg.es
    return ES(
        evolved_weights(run.model, c.evolve),
        sigma=c.sigma,
        lr=c.lr,
        population=c.population,
        antithetic=c.antithetic,
        shaping=c.shaping,
        seed=run.cfg.seed,
        weight_decay=c.weight_decay,
        stochastic_rounding=c.stochastic_rounding,
        backend=run.cfg.backend,
        noise_type=c.noise_type,
        rank=c.rank,
        timeout=run.cfg.collective_timeout,
    )


def es_iteration(run: Run, es: ES, step: int) -> dict[str, float]:
    """Score every member on one batch of prompts (greedy), then take the ES step.

    eval_mode "member" generates member by member under each member's perturbation; "materialised" and
    "virtual" generate for the whole population in one call (fastes.batched), rows grouped by member.
    """
    examples = batch_for(run, "es", step)
    prompts = run.prompts(examples)
    max_new = run.cfg.max_new_tokens
    start = time.perf_counter()
    if run.cfg.es.eval_mode != "member":
        with population_batched(es, run.model, mode=run.cfg.es.eval_mode) as members:
            gen = generate(run.model, run.tokenizer, prompts * len(members), max_new_tokens=max_new)
        texts = [gen.texts[i * len(prompts) : (i + 1) * len(prompts)] for i in range(len(members))]
        tokens = gen.num_tokens
    else:
        texts, tokens = [], 0
        for member in es.members():
            with member:
                gen = generate(run.model, run.tokenizer, prompts, max_new_tokens=max_new)
            texts.append(gen.texts)
            tokens += gen.num_tokens
    scores = [[run.task.score(ex, t) for ex, t in zip(examples, member_texts)] for member_texts in texts]
    rewards = es.step(
        torch.tensor([[s.reward(run.cfg.format_weight) for s in row] for row in scores], dtype=torch.float64)
    )
    seconds = time.perf_counter() - start
    per_member = rewards.mean(dim=1)
    diversity = js_diversity(torch.tensor([[s.answer for s in row] for row in scores]))
    return {
        "reward": float(per_member.mean()),
        "reward_std": float(per_member.std(correction=0)),
        "reward_max": float(per_member.max()),
        "js_diversity": float(diversity.normalized),
        "members_agree": float(diversity.agreement),
        "seconds": seconds,
        "tokens_per_second": tokens / seconds,
    }


# --- GRPO -------------------------------------------------------------------------------------------


def completion_logprobs(
    model, input_ids, attention_mask, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probabilities of input_ids[:, 1:] and the temperature-scaled logits predicting them."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float() / temperature
    logp = torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return logp, logits


def grpo_step(run: Run, optimizer: torch.optim.Optimizer, reference, step: int) -> dict[str, float]:
    """Sample G completions per prompt, normalise rewards per group, one clipped-surrogate update."""
    g = run.cfg.grpo
    examples = batch_for(run, "grpo", step)
    start = time.perf_counter()
    run.model.eval()
    gen = generate(
        run.model,
        run.tokenizer,
        run.prompts(examples),
        max_new_tokens=run.cfg.max_new_tokens,
        temperature=g.temperature,
        top_p=g.top_p,
        seed=run.cfg.seed * 1_000_003 + step,
        num_return_sequences=g.num_generations,
    )
    repeated = [ex for ex in examples for _ in range(g.num_generations)]
    rewards = torch.tensor(
        [run.task.score(ex, t).reward(run.cfg.format_weight) for ex, t in zip(repeated, gen.texts)]
    ).view(len(examples), g.num_generations)
    group_std = rewards.std(dim=1, keepdim=True)  # Bessel-corrected, as TRL
    advantages = ((rewards - rewards.mean(dim=1, keepdim=True)) / (group_std + 1e-4)).view(-1)

    # Right-padded prompt + completion rows; the mask keeps completion tokens (EOS included).
    rows = [p + c for p, c in zip(gen.prompt_ids, gen.completion_ids)]
    width = max(map(len, rows))
    pad = run.tokenizer.pad_token_id
    input_ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows], device=run.model.device)
    attention = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], device=run.model.device)
    completion = torch.zeros_like(input_ids, dtype=torch.bool)
    for i, (p, c) in enumerate(zip(gen.prompt_ids, gen.completion_ids)):
        completion[i, len(p) : len(p) + len(c)] = True
    mask = completion[:, 1:].float()

    run.model.train()
    logp, logits = completion_logprobs(run.model, input_ids, attention, g.temperature)
    ratio = torch.exp(logp - logp.detach())  # one optimisation step per batch: old policy = current
    adv = advantages[:, None].to(logp.device)
    clipped = torch.clamp(ratio, 1 - g.epsilon, 1 + g.epsilon)
    per_token = -torch.min(ratio * adv, clipped * adv)
    kl = torch.zeros(())
    if reference is not None:
        with torch.no_grad():
            ref_logp, _ = completion_logprobs(reference, input_ids, attention, g.temperature)
        delta = ref_logp - logp
        k3 = torch.exp(delta) - delta - 1  # unbiased, always >= 0
        per_token = per_token + g.beta * k3
        kl = (k3 * mask).sum() / mask.sum()
    if g.loss_type == "grpo":
        loss = ((per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)).mean()
    elif g.loss_type == "dapo":
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1)
    else:  # dr_grpo: a constant normaliser, no length bias
        loss = (per_token * mask).sum() / (mask.shape[0] * run.cfg.max_new_tokens)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), g.max_grad_norm)
    optimizer.step()
    run.model.eval()

    seconds = time.perf_counter() - start
    return {
        "reward": float(rewards.mean()),
        "reward_std": float(rewards.std(dim=1).mean()),
        "frac_reward_zero_std": float((group_std.squeeze(1) == 0).float().mean()),
        "entropy": float(token_entropy(logits.detach(), completion[:, 1:])),
        "kl": float(kl.detach()),
        "loss": float(loss.detach()),
        "grad_norm": float(grad_norm),
        "clip_ratio": float(
            (((ratio < 1 - g.epsilon) | (ratio > 1 + g.epsilon)).float() * mask).sum() / mask.sum()
        ),
        "completion_length": sum(gen.lengths) / len(gen.lengths),
        "seconds": seconds,
        "tokens_per_second": gen.num_tokens / seconds,
    }


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
    save_checkpoint(run.out_dir, global_step, tensors, state)


def _check_task(task: Task, cfg: TrainConfig) -> None:
    for split in ("train", "test"):
        if not task.split(split):
            raise ConfigError(f"task: {cfg.task!r} has no {split} problems; add some, or choose another task")


def _check_evolvable(model: torch.nn.Module, model_dir: Path) -> None:
    try:
        linear_weights(model)
    except ValueError as error:
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


def train(cfg: TrainConfig, *, resume: bool = False, overwrite: bool = False) -> dict[str, Any]:
    """Run the configured post-training; returns base and final test metrics.

    A new run needs a new or empty out_dir; `overwrite` lets it replace a previous run there. `resume`
    continues the run in out_dir from its newest checkpoint, exactly, with that run's own settings (only
    es.iterations / grpo.steps may be raised). Everything that can be checked is checked before any work.
    """
    if resume and overwrite:
        raise rundir.RunDirError("--resume continues the run in out_dir, --overwrite deletes it: choose one")
    out_dir = Path(cfg.out_dir)
    model_dir = Path(cfg.model) if cfg.model else tiny_model_path()
    phases = PHASES[cfg.algorithm]
    lengths = [cfg.grpo.steps if p == "grpo" else cfg.es.iterations for p in phases]
    task = get_task(cfg.task, seed=cfg.task_seed)
    _check_task(task, cfg)
    identity = rundir.run_identity(cfg, model_dir)
    if resume:
        found, run_id = _resume_point(out_dir, identity, phases)
    else:
        found, previous = None, rundir.check_fresh(out_dir, overwrite)
    torch.manual_seed(cfg.seed)
    model, tokenizer = load_model(model_dir, dtype=cfg.dtype, device=cfg.device)
    if "es" in phases:
        _check_evolvable(model, model_dir)
    # A tiny model's matmuls are too small to share: extra threads only add synchronisation.
    small = sum(p.numel() for p in model.parameters()) < 5_000_000
    torch.set_num_threads(cfg.threads or (1 if small else torch.get_num_threads()))
    run = Run(cfg, model, tokenizer, task, out_dir, identity)
    test = task.split("test")[: cfg.eval_size]
    # GRPO's KL reference is the starting model, also when the run resumes with trained weights.
    reference = None
    if "grpo" in phases and cfg.grpo.beta > 0:
        reference = copy.deepcopy(model).eval().requires_grad_(False)

    # Where to start: from scratch, or just after the newest checkpoint.
    first_phase, first_step, saved = 0, 0, None
    if not resume:
        rundir.remove_run(out_dir, previous)
    rundir.clean(out_dir)
    rundir.start_run(out_dir, identity)  # on resume: records a raised length
    if found is not None:
        global_step, tensors, saved = found
        print(f"Resuming run {run_id} from step {global_step} ({out_dir})")
        model.load_state_dict({k[len("model.") :]: v for k, v in tensors.items() if k.startswith("model.")})
        first_phase, first_step = saved["phase_index"], saved["step"]
        run.metrics = list(saved["metrics"])
        rundir.restore_metrics(out_dir, run.metrics, global_step)
    else:
        if resume:
            print(f"Resuming run {run_id} from step 0: no checkpoint was written yet, so it starts over")
        rundir.write_metrics(out_dir, [])
        base = evaluate(run, test)
        write_atomic(out_dir / "base_test.json", json.dumps(base["correct"]))  # for the paired gain
        run.log(
            {
                "global_step": 0,
                "phase": "base",
                "step": 0,
                "test_accuracy": base["accuracy"],
                "test_format": base["format"],
            }
        )

    global_step = sum(lengths[:first_phase]) + first_step
    last_eval = None
    bar = tqdm(total=sum(lengths), initial=global_step, disable=not cfg.progress, desc=cfg.algorithm)
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
            if cfg.eval_every and (step + 1) % cfg.eval_every == 0 or step + 1 == lengths[phase_index]:
                result = last_eval = evaluate(run, test)
                record.update(test_accuracy=result["accuracy"], test_format=result["format"])
            run.log(record)
            bar.update(1)
            bar.set_postfix(
                phase=phase,
                reward=f"{record['reward']:.3f}",
                test=f"{record.get('test_accuracy', float('nan')):.3f}",
            )
            if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
                _checkpoint(run, global_step, phase_index, step + 1, es, optimizer)
        if phase_index + 1 < len(phases):  # a phase boundary is a checkpoint: the next phase starts fresh
            _checkpoint(run, global_step, phase_index + 1, 0, None, None)
        saved = None
    bar.close()
    rundir.replace_dir(out_dir, "final", lambda path: save_model(model, tokenizer, path))
    final = last_eval or evaluate(run, test)
    base_file = out_dir / "base_test.json"  # absent in run directories of older fastes versions
    base_correct = json.loads(base_file.read_text()) if base_file.is_file() else None
    gain, gain_se = paired_gain(base_correct, final["correct"]) if base_correct else (math.nan, math.nan)
    summary = {
        "base_test_accuracy": run.metrics[0]["test_accuracy"],
        "final_test_accuracy": final["accuracy"],
        "test_gain": gain,
        "test_gain_se": gain_se,
        "test_problems": len(test),
        "steps": global_step,
        "out_dir": str(out_dir),
        "model_dir": str(out_dir / "final"),
    }
    write_atomic(out_dir / "summary.json", json.dumps(summary, indent=2))
    return summary
