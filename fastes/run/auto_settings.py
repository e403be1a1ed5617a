"""Settings left on "auto" (or 0), chosen from the model, its tokenizer and the machine at the start of a run.

The chosen values replace the automatic ones in the run's config (config.json, run.json), so a resumed
run uses, and compares, exactly what the first start chose, even on a machine with other free memory.

    prompt_style     instruct when prompts go through a chat template, else plain (the character model)
    max_new_tokens   12 for the plain form (answers of a few characters), 48 for the instruct form
    eval_batch_size  rows per evaluation generate call: 256, or fewer where memory is short
    es.noise_type    lowrank for models of SMALL_MODEL_PARAMS or more on CPU (population-batched evaluation
                     at nearly the cost of plain inference; see docs/real_models.md), else full
    es.eval_mode     lowrank with low-rank noise; on CUDA virtual for models of SMALL_MODEL_PARAMS or more;
                     else materialised, or member when not even one member's weights fit in memory. With a
                     PEFT adapter (full noise then): materialised, or member for a LoRA variant (DoRA)
    es.materialise_mb  a quarter of the memory available now (CPU) or of the free GPU memory
    grpo.lr          3e-4 for the tiny models, TRL's 1e-6 for real ones
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch

from fastes.es.params import is_peft_model
from fastes.models.adapters import auto_eval_mode
from fastes.models.loading import uses_chat_template

from .config import TrainConfig, config_from_dict

SMALL_MODEL_PARAMS = 20_000_000  # below: a toy model (the built-in tiny and small ones are < 1M)
ONE_THREAD_PARAMS = 5_000_000  # below: matmuls too small to share, extra threads only synchronise
PLAIN_NEW_TOKENS = 12
INSTRUCT_NEW_TOKENS = 48
EVAL_ROWS = 256
TINY_GRPO_LR = 3e-4
GRPO_LR = 1e-6  # TRL's default
MEMORY_SHARE = 0.25  # of the memory available at the start, for materialised members or eval rows


def torch_threads(params: int, requested: int = 0) -> int:
    """The torch threads a run of a `params`-parameter model takes: `requested` (the config's `threads`)
    when set, one below ONE_THREAD_PARAMS, else the process's current count."""
    return requested or (1 if params < ONE_THREAD_PARAMS else torch.get_num_threads())


def available_memory(device: str) -> int:
    """Bytes free for new tensors now: the GPU's free memory, or the system's MemAvailable."""
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


# Every setting that can be left to fastes, and the value that means "choose for me".
AUTO = {
    "prompt_style": "auto",
    "max_new_tokens": 0,
    "eval_batch_size": 0,
    "es.noise_type": "auto",
    "es.eval_mode": "auto",
    "es.materialise_mb": 0.0,
    "grpo.lr": 0.0,
}


def _get(cfg: TrainConfig, key: str) -> Any:
    section, _, name = key.rpartition(".")
    return getattr(getattr(cfg, section) if section else cfg, name)


def _set(cfg: TrainConfig, key: str, value: Any) -> None:
    section, _, name = key.rpartition(".")
    setattr(getattr(cfg, section) if section else cfg, name, value)


def resolve(
    cfg: TrainConfig, model: torch.nn.Module, tokenizer, saved: dict[str, Any] | None = None
) -> TrainConfig:
    """A copy of `cfg` with every automatic setting chosen (see the module docstring). `saved`, the config
    of the run being resumed, gives its own choices: a resume never chooses again."""
    cfg = dataclasses.replace(cfg, es=dataclasses.replace(cfg.es), grpo=dataclasses.replace(cfg.grpo))
    if saved is not None:
        before = config_from_dict(saved)
        for key, auto in AUTO.items():
            if _get(cfg, key) == auto:
                _set(cfg, key, _get(before, key))
    params = sum(p.numel() for p in model.parameters())
    toy = params < SMALL_MODEL_PARAMS
    if cfg.prompt_style == "auto":
        cfg.prompt_style = "instruct" if uses_chat_template(tokenizer, cfg.chat_template) else "plain"
    if cfg.max_new_tokens == 0:
        cfg.max_new_tokens = INSTRUCT_NEW_TOKENS if cfg.prompt_style == "instruct" else PLAIN_NEW_TOKENS
    memory = available_memory(cfg.device)
    if cfg.eval_batch_size == 0:
        cfg.eval_batch_size = max(1, min(EVAL_ROWS, int(MEMORY_SHARE * memory // row_bytes(model, cfg))))
    es = cfg.es
    cuda = cfg.device.startswith("cuda")
    adapter = is_peft_model(model)  # a PEFT adapter's matrices are small: full noise, materialised
    if es.noise_type == "auto":
        extra_kinds = es.include_embeddings or es.include_norms or es.include_biases
        real_cpu = not toy and not cuda and es.eval_mode == "auto" and not extra_kinds and not adapter
        es.noise_type = "lowrank" if real_cpu or es.eval_mode == "lowrank" else "full"
    if es.materialise_mb == 0:
        es.materialise_mb = float(round(MEMORY_SHARE * memory / 2**20))  # a float field: hashes as one
    if es.eval_mode == "auto":
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        if es.include_embeddings or es.include_norms or es.include_biases:
            es.eval_mode = "member"  # batched evaluation evolves projection matrices only
        elif adapter:
            es.eval_mode = auto_eval_mode(model, es.noise_type)
        elif es.noise_type == "lowrank":
            es.eval_mode = "lowrank"
        elif cuda and not toy:
            es.eval_mode = "virtual"
        else:
            es.eval_mode = "materialised" if weight_bytes <= es.materialise_mb * 2**20 else "member"
    if cfg.grpo.lr == 0:
        cfg.grpo.lr = TINY_GRPO_LR if toy else GRPO_LR
    return cfg


def row_bytes(model: torch.nn.Module, cfg: TrainConfig) -> int:
    """Rough memory of one generated row: its KV cache over the longest sequence, and two logit rows."""
    config = model.config
    layers = getattr(config, "num_hidden_layers", 1)
    heads = getattr(config, "num_key_value_heads", None) or getattr(config, "num_attention_heads", 1)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    positions = 256 + cfg.max_new_tokens  # prompts of up to ~256 tokens
    kv = 2 * layers * heads * head_dim * positions * 4
    return kv + 2 * config.vocab_size * 4
