"""Training: the three arms from the base model (probed as they train), and the population-size sweep.

How intermediate policies are probed: train() keeps only its newest checkpoints, so each arm is trained
in segments. Every segment resumes the run from the previous segment's checkpoint (train() resumes
exactly: the result equals an uninterrupted run), and the segment's final model is probed.
The GRPO -> ES arm starts from the GRPO arm's model halfway through (GRPO has no learning-rate schedule
and draws its batches from (seed, step), so the first half of the GRPO arm is exactly the GRPO phase a
shorter GRPO run would have) and runs ES with a fresh ES state. With equal prompt batches for both
phases that is bit for bit train() with algorithm "grpo_es" (tested); here each phase keeps its own arm's
batch size, and the GRPO phase is not paid for twice.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..config import load_config
from ..models import format_prompt, load_model, num_params, tiny_model_path
from ..tasks import Task
from ..train import train
from .budget import BudgetPlan, Preset, segment_ends, sweep_iterations
from .measure import greedy_correct, sampled_entropy


@dataclass
class Context:
    """What every stage needs: the preset, where to write, the base model and the task."""

    preset: Preset
    out_dir: Path
    base_path: Path
    device: str
    task: Task
    plan: BudgetPlan
    progress: bool
    timings: dict[str, float]

    def load(self, path: str | Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
        return load_model(path, dtype=self.preset.dtype, device=self.device)

    def bar(self, total: int, desc: str) -> tqdm:
        return tqdm(total=total, desc=desc, disable=not self.progress)

    def show(self, path: str | Path) -> str:
        """A model directory as the report names it: relative to the experiment directory when inside
        it, "fastes/assets/tiny" for the built-in model, else as given."""
        path = Path(path)
        if path.resolve() == tiny_model_path().resolve():
            return "fastes/assets/tiny"
        if path.resolve().is_relative_to(self.out_dir.resolve()):
            return str(path.resolve().relative_to(self.out_dir.resolve()))
        return str(path)

    def timed(self, name: str, start: float) -> None:
        """Record the seconds since `start` as stage `name`'s time."""
        self.timings[name] = round(time.perf_counter() - start, 1)


def train_overrides(ctx: Context, algorithm: str, model: Path, out_dir: Path) -> dict[str, Any]:
    """The TrainConfig overrides shared by every training run of the experiment."""
    p = ctx.preset
    return {
        "algorithm": algorithm,
        "model": str(model),
        "task": p.task,
        "seed": p.seed,
        "out_dir": str(out_dir),
        "batch_size": p.grpo_batch if algorithm == "grpo" else p.es_batch,
        "max_new_tokens": p.max_new_tokens,
        "format_weight": p.format_weight,
        "eval_size": p.eval_size,
        "dtype": p.dtype,
        "device": ctx.device,
        "progress": False,
        "es.population": p.population,
        "es.sigma": p.sigma,
        "es.lr": p.es_lr,
        "grpo.num_generations": p.num_generations,
        "grpo.lr": p.grpo_lr,
    }


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_in_segments(
    overrides: dict[str, Any],
    length: int,
    every: int,
    probe: Callable[[Path], float],
    *,
    extra_ends: tuple[int, ...] = (),
    on_end: Callable[[int, Path], None] | None = None,
    bar: tqdm | None = None,
) -> list[tuple[int, float]]:
    """Train one single-phase run ("es" or "grpo") for `length` steps, pausing at segment_ends to probe.

    Each segment after the first resumes from the previous one's checkpoint, which train() continues
    exactly. probe(model_dir) is called on the model at every segment end and on_end(step, model_dir)
    after it. Returns [(step, probe value)] for every segment end.
    """
    run_dir = Path(overrides["out_dir"])
    shutil.rmtree(run_dir, ignore_errors=True)  # a stale checkpoint must never be resumed
    ends = segment_ends(length, every, extra_ends)
    key = "es.iterations" if overrides["algorithm"] == "es" else "grpo.steps"
    probes, done = [], 0
    for index, end in enumerate(ends):
        cfg = load_config(
            None,
            {**overrides, key: end, "eval_every": every, "checkpoint_every": math.gcd(*ends)},
        )
        train(cfg, resume=index > 0)
        probes.append((end, probe(run_dir / "final")))
        if on_end is not None:
            on_end(end, run_dir / "final")
        if bar is not None:
            bar.update(end - done)
            last = read_metrics(run_dir)[-1]
            bar.set_postfix(reward=f"{last['reward']:.3f}", test=f"{last.get('test_accuracy', math.nan):.3f}")
        done = end
    return probes


