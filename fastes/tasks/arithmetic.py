"""Multi-digit arithmetic: "123*45=" -> "5535;".

Each operand has between min_digits and max_digits digits (the count drawn uniformly, then the number).
Subtraction puts the larger operand first, so every answer is a non-negative integer. The answer (the
text before the first ';', see verify.py) must be a plain number equal to the result: "5535" and
"5535.0" are right, an expression such as "5500+35" is not even well formed.
"""

from __future__ import annotations

import random

from .base import DEFAULT_TEST_PROBLEMS, Example, GeneratedTask, Score
from .verify import ANSWER_END, score_numeric

_OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


class ArithmeticTask(GeneratedTask):
    """Addition, subtraction and multiplication of min_digits..max_digits digit integers, or of integers
    in 0..max_operand when it is set."""

    name = "arithmetic"
    answer_kind = "number"
    # One sentence: SmolLM2-135M-Instruct states its answer after "Answer:" or as "The answer is" about
    # twice as often asked this way as with a separate sentence (docs/real_models.md).
    instruction = 'and write the result after "Answer:".'

    def __init__(
        self,
        seed: int = 0,
        n_train: int = 1000,
        n_test: int = DEFAULT_TEST_PROBLEMS,
        min_digits: int = 2,
        max_digits: int = 3,
        operations: str = "+-*",
        max_operand: int = 0,
    ) -> None:
        if not 1 <= min_digits <= max_digits <= 6:
            raise ValueError(f"need 1 <= min_digits <= max_digits <= 6, got {min_digits} and {max_digits}")
        if not operations or any(op not in _OPERATIONS for op in operations):
            raise ValueError(f"operations must be a non-empty string of '+', '-', '*', got {operations!r}")
        if max_operand < 0:
            raise ValueError(f"max_operand must be >= 0 (0: operands by digit count), got {max_operand}")
        super().__init__(seed=seed, n_train=n_train, n_test=n_test)
        self.max_operand = max_operand
        self.min_digits = min_digits
        self.max_digits = max_digits
        self.operations = operations

    def _operand(self, rng: random.Random) -> int:
        if self.max_operand:  # small numbers of any digit count, e.g. 0..20
            return rng.randint(0, self.max_operand)
        digits = rng.randint(self.min_digits, self.max_digits)
        low = 0 if digits == 1 else 10 ** (digits - 1)
        return rng.randint(low, 10**digits - 1)

    def generate(self, rng: random.Random) -> Example | None:
        a, b = self._operand(rng), self._operand(rng)
        op = rng.choice(self.operations)
        if op == "-" and a < b:
            a, b = b, a
        result = _OPERATIONS[op](a, b)
        return Example(
            prompt=f"{a}{op}{b}=",
            answer=str(result),
            solution=f"{result}{ANSWER_END}",
            meta={"a": a, "b": b, "op": op, "result": result},
        )

    def question(self, example: Example) -> str:
        return f"Calculate {example.meta['a']} {example.meta['op']} {example.meta['b']}"

    def score(self, example: Example, completion: str) -> Score:
        return score_numeric(example.meta["result"], completion)
