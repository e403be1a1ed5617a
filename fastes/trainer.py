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

One implementation, two faces: the config is mapped onto a TrainConfig (fastes.config) and training is
fastes.train.train, the loop of `fastes train`, so the run directory, checkpoints, exact resume and the
one-line errors are the command's. The ESConfig and GRPOConfig here are the public, TRL-named configs;
fastes.config.ESConfig and fastes.config.GRPOConfig are the [es] and [grpo] sections of a TrainConfig.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

import torch

from . import adapters, defaults, distributed
from .analysis.passk import pass_at_k_curve
from .callbacks import Callbacks
from .config import REPORT_TO, ConfigError, TrainConfig, load_config
from .errors import NonFiniteUpdateError
from .evaluation import Evaluator
from .model_sources import resolve_model
from .models import load_model, save_model
from .rundir import RUN_FILE
from .tasks import DatasetTask, Example, Score
from .tasks.dataset import dataset_rows
from .train import train as train_loop

_ITS_DEFAULT = object()


def _sets(key: str, default: Any = _ITS_DEFAULT) -> Any:
    """A field that sets TrainConfig key `key` ("es.sigma") one-to-one, by default starting from that
    key's own default, so that both faces start from the same settings."""
    if default is _ITS_DEFAULT:
        default = TrainConfig()
        for part in key.split("."):
            default = getattr(default, part)
    return field(default=default, metadata={"sets": key})


@dataclass
class _TrainerConfig:
    """The settings ESConfig and GRPOConfig share, with TRL's names (docs/trainer.md lists them all)."""

    output_dir: str = _sets("out_dir", "trainer_output")  # TRL's default; the run directory
    max_steps: int = 0  # each subclass sets its own default
    learning_rate: float = 0.0
    per_device_train_batch_size: int = 0
    max_completion_length: int = _sets("max_new_tokens")
    reward_weights: list[float] | None = None  # one per reward function; None = 1 each
    logging_steps: int = _sets("logging_steps")  # TensorBoard gets every this many steps
    save_steps: int = _sets("checkpoint_every")  # checkpoint every this many steps (0: never)
    # evaluate eval_dataset every this many steps; 0: before and after training
    eval_steps: int = _sets("eval_every", 0)
    seed: int = _sets("seed")
    report_to: str | list[str] = "none"  # "tensorboard" or "none"
    disable_tqdm: bool = False
    use_cpu: bool = False  # else CUDA when torch sees a device
    overwrite_output_dir: bool = False  # replace a previous run in output_dir
    # fastes only:
    dtype: str = _sets("dtype")  # weights' dtype when the model is loaded from a path
    backend: str = _sets("backend")
    threads: int = _sets("threads")
    reward_timeout: float = _sets("reward_timeout")  # seconds one reward function call may take

    # TrainConfig keys set in overrides() from a field of another meaning, named in error messages.
    SPECIAL: ClassVar[dict[str, str]] = {"progress": "disable_tqdm", "device": "use_cpu"}
    ALGORITHM: ClassVar[str] = ""

    def __post_init__(self) -> None:
        self.check_types()

    def check_types(self) -> None:
        """Every field holds a value of its annotated type (a bool a bool: "no" is truthy and would
        overwrite a run). Run at construction and again when the config is used, since fields can be set
        afterwards."""
        for f in fields(self):
            value, kinds = getattr(self, f.name), _FIELD_TYPES[f.type]
            if not any(_is(value, kind) for kind in kinds):
                wanted = " or ".join(_TYPE_WORDS[kind] for kind in kinds)
                raise ConfigError(f"{f.name}: must be {wanted}, got {type(value).__name__} {value!r}")

    @classmethod
    def keys(cls) -> dict[str, str]:
        """{field: TrainConfig key} of the fields that set one key one-to-one (the others: overrides())."""
        return {f.name: f.metadata["sets"] for f in fields(cls) if "sets" in f.metadata}

    def overrides(self) -> dict[str, Any]:
        """The TrainConfig keys this config sets (fastes.config.load_config's overrides)."""
        values = {key: getattr(self, name) for name, key in self.keys().items()}
        device = "cuda" if torch.cuda.is_available() and not self.use_cpu else "cpu"
        values.update(
            algorithm=self.ALGORITHM,
            task="dataset",
            report_to=_report_to(self.report_to),
            progress=not self.disable_tqdm,
            device=device,
        )
        return values

    @classmethod
    def public_name(cls, key: str) -> str:
        """The field that sets TrainConfig key `key`, for error messages; the key itself if none does."""
        names = {v: k for k, v in cls.keys().items()}
        names.update(cls.SPECIAL)
        return names.get(key, key)


