"""Post-train a model with fastes.ES by hand: no trainer, no run directory, just the loop.

    python examples/es_by_hand.py                     # 10 iterations, population 32: ~25 s on 2 CPU cores
    python examples/es_by_hand.py --iterations 2 --population 4 --prompts 8 --test 20   # seconds

Each iteration perturbs the model's linear weights once per member, generates greedy completions of a
batch of countdown prompts under that perturbation, scores them with the task's verifier, and moves the
weights toward the members that scored well (`es.step`). `fastes train` runs the same loop, batched.
"""

import argparse
import random

import torch

import fastes
from fastes.models.generation import generate
from fastes.models.loading import load_model, tiny_model_path
from fastes.tasks import get_task

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--iterations", type=int, default=10)
parser.add_argument("--population", type=int, default=32, help="members per iteration (even)")
parser.add_argument("--prompts", type=int, default=64, help="training prompts per iteration")
parser.add_argument("--test", type=int, default=200, help="held-out problems for the accuracies")
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

torch.manual_seed(args.seed)
model, tokenizer = load_model(tiny_model_path())  # the built-in 135K-parameter character-level Llama
task = get_task("countdown")  # prompts like "cd 2 4 8 > 24:", answers like "(4+8)*2;"
train, test = task.split("train"), task.split("test")[: args.test]


def rewards(examples: list) -> list[float]:
    """Greedy completions of `examples` under the current weights, scored by the task's verifier."""
    texts = generate(model, tokenizer, [ex.prompt for ex in examples], max_new_tokens=12).texts
    return [score.reward() for score in task.scores(examples, texts)]  # 0.1 * well-formed + correct


def accuracy() -> float:
    texts = generate(model, tokenizer, [ex.prompt for ex in test], max_new_tokens=12).texts
    return sum(score.answer for score in task.scores(test, texts)) / len(test)


base = accuracy()
# The defaults of `fastes train` for the tiny model: sigma 0.002, lr 2e-5, centered-rank shaping.
es = fastes.ES(fastes.linear_weights(model), sigma=0.002, lr=2e-5, population=args.population, seed=args.seed)
rng = random.Random(args.seed)
for iteration in range(args.iterations):
    batch = rng.sample(train, args.prompts)
    scores = []
    for member in es.members():
        with member:  # perturbs the weights on enter, restores them exactly on exit
            scores.append(rewards(batch))
    population = es.step(torch.tensor(scores))  # [members, prompts]: shaped, then one fused update
    print(f"iteration {iteration + 1}/{args.iterations}: mean reward {population.mean():.3f}")

print(f"base accuracy {base:.3f} -> trained accuracy {accuracy():.3f} on {len(test)} held-out problems")
