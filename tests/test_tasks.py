"""The built-in tasks, the registry, the JSONL loader and the reasoning-gym adapter."""

from __future__ import annotations

import json
import random
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from fastes.tasks import (
    ALPHABET,
    HELD_OUT_TASKS,
    TRAINABLE_TASKS,
    CountdownTask,
    JsonlTaskError,
    Score,
    get_task,
    parse_expression,
    solve_countdown,
)
from fastes.tasks.base import MAX_PROMPT_CHARS, MAX_SOLUTION_CHARS
from fastes.tasks.countdown import wrong_solution

BUILT_IN = TRAINABLE_TASKS + HELD_OUT_TASKS
SMALL = {"n_train": 200, "n_test": 50}


# ---- every built-in task ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", BUILT_IN)
def test_default_split_sizes(name: str) -> None:
    task = get_task(name)
    assert len(task.split("train")) == 1000
    assert len(task.split("test")) == 200


@pytest.mark.parametrize("name", BUILT_IN)
def test_same_seed_same_splits(name: str) -> None:
    first, second = get_task(name, seed=3, **SMALL), get_task(name, seed=3, **SMALL)
    for which in ("train", "test"):
        assert first.split(which) == second.split(which)


@pytest.mark.parametrize("name", BUILT_IN)
def test_different_seeds_differ(name: str) -> None:
    a, b = get_task(name, seed=0, **SMALL), get_task(name, seed=1, **SMALL)
    assert a.split("train") != b.split("train")
    assert a.split("test") != b.split("test")


@pytest.mark.parametrize("name", BUILT_IN)
def test_train_and_test_are_disjoint(name: str) -> None:
    task = get_task(name)
    train = [example.prompt for example in task.split("train")]
    test = [example.prompt for example in task.split("test")]
    assert len(set(train)) == len(train)
    assert len(set(test)) == len(test)
    assert not set(train) & set(test)


@pytest.mark.parametrize("name", BUILT_IN)
def test_examples_fit_the_tokenizer_and_size_limits(name: str) -> None:
    for example in get_task(name).split("train"):
        assert set(example.prompt + example.solution) <= set(ALPHABET), example
        assert len(example.prompt) <= MAX_PROMPT_CHARS, example
        assert len(example.solution) <= MAX_SOLUTION_CHARS, example
        assert example.solution.endswith(";")


@pytest.mark.parametrize("name", BUILT_IN)
def test_stored_solutions_score_full_marks(name: str) -> None:
    task = get_task(name)
    for example in task.split("train") + task.split("test"):
        assert task.score(example, example.solution) == Score(1.0, 1.0), example
        # what the model writes after the ';' does not matter
        assert task.score(example, example.solution + "9+9; rev") == Score(1.0, 1.0), example


@pytest.mark.parametrize("name", BUILT_IN)
def test_garbage_scores_zero(name: str) -> None:
    task = get_task(name, **SMALL)
    example = task.split("test")[0]
    for completion in ["", ";", "\u0663;", "zzz;", "(((;"]:
        assert task.score(example, completion) == Score(0.0, 0.0), completion


@pytest.mark.parametrize("name", BUILT_IN)
def test_split_returns_a_copy_and_rejects_unknown_names(name: str) -> None:
    task = get_task(name, **SMALL)
    task.split("train").clear()
    assert len(task.split("train")) == 200
    with pytest.raises(ValueError, match="unknown split"):
        task.split("validation")


# ---- countdown ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_numbers", [2, 3, 4])
def test_countdown_solutions_use_the_prompt_numbers_and_hit_the_target(n_numbers: int) -> None:
    task = CountdownTask(n_numbers=n_numbers, n_train=200, n_test=50)
    for example in task.split("train") + task.split("test"):
        numbers, target = example.meta["numbers"], example.meta["target"]
        assert example.prompt == f"cd {' '.join(map(str, numbers))} > {target}:"
        assert example.answer == str(target)
        parsed = parse_expression(example.solution.rstrip(";"))
        assert parsed is not None
        assert sorted(parsed.numbers) == sorted(numbers)
        assert parsed.value == target
        assert 1 <= target <= 100


def test_countdown_scoring() -> None:
    task = CountdownTask(n_train=1, n_test=0)
    example = task.split("train")[0]
    numbers, target = example.meta["numbers"], example.meta["target"]
    used_twice = "+".join(map(str, numbers + numbers[:1])) + ";"
    assert task.score(example, used_twice) == Score(1.0, 0.0)
    assert task.score(example, f"{target};") == Score(1.0, 0.0)  # all three numbers must be used
    assert task.score(example, "cd 1 2;") == Score(0.0, 0.0)


