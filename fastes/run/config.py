"""Run configuration: one dataclass tree, filled from defaults, a TOML file and command-line flags.

Every key is checked when the config is built: an unknown key, a wrong type or an impossible value
fails at once with a ConfigError that names the key and says how to fix it. The task and reward
settings are checked by the tasks package (`fastes.tasks.setup`), which knows what they mean.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from fastes.errors import ConfigError, FastesError, OptionError

ALGORITHMS = ("es", "grpo", "grpo_es")
LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo", "cispo", "sapo", "luspo", "vespo")
SCALE_REWARDS = ("group", "batch", "none")
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
# transformers' schedulers that need no extra arguments (TrainingArguments.lr_scheduler_type)
LR_SCHEDULERS = (
    "constant",
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant_with_warmup",
    "inverse_sqrt",
)
EVAL_MODES = ("auto", "materialised", "virtual", "lowrank", "member")
NOISE_TYPES = ("auto", "full", "lowrank")
PROMPT_STYLES = ("auto", "instruct", "plain")
CHAT_TEMPLATE_MODES = ("auto", "on", "off")
REPORT_TO = ("none", "tensorboard")
FLOAT32_MAX = 3.4028234663852886e38
MAX_SEED = 2**32  # seeds are in [0, 2^32): ES takes up to 2^64, GRPO samples with seed * 1_000_003 + step


# Every key's help line (`fastes train --help`, which appends the default) is its field's metadata "help".
# A field whose metadata has "es_kwarg" is passed to fastes.ES as that keyword argument (es_kwargs).


@dataclass
class ESSettings:
    iterations: int = field(default=60, metadata={"help": "ES iterations (may be raised when resuming)"})
    population: int = field(
        default=32,
        metadata={"help": "members per iteration (even when antithetic)", "es_kwarg": "population"},
    )
    sigma: float = field(default=0.002, metadata={"help": "noise scale", "es_kwarg": "sigma"})
    lr: float = field(
        default=2e-5,
        metadata={"help": "step size alpha in theta += alpha / (N sigma) sum_i w_i eps_i", "es_kwarg": "lr"},
    )
    lr_scheduler_type: str = field(
        default="constant",
        metadata={"help": f"learning-rate schedule over the ES iterations: {', '.join(LR_SCHEDULERS)}"},
    )
    warmup_steps: float = field(
        default=0.0,
        metadata={"help": "linear warmup: ES iterations (>= 1), or a fraction of them (< 1)"},
    )
    shaping: str = field(
        default="centered_rank",
        metadata={
            "help": "reward shaping: centered_rank, zscore, group_zscore or raw",
            "es_kwarg": "shaping",
        },
    )
    antithetic: bool = field(
        default=True,
        metadata={
            "help": "members 2j and 2j+1 use the same noise with opposite signs",
            "es_kwarg": "antithetic",
        },
    )
    weight_decay: float = field(
        default=0.0, metadata={"help": "decoupled weight decay", "es_kwarg": "weight_decay"}
    )
    stochastic_rounding: bool = field(
        default=False,
        metadata={
            "help": "round bf16/fp16 updates stochastically (reproducibly)",
            "es_kwarg": "stochastic_rounding",
        },
    )
    # materialised / virtual / lowrank: the population in one generate call (fastes.es.population); member:
    # one by one; auto: chosen from the model's size and the device (fastes.run.auto_settings)
    eval_mode: str = field(
        default="auto",
        metadata={
            "help": f"one of {', '.join(EVAL_MODES)}: how a generation is evaluated (virtual needs CUDA)"
        },
    )
    # materialised: members whose perturbed weights fit in this many MiB share a generate call (at least
    # one); 0: a quarter of the memory available at the start
    materialise_mb: float = field(
        default=0.0,
        metadata={
            "help": "materialised mode: MiB of members' perturbed weights per generate call "
            "(0: a quarter of the free memory)"
        },
    )
    # "lowrank": matrices get eps = A B^T / sqrt(rank) (EGGROLL-style); auto: lowrank for real models on CPU
    noise_type: str = field(
        default="auto",
        metadata={
            "help": "full, lowrank (eps = A B^T / sqrt(rank) for matrices), or auto (lowrank for real "
            "models on CPU)",
            "es_kwarg": "noise_type",
        },
    )
    rank: int = field(default=1, metadata={"help": "rank of low-rank noise", "es_kwarg": "rank"})
    noise: str = field(
        default="gaussian",
        metadata={
            "help": "distribution of eps: gaussian, or rademacher (+-1 signs, cheaper; docs/noise.md 6a)",
            "es_kwarg": "noise",
        },
    )
    # What to evolve (fastes.linear_weights): every projection matrix (nn.Linear, Conv1D) whose name
    # matches the regular expression `evolve` (empty = all), plus the opt-in kinds (member eval_mode only).
    evolve: str = field(
        default="",
        metadata={
            "help": "regular expression: evolve only the parameters whose name it matches (empty: all)"
        },
    )
    include_embeddings: bool = field(
        default=False,
        metadata={"help": "also evolve the embeddings (a tied lm_head too); needs es.eval_mode member"},
    )
    include_norms: bool = field(
        default=False, metadata={"help": "also evolve norm weights; needs es.eval_mode member"}
    )
    include_biases: bool = field(
        default=False, metadata={"help": "also evolve biases; needs es.eval_mode member"}
    )
    # Each member answers each prompt num_generations times: greedy (one answer) by default, or sampled.
    num_generations: int = field(
        default=1, metadata={"help": "completions per prompt per member (several need temperature > 0)"}
    )
    temperature: float = field(
        default=0.0, metadata={"help": "sampling temperature of the members' completions (0: greedy)"}
    )
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling threshold (temperature > 0)"})
    top_k: int = field(
        default=0, metadata={"help": "sample from the k likeliest tokens (0: off; temperature > 0)"}
    )
    min_p: float = field(
        default=0.0, metadata={"help": "drop tokens below min_p times the top one's probability (0: off)"}
    )
    repetition_penalty: float = field(
        default=1.0,
        metadata={"help": "divide the logits of tokens already in the row by this, greedy too (1: off)"},
    )


@dataclass
class GRPOSettings:
    steps: int = field(default=40, metadata={"help": "GRPO steps (may be raised when resuming)"})
    num_generations: int = field(default=8, metadata={"help": "completions sampled per prompt (the group)"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling threshold"})
    lr: float = field(
        default=0.0,
        metadata={"help": "AdamW learning rate (0: 3e-4 for the tiny models, 1e-6 for real ones)"},
    )
    beta: float = field(
        default=0.0, metadata={"help": "weight of the KL (k3) to the starting model; 0: no reference model"}
    )
    epsilon: float = field(default=0.2, metadata={"help": "clipping range of the probability ratio"})
    loss_type: str = field(default="dapo", metadata={"help": f"one of {', '.join(LOSS_TYPES)}"})
    max_grad_norm: float = field(default=1.0, metadata={"help": "gradient clipping norm"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    # TRL's names and meanings:
    num_iterations: int = field(
        default=1,
        metadata={"help": "optimisation steps per batch of samples (TRL's num_iterations)"},
    )
    epsilon_high: float = field(
        default=0.0, metadata={"help": "upper clip 1 + epsilon_high (DAPO's clip-higher); 0: epsilon"}
    )
    scale_rewards: str = field(
        default="group", metadata={"help": "divide advantages by the std of the group, the batch, or none"}
    )
    mask_truncated_completions: bool = field(
        default=False, metadata={"help": "leave completions cut at max_new_tokens out of the loss"}
    )
    use_bias_correction_kl: bool = field(
        default=False, metadata={"help": "multiply the k3 KL by the importance ratio (beta > 0)"}
    )
    importance_sampling_level: str = field(
        default="token",
        metadata={"help": "the ratio per token, or per sequence (exp of its mean log-ratio: GSPO)"},
    )
    delta: float = field(
        default=0.0, metadata={"help": "two-sided clipping: the ratio capped at delta (INTELLECT-2); 0: off"}
    )
    sapo_temperature_neg: float = field(
        default=1.05, metadata={"help": "sapo's gate temperature for advantages <= 0"}
    )
    sapo_temperature_pos: float = field(
        default=1.0, metadata={"help": "sapo's gate temperature for advantages > 0"}
    )
    vespo_k_pos: float = field(default=2.0, metadata={"help": "vespo's power k for advantages >= 0"})
    vespo_lambda_pos: float = field(
        default=3.0, metadata={"help": "vespo's decay lambda for advantages >= 0"}
    )
    vespo_k_neg: float = field(default=3.0, metadata={"help": "vespo's power k for advantages < 0"})
    vespo_lambda_neg: float = field(default=2.0, metadata={"help": "vespo's decay lambda for advantages < 0"})
    multi_objective_aggregation: str = field(
        default="sum_then_normalize",
        metadata={
            "help": "sum_then_normalize: advantages of the weighted sum of the rewards; normalize_then_sum: "
            "each reward function normalised in its group, then summed and normalised over the batch (GDPO)"
        },
    )
    top_entropy_quantile: float = field(
        default=1.0, metadata={"help": "keep in the loss only this top fraction of tokens by entropy; 1: all"}
    )
    off_policy_mask_threshold: float = field(
        default=0.0,
        metadata={
            "help": "drop completions with advantage < 0 whose mean KL(old || policy) exceeds it "
            "(DeepSeek-V3.2); 0: off"
        },
    )
    entropy_coef: float = field(default=0.0, metadata={"help": "weight of the mean token entropy bonus"})
    sync_ref_model: bool = field(
        default=False,
        metadata={"help": "mix the policy into the KL reference every ref_model_sync_steps optimizer steps"},
    )
    ref_model_mixup_alpha: float = field(
        default=0.6, metadata={"help": "reference = alpha * policy + (1 - alpha) * reference, when synced"}
    )
    ref_model_sync_steps: int = field(
        default=512, metadata={"help": "optimizer steps between reference syncs"}
    )
    gradient_accumulation_steps: int = field(
        default=1, metadata={"help": "micro-batches whose gradients make one optimizer step"}
    )
    steps_per_generation: int = field(
        default=0,
        metadata={
            "help": "micro-batches each step's completions are split into (shuffled); 0: "
            "gradient_accumulation_steps"
        },
    )
    lr_scheduler_type: str = field(
        default="constant",
        metadata={"help": f"learning-rate schedule over the optimizer steps: {', '.join(LR_SCHEDULERS)}"},
    )
    warmup_steps: float = field(
        default=0.0,
        metadata={"help": "linear warmup: optimizer steps (>= 1), or a fraction of them (< 1)"},
    )
    adam_beta1: float = field(default=0.9, metadata={"help": "AdamW beta1"})
    adam_beta2: float = field(default=0.999, metadata={"help": "AdamW beta2"})
    adam_epsilon: float = field(default=1e-8, metadata={"help": "AdamW epsilon"})

    top_k: int = field(default=0, metadata={"help": "sample from the k likeliest tokens (0: off)"})
    min_p: float = field(
        default=0.0, metadata={"help": "drop tokens below min_p times the top one's probability (0: off)"}
    )
    repetition_penalty: float = field(
        default=1.0, metadata={"help": "divide the logits of tokens already in the row by this (1: off)"}
    )

    def generation_steps(self) -> int:
        """Micro-batches a step's completions are split into (steps_per_generation; 0: accumulation's)."""
        return self.steps_per_generation or self.gradient_accumulation_steps

    def optimizer_steps(self) -> int:
        """Optimizer steps per GRPO step: each of the num_iterations passes over the step's micro-batches
        takes one every gradient_accumulation_steps of them."""
        return self.generation_steps() * self.num_iterations // self.gradient_accumulation_steps


@dataclass
class TrainConfig:
    algorithm: str = field(
        default="es",
        metadata={"help": f"one of {', '.join(ALGORITHMS)} (grpo_es: a GRPO phase, then ES from its result)"},
    )
    model: str = field(
        default="",
        metadata={
            "help": "a Hugging Face model directory, a .gguf file, or a shipped model "
            "(smollm2-135m-instruct); empty: the built-in tiny model"
        },
    )
    task: str = field(
        default="countdown",
        metadata={
            "help": "countdown, arithmetic, reverse, compare (name:key=value,... for options), jsonl:<path>, "
            "reasoning_gym:<name> or dataset (with --dataset)"
        },
    )
    reward: str = field(
        default="",
        metadata={
            "help": "FILE.py:FUNCTION, your reward function (TRL's signature) for a jsonl:<path> task of "
            "prompts; with dataset, one or more (comma-separated, or several after --reward)"
        },
    )
    reward_timeout: float = field(
        default=60.0, metadata={"help": "seconds one call of the reward function may take"}
    )
    task_seed: int = field(default=0, metadata={"help": "seed of the task's train/test problems"})
    seed: int = field(
        default=0,
        metadata={"help": "run seed in [0, 2^32): noise, prompt batches and sampling", "es_kwarg": "seed"},
    )
    out_dir: str = field(
        default="runs/es",
        metadata={"help": "run directory (config.json, metrics.jsonl, checkpoints/, final/)"},
    )
    batch_size: int = field(default=64, metadata={"help": "training prompts per ES iteration / GRPO step"})
    max_new_tokens: int = field(
        default=0, metadata={"help": "tokens generated per completion (0: 12 plain, 48 instruct)"}
    )
    eval_batch_size: int = field(
        default=0, metadata={"help": "rows per evaluation generate call (0: up to 256, from the free memory)"}
    )
    prompt_style: str = field(
        default="auto",
        metadata={
            "help": "instruct (built-in tasks asked in words), plain (the character model's form) or auto"
        },
    )
    chat_template: str = field(
        default="auto", metadata={"help": "on, off, or auto (on when the tokenizer has one)"}
    )
    system_prompt: str = field(
        default="",
        metadata={
            "help": "system prompt text; empty: none (not the template's default); <default>: keep that"
        },
    )
    instruction: str = field(
        default="",
        metadata={"help": "replaces a built-in task's request for the answer format in its instruct form"},
    )
    answer_prefix: str = field(
        default="auto",
        metadata={
            "help": "words the reply starts with, written after a built-in task's instruct prompt (auto: "
            "the task's own, 'Answer:'; empty: none)"
        },
    )
    format_weight: float = field(
        default=0.1, metadata={"help": "reward = format_weight * well-formed + correct answer"}
    )
    eval_every: int = field(
        default=10,
        metadata={"help": "test accuracy every this many steps (0: only at the end of each phase)"},
    )
    eval_size: int = field(default=200, metadata={"help": "test problems per evaluation"})
    checkpoint_every: int = field(
        default=10,
        metadata={"help": "checkpoint every this many steps (0: never); --resume continues the newest"},
    )
    dtype: str = field(default="float32", metadata={"help": "float32, bfloat16 or float16"})
    device: str = field(default="cpu", metadata={"help": "cpu, cuda, cuda:1, ..."})
    backend: str = field(
        default="auto",
        metadata={
            "help": "noise kernels: auto (Triton on CUDA, compiled C on CPU), triton, cpu (CPU) or torch",
            "es_kwarg": "backend",
        },
    )
    threads: int = field(
        default=0,
        metadata={"help": "torch CPU threads (0: 1 for models under 5M parameters, else torch's default)"},
    )
    progress: bool = field(default=True, metadata={"help": "show a progress bar"})
    collective_timeout: float = field(
        default=1800.0,
        metadata={
            "help": "seconds a multi-process collective (ES or GRPO) waits for the other ranks before "
            "failing",
            "es_kwarg": "timeout",
        },
    )
    # Data and reward functions as TRL takes them (fastes/tasks/dataset.py), and live metrics:
    dataset: str = field(
        default="",
        metadata={
            "help": "a local .jsonl/.json/.csv/.parquet file: a 'prompt' column (text or chat messages) and "
            "columns passed to the reward functions (TRL's way; docs/trainer.md)"
        },
    )
    eval_dataset: str = field(
        default="", metadata={"help": "a file of held-out rows for `dataset` (empty: a seeded 20%% of it)"}
    )
    reward_weights: str = field(
        default="",
        metadata={"help": "comma-separated weights of the reward functions, e.g. 1,0.5 (empty: 1 each)"},
    )
    report_to: str = field(
        default="none",
        metadata={
            "help": "none, or tensorboard (metrics under out_dir/tensorboard as train/<name>, eval/<name>)"
        },
    )
    logging_steps: int = field(
        default=1,
        metadata={
            "help": "TensorBoard gets the metrics of every this many steps (metrics.jsonl: every step)"
        },
    )
    es: ESSettings = field(default_factory=ESSettings)
    grpo: GRPOSettings = field(default_factory=GRPOSettings)


def _check_type(key: str, value: Any, expected: type) -> Any:
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    # bool is a subclass of int in Python, so it is checked both ways.
    if isinstance(value, bool) != (expected is bool) or not isinstance(value, expected):
        raise ConfigError(f"{key} must be {expected.__name__}, got {type(value).__name__} {value!r}")
    return value


def _merge(target: Any, values: dict[str, Any], prefix: str = "") -> None:
    fields = {f.name: f for f in dataclasses.fields(target)}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if key not in fields:
            known = ", ".join(prefix + k for k in fields)
            raise ConfigError(f"unknown config key {name!r}; known keys: {known}")
        current = getattr(target, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{name} must be a table ([{name}] in TOML), got {value!r}")
            _merge(current, value, prefix=f"{name}.")
        else:
            setattr(target, key, _check_type(name, value, type(current)))


def _require(condition: bool, key: str, problem: str) -> None:
    if not condition:
        raise ConfigError(f"{key}: {problem}")


def _floats(obj: Any, prefix: str = "") -> list[tuple[str, float]]:
    """(dotted key, value) of every float leaf of the config tree."""
    found = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            found += _floats(value, f"{prefix}{f.name}.")
        elif isinstance(value, float):
            found.append((f"{prefix}{f.name}", value))
    return found


def _check_out_dir(cfg: TrainConfig) -> None:
    """The run directory. Every file a run writes has a fixed name under it, so only its own value matters.

    Refused: an empty value, a NUL byte, an existing file, and the directory of the model the run starts
    from, or its parent when out_dir/final is that model (the run would overwrite its own starting model).
    """
    out = cfg.out_dir
    _require(out.strip() != "", "out_dir", "must name a run directory, got an empty value")
    _require("\0" not in out, "out_dir", f"contains a NUL byte: {out!r}")
    path = Path(out)
    _require(not path.exists() or path.is_dir(), "out_dir", f"{out!r} exists and is not a directory")
    existing = next(p for p in (path.absolute(), *path.absolute().parents) if p.exists())
    _require(
        existing.is_dir(),
        "out_dir",
        f"{out!r} would be under {str(existing)!r}, which is a file; choose a path under a directory",
    )
    from fastes.models.loading import tiny_model_path

    if cfg.model and not Path(cfg.model).is_dir():  # a .gguf file or a shipped name: converted into the cache
        return
    model = (Path(cfg.model) if cfg.model else tiny_model_path()).resolve()
    resolved = path.resolve()
    _require(
        model not in (resolved, resolved / "final"),
        "out_dir",
        f"{out!r} would overwrite the model directory {str(model)!r} the run starts from; choose another",
    )


def _check_device(device: str) -> None:
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError) as error:
        raise ConfigError(f"device: {device!r} is not a torch device ({error}); e.g. cpu, cuda:1") from None
    _require(
        parsed.type != "cuda" or torch.cuda.is_available(),
        "device",
        f"{device!r} asked for, but torch sees no CUDA device; use cpu",
    )
    _require(
        parsed.type != "cuda" or parsed.index is None or parsed.index < torch.cuda.device_count(),
        "device",
        f"{device!r} asked for, but torch sees {torch.cuda.device_count()} CUDA device(s); use cuda:0",
    )


def _check_triton(cfg: TrainConfig) -> None:
    """Triton kernels need a CUDA device; on CPU only the interpreter (TRITON_INTERPRET=1) runs them."""
    if cfg.device.startswith("cuda") or os.environ.get("TRITON_INTERPRET") == "1" or cfg.algorithm == "grpo":
        return
    _require(
        cfg.es.eval_mode != "virtual",
        "es.eval_mode",
        f"'virtual' runs a Triton kernel and needs a CUDA device, but device = {cfg.device!r}; "
        "use es.eval_mode = 'materialised' on CPU",
    )
    _require(
        cfg.backend != "triton",
        "backend",
        f"'triton' needs a CUDA device, but device = {cfg.device!r}; use backend = 'auto' or 'torch'",
    )


def _check_report_to(cfg: TrainConfig) -> None:
    _require(
        cfg.report_to in REPORT_TO,
        "report_to",
        f"{cfg.report_to!r} is not supported; use 'tensorboard' or 'none' (callbacks= logs anywhere else)",
    )
    if cfg.report_to == "tensorboard":
        import importlib.util

        _require(
            importlib.util.find_spec("tensorboard") is not None,
            "report_to",
            "'tensorboard' needs the tensorboard package: pip install 'fastes[hf]'",
        )
    _require(cfg.logging_steps >= 1, "logging_steps", f"must be at least 1, got {cfg.logging_steps}")


def _check_evolve(es: ESSettings) -> None:
    import re

    try:
        re.compile(es.evolve)
    except re.error as error:
        raise ConfigError(f"es.evolve: {es.evolve!r} is not a regular expression ({error})") from None
    extra = [k for k in ("include_embeddings", "include_norms", "include_biases") if getattr(es, k)]
    _require(
        not extra or es.eval_mode in ("member", "auto"),
        f"es.{extra[0] if extra else ''}",
        f"batched evaluation ({es.eval_mode}) evolves projection matrices only; set es.eval_mode = "
        "'member' to evolve embeddings, norms or biases",
    )


def _check_prompting(cfg: TrainConfig) -> None:
    _require(
        cfg.prompt_style in PROMPT_STYLES,
        "prompt_style",
        f"{cfg.prompt_style!r} is not one of {PROMPT_STYLES}",
    )
    _require(
        cfg.chat_template in CHAT_TEMPLATE_MODES,
        "chat_template",
        f"{cfg.chat_template!r} is not one of {CHAT_TEMPLATE_MODES}",
    )
    _require(
        not cfg.system_prompt or cfg.chat_template != "off",
        "system_prompt",
        "a system prompt goes through the chat template, but chat_template = 'off'; set it to auto or on",
    )
    from fastes.tasks import available_tasks

    built_in = cfg.task.partition(":")[0] in available_tasks()
    if cfg.instruction:
        _require(
            built_in and cfg.prompt_style != "plain",
            "instruction",
            "rewords the request for the answer format of a built-in task's instruct form; "
            "use it with a built-in task and prompt_style auto or instruct",
        )
    if cfg.answer_prefix != "auto":
        _require(
            built_in and cfg.prompt_style != "plain",
            "answer_prefix",
            "starts the reply to a built-in task's instruct form; use it with a built-in task and "
            "prompt_style auto or instruct, or leave it at auto",
        )


# The settings that decide how a task's prompts are written and answered (fastes.run.evaluation renders them).
PROMPT_SETTINGS = (
    "prompt_style",
    "chat_template",
    "system_prompt",
    "instruction",
    "answer_prefix",
    "max_new_tokens",
)


def validate(cfg: TrainConfig) -> TrainConfig:
    """Check every value's range; returns cfg for chaining."""
    from fastes.tasks.setup import check_settings

    for key, value in _floats(cfg):  # TOML has nan and inf literals; no key means anything by them
        _require(math.isfinite(value), key, f"must be a finite number, got {value}")
    _require(cfg.algorithm in ALGORITHMS, "algorithm", f"{cfg.algorithm!r} is not one of {ALGORITHMS}")
    check_settings(cfg)  # the task, its options, the reward functions and data files
    _check_report_to(cfg)
    if cfg.model:
        from fastes.models.sources import check_model_spec

        try:
            check_model_spec(cfg.model)
        except FastesError as error:  # a missing directory, file or package: the message names the fix
            raise ConfigError(f"model: {error}") from None
    _require(0 <= cfg.seed < MAX_SEED, "seed", f"must be in [0, 2^32), got {cfg.seed}")
    _check_out_dir(cfg)
    _check_device(cfg.device)
    _check_triton(cfg)
    timeout = cfg.collective_timeout
    _require(timeout > 0, "collective_timeout", f"must be > 0 seconds, got {timeout}")
    for key in ("batch_size", "eval_size"):
        _require(getattr(cfg, key) >= 1, key, f"must be at least 1, got {getattr(cfg, key)}")
    for key in ("eval_every", "checkpoint_every", "threads"):
        _require(getattr(cfg, key) >= 0, key, f"must be >= 0 (0 = never), got {getattr(cfg, key)}")
    for key in ("max_new_tokens", "eval_batch_size"):
        _require(getattr(cfg, key) >= 0, key, f"must be >= 1 (or 0 = auto), got {getattr(cfg, key)}")
    _check_prompting(cfg)
    _require(cfg.dtype in ("float32", "bfloat16", "float16"), "dtype", "choose float32, bfloat16 or float16")
    _require(
        cfg.backend in ("auto", "triton", "cpu", "torch"),
        "backend",
        "choose auto, triton, cpu or torch",
    )
    _require(
        not (cfg.backend == "cpu" and cfg.device.startswith("cuda")),
        "backend",
        f"'cpu' is the compiled CPU backend, but device = {cfg.device!r}; use backend 'auto' or 'torch'",
    )
    _require(math.isfinite(cfg.format_weight) and cfg.format_weight >= 0, "format_weight", "must be >= 0")
    _check_es(cfg.es)
    _check_grpo(cfg.grpo)
    completions, micro_batches = cfg.batch_size * cfg.grpo.num_generations, cfg.grpo.generation_steps()
    _require(
        cfg.algorithm == "es" or completions % micro_batches == 0,
        "grpo.steps_per_generation",
        f"{micro_batches} micro-batches do not split a step's {completions} completions (batch_size * "
        "num_generations) equally; choose a divisor",
    )
    return cfg


