"""More seeds of the headline comparison: ES vs GRPO at greedy Pass@1 and at Pass@n, seed by seed and
over seeds.

A second seed trains the headline arms only, into a folder named seed<N> inside the report's directory:

    fastes experiment --preset smollm2 --seed 1 --stages es,grpo,evaluate --out <report dir>/seed1

The report of the whole experiment then reads every seed*/metrics.json beside it (`other_seeds`),
checked to be the same experiment with another seed; `fastes experiment --report-only --out <report
dir>` writes report.md again without training anything.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from fastes.analysis.passk import pass_at_k
from fastes.errors import ConfigError

from .findings import paired_standard_error

HEADLINE_MODELS = ("base", "es", "grpo")


def other_seeds(out_dir: Path, metrics: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{folder name: metrics} of every seed*/ folder in `out_dir`: the same preset and model with another
    seed and the headline models evaluated. Anything else there is refused in one line, before any
    writing."""
    found, seeds = {}, {metrics["preset"]["seed"]}
    for path in sorted(out_dir.glob("seed*/metrics.json")):
        try:
            other = json.loads(path.read_text())
            preset = other["preset"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise ConfigError(
                f"{path}: not a readable experiment metrics.json ({error}); rerun that seed"
            ) from None
        described = ("seed", "tuning")  # the tuning note describes the settings, it is not one
        differ = sorted(
            k for k in metrics["preset"] if k not in described and preset.get(k) != metrics["preset"][k]
        )
        if other.get("model") != metrics["model"]:
            differ.append("model")
        if differ:
            raise ConfigError(
                f"{path}: not this experiment with another seed ({', '.join(differ)} differ); move that "
                f"folder out of {out_dir}"
            )
        if preset["seed"] in seeds:
            raise ConfigError(
                f"{path}: seed {preset['seed']} is already in the report; remove one of the two"
            )
        missing = [m for m in HEADLINE_MODELS if m not in other.get("models", {})]
        if missing:
            raise ConfigError(
                f"{path}: models {', '.join(missing)} are not evaluated yet; finish that seed with "
                "--stages es,grpo,evaluate"
            )
        seeds.add(preset["seed"])
        found[path.parent.name] = other
    return found


def _difference(a: list[float], b: list[float]) -> tuple[float, float]:
    """Mean per-prompt difference a - b and its paired standard error."""
    return float(np.mean(np.asarray(a, np.float64) - np.asarray(b, np.float64))), paired_standard_error(a, b)


def measures(run: dict[str, Any]) -> dict[str, dict[str, list[float]]]:
    """The headline measures of one run, per model and per problem: greedy accuracy (Pass@1 at
    temperature 0), and Pass@1 and Pass@n sampled at temperature 1 (unbiased, from n samples)."""
    models, n = run["models"], run["preset"]["passk_samples"]

    def sampled(k: int) -> dict[str, list[float]]:
        return {m: list(pass_at_k(n, models[m]["correct_counts"], k)) for m in HEADLINE_MODELS}

    return {
        "greedy": {m: [float(c) for c in models[m]["greedy_correct"]] for m in HEADLINE_MODELS},
        "Pass@1": sampled(1),
        f"Pass@{n}": sampled(n),
    }


def headline(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """ES vs GRPO in every run (one per seed), for each of `measures`: the base's, ES's and GRPO's mean
    and the ES - GRPO difference with its paired standard error; then the mean difference over seeds,
    whose standard error is sqrt(sum of the seeds' squared SEs) / seeds (the seeds' training is
    independent; the test problems are the same)."""
    rows = []
    for run in sorted(runs, key=lambda r: r["preset"]["seed"]):
        per_measure = {}
        for name, per_model in measures(run).items():
            per_measure[name] = {m: float(np.mean(per_model[m])) for m in HEADLINE_MODELS}
            per_measure[name]["es_minus_grpo"] = _difference(per_model["es"], per_model["grpo"])
        rows.append({"seed": run["preset"]["seed"], "measures": per_measure})
    mean = {}
    for name in rows[0]["measures"]:
        diffs, ses = zip(*(row["measures"][name]["es_minus_grpo"] for row in rows))
        mean[name] = (float(np.mean(diffs)), math.sqrt(sum(se**2 for se in ses)) / len(ses))
    return {"seeds": rows, "mean": mean}


def verdict(difference: tuple[float, float]) -> str:
    """Which model is ahead: only when the mean difference exceeds two standard errors."""
    value, se = difference
    if abs(value) <= 2 * se:
        return "within noise"
    return "ES ahead" if value > 0 else "GRPO ahead"