def entropy_probe(ctx: Context) -> Callable[[Path], float]:
    """probe(model_dir): the entropy of that model on its own samples of the preset's probe prompts."""
    p = ctx.preset
    tokenizer = ctx.load(ctx.base_path)[1]
    prompts = [format_prompt(tokenizer, ex.prompt) for ex in ctx.task.split("test")[: p.probe_prompts]]

    def probe(model_dir: Path) -> float:
        model, tokenizer = ctx.load(model_dir)
        return sampled_entropy(
            model,
            tokenizer,
            prompts,
            samples=p.probe_samples,
            max_new_tokens=p.max_new_tokens,
            seed=p.seed + 7,
        )

    return probe


def _arm_result(
    run_dir: Path, probes: list[tuple[int, float]], per_step: int, start: tuple[int, float]
) -> dict:
    """An arm's probes on the training-completions axis (from `start`), its metrics and its model."""
    offset = start[0]
    return {
        "probes": [start] + [(offset + step * per_step, value) for step, value in probes],
        "metrics": read_metrics(run_dir),
        "model_dir": str(run_dir / "final"),
    }


def train_arms(ctx: Context) -> dict[str, dict[str, Any]]:
    """Train ES, GRPO and GRPO -> ES from the base model; per arm its probes, metrics and model dir.

    Probes are (training completions so far, entropy of the policy on its own samples of the probe
    prompts), at every probe_every ES iterations and every GRPO step count of as many completions.
    """
    p, plan, runs = ctx.preset, ctx.plan, ctx.out_dir / "runs"
    probe = entropy_probe(ctx)
    base_probe = (0, probe(ctx.base_path))
    half_grpo, half_es = plan.arm_lengths()["grpo_es"]
    half_model = runs / "grpo" / "half"

    def snapshot(step: int, model_dir: Path) -> None:
        if step == half_grpo:  # where GRPO -> ES switches to ES
            shutil.rmtree(half_model, ignore_errors=True)
            shutil.copytree(model_dir, half_model)

    arms: dict[str, dict[str, Any]] = {}
    start = time.perf_counter()
    with ctx.bar(plan.es_iterations, "train ES") as bar:
        overrides = train_overrides(ctx, "es", ctx.base_path, runs / "es")
        probes = train_in_segments(overrides, plan.es_iterations, p.probe_every, probe, bar=bar)
    arms["es"] = _arm_result(runs / "es", probes, plan.es_samples_per_iteration, base_probe)
    ctx.timed("train_es", start)

    start = time.perf_counter()
    grpo_every = max(1, round(p.probe_every * plan.es_samples_per_iteration / plan.grpo_samples_per_step))
    with ctx.bar(plan.grpo_steps, "train GRPO") as bar:
        overrides = train_overrides(ctx, "grpo", ctx.base_path, runs / "grpo")
        probes = train_in_segments(
            overrides, plan.grpo_steps, grpo_every, probe, extra_ends=(half_grpo,), on_end=snapshot, bar=bar
        )
    arms["grpo"] = _arm_result(runs / "grpo", probes, plan.grpo_samples_per_step, base_probe)
    ctx.timed("train_grpo", start)

    start = time.perf_counter()
    with ctx.bar(half_es, "train GRPO->ES (ES phase)") as bar:
        overrides = train_overrides(ctx, "es", half_model, runs / "grpo_es")
        probes = train_in_segments(overrides, half_es, p.probe_every, probe, bar=bar)
    half_samples = plan.samples(half_grpo, 0)
    half_probe = (half_samples, dict(arms["grpo"]["probes"])[half_samples])
    arms["grpo_es"] = _arm_result(runs / "grpo_es", probes, plan.es_samples_per_iteration, half_probe)
    arms["grpo_es"]["start_model"] = str(half_model)
    ctx.timed("train_grpo_es", start)
    return arms


