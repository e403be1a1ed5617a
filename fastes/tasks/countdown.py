"""Countdown: combine the given numbers with + - * / to hit a target, using every number exactly once.

Prompt "cd 3 5 7 > 22:" (the numbers in ascending order, then the target); a solution "3*5+7;".
Answer reward 1 when the completion's answer (the text before the first ';', see verify.py) is a valid
expression whose integer literals are exactly the given numbers, as a multiset, and whose exact value is
the target; format reward 1 whenever it is a valid expression at all.

Instances are generated solvable: draw the numbers, then build a random expression over all of them and
take its value as the target, keeping that expression as the solution. Like the game show, generated
solutions keep every intermediate result a positive integer; the verifier itself accepts any route,
including fractional intermediates such as 7/2*2.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from fractions import Fraction

from .base import DEFAULT_TEST_PROBLEMS, Example, GeneratedTask, Score
from .verify import ANSWER_END, score_countdown

# Operator precedence of a (sub)expression's outermost operator, used to add only the parentheses needed.
_ADD, _MUL, _ATOM = 1, 2, 3

# (value, text, precedence of the text's outermost operator)
_Node = tuple[Fraction, str, int]


def _combine(left: _Node, op: str, right: _Node) -> _Node | None:
    """left op right as a node, or None for division by zero."""
    left_value, left_text, left_prec = left
    right_value, right_text, right_prec = right
    if op in "+-":
        prec = _ADD
        wrap_left = False
        wrap_right = op == "-" and right_prec == _ADD  # a-(b+c) needs them, a+(b-c) = a+b-c does not
    else:
        prec = _MUL
        wrap_left = left_prec == _ADD
        wrap_right = right_prec == _ADD or (op == "/" and right_prec == _MUL)
    if op == "+":
        value = left_value + right_value
    elif op == "-":
        value = left_value - right_value
    elif op == "*":
        value = left_value * right_value
    elif right_value == 0:
        return None
    else:
        value = left_value / right_value
    text = f"({left_text})" if wrap_left else left_text
    text += op + (f"({right_text})" if wrap_right else right_text)
    return value, text, prec


def _leaf(number: int) -> _Node:
    return Fraction(number), str(number), _ATOM


def random_solution(rng: random.Random, numbers: Sequence[int]) -> tuple[int, str] | None:
    """A random expression using each number once: (its value, its text), or None if an intermediate
    result was not a positive integer (the caller just draws again)."""
    nodes = [_leaf(n) for n in numbers]
    while len(nodes) > 1:
        # Joining two random nodes at a time gives every tree shape, not just left-leaning chains.
        i, j = rng.sample(range(len(nodes)), 2)
        left, right = nodes[i], nodes[j]
        nodes = [node for k, node in enumerate(nodes) if k not in (i, j)]
        node = _combine(left, rng.choice("+-*/"), right)
        if node is None or node[0] <= 0 or node[0].denominator != 1:
            return None
        nodes.append(node)
    value, text, _ = nodes[0]
    return int(value), text


def wrong_solution(rng: random.Random, numbers: Sequence[int], target: int, tries: int = 100) -> str | None:
    """A well-formed expression over exactly `numbers` whose value misses `target` (a distractor for
    pretraining: what a model writes when it knows the format but ignores the target), or None."""
    for _ in range(tries):
        drawn = random_solution(rng, numbers)
        if drawn is not None and drawn[0] != target:
            return drawn[1] + ANSWER_END
    return None


def with_result(solution: str, target: int) -> str:
    """`solution` written as "expression=target;": a common way to show a result, which the verifier
    does not accept (the answer before ';' is then not an expression). Pretraining on a share of these
    gives a base that solves as well as before but sometimes answers in the unverifiable style."""
    return solution.removesuffix(ANSWER_END) + f"={target}" + ANSWER_END


def solve_countdown(numbers: Sequence[int], target: Fraction | int) -> str | None:
    """An expression using each number once that equals `target` exactly, or None when there is none.

    Exhaustive search over every pair, operator and order, with fractional intermediates allowed; fine
    for up to 4 numbers (a few thousand expressions), slow beyond 5.
    """

    def search(nodes: list[_Node]) -> str | None:
        if len(nodes) == 1:
            return nodes[0][1] if nodes[0][0] == target else None
        for i, j in itertools.permutations(range(len(nodes)), 2):
            rest = [node for k, node in enumerate(nodes) if k not in (i, j)]
            for op in "+-*/":
                if op in "+*" and i > j:  # commutative: the other order was already tried
                    continue
                node = _combine(nodes[i], op, nodes[j])
                if node is not None:
                    found = search([*rest, node])
                    if found is not None:
                        return found
        return None

    if not numbers:
        return None
    return search([_leaf(n) for n in numbers])


class CountdownTask(GeneratedTask):
    """Countdown with `n_numbers` numbers drawn from 1..max_number and a target in 1..max_target."""

    name = "countdown"
    answer_kind = "expression"
    instruction = 'Write the expression after "Answer:".'

    def __init__(
        self,
        seed: int = 0,
        n_train: int = 1000,
        n_test: int = DEFAULT_TEST_PROBLEMS,
        n_numbers: int = 3,
        max_number: int = 15,
        max_target: int = 100,
    ) -> None:
        if not 2 <= n_numbers <= 4:
            raise ValueError(f"n_numbers must be 2, 3 or 4 (prompts must stay short), got {n_numbers}")
        if max_number < 1 or max_target < 1:
            raise ValueError(f"max_number and max_target must be >= 1, got {max_number} and {max_target}")
        super().__init__(seed=seed, n_train=n_train, n_test=n_test)
        self.n_numbers = n_numbers
        self.max_number = max_number
        self.max_target = max_target

    def generate(self, rng: random.Random) -> Example | None:
        numbers = sorted(rng.randint(1, self.max_number) for _ in range(self.n_numbers))
        drawn = random_solution(rng, numbers)
        if drawn is None or drawn[0] > self.max_target:
            return None
        target, expression = drawn
        return Example(
            prompt=f"cd {' '.join(map(str, numbers))} > {target}:",
            answer=str(target),
            solution=expression + ANSWER_END,
            meta={"numbers": tuple(numbers), "target": target},
        )

    def question(self, example: Example) -> str:
        *first, last = example.meta["numbers"]
        numbers = f"{', '.join(map(str, first))} and {last}"
        return (
            f"Use the numbers {numbers}, each exactly once, with + - * / and parentheses, to make "
            f"{example.meta['target']}."
        )

    def score(self, example: Example, completion: str) -> Score:
        return score_countdown(example.meta["numbers"], example.meta["target"], completion)
