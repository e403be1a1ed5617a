"""Batched text generation, returning completions and token counts.

Decoding is fastes' own loop (fastes.models.decoding): the inputs, positions and cache of transformers'
greedy `generate`, with finished rows leaving the batch. Sampling is fastes' own too (`RowSampler`):
every token is drawn from the softmax of the logits at the given temperature, cut by top-k, top-p and
min-p when they are set, with the semantics and in the order of transformers' warpers, and nothing else
(nothing a checkpoint's generation_config suggests). A repetition penalty, when set, is transformers'
own processor on the raw logits, before the sampler and in greedy decoding alike. The draw for row r
at step t is the inverse CDF at a Philox uniform of (seed, r, t), so a row's draws do not depend on
which other rows share the batch: with the same seed, the prompts generated in one call, in chunks or
spread over processes (`first_row`) get the same uniforms. Their completions agree as far as the
logits do: a CPU GEMM may round a row differently at another batch size, and on a real model that
changes a sampled token now and then (docs/results/sampling-across-batch-shapes-2026-12-05.md).
Without a seed, one is drawn from torch's global RNG (which it advances).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
from transformers import (
    BatchEncoding,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    RepetitionPenaltyLogitsProcessor,
)

from fastes.engine import cpu_memory, cpu_share, noise

from .decoding import decode

STREAM_SAMPLING = 4  # the Philox stream of sampling uniforms (0-3 are the ES noise streams)


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
    first_row: int = 0,
    top_k: int = 0,
    min_p: float | None = None,
    repetition_penalty: float = 1.0,
    stop_at_eos: bool = True,
) -> Generation:
    """Complete every prompt: greedy when temperature == 0, else sampled at the temperature.

    Sampling keeps the top_k most likely tokens (0: all), then the top_p nucleus, then the tokens at least
    min_p times as likely as the most likely one (None or 0: all), as transformers' warpers do. Tokens
    already in a row (prompt and completion) have their logits divided by repetition_penalty (multiplied
    when negative) first, also when decoding greedily; 1 is off.

    Each row stops at EOS (or after max_new_tokens); with stop_at_eos=False every row decodes
    max_new_tokens tokens and its completion keeps them all (what an inference throughput benchmark
    measures: the same work whatever the rows answer). Prompts should already be formatted
    (see fastes.models.loading.format_prompt). With `seed`, the result is deterministic. Row i of this call
    (sample i % num_return_sequences of prompt i // num_return_sequences) samples as row first_row + i:
    give each process its rows' global index and a shared seed to split one batch over processes.

    Finished rows leave the batch (fastes.models.decoding), under population_batched too.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not repetition_penalty > 0:
        raise ValueError(f"repetition_penalty must be > 0 (1: off), got {repetition_penalty}")
    check_cuts(top_p, top_k, min_p)
    sample = temperature > 0
    if not sample and num_return_sequences > 1:
        raise ValueError("greedy decoding gives identical samples; use temperature > 0 for several")

    if not prompts:
        return Generation(texts=[], completion_ids=[], prompt_ids=[])
    cpu_share.share_cores()  # a registered fastes command takes its share of the cores (at most 1/s)
    if model.device.type == "cpu":  # the layers' large activations reuse freed memory (cpu_memory)
        cpu_memory.keep_freed_memory()

    enc = encode_prompts(tokenizer, prompts).to(model.device)

    eos = eos_token_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    # Greedy decoding takes one sequence per row, so the samples of a prompt are rows of their own.
    input_ids = enc["input_ids"].repeat_interleave(num_return_sequences, dim=0)
    mask = enc["attention_mask"].repeat_interleave(num_return_sequences, dim=0)
    # The left padding is no token of the row: leaving it out of the penalty keeps a row's completion
    # independent of its batch.
    padding = (mask == 0).sum(dim=1)
    sampler = None
    if sample:
        if seed is None:
            seed = int(torch.randint(0, 2**62, ()))
        sampler = RowSampler(
            seed, temperature, top_p, first_row, input_ids.shape[0], max_new_tokens, top_k=top_k, min_p=min_p
        )

    def choose(sequences: torch.Tensor, logits: torch.Tensor, rows: torch.Tensor, step: int) -> torch.Tensor:
        """The next token of each row: transformers' repetition penalty on the raw logits (when set),
        then fastes' draw, or the most likely token."""
        if repetition_penalty != 1:
            penalty = RepetitionPenaltyLogitsProcessor(float(repetition_penalty), padding[rows])
            logits = penalty(sequences, logits)
        return sampler.draw(logits, rows, step) if sampler is not None else logits.argmax(dim=-1)

    out = decode(
        model,
        input_ids,
        mask,
        max_new_tokens=max_new_tokens,
        eos_ids=eos if stop_at_eos else [],
        pad_id=pad,
        choose=choose,
    )
    completion_ids = [until_eos(row, eos) if stop_at_eos else row for row in out.tolist()]
    texts = decode_texts(tokenizer, completion_ids)

    prompt_ids = [ids for ids in prompt_token_ids(enc) for _ in range(num_return_sequences)]
    return Generation(texts=texts, completion_ids=completion_ids, prompt_ids=prompt_ids)


def encode_prompts(tokenizer: PreTrainedTokenizerBase, prompts: list[str]) -> BatchEncoding:
    """The prompts' token ids and attention mask, left-padded, as fastes generates from them.

    Each distinct prompt is encoded once: a population's rows repeat the batch's prompts once per member
    (512 rows of 32 prompts in the tiny demo, whose encoding took ~7 ms of a ~110 ms generation against
    0.7 ms for the 32: docs/results/xeon-tiny-2026-12-07.md). Padding to the longest prompt, the rows
    are the same either way."""
    # A chat template already writes the special tokens it wants (e.g. <bos>), so don't add them twice.
    add_special = not getattr(tokenizer, "chat_template", None)
    distinct = list(dict.fromkeys(prompts))
    enc = tokenizer(
        distinct, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=add_special
    )
    if len(distinct) == len(prompts):
        return enc
    position = {prompt: i for i, prompt in enumerate(distinct)}
    rows = torch.tensor([position[prompt] for prompt in prompts])
    return BatchEncoding({name: values[rows] for name, values in enc.items()})


def decode_texts(tokenizer: PreTrainedTokenizerBase, completion_ids: list[list[int]]) -> list[str]:
    """Each completion's text without special tokens, each distinct completion decoded once (a
    population's members often write the same answer)."""
    distinct = list(dict.fromkeys(map(tuple, completion_ids)))
    decoded = tokenizer.batch_decode([list(ids) for ids in distinct], skip_special_tokens=True)
    texts = dict(zip(distinct, decoded, strict=True))
    return [texts[tuple(ids)] for ids in completion_ids]


def prompt_token_ids(enc: BatchEncoding) -> list[list[int]]:
    """Each prompt's token ids from `encode_prompts`, without its left padding (two tensor reads and list
    work: a tensor op per row took 2.5 ms for a tiny ES iteration's 512 rows, this 0.35 ms)."""
    pairs = zip(enc["input_ids"].tolist(), enc["attention_mask"].tolist(), strict=True)
    return [list(itertools.compress(ids, is_token)) for ids, is_token in pairs]


def generate_in_chunks(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    *,
    rows_per_call: int,
    num_return_sequences: int = 1,
    first_row: int = 0,
    **options: Any,
) -> Generation:
    """`generate` over any number of prompts in calls of at most `rows_per_call` rows (one prompt at
    least): every row samples as its index in the whole list, so the completions are one call's as far
    as the batch shapes round the logits alike (see the module's docstring)."""
    per_call = max(1, rows_per_call // num_return_sequences)
    parts = [
        generate(
            model,
            tokenizer,
            prompts[start : start + per_call],
            num_return_sequences=num_return_sequences,
            first_row=first_row + start * num_return_sequences,
            **options,
        )
        for start in range(0, len(prompts), per_call)
    ]
    return Generation(
        texts=[text for part in parts for text in part.texts],
        completion_ids=[ids for part in parts for ids in part.completion_ids],
        prompt_ids=[ids for part in parts for ids in part.prompt_ids],
    )


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The token ids that end a completion: the model's generation config's, else the tokenizer's."""
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    return list(eos) if isinstance(eos, (list, tuple)) else [eos]


def check_cuts(top_p: float, top_k: int, min_p: float | None) -> None:
    """Refuse sampling cuts outside their ranges (ValueError naming the argument)."""
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0: off), got {top_k!r}")
    if min_p is not None and not 0 <= min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1] (0 or None: off), got {min_p}")