# The annotations of the config fields (strings, under `from __future__ import annotations`) and the
# kinds of value each accepts; _is says what a kind is.
_FIELD_TYPES: dict[str, tuple[str, ...]] = {
    "str": ("str",),
    "int": ("int",),
    "float": ("float",),
    "bool": ("bool",),
    "float | None": ("float", "None"),
    "list[float] | None": ("list[float]", "None"),
    "str | list[str]": ("str", "list[str]"),
}
_TYPE_WORDS = {
    "str": "a string",
    "int": "a whole number",
    "float": "a number",
    "bool": "True or False",
    "None": "None",
    "list[float]": "a list of numbers (one per reward function)",
    "list[str]": "a list of strings",
}


def _is(value: Any, kind: str) -> bool:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    items = isinstance(value, (list, tuple))
    return {
        "str": lambda: isinstance(value, str),
        "int": lambda: isinstance(value, int) and not isinstance(value, bool),
        "float": lambda: number,
        "bool": lambda: isinstance(value, bool),
        "None": lambda: value is None,
        "list[float]": lambda: items and all(_is(v, "float") for v in value),
        "list[str]": lambda: items and all(isinstance(v, str) for v in value),
    }[kind]()


def _report_to(value: str | list[str]) -> str:
    """TRL's report_to (a name or a list) as TrainConfig's one value; an unknown name is passed on, for
    the config's error naming it."""
    names = [n for n in ([value] if isinstance(value, str) else list(value)) if n != "none"]
    unknown = [n for n in names if n not in REPORT_TO]
    return unknown[0] if unknown else ("tensorboard" if names else "none")


@dataclass
class ESConfig(_TrainerConfig):
    """ES settings with TRL's names where the concept is the same (fastes.config.ESConfig is the internal
    [es] section these map onto)."""

    max_steps: int = _sets("es.iterations")  # ES iterations
    learning_rate: float = _sets("es.lr")  # alpha in theta += alpha / (N sigma) sum_i w_i eps_i
    per_device_train_batch_size: int = _sets("batch_size")  # prompts per iteration
    population_size: int = _sets("es.population")
    sigma: float = _sets("es.sigma")
    weight_decay: float = _sets("es.weight_decay")
    shaping: str = _sets("es.shaping")
    antithetic: bool = _sets("es.antithetic")
    stochastic_rounding: bool = _sets("es.stochastic_rounding")
    eval_mode: str = _sets("es.eval_mode")
    materialise_mb: float = _sets("es.materialise_mb")
    noise_type: str = _sets("es.noise_type")
    rank: int = _sets("es.rank")
    noise: str = _sets("es.noise")
    evolve: str = _sets("es.evolve")
    include_embeddings: bool = _sets("es.include_embeddings")
    include_norms: bool = _sets("es.include_norms")
    include_biases: bool = _sets("es.include_biases")

    ALGORITHM: ClassVar[str] = "es"


@dataclass
class GRPOConfig(_TrainerConfig):
    """GRPO settings with TRL's names and meanings (fastes.config.GRPOConfig is the internal [grpo]
    section these map onto). per_device_train_batch_size counts completions, as in TRL: each step
    samples per_device_train_batch_size / num_generations prompts."""

    max_steps: int = _sets("grpo.steps")
    learning_rate: float = _sets("grpo.lr")
    per_device_train_batch_size: int = field(
        default=TrainConfig().batch_size * TrainConfig().grpo.num_generations
    )
    num_generations: int = _sets("grpo.num_generations")
    temperature: float = _sets("grpo.temperature")
    top_p: float = _sets("grpo.top_p")
    beta: float = _sets("grpo.beta")
    epsilon: float = _sets("grpo.epsilon")
    epsilon_high: float | None = None  # None: epsilon (symmetric clipping)
    loss_type: str = _sets("grpo.loss_type")
    max_grad_norm: float = _sets("grpo.max_grad_norm")
    weight_decay: float = _sets("grpo.weight_decay")
    num_iterations: int = _sets("grpo.num_iterations")
    scale_rewards: str = _sets("grpo.scale_rewards")
    mask_truncated_completions: bool = _sets("grpo.mask_truncated_completions")
    use_bias_correction_kl: bool = _sets("grpo.use_bias_correction_kl")

    ALGORITHM: ClassVar[str] = "grpo"
    SPECIAL: ClassVar[dict[str, str]] = {
        **_TrainerConfig.SPECIAL,
        "batch_size": "per_device_train_batch_size",
        "grpo.epsilon_high": "epsilon_high",
    }

    def overrides(self) -> dict[str, Any]:
        values = super().overrides()
        values["grpo.epsilon_high"] = 0.0 if self.epsilon_high is None else self.epsilon_high
        completions, group = self.per_device_train_batch_size, self.num_generations
        if isinstance(group, int) and group >= 1 and completions % group:
            raise ConfigError(
                f"per_device_train_batch_size: {completions} completions are not whole groups of "
                f"num_generations = {group}; make it a multiple of {group} (as TRL requires)"
            )
        values["batch_size"] = completions // group if isinstance(group, int) and group >= 1 else completions
        return values