def _check_es(es: ESSettings) -> None:
    _require(es.iterations >= 0, "es.iterations", f"must be >= 0, got {es.iterations}")
    _require(
        es.noise_type in NOISE_TYPES, "es.noise_type", f"{es.noise_type!r}: choose {', '.join(NOISE_TYPES)}"
    )
    from fastes.es.optimizer import check_arguments

    try:  # ES's own checks of its arguments, under the config's names (es.population, ...)
        check_arguments(
            sigma=es.sigma,
            lr=es.lr,
            population=es.population,
            antithetic=es.antithetic,
            shaping=es.shaping,
            weight_decay=es.weight_decay,
            noise_type="full" if es.noise_type == "auto" else es.noise_type,  # auto: resolved at the start
            rank=es.rank,
            noise=es.noise,
        )
    except OptionError as error:
        raise ConfigError(f"es.{error.option}: {error.problem}") from None
    # The update computes in float32 (fastes.ES refuses a step that would overflow; these never fit).
    coef = es.lr / (es.population * es.sigma)
    _require(
        coef <= FLOAT32_MAX,
        "es.lr",
        f"{es.lr:g} divided by population * sigma is {coef:.3g}, beyond float32's range where the update "
        "is computed; lower it, or raise sigma",
    )
    _require(
        es.lr * es.weight_decay <= FLOAT32_MAX,
        "es.weight_decay",
        f"{es.weight_decay:g} times the learning rate {es.lr:g} is beyond float32's range; lower either",
    )
    _check_schedule("es", es.lr_scheduler_type, es.warmup_steps)
    _require(es.eval_mode in EVAL_MODES, "es.eval_mode", f"{es.eval_mode!r} is not one of {EVAL_MODES}")
    _require(
        es.materialise_mb >= 0 and math.isfinite(es.materialise_mb),
        "es.materialise_mb",
        f"must be a positive number of MiB (or 0 = auto), got {es.materialise_mb}",
    )
    _require(es.num_generations >= 1, "es.num_generations", f"must be at least 1, got {es.num_generations}")
    _require(
        es.temperature >= 0 and math.isfinite(es.temperature),
        "es.temperature",
        f"must be >= 0 (0: greedy), got {es.temperature}",
    )
    _require(
        es.num_generations == 1 or es.temperature > 0,
        "es.num_generations",
        f"{es.num_generations} greedy completions of a prompt are identical; set es.temperature > 0",
    )
    _require(0 < es.top_p <= 1, "es.top_p", f"must be in (0, 1], got {es.top_p}")
    _require(es.top_k >= 0, "es.top_k", f"must be >= 0 (0: off), got {es.top_k}")
    _require(0 <= es.min_p <= 1, "es.min_p", f"must be in [0, 1] (0: off), got {es.min_p}")
    _require(
        es.repetition_penalty > 0,
        "es.repetition_penalty",
        f"must be > 0 (1: off), got {es.repetition_penalty}",
    )
    _require(
        es.eval_mode != "lowrank" or es.noise_type in ("lowrank", "auto"),
        "es.eval_mode",
        "'lowrank' evaluation needs es.noise_type = 'lowrank'",
    )
    _require(
        es.eval_mode != "virtual" or es.noise_type in ("full", "auto"),
        "es.eval_mode",
        "'virtual' evaluation generates full-rank noise; set es.noise_type = 'full'",
    )
    _check_evolve(es)


