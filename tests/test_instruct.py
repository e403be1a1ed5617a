"""The instruct (natural-language) form of every built-in task: prompts in words, answers read from
ordinary model text by the same whitelist verifiers as the plain form."""

from __future__ import annotations

import pytest

from fastes.tasks import get_task, stated_answer
from fastes.tasks.instruct import normalise

BUILT_IN = ("countdown", "arithmetic", "reverse", "compare")


@pytest.mark.parametrize(
    "text, expected",
    [
        ("12 + 34 = 46.\n\nThe answer is 46.", "46"),
        ("**Answer:** 46", "46"),
        ("Answer: 46\nI hope this helps.", "46"),
        ("the answer is: 7/2.", "7/2"),
        ("Answer: 3*5+7 = 22", "3*5+7 = 22"),
        ("The answer is 10. Wait, the answer is 12.", "12"),  # the last statement counts
        ("12 + 34 = 46", None),  # no answer stated
        ("", None),
    ],
)
def test_stated_answer(text: str, expected: str | None) -> None:
    assert stated_answer(text) == expected


@pytest.mark.parametrize(
    "stated, kind, expected",
    [
        ("46 apples", "number", "46"),
        ("46.", "number", "46"),
        ("12 + 34 = 46.", "number", "46"),  # an equation: its result
        ("3*5+7 = 22", "expression", "3*5+7"),
        ("45 < 123", "relation", "<"),
        ("< or >", "relation", ""),  # two relations: no answer
        ("4185 is less than", "relation", "<"),  # a named relation
        ("16 is greater than (>)", "relation", ">"),
        ("less than or equal", "relation", ""),
        ("54321, reversed", "digits", "54321"),
    ],
)
def test_normalise(stated: str, kind: str, expected: str) -> None:
    assert normalise(stated, kind) == expected


def _phrasings(answer: str) -> list[str]:
    """Ways an instruct model states an answer in ordinary text."""
    return [
        f"Answer: {answer}",
        f"Let me think.\n\nThe answer is {answer}.",
        f"**Answer:** {answer}\n\nI hope this helps!",
    ]


@pytest.mark.parametrize("name", BUILT_IN)
def test_instruct_form_scores_known_answers(name: str) -> None:
    plain = get_task(name, seed=3, n_train=20, n_test=5)
    task = get_task(name, seed=3, n_train=20, n_test=5, style="instruct")
    asked = task.split("train")
    assert [ex.answer for ex in asked] == [ex.answer for ex in plain.split("train")]  # same problems
    for example in asked:
        assert example.prompt != example.meta["plain_prompt"]
        assert '"Answer:"' in example.prompt or example.meta["answer_prefix"] == "Answer:"
        right = example.solution.removesuffix(";") if name == "countdown" else example.answer
        # A task that starts the reply with "Answer:" reads the completion as its continuation.
        continued = [f" {right}"] if example.meta["answer_prefix"] else []
        for text in _phrasings(right) + continued:
            assert task.score(example, text).answer == 1.0, (example.prompt, text)
        assert task.score(example, "I do not know.").format == 0.0
        wrong = "9999999" if name != "compare" else ("<" if example.answer != "<" else ">")
        for text in _phrasings(wrong) + [f" {wrong}"]:
            assert task.score(example, text).answer == 0.0, (example.prompt, text)


def test_an_answer_prefix_can_be_replaced_or_dropped() -> None:
    kept = get_task("compare", n_train=2, n_test=1, style="instruct").split("train")[0]
    assert get_task("compare", n_train=2, n_test=1, style="instruct").score(kept, " 1 < 2").format == 1.0
    task = get_task("compare", n_train=2, n_test=1, style="instruct", answer_prefix="")
    assert task.split("train")[0].meta["answer_prefix"] == ""
    assert task.score(kept, " 1 < 2").format == 0.0  # no prefix: a bare relation is no stated answer
    with pytest.raises(ValueError, match="answer prefix"):
        get_task("jsonl:x.jsonl", answer_prefix="Answer:")


def test_countdown_instruct_refuses_wrong_numbers() -> None:
    task = get_task("countdown", seed=0, n_train=5, n_test=1, style="instruct")
    example = task.split("train")[0]
    target = example.meta["target"]
    assert task.score(example, f"Answer: {target}").answer == 0.0  # the target alone is no expression
    assert task.score(example, f"Answer: {target}+0").answer == 0.0  # numbers that were not given
    # a ';' inside the stated answer: the plain verifier's end of answer, which would cut it short
    expression = example.solution.partition(";")[0]
    assert task.score(example, f"Answer: {expression}").answer == 1.0
    assert task.score(example, f"Answer: {expression};0") == task.score(example, "Answer: 0 0")
    assert task.score(example, f"Answer: {expression};").answer == 1.0  # one at its end ends it


def test_instruction_replaces_the_request() -> None:
    task = get_task("arithmetic", n_train=3, n_test=1, style="instruct", instruction="and say it in french.")
    example = task.split("train")[0]
    assert (
        example.prompt
        == f"Calculate {example.meta['a']} {example.meta['op']} {example.meta['b']} and say it in french."
    )
    task = get_task("arithmetic", n_train=3, n_test=1, style="instruct", instruction="Be brief.")
    assert task.split("train")[0].prompt.endswith(f"{example.meta['b']}. Be brief.")  # a new sentence


def test_task_options_in_the_name() -> None:
    task = get_task("arithmetic:min_digits=1,max_digits=1,operations=+", n_train=10, n_test=2)
    assert all(ex.meta["op"] == "+" and ex.meta["a"] < 10 for ex in task.split("train"))
    with pytest.raises(ValueError, match="not key=value"):
        get_task("arithmetic:max_digits")
    with pytest.raises(ValueError, match="no_such"):
        get_task("arithmetic:no_such=1")
    with pytest.raises(ValueError, match="built-in task's instruct form"):
        get_task("jsonl:x.jsonl", instruction="answer briefly")