def test_wrong_solution_is_well_formed_but_misses_the_target() -> None:
    task = CountdownTask()
    rng = random.Random(0)
    for example in task.split("train")[:50]:
        wrong = wrong_solution(rng, example.meta["numbers"], example.meta["target"])
        if wrong is not None:  # None only when every expression over the numbers hits the target
            assert task.score(example, wrong) == Score(1.0, 0.0), (example.prompt, wrong)
            assert sorted(parse_expression(wrong[:-1]).numbers) == sorted(example.meta["numbers"])
    assert wrong_solution(rng, [1, 1], 2, tries=20) in {"1*1;", "1/1;", None}


def test_solver() -> None:
    found = solve_countdown([3, 5, 7], 22)
    assert found is not None and parse_expression(found).value == 22
    # only reachable through a fractional intermediate: 8/(3-8/3)
    found = solve_countdown([3, 3, 8, 8], 24)
    assert found is not None and parse_expression(found).value == 24
    assert solve_countdown([1, 1, 1], 100) is None
    assert solve_countdown([], 0) is None


def test_solver_finds_every_generated_instance() -> None:
    task = CountdownTask(n_numbers=4, n_train=30, n_test=0)
    for example in task.split("train"):
        found = solve_countdown(example.meta["numbers"], example.meta["target"])
        assert found is not None
        parsed = parse_expression(found)
        assert parsed is not None and parsed.value == example.meta["target"]
        assert sorted(parsed.numbers) == sorted(example.meta["numbers"])


def test_countdown_rejects_bad_options() -> None:
    with pytest.raises(ValueError, match="n_numbers"):
        CountdownTask(n_numbers=7)
    with pytest.raises(ValueError, match="distinct problems"):
        CountdownTask(max_number=1, max_target=1, n_train=10, n_test=0).split("train")


# ---- arithmetic and the held-out tasks --------------------------------------------------------------------


def test_arithmetic_answers_are_right() -> None:
    task = get_task("arithmetic")
    ops = set()
    for example in task.split("train"):
        body = example.prompt.removesuffix("=")
        op = next(ch for ch in "+-*" if ch in body)
        a, b = (int(part) for part in body.split(op))
        expected = {"+": a + b, "-": a - b, "*": a * b}[op]
        assert example.answer == str(expected) and expected >= 0
        assert 10 <= a <= 999 and 10 <= b <= 999
        ops.add(op)
    assert ops == {"+", "-", "*"}


def test_arithmetic_scoring() -> None:
    task = get_task("arithmetic", **SMALL)
    example = next(e for e in task.split("train") if e.meta["op"] == "+")
    result = example.meta["result"]
    assert task.score(example, f"{result + 1};") == Score(1.0, 0.0)
    assert task.score(example, f"{example.meta['a']}+{example.meta['b']};") == Score(0.0, 0.0)


def test_reverse_and_compare_answers_are_right() -> None:
    for example in get_task("reverse").split("train"):
        digits = example.prompt.removeprefix("rev ").removesuffix(":")
        assert example.answer == digits[::-1]
    relations = []
    for example in get_task("compare").split("train"):
        a, b = (int(n) for n in example.prompt.removeprefix("cmp ").removesuffix(":").split())
        assert example.answer == ("<" if a < b else ">" if a > b else "=")
        relations.append(example.answer)
    assert min(relations.count(r) for r in "<>=") > 250  # roughly balanced


def test_held_out_format_reward() -> None:
    reverse = get_task("reverse", **SMALL)
    example = reverse.split("test")[0]
    assert reverse.score(example, "1;").format == 1.0
    compare = get_task("compare", **SMALL)
    example = next(e for e in compare.split("test") if e.answer == "<")
    assert compare.score(example, ">;") == Score(1.0, 0.0)
    assert compare.score(example, "<>;") == Score(0.0, 0.0)


# ---- registry ------------------------------------------------------------------------------------------


def test_registry_names() -> None:
    assert set(TRAINABLE_TASKS) == {"countdown", "arithmetic"}
    assert HELD_OUT_TASKS and not set(TRAINABLE_TASKS) & set(HELD_OUT_TASKS)
    for name in BUILT_IN:
        assert get_task(name, n_train=5, n_test=2).name == name


def test_registry_unknown_name_lists_tasks() -> None:
    with pytest.raises(ValueError, match="unknown task 'sudoku'") as raised:
        get_task("sudoku")
    for name in (*BUILT_IN, "jsonl:<path>", "reasoning_gym:<dataset>"):
        assert name in str(raised.value)
    with pytest.raises(ValueError, match="unknown task"):
        get_task("jsonl:")


