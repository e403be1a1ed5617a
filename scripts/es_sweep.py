"""One ES configuration on countdown, measured on validation problems: the sweep behind
docs/es_small_scale.md (what works for ES at small scale, and what does not).

    python scripts/es_sweep.py --name demo --iterations 60 --sigma 0.002 --lr 2e-5 >> sweep.jsonl

Validation problems: countdown test problems 1000-1999 (task seed 0, drawn with n_test=2000). They are
disjoint from the train split and from test problems 0-999, which are kept for the final report only.
Prints one JSON line: the configuration, validation accuracy of base and trained model with the paired
standard error of the gain, the share of valid-format answers before and after, the share of tied
rewards, and seconds.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time

import torch

from fastes import ES, linear_weights
from fastes.es.population import population_batched
from fastes.models.generation import generate
from fastes.models.loading import load_model, tiny_model_path
from fastes.tasks import get_task

VALIDATION = slice(1000, 2000)


def evolved(model: torch.nn.Module, which: str) -> list:
    """linear (every projection matrix), or a "+"-joined subset of embeddings and norms."""
    if which == "linear":
        return linear_weights(model)
    kinds = set(which.split("+"))
    chosen = linear_weights(model, include_embeddings="embeddings" in kinds, include_norms="norms" in kinds)
    linear = {id(p) for _, p in linear_weights(model)}
    return [(n, p) for n, p in chosen if id(p) not in linear]


def scores(model, tok, task, examples, max_new: int = 12) -> list:
    """Greedy Score (format, answer) of every example."""
    out = []
    for i in range(0, len(examples), 500):
        chunk = examples[i : i + 500]
        gen = generate(model, tok, [ex.prompt for ex in chunk], max_new_tokens=max_new)
        out += [task.score(ex, t) for ex, t in zip(chunk, gen.texts)]
    return out


def rewards_of(model, tok, task, es, examples, args) -> torch.Tensor:
    prompts = [ex.prompt for ex in examples]
    if args.params != "linear":  # batched evaluation swaps projection layers only
        texts = []
        for member in es.members():
            with member:
                texts.append(generate(model, tok, prompts, max_new_tokens=12).texts)
    else:
        with population_batched(es, model) as members:
            gen = generate(model, tok, prompts * len(members), max_new_tokens=12)
        texts = [gen.texts[i * len(prompts) : (i + 1) * len(prompts)] for i in range(len(members))]
    return torch.tensor(
        [[task.score(ex, t).reward(args.format_weight) for ex, t in zip(examples, row)] for row in texts],
        dtype=torch.float64,
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--name", default="")
    p.add_argument("--model", default=str(tiny_model_path()))
    p.add_argument("--params", default="linear", help="what ES evolves, as es.evolve: e.g. embeddings+norms")
    p.add_argument("--iterations", type=int, default=60)
    p.add_argument("--population", type=int, default=32)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--sigma", type=float, default=0.002)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--shaping", default="centered_rank")
    p.add_argument("--format_weight", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--val", type=int, default=1000)
    args = p.parse_args()
    torch.set_num_threads(1)
    start = time.perf_counter()
    model, tok = load_model(args.model)
    task = get_task("countdown", n_test=2000)
    train = task.split("train")
    val = task.split("test")[VALIDATION][: args.val]
    base_scores = scores(model, tok, task, val)
    base = [s.answer for s in base_scores]
    es = ES(
        evolved(model, args.params),
        sigma=args.sigma,
        lr=args.lr,
        population=args.population,
        shaping=args.shaping,
        seed=args.seed,
    )
    tied = []
    for step in range(args.iterations):
        batch = random.Random(f"{args.seed}:es:{step}").sample(train, args.batch)
        r = rewards_of(model, tok, task, es, batch, args)
        means = r.mean(1)
        tied.append(float((means[0::2] == means[1::2]).double().mean()))
        es.step(r)
    trained_scores = scores(model, tok, task, val)
    trained = [s.answer for s in trained_scores]
    diff = torch.tensor(trained) - torch.tensor(base)
    se = float(diff.std(correction=1) / math.sqrt(len(diff)))
    print(
        json.dumps(
            {
                **vars(args),
                "base": sum(base) / len(base),
                "trained": sum(trained) / len(trained),
                "gain": float(diff.mean()),
                "paired_se": se,
                # share of answers that are valid expressions (the format reward)
                "format_base": sum(s.format for s in base_scores) / len(val),
                "format_trained": sum(s.format for s in trained_scores) / len(val),
                "tied_pairs": sum(tied) / len(tied),
                "seconds": round(time.perf_counter() - start, 1),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
