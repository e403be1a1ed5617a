"""Batched text generation through Hugging Face `model.generate`, returning completions and token counts.

Randomness: sampling draws from torch's global RNG (that is what `generate` uses). With a `seed`
we seed it inside `torch.random.fork_rng`, which restores the caller's RNG state afterwards: the
same seed, prompts and model give the same completions, and the caller's RNG is left untouched.
Without a seed, the global RNG is used and advanced as usual.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase


@dataclass
class Generation:
    """What one `generate` call produced, one row per (prompt, sample), grouped by prompt.

    Row i * num_return_sequences + j is sample j of prompt i.
    """

    texts: list[str]  # decoded completions, without the prompt or special tokens
    completion_ids: list[list[int]]  # generated token ids, up to and including EOS when it was reached
    prompt_ids: list[list[int]]  # the unpadded prompt token ids of each row (for GRPO log-probs)

    @property
    def lengths(self) -> list[int]:
        return [len(ids) for ids in self.completion_ids]

    @property
    def num_tokens(self) -> int:
        """Total number of generated tokens (for tokens/s)."""
        return sum(self.lengths)


@torch.inference_mode()
def generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    num_return_sequences: int = 1,
) -> Generation:
    """Complete every prompt: greedy when temperature == 0, else temperature / top-p sampling.

    Each row stops at EOS (or after max_new_tokens). Prompts should already be formatted
    (see fastes.models.format_prompt). With `seed`, the result is deterministic.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    sample = temperature > 0
    if not sample and num_return_sequences > 1:
        raise ValueError("greedy decoding gives identical samples; use temperature > 0 for several")

    if not prompts:
        return Generation(texts=[], completion_ids=[], prompt_ids=[])

    # A chat template already writes the special tokens it wants (e.g. <bos>), so don't add them twice.
    add_special = not getattr(tokenizer, "chat_template", None)
    enc = tokenizer(
        prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=add_special
    ).to(model.device)

    # A fresh config rather than the checkpoint's, so a real model's suggested top_k / penalties
    # don't silently change the sampling we were asked for. Only its EOS ids are kept.
    eos = model.generation_config.eos_token_id
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=sample,
        temperature=temperature if sample else None,
        top_p=top_p if sample else None,
        num_return_sequences=num_return_sequences,
        eos_token_id=eos if eos is not None else tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        use_cache=True,
    )
    # Without a seed, draw from (and advance) the caller's RNG as usual; with one, fork it.
    devices = [model.device] if model.device.type != "cpu" else []
    with torch.random.fork_rng(devices=devices, enabled=seed is not None):
        if seed is not None:
            torch.manual_seed(seed)
        out = model.generate(**enc, generation_config=config)

    completion = out[:, enc["input_ids"].shape[1] :]
    eos_ids = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    completion_ids = [_until_eos(row, eos_ids) for row in completion.tolist()]
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)

    prompt_ids = [
        ids[mask.bool()].tolist() for ids, mask in zip(enc["input_ids"], enc["attention_mask"], strict=True)
    ]
    prompt_ids = [ids for ids in prompt_ids for _ in range(num_return_sequences)]
    return Generation(texts=texts, completion_ids=completion_ids, prompt_ids=prompt_ids)


def _until_eos(ids: list[int], eos_ids: list[int]) -> list[int]:
    """Cut a generated row after its first EOS (what follows is padding)."""
    for i, tok in enumerate(ids):
        if tok in eos_ids:
            return ids[: i + 1]
    return ids
