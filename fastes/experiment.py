"""`fastes experiment`: ES, GRPO and GRPO then ES from one base model at equal sample budgets, compared.

It trains three arms from the same base model,

    base -> ES        base -> GRPO        base -> GRPO -> ES (half the budget each)

each allowed the same number of training completions (the sample budget, see plan_budget), then
measures all four models (base included) the way the seed paper does ("Understanding ES for LLM
Reasoning: Broader Reasoning Coverage than GRPO", arXiv 2608.27351):

- Pass@K on the test prompts (n samples each at temperature 1);
- token entropy over training: the logged entropy of GRPO's training batches, and for every arm the
  entropy of the policy on its own samples of fixed probe prompts at each evaluation point;
- the verifier-projected JS diversity of the ES population (logged by every ES iteration);
- gain retained when only the top-k largest elements of the ES update are kept (random and bottom-k
  masks of the same density as controls);
- forgetting: held-out task accuracy, perplexity of a fixed held-out corpus, token KL to the base;
- the population-size sweep: ES at a fixed sample budget with N members, for two model sizes.

Everything goes into one directory: metrics.json, report.md (read that first) and the PNG plots.

    fastes experiment --preset tiny     # the built-in tiny model, 2 CPU cores, under 45 minutes
    fastes experiment --preset quick    # a smoke run of every stage, about a minute
    fastes experiment --model DIR       # any local HF causal LM (the sweep then uses that model alone)

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
import re
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .analysis.drift import masked_nll, perplexity, token_kl
from .analysis.entropy import token_entropy
from .analysis.passk import pass_at_k, pass_at_k_curve
from .analysis.sparsity import gain_retained, topk_mask_state
from .config import ConfigError, load_config
from .generation import Generation, generate
from .models import format_prompt, load_model, num_params, tiny_model_path
from .tasks import HELD_OUT_TASKS, Example, Task, get_task
from .train import train

ARMS = ("es", "grpo", "grpo_es")
MODELS = ("base", *ARMS)
LABELS = {"base": "base", "es": "ES", "grpo": "GRPO", "grpo_es": "GRPO->ES"}
MASK_KINDS = {"top": "top-k (global)", "random": "random (same density)", "bottom": "bottom-k"}

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


# --- presets ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Preset:
    """Every setting of one experiment. The budget is fixed by the ES arm: es_iterations x population x
    es_batch completions; GRPO gets as many steps as that buys (see plan_budget)."""

    name: str
    task: str = "countdown"
    seed: int = 0
    max_new_tokens: int = 12
    dtype: str = "float32"
    device: str = "auto"  # "auto": cuda when available, else cpu
    generation_batch: int = 512  # rows (prompts x samples) per generate call in the evaluations
    # ES. sigma and lr from short sweeps on the tiny model: at 30 iterations larger values hurt; at this
    # budget (40 iterations) test accuracy 0.25 -> 0.225 (sigma 0.002, lr 5e-5), 0.265 (0.002, 2e-5),
    # 0.23 (0.002, 1e-4), 0.275 (0.001, 2.5e-5): all within noise of the base, the last one kept.
    es_iterations: int = 40
    population: int = 32
    es_batch: int = 64
    sigma: float = 0.001
    es_lr: float = 2.5e-5
    # GRPO: num_generations and temperature 1 as TRL. lr from a sweep of 320 steps on the tiny model:
    # test accuracy 0.25 -> 0.32 (1e-4), 0.355 (3e-4), 0.25 (1e-3, entropy collapsed to 0.06 nats).
    grpo_batch: int = 32
    num_generations: int = 8
    grpo_lr: float = 3e-4
    # evaluation
    probe_every: int = 5  # ES iterations between evaluation points (GRPO: the same number of samples)
    eval_size: int = 200  # test prompts for greedy accuracy
    passk_prompts: int = 200
    passk_samples: int = 16
    probe_prompts: int = 64  # prompts for the entropy probe
    probe_samples: int = 8  # samples per probe prompt
    heldout_size: int = 200  # prompts per held-out task (accuracy, perplexity corpus and KL)
    kl_samples: int = 4  # samples per held-out prompt for the KL
    keep_fractions: tuple[float, ...] = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0)
    # population-size sweep: ES runs of sweep_budget completions each, for every N and model size
    sweep_populations: tuple[int, ...] = (8, 16, 32)
    sweep_budget: int = 40960  # = 20 iterations of N=32 x 64 prompts
    sweep_batch: int = 64
    sweep_sizes: tuple[str, ...] = ("tiny", "small")  # the built-in family; --model sweeps that model
    small_pretrain_steps: int = 1500


PRESETS: dict[str, Preset] = {
    "tiny": Preset(name="tiny"),
    "quick": Preset(
        name="quick",
        es_iterations=2,
        population=4,
        es_batch=8,
        sigma=0.02,  # large enough that 4 members on 8 prompts score differently, so ES moves at all
        es_lr=0.002,
        grpo_batch=4,
        num_generations=4,
        probe_every=1,
        eval_size=16,
        passk_prompts=8,
        passk_samples=4,
        probe_prompts=4,
        probe_samples=2,
        heldout_size=8,
        kl_samples=2,
        keep_fractions=(0.01, 0.1, 1.0),
        sweep_populations=(4, 8),
        sweep_budget=64,
        sweep_batch=8,
        sweep_sizes=("tiny",),
    ),
}


# --- equal sample budgets ---------------------------------------------------------------------------


@dataclass(frozen=True)
class BudgetPlan:
    """How long each arm trains so that all three generate the same number of training completions.

    ES generates population x prompts completions per iteration (every member answers every prompt),
    GRPO prompts x num_generations per step. GRPO -> ES spends half the budget on each phase.
    """

    es_iterations: int
    grpo_steps: int
    es_samples_per_iteration: int
    grpo_samples_per_step: int

    @property
    def total_samples(self) -> int:
        return self.es_iterations * self.es_samples_per_iteration

    def arm_lengths(self) -> dict[str, tuple[int, int]]:
        """{arm: (GRPO steps, ES iterations)}."""
        return {
            "es": (0, self.es_iterations),
            "grpo": (self.grpo_steps, 0),
            "grpo_es": (self.grpo_steps // 2, self.es_iterations // 2),
        }

    def samples(self, grpo_steps: int, es_iterations: int) -> int:
        """Training completions generated by that many GRPO steps and ES iterations."""
        return grpo_steps * self.grpo_samples_per_step + es_iterations * self.es_samples_per_iteration


def plan_budget(
    es_iterations: int, population: int, es_batch: int, grpo_batch: int, num_generations: int
) -> BudgetPlan:
    """GRPO steps that generate exactly as many completions as `es_iterations` ES iterations.

    Raises ValueError when no whole number of GRPO steps matches, or when the budget cannot be halved
    into whole GRPO steps and ES iterations for the GRPO -> ES arm.
    """
    for name, value in [
        ("es_iterations", es_iterations),
        ("population", population),
        ("es_batch", es_batch),
        ("grpo_batch", grpo_batch),
        ("num_generations", num_generations),
    ]:
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    per_iteration = population * es_batch
    per_step = grpo_batch * num_generations
    total = es_iterations * per_iteration
    if total % per_step:
        raise ValueError(
            f"{es_iterations} ES iterations generate {total} completions, which is not a whole number of "
            f"GRPO steps of {per_step} (grpo_batch x num_generations); change one of them"
        )
    grpo_steps = total // per_step
    if es_iterations % 2 or grpo_steps % 2:
        raise ValueError(
            f"GRPO -> ES spends half the budget on each phase, so ES iterations ({es_iterations}) and "
            f"GRPO steps ({grpo_steps}) must both be even"
        )
    return BudgetPlan(es_iterations, grpo_steps, per_iteration, per_step)


def segment_ends(length: int, every: int, extra: tuple[int, ...] = ()) -> list[int]:
    """Where training pauses to probe: every `every` steps, at each step in `extra` and at `length`."""
    if length < 1 or every < 1:
        raise ValueError(f"length and every must be at least 1, got {length} and {every}")
    ends = set(range(every, length, every)) | {length} | {e for e in extra if 0 < e < length}
    return sorted(ends)


# --- measurements on one model ----------------------------------------------------------------------


def _generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    *,
    max_new_tokens: int,
    rows_per_call: int = 512,
    temperature: float = 0.0,
    seed: int | None = None,
    samples: int = 1,
) -> Generation:
    """generate() over chunks of prompts (so a large model's memory stays bounded), results in order.

    Chunk c is sampled with seed + c, so the result is deterministic for a given chunk size.
    """
    per_call = max(1, rows_per_call // samples)
    texts, completions, prompt_ids = [], [], []
    for chunk, start in enumerate(range(0, len(prompts), per_call)):
        gen = generate(
            model,
            tokenizer,
            prompts[start : start + per_call],
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=None if seed is None else seed + chunk,
            num_return_sequences=samples,
        )
        texts += gen.texts
        completions += gen.completion_ids
        prompt_ids += gen.prompt_ids
    return Generation(texts=texts, completion_ids=completions, prompt_ids=prompt_ids)


def completion_rows(gen: Generation, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded prompt + completion rows of a Generation: (input_ids, attention_mask, completion_mask).

    completion_mask[i, t] is true where token t of row i is a generated token (EOS included).
    """
    rows = [p + c for p, c in zip(gen.prompt_ids, gen.completion_ids)]
    width = max(map(len, rows))
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    completion = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, (p, c) in enumerate(zip(gen.prompt_ids, gen.completion_ids)):
        input_ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        attention[i, : len(p) + len(c)] = 1
        completion[i, len(p) : len(p) + len(c)] = True
    return input_ids, attention, completion


@torch.no_grad()
def _next_token_logits(
    model: torch.nn.Module, input_ids: torch.Tensor, attention: torch.Tensor
) -> torch.Tensor:
    """Logits at positions 0..T-2, i.e. the distributions that predicted tokens 1..T-1."""
    device = next(model.parameters()).device
    out = model(input_ids=input_ids.to(device), attention_mask=attention.to(device))
    return out.logits[:, :-1]


def _completion_batches(
    gen: Generation, pad_token_id: int, rows_per_forward: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(input_ids, attention_mask, mask) for each chunk of rows_per_forward rows of `gen`, where
    mask[i, t] is true when position t predicted a completion token (it lines up with
    _next_token_logits). Chunks without any completion token are skipped."""
    for start in range(0, len(gen.texts), rows_per_forward):
        end = start + rows_per_forward
        part = Generation(gen.texts[start:end], gen.completion_ids[start:end], gen.prompt_ids[start:end])
        input_ids, attention, completion = completion_rows(part, pad_token_id)
        mask = completion[:, 1:]
        if mask.any():
            yield input_ids, attention, mask


def completion_entropy(
    model: torch.nn.Module,
    gen: Generation,
    pad_token_id: int,
    temperature: float = 1.0,
    rows_per_forward: int = 256,
) -> float:
    """Mean token entropy (nats) of the model's next-token distribution at every completion token of `gen`.

    The distribution predicting completion token t is the one at position t - 1, softmax(logits / T),
    so with gen sampled from this model at temperature T this is the entropy of the policy on its own
    samples (what GRPO logs for its training batches). Averaged over all completion tokens of all rows.
    """
    total, count = 0.0, 0
    for input_ids, attention, mask in _completion_batches(gen, pad_token_id, rows_per_forward):
        logits = _next_token_logits(model, input_ids, attention)
        tokens = int(mask.sum())
        total += float(token_entropy(logits, mask.to(logits.device), temperature)) * tokens
        count += tokens
    return total / count if count else math.nan


def sampled_entropy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    *,
    samples: int,
    max_new_tokens: int,
    seed: int,
    temperature: float = 1.0,
) -> float:
    """Entropy of the policy on its own samples: sample `samples` completions per prompt, then
    completion_entropy of them. Prompts must already be formatted (format_prompt)."""
    gen = _generate(
        model,
        tokenizer,
        prompts,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        seed=seed,
        samples=samples,
    )
    return completion_entropy(model, gen, tokenizer.pad_token_id, temperature)


def sampled_kl(
    model: PreTrainedModel,
    base: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    *,
    samples: int,
    max_new_tokens: int,
    seed: int,
    rows_per_forward: int = 256,
) -> float:
    """Token-level KL(model || base) in nats, averaged over the completion tokens of the model's own
    samples (temperature 1) on `prompts`: how differently the two models continue the same text."""
    gen = _generate(
        model, tokenizer, prompts, max_new_tokens=max_new_tokens, temperature=1.0, seed=seed, samples=samples
    )
    total, count = 0.0, 0
    for input_ids, attention, mask in _completion_batches(gen, tokenizer.pad_token_id, rows_per_forward):
        logits = _next_token_logits(model, input_ids, attention)
        base_logits = _next_token_logits(base, input_ids, attention)
        tokens = int(mask.sum())
        total += float(token_kl(logits, base_logits, mask.to(logits.device))) * tokens
        count += tokens
    return total / count if count else math.nan


@torch.no_grad()
def corpus_perplexity(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    corpus: list[tuple[str, str]],
    rows_per_forward: int = 256,
) -> float:
    """Perplexity of each continuation given its context, over a corpus of (context, continuation) texts.

    Only continuation tokens are scored: for the held-out corpus (prompt, solution) that is the skill
    itself, as in pretraining, whose loss is on the solutions (a prompt's random digits are not).
    """
    nll, tokens = 0.0, 0
    for start in range(0, len(corpus), rows_per_forward):
        part = corpus[start : start + rows_per_forward]
        pairs = Generation(
            texts=[continuation for _, continuation in part],
            completion_ids=tokenizer([c for _, c in part], add_special_tokens=False)["input_ids"],
            prompt_ids=tokenizer([context for context, _ in part])["input_ids"],
        )
        input_ids, attention, continuation = completion_rows(pairs, tokenizer.pad_token_id)
        logits = _next_token_logits(model, input_ids, attention)
        part_nll, part_tokens = masked_nll(logits, input_ids[:, 1:], continuation[:, 1:])
        nll += part_nll
        tokens += part_tokens
    return perplexity(nll, tokens)


def greedy_correct(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    examples: list[Example],
    *,
    max_new_tokens: int,
    rows_per_call: int = 512,
) -> list[int]:
    """For each example, 1 when the greedy completion has the right answer, else 0."""
    prompts = [format_prompt(tokenizer, ex.prompt) for ex in examples]
    gen = _generate(model, tokenizer, prompts, max_new_tokens=max_new_tokens, rows_per_call=rows_per_call)
    return [int(task.score(ex, text).answer) for ex, text in zip(examples, gen.texts)]


def correct_counts(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    examples: list[Example],
    *,
    samples: int,
    max_new_tokens: int,
    seed: int,
    rows_per_call: int = 512,
) -> list[int]:
    """For each example, how many of `samples` completions at temperature 1 are correct."""
    prompts = [format_prompt(tokenizer, ex.prompt) for ex in examples]
    gen = _generate(
        model,
        tokenizer,
        prompts,
        max_new_tokens=max_new_tokens,
        rows_per_call=rows_per_call,
        temperature=1.0,
        seed=seed,
        samples=samples,
    )
    return [
        int(sum(task.score(ex, gen.texts[i * samples + j]).answer for j in range(samples)))
        for i, ex in enumerate(examples)
    ]


# --- the experiment ---------------------------------------------------------------------------------


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


def _stage(ctx: Context, name: str, start: float) -> None:
    ctx.timings[name] = round(time.perf_counter() - start, 1)


def _train_overrides(ctx: Context, algorithm: str, model: Path, out_dir: Path) -> dict[str, Any]:
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


def _read_metrics(run_dir: Path) -> list[dict]:
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
            last = _read_metrics(run_dir)[-1]
            bar.set_postfix(reward=f"{last['reward']:.3f}", test=f"{last.get('test_accuracy', math.nan):.3f}")
        done = end
    return probes


def train_arms(ctx: Context) -> dict[str, dict[str, Any]]:
    """Train ES, GRPO and GRPO -> ES from the base model; per arm its probes, metrics and model dir.

    Probes are (training completions so far, entropy of the policy on its own samples of the probe
    prompts), at every probe_every ES iterations and every GRPO step count of as many completions.
    """
    p, plan = ctx.preset, ctx.plan
    tokenizer = ctx.load(ctx.base_path)[1]
    probe_prompts = [format_prompt(tokenizer, ex.prompt) for ex in ctx.task.split("test")[: p.probe_prompts]]

    def probe(model_dir: Path) -> float:
        model, tokenizer = ctx.load(model_dir)
        return sampled_entropy(
            model,
            tokenizer,
            probe_prompts,
            samples=p.probe_samples,
            max_new_tokens=p.max_new_tokens,
            seed=p.seed + 7,
        )

    runs = ctx.out_dir / "runs"
    half_grpo, half_es = plan.arm_lengths()["grpo_es"]
    half_model = runs / "grpo" / "half"
    half_samples = plan.samples(half_grpo, 0)

    def arm(name: str, probes: list[tuple[int, float]], per_step: int, start: tuple[int, float]) -> dict:
        offset = start[0]
        return {
            "probes": [start] + [(offset + step * per_step, value) for step, value in probes],
            "metrics": _read_metrics(runs / name),
            "model_dir": str(runs / name / "final"),
        }

    def snapshot(step: int, model_dir: Path) -> None:
        if step == half_grpo:  # where GRPO -> ES switches to ES
            shutil.rmtree(half_model, ignore_errors=True)
            shutil.copytree(model_dir, half_model)

    base_probe = (0, probe(ctx.base_path))
    arms: dict[str, dict[str, Any]] = {}
    start = time.perf_counter()
    with ctx.bar(plan.es_iterations, "train ES") as bar:
        overrides = _train_overrides(ctx, "es", ctx.base_path, runs / "es")
        probes = train_in_segments(overrides, plan.es_iterations, p.probe_every, probe, bar=bar)
        arms["es"] = arm("es", probes, plan.es_samples_per_iteration, base_probe)
    _stage(ctx, "train_es", start)

    start = time.perf_counter()
    grpo_every = max(1, round(p.probe_every * plan.es_samples_per_iteration / plan.grpo_samples_per_step))
    with ctx.bar(plan.grpo_steps, "train GRPO") as bar:
        overrides = _train_overrides(ctx, "grpo", ctx.base_path, runs / "grpo")
        probes = train_in_segments(
            overrides, plan.grpo_steps, grpo_every, probe, extra_ends=(half_grpo,), on_end=snapshot, bar=bar
        )
        arms["grpo"] = arm("grpo", probes, plan.grpo_samples_per_step, base_probe)
    _stage(ctx, "train_grpo", start)

    start = time.perf_counter()
    with ctx.bar(half_es, "train GRPO->ES (ES phase)") as bar:
        overrides = _train_overrides(ctx, "es", half_model, runs / "grpo_es")
        probes = train_in_segments(overrides, half_es, p.probe_every, probe, bar=bar)
        half_probe = (half_samples, dict(arms["grpo"]["probes"])[half_samples])
        arms["grpo_es"] = arm("grpo_es", probes, plan.es_samples_per_iteration, half_probe)
        arms["grpo_es"]["start_model"] = str(half_model)
    _stage(ctx, "train_grpo_es", start)
    return arms


def evaluate_models(ctx: Context, model_dirs: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Greedy accuracy, Pass@K, held-out accuracy, held-out perplexity and KL to the base, per model."""
    p = ctx.preset
    test = ctx.task.split("test")
    heldout = {name: get_task(name, seed=0).split("test")[: p.heldout_size] for name in HELD_OUT_TASKS}
    corpus = [(ex.prompt, ex.solution) for examples in heldout.values() for ex in examples]
    base, _ = ctx.load(model_dirs["base"])
    results: dict[str, dict[str, Any]] = {}
    with ctx.bar(len(model_dirs), "evaluate models") as bar:
        for name, model_dir in model_dirs.items():
            model, tokenizer = ctx.load(model_dir)
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
                task_name: greedy_correct(model, tokenizer, get_task(task_name, seed=0), examples, **kwargs)
                for task_name, examples in heldout.items()
            }
            heldout_prompts = [
                format_prompt(tokenizer, ex.prompt) for examples in heldout.values() for ex in examples
            ]
            results[name] = {
                "model_dir": ctx.show(model_dir),
                "greedy_accuracy": float(np.mean(correct)),
                "pass_at_k": {str(k): v for k, v in pass_at_k_curve(counts, p.passk_samples).items()},
                "heldout_accuracy": {task: float(np.mean(c)) for task, c in heldout_correct.items()},
                "heldout_perplexity": corpus_perplexity(model, tokenizer, corpus),
                "heldout_kl_to_base": sampled_kl(
                    model,
                    base,
                    tokenizer,
                    heldout_prompts,
                    samples=p.kl_samples,
                    max_new_tokens=p.max_new_tokens,
                    seed=p.seed + 13,
                ),
                "relative_update_norm": _relative_update_norm(base, model),
                # per prompt, for paired comparisons between models (same prompts, same order)
                "greedy_correct": correct,
                "correct_counts": counts,
                "heldout_correct": heldout_correct,
            }
            bar.update(1)
    return results


def _relative_update_norm(base: torch.nn.Module, model: torch.nn.Module) -> float:
    """||theta_model - theta_base|| / ||theta_base|| over all parameters (the total drift)."""
    before = dict(base.named_parameters())
    delta = sum(
        float((p.detach() - before[n].detach()).double().pow(2).sum()) for n, p in model.named_parameters()
    )
    norm = sum(float(p.detach().double().pow(2).sum()) for p in before.values())
    return math.sqrt(delta / norm)


def gain_retained_curves(ctx: Context, base_dir: str, trained_dir: str) -> dict[str, Any]:
    """Greedy accuracy of theta_0 + M * delta for the kept fractions and mask kinds, and the gain retained.

    Masks are over the tensors the training changed (the update's support by tensor: for ES the evolved
    linear weights), counted globally; theta_0 is the base and theta_1 the trained model.
    """
    p = ctx.preset
    examples = ctx.task.split("test")[: p.eval_size]
    kwargs = {"max_new_tokens": p.max_new_tokens, "rows_per_call": p.generation_batch}
    base, _ = ctx.load(base_dir)
    model, tokenizer = ctx.load(trained_dir)
    before = {n: t.detach().clone() for n, t in base.named_parameters()}
    after = {n: t.detach().clone() for n, t in model.named_parameters()}
    changed = [n for n in after if not torch.equal(after[n], before[n])]
    acc_base = float(np.mean(greedy_correct(base, tokenizer, ctx.task, examples, **kwargs)))
    acc_trained = float(np.mean(greedy_correct(model, tokenizer, ctx.task, examples, **kwargs)))
    accuracy: dict[str, dict[str, float]] = {kind: {} for kind in MASK_KINDS}
    fractions = sorted(p.keep_fractions)
    with ctx.bar(len(MASK_KINDS) * len(fractions), "gain retained") as bar:
        for kind in MASK_KINDS:
            for fraction in fractions:
                if fraction == 1.0 or not changed:  # keeps everything: the trained model itself
                    accuracy[kind][str(fraction)] = acc_trained
                else:
                    masked = topk_mask_state(
                        {n: before[n] for n in changed},
                        {n: after[n] for n in changed},
                        fraction,
                        kind=kind,
                        seed=p.seed,
                    )
                    with torch.no_grad():
                        for name, param in model.named_parameters():
                            if name in masked:
                                param.copy_(masked[name])
                    correct = greedy_correct(model, tokenizer, ctx.task, examples, **kwargs)
                    accuracy[kind][str(fraction)] = float(np.mean(correct))
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


def _small_model(ctx: Context) -> Path:
    """The built-in "small" model, pretrained once into the experiment directory and reused after."""
    from .pretrain import pretrain

    path = ctx.out_dir / "models" / "small"
    info = path / "pretrain.json"
    if info.is_file():
        saved = json.loads(info.read_text())
        if saved.get("steps") == ctx.preset.small_pretrain_steps and saved.get("seed") == ctx.preset.seed:
            return path
    pretrain(
        path, size="small", steps=ctx.preset.small_pretrain_steps, seed=ctx.preset.seed, progress=ctx.progress
    )
    return path


def population_sweep(ctx: Context, custom_model: bool) -> dict[str, Any]:
    """ES with N members for every N of the preset, each run given sweep_budget training completions.

    Sizes: the built-in tiny and small models, or the given model alone. Per (size, N): iterations,
    final greedy test accuracy and test reward (format_weight x format + answer), and the mean
    population reward over the last fifth of the iterations.
    """
    p = ctx.preset
    sizes = {"model": ctx.base_path} if custom_model else {}
    for size in () if custom_model else p.sweep_sizes:
        sizes[size] = tiny_model_path() if size == "tiny" else _small_model(ctx)
    format_weight = load_config().format_weight
    results: dict[str, Any] = {}
    with ctx.bar(len(sizes) * len(p.sweep_populations), "population sweep") as bar:
        for size, path in sizes.items():
            model, _ = ctx.load(path)
            results[size] = {"model_dir": ctx.show(path), "params": num_params(model), "runs": {}}
            for population in p.sweep_populations:
                iterations = sweep_iterations(p.sweep_budget, population, p.sweep_batch)
                run_dir = ctx.out_dir / "sweep" / size / f"N{population}"
                shutil.rmtree(run_dir, ignore_errors=True)
                overrides = {
                    **_train_overrides(ctx, "es", path, run_dir),
                    "batch_size": p.sweep_batch,
                    "es.population": population,
                    "es.iterations": iterations,
                    "eval_every": 0,
                    "checkpoint_every": 0,
                    "progress": ctx.progress,  # one run can take minutes: show its iterations
                }
                train(load_config(None, overrides))
                trained, tokenizer = ctx.load(run_dir / "final")
                correct = greedy_correct(
                    trained,
                    tokenizer,
                    ctx.task,
                    ctx.task.split("test")[: p.eval_size],
                    max_new_tokens=p.max_new_tokens,
                    rows_per_call=p.generation_batch,
                )
                metrics = _read_metrics(run_dir)
                steps = [m for m in metrics if "reward" in m]
                tail = steps[-max(1, len(steps) // 5) :]
                results[size]["base_accuracy"] = metrics[0]["test_accuracy"]
                results[size]["runs"][str(population)] = {
                    "iterations": iterations,
                    "samples": iterations * population * p.sweep_batch,
                    "test_accuracy": metrics[-1]["test_accuracy"],
                    "test_reward": format_weight * metrics[-1]["test_format"] + metrics[-1]["test_accuracy"],
                    "train_reward": float(np.mean([m["reward"] for m in tail])),
                    "greedy_correct": correct,  # per test prompt, for paired comparisons
                }
                bar.update(1)
    return results


def sweep_iterations(budget: int, population: int, batch: int) -> int:
    """ES iterations of `population` members on `batch` prompts that generate exactly `budget` completions."""
    if budget % (population * batch):
        raise ValueError(
            f"sweep budget {budget} is not a whole number of iterations of {population} members x "
            f"{batch} prompts"
        )
    return budget // (population * batch)


# --- collecting the numbers -------------------------------------------------------------------------


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


def _standard_error(p: float, n: int) -> float:
    """Standard error of an accuracy p measured on n independent problems."""
    return math.sqrt(max(p * (1 - p), 0.0) / n)


def paired_difference(a: list[float], b: list[float]) -> int:
    """+1 when a is clearly above b, -1 clearly below, 0 within noise, for per-problem scores of two
    models on the same problems: the mean difference must exceed two standard errors of the mean of the
    per-problem differences (a paired test, much tighter than comparing two independent accuracies)."""
    diff = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    if len(diff) == 0 or diff.mean() == 0:
        return 0
    se = diff.std(ddof=1) / math.sqrt(len(diff)) if len(diff) > 1 else math.inf
    if abs(diff.mean()) <= 2 * se:
        return 0
    return 1 if diff.mean() > 0 else -1


def _verdict(sign: int) -> str:
    return {1: "yes", 0: "within noise", -1: "no"}[sign]


def findings(metrics: dict[str, Any]) -> list[dict[str, str]]:
    """The seed paper's findings, each with what this run measured and a verdict: yes, no, within noise
    (the difference it needs is under two paired standard errors, see paired_difference) or not tested."""
    p = metrics["preset"]
    models, curves = metrics["models"], metrics["training"]
    n, top = p["passk_samples"], str(p["passk_samples"])
    pass1 = {name: models[name]["pass_at_k"]["1"] for name in MODELS}
    pass_n = {name: models[name]["pass_at_k"][top] for name in MODELS}

    def per_prompt(name: str, k: int) -> np.ndarray:
        return np.asarray(pass_at_k(n, models[name]["correct_counts"], k))

    def pass_diff(a: str, b: str, k: int) -> int:
        return paired_difference(per_prompt(a, k), per_prompt(b, k))

    out = []

    def add(claim: str, measured: str, verdict: str) -> None:
        out.append({"claim": claim, "measured": measured, "verdict": verdict})

    add(
        "ES raises Pass@1",
        f"Pass@1 (T=1) base {pass1['base']:.3f} -> ES {pass1['es']:.3f}; greedy accuracy "
        f"{models['base']['greedy_accuracy']:.3f} -> {models['es']['greedy_accuracy']:.3f}",
        _verdict(pass_diff("es", "base", 1)),
    )
    add(
        f"ES keeps a higher Pass@K than GRPO (K={top})",
        f"Pass@{top}: ES {pass_n['es']:.3f}, GRPO {pass_n['grpo']:.3f} (base {pass_n['base']:.3f}); "
        f"Pass@1: ES {pass1['es']:.3f}, GRPO {pass1['grpo']:.3f}",
        _verdict(pass_diff("es", "grpo", n)),
    )

    grpo_raises = pass_diff("grpo", "base", 1) > 0
    add(
        f"GRPO raises Pass@1 but narrows coverage: its Pass@{top} falls below the base's",
        f"GRPO Pass@1 {pass1['base']:.3f} -> {pass1['grpo']:.3f}, Pass@{top} {pass_n['base']:.3f} -> "
        f"{pass_n['grpo']:.3f}",
        _verdict(-pass_diff("grpo", "base", n)) if grpo_raises else "no (GRPO did not raise Pass@1)",
    )

    def entropy(arm: str, index: int) -> float:
        return curves[arm]["probe_entropy"][index][1]

    grpo_change = entropy("grpo", -1) / entropy("grpo", 0) - 1
    es_change = entropy("es", -1) / entropy("es", 0) - 1
    if grpo_change <= -0.25 and grpo_change < es_change - 0.10:
        entropy_verdict = "yes"
    elif grpo_change < es_change:
        entropy_verdict = "partly (GRPO's entropy fell more than ES's, but by less than a quarter)"
    else:
        entropy_verdict = "no"
    add(
        "GRPO's entropy collapses, ES's does not",
        f"entropy on own samples: GRPO {entropy('grpo', 0):.3f} -> {entropy('grpo', -1):.3f} nats "
        f"({grpo_change:+.0%}), ES {entropy('es', 0):.3f} -> {entropy('es', -1):.3f} ({es_change:+.0%})",
        entropy_verdict,
    )
    js = [value for _, value in curves["es"]["js_diversity"]]
    agree = [value for _, value in curves["es"]["members_agree"]]
    add(
        "The ES population is diverse in what it solves (verifier-projected JS diversity > 0)",
        f"mean JS / ln 2 over ES iterations {np.mean(js):.3f} (first {js[0]:.3f}, last {js[-1]:.3f}); "
        f"members agree on {np.mean(agree):.0%} of prompts",
        "yes" if np.mean(js) > 0 else "no",
    )
    keeps_pass1 = pass_diff("grpo_es", "grpo", 1) >= 0 and pass_diff("grpo_es", "base", 1) > 0
    add(
        "GRPO then ES combines both: GRPO's Pass@1 gain, and a higher Pass@K than GRPO",
        f"Pass@1: GRPO->ES {pass1['grpo_es']:.3f}, GRPO {pass1['grpo']:.3f}, base {pass1['base']:.3f}; "
        f"Pass@{top}: GRPO->ES {pass_n['grpo_es']:.3f}, GRPO {pass_n['grpo']:.3f}, ES {pass_n['es']:.3f}",
        _verdict(pass_diff("grpo_es", "grpo", n)) if keeps_pass1 else "no (Pass@1 gain not kept)",
    )
    gain = metrics["gain_retained"]
    es_gain = paired_difference(models["es"]["greedy_correct"], models["base"]["greedy_correct"])
    small = [f for f in gain["gain_retained"]["top"] if float(f) <= 0.1]
    claim = "ES's gain comes from a sparse subset of large updates"
    if es_gain <= 0:
        add(
            claim,
            f"ES greedy accuracy {gain['accuracy_base']:.3f} -> {gain['accuracy_trained']:.3f}: no clear "
            "gain to attribute, so gain retained is undefined or noise; "
            f"total drift ||delta||/||theta|| = {models['es']['relative_update_norm']:.2e}",
            "not tested",
        )
    elif not small:
        add(claim, "no kept fraction at or below 10% was evaluated", "not tested")
    else:
        best = max(small, key=lambda f: gain["gain_retained"]["top"][f])
        top_gain = gain["gain_retained"]["top"][best]
        random_gain = gain["gain_retained"]["random"][best]
        add(
            claim,
            f"keeping the top {float(best):.1%} of |delta| retains {top_gain:.0%} of the gain "
            f"(random mask {random_gain:.0%}, bottom-k {gain['gain_retained']['bottom'][best]:.0%}); "
            f"total drift ||delta||/||theta|| = {models['es']['relative_update_norm']:.2e}",
            "yes" if top_gain >= 0.5 and top_gain > random_gain else "no",
        )
    tasks = list(models["base"]["heldout_accuracy"])

    def heldout_drop(name: str) -> float:
        return float(
            np.mean(
                [models["base"]["heldout_accuracy"][t] - models[name]["heldout_accuracy"][t] for t in tasks]
            )
        )

    es_forgets = [
        paired_difference(models["es"]["heldout_correct"][t], models["base"]["heldout_correct"][t]) < 0
        for t in tasks
    ]
    forgetting_verdict = "no" if any(es_forgets) else "yes"
    if any(es_forgets) and heldout_drop("grpo") > heldout_drop("es"):
        forgetting_verdict += " (but ES forgot less than GRPO)"
    described = "; ".join(
        f"{t}: base {models['base']['heldout_accuracy'][t]:.3f}, "
        f"ES {models['es']['heldout_accuracy'][t]:.3f}, GRPO {models['grpo']['heldout_accuracy'][t]:.3f}"
        for t in tasks
    )
    add(
        "ES shows no necessary forgetting on held-out tasks",
        f"{described}; held-out perplexity base {models['base']['heldout_perplexity']:.3f}, "
        f"ES {models['es']['heldout_perplexity']:.3f}, GRPO {models['grpo']['heldout_perplexity']:.3f}",
        forgetting_verdict,
    )
    sweep = metrics["population_sweep"]
    claim = "Larger models need smaller populations"
    if len(sweep) < 2:
        add(claim, "only one model size in the sweep", "not tested")
    else:
        by_size = sorted(sweep.items(), key=lambda item: item[1]["params"])
        best_n, clear = {}, True
        for size, info in by_size:
            runs = {int(k): r for k, r in info["runs"].items()}
            ranked = sorted(runs, key=lambda k: -runs[k]["test_accuracy"])
            best_n[size] = ranked[0]
            # the best N must beat the runner-up on the same prompts, else the optimum is not known
            clear = (
                clear
                and paired_difference(runs[ranked[0]]["greedy_correct"], runs[ranked[1]]["greedy_correct"])
                > 0
            )
        smallest, largest = by_size[0][0], by_size[-1][0]
        if not clear:
            verdict = "within noise (some size's best N is not clearly better than its runner-up)"
        else:
            verdict = "yes" if best_n[largest] < best_n[smallest] else "no"
        add(
            claim,
            "test accuracy at equal budget: "
            + "; ".join(
                f"{size} ({info['params']:,} params, base {info['base_accuracy']:.3f}) "
                + ", ".join(f"N={n} {r['test_accuracy']:.3f}" for n, r in info["runs"].items())
                for size, info in by_size
            ),
            verdict,
        )
    return out


# --- plots and the report ---------------------------------------------------------------------------


def write_plots(metrics: dict[str, Any], out_dir: Path) -> dict[str, str]:
    """Every figure of the report, as PNGs in out_dir; returns {plot: file name}."""
    from .analysis import plots

    models, curves, p = metrics["models"], metrics["training"], metrics["preset"]

    def xy(points: list[list[float]]) -> tuple[list[float], list[float]]:
        return [pt[0] for pt in points], [pt[1] for pt in points]

    plots.plot_pass_at_k(
        {LABELS[n]: {int(k): v for k, v in models[n]["pass_at_k"].items()} for n in MODELS},
        out_dir / PLOTS["pass_at_k"],
        title=f"Pass@K on {p['passk_prompts']} test prompts ({p['passk_samples']} samples, T=1)",
    )
    plots.plot_metric_over_steps(
        {
            **{f"{LABELS[arm]} (own samples, probe)": xy(curves[arm]["probe_entropy"]) for arm in ARMS},
            "GRPO (logged, training batches)": xy(curves["grpo"]["logged_entropy"]),
        },
        out_dir / PLOTS["entropy"],
        metric="token entropy (nats)",
        title="Policy entropy during training",
        xlabel="training completions generated",
    )
    plots.plot_js_diversity(
        {
            "ES": xy(curves["es"]["js_diversity"]),
            "GRPO->ES (ES phase)": xy(curves["grpo_es"]["js_diversity"]),
        },
        out_dir / PLOTS["js_diversity"],
    )
    plots.plot_metric_over_steps(
        {LABELS[arm]: xy(curves[arm]["test_accuracy"]) for arm in ARMS},
        out_dir / PLOTS["accuracy"],
        metric="greedy test accuracy",
        title="Test accuracy during training",
        xlabel="training completions generated",
    )
    gain = metrics["gain_retained"]
    es_gained = paired_difference(models["es"]["greedy_correct"], models["base"]["greedy_correct"]) > 0
    plots.plot_gain_retained(
        {
            MASK_KINDS[kind]: {float(f): g for f, g in values.items()}
            for kind, values in gain["gain_retained"].items()
        },
        out_dir / PLOTS["gain_retained"],
        title="ES: gain retained by keeping part of the update"
        + ("" if es_gained else "\n(ES's own gain is within noise, so these ratios are noise)"),
    )
    labelled = {LABELS[n]: models[n] for n in MODELS}
    plots.plot_model_bars(
        {label: m["heldout_accuracy"] for label, m in labelled.items()},
        out_dir / PLOTS["heldout_accuracy"],
        title="Held-out tasks (never trained on): greedy accuracy",
    )
    plots.plot_model_bars(
        {label: {"held-out corpus": m["heldout_perplexity"]} for label, m in labelled.items()},
        out_dir / PLOTS["heldout_perplexity"],
        ylabel="perplexity",
        title="Perplexity of the held-out corpus",
    )
    plots.plot_model_bars(
        {label: {"held-out prompts": m["heldout_kl_to_base"]} for label, m in labelled.items()},
        out_dir / PLOTS["heldout_kl"],
        ylabel="token KL to the base (nats)",
        title="Token-level KL(model || base) on held-out prompts",
    )
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
            title=f"ES population size at {p['sweep_budget']:,} training completions",
        )
    return dict(PLOTS)


def _table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table; a "|" inside a cell (as in ||delta||) is escaped so it does not split the cell."""

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"

    return "\n".join([line(header), "|" + "|".join("---" for _ in header) + "|", *map(line, rows)])


def write_report(metrics: dict[str, Any], out_dir: Path) -> Path:
    """report.md: setup, budgets, results, every plot with what it shows, and the verdicts."""
    p, models, curves = metrics["preset"], metrics["models"], metrics["training"]
    top = str(p["passk_samples"])
    found = metrics["findings"]
    groups = {
        verdict: [f["claim"] for f in found if f["verdict"].split(" ")[0] == verdict]
        for verdict in ("yes", "partly", "no", "within", "not")
    }
    tested = len(found) - len(groups["not"])
    se_greedy = _standard_error(models["base"]["greedy_accuracy"], p["eval_size"])
    command = f"fastes experiment --preset {p['name']}" + (
        f" --model {metrics['model']}" if metrics["custom_model"] else ""
    )

    lines = [
        f"# ES vs GRPO at equal sample budgets ({p['name']} preset)",
        "",
        f"`{command}` -- model `{metrics['model']}` ({metrics['params']:,} parameters), task `{p['task']}`, "
        f"seed {p['seed']}, {metrics['timings']['total'] / 60:.1f} minutes on {metrics['device']}.",
        "",
        "## What the numbers say",
        "",
        f"This run reproduces **{len(groups['yes'])} of the {tested}** findings of the seed paper that it "
        f"could test. A difference between two models counts only when it exceeds two standard errors "
        "of the mean per-prompt difference on the same prompts (a paired test); for reference, one "
        f"standard error of a single accuracy near {models['base']['greedy_accuracy']:.2f} on "
        f"{p['eval_size']} prompts is {se_greedy:.3f}.",
        "",
        "What each arm did to the base model:",
        "",
        *_headline(metrics),
        "",
        "The paper's findings, one by one:",
        "",
        *(
            f"- **{title}:** {'; '.join(groups[key])}."
            for key, title in [
                ("yes", "Reproduced"),
                ("partly", "Partly reproduced"),
                ("no", "Not reproduced"),
                ("within", "Too close to call (within noise)"),
                ("not", "Not tested"),
            ]
            if groups[key]
        ),
        "",
        _table(
            ["paper's finding", "measured here", "reproduced?"],
            [[f["claim"], f["measured"], f["verdict"]] for f in found],
        ),
        "",
        "## Setup",
        "",
        f"- Base model: `{metrics['model']}`; every arm starts from it. Task `{p['task']}`: reward = 0.1 x "
        f"format + answer, greedy test accuracy on {p['eval_size']} test prompts.",
        f"- ES: population {p['population']} (antithetic), {p['es_batch']} prompts per iteration, sigma "
        f"{p['sigma']:g}, lr {p['es_lr']:g}, centered-rank shaping, greedy decoding.",
        f"- GRPO: {p['grpo_batch']} prompts x {p['num_generations']} generations per step, temperature 1, "
        f"lr {p['grpo_lr']:g} (AdamW), DAPO loss, no KL term.",
        f"- GRPO->ES: GRPO for half the GRPO budget (the GRPO arm's model at step "
        f"{curves['grpo_es']['grpo_steps']}), then ES for half the ES iterations.",
        f"- Evaluation: Pass@K from {p['passk_samples']} samples at T=1 on {p['passk_prompts']} test "
        f"prompts; entropy probe: {p['probe_samples']} samples of each of {p['probe_prompts']} test "
        f"prompts at every evaluation point; held-out tasks {', '.join(models['base']['heldout_accuracy'])} "
        f"({p['heldout_size']} test prompts each; perplexity of their solutions given the prompts, "
        f"KL on {p['kl_samples']} samples per prompt).",
        "",
        "## Sample budgets",
        "",
        "A training completion is one generated answer: ES generates population x prompts of them per "
        "iteration (every member answers every prompt), GRPO prompts x generations per step.",
        "",
        _table(
            ["arm", "GRPO steps", "ES iterations", "training completions", "training seconds"],
            [
                [
                    LABELS[arm],
                    str(curves[arm]["grpo_steps"]),
                    str(curves[arm]["es_iterations"]),
                    f"{curves[arm]['samples']:,}",
                    f"{curves[arm]['seconds']:.0f}" + (" (ES phase)" if arm == "grpo_es" else ""),
                ]
                for arm in ARMS
            ],
        ),
        "",
        "## Results",
        "",
        _table(
            [
                "model",
                "greedy acc",
                "Pass@1",
                f"Pass@{top}",
                *models["base"]["heldout_accuracy"],
                "held-out ppl",
                "KL to base",
                "||delta||/||theta||",
                "entropy",
            ],
            [
                [
                    LABELS[n],
                    f"{m['greedy_accuracy']:.3f}",
                    f"{m['pass_at_k']['1']:.3f}",
                    f"{m['pass_at_k'][top]:.3f}",
                    *(f"{v:.3f}" for v in m["heldout_accuracy"].values()),
                    f"{m['heldout_perplexity']:.3f}",
                    f"{m['heldout_kl_to_base']:.4f}",
                    f"{m['relative_update_norm']:.2e}",
                    f"{m['probe_entropy']:.3f}",
                ]
                for n, m in models.items()
            ],
        ),
        "",
        "Entropy: mean token entropy (nats) of the model on its own T=1 samples of the probe prompts.",
        "",
        "## Plots",
        "",
    ]
    for key, title, text in _plot_texts(metrics):
        lines += [f"### {title}", "", f"![{title}]({PLOTS[key]})", "", text, ""]
    if metrics["custom_model"]:
        about_models = (
            f"- One model (`{metrics['model']}`) with the {p['name']} preset's settings, which were tuned "
            "for the built-in tiny model, not for this one."
        )
    else:
        about_models = (
            "- The models are tiny character-level Llamas pretrained on the tasks themselves, not the "
            "0.5B-8B models of the paper; population sizes, sigma and budgets are scaled down to match."
        )
    tuning = (
        "- Both arms were tuned briefly on the tiny model at this budget, by final test accuracy: GRPO's "
        "lr over 1e-4, 3e-4, 1e-3 (3e-4 best, 0.355); ES's (sigma, lr) over four pairs around a "
        "30-iteration sweep's best (all within noise of the base, 0.225-0.275)."
        if p["name"] == "tiny"
        else "- The quick preset is a smoke test: its budgets are far too small for any finding."
    )
    lines += [
        "## Caveats",
        "",
        about_models,
        f"- One seed. Accuracies on {p['eval_size']} prompts move by a standard error of about "
        f"{se_greedy:.3f} from sampling the test set alone, so small differences between arms are not "
        "findings.",
        tuning,
        "",
    ]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines))
    return path


def _headline(metrics: dict[str, Any]) -> list[str]:
    """Plain sentences (markdown lines) on what each arm did to the base, from the paired comparisons."""
    p, models = metrics["preset"], metrics["models"]
    n, top = p["passk_samples"], str(p["passk_samples"])
    moved = {1: "raised", 0: "did not clearly change", -1: "lowered"}

    def pass_sign(name: str, k: int) -> int:
        a, b = (pass_at_k(n, models[m]["correct_counts"], k) for m in (name, "base"))
        return paired_difference(a, b)

    sentences = []
    for arm in ARMS:
        m, base = models[arm], models["base"]
        greedy = paired_difference(m["greedy_correct"], base["greedy_correct"])
        entropy_change = m["probe_entropy"] / base["probe_entropy"] - 1
        sentences.append(
            f"- {LABELS[arm]} {moved[greedy]} greedy accuracy ({base['greedy_accuracy']:.3f} -> "
            f"{m['greedy_accuracy']:.3f}), {moved[pass_sign(arm, 1)]} Pass@1 "
            f"({base['pass_at_k']['1']:.3f} -> {m['pass_at_k']['1']:.3f}) and "
            f"{moved[pass_sign(arm, n)]} Pass@{top} ({base['pass_at_k'][top]:.3f} -> "
            f"{m['pass_at_k'][top]:.3f}); its entropy changed by {entropy_change:+.0%} and its token KL "
            f"to the base on held-out prompts is {m['heldout_kl_to_base']:.3f} nats."
        )
    es, grpo = models["es"], models["grpo"]
    if paired_difference(es["greedy_correct"], models["base"]["greedy_correct"]) <= 0:
        text = (
            "\nES did not clearly improve the base at this budget, so the findings about where ES's gains "
            "come from cannot be tested here."
        )
        if pass_sign("es", n) <= 0 and es["pass_at_k"][top] > grpo["pass_at_k"][top]:
            if es["heldout_kl_to_base"] < grpo["heldout_kl_to_base"]:
                text += (
                    f" ES's Pass@{top} beats GRPO's by staying close to the base (KL "
                    f"{es['heldout_kl_to_base']:.3f} vs {grpo['heldout_kl_to_base']:.3f} nats), not by "
                    "widening coverage beyond it."
                )
        sentences.append(text)
    return sentences


def _plot_texts(metrics: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(plot key, title, one-paragraph reading of the plot from the numbers) for every figure."""
    p, models, curves = metrics["preset"], metrics["models"], metrics["training"]
    top = str(p["passk_samples"])
    best_pass_n = max(models[n]["pass_at_k"][top] for n in MODELS)
    leaders = " and ".join(LABELS[n] for n in MODELS if models[n]["pass_at_k"][top] == best_pass_n)
    gain = metrics["gain_retained"]
    js = [v for _, v in curves["es"]["js_diversity"]]
    sweep = metrics["population_sweep"]
    sweep_text = "; ".join(
        f"{size}: base {info['base_accuracy']:.3f}, "
        + ", ".join(
            f"N={n} -> {r['test_accuracy']:.3f} ({r['iterations']} iterations)"
            for n, r in info["runs"].items()
        )
        for size, info in sweep.items()
    )
    fractions = sorted(gain["accuracy"]["top"], key=float)
    gain_text = ", ".join(
        f"{float(f):.1%}: top {gain['accuracy']['top'][f]:.3f} / "
        f"random {gain['accuracy']['random'][f]:.3f} / bottom {gain['accuracy']['bottom'][f]:.3f}"
        for f in fractions
    )
    return [
        (
            "pass_at_k",
            "Pass@K",
            "Pass@1 -> Pass@"
            + top
            + ": "
            + "; ".join(
                f"{LABELS[n]} {models[n]['pass_at_k']['1']:.3f} -> {models[n]['pass_at_k'][top]:.3f}"
                for n in MODELS
            )
            + f". Highest Pass@{top}: {leaders}.",
        ),
        (
            "entropy",
            "Token entropy over training",
            "Each arm's entropy on its own samples of the same probe prompts, against training "
            "completions generated; the GRPO (logged) line is the entropy GRPO logs on its training "
            "batches. Final probe entropy: "
            + ", ".join(f"{LABELS[a]} {curves[a]['probe_entropy'][-1][1]:.3f}" for a in ARMS)
            + f" (base {curves['es']['probe_entropy'][0][1]:.3f}).",
        ),
        (
            "js_diversity",
            "JS diversity of the ES population",
            f"Verifier-projected JS diversity of the population's greedy outcomes on each iteration's batch, "
            f"divided by ln 2: mean {np.mean(js):.3f} for the ES arm"
            + (
                f", {np.mean([v for _, v in curves['grpo_es']['js_diversity']]):.3f} for the ES phase "
                "of GRPO->ES."
                if curves["grpo_es"]["js_diversity"]
                else "."
            ),
        ),
        (
            "accuracy",
            "Test accuracy over training",
            "Greedy test accuracy at every evaluation point: "
            + "; ".join(
                f"{LABELS[a]} {curves[a]['test_accuracy'][0][1]:.3f} -> "
                f"{curves[a]['test_accuracy'][-1][1]:.3f}"
                for a in ARMS
            )
            + ".",
        ),
        (
            "gain_retained",
            "Gain retained by sparse ES updates",
            f"theta_0 + M * delta for the ES model (delta = ES - base over the {gain['changed_elements']:,} "
            f"elements ES changed; M keeps a share of them). Base accuracy {gain['accuracy_base']:.3f}, ES "
            f"{gain['accuracy_trained']:.3f}; accuracies by kept share: {gain_text}."
            + (
                ""
                if paired_difference(models["es"]["greedy_correct"], models["base"]["greedy_correct"]) > 0
                else " ES's own gain is not clearly above zero here, so the gain-retained ratios divide "
                "noise by noise (undefined when ES gained exactly nothing); read the accuracies instead."
            ),
        ),
        (
            "heldout_accuracy",
            "Held-out accuracy",
            "Greedy accuracy on tasks no arm trained on: "
            + "; ".join(
                f"{LABELS[n]} " + ", ".join(f"{t} {v:.3f}" for t, v in models[n]["heldout_accuracy"].items())
                for n in MODELS
            )
            + ".",
        ),
        (
            "heldout_perplexity",
            "Held-out perplexity",
            "Perplexity of the fixed held-out corpus (the reference solutions given their prompts): "
            + ", ".join(f"{LABELS[n]} {models[n]['heldout_perplexity']:.3f}" for n in MODELS)
            + ".",
        ),
        (
            "heldout_kl",
            "Token KL to the base on held-out prompts",
            "Mean KL(model || base) per token of the model's own samples on held-out prompts: "
            + ", ".join(f"{LABELS[n]} {models[n]['heldout_kl_to_base']:.4f}" for n in MODELS)
            + ".",
        ),
        (
            "sweep_accuracy",
            "Population-size sweep: accuracy",
            f"ES with N members at a fixed budget of {p['sweep_budget']:,} training completions (smaller N "
            f"gets more iterations): {sweep_text}.",
        ),
        (
            "sweep_reward",
            "Population-size sweep: reward",
            "Final greedy test reward (0.1 x format + answer) per N: "
            + "; ".join(
                f"{size}: " + ", ".join(f"N={n} -> {r['test_reward']:.3f}" for n, r in info["runs"].items())
                for size, info in sweep.items()
            )
            + ".",
        ),
    ]


def _json_text(value: Any) -> str:
    """Indented JSON with every list of plain numbers on one line (per-prompt results stay short)."""
    text = json.dumps(value, indent=2)
    numbers = re.compile(r"\[\s+([-+0-9.eE,\s]+?)\s+\]")
    return numbers.sub(lambda match: "[" + " ".join(match.group(1).split()) + "]", text) + "\n"


# --- the whole run ----------------------------------------------------------------------------------


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


def run_experiment(
    preset: str | Preset = "tiny",
    out_dir: str | Path = "runs/experiment",
    model: str | Path | None = None,
    progress: bool = True,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Train the three arms, measure the four models, write metrics.json, the plots and report.md.

    `preset` is a name in PRESETS or a Preset; `model` a local HF model directory (default: the built-in
    tiny model). Returns the metrics (also in out_dir/metrics.json). An out_dir that already holds
    anything is refused unless `overwrite` (the experiment replaces its runs/, sweep/ and models/).
    """
    if isinstance(preset, str):
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
        preset = PRESETS[preset]
    plan = plan_budget(
        preset.es_iterations, preset.population, preset.es_batch, preset.grpo_batch, preset.num_generations
    )
    for population in preset.sweep_populations:  # fail now, not after an hour of training
        sweep_iterations(preset.sweep_budget, population, preset.sweep_batch)
    if model is not None and not Path(model).is_dir():
        raise ConfigError(f"model: model directory {str(model)!r} does not exist")
    started = time.perf_counter()
    out = Path(out_dir)
    _check_out(out, overwrite)
    out.mkdir(parents=True, exist_ok=True)
    base_path = Path(model) if model else tiny_model_path()
    device = preset.device if preset.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    ctx = Context(preset, out, base_path, device, get_task(preset.task, seed=0), plan, progress, {})
    base_model, _ = ctx.load(base_path)
    params = num_params(base_model)
    if params < 5_000_000:  # as train(): a tiny model's matmuls only lose from sharing threads
        torch.set_num_threads(1)

    arms = train_arms(ctx)
    start = time.perf_counter()
    models = evaluate_models(ctx, {"base": str(base_path), **{arm: arms[arm]["model_dir"] for arm in ARMS}})
    _stage(ctx, "evaluate", start)
    start = time.perf_counter()
    gain = gain_retained_curves(ctx, str(base_path), arms["es"]["model_dir"])
    _stage(ctx, "gain_retained", start)
    start = time.perf_counter()
    sweep = population_sweep(ctx, custom_model=model is not None)
    _stage(ctx, "population_sweep", start)

    curves = training_curves(arms, plan)
    models["base"]["probe_entropy"] = curves["es"]["probe_entropy"][0][1]
    for arm in ARMS:
        models[arm]["probe_entropy"] = curves[arm]["probe_entropy"][-1][1]
    metrics: dict[str, Any] = {
        "preset": asdict(preset),
        "model": ctx.show(base_path),
        "custom_model": model is not None,
        "params": params,
        "device": device,
        "budget": {
            "samples_per_arm": plan.total_samples,
            "es_samples_per_iteration": plan.es_samples_per_iteration,
            "grpo_samples_per_step": plan.grpo_samples_per_step,
            "arms": {
                arm: dict(zip(("grpo_steps", "es_iterations"), lengths))
                for arm, lengths in plan.arm_lengths().items()
            },
        },
        "models": models,
        "training": curves,
        "gain_retained": gain,
        "population_sweep": sweep,
        "timings": ctx.timings,
    }
    metrics["findings"] = findings(metrics)
    metrics["plots"] = write_plots(metrics, out)
    ctx.timings["total"] = round(time.perf_counter() - started, 1)
    (out / "metrics.json").write_text(_json_text(metrics))
    write_report(metrics, out)
    return metrics


__all__ = [
    "PRESETS",
    "BudgetPlan",
    "Preset",
    "completion_entropy",
    "corpus_perplexity",
    "correct_counts",
    "findings",
    "greedy_correct",
    "paired_difference",
    "plan_budget",
    "run_experiment",
    "sampled_entropy",
    "sampled_kl",
    "segment_ends",
    "sweep_iterations",
    "train_arms",
]
