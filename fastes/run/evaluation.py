"""One evaluation path: every measurement of a model on a task, its prompts rendered as a run renders them.

Runs (fastes/run/train.py), `fastes eval`, ESTrainer.evaluate() and the study (fastes/experiment/) all
measure through an Evaluator, built from a run's config (automatic settings resolved,
fastes.run.auto_settings): the task's prompt style, instruction and answer prefix are the task's
(fastes.tasks.setup.make_task builds it from the same config), the chat template, system prompt and answer
prefix are applied here, in render_prompts, and nowhere else.

    evaluator = Evaluator(cfg, model, tokenizer)
    evaluator.greedy(task, examples).metrics()       # accuracy, format, lenient_accuracy
    evaluator.correct_counts(task, examples, samples=32, temperature=1.0, seed=0)   # for Pass@K
    evaluator.entropy(examples, samples=8, temperature=1.0, seed=0)  # entropy of the policy on its samples
    evaluator.kl_to(base, examples, samples=4, seed=0)                # token KL to another model
    evaluator.perplexity(general_text_corpus())                       # a fixed corpus's perplexity

Sampled measurements draw row i * samples + j as sample j of example i with the given seed, so their
results do not depend on how many rows go into one generate call (eval_batch_size).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fastes.analysis.drift import masked_nll, perplexity, token_kl
from fastes.analysis.entropy import token_entropy
from fastes.analysis.passk import pass_at_k_curve
from fastes.models.generation import Generation, generate_in_chunks
from fastes.models.loading import format_prompt
from fastes.tasks import Example, Score, Task, get_task
from fastes.tasks.base import DEFAULT_TEST_PROBLEMS

from .config import TrainConfig

GENERAL_TEXT = Path(__file__).parents[1] / "assets" / "general_text.txt"
ROWS_PER_FORWARD = 256  # rows per teacher-forced forward (entropy, KL, perplexity): bounds memory


def render_prompts(cfg: TrainConfig, tokenizer: Any, examples: list[Example]) -> list[str]:
    """The model's input text for each example: its prompt with the run's chat template and system prompt,
    then the opening words of the reply when the example has them (an instruct form's answer prefix)."""
    rendered = []
    for ex in examples:
        text = format_prompt(
            tokenizer, ex.prompt, chat_template=cfg.chat_template, system_prompt=cfg.system_prompt
        )
        prefix = ex.meta.get("answer_prefix", "")
        if prefix and not text.endswith(("\n", " ")):  # no template: the reply starts a new sentence
            text += " "
        rendered.append(text + prefix)
    return rendered


@dataclass(frozen=True)
class Greedy:
    """Greedy completions of some examples and their scores; `lenient` holds each example's answer read
    leniently (instruct forms, see InstructTask.lenient_score), None for tasks without that reading."""

    texts: list[str]
    lengths: list[int]
    scores: list[Score]
    lenient: list[float] | None

    @property
    def correct(self) -> list[float]:
        return [s.answer for s in self.scores]

    def totals(self) -> list[float]:
        """[answers right, answers in the format, answers right when read leniently]: sums over examples,
        to add up over processes before rates() divides them."""
        return [sum(self.correct), sum(s.format for s in self.scores), sum(self.lenient or [])]

    def metrics(self) -> dict[str, float]:
        return rates(self.totals(), len(self.scores), self.lenient is not None)


def rates(totals: list[float], examples: int, lenient: bool) -> dict[str, float]:
    """Greedy.totals() as shares of `examples`: accuracy, format and (when read) lenient_accuracy."""
    answer, fmt, read_leniently = (float(t) / examples for t in totals)
    result = {"accuracy": answer, "format": fmt}
    if lenient:
        result["lenient_accuracy"] = read_leniently
    return result


class Evaluator:
    """A model measured as a run sees it: prompts rendered with `cfg`'s settings, completions of at most
    cfg.max_new_tokens tokens generated cfg.eval_batch_size rows per call. `cfg` must have its automatic
    settings resolved (fastes.run.auto_settings.resolve)."""

    def __init__(self, cfg: TrainConfig, model: torch.nn.Module, tokenizer: Any) -> None:
        self.cfg, self.model, self.tokenizer = cfg, model, tokenizer

    def prompts(self, examples: list[Example]) -> list[str]:
        return render_prompts(self.cfg, self.tokenizer, examples)

    def generate(
        self, examples: list[Example], *, samples: int = 1, temperature: float = 0.0, seed: int | None = None
    ) -> Generation:
        """`samples` completions of each example (greedy at temperature 0); row i * samples + j is sample
        j of example i."""
        return generate_in_chunks(
            self.model,
            self.tokenizer,
            self.prompts(examples),
            rows_per_call=self.cfg.eval_batch_size,
            max_new_tokens=self.cfg.max_new_tokens,
            temperature=temperature,
            seed=seed,
            num_return_sequences=samples,
        )

    def scores(
        self,
        task: Task,
        examples: list[Example],
        *,
        samples: int = 1,
        temperature: float = 0.0,
        seed: int | None = None,
    ) -> list[Score]:
        """The scores of generate()'s rows, in its order (one task.scores call: batch verifiers batch)."""
        gen = self.generate(examples, samples=samples, temperature=temperature, seed=seed)
        repeated = [ex for ex in examples for _ in range(samples)]
        return self._attached(task).scores(repeated, gen.texts, completion_ids=gen.completion_ids)

    def _attached(self, task: Task) -> Task:
        """`task`, told the tokenizer and device (a reward model runs where the model does)."""
        task.attach(tokenizer=self.tokenizer, device=next(self.model.parameters()).device)
        return task

    def greedy(self, task: Task, examples: list[Example]) -> Greedy:
        gen = self.generate(examples)
        scores = self._attached(task).scores(examples, gen.texts, completion_ids=gen.completion_ids)
        lenient_score = getattr(task, "lenient_score", None)  # instruct forms read answers leniently too
        lenient = None
        if lenient_score is not None:
            lenient = [lenient_score(ex, text).answer for ex, text in zip(examples, gen.texts)]
        return Greedy(gen.texts, gen.lengths, scores, lenient)

    def correct_counts(
        self, task: Task, examples: list[Example], *, samples: int, temperature: float, seed: int
    ) -> list[int]:
        """For each example, how many of `samples` sampled completions are correct (Pass@K's input)."""
        scores = self.scores(task, examples, samples=samples, temperature=temperature, seed=seed)
        return [
            int(sum(s.answer for s in scores[i * samples : (i + 1) * samples])) for i in range(len(examples))
        ]

    def entropy(self, examples: list[Example], *, samples: int, temperature: float, seed: int) -> float:
        """Entropy of the policy on its own samples: `samples` completions per example at `temperature`,
        then completion_entropy of them at that temperature."""
        gen = self.generate(examples, samples=samples, temperature=temperature, seed=seed)
        return completion_entropy(self.model, gen, self.tokenizer.pad_token_id, temperature)

    def kl_to(self, base: torch.nn.Module, examples: list[Example], *, samples: int, seed: int) -> float:
        """Token-level KL(model || base) in nats, averaged over the completion tokens of the model's own
        samples (temperature 1) of `examples`: how differently the two models continue the same text."""
        gen = self.generate(examples, samples=samples, temperature=1.0, seed=seed)
        total, count = 0.0, 0
        for input_ids, attention, mask in _completion_batches(gen, self.tokenizer.pad_token_id):
            logits = _next_token_logits(self.model, input_ids, attention)
            base_logits = _next_token_logits(base, input_ids, attention)
            tokens = int(mask.sum())
            total += float(token_kl(logits, base_logits, mask.to(logits.device))) * tokens
            count += tokens
        return total / count if count else math.nan

    @torch.no_grad()
    def perplexity(self, corpus: list[tuple[str, str]]) -> float:
        """Perplexity of each continuation given its context, over (context, continuation) texts, as
        plain text (no chat template): only continuation tokens are scored."""
        nll, tokens = 0.0, 0
        tokenizer = self.tokenizer
        for start in range(0, len(corpus), ROWS_PER_FORWARD):
            part = corpus[start : start + ROWS_PER_FORWARD]
            pairs = Generation(
                texts=[continuation for _, continuation in part],
                completion_ids=tokenizer([c for _, c in part], add_special_tokens=False)["input_ids"],
                prompt_ids=tokenizer([context for context, _ in part])["input_ids"],
            )
            input_ids, attention, continuation = completion_rows(pairs, tokenizer.pad_token_id)
            logits = _next_token_logits(self.model, input_ids, attention)
            part_nll, part_tokens = masked_nll(logits, input_ids[:, 1:], continuation[:, 1:])
            nll += part_nll
            tokens += part_tokens
        return perplexity(nll, tokens)


def pass_at_k(correct_counts: list[int], samples: int) -> dict[str, float]:
    """The Pass@K curve (unbiased estimator; k = 1, 2, 4, ... up to `samples`) with str keys, as JSON has."""
    return {str(k): v for k, v in pass_at_k_curve(correct_counts, samples).items()}


def heldout_tasks(cfg: TrainConfig, names: tuple[str, ...], size: int) -> dict[str, Task]:
    """Built-in tasks to measure forgetting on, in the run's prompt style (the instruct form for instruct
    models, each with its own request for the answer format) with at least `size` test problems."""
    return {
        name: get_task(
            name, seed=cfg.task_seed, style=cfg.prompt_style, n_test=max(DEFAULT_TEST_PROBLEMS, size)
        )
        for name in names
    }


def general_text_corpus() -> list[tuple[str, str]]:
    """The project's own short corpus of general English (fastes/assets/general_text.txt, written for
    fastes), as (context, continuation) pairs: each paragraph's first sentence, then the rest of it."""
    pairs = []
    for paragraph in GENERAL_TEXT.read_text().split("\n\n"):
        text = " ".join(paragraph.split())
        first, dot, rest = text.partition(". ")
        if text and rest:
            pairs.append((first + dot.rstrip(), " " + rest))
    return pairs


# --- teacher-forced passes over generated rows -------------------------------------------------------


def completion_rows(gen: Generation, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded prompt + completion rows of a Generation: (input_ids, attention_mask, completion_mask).

    completion_mask[i, t] is true where token t of row i is a generated token (EOS included).
    """
    rows = [p + c for p, c in zip(gen.prompt_ids, gen.completion_ids)]
    width = max(map(len, rows))
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    completion = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, (p, c) in enumerate(zip(gen.prompt_ids, gen.completion_ids)):
        input_ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        attention[i, : len(p) + len(c)] = 1
        completion[i, len(p) : len(p) + len(c)] = True
    return input_ids, attention, completion


@torch.no_grad()
def _next_token_logits(
    model: torch.nn.Module, input_ids: torch.Tensor, attention: torch.Tensor
) -> torch.Tensor:
    """Logits at positions 0..T-2, i.e. the distributions that predicted tokens 1..T-1."""
    device = next(model.parameters()).device
    out = model(input_ids=input_ids.to(device), attention_mask=attention.to(device))
    return out.logits[:, :-1]


def _completion_batches(
    gen: Generation, pad_token_id: int, rows_per_forward: int = ROWS_PER_FORWARD
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(input_ids, attention_mask, mask) for each chunk of rows_per_forward rows of `gen`, where
    mask[i, t] is true when position t predicted a completion token (it lines up with
    _next_token_logits). Chunks without any completion token are skipped."""
    for start in range(0, len(gen.texts), rows_per_forward):
        end = start + rows_per_forward
        part = Generation(gen.texts[start:end], gen.completion_ids[start:end], gen.prompt_ids[start:end])
        input_ids, attention, completion = completion_rows(part, pad_token_id)
        mask = completion[:, 1:]
        if mask.any():
            yield input_ids, attention, mask


def completion_entropy(
    model: torch.nn.Module,
    gen: Generation,
    pad_token_id: int,
    temperature: float = 1.0,
    rows_per_forward: int = ROWS_PER_FORWARD,
) -> float:
    """Mean token entropy (nats) of the model's next-token distribution at every completion token of `gen`.

    The distribution predicting completion token t is the one at position t - 1, softmax(logits / T),
    so with gen sampled from this model at temperature T this is the entropy of the policy on its own
    samples (what GRPO logs for its training batches). Averaged over all completion tokens of all rows.
    """
    total, count = 0.0, 0
    for input_ids, attention, mask in _completion_batches(gen, pad_token_id, rows_per_forward):
        logits = _next_token_logits(model, input_ids, attention)
        tokens = int(mask.sum())
        total += float(token_entropy(logits, mask.to(logits.device), temperature)) * tokens
        count += tokens
    return total / count if count else math.nan
