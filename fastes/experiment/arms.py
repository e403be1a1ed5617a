"""Training: the three arms from the base model (probed as they train), and the population-size sweep.

How intermediate policies are probed: train() keeps only its newest checkpoints, so each arm is trained
in segments. Every segment resumes the run from the previous segment's checkpoint (train() resumes
exactly: the result equals an uninterrupted run), and the segment's final model is probed.
The GRPO -> ES arm starts from the GRPO arm's model halfway through (the study's GRPO runs at a constant
learning rate and draws its batches from (seed, step), so the first half of the GRPO arm is exactly the
GRPO phase a shorter GRPO run would have) and runs ES with a fresh ES state. With equal prompt batches
for both phases that is bit for bit train() with algorithm "grpo_es" (tested); here each phase keeps its
own arm's batch size, and the GRPO phase is not paid for twice.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fastes.models.loading import is_character_tokenizer, load_model, num_params, tiny_model_path
from fastes.run import auto_settings
from fastes.run.config import TrainConfig, load_config
from fastes.run.evaluation import Evaluator
from fastes.run.rundir import RUN_FILE
from fastes.run.train import train
from fastes.tasks import Task
from fastes.tasks.setup import make_task

from .budget import BudgetPlan, Preset, segment_ends, sweep_iterations
from .progress import Progress


@dataclass
class Context:
    """What every stage needs: the preset, where to write, the base model, the settings every run and
    measurement shares (cfg, automatic settings resolved for the base model), the task and the progress."""

    preset: Preset
    out_dir: Path
    base_path: Path
    device: str
    plan: BudgetPlan
    progress: bool
    cfg: TrainConfig
    task: Task
    done: Progress

    def load(self, path: str | Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
        return load_model(path, dtype=self.preset.dtype, device=self.device)

    def evaluator(self, path: str | Path) -> Evaluator:
        """The model in `path` measured with the experiment's run settings (one evaluation path)."""
        return Evaluator(self.cfg, *self.load(path))

    def bar(self, total: int, desc: str, initial: int = 0) -> tqdm:
        return tqdm(total=total, initial=initial, desc=desc, disable=not self.progress)

    def show(self, path: str | Path) -> str:
        """A model directory as the report names it: relative to the experiment directory when inside
        it, "fastes/assets/tiny" for the built-in model, else as given."""
        path = Path(path)
        if path.resolve() == tiny_model_path().resolve():
            return "fastes/assets/tiny"
        if path.resolve().is_relative_to(self.out_dir.resolve()):
            return str(path.resolve().relative_to(self.out_dir.resolve()))
        return str(path)


def shared_settings(preset: Preset, device: str) -> dict[str, Any]:
    """The TrainConfig keys every run and every measurement of the experiment shares: the task, how its
    prompts are written and answered, the reward, the test problems."""
    p = preset
    return {
        "task": p.task,
        "seed": p.seed,
        "prompt_style": p.prompt_style,
        "chat_template": p.chat_template,
        "system_prompt": p.system_prompt,
        "instruction": p.instruction,
        "answer_prefix": p.answer_prefix,
        "max_new_tokens": p.max_new_tokens,
        "format_weight": p.format_weight,
        "eval_size": p.eval_size,
        "eval_batch_size": p.generation_batch,
        "dtype": p.dtype,
        "device": device,
    }


def make_context(
    preset: Preset,
    out_dir: Path,
    base_path: Path,
    device: str,
    plan: BudgetPlan,
    progress: bool,
    done: Progress,
) -> Context:
    """The Context of an experiment: its shared settings resolved for the base model as a run resolves
    them (fastes.run.auto_settings), and its task built as a run builds it (fastes.tasks.setup.make_task)."""
    model, tokenizer = load_model(base_path, dtype=preset.dtype, device=device)
    given = load_config(None, {**shared_settings(preset, device), "model": str(base_path)})
    cfg = auto_settings.resolve(given, model, tokenizer)
    task = make_task(cfg, strict_alphabet=is_character_tokenizer(tokenizer))
    return Context(preset, out_dir, base_path, device, plan, progress, cfg, task, done)