def _check_schedule(section: str, scheduler_type: str, warmup_steps: float) -> None:
    """The learning-rate schedule of ES or GRPO (fastes.run.shared.learning_rates)."""
    _require(
        scheduler_type in LR_SCHEDULERS,
        f"{section}.lr_scheduler_type",
        f"{scheduler_type!r} is not one of {LR_SCHEDULERS}",
    )
    _require(
        warmup_steps >= 0 and math.isfinite(warmup_steps),
        f"{section}.warmup_steps",
        f"must be >= 0, got {warmup_steps}",
    )
    _require(
        warmup_steps < 1 or warmup_steps == int(warmup_steps),
        f"{section}.warmup_steps",
        f"a count of steps must be whole (or a fraction < 1), got {warmup_steps}",
    )


def _check_grpo(g: GRPOSettings) -> None:
    _require(g.steps >= 0, "grpo.steps", f"must be >= 0, got {g.steps}")
    _require(g.num_generations >= 2, "grpo.num_generations", f"must be at least 2, got {g.num_generations}")
    _require(g.temperature > 0, "grpo.temperature", f"GRPO samples, so it must be > 0, got {g.temperature}")
    _require(0 < g.top_p <= 1, "grpo.top_p", f"must be in (0, 1], got {g.top_p}")
    _require(g.top_k >= 0, "grpo.top_k", f"must be >= 0 (0: off), got {g.top_k}")
    _require(0 <= g.min_p <= 1, "grpo.min_p", f"must be in [0, 1] (0: off), got {g.min_p}")
    _require(
        g.repetition_penalty > 0,
        "grpo.repetition_penalty",
        f"must be > 0 (1: off), got {g.repetition_penalty}",
    )
    _require(g.lr >= 0, "grpo.lr", f"must be > 0 (or 0 = auto), got {g.lr}")
    _require(g.beta >= 0, "grpo.beta", f"must be >= 0, got {g.beta}")
    _require(0 <= g.epsilon < 1, "grpo.epsilon", f"must be in [0, 1), got {g.epsilon}")
    _require(g.loss_type in LOSS_TYPES, "grpo.loss_type", f"{g.loss_type!r} is not one of {LOSS_TYPES}")
    _require(g.max_grad_norm > 0, "grpo.max_grad_norm", f"must be > 0, got {g.max_grad_norm}")
    _require(g.weight_decay >= 0, "grpo.weight_decay", f"must be >= 0, got {g.weight_decay}")
    # AdamW's first step is lr / (1 - beta1) = 10 lr, taken in float32 (fastes.run.grpo_loop refuses the
    # rest).
    _require(
        10 * g.lr <= FLOAT32_MAX and g.lr * g.weight_decay <= FLOAT32_MAX,
        "grpo.lr",
        f"{g.lr:g} (times 10 in AdamW's first step, or times the weight decay {g.weight_decay:g}) is beyond "
        "float32's range; lower it or the weight decay",
    )
    _require(g.num_iterations >= 1, "grpo.num_iterations", f"must be at least 1, got {g.num_iterations}")
    _require(g.epsilon_high >= 0, "grpo.epsilon_high", f"must be >= 0 (0 = epsilon), got {g.epsilon_high}")
    _require(
        g.scale_rewards in SCALE_REWARDS,
        "grpo.scale_rewards",
        f"{g.scale_rewards!r} is not one of {SCALE_REWARDS}",
    )
    _require(
        g.multi_objective_aggregation in AGGREGATIONS,
        "grpo.multi_objective_aggregation",
        f"{g.multi_objective_aggregation!r} is not one of {AGGREGATIONS}",
    )
    _require(
        g.importance_sampling_level in IMPORTANCE_SAMPLING_LEVELS,
        "grpo.importance_sampling_level",
        f"{g.importance_sampling_level!r} is not one of {IMPORTANCE_SAMPLING_LEVELS}",
    )
    _require(g.delta == 0 or g.delta > 1, "grpo.delta", f"must be > 1 (or 0 = off), got {g.delta}")
    for key in ("sapo_temperature_neg", "sapo_temperature_pos"):
        value = getattr(g, key)
        _require(value > 0 and math.isfinite(value), f"grpo.{key}", f"must be > 0, got {value}")
    for key in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
        value = getattr(g, key)
        _require(value >= 0 and math.isfinite(value), f"grpo.{key}", f"must be >= 0, got {value}")
    _require(
        0 <= g.top_entropy_quantile <= 1,
        "grpo.top_entropy_quantile",
        f"must be in [0, 1], got {g.top_entropy_quantile}",
    )
    _require(
        g.off_policy_mask_threshold >= 0,
        "grpo.off_policy_mask_threshold",
        f"must be > 0 (or 0 = off), got {g.off_policy_mask_threshold}",
    )
    _require(math.isfinite(g.entropy_coef), "grpo.entropy_coef", f"must be a number, got {g.entropy_coef}")
    _require(
        not g.sync_ref_model or g.beta > 0,
        "grpo.sync_ref_model",
        "needs a reference model, which beta = 0 does without; set grpo.beta > 0 or sync_ref_model = false",
    )
    _require(
        0 <= g.ref_model_mixup_alpha <= 1,
        "grpo.ref_model_mixup_alpha",
        f"must be in [0, 1], got {g.ref_model_mixup_alpha}",
    )
    _require(
        g.ref_model_sync_steps >= 1,
        "grpo.ref_model_sync_steps",
        f"must be >= 1, got {g.ref_model_sync_steps}",
    )
    _require(
        g.gradient_accumulation_steps >= 1,
        "grpo.gradient_accumulation_steps",
        f"must be at least 1, got {g.gradient_accumulation_steps}",
    )
    _require(
        g.steps_per_generation >= 0,
        "grpo.steps_per_generation",
        f"must be >= 1 (or 0 = gradient_accumulation_steps), got {g.steps_per_generation}",
    )
    passes = g.generation_steps() * g.num_iterations
    _require(
        passes % g.gradient_accumulation_steps == 0,
        "grpo.gradient_accumulation_steps",
        f"{g.gradient_accumulation_steps} does not divide steps_per_generation * num_iterations ({passes}): "
        "an optimizer step would mix two steps' completions, which fastes does not do",
    )
    _check_schedule("grpo", g.lr_scheduler_type, g.warmup_steps)
    for key in ("adam_beta1", "adam_beta2"):
        value = getattr(g, key)
        _require(0 <= value < 1, f"grpo.{key}", f"must be in [0, 1), got {value}")
    _require(g.adam_epsilon > 0, "grpo.adam_epsilon", f"must be > 0, got {g.adam_epsilon}")