@dataclass
class TrainerState:
    """What TRL's trainer.state offers that fastes has: the steps done and every metrics.jsonl record."""

    global_step: int = 0
    log_history: list[dict[str, Any]] = field(default_factory=list)


class ESTrainer:
    """Post-train a model with ES on rows of prompts scored by reward functions (TRL's GRPOTrainer shape).

    model: a model directory (str or Path), or a loaded transformers causal LM (then processing_class
    is its tokenizer, and it is trained in place). reward_funcs: one callable or a list of them, each
    f(completions, prompts=..., **columns) -> list[float | None]. peft_config: a peft.PeftConfig (e.g.
    peft.LoraConfig(target_modules=[...])): train a new adapter instead of the model's weights; a
    peft.PeftModel as `model` trains its own adapter. Every check runs here, before any work.
    """

    config_class: ClassVar[type[_TrainerConfig]] = ESConfig

    def __init__(
        self,
        model: str | Path | torch.nn.Module,
        reward_funcs: Any,
        args: _TrainerConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        callbacks: list[Any] | None = None,
        peft_config: Any = None,
    ) -> None:
        self.args = self.config_class() if args is None else args
        if not isinstance(self.args, self.config_class):
            raise ConfigError(
                f"args: {type(self).__name__} takes a fastes.{self.config_class.__name__}, got "
                f"{type(self.args).__module__}.{type(self.args).__name__}; build one with the same fields"
            )
        self.args.check_types()
        if train_dataset is None:
            raise ConfigError("train_dataset: required, rows with a 'prompt' column (a Dataset or a list)")
        self.task = DatasetTask(
            train_dataset,
            reward_funcs,
            reward_weights=self.args.reward_weights,
            eval_dataset=eval_dataset,
            timeout=self.args.reward_timeout,
        )
        self.callbacks = Callbacks(callbacks, args=self.args, max_steps=self.args.max_steps).callbacks
        self.processing_class = processing_class
        if peft_config is not None:  # a new adapter (docs/trainer.md, peft_config); errors before any work
            adapters.check_peft_config(peft_config, model)
        self.peft_config = peft_config
        overrides = self.args.overrides()
        if isinstance(model, (str, Path)):
            self.model_path: str | None = str(model)
            self.model = None  # loaded when first needed (evaluate before training)
            overrides["model"] = self.model_path
        elif isinstance(model, torch.nn.Module):
            if processing_class is None:
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
        self.state = TrainerState()

    def train(self, resume_from_checkpoint: bool | None = None) -> dict[str, Any]:
        """Train; with resume_from_checkpoint=True, continue the run in output_dir from its newest
        checkpoint, exactly. Returns the run's summary (fastes.train.train)."""
        if not isinstance(resume_from_checkpoint, (bool, type(None))):
            raise ConfigError(
                f"resume_from_checkpoint: {resume_from_checkpoint!r}; fastes resumes the run in output_dir "
                "from its newest checkpoint: pass True"
            )
        self.args.check_types()  # fields set since construction (overwrite_output_dir = "no")
        try:
            summary = train_loop(
                self.config,
                resume=bool(resume_from_checkpoint),
                overwrite=self.args.overwrite_output_dir,
                model=None if self.model_path else self.model,
                tokenizer=self.processing_class,
                task=self.task,
                callbacks=self.callbacks,
                peft_config=self.peft_config if self.model_path else None,  # a model object is wrapped
            )
        except NonFiniteUpdateError as error:  # name this config's fields
            raise error.renamed(self.args.public_name) from None
        if self.model_path:  # the trained weights are in final/, written by the loop
            self.model, self.processing_class = load_model(
                Path(self.config.out_dir) / "final", dtype=self.config.dtype, device=self.config.device
            )
        lines = (Path(self.config.out_dir) / "metrics.jsonl").read_text().splitlines()
        self.state.log_history = [json.loads(line) for line in lines]
        self.state.global_step = summary["steps"]
        return summary

    def _loaded(self) -> tuple[torch.nn.Module, Any]:
        """The model and tokenizer, loaded when first needed; the config's automatic settings chosen for
        them as the run chooses them (fastes.defaults)."""
        if self.model is None:
            self.model, tokenizer = load_model(
                resolve_model(self.model_path), dtype=self.config.dtype, device=self.config.device
            )
            self.model = adapters.prepare(self.model, self.peft_config, self.config.seed)  # as the run starts
            self.processing_class = self.processing_class or tokenizer
        self.config = defaults.resolve(self.config, self.model, self.processing_class)
        return self.model, self.processing_class

    @torch.no_grad()
    def evaluate(
        self,
        eval_dataset: Any = None,
        metric_key_prefix: str = "eval",
        *,
        num_samples: int = 1,
        temperature: float = 1.0,
    ) -> dict[str, float]:
        """Greedy completions of the eval rows scored by the reward functions: `<prefix>_reward` (the
        weighted sum), and per function `<prefix>_rewards/<name>/mean`, `/accuracy` where its values are
        all 0 or 1, and with num_samples = n > 1 sampled completions, `/pass@k` for k = 1, 2, 4 .. n."""
        if eval_dataset is not None:
            dataset_rows(eval_dataset, "eval_dataset")  # its own name in errors, not train_dataset's
            task = DatasetTask(eval_dataset, self.task.functions, reward_weights=self.task.weights)
            examples = task.split("train")
        else:
            task, examples = self.task, self.task.split("test")
        if not examples:
            raise ConfigError("evaluate: no eval_dataset; pass one here or to the trainer")
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise ConfigError(f"num_samples: must be a whole number >= 1, got {num_samples!r}")
        if num_samples > 1 and not temperature > 0:
            raise ConfigError(f"temperature: sampling for Pass@K needs temperature > 0, got {temperature}")
        model, tokenizer = self._loaded()
        greedy = self._scores(model, tokenizer, task, examples, 1, 0.0)
        metrics = {f"{metric_key_prefix}_reward": _mean([s.answer for s in greedy])}
        for name in greedy[0].rewards:
            values = [s.rewards[name] for s in greedy]
            metrics[f"{metric_key_prefix}_rewards/{name}/mean"] = _mean(values)
            if _binary(values):
                metrics[f"{metric_key_prefix}_rewards/{name}/accuracy"] = _mean(values)
        if num_samples > 1:
            sampled = self._scores(model, tokenizer, task, examples, num_samples, temperature)
            for name in sampled[0].rewards:
                values = [s.rewards[name] for s in sampled]
                if not _binary(values):  # Pass@K counts correct samples: defined for 0/1 rewards only
                    continue
                per_prompt = [values[i : i + num_samples] for i in range(0, len(values), num_samples)]
                curve = pass_at_k_curve([int(sum(v)) for v in per_prompt], num_samples)
                metrics.update({f"{metric_key_prefix}_rewards/{name}/pass@{k}": p for k, p in curve.items()})
        metrics[f"{metric_key_prefix}_samples"] = len(examples)
        self.state.log_history.append({**metrics, "global_step": self.state.global_step})
        if distributed.is_writer():
            loop_names = {k.replace(f"{metric_key_prefix}_", "test_", 1): v for k, v in metrics.items()}
            Callbacks(self.callbacks).fire("on_evaluate", self.state.global_step, loop_names)
        return metrics

    def _scores(
        self,
        model: Any,
        tokenizer: Any,
        task: DatasetTask,
        examples: list[Example],
        n: int,
        temperature: float,
    ) -> list[Score]:
        """Scores of n completions per example (row i * n + j: sample j of example i)."""
        evaluator = Evaluator(self.config, model, tokenizer)
        seed = self.config.seed if n > 1 else None
        return evaluator.scores(task, examples, samples=n, temperature=temperature, seed=seed)

    def save_model(self, output_dir: str | Path | None = None) -> Path:
        """Write the current model and tokenizer as a Hugging Face directory: output_dir, by default the
        run's final/ (the run directory itself holds the run's own config.json, so it cannot take one)."""
        out = Path(self.config.out_dir)
        target = Path(output_dir) if output_dir is not None else out / "final"
        self._check_save_target(target)
        model, tokenizer = self._loaded()
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
