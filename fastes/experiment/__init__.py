"""`fastes experiment`: ES, GRPO and GRPO then ES from one base model at equal sample budgets, compared.

It trains three arms from the same base model,

    base -> ES        base -> GRPO        base -> GRPO -> ES (half the budget each)

each allowed the same number of training completions (the sample budget, see budget.plan_budget), then
measures all four models (base included) the way the seed paper does ("Understanding ES for LLM
Reasoning: Broader Reasoning Coverage than GRPO", arXiv 2608.27351):

- Pass@K on the test prompts (n samples each at temperature 1);
- token entropy over training: the logged entropy of GRPO's training batches, and for every arm the
  entropy of the policy on its own samples of fixed probe prompts at each evaluation point;
- the verifier-projected JS diversity of the ES population (logged by every ES iteration);
- gain retained when only the top-k largest elements of the ES update are kept (random and bottom-k
  masks of the same density as controls);
- forgetting: held-out task accuracy, perplexity of a fixed held-out corpus, token KL to the base;
- the population-size sweep: ES at a fixed sample budget with N members, for two model sizes.

Everything goes into one directory: metrics.json, report.md (read that first) and the PNG plots.

    fastes experiment --preset tiny     # the built-in tiny model on 2 CPU cores
    fastes experiment --preset quick    # a smoke run of every stage, about a minute
    fastes experiment --preset smollm2  # SmolLM2-135M-Instruct (smollm2-quick: every stage, small budgets)
    fastes experiment --model DIR       # any local HF causal LM (the sweep then uses that model alone)
    fastes experiment --preset smollm2 --seed 1 --stages es,grpo,evaluate --out DIR/seed1   # 2nd seed
    fastes experiment --report-only --out DIR   # report.md again, with DIR's seed*/ folders (seeds.py)

Stopped with Ctrl-C or killed, the same command continues: finished arms and evaluations are recorded
in progress.json and not redone.

Read in this order: budget.py (presets, equal budgets, what each stage costs), arms.py (training the
arms and the sweep), evaluate.py (measurements, through fastes.run.evaluation, the one evaluation path),
findings.py (the paper's claims, checked), seeds.py (ES vs GRPO over seeds), plots.py and report.py
(the output), progress.py (what is finished), run.py (the whole run).
"""

from .arms import Context, make_context, train_arm, train_in_segments, train_overrides
from .budget import (
    ARMS,
    LABELS,
    MODELS,
    PRESETS,
    STAGES,
    BudgetPlan,
    Preset,
    Speed,
    estimate_seconds,
    plan_budget,
    segment_ends,
    sweep_iterations,
)
from .evaluate import MASK_KINDS, evaluate_models, gain_retained_curves
from .findings import findings, paired_difference, paired_standard_error
from .plots import PLOTS, write_plots
from .report import write_report
from .runner import rewrite_report, run_experiment
from .seeds import headline, other_seeds

__all__ = [
    "ARMS",
    "LABELS",
    "MASK_KINDS",
    "MODELS",
    "PLOTS",
    "PRESETS",
    "STAGES",
    "BudgetPlan",
    "Context",
    "Preset",
    "Speed",
    "estimate_seconds",
    "evaluate_models",
    "findings",
    "gain_retained_curves",
    "headline",
    "make_context",
    "other_seeds",
    "paired_difference",
    "paired_standard_error",
    "plan_budget",
    "rewrite_report",
    "run_experiment",
    "segment_ends",
    "sweep_iterations",
    "train_arm",
    "train_in_segments",
    "train_overrides",
    "write_plots",
    "write_report",
]