def load_config(
    path: str | Path | None = None,
    overrides: dict[str, Any] | None = None,
    base: dict[str, Any] | None = None,
) -> TrainConfig:
    """Defaults (or `base`, a config_dict such as a run's saved config), then the TOML file at `path`, then
    `overrides` ({"es.sigma": 0.01, ...}); validated."""
    cfg = config_from_dict(base or {})
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            values = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(f"config file {str(path)!r} is not valid TOML: {error}") from None
        _merge(cfg, values)
    for dotted, value in (overrides or {}).items():
        *sections, key = dotted.split(".")
        nested: dict[str, Any] = {key: value}
        for section in reversed(sections):
            nested = {section: nested}
        _merge(cfg, nested)
    return validate(cfg)


def config_dict(cfg: TrainConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def config_from_dict(values: dict[str, Any]) -> TrainConfig:
    """The config that config_dict() gave `values`; keys and types are checked, ranges are not."""
    cfg = TrainConfig()
    _merge(cfg, values)
    return cfg


def flag_specs() -> list[tuple[str, type]]:
    """("es.sigma", float), ...: every leaf key, for building command-line flags."""
    specs = []

    def walk(obj: Any, prefix: str) -> None:
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                walk(value, f"{prefix}{f.name}.")
            else:
                specs.append((f"{prefix}{f.name}", type(value)))

    walk(TrainConfig(), "")
    return specs


def _field(key: str) -> dataclasses.Field:
    """The dataclass field of a dotted key ("es.sigma")."""
    *sections, name = key.split(".")
    obj: Any = TrainConfig
    for section in sections:
        obj = {f.name: f for f in dataclasses.fields(obj)}[section].default_factory
    return {f.name: f for f in dataclasses.fields(obj)}[name]


def flag_help(key: str) -> str:
    """The help line of a dotted key (its field's metadata), with its default."""
    default: Any = TrainConfig()
    for part in key.split("."):
        default = getattr(default, part)
    return f"{_field(key).metadata['help']} (default: {default!r})"


def es_kwargs(cfg: TrainConfig) -> dict[str, Any]:
    """The keyword arguments of fastes.ES that the run config sets: every field of the run and of its [es]
    section whose metadata names one ("es_kwarg"), e.g. es.sigma -> sigma, collective_timeout -> timeout.

    fastes.run.es_loop.make_es builds the run's ES from these; "auto" values (es.noise_type) must have been
    resolved (fastes.run.auto_settings) first.
    """
    kwargs = {}
    for section in (cfg, cfg.es):
        for f in dataclasses.fields(section):
            if "es_kwarg" in f.metadata:
                kwargs[f.metadata["es_kwarg"]] = getattr(section, f.name)
    return kwargs


def es_key(kwarg: str) -> str:
    """The run config key that sets fastes.ES's keyword argument `kwarg` ("sigma" -> "es.sigma"), for
    messages in the run's terms; `kwarg` itself when no key sets it."""
    for prefix, section in (("", TrainConfig), ("es.", ESSettings)):
        for f in dataclasses.fields(section):
            if f.metadata.get("es_kwarg") == kwarg:
                return prefix + f.name
    return kwarg
