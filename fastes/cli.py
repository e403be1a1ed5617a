"""The `fastes` command: demo, train, eval, pretrain, experiment.

fastes demo                       ES on the built-in tiny model and countdown, with a plot
fastes demo --model smollm2-135m-instruct   the same on a real instruct model, with settings chosen for it
fastes train --config run.toml    ES, GRPO or GRPO then ES; any key as a flag: --es.sigma 0.01
fastes eval --model DIR           accuracy and Pass@K of a model directory on a task
fastes eval --run DIR             the same for a finished run's final/, with the run's task and prompts
fastes eval --run DIR --checkpoint   the same for the run's newest checkpoint (an unfinished run's model)
fastes pretrain --out DIR         rebuild the tiny model by supervised training
fastes experiment --preset tiny   ES vs GRPO vs GRPO then ES at equal budgets: plots and report.md
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from . import distributed
from .distributed import CollectiveError
from .engine import cpu_share
from .errors import ConfigError, FastesError
from .run import pretrain
from .run.config import PROMPT_SETTINGS, TrainConfig, flag_help, flag_specs, load_config
from .version import __version__

DEMO_EVAL_SIZE = 500  # test problems the demo reports on
DEFAULT_EVAL_LIMIT = 200  # problems `fastes eval` takes unless told (or given a run)
FEW_ANSWERS = 0.5  # `fastes eval` warns when the model states a readable answer on fewer problems
# `fastes demo --model NAME`: settings chosen for a shipped model on validation problems only (the
# first 272 train / next 100 problems of the same task), see docs/real_models.md. Flags override them.
DEMO_PRESETS: dict[str, dict[str, Any]] = {
    "smollm2-135m-instruct": {
        "out_dir": "runs/demo-smollm2",
        # One- and two-digit addition and subtraction of 0..20: 672 problems; the last 300 are the test.
        "task": "arithmetic:max_operand=20,operations=+-,n_train=372,n_test=300",
        # Asked in two sentences, the base states its answer in the format on ~40% of problems (~90%
        # with the default one-sentence wording): what ES learns here is to follow the instruction.
        "instruction": 'Write the result after "Answer:".',
        "answer_prefix": "",  # the reply is the model's own: what ES learns here is the answer format
        "eval_size": 300,
        "batch_size": 16,
        "max_new_tokens": 24,
        "format_weight": 0.5,
        "eval_every": 10,
        "checkpoint_every": 5,
        "es.iterations": 20,
        "es.population": 16,
        "es.sigma": 0.001,
        "es.lr": 5e-6,
    },
}
# Run settings that `fastes eval` takes as flags, with the meaning they have in a run.
EVAL_SETTINGS = (
    "model",
    "task",
    "task_seed",
    "reward",
    "dataset",
    "eval_dataset",
    "reward_weights",
    "reward_timeout",
    *PROMPT_SETTINGS,
    "eval_batch_size",
)


class Parser(argparse.ArgumentParser):
    """argparse, with a usage error printed as one line like every other fastes error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"fastes: {message} (see `{self.prog} --help`)\n")


class Interrupted(Exception):
    """Ctrl-C during a run; the message says how to continue it."""


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not value > 0 or not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def _normalise_flags(argv: list[str]) -> list[str]:
    """--max-new-tokens and --max_new_tokens are the same flag: dashes inside a flag name become
    underscores (the config keys' spelling)."""
    out = []
    for token in argv:
        if token.startswith("--") and len(token) > 2:
            name, eq, value = token[2:].partition("=")
            token = "--" + name.replace("-", "_") + eq + value
        out.append(token)
    return out


def _parse_bool(text: str) -> bool:
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="a TOML file of settings (flags override it)")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in out_dir from its newest checkpoint, with its own settings",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace a previous run in out_dir (says what it deletes)"
    )
    for key, kind in flag_specs():
        parser.add_argument(
            f"--{key}",
            dest=f"cfg:{key}",
            type=_parse_bool if kind is bool else kind,
            nargs="+" if key == "reward" else None,  # --reward a.py:f b.py:g: several, for a dataset
            default=None,
            metavar=kind.__name__.upper(),
            help=flag_help(key),
        )