def train_overrides(ctx: Context, algorithm: str, model: Path, out_dir: Path) -> dict[str, Any]:
    """The TrainConfig overrides of one training run of the experiment: the shared settings with the
    prompt settings chosen for the base model, and the algorithm's own."""
    p = ctx.preset
    return {
        **shared_settings(p, ctx.device),
        "prompt_style": ctx.cfg.prompt_style,
        "algorithm": algorithm,
        "model": str(model),
        "out_dir": str(out_dir),
        "batch_size": p.grpo_batch if algorithm == "grpo" else p.es_batch,
        "progress": False,
        "es.population": p.population,
        "es.sigma": p.sigma,
        "es.lr": p.es_lr,
        "grpo.num_generations": p.num_generations,
        "grpo.lr": p.grpo_lr,
        "grpo.temperature": p.temperature,
    }


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_in_segments(
    overrides: dict[str, Any],
    length: int,
    every: int,
    probe: Callable[[Path], float],
    *,
    done: Progress,
    key: str,
    extra_ends: tuple[int, ...] = (),
    on_end: Callable[[int, Path], None] | None = None,
    bar: tqdm | None = None,
) -> list[tuple[int, float]]:
    """Train one single-phase run ("es" or "grpo") for `length` steps, pausing at segment_ends to probe.

    Each segment continues the run from its newest checkpoint, which train() does exactly. probe(model_dir)
    is called on the model at every segment end and on_end(step, model_dir) after it; each end's probe is
    recorded in `done` under "<key>:<end>", and a segment already recorded there (by an earlier start of
    the experiment) is not trained again. Returns [(step, probe value)] for every segment end.
    """
    run_dir = Path(overrides["out_dir"])
    ends = segment_ends(length, every, extra_ends)
    step_key = "es.iterations" if overrides["algorithm"] == "es" else "grpo.steps"
    probes, trained = [], 0
    for end in ends:
        value = done.get(f"{key}:{end}")
        if value is None:
            started = (run_dir / RUN_FILE).is_file()
            if not started:  # nothing to continue: whatever an interrupted start left is replaced
                shutil.rmtree(run_dir, ignore_errors=True)
            cfg = load_config(
                None,
                {**overrides, step_key: end, "eval_every": every, "checkpoint_every": math.gcd(*ends)},
            )
            train(cfg, resume=started)
            value = probe(run_dir / "final")
            if on_end is not None:
                on_end(end, run_dir / "final")
            done.put(f"{key}:{end}", value)
        probes.append((end, value))
        if bar is not None:
            bar.update(end - trained)
            last = read_metrics(run_dir)[-1]
            bar.set_postfix(reward=f"{last['reward']:.3f}", test=f"{last.get('test_accuracy', math.nan):.3f}")
        trained = end
    return probes


