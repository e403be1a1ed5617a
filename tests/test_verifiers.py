"""The parser and verifiers in fastes.tasks.verify, which read untrusted model output."""

from __future__ import annotations

from fractions import Fraction

import pytest
from conftest import python_steps
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastes.tasks.base import Score
from fastes.tasks.verify import (
    MAX_DEPTH,
    MAX_EXPR_CHARS,
    MAX_LITERAL_DIGITS,
    extract_answer,
    parse_expression,
    parse_number,
    score_countdown,
    score_exact,
    score_numeric,
)


@pytest.mark.parametrize(
    ("text", "value", "numbers"),
    [
        ("3*5+7", 22, (3, 5, 7)),
        ("2+3*4", 14, (2, 3, 4)),  # precedence
        ("(2+3)*4", 20, (2, 3, 4)),
        ("10-2-3", 5, (10, 2, 3)),  # left to right
        ("8/4/2", 1, (8, 4, 2)),
        ("7/2*2", 7, (7, 2, 2)),  # exact fractions, no float rounding
        ("1/3", Fraction(1, 3), (1, 3)),
        (" 1 +  2 ", 3, (1, 2)),
        ("007", 7, (7,)),  # leading zeros are allowed
        ("0", 0, (0,)),
        ("999999*999999", 999999 * 999999, (999999, 999999)),
        ("(" * MAX_DEPTH + "1" + ")" * MAX_DEPTH, 1, (1,)),
        ("2-5", -3, (2, 5)),  # a negative result is fine, a negative literal is not
    ],
)
def test_valid_expressions(text: str, value: Fraction, numbers: tuple[int, ...]) -> None:
    parsed = parse_expression(text)
    assert parsed is not None
    assert parsed.value == value
    assert parsed.numbers == numbers


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   ",
        "1+",
        "+1",
        "-3+5",  # no unary minus
        "2*-3",
        "(1+2",
        "1+2)",
        "()",
        "3 4",
        "1++2",
        "3x4",
        "1.5+2",
        "1;2",
        "1\t+2",
        "1,000",
    ],
)
def test_malformed_expressions(text: str) -> None:
    assert parse_expression(text) is None


@pytest.mark.parametrize(
    "text",
    [
        "9**9**9",  # no exponentiation operator at all
        "2**10",
        "(" * 10_000 + "1" + ")" * 10_000,
        "(" * (MAX_DEPTH + 1) + "1" + ")" * (MAX_DEPTH + 1),
        "1" * (MAX_LITERAL_DIGITS + 1),
        "9" * 100_000,
        "1+" * 10_000 + "1",
        "\u0663+1",  # ARABIC-INDIC DIGIT THREE
        "\uff13+1",  # FULLWIDTH DIGIT THREE
        "\u00b2",  # SUPERSCRIPT TWO
        "1/0",
        "1/(2-2)",
        "0*(1/0)",
        "__import__('os').system('true')",
        "1\x00+2",
        "1_000",
    ],
)
def test_hostile_expressions_are_rejected(text: str) -> None:
    assert parse_expression(text) is None