class RowSampler:
    """Draws each row's next token from softmax(logits / temperature), cut as transformers' warpers cut it:
    top-k (0: off), then the top-p nucleus (1: off), then min-p (None or 0: off).

    The uniform of row r at step t is Philox (key = seed, counter = (t, r, STREAM_SAMPLING)), r counted
    from `first_row` over the call's `rows` rows.
    """

    def __init__(
        self,
        seed: int,
        temperature: float,
        top_p: float,
        first_row: int,
        rows: int,
        steps: int,
        *,
        top_k: int = 0,
        min_p: float | None = None,
    ) -> None:
        check_cuts(top_p, top_k, min_p)
        self.key = (seed & noise.MASK32, (seed >> 32) & noise.MASK32)
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k
        self.min_p = 0.0 if min_p is None else min_p
        self.first_row = first_row
        self.rows = rows
        self.steps = steps
        self._uniforms: torch.Tensor | None = None

    def uniforms(self, device: torch.device) -> torch.Tensor:
        """[rows, steps] fp32 uniforms in (0, 1): row r's draws for every step."""
        if self._uniforms is None:
            # noise.uniform(key, first_row + r, steps) for every row r, in one call: block b of row r
            # has counter (b, 0, first_row + r).
            blocks = (self.steps + 3) // 4
            c0 = torch.arange(blocks, dtype=torch.int64).repeat(self.rows)
            row_ids = (self.first_row + torch.arange(self.rows, dtype=torch.int64)).repeat_interleave(blocks)
            words = noise.uniform_from_counters(self.key, c0, torch.zeros_like(c0), row_ids, STREAM_SAMPLING)
            self._uniforms = words.view(self.rows, 4 * blocks)[:, : self.steps].to(device)
        return self._uniforms

    def probabilities(self, scores: torch.Tensor) -> torch.Tensor:
        """The distribution sampled from: softmax at the temperature, cut to the top k, to the nucleus and
        by min-p (in transformers' order: each cut sees the distribution the previous one renormalised)."""
        logits = scores.float() / self.temperature
        if self.top_k > 0:
            # The k largest logits, and any tied with the k-th (as TopKLogitsWarper keeps them).
            kth = logits.topk(min(self.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if self.top_p < 1:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of the more likely tokens
            keep = before < self.top_p  # the smallest set whose mass reaches top_p (at least one token)
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs * keep)
            probs = probs / probs.sum(dim=-1, keepdim=True)
        if self.min_p > 0:
            # A threshold relative to the most likely token, which is always kept.
            floor = self.min_p * probs.amax(dim=-1, keepdim=True)
            probs = probs.masked_fill(probs < floor, 0.0)
            probs = probs / probs.sum(dim=-1, keepdim=True)
        return probs

    def draw(self, scores: torch.Tensor, rows: torch.Tensor, step: int) -> torch.Tensor:
        """The tokens drawn at `step` for the call's rows `rows` (indices among its `rows`) from `scores`."""
        u = self.uniforms(scores.device)[rows, step]
        cdf = self.probabilities(scores).cumsum(dim=-1)
        return torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).clamp(max=scores.shape[-1] - 1).flatten()


def until_eos(ids: list[int], eos_ids: list[int]) -> list[int]:
    """Cut a generated row after its first EOS (what follows is padding)."""
    for i, tok in enumerate(ids):
        if tok in eos_ids:
            return ids[: i + 1]
    return ids
