"""Held-out tasks: part of the supervised pretraining mix, never trained on by ES or GRPO.

They measure forgetting: if post-training on Countdown or arithmetic damages skills it was not paid
for, accuracy on these drops.

  reverse  "rev 12345:" -> "54321;"  write the digits backwards (leading zeros kept: "rev 120:" -> "021;")
  compare  "cmp 123 45:" -> ">;"     the relation of the first number to the second: '<', '>' or '='

Both are scored by exact match of the answer (the text before the first ';', see verify.py); format
reward 1 when the answer has the right shape (only digits for reverse, one of < > = for compare).
"""

from __future__ import annotations

import random

from .base import DEFAULT_TEST_PROBLEMS, Example, GeneratedTask, Score
from .verify import ANSWER_END, extract_answer

_RELATIONS = "<>="


class ReverseTask(GeneratedTask):
    """Reverse a string of min_digits..max_digits digits."""

    name = "reverse"
    answer_kind = "digits"
    instruction = 'Write the reversed digits after "Answer:".'

    def __init__(
        self,
        seed: int = 0,
        n_train: int = 1000,
        n_test: int = DEFAULT_TEST_PROBLEMS,
        min_digits: int = 3,
        max_digits: int = 8,
    ) -> None:
        if not 1 <= min_digits <= max_digits <= 15:
            raise ValueError(f"need 1 <= min_digits <= max_digits <= 15, got {min_digits} and {max_digits}")
        super().__init__(seed=seed, n_train=n_train, n_test=n_test)
        self.min_digits = min_digits
        self.max_digits = max_digits

    def generate(self, rng: random.Random) -> Example | None:
        length = rng.randint(self.min_digits, self.max_digits)
        digits = "".join(rng.choice("0123456789") for _ in range(length))
        reversed_digits = digits[::-1]
        return Example(
            prompt=f"rev {digits}:",
            answer=reversed_digits,
            solution=reversed_digits + ANSWER_END,
            meta={"digits": digits},
        )

    def question(self, example: Example) -> str:
        return f"Write the digits {example.meta['digits']} in reverse order."

    def score(self, example: Example, completion: str) -> Score:
        answer = extract_answer(completion)
        well_formed = answer != "" and all(ch in "0123456789" for ch in answer)
        return Score(format=float(well_formed), answer=float(answer == example.answer))


class CompareTask(GeneratedTask):
    """Compare two numbers below 10**max_digits; the three relations are equally likely."""

    name = "compare"
    answer_kind = "relation"
    instruction = "Answer with the symbol <, > or =."

    def __init__(
        self, seed: int = 0, n_train: int = 1000, n_test: int = DEFAULT_TEST_PROBLEMS, max_digits: int = 4
    ) -> None:
        if not 1 <= max_digits <= 9:
            raise ValueError(f"max_digits must be in 1..9, got {max_digits}")
        super().__init__(seed=seed, n_train=n_train, n_test=n_test)
        self.max_digits = max_digits

    def generate(self, rng: random.Random) -> Example | None:
        # Choosing the relation first keeps '=' as common as the others instead of vanishingly rare.
        relation = rng.choice(_RELATIONS)
        a = rng.randint(0, 10**self.max_digits - 1)
        if relation == "=":
            b = a
        else:
            b = rng.randint(0, 10**self.max_digits - 1)
            if a == b:
                return None
            if (a > b) != (relation == ">"):
                a, b = b, a
        return Example(
            prompt=f"cmp {a} {b}:",
            answer=relation,
            solution=relation + ANSWER_END,
            meta={"a": a, "b": b},
        )

    def question(self, example: Example) -> str:
        a, b = example.meta["a"], example.meta["b"]
        return f"Is {a} less than (<), greater than (>) or equal to (=) {b}?"

    def score(self, example: Example, completion: str) -> Score:
        answer = extract_answer(completion)
        return Score(format=float(answer in tuple(_RELATIONS)), answer=float(answer == example.answer))
