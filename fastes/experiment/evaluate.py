"""Evaluation of the trained models: accuracy, Pass@K, forgetting, drift, and the gain that sparse
updates keep."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..analysis.passk import pass_at_k_curve
from ..analysis.sparsity import gain_retained, topk_mask_state
from ..models import format_prompt
from ..tasks import HELD_OUT_TASKS, Example, get_task
from .arms import Context
from .measure import corpus_perplexity, correct_counts, greedy_correct, sampled_kl

MASK_KINDS = {"top": "top-k (global)", "random": "random (same density)", "bottom": "bottom-k"}


def _evaluate_one(
    ctx: Context,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    base: PreTrainedModel,
    heldout: dict[str, list[Example]],
) -> dict[str, Any]:
    """Every measurement of one model; per-prompt results are kept for paired comparisons."""
    p = ctx.preset
    test = ctx.task.split("test")
    kwargs = {"max_new_tokens": p.max_new_tokens, "rows_per_call": p.generation_batch}
    correct = greedy_correct(model, tokenizer, ctx.task, test[: p.eval_size], **kwargs)
    counts = correct_counts(
        model,
        tokenizer,
        ctx.task,
        test[: p.passk_prompts],
        samples=p.passk_samples,
        seed=p.seed + 11,
        **kwargs,
    )
    heldout_correct = {
        name: greedy_correct(model, tokenizer, get_task(name, seed=0), examples, **kwargs)
        for name, examples in heldout.items()
    }
    examples = [ex for group in heldout.values() for ex in group]
    prompts = [format_prompt(tokenizer, ex.prompt) for ex in examples]
    kl = sampled_kl(
        model,
        base,
        tokenizer,
        prompts,
        samples=p.kl_samples,
        max_new_tokens=p.max_new_tokens,
        seed=p.seed + 13,
    )
    return {
        "greedy_accuracy": float(np.mean(correct)),
        "pass_at_k": {str(k): v for k, v in pass_at_k_curve(counts, p.passk_samples).items()},
        "heldout_accuracy": {task: float(np.mean(c)) for task, c in heldout_correct.items()},
        "heldout_perplexity": corpus_perplexity(
            model, tokenizer, [(ex.prompt, ex.solution) for ex in examples]
        ),
        "heldout_kl_to_base": kl,
        "relative_update_norm": relative_update_norm(base, model),
        # per prompt, for paired comparisons between models (same prompts, same order)
        "greedy_correct": correct,
        "correct_counts": counts,
        "heldout_correct": heldout_correct,
    }


def evaluate_models(ctx: Context, model_dirs: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Greedy accuracy, Pass@K, held-out accuracy, held-out perplexity and KL to the base, per model."""
    heldout = {
        name: get_task(name, seed=0).split("test")[: ctx.preset.heldout_size] for name in HELD_OUT_TASKS
    }
    base, _ = ctx.load(model_dirs["base"])
    results: dict[str, dict[str, Any]] = {}
    with ctx.bar(len(model_dirs), "evaluate models") as bar:
        for name, model_dir in model_dirs.items():
            model, tokenizer = ctx.load(model_dir)
            results[name] = {
                "model_dir": ctx.show(model_dir),
                **_evaluate_one(ctx, model, tokenizer, base, heldout),
            }
            bar.update(1)
    return results


def relative_update_norm(base: torch.nn.Module, model: torch.nn.Module) -> float:
    """||theta_model - theta_base|| / ||theta_base|| over all parameters (the total drift)."""
    before = dict(base.named_parameters())
    delta = sum(
        float((p.detach() - before[n].detach()).double().pow(2).sum()) for n, p in model.named_parameters()
    )
    norm = sum(float(p.detach().double().pow(2).sum()) for p in before.values())
    return math.sqrt(delta / norm)


def _load_masked(model: PreTrainedModel, masked: dict[str, torch.Tensor]) -> None:
    """Write the masked tensors theta_0 + M * delta into `model` (the others stay as they are)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in masked:
                param.copy_(masked[name])


def gain_retained_curves(ctx: Context, base_dir: str, trained_dir: str) -> dict[str, Any]:
    """Greedy accuracy of theta_0 + M * delta for the kept fractions and mask kinds, and the gain retained.

    Masks are over the tensors the training changed (the update's support by tensor: for ES the evolved
    weights), counted globally; theta_0 is the base and theta_1 the trained model.
    """
    p = ctx.preset
    examples = ctx.task.split("test")[: p.eval_size]
    base, _ = ctx.load(base_dir)
    model, tokenizer = ctx.load(trained_dir)

    def accuracy_of(current: PreTrainedModel) -> float:
        kwargs = {"max_new_tokens": p.max_new_tokens, "rows_per_call": p.generation_batch}
        return float(np.mean(greedy_correct(current, tokenizer, ctx.task, examples, **kwargs)))

    before = {n: t.detach().clone() for n, t in base.named_parameters()}
    after = {n: t.detach().clone() for n, t in model.named_parameters()}
    changed = [n for n in after if not torch.equal(after[n], before[n])]
    acc_base, acc_trained = accuracy_of(base), accuracy_of(model)
    accuracy: dict[str, dict[str, float]] = {kind: {} for kind in MASK_KINDS}
    fractions = sorted(p.keep_fractions)
    with ctx.bar(len(MASK_KINDS) * len(fractions), "gain retained") as bar:
        for kind, fraction in [(kind, f) for kind in MASK_KINDS for f in fractions]:
            if fraction == 1.0 or not changed:  # keeps everything: the trained model itself
                accuracy[kind][str(fraction)] = acc_trained
            else:
                kept, trained = ({n: state[n] for n in changed} for state in (before, after))
                _load_masked(model, topk_mask_state(kept, trained, fraction, kind=kind, seed=p.seed))
                accuracy[kind][str(fraction)] = accuracy_of(model)
            bar.update(1)
    gains = {
        kind: {f: float(gain_retained(acc, acc_base, acc_trained)) for f, acc in per_fraction.items()}
        for kind, per_fraction in accuracy.items()
    }
    return {
        "accuracy_base": acc_base,
        "accuracy_trained": acc_trained,
        "changed_elements": sum(after[n].numel() for n in changed),
        "accuracy": accuracy,
        "gain_retained": gains,
    }