def _overrides(args: argparse.Namespace, defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    values = dict(defaults or {})
    for name, value in vars(args).items():
        if name.startswith("cfg:") and value is not None:
            values[name[4:]] = ",".join(value) if isinstance(value, list) else value
    return _dataset_replaces_task(values)


def _dataset_replaces_task(values: dict[str, Any]) -> dict[str, Any]:
    """Settings given on the command line: a data file (`dataset`) sets the task unless one is given."""
    if "dataset" in values:
        values.setdefault("task", "dataset")
    return values


def _curve_plot(metrics: list[dict], path: Path, task: str) -> Path:
    from .analysis.plots import plot_metric_over_steps

    steps = [m for m in metrics if "reward" in m]
    lines = {"train reward": ([m["global_step"] for m in steps], [m["reward"] for m in steps])}
    # Beside accuracy, the format rate and the lenient reading tell a gain in format from problems solved.
    for key, label in [
        ("test_accuracy", "test accuracy"),
        ("test_lenient_accuracy", "test lenient accuracy"),
        ("test_format", "test format rate"),
    ]:
        evals = [m for m in metrics if key in m]
        if evals:
            lines[label] = ([m["global_step"] for m in evals], [m[key] for m in evals])
    return plot_metric_over_steps(
        lines,
        path,
        title=f"fastes: post-training on {task}",
        metric="reward / rate",
        xlabel="iteration",
    )


def _resume_hint(command: str, out_dir: str) -> str:
    from .checkpoint import checkpoint_steps
    from .run.rundir import RUN_FILE

    if not (Path(out_dir) / RUN_FILE).is_file():
        return "interrupted before the run started; nothing was written"
    steps = checkpoint_steps(out_dir)
    saved = f"its newest checkpoint is step {steps[-1]}" if steps else "it has no checkpoint yet"
    return f"interrupted; {saved}. Continue with: fastes {command} --out_dir {shlex.quote(out_dir)} --resume"


def cmd_train(args: argparse.Namespace, defaults: dict[str, Any] | None = None) -> dict:
    from .run.rundir import saved_identity
    from .run.train import train

    overrides = _overrides(args, defaults)
    cfg = load_config(args.config, overrides)
    saved = saved_identity(cfg.out_dir) if args.resume else None
    if saved is not None:  # a resume continues with the run's own settings; only flags given now differ
        cfg = load_config(args.config, {**overrides, "out_dir": cfg.out_dir}, base=saved["config"])
    try:
        summary = train(cfg, resume=args.resume, overwrite=args.overwrite)
    except KeyboardInterrupt:
        raise Interrupted(_resume_hint(args.command, cfg.out_dir)) from None
    if not distributed.is_writer():  # under torchrun, rank 0 reports and plots
        return summary
    metrics = [json.loads(line) for line in (Path(cfg.out_dir) / "metrics.jsonl").read_text().splitlines()]
    summary["plot"] = str(_curve_plot(metrics, Path(cfg.out_dir) / "curve.png", cfg.task.partition(":")[0]))
    base, final = summary["base_test_accuracy"], summary["final_test_accuracy"]
    if base is None:
        print(f"\nno held-out rows, so no evaluation. trained model: {summary['model_dir']}")
        return summary
    gain, se, n = summary["test_gain"], summary["test_gain_se"], summary["test_problems"]
    if cfg.task == "dataset" or cfg.reward:  # the mean of your reward functions: any number, no percentage
        print(f"\nbase model mean test reward:    {base:.4g}")
        print(f"trained model mean test reward: {final:.4g}")
        print(f"gain: {gain:+.4g} (+- {se:.2g}, paired standard error on {n} test rows)")
        print(f"trained model: {summary['model_dir']}   metrics: {cfg.out_dir}/metrics.jsonl")
        return summary
    print(f"\nbase model test accuracy:    {base:.1%}")
    print(f"trained model test accuracy: {final:.1%}")
    if summary["base_test_format"] is not None:
        print(
            f"answers in the verifiable format: {summary['base_test_format']:.1%} -> "
            f"{summary['final_test_format']:.1%}"
        )
    if summary["base_test_lenient_accuracy"] is not None:  # instruct forms: is the gain format or solving?
        print(
            f"accuracy, answers read leniently (last number): {summary['base_test_lenient_accuracy']:.1%} "
            f"-> {summary['final_test_lenient_accuracy']:.1%}"
        )
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
    from .checkpoint import load_checkpoint, tensors_under
    from .models.loading import is_character_tokenizer, load_model
    from .models.sources import resolve_model
    from .run import auto_settings
    from .run.evaluation import Evaluator, pass_at_k
    from .run.train import check_task
    from .tasks.setup import make_task

    # The run's own settings, checked and chosen as a run would: the same prompts, task and verifier.
    given = _dataset_replaces_task({key: getattr(args, key) for key in EVAL_SETTINGS if hasattr(args, key)})
    limit = args.limit
    step = None  # the step of the run's checkpoint to evaluate
    if args.checkpoint is not None:
        if args.run is None or "model" in given:
            raise ConfigError(
                "--checkpoint evaluates a checkpoint of the run given by --run DIR, on the model that run "
                "started from: give --run, and no --model"
            )
        step = checkpoint_step(args.run, args.checkpoint)
    if args.run is not None:  # a run's model and settings; flags given here still win
        trained_model = "model" not in given and step is None
        settings, eval_size = run_eval_settings(args.run, trained_model=trained_model)
        given = {**settings, **given}
        if given["task"] == "dataset" and not given["dataset"]:
            raise ConfigError(
                f"--run {args.run!r}: the run's rows were given in code (fastes.ESTrainer), not as a file, "
                "so fastes eval cannot read them: evaluate with the trainer's evaluate(), or give the rows "
                "as --dataset FILE beside --run"
            )
        limit = limit or eval_size
    limit = limit or DEFAULT_EVAL_LIMIT
    if args.split == "test":  # a run with eval_size = limit evaluates the same problems
        given["eval_size"] = limit
    cfg = load_config(None, given)
    model, tokenizer = load_model(resolve_model(cfg.model), dtype=args.dtype)
    if step is not None:  # read (and verified) once every setting has been checked
        _, tensors, _ = load_checkpoint(Path(args.run) / "checkpoints" / f"step-{step:08d}")
        load_run_weights(model, step, tensors_under(tensors, "model."), args.run, args.dtype is not None)
    cfg = auto_settings.resolve(cfg, model, tokenizer)
    task = make_task(cfg, strict_alphabet=is_character_tokenizer(tokenizer))
    check_task(task, cfg)
    examples = task.split(args.split)[:limit]
    evaluator = Evaluator(cfg, model, tokenizer)
    greedy = evaluator.greedy(task, examples)
    rates = greedy.metrics()
    result: dict[str, Any] = {} if step is None else {"checkpoint_step": step}
    result |= {
        "task": cfg.task,
        "prompt_style": cfg.prompt_style,
        "examples": len(examples),
        "greedy_accuracy": rates["accuracy"],
        "format_rate": rates["format"],
        "mean_completion_tokens": sum(greedy.lengths) / len(examples),
        "max_new_tokens": cfg.max_new_tokens,
    }
    if "lenient_accuracy" in rates:
        result["lenient_accuracy"] = rates["lenient_accuracy"]
    shown = zip(examples, evaluator.prompts(examples[: args.show]), greedy.texts, greedy.scores)
    for example, prompt, text, score in shown:
        verdict = f"format {score.format:g}, answer {score.answer:g}"
        print(f"--- prompt:\n{prompt}\n--- completion:\n{text}\n--- expected {example.answer!r}: {verdict}\n")
    if rates["format"] < FEW_ANSWERS:
        print(few_answers_hint(rates["format"], cfg), file=sys.stderr)
    if args.samples > 1:
        counts = evaluator.correct_counts(
            task, examples, samples=args.samples, temperature=args.temperature, seed=args.seed
        )
        result["pass_at_k"] = pass_at_k(counts, args.samples)
    print(json.dumps(result, indent=2))
    return result


def run_eval_settings(run_dir: str, trained_model: bool = True) -> tuple[dict[str, Any], int]:
    """`fastes eval --run DIR`: the settings that the run in DIR evaluated with (its task, prompts,
    reward and batch size) and its number of test problems; with `trained_model`, its model DIR/final
    in place of the model it started from."""
    from .run.config import config_from_dict
    from .run.rundir import saved_identity

    identity = saved_identity(run_dir, "evaluate its final/ with --model and the run's settings as flags")
    if identity is None:
        raise ConfigError(
            f"--run {run_dir!r} holds no fastes run (no run.json): give a run's out_dir, or --model with "
            "the run's settings as flags"
        )
    config = config_from_dict(identity["config"])  # a key the run did not write has its default
    settings = {key: getattr(config, key) for key in EVAL_SETTINGS}
    if "working_directory" in identity:  # older runs recorded none: their paths are taken as they are
        settings.update(_read_from(Path(identity["working_directory"]), settings))
    final = Path(run_dir) / "final"
    if trained_model:
        if not (final / "config.json").is_file():
            raise ConfigError(
                f"--run {run_dir!r} has no trained model in final/ yet (the run has not finished): "
                "evaluate its newest checkpoint with --checkpoint, finish it with "
                f"`fastes train --out_dir {shlex.quote(run_dir)} --resume`, or name a model with --model"
            )
        settings["model"] = str(final)
    return settings, config.eval_size


def checkpoint_step(run_dir: str, which: str) -> int:
    """`fastes eval --run DIR --checkpoint [STEP]`: the step of the run's newest checkpoint ("latest"),
    or STEP where the run keeps it."""
    from .checkpoint import checkpoint_steps

    steps = checkpoint_steps(run_dir)
    if not steps:
        raise ConfigError(f"--checkpoint: --run {run_dir!r} has no checkpoint yet (none written, or no run)")
    if which == "latest":
        return steps[-1]
    if which.isascii() and which.isdigit() and int(which) in steps:
        return int(which)
    kept = ", ".join(map(str, steps))
    raise ConfigError(
        f"--checkpoint {which!r}: --run {run_dir!r} keeps the checkpoints of steps {kept} (a run keeps "
        "its newest two); give one of them, or --checkpoint alone for the newest"
    )


def load_run_weights(
    model: Any, step: int, weights: dict[str, Any], run_dir: str, keep_dtype: bool = False
) -> None:
    """Put a checkpoint's weights into the model the run started from, in the dtype
    the run trained them in (as its final/ is saved) unless `keep_dtype` (--dtype given); a checkpoint
    of an adapter's tensors (a run given a peft_config in code) is refused in one line."""
    missing = set(model.state_dict()) - set(weights)
    if missing:
        raise ConfigError(
            f"--checkpoint {step}: the checkpoint in --run {run_dir!r} holds {len(weights)} tensors, not the "
            f"whole model ({len(missing)} missing, e.g. {sorted(missing)[0]!r}): a run that trained an "
            "adapter; evaluate it with the trainer's evaluate()"
        )
    trained = {w.dtype for w in weights.values() if w.is_floating_point()}
    if not keep_dtype and len(trained) == 1:
        model.to(trained.pop())
    model.load_state_dict(weights)


def _read_from(directory: Path, settings: dict[str, Any]) -> dict[str, str]:
    """A run's settings that name files (a jsonl task, data files, reward files or reward models'
    directories), their relative paths taken under `directory`, where the run read them."""
    from .tasks.setup import reward_specs

    def under(path: str) -> str:
        return path if Path(path).is_absolute() else str(directory / path)

    def reward_under(entry: str) -> str:  # FILE.py:FUNCTION, or a reward model's directory
        file, _, function = entry.rpartition(":")
        return f"{under(file)}:{function}" if file.endswith(".py") else under(entry)

    task = settings["task"]
    kind, _, data = task.partition(":")
    return {
        "task": f"jsonl:{under(data)}" if kind == "jsonl" and data else task,
        "reward": ",".join(reward_under(entry) for entry in reward_specs(settings["reward"])),
        **{key: under(settings[key]) for key in ("dataset", "eval_dataset") if settings[key]},
    }


def few_answers_hint(format_rate: float, cfg: TrainConfig) -> str:
    """One line for an evaluation in which the model rarely states an answer the verifier can read: its
    accuracy then measures the answer format more than the task, and training would first learn that."""
    line = (
        f"fastes eval: the model stated an answer in the task's format on only {format_rate:.0%} of the "
        "problems, so accuracy here mostly measures the format; "
    )
    if cfg.prompt_style == "plain":
        return line + "for an instruct model try --prompt_style instruct"
    from .tasks import available_tasks

    if cfg.task.partition(":")[0] not in available_tasks():
        return line + "ask for the answer's format in the prompts, or score answers more leniently"
    if cfg.answer_prefix == "":
        return line + "try --answer_prefix auto (the reply starts with the task's own opening words)"
    return line + (
        "try --answer_prefix 'Answer:' (the reply starts with it), another --instruction, or --show 5 "
        "to read the completions"
    )


def cmd_experiment(args: argparse.Namespace) -> dict:
    from .experiment import rewrite_report, run_experiment

    if args.report_only:
        given = [flag for flag in ("model", "seed", "stages") if getattr(args, flag) is not None]
        if given or args.overwrite:
            flag = (given or ["overwrite"])[0]
            raise ConfigError(f"--report-only trains nothing and reads --out only; leave out --{flag}")
        print(f"report: {rewrite_report(args.out)}")
        return {}

    if distributed.launched_world_size() > 1:
        raise ConfigError(
            "fastes experiment runs in one process (its arms and analyses are not split over processes); "
            "start it without torchrun"
        )
    try:
        metrics = run_experiment(
            args.preset,
            args.out,
            model=args.model,
            overwrite=args.overwrite,
            seed=args.seed,
            stages=args.stages,
        )
    except KeyboardInterrupt:
        raise Interrupted(
            f"interrupted; what was finished is kept in {args.out / 'progress.json'}. Run the same command "
            "again to continue"
        ) from None
    if metrics["missing_stages"]:
        missing = ", ".join(metrics["missing_stages"])
        print(f"\nmetrics: {args.out / 'metrics.json'} (stages not finished yet: {missing})")
        for name, model in metrics["models"].items():
            passes, top = model["pass_at_k"], str(metrics["preset"]["passk_samples"])
            print(
                f"- {name}: greedy accuracy {model['greedy_accuracy']:.3f}, format {model['format_rate']:.3f}"
                f", Pass@1 {passes['1']:.3f}, Pass@{top} {passes[top]:.3f}"
            )
        return metrics
    print(f"\nreport: {args.out / 'report.md'}   metrics: {args.out / 'metrics.json'}")
    for finding in metrics["findings"]:
        print(f"- {finding['claim']}: {finding['verdict']}")
    return metrics


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="fastes",
        description=__doc__ + "\nFlags may be spelled with dashes or underscores (--max-new-tokens).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"fastes {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="ES on the built-in tiny model and countdown (the main job)")
    _add_config_flags(demo)

    train = sub.add_parser("train", help="post-train a model with ES, GRPO or GRPO then ES")
    _add_config_flags(train)

    ev = sub.add_parser(
        "eval",
        help="greedy accuracy and Pass@K of a model directory on a task",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for key in EVAL_SETTINGS:  # the run's own flags, with the run's defaults and help
        kind = type(getattr(TrainConfig(), key))
        # SUPPRESS: absent unless given (the run's default applies), and flag_help already names it
        ev.add_argument(
            f"--{key}",
            type=kind,
            default=argparse.SUPPRESS,
            metavar=kind.__name__.upper(),
            help=flag_help(key),
        )
    ev.add_argument("--split", default="test", choices=["train", "test"], help="which problems")
    ev.add_argument(
        "--run",
        default=None,
        metavar="DIR",
        help="a finished run's out_dir: its final/ model, evaluated with the run's task, prompts and "
        "reward on its eval_size test problems (flags given here override them)",
    )
    ev.add_argument(
        "--checkpoint",
        nargs="?",
        const="latest",
        default=None,
        metavar="STEP",
        help="with --run: evaluate the run's newest checkpoint (or checkpoint STEP) in place of its final/, "
        "e.g. a run that has not finished",
    )
    ev.add_argument(
        "--limit",
        type=_positive(int),
        default=None,
        help=f"number of problems (None: {DEFAULT_EVAL_LIMIT}, or the run's eval_size with --run)",
    )
    ev.add_argument(
        "--samples", type=_positive(int), default=16, help="samples per problem for Pass@K (1: greedy only)"
    )
    ev.add_argument("--temperature", type=_positive(float), default=1.0, help="sampling temperature")
    ev.add_argument("--show", type=int, default=0, help="print this many prompt / completion / score triples")
    ev.add_argument("--dtype", default=None, help="float32, bfloat16 or float16; None: the model's own")
    ev.add_argument("--seed", type=int, default=0, help="sampling seed")

    pretrain.add_arguments(sub.add_parser("pretrain", help="supervised pretraining of the tiny model"))

    exp = sub.add_parser("experiment", help="ES vs GRPO vs GRPO then ES at equal budgets, with a report")
    exp.add_argument(
        "--preset",
        default="tiny",
        choices=["tiny", "quick", "smollm2", "smollm2-quick"],
        help="quick: a smoke run; smollm2: SmolLM2-135M-Instruct (bash scripts/setup.sh real)",
    )
    exp.add_argument("--out", type=Path, default=Path("runs/experiment"), help="the report directory")
    exp.add_argument(
        "--model",
        default=None,
        help="a local HF model directory (default: the preset's model, else the tiny one)",
    )
    exp.add_argument(
        "--overwrite", action="store_true", help="replace what is already in --out (says what it deletes)"
    )
    exp.add_argument(
        "--seed", type=int, default=None, help="training seed of every arm (default: the preset's, 0)"
    )
    exp.add_argument(
        "--stages",
        default=None,
        help="run only these stages, comma-separated: es, grpo, grpo_es, evaluate, sparsity, sweep "
        "(default: all; the report is written once every stage is done)",
    )
    exp.add_argument(
        "--report_only",
        action="store_true",
        help="write --out's report.md again from its metrics.json, taking in the seed*/ folders inside it "
        "(a second seed run with --out <report dir>/seed1); trains nothing",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(_normalise_flags(sys.argv[1:] if argv is None else argv))
    if argv is None:  # a fastes process (not a test calling main): share the cores with the others
        cpu_share.register()
    try:
        if args.command == "demo":
            # The demo's own directory holds only its previous run, so running it again replaces that
            # run (overwrite removes only files a run writes); an explicit --out_dir keeps the rule.
            if getattr(args, "cfg:out_dir") is None and args.config is None and not args.resume:
                args.overwrite = True
            # 500 test problems: a paired standard error of ~1.5 points instead of ~2.4 with 200.
            preset = DEMO_PRESETS.get(getattr(args, "cfg:model") or "", {})
            cmd_train(args, defaults={"out_dir": "runs/demo", "eval_size": DEMO_EVAL_SIZE, **preset})
        elif args.command == "train":
            cmd_train(args)
        elif args.command == "eval":
            cmd_eval(args)
        elif args.command == "experiment":
            cmd_experiment(args)
        else:
            pretrain.run_from_args(args)
    except ConfigError as error:
        print(f"fastes: configuration error: {error}", file=sys.stderr)
        return 2
    except FastesError as error:
        print(f"fastes: {error}", file=sys.stderr)
        return 2
    except (Interrupted, KeyboardInterrupt) as interrupt:
        print(f"\nfastes: {str(interrupt) or 'interrupted'}", file=sys.stderr)
        return 130
    except CollectiveError as error:
        # The process group is broken and torch would wait for the lost peer at shutdown: leave now.
        print(f"fastes: {error}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
