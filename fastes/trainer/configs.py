"""ESConfig and GRPOConfig: TRL's GRPOConfig, field for field, over the run config of `fastes train`.

Both accept every field of TRL's GRPOConfig (and so of transformers' TrainingArguments), with TRL's
defaults, so that a TRL script runs with only its import changed. Each field has one of four outcomes,
kept in its metadata and listed in docs/trainer.md (a test compares the two, and TRL's own field list
when TRL is installed):

- honoured: it sets a TrainConfig key (`_sets`), or the trainer acts on it (`_uses`);
- choices: the values fastes honours are listed; another value is an error (`_choices`);
- inert: it cannot change the trained model here (speed, memory, logging, hub): any value is accepted,
  and a value other than the default prints one warning line saying so (`_inert`);
- refused: ignoring it would change the result, so a value other than the default is an error naming
  the field and why (`_refused`).

ESConfig keeps fastes' ES defaults for what ES means by a TRL name (learning_rate is alpha of the ES
step, per_device_train_batch_size counts prompts); GRPO-only fields are refused there when set.
fastes.run.config.ESSettings and fastes.run.config.GRPOSettings are the [es] and [grpo] sections of a
TrainConfig (the TOML file of `fastes train`), which these map onto.
"""

from __future__ import annotations

import importlib.util
import math
import warnings
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar

import torch

from fastes.errors import ConfigError
from fastes.run.config import REPORT_TO, TrainConfig

_ITS_DEFAULT = object()
OUTCOMES = ("honoured", "choices", "inert", "refused")


def _default_of(key: str) -> Any:
    value: Any = TrainConfig()
    for part in key.split("."):
        value = getattr(value, part)
    return value


def _sets(key: str, default: Any = _ITS_DEFAULT, note: str = "") -> Any:
    """Honoured: sets TrainConfig key `key` ("es.sigma") one-to-one; by default from that key's own
    default, so that the config and `fastes train` start from the same settings."""
    default = _default_of(key) if default is _ITS_DEFAULT else default
    return field(default=default, metadata={"outcome": "honoured", "sets": key, "note": note or f"`{key}`"})


def _uses(default: Any, note: str) -> Any:
    """Honoured by the trainer's own code (see `overrides` and fastes/trainer/trainers.py)."""
    return field(default=default, metadata={"outcome": "honoured", "note": note})


def _choices(default: Any, allowed: tuple[Any, ...], note: str) -> Any:
    """Honoured for the listed values; any other is refused."""
    return field(default=default, metadata={"outcome": "choices", "allowed": allowed, "note": note})


def _inert(default: Any, note: str) -> Any:
    """Accepted; a value other than the default warns that it changes nothing here."""
    return field(default=default, metadata={"outcome": "inert", "note": note})


def _refused(default: Any, note: str) -> Any:
    """Accepted at its default only: another value would be ignored, changing the result."""
    return field(default=default, metadata={"outcome": "refused", "note": note})


def _inert_list(default: Any, note: str) -> Any:
    return field(default_factory=lambda: list(default), metadata={"outcome": "inert", "note": note})


GRPO_ONLY = "GRPO only: ES has no loss, gradient or reference model"
NO_GRADIENTS = "ES has no gradients or optimizer state"
SPEED = "speed or memory only; the result is the same"
LOGGING = "logging only"
HUB = "fastes does not talk to the Hugging Face Hub; push output_dir/final yourself"
PARALLEL = "launch with torchrun instead: fastes.distributed shares the work (docs/distributed.md)"
SAMPLING = "fastes draws each step's prompts at random from `seed`"
ADAPTIVE = "fastes' GRPO has a fixed entropy_coef, no adaptive entropy"
# The keys of generation_kwargs fastes honours (as TRL, they override the fields of the same meaning).
GENERATION_KWARGS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "max_new_tokens",
    "do_sample",
)