def test_registry_passes_options() -> None:
    task = get_task("countdown", seed=5, n_train=7, n_test=3, n_numbers=4)
    assert len(task.split("train")) == 7 and len(task.split("test")) == 3
    assert all(len(example.meta["numbers"]) == 4 for example in task.split("train"))
    with pytest.raises(TypeError):
        get_task("arithmetic", no_such_option=1)


# ---- JSONL ---------------------------------------------------------------------------------------------


def _write(tmp_path: Path, lines: list[Any]) -> Path:
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


def test_jsonl_round_trip(tmp_path: Path) -> None:
    rows = [
        {"prompt": "cd 3 5 7 > 22:", "answer": "22", "verifier": "countdown", "numbers": [3, 5, 7]},
        {"prompt": "2+2=", "answer": 4, "verifier": "numeric", "split": "test"},
        {"prompt": "say hi:", "answer": "hi", "verifier": "exact", "split": "train", "meta": {"id": 7}},
        {"prompt": "half:", "answer": "1/2", "verifier": "numeric", "solution": "0.5"},
    ]
    path = _write(tmp_path, [rows[0], "", rows[1], rows[2], rows[3]])
    task = get_task(f"jsonl:{path}", test_fraction=0.0)
    train, test = task.split("train"), task.split("test")
    assert [e.prompt for e in test] == ["2+2="]
    assert {e.prompt for e in train} == {"cd 3 5 7 > 22:", "say hi:", "half:"}
    by_prompt = {e.prompt: e for e in train + test}
    for example in by_prompt.values():
        assert task.score(example, example.solution) == Score(1.0, 1.0)
    countdown = by_prompt["cd 3 5 7 > 22:"]
    assert task.score(countdown, "7+3*5;") == Score(1.0, 1.0)
    assert task.score(countdown, "22;") == Score(1.0, 0.0)
    assert task.score(by_prompt["2+2="], "4.0;") == Score(1.0, 1.0)
    assert task.score(by_prompt["2+2="], "2+2;") == Score(0.0, 0.0)
    assert task.score(by_prompt["say hi:"], "hello;") == Score(1.0, 0.0)
    assert by_prompt["say hi:"].meta["user"] == {"id": 7}
    assert by_prompt["half:"].solution == "0.5;"


def test_jsonl_seeded_assignment(tmp_path: Path) -> None:
    path = _write(tmp_path, [{"prompt": f"{i}?", "answer": str(i), "verifier": "exact"} for i in range(50)])
    first = get_task(f"jsonl:{path}", seed=0)
    again = get_task(f"jsonl:{path}", seed=0)
    other = get_task(f"jsonl:{path}", seed=1)
    assert first.split("test") == again.split("test")
    assert len(first.split("test")) == 10 and len(first.split("train")) == 40
    assert first.split("test") != other.split("test")
    assert not {e.prompt for e in first.split("test")} & {e.prompt for e in first.split("train")}


GOOD = {"prompt": "1+1=", "answer": "2", "verifier": "numeric"}


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "malformed JSON"),
        ("[1, 2]", "expected a JSON object"),
        ({"answer": "2", "verifier": "exact"}, "missing key 'prompt'"),
        ({"prompt": "a", "verifier": "exact"}, "missing key 'answer'"),
        ({"prompt": "a", "answer": "b"}, "missing key 'verifier'"),
        ({"prompt": "a", "answer": "b", "verifier": "regex"}, "unknown verifier 'regex'; use one of"),
        ({"prompt": "a", "answer": "b", "verifier": "exact", "spilt": "test"}, "unknown key(s) 'spilt'"),
        ({"prompt": "a", "answer": "b", "verifier": "exact", "split": "dev"}, "'split' must be"),
        ({"prompt": "", "answer": "b", "verifier": "exact"}, "'prompt' must be a non-empty string"),
        ({"prompt": "a", "answer": True, "verifier": "numeric"}, "'answer' must be a string or a number"),
        ({"prompt": "a", "answer": "b;c", "verifier": "exact"}, "must not contain ';'"),
        ({"prompt": "a", "answer": "many", "verifier": "numeric"}, "is not a number"),
        ({"prompt": "a", "answer": "5", "verifier": "countdown"}, "countdown needs 'numbers'"),
        ({"prompt": "a", "answer": "5", "verifier": "countdown", "numbers": [1, "2"]}, "countdown needs"),
        ({"prompt": "a", "answer": "100", "verifier": "countdown", "numbers": [1, 1, 1]}, "no expression"),
        ({"prompt": "a", "answer": "9", "verifier": "countdown", "numbers": [1] * 5}, "add a 'solution'"),
        ({"prompt": "a", "answer": "5", "verifier": "exact", "numbers": [5]}, "'numbers' is only used"),
        ({"prompt": "a", "answer": "5", "verifier": "numeric", "solution": "6"}, "is not scored as correct"),
        ({"prompt": "Capital?", "answer": "b", "verifier": "exact"}, "characters 'C' are not in"),
        ({"prompt": "1+1=", "answer": "2", "verifier": "exact"}, "already appears on line 1"),
    ],
)
def test_jsonl_errors_name_file_line_and_problem(tmp_path: Path, line: Any, message: str) -> None:
    path = _write(tmp_path, [GOOD, line])
    with pytest.raises(JsonlTaskError) as raised:
        get_task(f"jsonl:{path}")
    assert str(raised.value).startswith(f"{path}:2: ")  # the file and the line
    assert message in str(raised.value)


