"""The report's figures: one PNG per measurement, written from metrics.json's numbers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .budget import ARMS, LABELS, MODELS
from .evaluate import MASK_KINDS
from .findings import paired_difference

PLOTS = {
    "pass_at_k": "pass_at_k.png",
    "entropy": "entropy.png",
    "js_diversity": "js_diversity.png",
    "accuracy": "accuracy_over_training.png",
    "gain_retained": "gain_retained.png",
    "heldout_accuracy": "heldout_accuracy.png",
    "heldout_perplexity": "heldout_perplexity.png",
    "heldout_kl": "heldout_kl.png",
    "sweep_accuracy": "population_sweep_accuracy.png",
    "sweep_reward": "population_sweep_reward.png",
}


def _xy(points: list[list[float]]) -> tuple[list[float], list[float]]:
    return [pt[0] for pt in points], [pt[1] for pt in points]


def _training_plots(metrics: dict[str, Any], out_dir: Path) -> None:
    """Entropy, JS diversity and test accuracy over training."""
    from fastes.analysis import plots

    curves = metrics["training"]
    plots.plot_metric_over_steps(
        {
            **{f"{LABELS[arm]} (own samples, probe)": _xy(curves[arm]["probe_entropy"]) for arm in ARMS},
            "GRPO (logged, training batches)": _xy(curves["grpo"]["logged_entropy"]),
        },
        out_dir / PLOTS["entropy"],
        metric="token entropy (nats)",
        title="Policy entropy during training",
        xlabel="training completions generated",
    )
    plots.plot_js_diversity(
        {
            "ES": _xy(curves["es"]["js_diversity"]),
            "GRPO->ES (ES phase)": _xy(curves["grpo_es"]["js_diversity"]),
        },
        out_dir / PLOTS["js_diversity"],
    )
    plots.plot_metric_over_steps(
        {LABELS[arm]: _xy(curves[arm]["test_accuracy"]) for arm in ARMS},
        out_dir / PLOTS["accuracy"],
        metric="greedy test accuracy",
        title="Test accuracy during training",
        xlabel="training completions generated",
    )


def _model_plots(metrics: dict[str, Any], out_dir: Path) -> None:
    """Pass@K and the held-out measurements of the four models, and ES's gain retained."""
    from fastes.analysis import plots

    models, p = metrics["models"], metrics["preset"]
    plots.plot_pass_at_k(
        {LABELS[n]: {int(k): v for k, v in models[n]["pass_at_k"].items()} for n in MODELS},
        out_dir / PLOTS["pass_at_k"],
        title=f"Pass@K on {p['passk_prompts']} test prompts ({p['passk_samples']} samples, T=1)",
    )
    es_gained = paired_difference(models["es"]["greedy_correct"], models["base"]["greedy_correct"]) > 0
    plots.plot_gain_retained(
        {
            MASK_KINDS[kind]: {float(f): g for f, g in values.items()}
            for kind, values in metrics["gain_retained"]["gain_retained"].items()
        },
        out_dir / PLOTS["gain_retained"],
        title="ES: gain retained by keeping part of the update"
        + ("" if es_gained else "\n(ES's own gain is within noise, so these ratios are noise)"),
    )
    labelled = {LABELS[n]: models[n] for n in MODELS}
    for key, values, ylabel, title in [
        (
            "heldout_accuracy",
            lambda m: m["heldout_accuracy"],
            "held-out accuracy",
            "Held-out tasks (never trained on): greedy accuracy",
        ),
        (
            "heldout_perplexity",
            lambda m: {"held-out corpus": m["heldout_perplexity"]},
            "perplexity",
            "Perplexity of the held-out corpus",
        ),
        (
            "heldout_kl",
            lambda m: {"held-out prompts": m["heldout_kl_to_base"]},
            "token KL to the base (nats)",
            "Token-level KL(model || base) on held-out prompts",
        ),
    ]:
        bars = {label: values(m) for label, m in labelled.items()}
        plots.plot_model_bars(bars, out_dir / PLOTS[key], ylabel=ylabel, title=title)


def _sweep_plots(metrics: dict[str, Any], out_dir: Path) -> None:
    """Final test accuracy and reward against the population size, per model size."""
    from fastes.analysis import plots

    sweep = metrics["population_sweep"]
    for key, metric, ylabel in [
        ("sweep_accuracy", "test_accuracy", "final greedy test accuracy"),
        ("sweep_reward", "test_reward", "final test reward"),
    ]:
        plots.plot_population_sweep(
            {
                f"{size} ({info['params']:,} params)": {int(n): r[metric] for n, r in info["runs"].items()}
                for size, info in sweep.items()
            },
            out_dir / PLOTS[key],
            ylabel=ylabel,
            title=f"ES population size at {metrics['preset']['sweep_budget']:,} training completions",
        )


def write_plots(metrics: dict[str, Any], out_dir: Path) -> dict[str, str]:
    """Every figure of the report, as PNGs in out_dir; returns {plot: file name}."""
    _training_plots(metrics, out_dir)
    _model_plots(metrics, out_dir)
    _sweep_plots(metrics, out_dir)
    return dict(PLOTS)
