"""Safe parsing and scoring of untrusted model output.

Model completions are arbitrary text, so nothing here uses eval, exec or ast: a small hand-written parser
accepts a whitelist and rejects everything else by returning None, never by raising.

Where an answer ends: the answer is the text of the completion before the first ';' or newline, with
surrounding whitespace removed, or the whole completion when it has neither. Solutions of the built-in
tasks end with ';' for this reason, and whatever the model writes after it is ignored.

Arithmetic expressions (`parse_expression`):
  * characters: ASCII digits 0-9, the operators + - * /, parentheses and spaces; anything else, including
    non-ASCII digits such as '٣', tabs or '**', makes the whole text invalid;
  * at most MAX_EXPR_CHARS characters, at most MAX_DEPTH nested parentheses, at most MAX_LITERAL_DIGITS
    digits per number; leading zeros are allowed ("07" is the number 7);
  * usual precedence (* and / before + and -), left to right, exact rational arithmetic with Fraction,
    so 7/2*2 is exactly 7; division by zero makes the expression invalid;
  * no unary minus: "-3+5" and "2*-3" are invalid (every number is a non-negative literal, which is what
    Countdown wants, and it keeps one spelling per expression); write "5-3" instead.
With these bounds the largest value has a few hundred bits, so any input is parsed in microseconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from .base import Score

ANSWER_END = ";"

MAX_EXPR_CHARS = 64
MAX_DEPTH = 8
MAX_LITERAL_DIGITS = 6
MAX_NUMBER_CHARS = 32

# Explicit sets rather than str.isdigit(), which also accepts digits of other scripts.
_DIGITS = frozenset("0123456789")
_SYMBOLS = frozenset("+-*/()")


def extract_answer(completion: str) -> str:
    """The answer part of a completion: text before the first ';' or newline, stripped of whitespace."""
    return completion.partition(ANSWER_END)[0].partition("\n")[0].strip()


@dataclass(frozen=True)
class ParsedExpr:
    """A valid expression: its exact value and its integer literals in the order they appear."""

    value: Fraction
    numbers: tuple[int, ...]


class _Invalid(Exception):
    """Raised inside the parser to abandon the parse; never escapes this module."""


def _tokenize(text: str) -> list[str]:
    """Split into number and symbol tokens, dropping spaces; raise _Invalid on any other character."""
    tokens = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch == " ":
            i += 1
        elif ch in _SYMBOLS:
            tokens.append(ch)
            i += 1
        elif ch in _DIGITS:
            start = i
            while i < len(text) and text[i] in _DIGITS:
                i += 1
            if i - start > MAX_LITERAL_DIGITS:
                raise _Invalid
            tokens.append(text[start:i])
        else:
            raise _Invalid
    return tokens


class _Parser:
    """Recursive descent over the grammar
    expression := term (('+' | '-') term)*
    term       := factor (('*' | '/') factor)*
    factor     := number | '(' expression ')'
    """

    def __init__(self, tokens: list[str]) -> None:
        self.tokens = tokens
        self.pos = 0
        self.depth = 0
        self.numbers: list[int] = []

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str:
        token = self.peek()
        if token is None:
            raise _Invalid
        self.pos += 1
        return token

    def expression(self) -> Fraction:
        value = self.term()
        while self.peek() in ("+", "-"):
            op = self.take()
            right = self.term()
            value = value + right if op == "+" else value - right
        return value

    def term(self) -> Fraction:
        value = self.factor()
        while self.peek() in ("*", "/"):
            op = self.take()
            right = self.factor()
            if op == "*":
                value *= right
            elif right == 0:
                raise _Invalid
            else:
                value /= right
        return value

    def factor(self) -> Fraction:
        token = self.take()
        if token == "(":
            self.depth += 1
            if self.depth > MAX_DEPTH:
                raise _Invalid
            value = self.expression()
            if self.take() != ")":
                raise _Invalid
            self.depth -= 1
            return value
        if token[0] in _DIGITS:
            number = int(token)
            self.numbers.append(number)
            return Fraction(number)
        raise _Invalid  # an operator or ')' where a number belongs (this is where unary minus is refused)


def parse_expression(text: str) -> ParsedExpr | None:
    """Parse and evaluate a whitelisted arithmetic expression; None when `text` is not one."""
    if not isinstance(text, str) or len(text) > MAX_EXPR_CHARS:
        return None
    try:
        parser = _Parser(_tokenize(text))
        value = parser.expression()
        if parser.peek() is not None:  # trailing tokens, e.g. "1+2)" or "3 4"
            raise _Invalid
    except _Invalid:
        return None
    return ParsedExpr(value=value, numbers=tuple(parser.numbers))


def _is_digits(text: str) -> bool:
    return text != "" and all(ch in _DIGITS for ch in text)


def parse_number(text: str) -> Fraction | None:
    """Parse a plain number: an integer "-12", a decimal "3.25" or a fraction "7/2"; None otherwise.

    Only an optional leading '-', ASCII digits and one '.' or '/' are accepted (no spaces inside, no
    exponents, no expressions: "3+4" is not a number, so a model cannot be paid for restating a problem).
    """
    if not isinstance(text, str) or len(text) > MAX_NUMBER_CHARS:
        return None
    sign = -1 if text.startswith("-") else 1
    body = text[1:] if sign == -1 else text
    if "/" in body:
        numerator, _, denominator = body.partition("/")
        if not (_is_digits(numerator) and _is_digits(denominator)) or int(denominator) == 0:
            return None
        return sign * Fraction(int(numerator), int(denominator))
    whole, dot, decimals = body.partition(".")
    if not _is_digits(whole) or (dot and not _is_digits(decimals)):
        return None
    value = Fraction(int(whole))
    if decimals:
        value += Fraction(int(decimals), 10 ** len(decimals))
    return sign * value


def score_exact(expected: str, completion: str) -> Score:
    """Format 1 for any non-empty answer; answer 1 when it equals `expected` exactly."""
    answer = extract_answer(completion)
    return Score(format=float(answer != ""), answer=float(answer == expected))


def score_numeric(expected: Fraction | int, completion: str) -> Score:
    """Format 1 when the answer is a plain number; answer 1 when it equals `expected` exactly."""
    value = parse_number(extract_answer(completion))
    if value is None:
        return Score(format=0.0, answer=0.0)
    return Score(format=1.0, answer=float(value == expected))


def score_countdown(numbers: Sequence[int], target: Fraction | int, completion: str) -> Score:
    """Format 1 when the answer is a valid expression; answer 1 when it uses exactly `numbers` (each
    as often as given, in any order) and evaluates exactly to `target`."""
    parsed = parse_expression(extract_answer(completion))
    if parsed is None:
        return Score(format=0.0, answer=0.0)
    correct = sorted(parsed.numbers) == sorted(numbers) and parsed.value == target
    return Score(format=1.0, answer=float(correct))
