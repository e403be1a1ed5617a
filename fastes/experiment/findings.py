"""The seed paper's findings, each checked against the measurements with a paired test.

Every check returns {"claim", "measured", "verdict"}; a verdict is "yes", "no", "within noise" (the
difference it needs is under two paired standard errors, see paired_difference), "partly ..." or
"not tested".
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from fastes.analysis.passk import pass_at_k

from .budget import MODELS

Finding = dict[str, str]


def standard_error(p: float, n: int) -> float:
    """Standard error of an accuracy p measured on n independent problems."""
    return math.sqrt(max(p * (1 - p), 0.0) / n)


def paired_standard_error(a: list[float], b: list[float]) -> float:
    """Standard error of mean(a - b) for per-problem scores of two models on the same problems."""
    diff = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    return float(diff.std(ddof=1) / math.sqrt(len(diff))) if len(diff) > 1 else math.inf


def paired_difference(a: list[float], b: list[float]) -> int:
    """+1 when a is clearly above b, -1 clearly below, 0 within noise, for per-problem scores of two
    models on the same problems: the mean difference must exceed two standard errors of the mean of the
    per-problem differences (a paired test, much tighter than comparing two independent accuracies)."""
    diff = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    if len(diff) == 0 or diff.mean() == 0:
        return 0
    if abs(diff.mean()) <= 2 * paired_standard_error(a, b):
        return 0
    return 1 if diff.mean() > 0 else -1


def verdict(sign: int) -> str:
    return {1: "yes", 0: "within noise", -1: "no"}[sign]


def _finding(claim: str, measured: str, verdict: str) -> Finding:
    return {"claim": claim, "measured": measured, "verdict": verdict}


class _Passes:
    """Pass@1 / Pass@n of every model and paired Pass@k comparisons between two of them."""

    def __init__(self, metrics: dict[str, Any]) -> None:
        self.models = metrics["models"]
        self.n = metrics["preset"]["passk_samples"]
        self.top = str(self.n)
        self.one = {name: self.models[name]["pass_at_k"]["1"] for name in MODELS}
        self.all = {name: self.models[name]["pass_at_k"][self.top] for name in MODELS}

    def diff(self, a: str, b: str, k: int) -> int:
        per_prompt = [np.asarray(pass_at_k(self.n, self.models[m]["correct_counts"], k)) for m in (a, b)]
        return paired_difference(*per_prompt)


def es_raises_pass1(metrics: dict[str, Any], passes: _Passes) -> Finding:
    greedy = {m: metrics["models"][m]["greedy_accuracy"] for m in ("base", "es")}
    return _finding(
        "ES raises Pass@1",
        f"Pass@1 (T=1) base {passes.one['base']:.3f} -> ES {passes.one['es']:.3f}; greedy accuracy "
        f"{greedy['base']:.3f} -> {greedy['es']:.3f}",
        verdict(passes.diff("es", "base", 1)),
    )


def es_keeps_pass_k(metrics: dict[str, Any], passes: _Passes) -> Finding:
    top, one, every = passes.top, passes.one, passes.all
    return _finding(
        f"ES keeps a higher Pass@K than GRPO (K={top})",
        f"Pass@{top}: ES {every['es']:.3f}, GRPO {every['grpo']:.3f} (base {every['base']:.3f}); "
        f"Pass@1: ES {one['es']:.3f}, GRPO {one['grpo']:.3f}",
        verdict(passes.diff("es", "grpo", passes.n)),
    )


def grpo_narrows(metrics: dict[str, Any], passes: _Passes) -> Finding:
    top, one, every = passes.top, passes.one, passes.all
    raises = passes.diff("grpo", "base", 1) > 0
    return _finding(
        f"GRPO raises Pass@1 but narrows coverage: its Pass@{top} falls below the base's",
        f"GRPO Pass@1 {one['base']:.3f} -> {one['grpo']:.3f}, Pass@{top} {every['base']:.3f} -> "
        f"{every['grpo']:.3f}",
        verdict(-passes.diff("grpo", "base", passes.n)) if raises else "no (GRPO did not raise Pass@1)",
    )


def entropy_collapse(metrics: dict[str, Any], passes: _Passes) -> Finding:
    curves = metrics["training"]

    def entropy(arm: str, index: int) -> float:
        return curves[arm]["probe_entropy"][index][1]

    grpo_change = entropy("grpo", -1) / entropy("grpo", 0) - 1
    es_change = entropy("es", -1) / entropy("es", 0) - 1
    if grpo_change <= -0.25 and grpo_change < es_change - 0.10:
        result = "yes"
    elif grpo_change < es_change:
        result = "partly (GRPO's entropy fell more than ES's, but by less than a quarter)"
    else:
        result = "no"
    return _finding(
        "GRPO's entropy collapses, ES's does not",
        f"entropy on own samples: GRPO {entropy('grpo', 0):.3f} -> {entropy('grpo', -1):.3f} nats "
        f"({grpo_change:+.0%}), ES {entropy('es', 0):.3f} -> {entropy('es', -1):.3f} ({es_change:+.0%})",
        result,
    )


def population_diverse(metrics: dict[str, Any], passes: _Passes) -> Finding:
    curves = metrics["training"]["es"]
    js = [value for _, value in curves["js_diversity"]]
    agree = [value for _, value in curves["members_agree"]]
    return _finding(
        "The ES population is diverse in what it solves (verifier-projected JS diversity > 0)",
        f"mean JS / ln 2 over ES iterations {np.mean(js):.3f} (first {js[0]:.3f}, last {js[-1]:.3f}); "
        f"members agree on {np.mean(agree):.0%} of prompts",
        "yes" if np.mean(js) > 0 else "no",
    )


def grpo_then_es(metrics: dict[str, Any], passes: _Passes) -> Finding:
    top, one, every = passes.top, passes.one, passes.all
    keeps_pass1 = passes.diff("grpo_es", "grpo", 1) >= 0 and passes.diff("grpo_es", "base", 1) > 0
    return _finding(
        "GRPO then ES combines both: GRPO's Pass@1 gain, and a higher Pass@K than GRPO",
        f"Pass@1: GRPO->ES {one['grpo_es']:.3f}, GRPO {one['grpo']:.3f}, base {one['base']:.3f}; "
        f"Pass@{top}: GRPO->ES {every['grpo_es']:.3f}, GRPO {every['grpo']:.3f}, ES {every['es']:.3f}",
        verdict(passes.diff("grpo_es", "grpo", passes.n)) if keeps_pass1 else "no (Pass@1 gain not kept)",
    )


def sparse_updates(metrics: dict[str, Any], passes: _Passes) -> Finding:
    """Keeping the top-k |delta| of the ES update must keep most of ES's (clear) gain, more than a random
    mask of the same density does."""
    claim = "ES's gain comes from a sparse subset of large updates"
    models, gain = metrics["models"], metrics["gain_retained"]
    drift = f"total drift ||delta||/||theta|| = {models['es']['relative_update_norm']:.2e}"
    if paired_difference(models["es"]["greedy_correct"], models["base"]["greedy_correct"]) <= 0:
        return _finding(
            claim,
            f"ES greedy accuracy {gain['accuracy_base']:.3f} -> {gain['accuracy_trained']:.3f}: no clear "
            f"gain to attribute, so gain retained is undefined or noise; {drift}",
            "not tested",
        )
    ratios = gain["gain_retained"]
    small = [f for f in ratios["top"] if float(f) <= 0.1]
    if not small:
        return _finding(claim, "no kept fraction at or below 10% was evaluated", "not tested")
    best = max(small, key=lambda f: ratios["top"][f])
    top, random = ratios["top"][best], ratios["random"][best]
    return _finding(
        claim,
        f"keeping the top {float(best):.1%} of |delta| retains {top:.0%} of the gain (random mask "
        f"{random:.0%}, bottom-k {ratios['bottom'][best]:.0%}); {drift}",
        "yes" if top >= 0.5 and top > random else "no",
    )


def no_forgetting(metrics: dict[str, Any], passes: _Passes) -> Finding:
    models = metrics["models"]
    tasks = list(models["base"]["heldout_accuracy"])

    def drop(name: str) -> float:
        accuracy = models[name]["heldout_accuracy"]
        return float(np.mean([models["base"]["heldout_accuracy"][t] - accuracy[t] for t in tasks]))

    forgets = [
        paired_difference(models["es"]["heldout_correct"][t], models["base"]["heldout_correct"][t]) < 0
        for t in tasks
    ]
    result = "no" if any(forgets) else "yes"
    if any(forgets) and drop("grpo") > drop("es"):
        result += " (but ES forgot less than GRPO)"
    described = "; ".join(
        f"{t}: base {models['base']['heldout_accuracy'][t]:.3f}, "
        f"ES {models['es']['heldout_accuracy'][t]:.3f}, GRPO {models['grpo']['heldout_accuracy'][t]:.3f}"
        for t in tasks
    )
    perplexity = {m: models[m]["heldout_perplexity"] for m in ("base", "es", "grpo")}
    return _finding(
        "ES shows no necessary forgetting on held-out tasks",
        f"{described}; held-out perplexity base {perplexity['base']:.3f}, ES {perplexity['es']:.3f}, "
        f"GRPO {perplexity['grpo']:.3f}",
        result,
    )


def population_size(metrics: dict[str, Any], passes: _Passes) -> Finding:
    """The best population size of the larger model must be smaller, and each size's best N must beat
    its runner-up on the same prompts (else the optimum is not known)."""
    claim = "Larger models need smaller populations"
    sweep = metrics["population_sweep"]
    if len(sweep) < 2:
        return _finding(claim, "only one model size in the sweep", "not tested")
    by_size = sorted(sweep.items(), key=lambda item: item[1]["params"])
    best_n, clear = {}, True
    for size, info in by_size:
        runs = {int(k): r for k, r in info["runs"].items()}
        ranked = sorted(runs, key=lambda k: -runs[k]["test_accuracy"])
        best_n[size] = ranked[0]
        first, second = (runs[ranked[i]]["greedy_correct"] for i in (0, 1))
        clear = clear and paired_difference(first, second) > 0
    if not clear:
        result = "within noise (some size's best N is not clearly better than its runner-up)"
    else:
        result = "yes" if best_n[by_size[-1][0]] < best_n[by_size[0][0]] else "no"
    measured = "test accuracy at equal budget: " + "; ".join(
        f"{size} ({info['params']:,} params, base {info['base_accuracy']:.3f}) "
        + ", ".join(f"N={n} {r['test_accuracy']:.3f}" for n, r in info["runs"].items())
        for size, info in by_size
    )
    return _finding(claim, measured, result)


CHECKS: list[Callable[[dict[str, Any], _Passes], Finding]] = [
    es_raises_pass1,
    es_keeps_pass_k,
    grpo_narrows,
    entropy_collapse,
    population_diverse,
    grpo_then_es,
    sparse_updates,
    no_forgetting,
    population_size,
]


def findings(metrics: dict[str, Any]) -> list[Finding]:
    """Every finding of the seed paper, with what this run measured and a verdict."""
    passes = _Passes(metrics)
    return [check(metrics, passes) for check in CHECKS]