def entropy_probe(ctx: Context) -> Callable[[Path], float]:
    """probe(model_dir): the entropy of that model on its own samples of the preset's probe prompts."""
    p = ctx.preset
    examples = ctx.task.split("test")[: p.probe_prompts]

    def probe(model_dir: Path) -> float:
        return ctx.evaluator(model_dir).entropy(
            examples, samples=p.probe_samples, temperature=p.temperature, seed=p.seed + 7
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


def train_arm(ctx: Context, arm: str) -> dict[str, Any]:
    """Train one arm (ES, GRPO, or GRPO -> ES from the GRPO arm's half-way model): its probes, metrics and
    model dir. GRPO -> ES needs the GRPO arm trained first.

    Probes are (training completions so far, entropy of the policy on its own samples of the probe
    prompts), at every probe_every ES iterations and every GRPO step count of as many completions.
    """
    p, plan, runs = ctx.preset, ctx.plan, ctx.out_dir / "runs"
    probe = entropy_probe(ctx)
    base_probe = (0, ctx.done.once("probe:base", probe, ctx.base_path))
    half_grpo, half_es = plan.arm_lengths()["grpo_es"]
    half_model = runs / "grpo" / "half"
    if arm == "es":
        with ctx.bar(plan.es_iterations, "train ES") as bar:
            overrides = train_overrides(ctx, "es", ctx.base_path, runs / "es")
            probes = train_in_segments(
                overrides, plan.es_iterations, p.probe_every, probe, done=ctx.done, key="probe:es", bar=bar
            )
        return _arm_result(runs / "es", probes, plan.es_samples_per_iteration, base_probe)
    if arm == "grpo":

        def snapshot(step: int, model_dir: Path) -> None:
            if step == half_grpo:  # where GRPO -> ES switches to ES
                shutil.rmtree(half_model, ignore_errors=True)
                shutil.copytree(model_dir, half_model)

        grpo_every = max(1, round(p.probe_every * plan.es_samples_per_iteration / plan.grpo_samples_per_step))
        with ctx.bar(plan.grpo_steps, "train GRPO") as bar:
            overrides = train_overrides(ctx, "grpo", ctx.base_path, runs / "grpo")
            probes = train_in_segments(
                overrides,
                plan.grpo_steps,
                grpo_every,
                probe,
                done=ctx.done,
                key="probe:grpo",
                extra_ends=(half_grpo,),
                on_end=snapshot,
                bar=bar,
            )
        return _arm_result(runs / "grpo", probes, plan.grpo_samples_per_step, base_probe)
    with ctx.bar(half_es, "train GRPO->ES (ES phase)") as bar:
        overrides = train_overrides(ctx, "es", half_model, runs / "grpo_es")
        probes = train_in_segments(
            overrides, half_es, p.probe_every, probe, done=ctx.done, key="probe:grpo_es", bar=bar
        )
    half_probe = (plan.samples(half_grpo, 0), ctx.done.get(f"probe:grpo:{half_grpo}"))
    result = _arm_result(runs / "grpo_es", probes, plan.es_samples_per_iteration, half_probe)
    return {**result, "start_model": str(half_model)}


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
    from fastes.run.pretrain import pretrain

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
    shutil.rmtree(run_dir, ignore_errors=True)  # a run stopped half-way starts again
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
    examples = ctx.task.split("test")[: p.eval_size]
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
        # per prompt, for paired tests
        "greedy_correct": ctx.evaluator(run_dir / "final").greedy(ctx.task, examples).correct,
    }


def population_sweep(ctx: Context, custom_model: bool) -> dict[str, Any]:
    """ES with N members for every N of the preset, each run given sweep_budget training completions.

    Sizes: those of the preset ("tiny" and "small": the built-in family, "model": the experiment's own
    model), or the given model alone (custom_model). Per (size, N): iterations, final greedy test
    accuracy and test reward (format_weight x format + answer), and the mean population reward over the
    last fifth of the iterations. Each finished run is recorded, and not run again on a continued start.
    """
    p = ctx.preset
    sizes: dict[str, Path] = {}
    for size in ("model",) if custom_model else p.sweep_sizes:
        sizes[size] = ctx.base_path if size in ("model", "tiny") else _small_model(ctx)
    results: dict[str, Any] = {}
    with ctx.bar(len(sizes) * len(p.sweep_populations), "population sweep") as bar:
        for size, path in sizes.items():
            results[size] = {"model_dir": ctx.show(path), "params": num_params(ctx.load(path)[0]), "runs": {}}
            for population in p.sweep_populations:
                run_dir = ctx.out_dir / "sweep" / size / f"N{population}"
                run = ctx.done.once(f"sweep:{size}:{population}", _sweep_run, ctx, path, population, run_dir)
                results[size]["base_accuracy"] = run["base_accuracy"]
                results[size]["runs"][str(population)] = {
                    k: v for k, v in run.items() if k != "base_accuracy"
                }
                bar.update(1)
    return results
