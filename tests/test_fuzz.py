"""Fuzzing the verifiers with untrusted model output: nothing raises, nothing is slow, no code runs.

Property tests (hypothesis) over every verifier entry point, plus a 5,000-input run of the seeded
random/mutational fuzzer in scripts/fuzz_verifiers.py (its 100,000-input figures: docs/reliability.md).
tests/test_verifiers.py holds the hand-written hostile cases and the parser's agreement with an
independent evaluator; this file does not repeat them.
"""

from __future__ import annotations

import importlib.util
import math
import time
from fractions import Fraction
from pathlib import Path

import pytest
from conftest import python_steps
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastes.tasks import extract_answer, get_task, parse_expression, parse_number, score_countdown

_spec = importlib.util.spec_from_file_location(
    "fuzz_verifiers", Path(__file__).resolve().parents[1] / "scripts" / "fuzz_verifiers.py"
)
fuzz = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fuzz)

POINTS = fuzz.entry_points()
SETTINGS = settings(
    max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)

# Building blocks of hostile completions: hypothesis concatenates and repeats them.
ATOMS = st.sampled_from(
    [
        "(", ")", "9", "0", "999999", "+", "-", "*", "/", "**", "^", " ", ";", "\n", "\x00", "\t",
        "\u3000", "\u2028", "\u0663", "\uff13", "\u00b2", "e", "9**9**9", "__import__('os').system('x')",
        "eval(", "1/0", ".", "_", "inf", "nan",
    ]
)  # fmt: skip
HOSTILE = st.one_of(
    st.text(max_size=300),
    st.lists(ATOMS, max_size=60).map("".join),
    st.tuples(st.integers(0, 20_000), ATOMS, st.integers(0, 20_000)).map(
        lambda t: "(" * t[0] + t[1] + ")" * t[2]
    ),
    st.tuples(ATOMS, st.integers(1, 100_000)).map(lambda t: t[0] * t[1]),
)


# Work bounds in Python lines executed (conftest.python_steps), the same on any machine: a verifier may
# walk its input once (reverse.score compares it character by character), anything more is a blow-up.
STEPS_BASE, STEPS_PER_CHAR = 5_000, 2


def run_all(text: str) -> None:
    """Every entry point on `text`: no exception, every invariant, a bounded amount of work, no audit
    event; a call still running after 5 s (a hang) is interrupted and fails as an exception."""
    fuzz._install_audit_hook()
    results, _, events = fuzz.call_all(POINTS, text, hard_seconds=5.0)
    assert events == [], f"audit events while scoring: {events}"
    for (name, result, error), (_, call, check) in zip(results, POINTS):
        assert error is None, f"{name} raised {error!r}"
        assert check(result, text) is None, f"{name}: {check(result, text)}"
        _, steps = python_steps(call, text)
        assert steps <= STEPS_BASE + STEPS_PER_CHAR * len(text), (
            f"{name}: {steps} lines for {len(text)} chars"
        )


@SETTINGS
@given(HOSTILE)
def test_hostile_text_through_every_verifier(text):
    run_all(text)


VALID = get_task("countdown").split("train")[:50]


@st.composite
def mutated_solutions(draw) -> tuple:
    """A correct countdown solution, then a few random edits (insert, delete, replace) in its answer."""
    example = draw(st.sampled_from(VALID))
    chars = list(example.solution)
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(chars)))
        op = draw(st.sampled_from(["insert", "delete", "replace"]))
        if op == "insert" or not chars:
            chars.insert(at, draw(ATOMS))
        elif op == "delete":
            del chars[min(at, len(chars) - 1)]
        else:
            chars[min(at, len(chars) - 1)] = draw(ATOMS)
    return example, "".join(chars)


@SETTINGS
@given(mutated_solutions())
def test_mutated_solutions_never_raise_and_are_only_paid_when_right(case):
    example, text = case
    run_all(text)
    score = score_countdown(example.meta["numbers"], example.meta["target"], text)
    if score.answer:  # soundness, checked without the parser: the literals and an exact value
        answer = extract_answer(text)
        parsed = parse_expression(answer)
        assert parsed is not None and parsed.value == example.meta["target"]
        literals = "".join(ch if ch.isascii() and ch.isdigit() else " " for ch in answer).split()
        assert sorted(map(int, literals)) == sorted(example.meta["numbers"])


PADDING = st.text(alphabet=[c for c in map(chr, range(0x3100)) if c.isspace() and c != "\n"], max_size=50)