def training_curves(arms: dict[str, dict[str, Any]], plan: BudgetPlan) -> dict[str, dict[str, Any]]:
    """Per arm, its logged curves with training completions on the x axis (for plots and metrics.json)."""
    curves: dict[str, dict[str, Any]] = {}
    offsets = {"es": 0, "grpo": 0, "grpo_es": plan.samples(plan.arm_lengths()["grpo_es"][0], 0)}
    for arm, info in arms.items():
        cost = plan.grpo_samples_per_step if arm == "grpo" else plan.es_samples_per_iteration
        grpo_steps, es_iterations = plan.arm_lengths()[arm]

        def x(record: dict, cost: int = cost, offset: int = offsets[arm]) -> int:
            return offset + record["step"] * cost

        metrics = info["metrics"]
        steps = [m for m in metrics if "reward" in m]
        curves[arm] = {
            "grpo_steps": grpo_steps,
            "es_iterations": es_iterations,
            "samples": plan.samples(grpo_steps, es_iterations),
            "probe_entropy": [list(point) for point in info["probes"]],
            "test_accuracy": [[x(m), m["test_accuracy"]] for m in metrics if "test_accuracy" in m],
            "reward": [[x(m), m["reward"]] for m in steps],
            "seconds": round(sum(m["seconds"] for m in steps), 1),
        }
        if arm == "grpo":
            curves[arm]["logged_entropy"] = [[x(m), m["entropy"]] for m in steps]
        else:
            curves[arm]["js_diversity"] = [[m["step"], m["js_diversity"]] for m in steps]
            curves[arm]["members_agree"] = [[m["step"], m["members_agree"]] for m in steps]
    return curves


# --- the population-size sweep ----------------------------------------------------------------------


def _small_model(ctx: Context) -> Path:
    """The built-in "small" model, pretrained once into the experiment directory and reused after, with
    the shipped tiny model's data recipe (its style_mix), so that the two sizes differ only in size."""
    from ..models import tiny_model_path
    from ..pretrain import pretrain

    recipe = json.loads((tiny_model_path() / "pretrain.json").read_text())
    wanted = {"steps": ctx.preset.small_pretrain_steps, "seed": ctx.preset.seed}
    wanted["style_mix"] = recipe.get("style_mix", 0.0)
    path = ctx.out_dir / "models" / "small"
    info = path / "pretrain.json"
    if info.is_file():
        saved = json.loads(info.read_text())
        if all(saved.get(key, 0.0) == value for key, value in wanted.items()):
            return path
    pretrain(path, size="small", progress=ctx.progress, **wanted)
    return path


def _sweep_run(ctx: Context, path: Path, population: int, run_dir: Path) -> dict[str, Any]:
    """One ES run of the sweep (population members, sweep_budget completions) and its results."""
    p = ctx.preset
    iterations = sweep_iterations(p.sweep_budget, population, p.sweep_batch)
    shutil.rmtree(run_dir, ignore_errors=True)
    overrides = {
        **train_overrides(ctx, "es", path, run_dir),
        "batch_size": p.sweep_batch,
        "es.population": population,
        "es.iterations": iterations,
        "eval_every": 0,
        "checkpoint_every": 0,
        "progress": ctx.progress,  # one run can take minutes: show its iterations
    }
    cfg = load_config(None, overrides)
    train(cfg)
    trained, tokenizer = ctx.load(run_dir / "final")
    examples = ctx.task.split("test")[: p.eval_size]
    kwargs = {"max_new_tokens": p.max_new_tokens, "rows_per_call": p.generation_batch}
    metrics = read_metrics(run_dir)
    steps = [m for m in metrics if "reward" in m]
    tail = steps[-max(1, len(steps) // 5) :]
    return {
        "base_accuracy": metrics[0]["test_accuracy"],
        "iterations": iterations,
        "samples": iterations * population * p.sweep_batch,
        "test_accuracy": metrics[-1]["test_accuracy"],
        "test_reward": cfg.format_weight * metrics[-1]["test_format"] + metrics[-1]["test_accuracy"],
        "train_reward": float(np.mean([m["reward"] for m in tail])),
        "greedy_correct": greedy_correct(trained, tokenizer, ctx.task, examples, **kwargs),  # paired tests
    }


def population_sweep(ctx: Context, custom_model: bool) -> dict[str, Any]:
    """ES with N members for every N of the preset, each run given sweep_budget training completions.

    Sizes: the built-in tiny and small models, or the given model alone. Per (size, N): iterations,
    final greedy test accuracy and test reward (format_weight x format + answer), and the mean
    population reward over the last fifth of the iterations.
    """
    p = ctx.preset
    sizes = {"model": ctx.base_path} if custom_model else {}
    for size in () if custom_model else p.sweep_sizes:
        sizes[size] = ctx.base_path if size == "tiny" else _small_model(ctx)
    results: dict[str, Any] = {}
    with ctx.bar(len(sizes) * len(p.sweep_populations), "population sweep") as bar:
        for size, path in sizes.items():
            model, _ = ctx.load(path)
            results[size] = {"model_dir": ctx.show(path), "params": num_params(model), "runs": {}}
            for population in p.sweep_populations:
                run = _sweep_run(ctx, path, population, ctx.out_dir / "sweep" / size / f"N{population}")
                results[size]["base_accuracy"] = run.pop("base_accuracy")
                results[size]["runs"][str(population)] = run
                bar.update(1)
    return results