@dataclass
class _TrainerConfig:
    """Every field of TRL's GRPOConfig with TRL's default (docs/trainer.md lists each one's outcome)."""

    # --- transformers.TrainingArguments -------------------------------------------------------------
    output_dir: str = _sets("out_dir", "trainer_output", "`out_dir`: the run directory")
    per_device_train_batch_size: int = 0  # each subclass: prompts (ES) or completions (GRPO)
    num_train_epochs: float = _uses(3.0, "with `max_steps=-1`: steps = epochs x rows / prompts per step")
    max_steps: int = _uses(-1, "steps; -1: from `num_train_epochs`")
    learning_rate: float = 0.0  # each subclass
    lr_scheduler_type: str = ""  # each subclass
    lr_scheduler_kwargs: Any = _refused(None, "the schedules take no arguments beyond warmup_steps")
    warmup_steps: float = 0.0  # each subclass
    optim: str = _refused("adamw_torch_fused", NO_GRADIENTS)
    optim_args: Any = _refused(None, NO_GRADIENTS)
    weight_decay: float = 0.0  # each subclass
    adam_beta1: Any = _refused(0.9, NO_GRADIENTS)
    adam_beta2: Any = _refused(0.999, NO_GRADIENTS)
    adam_epsilon: Any = _refused(1e-8, NO_GRADIENTS)
    optim_target_modules: Any = _refused(None, "ES chooses its weights with `evolve`")
    gradient_accumulation_steps: int = _refused(1, "ES has no gradients: raise per_device_train_batch_size")
    average_tokens_across_devices: Any = _inert(True, "GRPO's normaliser is the whole batch's already")
    max_grad_norm: float = _refused(1.0, NO_GRADIENTS)
    label_smoothing_factor: Any = _refused(0.0, "no labels")
    bf16: bool | None = _uses(None, "True: the model is loaded in bfloat16 (a path only)")
    fp16: bool = _uses(False, "True: the model is loaded in float16 (a path only)")
    bf16_full_eval: Any = _refused(False, "evaluation runs in the model's dtype")
    fp16_full_eval: Any = _refused(False, "evaluation runs in the model's dtype")
    tf32: Any = _refused(None, "set torch.backends.cuda.matmul.allow_tf32 yourself")
    activation_checkpointing: Any = _inert(None, SPEED)
    activation_checkpointing_kwargs: Any = _inert(None, SPEED)
    gradient_checkpointing: Any = _inert(True, SPEED)
    gradient_checkpointing_kwargs: Any = _inert(None, SPEED)
    torch_compile: Any = _inert(False, SPEED)
    torch_compile_backend: Any = _inert(None, SPEED)
    torch_compile_mode: Any = _inert(None, SPEED)
    use_liger_kernel: Any = _inert(False, "fastes computes the loss with torch; " + SPEED)
    liger_kernel_config: Any = _inert(None, SPEED)
    use_cache: Any = _inert(False, "generation always uses the KV cache; " + SPEED)
    neftune_noise_alpha: Any = _refused(None, "no embedding noise")
    torch_empty_cache_steps: Any = _inert(None, SPEED)
    auto_find_batch_size: Any = _inert(False, SPEED)
    logging_strategy: Any = _inert("steps", "metrics.jsonl and log_history get every step")
    logging_steps: int = _sets("logging_steps", 10, "`logging_steps`: TensorBoard gets every this many")
    logging_first_step: Any = _inert(False, LOGGING)
    log_on_each_node: Any = _inert(True, LOGGING)
    logging_nan_inf_filter: Any = _inert(True, LOGGING)
    include_num_input_tokens_seen: Any = _inert("no", LOGGING)
    log_level: Any = _inert("passive", LOGGING)
    log_level_replica: Any = _inert("warning", LOGGING)
    disable_tqdm: bool | None = _uses(None, "`progress` (negated)")
    report_to: str | list[str] = _uses("none", "`report_to`: tensorboard or none")
    run_name: Any = _inert(None, LOGGING)
    project: Any = _inert("huggingface", LOGGING)
    trackio_space_id: Any = _inert(None, LOGGING)
    trackio_bucket_id: Any = _inert(None, LOGGING)
    trackio_static_space_id: Any = _inert(None, LOGGING)
    eval_strategy: str = _choices("no", ("no", "steps"), "steps: every `eval_steps`")
    eval_steps: float | None = _uses(None, "`eval_every` (None: `logging_steps`)")
    eval_delay: Any = _inert(0, "evaluation only")
    per_device_eval_batch_size: int = _inert(8, "evaluation generates in batches sized by free memory")
    prediction_loss_only: Any = _inert(False, "evaluation only")
    eval_on_start: bool = _uses(False, "an eval_dataset is always evaluated before the first step")
    eval_do_concat_batches: Any = _inert(True, "evaluation only")
    eval_use_gather_object: Any = _inert(False, "evaluation only")
    eval_accumulation_steps: Any = _inert(None, "evaluation only")
    include_for_metrics: list[str] = _inert_list([], "evaluation only")
    batch_eval_metrics: Any = _inert(False, "evaluation only")
    save_only_model: Any = _inert(False, "checkpoints always hold what an exact resume needs")
    save_strategy: str = _choices("steps", ("steps", "no"), "no: `checkpoint_every` 0")
    save_steps: int = _sets("checkpoint_every", 500, "`checkpoint_every`")
    save_on_each_node: Any = _inert(False, "rank 0 writes the run directory")
    save_total_limit: Any = _inert(None, "checkpoints/ keeps what resume needs")
    enable_jit_checkpoint: Any = _inert(False, SPEED)
    push_to_hub: Any = _refused(False, HUB)
    hub_token: Any = _inert(None, HUB)
    hub_private_repo: Any = _inert(None, HUB)
    hub_model_id: Any = _inert(None, HUB)
    hub_strategy: Any = _inert("every_save", HUB)
    hub_always_push: Any = _inert(False, HUB)
    hub_revision: Any = _inert(None, HUB)
    load_best_model_at_end: Any = _refused(False, "the final model is the last step's")
    metric_for_best_model: Any = _inert(None, "the final model is the last step's")
    greater_is_better: Any = _inert(None, "the final model is the last step's")
    ignore_data_skip: Any = _inert(False, "a resumed run redraws the same prompts exactly")
    restore_callback_states_from_checkpoint: Any = _inert(False, "callbacks")
    full_determinism: Any = _inert(False, "fastes runs are deterministic for a seed")
    seed: int = _sets("seed", 42)
    data_seed: Any = _refused(None, SAMPLING)
    use_cpu: bool = _uses(False, "`device`: else CUDA when torch sees one")
    accelerator_config: Any = _inert(None, PARALLEL)
    parallelism_config: Any = _refused(None, PARALLEL)
    dataloader_drop_last: Any = _inert(False, SAMPLING)
    dataloader_num_workers: Any = _inert(0, SPEED)
    dataloader_pin_memory: Any = _inert(True, SPEED)
    dataloader_persistent_workers: Any = _inert(False, SPEED)
    dataloader_prefetch_factor: Any = _inert(None, SPEED)
    dataloader_multiprocessing_context: Any = _inert(None, SPEED)
    dataloader_in_order: Any = _inert(True, SPEED)
    remove_unused_columns: Any = _inert(False, "every column reaches the reward functions")
    label_names: Any = _inert(None, "no labels")
    train_sampling_strategy: Any = _refused("random", SAMPLING)
    length_column_name: Any = _inert("length", SAMPLING)
    ddp_find_unused_parameters: Any = _inert(None, PARALLEL)
    ddp_bucket_cap_mb: Any = _inert(None, PARALLEL)
    ddp_broadcast_buffers: Any = _inert(None, PARALLEL)
    ddp_static_graph: Any = _inert(None, PARALLEL)
    ddp_backend: Any = _inert(None, PARALLEL)
    ddp_timeout: int = _sets("collective_timeout", 1800, "`collective_timeout` (seconds)")
    fsdp: Any = _refused(None, PARALLEL)
    fsdp_config: Any = _refused(None, PARALLEL)
    deepspeed: Any = _refused(None, PARALLEL)
    debug: Any = _inert("", LOGGING)
    skip_memory_metrics: Any = _inert(True, LOGGING)
    do_train: Any = _inert(False, "scripts' flags; the trainer does what it is called for")
    do_eval: Any = _inert(False, "scripts' flags; the trainer does what it is called for")
    do_predict: Any = _inert(False, "scripts' flags; the trainer does what it is called for")
    resume_from_checkpoint: Any = _inert(None, "use train(resume_from_checkpoint=True)")
    local_rank: Any = _inert(-1, PARALLEL)

    # --- TRL's GRPOConfig: model and data -----------------------------------------------------------
    model_init_kwargs: Any = _uses(None, "`dtype`/`torch_dtype` only; other keys are refused")
    trust_remote_code: Any = _refused(False, "fastes loads models without remote code")
    router_aux_loss_coef: Any = _refused(None, "no auxiliary loss")
    disable_dropout: Any = _refused(False, "dropout is as the model has it")
    cast_lm_head_to_fp32: Any = _refused(False, "the lm_head runs in the model's dtype")
    shuffle_dataset: Any = _refused(True, SAMPLING)
    pad_to_multiple_of: Any = _inert("auto", "padding changes no token's result; " + SPEED)
    ds3_gather_for_generation: Any = _inert(True, PARALLEL)

    # --- generation ---------------------------------------------------------------------------------
    num_generations: int = 0  # each subclass
    num_generations_eval: Any = _inert(None, "evaluate(num_samples=n) samples n per prompt")
    max_completion_length: int = _sets("max_new_tokens", 512, "`max_new_tokens`")
    generation_batch_size: Any = _refused(None, GRPO_ONLY)
    steps_per_generation: Any = _refused(None, GRPO_ONLY)
    temperature: float = 0.0  # each subclass
    top_p: float = 1.0  # each subclass
    top_k: int = _uses(0, "`es.top_k` / `grpo.top_k` (0: off)")
    min_p: float | None = _uses(None, "`es.min_p` / `grpo.min_p` (None: off)")
    generation_kwargs: Any = _uses(None, "overrides the sampling fields: " + ", ".join(GENERATION_KWARGS))
    chat_template_kwargs: Any = _refused(None, "the chat template is applied without extra arguments")
    repetition_penalty: float = _uses(1.0, "`es.repetition_penalty` / `grpo.repetition_penalty` (1: off)")
    cache_implementation: Any = _inert(None, SPEED)
    use_vllm: bool = _uses(False, "True: refused without vLLM; with it, a warning (transformers generates)")
    vllm_mode: Any = _inert("colocate", "vLLM is not used")
    vllm_model_impl: Any = _inert("vllm", "vLLM is not used")
    vllm_enable_sleep_mode: Any = _inert(False, "vLLM is not used")
    vllm_structured_outputs_regex: Any = _refused(None, "no constrained decoding")
    vllm_server_base_url: Any = _inert(None, "vLLM is not used")
    vllm_server_host: Any = _inert("0.0.0.0", "vLLM is not used")
    vllm_server_port: Any = _inert(8000, "vLLM is not used")
    vllm_server_timeout: Any = _inert(240.0, "vLLM is not used")
    vllm_group_port: Any = _inert(51216, "vLLM is not used")
    vllm_gpu_memory_utilization: Any = _inert(0.3, "vLLM is not used")
    vllm_max_model_length: Any = _inert(None, "vLLM is not used")
    vllm_tensor_parallel_size: Any = _inert(1, "vLLM is not used")

    # --- GRPO's loss (refused in ES; GRPOConfig honours what fastes' GRPO implements) ----------------
    beta: float = _refused(0.0, GRPO_ONLY)
    num_iterations: int = _refused(1, GRPO_ONLY)
    epsilon: float = _refused(0.2, GRPO_ONLY)
    delta: Any = _refused(None, GRPO_ONLY)
    epsilon_high: float | None = _refused(None, GRPO_ONLY)
    sapo_temperature_neg: Any = _refused(1.05, GRPO_ONLY)
    sapo_temperature_pos: Any = _refused(1.0, GRPO_ONLY)
    vespo_k_pos: Any = _refused(2.0, GRPO_ONLY)
    vespo_lambda_pos: Any = _refused(3.0, GRPO_ONLY)
    vespo_k_neg: Any = _refused(3.0, GRPO_ONLY)
    vespo_lambda_neg: Any = _refused(2.0, GRPO_ONLY)
    importance_sampling_level: Any = _refused("token", GRPO_ONLY)
    reward_weights: list[float] | None = _uses(None, "the weights of the reward functions")
    multi_objective_aggregation: Any = _refused("sum_then_normalize", "the weighted sum is the reward")
    scale_rewards: Any = _refused("group", GRPO_ONLY)
    loss_type: str = _refused("dapo", GRPO_ONLY)
    mask_truncated_completions: bool = _refused(False, GRPO_ONLY)
    sync_ref_model: Any = _refused(False, GRPO_ONLY)
    ref_model_mixup_alpha: Any = _refused(0.6, GRPO_ONLY)
    ref_model_sync_steps: Any = _refused(512, GRPO_ONLY)
    top_entropy_quantile: Any = _refused(1.0, GRPO_ONLY)
    entropy_coef: Any = _refused(0.0, GRPO_ONLY)
    use_adaptive_entropy: Any = _refused(False, GRPO_ONLY)
    entropy_coef_min: Any = _refused(0.0, GRPO_ONLY)
    entropy_coef_max: Any = _refused(1.0, GRPO_ONLY)
    entropy_coef_delta: Any = _refused(0.005, GRPO_ONLY)
    entropy_target: Any = _refused(0.2, GRPO_ONLY)
    max_tool_calling_iterations: Any = _refused(None, "no tool calling")
    vllm_importance_sampling_correction: Any = _inert(True, "vLLM is not used")
    vllm_importance_sampling_mode: Any = _inert("sequence_mask", "vLLM is not used")
    vllm_importance_sampling_clip_max: Any = _inert(3.0, "vLLM is not used")
    vllm_importance_sampling_clip_min: Any = _inert(None, "vLLM is not used")
    vllm_importance_sampling_cap: Any = _inert(None, "vLLM is not used")
    off_policy_mask_threshold: Any = _refused(None, GRPO_ONLY)
    use_bias_correction_kl: bool = _refused(True, GRPO_ONLY)

    # --- logging --------------------------------------------------------------------------------------
    log_completions: Any = _inert(False, "metrics.jsonl holds the rewards; completions are not logged")
    log_multimodal: Any = _inert(True, LOGGING)
    num_completions_to_print: Any = _inert(None, LOGGING)
    log_unique_prompts: Any = _inert(False, LOGGING)
    log_completions_hub_repo: Any = _inert(None, HUB)
    use_transformers_continuous_batching: Any = _inert(False, SPEED)
    transformers_continuous_batching_config: Any = _inert(None, SPEED)
    use_transformers_paged: Any = _inert(False, SPEED)

    # --- fastes only ----------------------------------------------------------------------------------
    overwrite_output_dir: bool = _uses(False, "fastes: replace a previous run in output_dir")
    dtype: str = _sets("dtype", note="fastes: the weights' dtype when the model is loaded from a path")
    backend: str = _sets("backend", note="fastes: noise kernels (auto, triton, cpu, torch)")
    threads: int = _sets("threads", note="fastes: torch CPU threads (0: automatic)")
    reward_timeout: float = _sets("reward_timeout", note="fastes: seconds one reward function call may take")

    # TrainConfig keys set in overrides() from a field of another meaning, named in error messages.
    SPECIAL: ClassVar[dict[str, str]] = {
        "progress": "disable_tqdm",
        "device": "use_cpu",
        "eval_every": "eval_steps",
        **{f"{section}.{name}": name for section in ("es", "grpo") for name in ("top_k", "min_p")},
        **{f"{section}.repetition_penalty": "repetition_penalty" for section in ("es", "grpo")},
    }
    ALGORITHM: ClassVar[str] = ""

    def __post_init__(self) -> None:
        self.check()
        for name, value, f in self._changed("inert"):
            warnings.warn(f"{name}={value!r} changes nothing in fastes: {f.metadata['note']}", stacklevel=3)

    def _changed(self, outcome: str) -> list[tuple[str, Any, Any]]:
        """(name, value, field) of the fields of `outcome` set to something other than their default."""
        changed = []
        for f in fields(self):
            if f.metadata.get("outcome") != outcome:
                continue
            default = f.default if f.default is not MISSING else f.default_factory()
            value = getattr(self, f.name)
            if not _same(value, default):
                changed.append((f.name, value, f))
        return changed

    def check(self) -> None:
        """Every field holds a value of its annotated type (a bool a bool: "no" is truthy and would
        overwrite a run), refused fields hold their default, and choices one of theirs. Run at
        construction and again when the config is used, since fields can be set afterwards."""
        for f in fields(self):
            kinds = _FIELD_TYPES[f.type]
            value = getattr(self, f.name)
            if not any(_is(value, kind) for kind in kinds):
                wanted = " or ".join(_TYPE_WORDS[kind] for kind in kinds)
                raise ConfigError(f"{f.name}: must be {wanted}, got {type(value).__name__} {value!r}")
            allowed = f.metadata.get("allowed")
            if allowed is not None and value not in allowed:
                raise ConfigError(
                    f"{f.name}: {value!r} is not supported by {type(self).__name__} ({f.metadata['note']}); "
                    f"use one of {', '.join(map(repr, allowed))}"
                )
        for name, value, f in self._changed("refused"):
            raise ConfigError(
                f"{name}={value!r} is not supported by {type(self).__name__} ({f.metadata['note']}); "
                "remove it to run"
            )
        if self.use_vllm and importlib.util.find_spec("vllm") is None:
            raise ConfigError(
                "use_vllm=True: vLLM is not installed (fastes generates with transformers); "
                "set use_vllm=False"
            )
        if self.use_vllm:
            warnings.warn("use_vllm=True changes nothing in fastes: transformers generates", stacklevel=3)
        if self.bf16 and self.fp16:
            raise ConfigError("bf16 and fp16 are both True; choose one")
        generation = self.generation_kwargs or {}
        unknown = sorted(set(generation) - set(GENERATION_KWARGS)) if isinstance(generation, dict) else None
        if unknown != []:
            raise ConfigError(
                f"generation_kwargs: fastes samples with {', '.join(GENERATION_KWARGS)}, got "
                f"{unknown if unknown is not None else generation!r}; remove the others"
            )
        kwargs = self.model_init_kwargs or {}
        if not isinstance(kwargs, dict) or set(kwargs) - {"dtype", "torch_dtype"}:
            raise ConfigError(
                f"model_init_kwargs: fastes takes only 'dtype' (or 'torch_dtype') there, got {kwargs!r}; "
                "load the model yourself and pass it as `model`"
            )

    # The older name of check(), kept because ESTrainer users called it.
    check_types = check

    @classmethod
    def keys(cls) -> dict[str, str]:
        """{field: TrainConfig key} of the fields that set one key one-to-one (the others: overrides())."""
        return {f.name: f.metadata["sets"] for f in fields(cls) if "sets" in f.metadata}

    def load_dtype(self) -> str:
        """The dtype a model loaded from a path gets: bf16/fp16/model_init_kwargs, else `dtype`."""
        kwargs = self.model_init_kwargs or {}
        chosen = kwargs.get("dtype", kwargs.get("torch_dtype"))
        if isinstance(chosen, torch.dtype):
            chosen = str(chosen).removeprefix("torch.")
        if chosen not in (None, "auto"):
            return str(chosen)
        return "bfloat16" if self.bf16 else "float16" if self.fp16 else self.dtype

    def steps(self, rows: int, prompts_per_step: int) -> int:
        """max_steps, or with max_steps = -1 the steps of num_train_epochs passes over `rows` prompts."""
        if self.max_steps > 0:
            return self.max_steps
        if not self.num_train_epochs > 0:
            raise ConfigError(
                f"num_train_epochs: must be > 0 when max_steps is -1, got {self.num_train_epochs}"
            )
        return max(1, math.ceil(self.num_train_epochs * rows / max(1, prompts_per_step)))

    def overrides(self, rows: int) -> dict[str, Any]:
        """The TrainConfig keys this config sets (fastes.run.config.load_config's overrides), for a train
        dataset of `rows` prompts."""
        values = {key: getattr(self, name) for name, key in self.keys().items()}
        device = "cuda" if torch.cuda.is_available() and not self.use_cpu else "cpu"
        eval_every = 0
        if self.eval_strategy == "steps":
            eval_every = self.eval_steps if self.eval_steps is not None else self.logging_steps
        values.update(
            algorithm=self.ALGORITHM,
            task="dataset",
            report_to=_report_to(self.report_to),
            progress=not self.disable_tqdm,
            device=device,
            dtype=self.load_dtype(),
            eval_every=_whole(eval_every, "eval_steps"),
        )
        if self.save_strategy == "no":
            values["checkpoint_every"] = 0
        return values

    def sampling(self, section: str) -> dict[str, Any]:
        """The [es] or [grpo] sampling keys from top_k, min_p, repetition_penalty and generation_kwargs
        (which override the fields, as in TRL; do_sample=False means greedy: temperature 0)."""
        settings: dict[str, Any] = {
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
        }
        values = {}
        for key, value in (self.generation_kwargs or {}).items():
            if key == "max_new_tokens":
                values["max_new_tokens"] = value
            elif key == "do_sample":
                if value is False:
                    settings["temperature"] = 0.0
            else:
                settings[key] = value
        settings["min_p"] = settings["min_p"] or 0.0  # TRL's None: off, 0 in the run config
        values.update({f"{section}.{key}": value for key, value in settings.items()})
        return values

    @classmethod
    def public_name(cls, key: str) -> str:
        """The field that sets TrainConfig key `key`, for error messages; the key itself if none does."""
        names = {v: k for k, v in cls.keys().items()}
        names.update(cls.SPECIAL)
        return names.get(key, key)

    @classmethod
    def outcomes(cls) -> dict[str, tuple[str, str]]:
        """{field: (outcome, note)}: what this config does with each field (docs/trainer.md's table)."""
        table = {}
        for f in fields(cls):
            note, allowed = f.metadata["note"], f.metadata.get("allowed")
            if allowed:
                note = f"{' or '.join(f'`{v!r}`' for v in allowed)}; {note}"
            table[f.name] = (f.metadata["outcome"], note)
        return table


