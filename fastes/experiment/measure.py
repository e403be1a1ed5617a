"""Measurements on one model: greedy and sampled correctness, entropy of its own samples, token KL to
another model, perplexity of a fixed corpus. Prompts are formatted here or by the caller (format_prompt)."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..analysis.drift import masked_nll, perplexity, token_kl
from ..analysis.entropy import token_entropy
from ..generation import Generation, generate_in_chunks
from ..models import format_prompt
from ..tasks import Example, Task

ROWS_PER_CALL = 512  # generated rows per generate() call: bounds a large model's memory


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
    gen = generate_in_chunks(
        model,
        tokenizer,
        prompts,
        rows_per_call=ROWS_PER_CALL,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        seed=seed,
        num_return_sequences=samples,
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
    gen = generate_in_chunks(
        model,
        tokenizer,
        prompts,
        rows_per_call=ROWS_PER_CALL,
        max_new_tokens=max_new_tokens,
        temperature=1.0,
        seed=seed,
        num_return_sequences=samples,
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
    rows_per_call: int = ROWS_PER_CALL,
) -> list[int]:
    """For each example, 1 when the greedy completion has the right answer, else 0."""
    prompts = [format_prompt(tokenizer, ex.prompt) for ex in examples]
    gen = generate_in_chunks(
        model, tokenizer, prompts, max_new_tokens=max_new_tokens, rows_per_call=rows_per_call
    )
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
    rows_per_call: int = ROWS_PER_CALL,
) -> list[int]:
    """For each example, how many of `samples` completions at temperature 1 are correct."""
    prompts = [format_prompt(tokenizer, ex.prompt) for ex in examples]
    gen = generate_in_chunks(
        model,
        tokenizer,
        prompts,
        max_new_tokens=max_new_tokens,
        rows_per_call=rows_per_call,
        temperature=1.0,
        seed=seed,
        num_return_sequences=samples,
    )
    return [
        int(sum(task.score(ex, gen.texts[i * samples + j]).answer for j in range(samples)))
        for i, ex in enumerate(examples)
    ]
