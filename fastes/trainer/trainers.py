"""ESTrainer and GRPOTrainer: the shape of TRL's GRPOTrainer, over the loop of `fastes train`.

    trainer = ESTrainer(
        model="path/to/model",           # a model directory, or a loaded transformers model
        reward_funcs=[correct, short],   # TRL's signature: f(completions, **columns) -> list[float]
        args=ESConfig(output_dir="runs/es", max_steps=30, reward_weights=[1.0, 0.1]),
        train_dataset=train_rows,        # a datasets.Dataset or a list of dicts with a "prompt"
        eval_dataset=test_rows,
    )
    trainer.train()                      # or train(resume_from_checkpoint=True)
    trainer.evaluate()                   # {"eval_reward": ..., "eval_rewards/correct/mean": ...}

One implementation, two faces: the config is mapped onto a TrainConfig (fastes.run.config) and training is
fastes.run.train.train, the loop of `fastes train`, so the run directory, checkpoints, exact resume and the
one-line errors are the command's. The ESConfig and GRPOConfig here are the public, TRL-named configs;
fastes.run.config.ESSettings and fastes.run.config.GRPOSettings are the [es] and [grpo] sections of a
TrainConfig.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import time
from pathlib import Path
from typing import Any, ClassVar

import torch
from transformers.trainer_callback import TrainerState
from transformers.trainer_utils import TrainOutput

from fastes import distributed
from fastes.analysis.passk import pass_at_k_curve
from fastes.errors import ConfigError, NonFiniteUpdateError
from fastes.models import adapters
from fastes.models.loading import load_model, save_model
from fastes.models.sources import resolve_model
from fastes.run import auto_settings, grpo_loop
from fastes.run.callbacks import Callbacks
from fastes.run.config import TrainConfig, load_config
from fastes.run.evaluation import Evaluator
from fastes.run.rundir import RUN_FILE
from fastes.run.shared import Run
from fastes.run.train import train as train_loop
from fastes.tasks import DatasetTask, Example, Score
from fastes.tasks.dataset import dataset_rows

from .configs import ESConfig, GRPOConfig, _TrainerConfig

__all__ = ["ESConfig", "ESTrainer", "GRPOConfig", "GRPOTrainer"]

logger = logging.getLogger(__name__)
EVAL_LOSS_SEED = 104_729  # keeps the eval groups' sampling apart from the training steps' at a step


class ESTrainer:
    """Post-train a model with ES on rows of prompts scored by reward functions (TRL's GRPOTrainer shape).

    model: a model directory (str or Path), or a loaded transformers causal LM (then processing_class
    is its tokenizer, and it is trained in place). reward_funcs: one callable or a list of them, each
    f(completions, prompts=..., **columns) -> list[float | None]. peft_config: a peft.PeftConfig (e.g.
    peft.LoraConfig(target_modules=[...])): train a new adapter instead of the model's weights; a
    peft.PeftModel as `model` trains its own adapter. Every check runs here, before any work.
    After construction, as in TRL: `model` and `processing_class` are loaded, `train_dataset`,
    `eval_dataset` are what was passed, `ref_model` is the frozen starting model of GRPO's KL term (None
    without one, and with an adapter, whose reference is the model with the adapter off), `state` is a
    transformers.TrainerState that follows the run.
    """

    config_class: ClassVar[type[_TrainerConfig]] = ESConfig

    def __init__(
        self,
        model: str | Path | torch.nn.Module,
        reward_funcs: Any = None,
        args: _TrainerConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        reward_processing_classes: Any = None,
        callbacks: list[Any] | None = None,
        optimizers: tuple[Any, Any] = (None, None),
        peft_config: Any = None,
    ) -> None:
        self.args = self.config_class() if args is None else args
        if not isinstance(self.args, self.config_class):
            module = type(self.args).__module__
            module = "fastes" if module.startswith("fastes.") else module
            raise ConfigError(
                f"args: {type(self).__name__} takes a fastes.{self.config_class.__name__}, got "
                f"{module}.{type(self.args).__name__}; build one with the same fields"
            )
        self.args.check()
        if optimizers != (None, None):
            raise ConfigError(
                "optimizers: fastes builds the optimizer from the config (learning_rate, weight_decay, "
                "adam_*); pass optimizers=(None, None)"
            )
        if reward_funcs is None:
            raise ConfigError(
                "reward_funcs: No reward source provided; give reward functions or a reward model"
            )
        if train_dataset is None:
            raise ConfigError(
                "`train_dataset` is required: rows with a 'prompt' column (a Dataset or a list)"
            )
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.task = DatasetTask(
            _materialised(train_dataset),
            reward_funcs,
            reward_weights=self.args.reward_weights,
            eval_dataset=_joined(eval_dataset),
            timeout=self.args.reward_timeout,
            reward_processing_classes=reward_processing_classes,
        )
        # TRL's trainer.reward_funcs: the callables and reward models as given.
        self.reward_funcs = [getattr(f, "function", None) or f.model for f in self.task.functions]
        self.state = TrainerState()
        self.task.trainer_state = self.state  # what reward functions get as trainer_state
        self.callbacks = Callbacks(callbacks, args=self.args, max_steps=self.args.max_steps).callbacks
        self.processing_class = processing_class
        # TRL's trainer.reward_processing_classes: each reward model's tokenizer, None for a function.
        self.reward_processing_classes = [getattr(f, "tokenizer", None) for f in self.task.functions]
        if peft_config is not None:  # a new adapter (docs/trainer.md, peft_config); errors before any work
            adapters.check_peft_config(peft_config, model)
        self.peft_config = peft_config
        overrides = self.args.overrides(len(self.task.split("train")))
        if isinstance(model, (str, Path)):
            self.model_path: str | None = str(model)
            self.model = None  # loaded below, once the config is checked
            overrides["model"] = self.model_path
        elif isinstance(model, torch.nn.Module):
            self.processing_class = processing_class or _saved_tokenizer(model)
            if self.processing_class is None:
                raise ConfigError("processing_class: a loaded model needs its tokenizer; pass it here")
            self.model_path = None
            self.model = model
            overrides["device"] = str(next(model.parameters()).device)
            overrides["dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
        else:
            raise ConfigError(
                f"model: expected a model directory, a .gguf file, a shipped model's name or a loaded "
                "transformers model, "
                f"got {type(model).__name__}"
            )
        overrides["eval_size"] = max(1, len(self.task.split("test")))
        try:
            self.config = load_config(None, overrides)
        except ConfigError as error:  # name the field the user set, not the TrainConfig key it maps to
            key, sep, rest = str(error).partition(":")
            key, space, words = key.partition(" ")
            raise ConfigError(f"{self.args.public_name(key)}{space}{words}{sep}{rest}") from None
        if self.model is not None and peft_config is not None:  # a model object: wrapped here, as TRL does
            self.model = adapters.wrap(self.model, peft_config, self.config.seed)
        g = self.config.grpo
        summed = ("bnpo", "dr_grpo", "dapo", "cispo")
        if (
            self.config.algorithm == "grpo"
            and g.importance_sampling_level == "sequence"
            and g.loss_type in summed
        ):
            logger.warning(
                f"importance_sampling_level='sequence' with loss_type={g.loss_type!r}: that loss sums "
                "per-token terms, which weights each sequence by its completion length; 'grpo' averages each"
            )
        self.state.max_steps = self._steps()
        self._loaded()  # a path: the model and tokenizer, as in TRL
        self.aux_loss_enabled = bool(getattr(self.model.config, "output_router_logits", False))
        beta = getattr(self.args, "beta", 0.0)
        copied = beta and not adapters.is_peft_model(self.model)
        self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False) if copied else None
        self.summary: dict[str, Any] = {}

    def _steps(self) -> int:
        return self.config.es.iterations if self.config.algorithm == "es" else self.config.grpo.steps

    def train(self, resume_from_checkpoint: bool | None = None) -> TrainOutput:
        """Train; with resume_from_checkpoint=True, continue the run in output_dir from its newest
        checkpoint, exactly. Returns TRL's TrainOutput(global_step, training_loss, metrics); the run's
        own summary (fastes.run.train.train) is `trainer.summary`."""
        if not isinstance(resume_from_checkpoint, (bool, type(None))):
            raise ConfigError(
                f"resume_from_checkpoint: {resume_from_checkpoint!r}; fastes resumes the run in output_dir "
                "from its newest checkpoint: pass True"
            )
        self.args.check()  # fields set since construction (overwrite_output_dir = "no")
        start = time.perf_counter()
        try:
            self.summary = train_loop(
                self.config,
                resume=bool(resume_from_checkpoint),
                overwrite=self.args.overwrite_output_dir,
                model=None if self.model_path else self.model,
                tokenizer=self.processing_class,
                task=self.task,
                callbacks=[*self.callbacks, _StateKeeper(self)],
                peft_config=self.peft_config if self.model_path else None,  # a model object is wrapped
            )
        except NonFiniteUpdateError as error:  # name this config's fields
            raise error.renamed(self.args.public_name) from None
        if self.model_path:  # the trained weights are in final/, written by the loop
            self.model, self.processing_class = load_model(
                Path(self.config.out_dir) / "final", dtype=self.config.dtype, device=self.config.device
            )
        records = [json.loads(line) for line in (Path(self.config.out_dir) / "metrics.jsonl").open()]
        self.state.log_history = [entry for record in records for entry in self._history(record)]
        self.state.global_step = self.summary["steps"]
        metrics = self._final_metrics(records, time.perf_counter() - start)
        last = next((e for e in reversed(self.state.log_history) if "reward" in e), {})
        # TRL's last record also carries the step metrics logged since the one before (logging_steps).
        pending = {k: v for k, v in last.items() if k not in ("step", "epoch")}
        step = self.state.global_step
        self.state.log_history.append({**pending, **metrics, "epoch": self._epoch(step), "step": step})
        return TrainOutput(self.state.global_step, metrics["train_loss"], metrics)

    def _epoch(self, step: int) -> float:
        """Passes over the training rows after `step` steps (prompts are drawn at random each step)."""
        return step * self.config.batch_size / len(self.task.split("train"))

    def _history(self, record: dict[str, Any]) -> list[dict[str, Any]]:
        """A metrics.jsonl record as TRL's log_history has it: the step's metrics, and an evaluation's
        eval_-prefixed, each with its "step" and "epoch"."""
        step = record["global_step"]
        where = {"epoch": self._epoch(step), "step": step}
        evaluation = {
            f"eval_{k.removeprefix('test_')}": v for k, v in record.items() if k.startswith("test_")
        }
        training = {k: v for k, v in record.items() if not k.startswith("test_") and k != "global_step"}
        entries = [{**training, **where}] if "reward" in record else []
        return entries + ([{**evaluation, **where}] if evaluation else [])

    def _final_metrics(self, records: list[dict[str, Any]], seconds: float) -> dict[str, float]:
        """TRL's end-of-training record. train_loss: GRPO's mean step loss; ES minimises no loss, so
        there it is minus the mean reward over the steps (the objective ES descends)."""
        steps = [r for r in records if "reward" in r]
        losses = [r["loss"] for r in steps if "loss" in r] or [-r["reward"] for r in steps]
        done = self.state.global_step
        return {
            "train_runtime": seconds,
            "train_samples_per_second": done * self.config.batch_size / seconds,
            "train_steps_per_second": done / seconds,
            "train_loss": _mean(losses),
        }

    def _loaded(self) -> tuple[torch.nn.Module, Any, TrainConfig]:
        """The model and tokenizer, loaded when first needed, and the config with its automatic settings
        chosen for them as the run chooses them (fastes.run.auto_settings); self.config keeps "auto", so that
        the run and its resume choose alike."""
        if self.model is None:
            self.model, tokenizer = load_model(
                resolve_model(self.model_path), dtype=self.config.dtype, device=self.config.device
            )
            self.model = adapters.prepare(self.model, self.peft_config, self.config.seed)  # as the run starts
            self.processing_class = self.processing_class or tokenizer
        resolved = auto_settings.resolve(self.config, self.model, self.processing_class)
        return self.model, self.processing_class, resolved

    @torch.no_grad()
    def evaluate(
        self,
        eval_dataset: Any = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
        *,
        num_samples: int = 1,
        temperature: float = 1.0,
    ) -> dict[str, float]:
        """Greedy completions of the eval rows scored by the reward functions: `<prefix>_reward` (the
        weighted sum), and per function `<prefix>_rewards/<name>/mean`, `/accuracy` where its values are
        all 0 or 1, and with num_samples = n > 1 sampled completions, `/pass@k` for k = 1, 2, 4 .. n.
        A dict of datasets (as TRL takes) is evaluated one by one, `<prefix>_<name>_...` each.
        `ignore_keys` is TRL's argument for model outputs; fastes reads none."""
        data = self.eval_dataset if eval_dataset is None else eval_dataset
        if data is None:
            raise ConfigError("evaluate: no eval_dataset; pass one here or to the trainer")
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise ConfigError(f"num_samples: must be a whole number >= 1, got {num_samples!r}")
        if num_samples > 1 and not temperature > 0:
            raise ConfigError(f"temperature: sampling for Pass@K needs temperature > 0, got {temperature}")
        if _is_dict(data):
            metrics: dict[str, float] = {}
            for name, part in data.items():
                metrics.update(self._evaluate(part, f"{metric_key_prefix}_{name}", num_samples, temperature))
            return metrics
        return self._evaluate(data, metric_key_prefix, num_samples, temperature)

    def _evaluate(self, data: Any, prefix: str, num_samples: int, temperature: float) -> dict[str, float]:
        if data is self.eval_dataset:
            task, examples = self.task, self.task.split("test")
        else:
            rows = dataset_rows(_materialised(data), "eval_dataset")  # its own name in errors
            task = DatasetTask(rows, self.task.functions, reward_weights=self.task.weights)
            examples = task.split("train")
        model, tokenizer, cfg = self._loaded()
        greedy = self._scores(cfg, model, tokenizer, task, examples, 1, 0.0)
        metrics = {f"{prefix}_reward": _mean([s.answer for s in greedy])}
        for name in greedy[0].rewards:
            values = [s.rewards[name] for s in greedy]
            metrics[f"{prefix}_rewards/{name}/mean"] = _mean(values)
            if _binary(values):
                metrics[f"{prefix}_rewards/{name}/accuracy"] = _mean(values)
        if num_samples > 1:
            sampled = self._scores(cfg, model, tokenizer, task, examples, num_samples, temperature)
            for name in sampled[0].rewards:
                values = [s.rewards[name] for s in sampled]
                if not _binary(values):  # Pass@K counts correct samples: defined for 0/1 rewards only
                    continue
                per_prompt = [values[i : i + num_samples] for i in range(0, len(values), num_samples)]
                curve = pass_at_k_curve([int(sum(v)) for v in per_prompt], num_samples)
                metrics.update({f"{prefix}_rewards/{name}/pass@{k}": p for k, p in curve.items()})
        if cfg.algorithm == "grpo":  # TRL's eval_loss: GRPO's loss on sampled groups, nothing trained
            run = Run(cfg, model, tokenizer, task, Path(cfg.out_dir))
            seed = cfg.seed * 1_000_003 + self.state.global_step + EVAL_LOSS_SEED
            metrics[f"{prefix}_loss"] = grpo_loop.eval_loss(run, examples, self.ref_model, seed=seed)
        else:  # ES minimises no loss: minus the reward, as its train_loss
            metrics[f"{prefix}_loss"] = -metrics[f"{prefix}_reward"]
        metrics[f"{prefix}_samples"] = len(examples)
        step = self.state.global_step
        self.state.log_history.append({**metrics, "epoch": self._epoch(step), "step": step})
        if distributed.is_writer():
            loop_names = {k.replace(f"{prefix}_", "test_", 1): v for k, v in metrics.items()}
            Callbacks(self.callbacks).fire("on_evaluate", step, loop_names)
        return metrics

    def _scores(
        self,
        cfg: TrainConfig,
        model: Any,
        tokenizer: Any,
        task: DatasetTask,
        examples: list[Example],
        n: int,
        temperature: float,
    ) -> list[Score]:
        """Scores of n completions per example (row i * n + j: sample j of example i)."""
        evaluator = Evaluator(cfg, model, tokenizer)
        seed = cfg.seed if n > 1 else None
        return evaluator.scores(task, examples, samples=n, temperature=temperature, seed=seed)

    def save_model(self, output_dir: str | Path | None = None) -> Path:
        """Write the current model and tokenizer as a Hugging Face directory: output_dir, by default the
        run's final/ (the run directory itself holds the run's own config.json, so it cannot take one)."""
        out = Path(self.config.out_dir)
        target = Path(output_dir) if output_dir is not None else out / "final"
        self._check_save_target(target)
        model, tokenizer, _ = self._loaded()
        try:
            path = save_model(model, tokenizer, target)
        except OSError as error:  # under a file, read-only, full disk
            raise ConfigError(
                f"save_model: cannot write {str(target)!r} ({type(error).__name__}: "
                f"{error.strerror or error}); choose a writable directory"
            ) from None
        if distributed.is_writer():
            Callbacks(self.callbacks).fire("on_save", self.state.global_step, path)
        return path

    def _check_save_target(self, target: Path) -> None:
        """What save_model must never write into (symlinks resolved): the run directory, its checkpoints,
        another run's directory, and the model the run starts from (a resume needs it unchanged)."""
        out = Path(self.config.out_dir).resolve()
        resolved = target.resolve()
        protected = {out: "the run directory", out / "checkpoints": "the run's checkpoints"}
        if self.model_path:
            protected[resolve_model(self.model_path).resolve()] = "the model this run starts from"
        for path, what in protected.items():
            if resolved == path or path.name == "checkpoints" and path in resolved.parents:
                raise ConfigError(
                    f"save_model: {str(target)!r} is {what}; saving there would overwrite it. Save to the "
                    "run's final/ (the default) or a new directory"
                )
        if (resolved / RUN_FILE).is_file():
            raise ConfigError(
                f"save_model: {str(target)!r} holds a fastes run ({RUN_FILE}); saving there would mix a "
                "model into it. Save to a new directory"
            )