def _same(value: Any, default: Any) -> bool:
    try:
        return value is default or bool(value == default)
    except Exception:  # noqa: BLE001 - an object whose == fails or is ambiguous (an array) differs
        return False


def _whole(value: float, name: str) -> int:
    if isinstance(value, float) and not value.is_integer():
        raise ConfigError(f"{name}: fastes counts whole steps, got {value}; use a whole number")
    return int(value)


# The annotations of the config fields (strings, under `from __future__ import annotations`) and the
# kinds of value each accepts; _is says what a kind is.
_FIELD_TYPES: dict[str, tuple[str, ...]] = {
    "Any": ("any",),
    "str": ("str",),
    "int": ("int",),
    "float": ("float",),
    "bool": ("bool",),
    "bool | None": ("bool", "None"),
    "float | None": ("float", "None"),
    "int | None": ("int", "None"),
    "list[str]": ("list[str]",),
    "list[float] | None": ("list[float]", "None"),
    "str | list[str]": ("str", "list[str]"),
}
_TYPE_WORDS = {
    "any": "anything",
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
        "any": lambda: True,
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
    """ES settings under TRL's names where the concept is the same; ES's own below."""

    max_steps: int = _uses(_default_of("es.iterations"), "`es.iterations`; -1: from `num_train_epochs`")
    # fastes' ES defaults (those of `fastes train`) where TRL's suit GRPO on a GPU:
    max_completion_length: int = _sets("max_new_tokens", note="`max_new_tokens` (0: automatic)")
    logging_steps: int = _sets("logging_steps", note="`logging_steps`: TensorBoard gets every this many")
    save_steps: int = _sets("checkpoint_every", note="`checkpoint_every`")
    seed: int = _sets("seed")
    learning_rate: float = _sets("es.lr", note="`es.lr`: alpha of the ES step")
    # ES's default schedule is constant (TRL's is linear): a drop-in keeps the ES step size it was given
    lr_scheduler_type: str = _sets("es.lr_scheduler_type", note="`es.lr_scheduler_type`: over the iterations")
    warmup_steps: float = _sets("es.warmup_steps", note="`es.warmup_steps` (< 1: a fraction)")
    per_device_train_batch_size: int = _sets("batch_size", note="`batch_size`: prompts per iteration")
    weight_decay: float = _sets("es.weight_decay", note="`es.weight_decay`: decoupled, on the ES step")
    num_generations: int = _sets(
        "es.num_generations", note="`es.num_generations`: samples per prompt per member"
    )
    temperature: float | None = _uses(
        None, "`es.temperature`; None: greedy for one sample, TRL's 1.0 for several"
    )
    top_p: float = _sets("es.top_p", 1.0, "`es.top_p`")
    # ES only:
    population_size: int = _sets("es.population")
    sigma: float = _sets("es.sigma", note="noise scale")
    shaping: str = _sets("es.shaping", note="centered_rank, zscore, group_zscore, raw")
    antithetic: bool = _sets("es.antithetic", note="mirrored noise pairs")
    stochastic_rounding: bool = _sets("es.stochastic_rounding", note="bf16/fp16 updates")
    eval_mode: str = _sets("es.eval_mode", note="materialised, virtual, lowrank, member")
    materialise_mb: float = _sets("es.materialise_mb")
    noise_type: str = _sets("es.noise_type", note="full or lowrank")
    rank: int = _sets("es.rank", note="rank of low-rank noise")
    noise: str = _sets("es.noise", note="gaussian or rademacher")
    evolve: str = _sets("es.evolve", note="regular expression of the evolved weights")
    include_embeddings: bool = _sets("es.include_embeddings")
    include_norms: bool = _sets("es.include_norms")
    include_biases: bool = _sets("es.include_biases")

    ALGORITHM: ClassVar[str] = "es"
    SPECIAL: ClassVar[dict[str, str]] = {
        **_TrainerConfig.SPECIAL,
        "es.iterations": "max_steps",
        "es.temperature": "temperature",
    }

    def overrides(self, rows: int) -> dict[str, Any]:
        values = super().overrides(rows)
        values["es.iterations"] = self.steps(rows, self.per_device_train_batch_size)
        greedy = self.num_generations == 1
        values["es.temperature"] = (0.0 if greedy else 1.0) if self.temperature is None else self.temperature
        values.update(self.sampling("es"))
        return values


@dataclass
class GRPOConfig(_TrainerConfig):
    """GRPO settings with TRL's names, meanings and defaults. per_device_train_batch_size counts
    completions, as in TRL: each step samples per_device_train_batch_size / num_generations prompts."""

    learning_rate: float = _sets("grpo.lr", 1e-6, "`grpo.lr` (AdamW)")
    per_device_train_batch_size: int = _uses(8, "completions per micro-batch (see below)")
    lr_scheduler_type: str = _sets("grpo.lr_scheduler_type", "linear")
    warmup_steps: float = _sets("grpo.warmup_steps", 0, "`grpo.warmup_steps` (< 1: a fraction)")
    optim: str = _choices("adamw_torch_fused", ("adamw_torch_fused", "adamw_torch"), "torch.optim.AdamW")
    weight_decay: float = _sets("grpo.weight_decay", note="`grpo.weight_decay` (AdamW)")
    adam_beta1: float = _sets("grpo.adam_beta1", 0.9)
    adam_beta2: float = _sets("grpo.adam_beta2", 0.999)
    adam_epsilon: float = _sets("grpo.adam_epsilon", 1e-8)
    gradient_accumulation_steps: int = _sets("grpo.gradient_accumulation_steps", 1)
    max_grad_norm: float = _sets("grpo.max_grad_norm", 1.0)
    num_generations: int = _sets("grpo.num_generations", 8)
    generation_batch_size: int | None = _uses(None, "completions per step (None: from the others)")
    steps_per_generation: int | None = _uses(None, "`grpo.steps_per_generation` (None: from the others)")
    temperature: float = _sets("grpo.temperature", 1.0)
    top_p: float = _sets("grpo.top_p", 1.0)
    beta: float = _sets("grpo.beta", 0.0)
    num_iterations: int = _sets("grpo.num_iterations", 1)
    epsilon: float = _sets("grpo.epsilon", 0.2)
    delta: float | None = _uses(None, "`grpo.delta` (None: no two-sided clipping)")
    epsilon_high: float | None = _uses(None, "`grpo.epsilon_high` (None: `epsilon`)")
    sapo_temperature_neg: float = _sets("grpo.sapo_temperature_neg", 1.05)
    sapo_temperature_pos: float = _sets("grpo.sapo_temperature_pos", 1.0)
    vespo_k_pos: float = _sets("grpo.vespo_k_pos", 2.0)
    vespo_lambda_pos: float = _sets("grpo.vespo_lambda_pos", 3.0)
    vespo_k_neg: float = _sets("grpo.vespo_k_neg", 3.0)
    vespo_lambda_neg: float = _sets("grpo.vespo_lambda_neg", 2.0)
    importance_sampling_level: str = _sets("grpo.importance_sampling_level", "token")
    multi_objective_aggregation: str = _sets("grpo.multi_objective_aggregation", "sum_then_normalize")
    scale_rewards: Any = _uses("group", "`grpo.scale_rewards`: True = group, False = none, or batch")
    loss_type: str = _sets("grpo.loss_type", "dapo")
    mask_truncated_completions: bool = _sets("grpo.mask_truncated_completions", False)
    sync_ref_model: bool = _sets("grpo.sync_ref_model", False)
    ref_model_mixup_alpha: float = _sets("grpo.ref_model_mixup_alpha", 0.6)
    ref_model_sync_steps: int = _sets("grpo.ref_model_sync_steps", 512)
    top_entropy_quantile: float = _sets("grpo.top_entropy_quantile", 1.0)
    entropy_coef: float = _sets("grpo.entropy_coef", 0.0)
    use_adaptive_entropy: Any = _refused(False, ADAPTIVE)
    entropy_coef_min: Any = _refused(0.0, ADAPTIVE)
    entropy_coef_max: Any = _refused(1.0, ADAPTIVE)
    entropy_coef_delta: Any = _refused(0.005, ADAPTIVE)
    entropy_target: Any = _refused(0.2, ADAPTIVE)
    off_policy_mask_threshold: float | None = _uses(None, "`grpo.off_policy_mask_threshold` (None: off)")
    use_bias_correction_kl: bool = _sets("grpo.use_bias_correction_kl", True)

    ALGORITHM: ClassVar[str] = "grpo"
    SPECIAL: ClassVar[dict[str, str]] = {
        **_TrainerConfig.SPECIAL,
        "batch_size": "per_device_train_batch_size",
        "grpo.steps": "max_steps",
        "grpo.epsilon_high": "epsilon_high",
        "grpo.delta": "delta",
        "grpo.off_policy_mask_threshold": "off_policy_mask_threshold",
        "grpo.steps_per_generation": "steps_per_generation",
        "grpo.scale_rewards": "scale_rewards",
    }

    def overrides(self, rows: int) -> dict[str, Any]:
        values = super().overrides(rows)
        for name in ("epsilon_high", "delta", "off_policy_mask_threshold"):  # None: off, 0 in [grpo]
            values[f"grpo.{name}"] = 0.0 if getattr(self, name) is None else getattr(self, name)
        if self.off_policy_mask_threshold == 0:
            raise ConfigError(
                "off_policy_mask_threshold: 0 is 'off' in fastes; use None for off, or a positive threshold"
            )
        scale = self.scale_rewards
        values["grpo.scale_rewards"] = {True: "group", False: "none"}.get(scale, scale)
        prompts, per_generation = self._batches()
        values["batch_size"] = prompts
        values["grpo.steps_per_generation"] = per_generation
        values["grpo.steps"] = self._generations(rows, prompts, per_generation)
        values.update(self.sampling("grpo"))
        return values

    def _batches(self) -> tuple[int, int]:
        """(prompts per step, micro-batches per step) from TRL's batch fields. A fastes step is one
        generation: generation_batch_size completions (per_device_train_batch_size x
        steps_per_generation, which defaults to gradient_accumulation_steps), whole groups of
        num_generations, trained in micro-batches of per_device_train_batch_size completions."""
        per_device, group = self.per_device_train_batch_size, self.num_generations
        if not (isinstance(group, int) and group >= 1 and per_device >= 1):
            return per_device, 1  # the run config names the value that is wrong
        if self.steps_per_generation is not None and self.generation_batch_size is not None:
            raise ConfigError(
                "steps_per_generation and generation_batch_size are both set; set one (as TRL requires)"
            )
        per_generation = self.steps_per_generation or self.gradient_accumulation_steps
        completions = per_device * per_generation
        if self.generation_batch_size is not None:
            completions = self.generation_batch_size
            if completions % per_device:
                raise ConfigError(
                    f"generation_batch_size: {completions} is not a multiple of per_device_train_batch_size "
                    f"= {per_device}; make it one"
                )
            per_generation = completions // per_device
        if completions % group:
            what = "per_device_train_batch_size" if completions == per_device else "generation_batch_size"
            raise ConfigError(
                f"{what}: {completions} completions are not whole groups of num_generations = {group}; "
                f"make it a multiple of {group} (as TRL requires)"
            )
        return completions // group, per_generation

    def _generations(self, rows: int, prompts: int, per_generation: int) -> int:
        """fastes steps (generations): TRL's max_steps counts optimizer steps, and a generation takes
        steps_per_generation x num_iterations micro-batches, an optimizer step every
        gradient_accumulation_steps of them; with max_steps = -1, epochs over the prompts."""
        if self.max_steps <= 0:
            return self.steps(rows, prompts)
        micro = self.max_steps * self.gradient_accumulation_steps
        per_step = per_generation * self.num_iterations
        if micro % per_step:
            raise ConfigError(
                f"max_steps: {self.max_steps} optimizer steps of {self.gradient_accumulation_steps} "
                f"micro-batches are not whole generations of {per_step} micro-batches "
                "(steps_per_generation x num_iterations); make them so"
            )
        return micro // per_step


def fields_table() -> str:
    """docs/trainer.md's table: every field, and what GRPOTrainer and ESTrainer do with it."""
    grpo, es = GRPOConfig.outcomes(), ESConfig.outcomes()
    lines = ["| field | GRPOConfig | ESConfig |", "|---|---|---|"]
    for name in dict.fromkeys([*grpo, *es]):
        cells = [_cell(table.get(name)) for table in (grpo, es)]
        lines.append(f"| `{name}` | {cells[0]} | {cells[1]} |")
    return "\n".join(lines) + "\n"


def _cell(entry: tuple[str, str] | None) -> str:
    if entry is None:
        return "(not a field)"
    outcome, note = entry
    return f"**{outcome}**: {note}" if note else f"**{outcome}**"


if __name__ == "__main__":  # python -m fastes.trainer.configs > the table in docs/trainer.md
    print(fields_table(), end="")
