"""Optional adapter to the `reasoning-gym` package's procedural datasets (`pip install reasoning-gym`).

The package is imported only when a ReasoningGymTask is created, so fastes works without it.

    task = get_task("reasoning_gym:leg_counting", seed=0, n_train=500)

One dataset of n_train + n_test entries is created with reasoning_gym.create_dataset(name, size=...,
seed=...) plus any extra options (passed on as the dataset's config); the first n_train entries are the
train split and the rest the test split, less any test entry whose question also occurs in train.
The answer is the completion's text before the first ';' or newline (see verify.py), scored by the
dataset's own score_answer, which may give partial credit in [0, 1]; format is 1 for a non-empty answer.

Its questions are long English text with capitals and punctuation outside ALPHABET, so these tasks suit
a model with its own tokenizer, not the built-in character-level one.
"""

from __future__ import annotations

import importlib
import math
from typing import Any

from fastes.errors import MissingPackageError

from .base import Example, Score, Task
from .verify import ANSWER_END, extract_answer


def _import_reasoning_gym() -> Any:
    try:
        return importlib.import_module("reasoning_gym")
    except ImportError as error:
        raise MissingPackageError(
            "reasoning_gym tasks need the optional 'reasoning-gym' package: pip install reasoning-gym"
        ) from error


class ReasoningGymTask(Task):
    """A reasoning-gym dataset, e.g. ReasoningGymTask("leg_counting")."""

    def __init__(
        self, dataset: str, seed: int = 0, n_train: int = 1000, n_test: int = 200, **config: Any
    ) -> None:
        if n_train < 0 or n_test < 0:
            raise ValueError(f"n_train and n_test must be >= 0, got {n_train} and {n_test}")
        reasoning_gym = _import_reasoning_gym()
        self.name = f"reasoning_gym:{dataset}"
        self._dataset = reasoning_gym.create_dataset(dataset, size=n_train + n_test, seed=seed, **config)
        examples = [self._to_example(self._dataset[i]) for i in range(n_train + n_test)]
        train = examples[:n_train]
        train_questions = {example.prompt for example in train}
        test = [example for example in examples[n_train:] if example.prompt not in train_questions]
        self._splits = {"train": train, "test": test}

    @staticmethod
    def _to_example(entry: dict[str, Any]) -> Example:
        answer = str(entry["answer"])
        return Example(
            prompt=str(entry["question"]), answer=answer, solution=answer + ANSWER_END, meta={"entry": entry}
        )

    def score(self, example: Example, completion: str) -> Score:
        answer = extract_answer(completion)
        try:
            reward = float(self._dataset.score_answer(answer=answer, entry=example.meta["entry"]))
        except Exception:  # a third-party scorer must not crash training on odd model text
            reward = 0.0
        if not math.isfinite(reward):
            reward = 0.0
        return Score(format=float(answer != ""), answer=min(max(reward, 0.0), 1.0))