class GRPOTrainer(ESTrainer):
    """The same, with the GRPO loop of `fastes train --algorithm grpo` and a GRPOConfig."""

    config_class: ClassVar[type[_TrainerConfig]] = GRPOConfig


def _mean(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]  # a function's None: not applicable here
    return math.fsum(finite) / len(finite) if finite else math.nan


def _binary(values: list[float]) -> bool:
    finite = [v for v in values if math.isfinite(v)]
    return bool(finite) and all(v in (0.0, 1.0) for v in finite)


class _StateKeeper:
    """Keeps trainer.state current while the loop runs (reward functions get it as trainer_state)."""

    def __init__(self, trainer: ESTrainer) -> None:
        self.trainer = trainer

    def on_train_begin(self, global_step: int) -> None:
        self.trainer.state.global_step = global_step

    def on_step_end(self, global_step: int, metrics: dict[str, Any]) -> None:
        state = self.trainer.state
        state.global_step = global_step
        state.epoch = self.trainer._epoch(global_step)
        state.log_history.extend(self.trainer._history({**metrics, "global_step": global_step}))

    def on_evaluate(self, global_step: int, metrics: dict[str, Any]) -> None:
        self.trainer.state.log_history.extend(self.trainer._history({**metrics, "global_step": global_step}))


def _saved_tokenizer(model: torch.nn.Module) -> Any:
    """A loaded model's tokenizer from the directory it was loaded from, as TRL finds it; None if none."""
    source = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    if not source or not Path(source).is_dir():
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError):
        return None


def _is_dict(data: Any) -> bool:
    return isinstance(data, dict) or type(data).__name__ in ("DatasetDict", "IterableDatasetDict")


def _materialised(data: Any) -> Any:
    """A streamed datasets.IterableDataset as its rows (TRL takes one; fastes draws prompts at random, so
    it reads them all: a local, finite stream)."""
    return list(data) if type(data).__name__ == "IterableDataset" else data


def _joined(eval_dataset: Any) -> Any:
    """Several eval datasets (a dict of them, as TRL takes) as one for the run's evaluations; evaluate()
    reports each under its own name."""
    if _is_dict(eval_dataset):
        parts = [dataset_rows(_materialised(part), "eval_dataset") for part in eval_dataset.values()]
        return [row for part in parts for row in part]
    return _materialised(eval_dataset)
