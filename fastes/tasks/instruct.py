"""The natural-language form of a built-in task, for instruct (chat) models.

The plain form of a task is made for the built-in character model ("12+34=" -> "46;"). An instruct model
asked that way chats, and the plain verifier, which reads the text before the first ';' or newline,
never finds an answer. The instruct form asks a question in words and for the answer after "Answer:":

    Calculate 12 + 34 and write the result after "Answer:".

and reads the answer that the completion states anywhere in ordinary text:

    12 + 34 = 46.\n\nThe answer is 46.      -> "46"
    **Answer:** 46                          -> "46"

A small instruct model often answers in a sentence of its own ("4185 is greater than 2640.") and never
writes the marker. For such tasks the instruct form also has an answer prefix: words the reply starts
with, written into the prompt after the chat template (an assistant prefill), which the model continues:
the prompt ends in "Answer:" and the completion " 4185 > 2640" is read as "Answer: 4185 > 2640". Each
built-in task's wording and prefix were chosen by measuring SmolLM2-135M-Instruct on training problems
(docs/real_models.md#the-built-in-tasks-on-a-small-instruct-model).

`stated_answer` finds the last "answer:" or "answer is" (any case; in the last 16K characters), takes
the rest of that line, strips markdown emphasis and a final full stop, and `normalise` cuts it to the
shape of the task's answer. The result is then scored by the task's own plain verifier, so the whitelist
parser and every invariant of scripts/fuzz_verifiers.py hold for the instruct form too. Format reward 1
means an answer was stated in a shape the verifier accepts.
"""

from __future__ import annotations

import re

from .base import Example, GeneratedTask, Score, Task
from .verify import ANSWER_END

MARKERS = ("answer:", "answer is")  # the phrases that introduce a stated answer
MAX_STATED_CHARS = 200  # a stated answer is short; longer text after a marker is cut
# Only the end of a completion is searched for the last marker: a completion's final answer is near its
# end, and megabytes of hostile text cost no more than this much.
MAX_SEARCH_CHARS = 16_384
_WRAPPERS = "*_`$ \t"  # markdown emphasis, code and maths delimiters around an answer
ANSWER_KINDS = ("number", "expression", "relation", "digits")
_NUMBER = re.compile(r"-?[0-9]+(?:\.[0-9]+)?")
_RELATION_WORDS = {"less": "<", "smaller": "<", "greater": ">", "larger": ">", "more": ">", "equal": "="}


def stated_answer(completion: str) -> str | None:
    """The text after the last answer marker in the completion's last MAX_SEARCH_CHARS characters, up to
    the end of its line, unwrapped; None when there is no marker there."""
    if not isinstance(completion, str):
        return None
    completion = completion[-MAX_SEARCH_CHARS:]
    lowered = completion.lower()
    found = max((lowered.rfind(marker) + len(marker) if marker in lowered else -1) for marker in MARKERS)
    if found < 0:
        return None
    rest = completion[found : found + MAX_STATED_CHARS].lstrip(_WRAPPERS + ":")
    line = rest.partition("\n")[0]
    return line.strip(_WRAPPERS).removesuffix(".").strip(_WRAPPERS)


def normalise(stated: str, kind: str) -> str:
    """Cut a stated answer to the shape the plain verifier reads.

    number:     the first word ("46 apples" -> "46"), without a trailing '.', ',' or '!'; of an equation,
                the first word after its last '=' ("12 + 34 = 46" -> "46")
    expression: the part before '=' ("3*5+7 = 22" -> "3*5+7")
    relation:   the one relation symbol it holds ("45 < 123" -> "<"), else the one relation it names
                ("4185 is less than" -> "<"); '' when it holds none or several
    digits:     the first word, as for number
    """
    if kind == "expression":
        return stated.partition("=")[0].strip()
    if kind == "relation":
        symbols = {ch for ch in stated if ch in "<>="} or {
            _RELATION_WORDS[word] for word in re.findall(r"[a-z]+", stated.lower()) if word in _RELATION_WORDS
        }
        return symbols.pop() if len(symbols) == 1 else ""
    words = stated.rpartition("=")[2].split()
    return words[0].rstrip(".,!").strip(_WRAPPERS) if words else ""


class InstructTask(Task):
    """A built-in task asked in words (see the module docstring): same problems, same splits.

    `instruction` replaces the task's own request for the answer format (e.g. to try another wording);
    one that starts in lower case continues the question's sentence ("Calculate 12 + 34 and write ...").
    `answer_prefix` replaces the task's own opening words of the reply ("" for none); each example
    carries it as meta["answer_prefix"] for fastes.run.evaluation.render_prompts to write after the prompt.
    """

    def __init__(
        self, task: GeneratedTask, instruction: str | None = None, answer_prefix: str | None = None
    ) -> None:
        if task.answer_kind not in ANSWER_KINDS:
            raise ValueError(f"task {task.name!r} has no instruct form (answer_kind {task.answer_kind!r})")
        self.task = task
        self.name = task.name
        self.instruction = instruction or task.instruction
        self.answer_prefix = task.answer_prefix if answer_prefix is None else answer_prefix

    def split(self, which: str) -> list[Example]:
        return [self._ask(example) for example in self.task.split(which)]

    def _ask(self, example: Example) -> Example:
        question = self.task.question(example)
        if self.instruction[:1].islower():  # "and write ...": it continues the question's sentence
            question = question.removesuffix(".")
        prompt = f"{question} {self.instruction}"
        meta = {**example.meta, "plain_prompt": example.prompt, "answer_prefix": self.answer_prefix}
        return Example(prompt, example.answer, example.solution, meta)

    def score(self, example: Example, completion: str) -> Score:
        """The completion read after the answer prefix that the prompt ended with."""
        stated = stated_answer(self.answer_prefix + completion)
        if stated is None:
            return Score(format=0.0, answer=0.0)
        answer = normalise(stated, self.task.answer_kind).removesuffix(ANSWER_END)
        if ANSWER_END in answer:  # the plain verifier would read only the part before it, not the answer
            return Score(format=0.0, answer=0.0)
        return self.task.score(example, answer + ANSWER_END)

    def lenient_score(self, example: Example, completion: str) -> Score:
        """The answer read leniently: as `score` when one is stated, else (numbers and digits) the last
        number in the completion ("12 + 34 = 46" -> "46"). Not a reward: it tells whether a gain in
        `score` is the format (stated answers) or the problems solved."""
        if stated_answer(self.answer_prefix + completion) is not None or self.task.answer_kind not in (
            "number",
            "digits",
        ):
            return self.score(example, completion)
        numbers = _NUMBER.findall(completion[-MAX_STATED_CHARS:])
        return self.task.score(example, numbers[-1] + ANSWER_END) if numbers else Score(0.0, 0.0)
