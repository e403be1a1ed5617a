"""The whole experiment: check the settings, run the stages (or a chosen subset), measure, find, write
metrics, plots and the report.

Every finished piece of work is recorded in progress.json (fastes/experiment/progress.py): the same
command run again after Ctrl-C or a kill continues where it stopped. Each stage starts with a line that
says how long the rest should take (budget.estimate_seconds, scaled by the speed measured so far).
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from fastes.errors import ConfigError
from fastes.models.loading import num_params, tiny_model_path
from fastes.models.sources import resolve_model
from fastes.run.auto_settings import SMALL_MODEL_PARAMS, torch_threads
from fastes.run.config import MAX_SEED, PROMPT_SETTINGS

from .arms import Context, make_context, population_sweep, train_arm, training_curves
from .budget import (
    ARMS,
    NEEDS,
    PRESETS,
    STAGES,
    BudgetPlan,
    Preset,
    estimate_seconds,
    plan_budget,
    sweep_iterations,
)
from .evaluate import evaluate_models, gain_retained_curves
from .findings import findings
from .plots import write_plots
from .progress import Progress
from .report import json_text, write_report
from .seeds import other_seeds


def _resolve(
    preset: str | Preset, model: str | Path | None, seed: int | None = None
) -> tuple[Preset, BudgetPlan, Path]:
    """The preset (with `seed` when given), its budget plan and the base model's directory; every setting
    that can fail fails here, before any training."""
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
    base = Path(model) if model else resolve_model(preset.model) if preset.model else tiny_model_path()
    return preset, plan, base


def _stages(stages: str | tuple[str, ...] | None) -> tuple[str, ...]:
    """The chosen stages in running order ("es,grpo,evaluate"; None: all)."""
    if stages is None:
        return STAGES
    names = [s.strip() for s in stages.split(",")] if isinstance(stages, str) else list(stages)
    unknown = [s for s in names if s not in STAGES]
    if unknown or not names:
        raise ConfigError(
            f"--stages: unknown stage {(unknown or [''])[0]!r}; choose from {', '.join(STAGES)} "
            "(comma-separated, e.g. es,grpo,evaluate)"
        )
    return tuple(s for s in STAGES if s in names)


def _identity(preset: Preset, base: Path) -> dict[str, Any]:
    """What makes two starts the same experiment: every setting and the starting model."""
    return {"preset": json.loads(json.dumps(asdict(preset))), "model": str(base.resolve())}


def _read_out(out: Path, identity: dict[str, Any], overwrite: bool) -> Progress:
    """The experiment's progress in `out`, read, nothing written: what an earlier start of this same
    experiment finished (continued), or nothing (an empty `out`, or `overwrite`). Anything else in `out`
    is refused."""
    present = sorted(p.name + ("/" if p.is_dir() else "") for p in out.iterdir()) if out.is_dir() else []
    progress = Progress(out, identity)
    if not present or overwrite:
        return progress
    saved = Progress.saved_identity(out)
    if saved is None:
        shown = ", ".join(present[:6]) + (", ..." if len(present) > 6 else "")
        raise ConfigError(
            f"--out: {str(out)!r} is not empty ({shown}) and holds no experiment to continue; choose "
            "another --out, or pass --overwrite to delete and replace the runs there"
        )
    if saved != identity:
        settings = set(saved["preset"]) | set(identity["preset"])
        changed = [k for k in sorted(settings) if saved["preset"].get(k) != identity["preset"].get(k)]
        changed += ["model"] if saved["model"] != identity["model"] else []
        raise ConfigError(
            f"--out: {str(out)!r} holds an experiment with other settings ({', '.join(changed)} differ); run "
            "the same command to continue it, choose another --out, or pass --overwrite"
        )
    progress.load()
    return progress


def _start(out: Path, progress: Progress, overwrite: bool) -> None:
    """Make `out` ready: with `overwrite`, delete what a previous experiment there left (saying so)."""
    present = out.is_dir() and any(out.iterdir())
    if overwrite and present:
        print(
            f"fastes: --overwrite: replacing the experiment in {out}: its runs/ and sweep/ folders, "
            "progress and results are deleted and run again (a pretrained models/small is reused)"
        )
        for name in ("runs", "sweep"):
            shutil.rmtree(out / name, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    progress.save()


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


class StageClock:
    """The line each stage starts with: which stage, and how long the rest of the run should take, from
    budget.estimate_seconds scaled by the seconds measured against the estimate so far."""

    def __init__(self, estimates: dict[str, float], chosen: tuple[str, ...], real_model: bool) -> None:
        self.estimates, self.chosen = estimates, chosen
        self.measured, self.predicted = 0.0, 0.0
        self.scale: float | None = 1.0 if real_model else None  # a toy model: no prior, wait for a stage

    def line(self, stage: str) -> str:
        index = self.chosen.index(stage)
        left = sum(self.estimates[s] for s in self.chosen[index:])
        if self.scale is None:
            remaining = "time left: known after the first stage"
        else:
            remaining = f"about {left * self.scale / 60:.0f} min left"
        return f"fastes experiment: stage {index + 1}/{len(self.chosen)}: {stage} ({remaining})"

    def finished(self, stage: str, seconds: float) -> None:
        self.measured += seconds
        self.predicted += self.estimates[stage]
        self.scale = self.measured / self.predicted if self.predicted > 0 else self.scale


def run_experiment(
    preset: str | Preset = "tiny",
    out_dir: str | Path = "runs/experiment",
    model: str | Path | None = None,
    progress: bool = True,
    overwrite: bool = False,
    seed: int | None = None,
    stages: str | tuple[str, ...] | None = None,
) -> dict[str, Any]:
    """Run the stages (default: all) and write metrics.json; with every stage done, also the findings,
    the plots and report.md.

    `preset` is a name in PRESETS or a Preset; `model` a local HF model directory (default: the preset's
    model, or the built-in tiny model); `seed` replaces the preset's training seed (the test problems
    stay the same); `stages` a subset of STAGES ("es,grpo,evaluate"). An out_dir that holds this same
    experiment is continued (nothing finished is redone); one that holds anything else is refused unless
    `overwrite`. Returns the metrics (also in out_dir/metrics.json).
    """
    preset, plan, base_path = _resolve(preset, model, seed)
    chosen = _stages(stages)
    out = Path(out_dir)
    done = _read_out(out, _identity(preset, base_path), overwrite)
    for stage, needed in NEEDS.items():
        if stage in chosen and needed not in chosen and done.get(f"arm:{needed}") is None:
            raise ConfigError(
                f"--stages: {stage} starts from the {needed} arm's model; add {needed} to --stages, or "
                "run it first"
            )
    _start(out, done, overwrite)
    device = preset.device if preset.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    ctx = make_context(preset, out, base_path, device, plan, progress, done)
    params = num_params(ctx.load(base_path)[0])
    threads = torch.get_num_threads()  # the caller's, given back at the end
    torch.set_num_threads(torch_threads(params))  # as train() sets them: one for a tiny model
    try:
        clock = StageClock(estimate_seconds(preset, plan), chosen, params >= SMALL_MODEL_PARAMS)
        for stage in chosen:
            if progress:
                tqdm.write(clock.line(stage), file=sys.stderr)
            start = time.perf_counter()
            _run_stage(ctx, stage, model is not None)
            seconds = time.perf_counter() - start
            done.add_seconds(stage, seconds)
            clock.finished(stage, seconds)
        return _write_results(ctx, model is not None, params)
    finally:
        torch.set_num_threads(threads)


def _trained(ctx: Context) -> dict[str, str]:
    """The models to evaluate: the base and every arm trained so far."""
    arms = {arm: ctx.done.get(f"arm:{arm}") for arm in ARMS}
    return {"base": str(ctx.base_path), **{arm: info["model_dir"] for arm, info in arms.items() if info}}


def _run_stage(ctx: Context, stage: str, custom_model: bool) -> None:
    """Run one stage, recording its result in the progress (a finished stage is read back at once)."""
    if stage in ARMS:
        ctx.done.once(f"arm:{stage}", train_arm, ctx, stage)
    elif stage == "evaluate":
        evaluate_models(ctx, _trained(ctx))
    elif stage == "sparsity":
        es_model = ctx.done.get("arm:es")["model_dir"]
        ctx.done.once("stage:sparsity", gain_retained_curves, ctx, str(ctx.base_path), es_model)
    else:
        ctx.done.once("stage:sweep", population_sweep, ctx, custom_model)


def _write_results(ctx: Context, custom_model: bool, params: int) -> dict[str, Any]:
    """metrics.json from everything finished so far; with every stage and model done, also the findings,
    the plots and report.md."""
    done, preset, out = ctx.done, ctx.preset, ctx.out_dir
    arms = {arm: done.get(f"arm:{arm}") for arm in ARMS if done.get(f"arm:{arm}")}
    models = {name: done.get(f"evaluate:{name}") for name in _trained(ctx) if done.get(f"evaluate:{name}")}
    curves = training_curves(arms, ctx.plan)
    if "base" in models and done.get("probe:base") is not None:
        models["base"]["probe_entropy"] = done.get("probe:base")
    for arm in arms:
        if arm in models:
            models[arm]["probe_entropy"] = curves[arm]["probe_entropy"][-1][1]
    metrics: dict[str, Any] = {
        "preset": asdict(preset),
        "model": ctx.show(ctx.base_path),
        "custom_model": custom_model,
        "base_pretraining": _pretraining_recipe(ctx.base_path),
        "params": params,
        "device": ctx.device,
        "prompt_settings": {key: getattr(ctx.cfg, key) for key in PROMPT_SETTINGS},
        "budget": _budget_summary(ctx.plan),
        "models": models,
        "training": curves,
        "gain_retained": done.get("stage:sparsity"),
        "population_sweep": done.get("stage:sweep"),
        "timings": {**done.seconds, "total": round(sum(done.seconds.values()), 1)},
    }
    missing = [s for s in STAGES if not _stage_done(done, s)]
    metrics["missing_stages"] = missing
    if not missing:
        metrics["findings"] = findings(metrics)
        metrics["plots"] = write_plots(metrics, out)
    (out / "metrics.json").write_text(json_text(metrics))
    if not missing:
        write_report(metrics, out, other_seeds(out, metrics))
    return metrics


def rewrite_report(out_dir: str | Path) -> Path:
    """report.md again from out_dir's metrics.json and the seed folders beside it (seeds.py); nothing is
    trained or measured. For a report to take in a seed finished after it was written."""
    path = Path(out_dir) / "metrics.json"
    try:
        metrics = json.loads(path.read_text())
        missing = metrics.get("missing_stages", [])  # absent in files written before stages existed
    except FileNotFoundError:
        raise ConfigError(f"--report-only: {path} does not exist; run the experiment there first") from None
    except (OSError, ValueError, AttributeError) as error:
        raise ConfigError(f"--report-only: {path} is not an experiment's metrics.json ({error})") from None
    if missing:
        raise ConfigError(
            f"--report-only: stages {', '.join(missing)} are not finished in {out_dir}; the report needs "
            "every stage: run the same experiment command again to finish them"
        )
    return write_report(metrics, path.parent, other_seeds(path.parent, metrics))


def _stage_done(done: Progress, stage: str) -> bool:
    if stage in ARMS:
        return done.get(f"arm:{stage}") is not None
    if stage == "evaluate":
        return all(done.get(f"evaluate:{name}") is not None for name in ("base", *ARMS))
    return done.get(f"stage:{stage}") is not None
