"""Seeded random and mutational fuzzing of the verifiers that score untrusted model output.

    python scripts/fuzz_verifiers.py --n 100000 --seed 0 [--json report.json]

Every input goes through every verifier entry point (fastes.tasks.verify and the built-in tasks' score
methods). The run fails (exit status 1) when any call raises, breaks an invariant (a Score outside
{0, 1}, an accepted expression with a character outside the whitelist, a "correct" countdown answer that
does not use the given numbers, ...), takes longer than --max-seconds for one input (a call still running
after --hard-seconds is interrupted and counted as raising), or triggers a Python
audit event (compile, exec, import, open, os.system, subprocess, socket, ...): model output is data, and
scoring it must run no code and touch nothing.

Inputs are drawn from generators of hostile text (deep nesting, enormous literals, exponent towers such as
9**9**9, digits of other scripts, strings of megabytes, NUL bytes, huge runs of whitespace, code such as
__import__('os').system('x')) and from mutations of valid expressions. The same seed gives the same inputs.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import signal
import sys
import threading
import time
import unicodedata
from collections import Counter
from collections.abc import Callable, Iterator
from fractions import Fraction
from typing import Any

from fastes.tasks import Score, get_task, stated_answer
from fastes.tasks.instruct import MARKERS, MAX_SEARCH_CHARS, MAX_STATED_CHARS, normalise
from fastes.tasks.verify import (
    MAX_DEPTH,
    MAX_EXPR_CHARS,
    MAX_NUMBER_CHARS,
    ParsedExpr,
    extract_answer,
    parse_expression,
    parse_number,
    score_countdown,
    score_exact,
    score_numeric,
)

EXPRESSION_CHARS = frozenset("0123456789+-*/() ")
NUMBER_CHARS = frozenset("0123456789-./")
COUNTDOWN_NUMBERS = (3, 4, 5, 25)

# --- no code runs: audit events raised while a verifier is running -----------------------------------

_watching = False
_events: list[str] = []
_hook_installed = False


def _audit(event: str, args: tuple) -> None:
    if _watching:
        _events.append(event)


def _install_audit_hook() -> None:
    global _hook_installed
    if not _hook_installed:  # audit hooks cannot be removed; one, switched on only around the calls
        sys.addaudithook(_audit)
        _hook_installed = True


# --- a hard time limit per call: a verifier that loops forever is a finding, not a hung run -----------


class Hung(Exception):
    """A verifier call ran past the hard time limit and was interrupted."""


def _expire(signum: int, frame: Any) -> None:
    raise Hung("interrupted: still running at the hard time limit")


def call_all(points: list, text: str, hard_seconds: float = 5.0) -> tuple[list, float, list[str]]:
    """Call every entry point on `text`: ([(name, result, exception)], seconds, audit events).

    Each call is interrupted (Hung) after `hard_seconds` where SIGALRM exists and this is the main thread.
    """
    global _watching
    timed = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGALRM, _expire) if timed else None
    results = []
    _events.clear()
    start = time.perf_counter()
    try:
        for name, call, _ in points:
            if timed:
                signal.setitimer(signal.ITIMER_REAL, hard_seconds)
            _watching = True
            try:
                results.append((name, call(text), None))
            except Exception as error:  # any exception is a finding, reported by the caller
                results.append((name, None, error))
            finally:
                _watching = False
                if timed:
                    signal.setitimer(signal.ITIMER_REAL, 0)
    finally:
        if timed:
            signal.signal(signal.SIGALRM, previous)
    return results, time.perf_counter() - start, list(_events)


# --- the entry points and their invariants -------------------------------------------------------------


def _check_score(score: Any) -> str | None:
    if not isinstance(score, Score):
        return f"returned {type(score).__name__}, not a Score"
    if score.format not in (0.0, 1.0) or score.answer not in (0.0, 1.0):
        return f"score outside {{0, 1}}: {score}"
    if score.answer and not score.format:
        return f"a correct answer that is not well formed: {score}"
    return None


def _check_expression(parsed: Any, text: str) -> str | None:
    if parsed is None:
        return None
    if not isinstance(parsed, ParsedExpr) or not isinstance(parsed.value, Fraction):
        return f"returned {parsed!r}"
    if len(text) > MAX_EXPR_CHARS or not set(text) <= EXPRESSION_CHARS:
        return "accepted text longer than the bound or outside the whitelist"
    depth = deepest = 0
    for ch in text:
        depth += (ch == "(") - (ch == ")")
        deepest = max(deepest, depth)
    if deepest > MAX_DEPTH:
        return f"accepted nesting {deepest} > {MAX_DEPTH}"
    if list(parsed.numbers) != [int(n) for n in re.findall("[0-9]+", text)]:
        return f"numbers {parsed.numbers} are not the literals of the text"
    return None


def _check_number(value: Any, text: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, Fraction):
        return f"returned {value!r}"
    if len(text) > MAX_NUMBER_CHARS or not set(text) <= NUMBER_CHARS:
        return "accepted a number longer than the bound or outside [0-9-./]"
    return None


def _check_countdown(score: Any, text: str) -> str | None:
    problem = _check_score(score)
    if problem or not score.answer:
        return problem
    literals = sorted(int(n) for n in re.findall("[0-9]+", extract_answer(text)))
    if literals != sorted(COUNTDOWN_NUMBERS):
        return f"scored correct without using exactly {COUNTDOWN_NUMBERS}"
    return None


def _check_extract(answer: Any, text: str) -> str | None:
    if not isinstance(answer, str) or ";" in answer or "\n" in answer or len(answer) > len(text):
        return f"extract_answer returned {answer!r:.80}"
    return None


EntryPoint = tuple[str, Callable[[str], Any], Callable[[Any, str], str | None]]


def _check_stated(stated: Any, text: str) -> str | None:
    if stated is None:
        searched = text[-MAX_SEARCH_CHARS:].lower()
        marked = any(marker in searched for marker in MARKERS)
        return "None although the text has an answer marker" if marked else None
    if not isinstance(stated, str) or len(stated) > MAX_STATED_CHARS:
        return f"not a short string: {type(stated).__name__} of {len(stated)} characters"
    if "\n" in stated:
        return "a stated answer spans lines"
    return None


def _instruct_countdown_check(example: Any) -> Callable[[Any, str], str | None]:
    """A correct instruct-form countdown answer states an expression over exactly the given numbers (read,
    as the task reads it, after the answer prefix that the prompt ends with)."""
    prefix = example.meta.get("answer_prefix", "")

    def check(score: Any, text: str) -> str | None:
        problem = _check_score(score)
        if problem or not score.answer:
            return problem
        expression = normalise(stated_answer(prefix + text) or "", "expression")
        if sorted(int(n) for n in re.findall("[0-9]+", expression)) != sorted(example.meta["numbers"]):
            return f"scored correct without stating an expression over {example.meta['numbers']}"
        return None

    return check


def entry_points() -> list[EntryPoint]:
    """(name, call, check) for every verifier a completion can reach."""
    points: list[EntryPoint] = [
        ("extract_answer", extract_answer, _check_extract),
        ("parse_expression", parse_expression, _check_expression),
        (
            "parse_expression(answer)",
            lambda t: parse_expression(extract_answer(t)),
            lambda r, t: _check_expression(r, extract_answer(t)),
        ),
        ("parse_number", parse_number, _check_number),
        (
            "parse_number(answer)",
            lambda t: parse_number(extract_answer(t)),
            lambda r, t: _check_number(r, extract_answer(t)),
        ),
        ("score_exact", lambda t: score_exact("17", t), lambda r, t: _check_score(r)),
        ("score_numeric", lambda t: score_numeric(Fraction(17, 2), t), lambda r, t: _check_score(r)),
        ("score_countdown", lambda t: score_countdown(COUNTDOWN_NUMBERS, 7, t), _check_countdown),
    ]
    points.append(("stated_answer", stated_answer, _check_stated))
    for name in ("countdown", "arithmetic", "reverse", "compare"):
        for style in ("plain", "instruct"):
            task = get_task(name, n_train=1, n_test=0, style=style)
            example = task.split("train")[0]
            points.append(
                (
                    f"{name}.score" + ("" if style == "plain" else " (instruct)"),
                    lambda t, task=task, ex=example: task.score(ex, t),
                    _instruct_countdown_check(example)
                    if (name, style) == ("countdown", "instruct")
                    else lambda r, t: _check_score(r),
                )
            )
    return points


# --- inputs --------------------------------------------------------------------------------------------

OTHER_DIGITS = [chr(c) for c in range(0x80, 0x110000) if unicodedata.category(chr(c)) == "Nd"] + list(
    "²³¹⁰⁴⁵⁶⁷⁸⁹₀₁₂"
)
WHITESPACE = [" ", "\t", "\r", "\x0b", "\x0c", "\x1c", "\x85", "\xa0", "\u2000", "\u2028", "\u3000", "\ufeff"]
HOSTILE_CHARS = list("abexyzEIN_.,^%=!~&|<>[]{}'\"`\\$#@?:") + ["\x00", "\x7f", "\n", ";", "**", "//"]
TOWERS = [
    "9**9**9",
    "9 ** 9 ** 9",
    "(9**9)**9",
    "9^9^9",
    "2**2**2**2**2",
    "pow(9, pow(9, 9))",
    "9e999999",
    "1e309",
    "-1e309",
    "10**-1",
    "inf",
    "-inf",
    "nan",
    "NaN",
    "Infinity",
    "1_000",
    "0x1F",
    "0b101",
    "0o17",
    "1j",
    "True",
    "None",
    "1.5e3",
    "--5",
    "+5",
    "5!",
    "√9",
    "9⁹",
    "1/0",
    "0/0",
    "1/(3-3)",
    "99999999999999999999/1",
]
CODE = [
    "__import__('os').system('x')",
    "__import__('os').system('touch /tmp/fastes-fuzz-pwned')",
    "eval('1+1')",
    "exec('import os')",
    "compile('1', 'x', 'eval')",
    "open('/etc/passwd').read()",
    "().__class__.__bases__[0].__subclasses__()",
    "lambda: 0",
    "[x for x in range(10**9)]",
    "'a' * 10**9",
    "globals()",
    "import os; os.system('x')",
    "{{7*7}}",
    "${7*7}",
    "`id`",
    "$(id)",
    "'; DROP TABLE runs; --",
    "\\x00\\x00",
    "\x80\x04\x95",  # a pickle header as text
    "1+__import__('os').getpid()",
    "getattr(__builtins__, 'eval')('1')",
]


def _expression(rng: random.Random, depth: int = 0) -> str:
    if depth > 3 or rng.random() < 0.35:
        return str(rng.choice([*COUNTDOWN_NUMBERS, rng.randint(0, 999_999), 0, 1]))
    left, right = _expression(rng, depth + 1), _expression(rng, depth + 1)
    text = f"{left}{rng.choice(['', '', ' '])}{rng.choice('+-*/')}{rng.choice(['', ' '])}{right}"
    return f"({text})" if rng.random() < 0.5 else text


def _mutate(rng: random.Random, text: str) -> str:
    alphabet = [*"0123456789+-*/() ;\n", *HOSTILE_CHARS, *rng.sample(OTHER_DIGITS, 3), *WHITESPACE]
    chars = list(text)
    for _ in range(rng.randint(1, 6)):
        op = rng.randrange(5)
        at = rng.randint(0, len(chars))
        if op == 0:
            chars.insert(at, rng.choice(alphabet))
        elif op == 1 and chars:
            del chars[min(at, len(chars) - 1)]
        elif op == 2 and chars:
            chars[min(at, len(chars) - 1)] = rng.choice(alphabet)
        elif op == 3 and chars:  # duplicate a slice
            end = rng.randint(at, len(chars))
            chars[at:at] = chars[at:end]
        else:
            chars[at:at] = list(rng.choice(TOWERS + CODE))
    return "".join(chars)


def _big(rng: random.Random) -> int:
    return rng.choice([10, 1_000, 10_000, 100_000, 1_000_000, rng.randint(1, 1_000_000)])


def _kinds() -> dict[str, Callable[[random.Random], str]]:
    def valid(rng):
        return _expression(rng) + rng.choice(["", ";", "; junk", "\nmore"])

    def mutated(rng):
        return _mutate(rng, valid(rng))

    def nested(rng):
        d = rng.choice([MAX_DEPTH, MAX_DEPTH + 1, 50, 1_000, _big(rng)])
        close = d if rng.random() < 0.7 else rng.randint(0, d)
        return "(" * d + rng.choice(["1", "", "1+2", "9**9"]) + ")" * close

    def literal(rng):
        n = _big(rng)
        return rng.choice(
            ["9" * n, "1" + "0" * n, "0." + "3" * n, "1/" + "7" * n, "-" + "8" * n, "9" * n + "!"]
        )

    def tower(rng):
        if rng.random() < 0.5:
            return rng.choice(TOWERS)
        return "9" + "**9" * rng.randint(1, 10_000) if rng.random() < 0.5 else "(" + "9**" * 50 + "9)"

    def unicode_digits(rng):
        return "".join(
            rng.choice([*rng.sample(OTHER_DIGITS, 4), "+", "*", "1"]) for _ in range(rng.randint(1, 40))
        )

    def long_string(rng):
        chunk = rng.choice(["1+", "(", "9", "a", " ", "\x00", "١", "1+2;", "\n", "é", "🙂", "\ud800"])
        return chunk * (_big(rng) // len(chunk) + 1)

    def nul(rng):
        text = valid(rng)
        at = rng.randint(0, len(text))
        return text[:at] + "\x00" * rng.randint(1, 4) + text[at:]

    def whitespace(rng):
        pad = rng.choice(WHITESPACE) * _big(rng)
        core = rng.choice([valid(rng), "", rng.choice(TOWERS)])
        return rng.choice([pad + core, core + pad, pad + core + pad, pad])

    def code(rng):
        payload = rng.choice(CODE)
        return rng.choice(
            [payload, "1+2;" + payload, payload + ";1+2", "(" + payload + ")", valid(rng) + payload]
        )

    def random_text(rng):
        n = rng.randint(0, 200)
        if rng.random() < 0.5:
            return "".join(chr(rng.randint(0, 0x10FFFF)) for _ in range(n))
        return bytes(rng.randrange(256) for _ in range(n)).decode("utf-8", errors="surrogateescape")

    def stated(rng):  # answers stated in ordinary text, as instruct models write them
        marker = rng.choice(
            ["Answer: ", "The answer is ", "**Answer:** ", "answer:", "ANSWER IS", "Answer:\n"]
        )
        body = rng.choice([valid(rng), mutated(rng), rng.choice(TOWERS), rng.choice(CODE), "46.", "< 3"])
        return rng.choice(["", "Let me see. 2+2=4.\n", marker + "1; "]) + marker + body

    def separators(rng):
        pieces = [valid(rng), rng.choice(TOWERS), "", " "]
        return "".join(rng.choice(pieces) + rng.choice([";", "\n", ";;", "\r\n", "\n;"]) for _ in range(4))

    return {
        "valid": valid,
        "mutated": mutated,
        "nested": nested,
        "literal": literal,
        "tower": tower,
        "unicode_digits": unicode_digits,
        "long_string": long_string,
        "nul": nul,
        "whitespace": whitespace,
        "code": code,
        "random_text": random_text,
        "separators": separators,
        "stated": stated,
    }


# Mostly short inputs, as model output is; a few percent are megabytes long.
WEIGHTS = {
    "valid": 10,
    "mutated": 40,
    "nested": 4,
    "literal": 3,
    "tower": 6,
    "unicode_digits": 6,
    "long_string": 2,
    "nul": 5,
    "whitespace": 3,
    "code": 8,
    "random_text": 8,
    "separators": 5,
    "stated": 8,
}


def inputs(n: int, seed: int) -> Iterator[tuple[str, str]]:
    """n (kind, text) pairs, a pure function of the seed."""
    rng = random.Random(seed)
    kinds = _kinds()
    names = list(WEIGHTS)
    for _ in range(n):
        kind = rng.choices(names, weights=[WEIGHTS[k] for k in names])[0]
        yield kind, kinds[kind](rng)


# --- the run -----------------------------------------------------------------------------------------


def run(
    n: int = 100_000,
    seed: int = 0,
    max_seconds: float = 0.25,
    points: list[EntryPoint] | None = None,
    hard_seconds: float = 5.0,
    log: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Fuzz `n` inputs through every entry point; returns the report (see the module docstring)."""
    _install_audit_hook()
    points = points if points is not None else entry_points()
    times: list[float] = []
    kinds: Counter[str] = Counter()
    accepted: Counter[str] = Counter()
    failures: list[dict[str, str]] = []
    exceptions = violations = slow = 0
    audit: Counter[str] = Counter()
    slowest = (0.0, "", 0)
    longest = 0
    start_all = time.perf_counter()
    for index, (kind, text) in enumerate(inputs(n, seed)):
        kinds[kind] += 1
        longest = max(longest, len(text))
        results, elapsed, events = call_all(points, text, hard_seconds)
        times.append(elapsed)
        if elapsed > slowest[0]:
            slowest = (elapsed, kind, len(text))
        if elapsed > max_seconds:
            slow += 1
            failures.append({"kind": kind, "input": repr(text[:120]), "problem": f"took {elapsed:.3f} s"})
        if events:
            audit.update(events)
            failures.append(
                {"kind": kind, "input": repr(text[:120]), "problem": f"audit events {set(events)}"}
            )
        for (name, result, error), (_, _, check) in zip(results, points):
            if error is not None:
                exceptions += 1
                problem = f"{name} raised {type(error).__name__}: {error}"
            else:
                problem = check(result, text) if check else None
                if problem:
                    violations += 1
                    problem = f"{name}: {problem}"
                elif result is not None and name.startswith("parse_"):
                    accepted[name] += 1
            if problem and len(failures) < 50:
                failures.append({"kind": kind, "input": repr(text[:120]), "problem": problem})
        if (index + 1) % 10_000 == 0:
            log(f"{index + 1} inputs, max {max(times) * 1e3:.2f} ms, {exceptions + violations} problems")
    total = time.perf_counter() - start_all
    ordered = sorted(times)
    return {
        "inputs": n,
        "seed": seed,
        "calls": n * len(points),
        "entry_points": [name for name, _, _ in points],
        "exceptions": exceptions,
        "invariant_violations": violations,
        "audit_events": dict(audit),
        "slow_inputs": slow,
        "max_seconds_bound": max_seconds,
        "max_seconds": ordered[-1] if ordered else 0.0,
        "mean_seconds": sum(times) / len(times) if times else 0.0,
        "p99_seconds": ordered[int(0.99 * (len(ordered) - 1))] if ordered else 0.0,
        "slowest": {"seconds": slowest[0], "kind": slowest[1], "chars": slowest[2]},
        "longest_input_chars": longest,
        "inputs_by_kind": dict(kinds),
        "accepted": dict(accepted),
        "total_seconds": total,
        "failures": failures[:50],
    }


def ok(report: dict[str, Any]) -> bool:
    return not (
        report["exceptions"]
        or report["invariant_violations"]
        or report["audit_events"]
        or report["slow_inputs"]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=100_000, help="number of inputs (default 100000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-seconds", type=float, default=0.25, help="time bound for one input")
    parser.add_argument(
        "--hard-seconds",
        type=float,
        default=5.0,
        help="interrupt a call running this long (counted as raising)",
    )
    parser.add_argument("--json", help="also write the report to this file")
    args = parser.parse_args(argv)
    report = run(
        args.n,
        args.seed,
        args.max_seconds,
        hard_seconds=args.hard_seconds,
        log=lambda x: print(x, file=sys.stderr),
    )
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0 if ok(report) else 1


if __name__ == "__main__":
    sys.exit(main())