@SETTINGS
@given(st.sampled_from(VALID), PADDING, PADDING, st.text(max_size=100))
def test_whitespace_around_and_text_after_the_answer_change_nothing(example, before, after, tail):
    task = get_task("countdown")
    expected = task.score(example, example.solution)
    assert task.score(example, before + example.solution.rstrip(";") + after + ";" + tail) == expected


OTHER_DIGITS = st.characters(categories=["Nd"]).filter(lambda c: not c.isascii())


@SETTINGS
@given(st.text(alphabet="0123456789+-*/() ", max_size=30), OTHER_DIGITS, st.integers(0, 30))
def test_digits_of_other_scripts_are_never_numbers(text, digit, at):
    """str.isdigit() and int() accept '\u0663' as 3; the verifiers must not."""
    hostile = text[:at] + digit + text[at:]
    assert parse_expression(hostile) is None
    assert parse_number(hostile) is None
    assert int(digit) in range(10)  # Python itself would have taken it


def test_code_in_completions_is_rejected_and_not_run(tmp_path):
    marker = tmp_path / "pwned"
    for payload in [
        f"__import__('pathlib').Path({str(marker)!r}).write_text('x')",
        f"open({str(marker)!r}, 'w')",
        "__import__('os').system('x')",
        "9**9**9",
    ]:
        for text in (payload, payload + ";", "1+2;" + payload, f"({payload})"):
            run_all(text)
            assert parse_expression(extract_answer(text)) in (None, parse_expression("1+2"))
    assert not marker.exists()


def test_the_fuzzer_finds_exceptions_slowness_and_code_execution():
    """The harness itself can fail: a raising, a slow, an eval-ing and a looping verifier are caught."""

    def raises(text):
        if "(" in text:
            raise IndexError("bug")

    def slow(text):
        time.sleep(0.002)

    def evaluates(text):
        return eval("1")  # what a verifier must never do

    report = fuzz.run(
        n=200, seed=5, max_seconds=0.001, points=[("raises", raises, None), ("slow", slow, None)]
    )
    assert report["exceptions"] > 0 and report["slow_inputs"] == 200
    report = fuzz.run(n=20, seed=5, points=[("evaluates", evaluates, None)])
    assert report["audit_events"].get("exec") == 20 and not fuzz.ok(report)

    def loops(text):
        while True:
            pass

    report = fuzz.run(n=3, seed=5, points=[("loops", loops, None)], hard_seconds=0.05)
    assert report["exceptions"] == 3 and "raised Hung" in report["failures"][0]["problem"]


def test_fast_fuzz_run_of_five_thousand_inputs():
    # No time bound per input here (a loaded machine is slow, not wrong): the work bound is run_all's, the
    # time per input is measured by `python scripts/fuzz_verifiers.py` (docs/reliability.md).
    report = fuzz.run(n=5_000, seed=1, max_seconds=math.inf)
    assert report["failures"] == [] and fuzz.ok(report)
    assert report["exceptions"] == report["invariant_violations"] == 0 and report["audit_events"] == {}
    assert set(report["inputs_by_kind"]) == set(fuzz.WEIGHTS)  # every generator ran
    assert report["accepted"]["parse_expression(answer)"] > 100  # and the accepting paths were reached
    assert report["longest_input_chars"] >= 1_000_000


@pytest.mark.parametrize("seed", [0, 1])
def test_the_fuzzer_is_a_pure_function_of_its_seed(seed):
    assert list(fuzz.inputs(300, seed)) == list(fuzz.inputs(300, seed))
    assert list(fuzz.inputs(300, seed)) != list(fuzz.inputs(300, seed + 7))


def test_parse_number_accepts_exactly_plain_numbers():
    # A check of the whitelist the fuzzer relies on: plain numbers only, no exponents or spaces.
    assert parse_number("-7/2") == Fraction(-7, 2) and parse_number("3.25") == Fraction(13, 4)
    for text in ("1e3", " 1", "1 ", "+1", "1.", ".5", "0x1", "1_0", "\u0663"):
        assert parse_number(text) is None


def test_the_instruct_countdown_check_reads_the_answer_after_the_prompts_prefix():
    """The reply continues the prompt's "Answer:", so a correct reply need not repeat it: the check reads
    it as the task does. A case hypothesis found: "(4+8)*2" for the numbers 2, 4, 8 and the target 24."""
    _, call, check = next(p for p in POINTS if p[0] == "countdown.score (instruct)")
    for text in ["(4+8)*2", "Answer: 2*(8+4)"]:
        score = call(text)
        assert score.answer == 1.0 and check(score, text) is None, text
    assert call("9").answer == 0.0 and check(call("9"), "9") is None
