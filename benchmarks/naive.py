"""The naive ES baselines fastes is measured against (the pattern of the public ES-for-LLMs code).

Noise: per tensor, a fresh torch.Generator seeded with the member seed, `torch.randn` of the tensor's
shape and dtype. (So two tensors of the same shape get the same noise: a bug of the original, kept
because it is what its cost is made of.) Perturb adds sigma * noise in place; restore regenerates the
noise and subtracts it, which in finite precision does not give the weights back exactly. The update is
N passes: per seed, regenerate, scale and add. The ES loop evaluates the members one after another,
each with transformers' `generate` (`transformers_generate`: every row decodes until the batch's last
row stops, where fastes' own loop lets finished rows leave).

These are written plainly on purpose; they are the reference point, not something to optimise.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from unittest import mock

import torch
from transformers import GenerationConfig

from fastes.models import generation
from fastes.models.generation import (
    Generation,
    encode_prompts,
    eos_token_ids,
    prompt_token_ids,
    until_eos,
)
from fastes.tasks import Example, Task


@torch.inference_mode()
def transformers_generate(
    model, tokenizer, prompts: list[str], max_new_tokens: int, stop_at_eos: bool = True
) -> Generation:
    """Greedy completions by transformers' `generate`, prompts tokenized as fastes tokenizes them; with
    stop_at_eos=False every row decodes max_new_tokens tokens (min_new_tokens: EOS is never chosen)."""
    enc = encode_prompts(tokenizer, prompts)
    eos = eos_token_ids(model, tokenizer)
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        min_new_tokens=0 if stop_at_eos else max_new_tokens,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id,
    )
    out = model.generate(**enc, generation_config=config)[:, enc["input_ids"].shape[1] :].tolist()
    completions = [until_eos(row, eos) if stop_at_eos else row for row in out]
    prompt_ids = prompt_token_ids(enc)
    texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
    return Generation(texts=texts, completion_ids=completions, prompt_ids=prompt_ids)


def generate_at_lengths(
    model, tokenizer, prompts: list[str], lengths: Sequence[int], max_new_tokens: int
) -> Generation:
    """fastes' plain batched generation in which row i generates exactly lengths[i] tokens: the same
    decode steps, with the same rows in each, as a generation whose rows stopped at those lengths.

    An ES iteration's perturbed members answer at lengths of their own, so plain generation of the
    unperturbed model does other work; this one does the iteration's. Each step still takes the greedy
    token, except that EOS is put off until a row's length and then given (a token's value costs nothing:
    the work is the rows and steps)."""
    if len(lengths) != len(prompts) or not all(1 <= n <= max_new_tokens for n in lengths):
        raise ValueError(f"need one length in 1..{max_new_tokens} per prompt, got {list(lengths)}")
    decode = generation.decode
    # EOS at step n - 1; a row of max_new_tokens is stopped by the loop's end (0: no step matches)
    target = torch.tensor([n if n < max_new_tokens else 0 for n in lengths])

    def at_lengths(*positional, eos_ids: Sequence[int], choose, **keywords) -> torch.Tensor:
        eos = torch.tensor(list(eos_ids))
        filler = next(t for t in range(len(eos_ids) + 1) if t not in eos_ids)

        def held(sequences: torch.Tensor, logits: torch.Tensor, rows: torch.Tensor, step: int):
            tokens = choose(sequences, logits, rows, step)
            tokens = tokens.masked_fill(torch.isin(tokens, eos.to(tokens.device)), filler)
            return tokens.masked_fill(target.to(rows.device)[rows] == step + 1, int(eos_ids[0]))

        return decode(*positional, eos_ids=eos_ids, choose=held, **keywords)

    with mock.patch.object(generation, "decode", at_lengths):
        return generation.generate(model, tokenizer, prompts, max_new_tokens=max_new_tokens)


def naive_noise(tensor: torch.Tensor, seed: int) -> torch.Tensor:
    """torch.randn shaped like `tensor`, from a fresh generator seeded with `seed`."""
    generator = torch.Generator(device=tensor.device).manual_seed(seed)
    return torch.randn(tensor.shape, generator=generator, device=tensor.device, dtype=tensor.dtype)


@torch.no_grad()
def naive_perturb(tensors: Sequence[torch.Tensor], seed: int, sigma: float) -> None:
    """theta += sigma * eps, in place, tensor by tensor."""
    for t in tensors:
        t.add_(sigma * naive_noise(t, seed))


@torch.no_grad()
def naive_restore(tensors: Sequence[torch.Tensor], seed: int, sigma: float) -> None:
    """theta -= sigma * eps with the noise regenerated: inexact in finite precision."""
    for t in tensors:
        t.sub_(sigma * naive_noise(t, seed))


@torch.no_grad()
def naive_update(
    tensors: Sequence[torch.Tensor], seeds: Sequence[int], weights: Sequence[float], coef: float
) -> None:
    """theta += coef * sum_i w_i eps_i as N sequential passes: regenerate, multiply, add, per seed."""
    for seed, w in zip(seeds, weights):
        for t in tensors:
            t.add_(naive_noise(t, seed) * (coef * w))


@torch.no_grad()
def copy_weights(tensors: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor]) -> None:
    """buffer <- theta for every tensor: the same bytes a perturbation reads and writes, no arithmetic."""
    for t, b in zip(tensors, buffers):
        b.copy_(t)


def member_seeds(seed: int, iteration: int, population: int) -> list[int]:
    """The naive loop's seeds: random integers drawn per iteration, one per member."""
    rng = random.Random(seed * 1_000_003 + iteration)
    return [rng.randrange(2**30) for _ in range(population)]


@torch.no_grad()
def naive_es_iteration(
    model: torch.nn.Module,
    tokenizer,
    tensors: Sequence[torch.Tensor],
    examples: Sequence[Example],
    prompts: list[str],
    task: Task,
    *,
    population: int,
    sigma: float,
    lr: float,
    max_new_tokens: int,
    seed: int = 0,
    iteration: int = 0,
    format_weight: float = 0.1,
) -> dict[str, float]:
    """One iteration of the naive loop: member by member perturb, generate, score, restore; then update.

    Rewards are z-scored, (r - mean) / (std + 1e-8), and the update is theta += lr / N * sum_i z_i eps_i
    (1 / sigma folded into lr, as in the original).
    """
    seeds = member_seeds(seed, iteration, population)
    rewards, tokens = [], 0
    for s in seeds:
        naive_perturb(tensors, s, sigma)
        gen = transformers_generate(model, tokenizer, prompts, max_new_tokens)
        tokens += gen.num_tokens
        scores = [task.score(ex, text).reward(format_weight) for ex, text in zip(examples, gen.texts)]
        rewards.append(sum(scores) / len(scores))
        naive_restore(tensors, s, sigma)
    r = torch.tensor(rewards, dtype=torch.float64)
    z = (r - r.mean()) / (r.std(correction=0) + 1e-8)
    naive_update(tensors, seeds, z.tolist(), lr / population)
    return {"reward": float(r.mean()), "tokens": tokens}
