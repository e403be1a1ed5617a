"""ES in the training loop: the run's ES, and one iteration of it.

An iteration scores every member on one batch of prompts (greedy completions under the member's
perturbation, scored by the task's verifier), then takes `es.step`: the rewards are shaped and the
update is fused (fastes.ES). How the members are evaluated is the config's es.eval_mode: member by member,
or the whole population in one generate call (fastes.es.population). GRPO's step is in
fastes/run/grpo_loop.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import torch

from fastes import distributed
from fastes.analysis.diversity import js_diversity
from fastes.es.optimizer import ES
from fastes.es.params import linear_weights
from fastes.es.population import member_groups, population_batched
from fastes.models.generation import Generation, generate

from .config import ESSettings, es_kwargs
from .shared import Run, batch_for, learning_rates, reward_parts

ES_SAMPLING_SEED = 7_919  # keeps ES's sampling streams apart from GRPO's at the same run seed and step


def evolved_weights(model: torch.nn.Module, c: ESSettings) -> list[tuple[str, torch.nn.Parameter]]:
    """The (name, tensor) pairs the config asks ES to evolve (es.evolve, es.include_*)."""
    return linear_weights(
        model,
        names=c.evolve or None,
        include_embeddings=c.include_embeddings,
        include_norms=c.include_norms,
        include_biases=c.include_biases,
    )


def make_es(run: Run) -> ES:
    """The run's ES: the evolved weights of its config, and every ES argument the config sets (es_kwargs)."""
    return ES(evolved_weights(run.model, run.cfg.es), **es_kwargs(run.cfg))


def es_iteration(run: Run, es: ES, step: int) -> dict[str, float]:
    """Score every member on one batch of prompts (es.num_generations completions per prompt, greedy
    by default), then take the ES step.

    eval_mode "member" generates member by member under each member's perturbation; "materialised" and
    "virtual" generate for the whole population in one call (fastes.es.population), rows grouped by member;
    materialised mode in groups whose perturbed weights fit in es.materialise_mb (big models: one each).
    Under torchrun each process evaluates its members (es.members()) and es.step all-reduces the rewards.
    """
    examples = batch_for(run, "es", step)
    prompts = run.prompts(examples)
    c = run.cfg.es
    rows = len(prompts) * c.num_generations  # sample j of prompt i is row i * num_generations + j

    def complete(members: list, count: int) -> Generation:
        """Completions of `count` members (from members[0]) in one call; sampled rows are seeded by the
        step and the member's index, so a resumed run and any split over processes draw the same."""
        return generate(
            run.model,
            run.tokenizer,
            prompts * count,
            max_new_tokens=run.cfg.max_new_tokens,
            temperature=c.temperature,
            top_p=c.top_p,
            top_k=c.top_k,
            min_p=c.min_p,
            repetition_penalty=c.repetition_penalty,
            seed=run.cfg.seed * 1_000_003 + step + ES_SAMPLING_SEED,
            num_return_sequences=c.num_generations,
            first_row=members[0].index * rows,
        )

    start = time.perf_counter()
    timer = PartTimer()
    texts, ids, tokens = [], [], 0  # each member's completions, and their token ids
    mode = run.cfg.es.eval_mode
    if mode != "member":
        for group in member_groups(es, mode, run.cfg.es.materialise_mb * 2**20):
            with ExitStack() as stack:
                with timer("noise"):  # the members' weights (materialised) or noise factors (lowrank)
                    members = stack.enter_context(population_batched(es, run.model, mode=mode, members=group))
                with timer("generation"):
                    gen = complete(group, len(members))
            each = [slice(i * rows, (i + 1) * rows) for i in range(len(members))]
            texts += [gen.texts[r] for r in each]
            ids += [gen.completion_ids[r] for r in each]
            tokens += gen.num_tokens
    else:
        for member in es.members():
            with ExitStack() as stack:
                with timer("noise"):  # perturb in place
                    stack.enter_context(member)
                with timer("generation"):
                    gen = complete([member], 1)
                with timer("noise"):  # restore, exactly
                    stack.close()
            texts.append(gen.texts)
            ids.append(gen.completion_ids)
            tokens += gen.num_tokens
    with timer("scoring"):
        asked = [ex for ex in examples for _ in range(c.num_generations)]  # in the order of the rows
        flat = run.task.scores(
            asked * len(texts),
            [t for member_texts in texts for t in member_texts],
            completion_ids=[i for member_ids in ids for i in member_ids],
        )
    scores = [flat[i * rows : (i + 1) * rows] for i in range(len(texts))]
    weights = [[s.reward(run.cfg.format_weight) for s in row] for row in scores]
    lr = learning_rates(c.lr, c.lr_scheduler_type, c.warmup_steps, c.iterations)(step)
    for group in es.param_groups:  # the schedule's rate; es.step records it, so replay() is exact
        group["lr"] = lr
    with timer("update"):
        rewards = es.step(torch.tensor(weights, dtype=torch.float64))
    answers = torch.tensor([[s.answer for s in row] for row in scores], dtype=torch.float64)
    well_formed = distributed.all_sum([sum(s.format for s in flat), len(flat)]).tolist()
    answers = distributed.gather_strided(answers, es.population)
    # a batch decodes until its longest completion ends: one member that answers at length sets the time
    longest = torch.tensor(
        [[max(map(len, member_ids), default=0)] for member_ids in ids], dtype=torch.float64
    )
    longest = distributed.gather_strided(longest, es.population)
    tokens = int(distributed.all_sum([tokens])[0])
    seconds = time.perf_counter() - start
    per_member = rewards.mean(dim=1)
    record = {
        "reward": float(per_member.mean()),
        "reward_std": float(per_member.std(correction=0)),
        "reward_max": float(per_member.max()),
        "format": well_formed[0] / well_formed[1],
        "completion_tokens_max": int(longest.max()),
        "lr": lr,
    }
    # JS diversity is defined on acceptance rates in [0, 1]: verifier outcomes, not any user reward.
    if bool(((answers >= 0) & (answers <= 1)).all()):
        diversity = js_diversity(answers)
        record.update(js_diversity=float(diversity.normalized), members_agree=float(diversity.agreement))
    record.update(reward_parts(run.task, flat))
    return {**record, "seconds": seconds, "tokens_per_second": tokens / seconds, **timer.record()}


class PartTimer:
    """Seconds spent in each named part of an iteration: `with timer("noise"): ...`, then record()."""

    PARTS = ("generation", "noise", "scoring", "update")

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(self.PARTS, 0.0)

    @contextmanager
    def __call__(self, part: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[part] += time.perf_counter() - start

    def record(self) -> dict[str, float]:
        """{"time/generation": s, ...}: the metric names of metrics.jsonl."""
        return {f"time/{part}": seconds for part, seconds in self.seconds.items()}
