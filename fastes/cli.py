"""The `fastes` command: demo, train, eval, pretrain.

fastes demo                       ES on the built-in tiny model and countdown, with a plot
fastes train --config run.toml    ES, GRPO or GRPO then ES; any key as a flag: --es.sigma 0.01
fastes eval --model DIR           accuracy and Pass@K of a model directory on a task
fastes pretrain --out DIR         rebuild the tiny model by supervised training
fastes experiment --preset tiny   ES vs GRPO vs GRPO then ES at equal budgets: plots and report.md
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from .config import ConfigError, flag_specs, load_config


def _parse_bool(text: str) -> bool:
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="a TOML file of settings (flags override it)")
    for key, kind in flag_specs():
        parser.add_argument(
            f"--{key}",
            dest=f"cfg:{key}",
            type=_parse_bool if kind is bool else kind,
            default=None,
            metavar=kind.__name__.upper(),
        )


def _overrides(args: argparse.Namespace, defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    values = dict(defaults or {})
    for name, value in vars(args).items():
        if name.startswith("cfg:") and value is not None:
            values[name[4:]] = value
    return values


def _curve_plot(metrics: list[dict], path: Path) -> Path:
    from .analysis.plots import plot_metric_over_steps

    steps = [m for m in metrics if "reward" in m]
    evals = [m for m in metrics if "test_accuracy" in m]
    return plot_metric_over_steps(
        {
            "train reward": ([m["global_step"] for m in steps], [m["reward"] for m in steps]),
            "test accuracy": ([m["global_step"] for m in evals], [m["test_accuracy"] for m in evals]),
        },
        path,
        title="fastes: post-training on countdown",
        metric="reward / accuracy",
        xlabel="iteration",
    )


def cmd_train(args: argparse.Namespace, defaults: dict[str, Any] | None = None) -> dict:
    from .train import train

    cfg = load_config(args.config, _overrides(args, defaults))
    summary = train(cfg, resume=args.resume)
    metrics = [json.loads(line) for line in (Path(cfg.out_dir) / "metrics.jsonl").read_text().splitlines()]
    summary["plot"] = str(_curve_plot(metrics, Path(cfg.out_dir) / "curve.png"))
    base, final = summary["base_test_accuracy"], summary["final_test_accuracy"]
    gain, se, n = summary["test_gain"], summary["test_gain_se"], summary["test_problems"]
    print(f"\nbase model test accuracy:    {base:.1%}")
    print(f"trained model test accuracy: {final:.1%}")
    # The paired standard error (same problems before and after) says how large a gain must be to be real.
    if math.isfinite(se) and se > 0:
        verdict = "above noise" if gain > 3 * se else "within noise (under 3 standard errors)"
        print(
            f"gain: {gain * 100:+.1f} points +- {se * 100:.1f} (paired standard error on {n} test problems; "
            f"{gain / se:+.1f} SE): {verdict}"
        )
    else:
        print(f"gain: {gain * 100:+.1f} points on {n} test problems")
    print(
        f"trained model: {summary['model_dir']}   metrics: {cfg.out_dir}/metrics.jsonl   "
        f"plot: {summary['plot']}"
    )
    return summary


def cmd_eval(args: argparse.Namespace) -> dict:
    from .analysis.passk import pass_at_k_curve
    from .generation import generate
    from .models import format_prompt, load_model, tiny_model_path
    from .tasks import get_task

    model, tokenizer = load_model(args.model or tiny_model_path(), dtype=args.dtype)
    task = get_task(args.task, seed=args.task_seed)
    examples = task.split(args.split)[: args.limit]
    prompts = [format_prompt(tokenizer, ex.prompt) for ex in examples]
    greedy = generate(model, tokenizer, prompts, max_new_tokens=args.max_new_tokens)
    accuracy = sum(task.score(ex, t).answer for ex, t in zip(examples, greedy.texts)) / len(examples)
    result: dict[str, Any] = {"task": args.task, "examples": len(examples), "greedy_accuracy": accuracy}
    if args.samples > 1:
        sampled = generate(
            model,
            tokenizer,
            prompts,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            seed=args.seed,
            num_return_sequences=args.samples,
        )
        correct = [
            sum(task.score(ex, sampled.texts[i * args.samples + j]).answer for j in range(args.samples))
            for i, ex in enumerate(examples)
        ]
        result["pass_at_k"] = {str(k): v for k, v in pass_at_k_curve(correct, args.samples).items()}
    print(json.dumps(result, indent=2))
    return result


def cmd_pretrain(args: argparse.Namespace) -> dict:
    from .pretrain import pretrain

    metrics = pretrain(args.out, size=args.size, steps=args.steps, seed=args.seed)
    print(json.dumps({k: v for k, v in metrics.items() if k != "loss_curve"}, indent=2))
    return metrics


def cmd_experiment(args: argparse.Namespace) -> dict:
    from .experiment import run_experiment

    metrics = run_experiment(args.preset, args.out, model=args.model)
    print(f"\nreport: {Path(args.out) / 'report.md'}   metrics: {Path(args.out) / 'metrics.json'}")
    for finding in metrics["findings"]:
        print(f"- {finding['claim']}: {finding['verdict']}")
    return metrics


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fastes", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="ES on the built-in tiny model and countdown (the main job)")
    demo.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    _add_config_flags(demo)

    train = sub.add_parser("train", help="post-train a model with ES, GRPO or GRPO then ES")
    train.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    _add_config_flags(train)

    ev = sub.add_parser("eval", help="greedy accuracy and Pass@K of a model directory on a task")
    ev.add_argument("--model", default="", help="model directory (default: the built-in tiny model)")
    ev.add_argument("--task", default="countdown")
    ev.add_argument("--task-seed", type=int, default=0)
    ev.add_argument("--split", default="test", choices=["train", "test"])
    ev.add_argument("--limit", type=int, default=200, help="number of examples")
    ev.add_argument("--samples", type=int, default=16, help="samples per prompt for Pass@K (1 = greedy only)")
    ev.add_argument("--temperature", type=float, default=1.0)
    ev.add_argument("--max-new-tokens", type=int, default=12)
    ev.add_argument("--dtype", default=None)
    ev.add_argument("--seed", type=int, default=0)

    pre = sub.add_parser("pretrain", help="supervised pretraining of the tiny model")
    pre.add_argument("--out", type=Path, required=True, help="where to write the model directory")
    pre.add_argument("--size", default="tiny", choices=["tiny", "small"])
    pre.add_argument("--steps", type=int, default=1500)
    pre.add_argument("--seed", type=int, default=0)

    exp = sub.add_parser("experiment", help="ES vs GRPO vs GRPO then ES at equal budgets, with a report")
    exp.add_argument("--preset", default="tiny", choices=["tiny", "quick"], help="quick: a smoke run")
    exp.add_argument("--out", type=Path, default=Path("runs/experiment"), help="the report directory")
    exp.add_argument("--model", default=None, help="a local HF model directory (default: the tiny model)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "demo":
            cmd_train(args, defaults={"out_dir": "runs/demo"})
        elif args.command == "train":
            cmd_train(args)
        elif args.command == "eval":
            cmd_eval(args)
        elif args.command == "experiment":
            cmd_experiment(args)
        else:
            cmd_pretrain(args)
    except ConfigError as error:
        print(f"fastes: configuration error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
