"""Supervised pretraining of the built-in tiny model on the tasks' reference solutions.

The goal is a *partial* skill: good enough that sampling often finds a right answer, poor enough that
greedy decoding often misses, so ES / GRPO post-training has something to improve. The shipped
checkpoint in fastes/assets/tiny is made by

    python -m fastes.run.pretrain --out fastes/assets/tiny     (or: fastes pretrain --out ...)

whose countdown data mixes two answer styles (style_mix, SHIPPED_STYLE_MIX): a base that knows the task
but often answers in a style its verifier refuses, as real pretrained models do.

Training sequences are <bos> prompt solution <eos>; the loss is on the solution and <eos> only (the
prompts are given at test time, so there is no point spending capacity on predicting them).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase, get_cosine_schedule_with_warmup

from fastes.models.generation import generate_in_chunks
from fastes.models.loading import build_tiny_model, build_tokenizer, num_params, save_model
from fastes.tasks import HELD_OUT_TASKS, TRAINABLE_TASKS, get_task
from fastes.tasks.base import Task
from fastes.tasks.countdown import with_result, wrong_solution

IGNORE = -100  # label value the HF loss skips
# Share of countdown rows in the unverifiable "expression=target;" style in the shipped tiny model. At
# 0.5 greedy decoding picks that style on ~57% of validation prompts; at 0.35 on 0.6% (greedy takes the
# likelier ending), which leaves post-training nothing to learn (docs/es_small_scale.md).
SHIPPED_STYLE_MIX = 0.5


def _rows(task: Task, distractors: float, seed: int, style_mix: float = 0.0) -> list[tuple[str, str, float]]:
    """(prompt, target text, sampling weight) of every pretraining row of `task`; weights sum to 1.

    Countdown only: with `distractors` > 0, each problem also gets one well-formed wrong solution (the
    same numbers, a value that misses the target), sampled that share of the time instead of the right
    one; with `style_mix` > 0, that share of each row's weight goes to the same text written
    "expression=target;" (countdown.with_result), a style the verifier does not accept.
    """
    examples = task.split("train")
    if task.name != "countdown":
        return [(ex.prompt, ex.solution, 1.0 / len(examples)) for ex in examples]
    rng = random.Random(f"distractors:{seed}")
    rows = []
    for ex in examples:
        wrong = wrong_solution(rng, ex.meta["numbers"], ex.meta["target"]) if distractors else None
        share = distractors if wrong is not None else 0.0
        rows.append((ex.prompt, ex.solution, (1 - share) / len(examples)))
        if wrong is not None:
            rows.append((ex.prompt, wrong, share / len(examples)))
    if not style_mix:
        return rows
    by_prompt = {ex.prompt: ex.meta["target"] for ex in examples}
    styled = [(p, with_result(text, by_prompt[p]), w * style_mix) for p, text, w in rows]
    return [(p, text, w * (1 - style_mix)) for p, text, w in rows] + styled


def check_share(name: str, value: float) -> float:
    """A share of the countdown pretraining rows: a number in [0, 1)."""
    if not 0.0 <= value < 1.0:  # also refuses NaN
        raise ValueError(f"{name} is a share of the countdown rows, in [0, 1); got {value}")
    return value


def _encode(
    tokenizer: PreTrainedTokenizerBase,
    tasks: dict[str, Task],
    distractors: float = 0.0,
    seed: int = 0,
    style_mix: float = 0.0,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """All train rows as right-padded tensors, and a sampling weight per row.

    Weights make every task equally likely in a batch, whatever the size of its train split.
    """
    input_ids, labels, weights = [], [], []
    for task in tasks.values():
        rows = _rows(task, distractors, seed, style_mix)
        prompts = tokenizer([prompt for prompt, _, _ in rows])["input_ids"]
        solutions = tokenizer([text for _, text, _ in rows], add_special_tokens=False)["input_ids"]
        for prompt, solution in zip(prompts, solutions, strict=True):
            solution = solution + [tokenizer.eos_token_id]
            input_ids.append(prompt + solution)
            labels.append([IGNORE] * len(prompt) + solution)
        weights += [weight for _, _, weight in rows]
    longest = max(map(len, input_ids))
    if longest > tokenizer.model_max_length:
        raise ValueError(
            f"a training sequence has {longest} tokens, over the model's {tokenizer.model_max_length}"
        )

    def pad(rows: list[list[int]], value: int) -> torch.Tensor:
        return torch.tensor([row + [value] * (longest - len(row)) for row in rows])

    batch = {
        "input_ids": pad(input_ids, tokenizer.pad_token_id),
        "attention_mask": pad([[1] * len(row) for row in input_ids], 0),
        "labels": pad(labels, IGNORE),
    }
    return batch, torch.tensor(weights)


def greedy_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    n: int = 200,
    batch_size: int = 200,
) -> float:
    """Fraction of the first `n` test examples whose greedy completion has the right answer."""
    examples = task.split("test")[:n]
    max_new = max(len(ex.solution) for ex in task.split("train")) + 4  # char tokenizer: 1 token per char
    prompts = [ex.prompt for ex in examples]
    out = generate_in_chunks(model, tokenizer, prompts, rows_per_call=batch_size, max_new_tokens=max_new)
    correct = sum(task.score(ex, text).answer for ex, text in zip(examples, out.texts, strict=True))
    return correct / len(examples)


def pretrain(
    out_dir: str | Path,
    *,
    size: str = "tiny",
    steps: int = 1500,
    seed: int = 0,
    tasks: Sequence[str] | None = None,
    batch_size: int = 64,
    lr: float = 3e-3,
    eval_examples: int = 200,
    progress: bool = True,
    distractors: float = 0.0,
    style_mix: float = SHIPPED_STYLE_MIX,
) -> dict:
    """Train a fresh model of `size` for `steps` AdamW steps, save it to `out_dir`, return its metrics.

    `tasks` defaults to every task, trainable and held out (their train splits only, made with task
    seed 0; `seed` drives the initialisation and the batch order). Deterministic for a given seed.
    `distractors` and `style_mix` are shares of the countdown rows (see _rows), each in [0, 1).
    """
    check_share("distractors", distractors)
    check_share("style_mix", style_mix)
    names = list(tasks) if tasks is not None else [*TRAINABLE_TASKS, *HELD_OUT_TASKS]
    start = time.perf_counter()
    # Seed a fork of the global RNG so the run is reproducible without touching the caller's RNG.
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        tokenizer = build_tokenizer()
        model = build_tiny_model(size, tokenizer)
        task_objs = {name: get_task(name, seed=0) for name in names}
        data, weights = _encode(tokenizer, task_objs, distractors, seed, style_mix)

        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
        schedule = get_cosine_schedule_with_warmup(
            optimizer, num_warmup_steps=steps // 20, num_training_steps=steps
        )
        model.train()
        losses = []
        bar = tqdm(range(steps), desc=f"pretrain {size}", disable=not progress)
        for step in bar:
            idx = torch.multinomial(weights, batch_size, replacement=True)
            batch = {k: v[idx] for k, v in data.items()}
            # Drop the all-padding tail columns of this batch: less work per step.
            width = int(batch["attention_mask"].sum(1).max())
            loss = model(**{k: v[:, :width] for k, v in batch.items()}).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            if step % 25 == 0 or step == steps - 1:
                bar.set_postfix(loss=f"{sum(losses[-25:]) / len(losses[-25:]):.3f}")
        model.eval()

    tail = max(1, min(50, steps // 10))
    metrics = {
        "size": size,
        "params": num_params(model),
        "steps": steps,
        "seed": seed,
        "tasks": names,
        "distractors": distractors,
        "style_mix": style_mix,
        "initial_loss": losses[0],
        "loss": sum(losses[-tail:]) / tail,
        "loss_curve": [
            round(sum(losses[i : i + 50]) / len(losses[i : i + 50]), 4) for i in range(0, steps, 50)
        ],
        "train_seconds": round(time.perf_counter() - start, 1),
        "greedy_accuracy": {
            name: greedy_accuracy(model, tokenizer, task, n=eval_examples) for name, task in task_objs.items()
        },
    }
    out_dir = save_model(model, tokenizer, out_dir)
    (out_dir / "pretrain.json").write_text(json.dumps(metrics, indent=2) + "\n")
    if not math.isfinite(metrics["loss"]):
        raise RuntimeError(f"pretraining diverged (loss {metrics['loss']}); try a lower lr")
    return metrics


def share_arg(text: str) -> float:
    """argparse type of a share of the pretraining data: a number in [0, 1)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be a share in [0, 1), e.g. 0.5; got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The pretraining flags, shared by `fastes pretrain` and `python -m fastes.run.pretrain`."""
    parser.add_argument("--out", type=Path, required=True, help="where to write the model directory")
    parser.add_argument("--size", default="tiny", choices=["tiny", "small"])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--distractors", type=share_arg, default=0.0, help="share of wrong countdown rows")
    parser.add_argument(
        "--style_mix",
        type=share_arg,
        default=SHIPPED_STYLE_MIX,
        help='share of countdown rows written "expression=target;", a style the verifier refuses (0: plain)',
    )
    # The model's matrices are tiny: extra threads mostly add overhead, and on a busy machine they
    # contend badly (measured on 2 cores: 1 thread ~10x faster than 2 under load).
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")


def run_from_args(args: argparse.Namespace) -> dict:
    """Pretrain as the flags of `add_arguments` say and print the metrics (the loss curve is in the
    directory's pretrain.json)."""
    torch.set_num_threads(args.threads)
    metrics = pretrain(
        args.out,
        size=args.size,
        steps=args.steps,
        seed=args.seed,
        distractors=args.distractors,
        style_mix=args.style_mix,
    )
    print(json.dumps({k: v for k, v in metrics.items() if k != "loss_curve"}, indent=2))
    return metrics


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m fastes.run.pretrain", description="Pretrain the tiny model."
    )
    add_arguments(parser)
    run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    main()
