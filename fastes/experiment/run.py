"""The whole experiment: check the settings, train the arms, measure, find, write metrics, plots, report."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from ..config import MAX_SEED, ConfigError
from ..models import num_params, tiny_model_path
from ..tasks import get_task
from .arms import Context, population_sweep, train_arms, training_curves
from .budget import ARMS, PRESETS, BudgetPlan, Preset, plan_budget, sweep_iterations
from .evaluate import evaluate_models, gain_retained_curves
from .findings import findings
from .plots import write_plots
from .report import json_text, write_report


def _resolve(
    preset: str | Preset, model: str | Path | None, seed: int | None = None
) -> tuple[Preset, BudgetPlan]:
    """The preset (with `seed` when given) and its budget plan; every setting that can fail fails here,
    before any training."""
    if isinstance(preset, str):
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
        preset = PRESETS[preset]
    if seed is not None:
        if not 0 <= seed < MAX_SEED:
            raise ConfigError(f"seed: must be in [0, 2^32), got {seed}")
        preset = replace(preset, seed=seed)
    plan = plan_budget(
        preset.es_iterations, preset.population, preset.es_batch, preset.grpo_batch, preset.num_generations
    )
    for population in preset.sweep_populations:
        sweep_iterations(preset.sweep_budget, population, preset.sweep_batch)
    if model is not None and not Path(model).is_dir():
        raise ConfigError(f"model: model directory {str(model)!r} does not exist")
    return preset, plan


def _check_out(out: Path, overwrite: bool) -> None:
    """Refuse to replace what is in `out` without --overwrite; with it, say what is replaced."""
    present = sorted(p.name + ("/" if p.is_dir() else "") for p in out.iterdir()) if out.is_dir() else []
    if not present:
        return
    shown = ", ".join(present[:6]) + (", ..." if len(present) > 6 else "")
    if not overwrite:
        raise ConfigError(
            f"--out: {str(out)!r} is not empty ({shown}); the experiment would delete and replace the "
            "runs there. Choose another --out, or pass --overwrite"
        )
    print(
        f"fastes: --overwrite: replacing the experiment in {out} ({shown}): its runs/ and sweep/ "
        "folders are deleted and run again (a pretrained models/small is reused)"
    )


def _stage(ctx: Context, name: str, work: Any, *args: Any) -> Any:
    """work(*args), timed as stage `name`."""
    start = time.perf_counter()
    result = work(*args)
    ctx.timed(name, start)
    return result


def _budget_summary(plan: BudgetPlan) -> dict[str, Any]:
    return {
        "samples_per_arm": plan.total_samples,
        "es_samples_per_iteration": plan.es_samples_per_iteration,
        "grpo_samples_per_step": plan.grpo_samples_per_step,
        "arms": {
            arm: dict(zip(("grpo_steps", "es_iterations"), lengths))
            for arm, lengths in plan.arm_lengths().items()
        },
    }


def _pretraining_recipe(model_dir: Path) -> dict[str, float]:
    """The data options a built-in model was pretrained with (its pretrain.json); {} for other models."""
    info = model_dir / "pretrain.json"
    if not info.is_file():
        return {}
    saved = json.loads(info.read_text())
    return {key: saved[key] for key in ("style_mix", "distractors") if key in saved}


def run_experiment(
    preset: str | Preset = "tiny",
    out_dir: str | Path = "runs/experiment",
    model: str | Path | None = None,
    progress: bool = True,
    overwrite: bool = False,
    seed: int | None = None,
) -> dict[str, Any]:
    """Train the three arms, measure the four models, write metrics.json, the plots and report.md.

    `preset` is a name in PRESETS or a Preset; `model` a local HF model directory (default: the built-in
    tiny model); `seed` replaces the preset's training seed (the test problems stay the same). Returns
    the metrics (also in out_dir/metrics.json). An out_dir that already holds
    anything is refused unless `overwrite` (the experiment replaces its runs/, sweep/ and models/).
    """
    preset, plan = _resolve(preset, model, seed)
    started = time.perf_counter()
    out = Path(out_dir)
    _check_out(out, overwrite)
    out.mkdir(parents=True, exist_ok=True)
    base_path = Path(model) if model else tiny_model_path()
    device = preset.device if preset.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    ctx = Context(preset, out, base_path, device, get_task(preset.task, seed=0), plan, progress, {})
    params = num_params(ctx.load(base_path)[0])
    if params < 5_000_000:  # as train(): a tiny model's matmuls only lose from sharing threads
        torch.set_num_threads(1)

    arms = train_arms(ctx)
    model_dirs = {"base": str(base_path), **{arm: arms[arm]["model_dir"] for arm in ARMS}}
    models = _stage(ctx, "evaluate", evaluate_models, ctx, model_dirs)
    gain = _stage(ctx, "gain_retained", gain_retained_curves, ctx, str(base_path), arms["es"]["model_dir"])
    sweep = _stage(ctx, "population_sweep", population_sweep, ctx, model is not None)

    curves = training_curves(arms, plan)
    models["base"]["probe_entropy"] = curves["es"]["probe_entropy"][0][1]
    for arm in ARMS:
        models[arm]["probe_entropy"] = curves[arm]["probe_entropy"][-1][1]
    metrics: dict[str, Any] = {
        "preset": asdict(preset),
        "model": ctx.show(base_path),
        "custom_model": model is not None,
        "base_pretraining": _pretraining_recipe(base_path),
        "params": params,
        "device": device,
        "budget": _budget_summary(plan),
        "models": models,
        "training": curves,
        "gain_retained": gain,
        "population_sweep": sweep,
        "timings": ctx.timings,
    }
    metrics["findings"] = findings(metrics)
    metrics["plots"] = write_plots(metrics, out)
    ctx.timings["total"] = round(time.perf_counter() - started, 1)
    (out / "metrics.json").write_text(json_text(metrics))
    write_report(metrics, out)
    return metrics