def test_jsonl_missing_and_empty_files(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        get_task(f"jsonl:{missing}")
    for text in ["", "\n  \n"]:
        empty = tmp_path / "empty.jsonl"
        empty.write_text(text)
        with pytest.raises(JsonlTaskError, match="no tasks found"):
            get_task(f"jsonl:{empty}")
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(JsonlTaskError, match="not UTF-8"):
        get_task(f"jsonl:{binary}")


def test_jsonl_alphabet_check_can_be_turned_off(tmp_path: Path) -> None:
    path = _write(tmp_path, [{"prompt": "Capital of France?", "answer": "Paris", "verifier": "exact"}])
    task = get_task(f"jsonl:{path}", strict_alphabet=False, test_fraction=0.0)
    assert task.split("train")[0].solution == "Paris;"


# ---- reasoning-gym --------------------------------------------------------------------------------------


def test_reasoning_gym_missing_package_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # makes `import reasoning_gym` fail
    with pytest.raises(ImportError, match="pip install reasoning-gym"):
        get_task("reasoning_gym:leg_counting")


class _FakeDataset:
    """Stands in for a reasoning-gym dataset: the documented indexing, len and score_answer."""

    def __init__(self, size: int, seed: int, **config: Any) -> None:
        self.size, self.seed, self.config = size, seed, config

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> dict[str, Any]:
        n = (idx * 7 + self.seed) % 12  # repeats, so some test questions also occur in train
        return {"question": f"How many legs do {n} cats have?", "answer": str(4 * n), "metadata": {}}

    def score_answer(self, answer: str | None, entry: dict[str, Any]) -> float:
        if answer == "boom":
            raise RuntimeError("scorer bug")
        return 1.0 if answer == entry["answer"] else 0.0


def test_reasoning_gym_adapter(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def create_dataset(name: str, **kwargs: Any) -> _FakeDataset:
        calls.append((name, kwargs))
        return _FakeDataset(**kwargs)

    fake = types.ModuleType("reasoning_gym")
    fake.create_dataset = create_dataset  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "reasoning_gym", fake)

    task = get_task("reasoning_gym:leg_counting", seed=3, n_train=10, n_test=10, max_animals=2)
    assert calls == [("leg_counting", {"size": 20, "seed": 3, "max_animals": 2})]
    assert task.name == "reasoning_gym:leg_counting"
    train, test = task.split("train"), task.split("test")
    assert len(train) == 10 and 0 < len(test) < 10
    assert not {e.prompt for e in train} & {e.prompt for e in test}
    example = train[0]
    assert task.score(example, example.solution) == Score(1.0, 1.0)
    assert task.score(example, "-1;") == Score(1.0, 0.0)
    assert task.score(example, "boom") == Score(1.0, 0.0)  # a crashing scorer counts as wrong
    assert task.score(example, "") == Score(0.0, 0.0)


def test_a_batch_scores_each_distinct_completion_of_a_prompt_once(monkeypatch):
    """An ES population's members often write the same completion: scores() calls the verifier once per
    distinct (example, completion) and returns what scoring each pair alone returns."""
    task = get_task("countdown", seed=0)
    examples = task.split("test")[:3]
    completions = ["1+2", "bad", "1+2"]
    asked = [ex for ex in examples for _ in completions] * 4  # 4 members, 3 prompts, 3 samples each
    texts = completions * len(examples) * 4
    expected = [task.score(ex, text) for ex, text in zip(asked, texts)]
    calls = []
    real_score = type(task).score
    monkeypatch.setattr(
        type(task), "score", lambda self, ex, text: calls.append(1) or real_score(self, ex, text)
    )
    assert task.scores(asked, texts) == expected
    assert len(calls) == len(examples) * 2  # "1+2" and "bad" per prompt