def test_length_bound_is_exact() -> None:
    longest = "1+" * (MAX_EXPR_CHARS // 2 - 1) + "11"
    assert len(longest) == MAX_EXPR_CHARS
    assert parse_expression(longest) is not None
    assert parse_expression(longest + " ") is None


# Python lines one parse or countdown score may execute: an accepted expression has at most
# MAX_EXPR_CHARS characters (measured: up to ~1,400 lines), and a longer input is refused by its length.
PARSE_STEPS = 5_000


def test_hostile_inputs_are_fast() -> None:
    # The worst cases that pass the length check: large products and long division chains.
    inputs = [
        "999999*" * 9 + "9",
        "1/999999/999997/999993/999991/999989/999983/999979/999961/99999",
        "(" * MAX_DEPTH + "1" + ")" * MAX_DEPTH,
        "(" * 100_000,
        "9" * 1_000_000,
    ]
    for text in inputs:  # a bound on the work done, not on the time it took: the same on any machine
        _, steps = python_steps(parse_expression, text)
        assert steps <= PARSE_STEPS, (text[:20], len(text), steps)


@settings(max_examples=300, deadline=None, database=None)
@given(st.one_of(st.text(max_size=200), st.text(alphabet="0123456789+-*/() \u0663.", max_size=80)))
def test_arbitrary_text_never_raises_and_is_fast(text: str) -> None:
    parsed, parse_steps = python_steps(parse_expression, text)
    number = parse_number(text)
    score, score_steps = python_steps(score_countdown, [1, 2, 3], 6, text)
    assert parsed is None or isinstance(parsed.value, Fraction)
    assert number is None or isinstance(number, Fraction)
    assert score.format in (0.0, 1.0) and score.answer in (0.0, 1.0)
    assert parse_steps <= PARSE_STEPS and score_steps <= PARSE_STEPS  # a blow-up would need far more


def _expressions(max_leaves: int = 6) -> st.SearchStrategy[tuple[str, Fraction | None, list[int]]]:
    """Random fully parenthesised expressions with their value computed independently (None: 1/0)."""
    leaves = st.integers(0, 999).map(lambda n: (str(n), Fraction(n), [n]))

    def combine(children: st.SearchStrategy) -> st.SearchStrategy:
        def join(left: tuple, op: str, right: tuple) -> tuple:
            (left_text, lv, left_numbers), (right_text, rv, right_numbers) = left, right
            if lv is None or rv is None or (op == "/" and rv == 0):
                value = None
            elif op == "+":
                value = lv + rv
            elif op == "-":
                value = lv - rv
            elif op == "*":
                value = lv * rv
            else:
                value = lv / rv
            return f"({left_text}{op}{right_text})", value, left_numbers + right_numbers

        return st.builds(join, children, st.sampled_from("+-*/"), children)

    return st.recursive(leaves, combine, max_leaves=max_leaves)


@settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(_expressions())
def test_parser_agrees_with_independent_evaluation(case: tuple[str, Fraction | None, list[int]]) -> None:
    text, value, numbers = case
    # Strip the redundant outer pair so depth and length stay within the parser's bounds more often.
    if text.startswith("("):
        text = text[1:-1]
    if len(text) > MAX_EXPR_CHARS or text.count("(") > MAX_DEPTH:
        return
    parsed = parse_expression(text)
    if value is None:
        assert parsed is None
    else:
        assert parsed is not None
        assert parsed.value == value
        assert list(parsed.numbers) == numbers


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("12", 12),
        ("-12", -12),
        ("0", 0),
        ("3.25", Fraction(13, 4)),
        ("-0.5", Fraction(-1, 2)),
        ("7/2", Fraction(7, 2)),
    ],
)
def test_parse_number_valid(text: str, value: Fraction) -> None:
    assert parse_number(text) == value


@pytest.mark.parametrize(
    "text",
    ["", "-", "--5", "+5", "3+4", "1e5", ".5", "5.", "1/0", "1/2/3", "1 2", "\u0663", "1_000", "9" * 40]
    + ["nan", "inf", " 5", "5 "],  # no spaces inside: extract_answer has already stripped the answer
)
def test_parse_number_invalid(text: str) -> None:
    assert parse_number(text) is None


@pytest.mark.parametrize(
    ("completion", "answer"),
    [
        ("3*5+7;", "3*5+7"),
        ("3*5+7; junk 1+1", "3*5+7"),
        (" 42 ;;", "42"),
        ("42\nmore", "42"),
        ("42", "42"),  # no terminator: the whole completion
        (";42", ""),
        ("", ""),
    ],
)
def test_extract_answer(completion: str, answer: str) -> None:
    assert extract_answer(completion) == answer


def test_score_countdown() -> None:
    numbers, target = [3, 5, 7], 22
    assert score_countdown(numbers, target, "3*5+7;") == Score(1.0, 1.0)
    assert score_countdown(numbers, target, "7+5*3; trailing junk") == Score(1.0, 1.0)  # any order
    assert score_countdown(numbers, target, "3*5+7+0;") == Score(1.0, 0.0)  # an extra number
    assert score_countdown(numbers, target, "15+7;") == Score(1.0, 0.0)  # right value, wrong numbers
    assert score_countdown(numbers, target, "3*5*7;") == Score(1.0, 0.0)  # right numbers, wrong value
    assert score_countdown([3, 3, 5], 15, "3*5;") == Score(1.0, 0.0)  # each number must be used
    assert score_countdown([3, 3, 5], 45, "3*3*5;") == Score(1.0, 1.0)  # repeats count as given
    assert score_countdown(numbers, target, "22;") == Score(1.0, 0.0)
    assert score_countdown(numbers, target, "3*5+7=22;") == Score(0.0, 0.0)
    assert score_countdown(numbers, target, "") == Score(0.0, 0.0)


def test_score_numeric_and_exact() -> None:
    assert score_numeric(5535, "5535;") == Score(1.0, 1.0)
    assert score_numeric(5535, "5535.0;") == Score(1.0, 1.0)
    assert score_numeric(5535, "5536;") == Score(1.0, 0.0)
    assert score_numeric(5535, "5500+35;") == Score(0.0, 0.0)  # an expression is not a number
    assert score_numeric(Fraction(1, 2), "0.5") == Score(1.0, 1.0)
    assert score_exact("paris", "paris; and more") == Score(1.0, 1.0)
    assert score_exact("paris", "Paris;") == Score(1.0, 0.0)
    assert score_exact("paris", ";") == Score(0.0, 0.0)


def test_score_reward_weights() -> None:
    assert score_countdown([3, 5, 7], 22, "3*5+7;").reward() == pytest.approx(1.1)
    assert score_countdown([3, 5, 7], 22, "15+7;").reward(format_weight=0.5) == pytest.approx(0.5)
