"""Evaluation of the trained models: accuracy, Pass@K, forgetting, drift, and the gain that sparse
updates keep. Every measurement goes through fastes.run.evaluation (the one evaluation path), with the
experiment's run settings; each finished evaluation is recorded, and not redone on a continued start."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from fastes.analysis.sparsity import gain_retained, topk_mask_state
from fastes.run.evaluation import Evaluator, general_text_corpus, heldout_tasks, pass_at_k
from fastes.tasks import Example, Task

from .arms import Context

MASK_KINDS = {"top": "top-k (global)", "random": "random (same density)", "bottom": "bottom-k"}


def _evaluate_one(
    ctx: Context, evaluator: Evaluator, base: torch.nn.Module, heldout: dict[str, tuple[Task, list[Example]]]
) -> dict[str, Any]:
    """Every measurement of one model; per-prompt results are kept for paired comparisons."""
    p = ctx.preset
    test = ctx.task.split("test")
    greedy = evaluator.greedy(ctx.task, test[: p.eval_size])
    counts = evaluator.correct_counts(
        ctx.task,
        test[: p.passk_prompts],
        samples=p.passk_samples,
        temperature=p.temperature,
        seed=p.seed + 11,
    )
    heldout_correct = {
        name: evaluator.greedy(task, examples).correct for name, (task, examples) in heldout.items()
    }
    examples = [ex for _, group in heldout.values() for ex in group]
    if p.perplexity_corpus == "text":
        corpus = general_text_corpus()
    else:  # the held-out tasks' solutions given their prompts: the character model's own kind of text
        corpus = [(ex.prompt, ex.solution) for ex in examples]
    rates = greedy.metrics()
    return {
        "greedy_accuracy": rates["accuracy"],
        "format_rate": rates["format"],
        "lenient_accuracy": rates.get("lenient_accuracy"),
        "pass_at_k": pass_at_k(counts, p.passk_samples),
        "heldout_accuracy": {task: float(np.mean(c)) for task, c in heldout_correct.items()},
        "heldout_perplexity": evaluator.perplexity(corpus),
        "heldout_kl_to_base": evaluator.kl_to(base, examples, samples=p.kl_samples, seed=p.seed + 13),
        "relative_update_norm": relative_update_norm(base, evaluator.model),
        # per prompt, for paired comparisons between models (same prompts, same order)
        "greedy_correct": greedy.correct,
        "correct_counts": counts,
        "heldout_correct": heldout_correct,
    }


def evaluate_models(ctx: Context, model_dirs: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Greedy accuracy, format rate, lenient accuracy, Pass@K, held-out accuracy, perplexity and KL to the
    base, per model. Held-out tasks are asked in the experiment's prompt style (the instruct form for an
    instruct model)."""
    p = ctx.preset
    heldout = {
        name: (task, task.split("test")[: p.heldout_size])
        for name, task in heldout_tasks(ctx.cfg, p.heldout_tasks, p.heldout_size).items()
    }
    base: torch.nn.Module | None = None  # loaded when some model is still to be measured
    results: dict[str, dict[str, Any]] = {}
    with ctx.bar(len(model_dirs), "evaluate models") as bar:
        for name, model_dir in model_dirs.items():
            results[name] = ctx.done.get(f"evaluate:{name}")
            if results[name] is None:
                if base is None:
                    base = ctx.load(model_dirs["base"])[0]
                measured = _evaluate_one(ctx, ctx.evaluator(model_dir), base, heldout)
                results[name] = ctx.done.put(
                    f"evaluate:{name}", {"model_dir": ctx.show(model_dir), **measured}
                )
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


def _load_masked(model: torch.nn.Module, masked: dict[str, torch.Tensor]) -> None:
    """Write the masked tensors theta_0 + M * delta into `model` (the others stay as they are)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in masked:
                param.copy_(masked[name])


def gain_retained_curves(ctx: Context, base_dir: str, trained_dir: str) -> dict[str, Any]:
    """Greedy accuracy of theta_0 + M * delta for the kept fractions and mask kinds, and the gain retained.

    Masks are over the tensors the training changed (the update's support by tensor: for ES the evolved
    weights), counted globally; theta_0 is the base and theta_1 the trained model. Each masked model's
    accuracy is recorded as it is measured.
    """
    p = ctx.preset
    examples = ctx.task.split("test")[: p.eval_size]
    base, trained = ctx.evaluator(base_dir), ctx.evaluator(trained_dir)

    def accuracy_of(evaluator: Evaluator) -> float:
        return evaluator.greedy(ctx.task, examples).metrics()["accuracy"]

    before = {n: t.detach().clone() for n, t in base.model.named_parameters()}
    after = {n: t.detach().clone() for n, t in trained.model.named_parameters()}
    changed = [n for n in after if not torch.equal(after[n], before[n])]
    acc_base = ctx.done.once("sparsity:base", accuracy_of, base)
    acc_trained = ctx.done.once("sparsity:trained", accuracy_of, trained)
    accuracy: dict[str, dict[str, float]] = {kind: {} for kind in MASK_KINDS}
    fractions = sorted(p.keep_fractions)

    def masked_accuracy(kind: str, fraction: float) -> float:
        kept, updated = ({n: state[n] for n in changed} for state in (before, after))
        _load_masked(trained.model, topk_mask_state(kept, updated, fraction, kind=kind, seed=p.seed))
        return accuracy_of(trained)

    with ctx.bar(len(MASK_KINDS) * len(fractions), "gain retained") as bar:
        for kind, fraction in [(kind, f) for kind in MASK_KINDS for f in fractions]:
            if fraction == 1.0 or not changed:  # keeps everything: the trained model itself
                accuracy[kind][str(fraction)] = acc_trained
            else:
                key = f"sparsity:{kind}:{fraction}"
                accuracy[kind][str(fraction)] = ctx.done.once(key, masked_accuracy, kind, fraction)
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
