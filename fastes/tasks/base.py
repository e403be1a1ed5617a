"""What every task provides: examples with a reference solution, and a verifier that scores completions.

Tasks know nothing of ES, GRPO or models: they turn a seed into prompts and score text.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

# Every character a built-in task can put in a prompt or a solution. The built-in character-level
# tokenizer is made from exactly this alphabet, so a new task must only use these characters.
ALPHABET = "0123456789+-*/()=<>:,.;? abcdefghijklmnopqrstuvwxyz"


@dataclass(frozen=True)
class Example:
    """One problem: the text the model sees, the canonical answer, and a correct completion."""

    prompt: str
    answer: str
    solution: str
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Score:
    """A verifier's verdict, kept as two parts so the reward can weigh them as configured."""

    format: float  # 1.0 when the completion is well formed, else 0.0
    answer: float  # 1.0 when the completion is correct, else 0.0
    # Tasks scored by several reward functions: each one's own value by name (logged as rewards/<name>/*),
    # while `answer` holds their weighted sum.
    rewards: dict[str, float] = field(default_factory=dict, hash=False)  # Score stays hashable

    def reward(self, format_weight: float = 0.1) -> float:
        """Combined reward: format_weight * format + answer (the ES-at-scale paper uses 0.1)."""
        return format_weight * self.format + self.answer


class Task(ABC):
    """A verifiable task with fixed, seed-generated train and test splits."""

    name: str
    # Both splits: set by the constructor, or drawn on first use by `_draw_splits`.
    _splits: dict[str, list[Example]] | None = None

    def split(self, which: str) -> list[Example]:
        """The examples of split `which` ("train" or "test"): a fresh copy of the same list on every call."""
        check_split(which)
        if self._splits is None:
            self._splits = self._draw_splits()
        return list(self._splits[which])

    def _draw_splits(self) -> dict[str, list[Example]]:
        raise NotImplementedError(f"{type(self).__name__} must set self._splits or define _draw_splits")

    @abstractmethod
    def score(self, example: Example, completion: str) -> Score:
        """Score a model completion (untrusted text) against an example. Never raises on bad text."""

    def scores(
        self, examples: list[Example], completions: list[str], completion_ids: list[list[int]] | None = None
    ) -> list[Score]:
        """Score a batch: completion i against example i (one call, so that batch verifiers can batch).
        `completion_ids`: the generated token ids of each completion, for tasks whose reward functions take
        them (TRL's `completion_ids`); built-in verifiers read the text only.

        `score` is a verifier, a function of the example and the text alone, so each distinct pair is scored
        once: an ES population's members often write the same completion of a prompt."""
        scored: dict[tuple[int, str], Score] = {}
        for example, completion in zip(examples, completions, strict=True):
            key = (id(example), completion)  # the same Example object, asked of every member
            if key not in scored:
                scored[key] = self.score(example, completion)
        return [scored[(id(example), completion)] for example, completion in zip(examples, completions)]

    # Hooks the training loop calls; tasks scored by reward functions use them (fastes/tasks/reward_file.py).

    def attach(self, *, tokenizer: Any = None, device: Any = None) -> None:  # noqa: B027 - optional hook
        """The run's tokenizer and device, before the first scoring call."""

    def at_step(self, global_step: int, max_steps: int | None = None) -> None:  # noqa: B027 - optional hook
        """The run is at `global_step` (steps taken so far): called before the first step and after each."""

    def logged(self) -> tuple[dict[str, list[float]], dict[str, list[Any]]]:
        """What reward functions logged since the last call, emptied: ({metric: values}, {column: values})."""
        return {}, {}


# Size limits for built-in tasks: the tiny character-level model trains on a CPU, so problems stay short.
MAX_PROMPT_CHARS = 24
MAX_SOLUTION_CHARS = 16

SPLITS = ("train", "test")
DEFAULT_TEST_PROBLEMS = 200  # test problems a generated task draws unless told otherwise


def check_split(which: str) -> None:
    """Raise ValueError unless `which` names a split."""
    if which not in SPLITS:
        raise ValueError(f"unknown split {which!r}; use one of {', '.join(SPLITS)}")


def outside_alphabet(text: str) -> str:
    """The characters of `text` that are not in ALPHABET, in order of first appearance ('' when none)."""
    return "".join(dict.fromkeys(ch for ch in text if ch not in ALPHABET))


class GeneratedTask(Task):
    """A task whose examples are drawn from a seeded generator.

    Subclasses set `name` and implement `generate`. The splits are drawn once, on first use, from a
    random.Random seeded with the task name and the seed, so they are the same on every run and machine.
    Examples are deduplicated by prompt before splitting, which makes train and test disjoint.

    For the natural-language form that instruct models get (fastes.tasks.instruct), a subclass also
    sets `answer_kind` and `instruction` (and may change `answer_prefix`) and implements `question`.
    """

    answer_kind = ""  # "number", "expression", "relation" or "digits": how a stated answer is read
    instruction = ""  # the request for the answer format, after the question in the instruct form
    # The instruct form's opening words of the reply, written into the prompt. Without them
    # SmolLM2-135M-Instruct states an answer after a marker on 0-57% of a task's problems, with them on
    # 67-97% (docs/real_models.md#the-built-in-tasks-on-a-small-instruct-model).
    answer_prefix = "Answer:"

    def __init__(self, seed: int = 0, n_train: int = 1000, n_test: int = DEFAULT_TEST_PROBLEMS) -> None:
        if n_train < 0 or n_test < 0:
            raise ValueError(f"n_train and n_test must be >= 0, got {n_train} and {n_test}")
        self.seed = seed
        self.n_train = n_train
        self.n_test = n_test

    @abstractmethod
    def generate(self, rng: random.Random) -> Example | None:
        """Draw one example using only `rng`, or return None to reject the draw and try again."""

    def question(self, example: Example) -> str:
        """The problem of `example` asked in words (the instruct form)."""
        raise NotImplementedError(f"task {self.name!r} has no instruct form")

    def _draw_splits(self) -> dict[str, list[Example]]:
        # Seeding with a string mixes in the task name, so equal seeds of different tasks are unrelated.
        rng = random.Random(f"{self.name}:{self.seed}")
        wanted = self.n_train + self.n_test
        max_draws = max(2_000, 30 * wanted)  # plenty for every built-in task's defaults
        examples: dict[str, Example] = {}  # by prompt, in the order drawn
        for _ in range(max_draws):
            if len(examples) == wanted:
                break
            example = self.generate(rng)
            if example is None or example.prompt in examples:
                continue
            if len(example.prompt) > MAX_PROMPT_CHARS or len(example.solution) > MAX_SOLUTION_CHARS:
                continue
            bad = outside_alphabet(example.prompt + example.solution)
            if bad:
                raise RuntimeError(f"task {self.name!r} generated characters outside ALPHABET: {bad!r}")
            examples[example.prompt] = example
        if len(examples) < wanted:
            raise ValueError(
                f"task {self.name!r} found only {len(examples)} distinct problems in {max_draws} draws but "
                f"{wanted} were asked for; lower n_train/n_test or widen the task's options"
            )
        drawn = list(examples.values())
        return {"train": drawn[: self.n_train], "test": drawn[self.n_train :]}
