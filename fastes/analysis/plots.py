"""The figures of the ES-vs-GRPO analyses, each saved as a PNG.

Every function draws one figure with matplotlib's object API (matplotlib.figure.Figure, which renders
through the Agg backend and never opens a window or touches pyplot's global state), writes it to `path`
(creating the folder) and returns the path.

A line series (one curve) is either a mapping x -> y (drawn in order of x) or a pair (xs, ys) of
equal-length sequences (drawn in the given order). NaN values leave gaps.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from .sparsity import DeltaHistogram

Series = Mapping[float, float] | tuple[Sequence[float], Sequence[float]]

DPI = 120
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def _xy(series: Series, label: str) -> tuple[np.ndarray, np.ndarray]:
    """The x and y arrays of one series (see the module docstring for the two accepted forms)."""
    if isinstance(series, Mapping):
        xs = sorted(series)
        ys = [series[x] for x in xs]
    else:
        xs, ys = series
    x_array = np.asarray(xs, dtype=np.float64)
    y_array = np.asarray(ys, dtype=np.float64)
    if x_array.shape != y_array.shape or x_array.ndim != 1:
        raise ValueError(
            f"series {label!r}: x and y must be 1-D of equal length, got {x_array.shape} and {y_array.shape}"
        )
    return x_array, y_array


def _check_not_empty(collection: Mapping, what: str) -> None:
    if len(collection) == 0:
        raise ValueError(f"nothing to plot: {what} is empty")


def _figure(
    title: str, xlabel: str, ylabel: str, size: tuple[float, float] = (6.4, 4.4)
) -> tuple[Figure, Axes]:
    figure = Figure(figsize=size, layout="constrained")
    axes = figure.add_subplot()
    axes.set_title(title)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.grid(True, alpha=0.3)
    return figure, axes


def _save(figure: Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=DPI, format="png")
    return path


def _draw_lines(axes: Axes, runs: Mapping[str, Series], markers: bool = True) -> list[float]:
    """Draw each run as a labelled line and return all x values seen (sorted, unique)."""
    all_x: set[float] = set()
    for index, (label, series) in enumerate(runs.items()):
        xs, ys = _xy(series, label)
        marker = MARKERS[index % len(MARKERS)] if markers else None
        axes.plot(xs, ys, marker=marker, markersize=4, linewidth=1.6, label=label)
        all_x.update(float(x) for x in xs)
    axes.legend()
    return sorted(all_x)


def _log2_x_axis(axes: Axes, ticks: Sequence[float]) -> None:
    """Log-2 x axis with a labelled tick at every given x (no unlabelled minor ticks)."""
    axes.set_xscale("log", base=2)
    axes.set_xticks(list(ticks), labels=[f"{t:g}" for t in ticks])
    axes.minorticks_off()


def plot_pass_at_k(
    curves: Mapping[str, Series], path: str | Path, title: str = "Pass@K on the test split"
) -> Path:
    """Pass@K curves of several models on one axes: {model: {k: pass@k}} (e.g. from pass_at_k_curve)."""
    _check_not_empty(curves, "curves")
    figure, axes = _figure(title, "K (samples per problem)", "Pass@K")
    ks = _draw_lines(axes, curves)
    _log2_x_axis(axes, ks)
    axes.set_ylim(-0.02, 1.02)
    return _save(figure, path)


def plot_metric_over_steps(
    runs: Mapping[str, Series],
    path: str | Path,
    metric: str = "entropy (nats)",
    title: str | None = None,
    xlabel: str = "training step",
) -> Path:
    """One metric over training steps for several runs: {run: {step: value}} or {run: (steps, values)}."""
    _check_not_empty(runs, "runs")
    figure, axes = _figure(title or f"{metric} during training", xlabel, metric)
    _draw_lines(axes, runs, markers=False)
    return _save(figure, path)


def plot_js_diversity(
    runs: Mapping[str, Series],
    path: str | Path,
    normalized: bool = True,
    title: str = "Verifier-projected JS diversity of the population",
) -> Path:
    """JS diversity over ES iterations for several runs: {run: {iteration: JS}}.

    normalized=True: values are JS / ln 2 in [0, 1] and the y axis is fixed to that range; False: nats.
    """
    _check_not_empty(runs, "runs")
    ylabel = "JS diversity / ln 2" if normalized else "JS diversity (nats)"
    figure, axes = _figure(title, "ES iteration", ylabel)
    _draw_lines(axes, runs, markers=False)
    axes.set_ylim(-0.02, 1.02 if normalized else 1.02 * math.log(2.0))
    return _save(figure, path)


def plot_gain_retained(
    lines: Mapping[str, Series],
    path: str | Path,
    title: str = "Gain retained by masking the update",
) -> Path:
    """Gain retained vs kept fraction: {mask: {keep_fraction: gain}}, one line per mask kind/scope.

    Pass the controls (random mask, bottom-k mask) as their own lines. The x axis is logarithmic and
    labelled in percent; dashed lines mark no gain (0) and the full gain (1).
    """
    _check_not_empty(lines, "lines")
    figure, axes = _figure(title, "share of update elements kept", "gain retained")
    fractions = _draw_lines(axes, lines)
    axes.axhline(0.0, color="grey", linestyle="--", linewidth=1)
    axes.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    positive = [f for f in fractions if f > 0]
    if positive:
        axes.set_xscale("log")
        axes.set_xticks(positive, labels=[f"{100 * f:g}%" for f in positive])
        axes.minorticks_off()
    return _save(figure, path)


def plot_model_bars(
    results: Mapping[str, Mapping[str, float]],
    path: str | Path,
    ylabel: str = "held-out accuracy",
    title: str = "Held-out evaluation by model",
) -> Path:
    """Grouped bar chart: {model: {task or metric: value}}, models on the x axis, one bar per task.

    Use one call per kind of value (accuracy and perplexity have different scales). Bars are labelled
    with their values; a task missing for a model is left out.
    """
    _check_not_empty(results, "results")
    models = list(results)
    tasks: list[str] = []
    for scores in results.values():
        tasks.extend(task for task in scores if task not in tasks)
    if not tasks:
        raise ValueError("nothing to plot: no model has any value")
    figure_width = max(6.4, 1.0 + 0.6 * len(models) * len(tasks))  # room for every bar and its label
    figure, axes = _figure(title, "model", ylabel, size=(figure_width, 4.4))
    width = 0.8 / len(tasks)
    positions = np.arange(len(models))
    for index, task in enumerate(tasks):
        heights = [float(results[model].get(task, math.nan)) for model in models]
        bars = axes.bar(positions + (index - (len(tasks) - 1) / 2) * width, heights, width, label=task)
        labels = ["" if math.isnan(height) else f"{height:.3g}" for height in heights]
        axes.bar_label(bars, labels=labels, fontsize=8)
    axes.set_xticks(positions, labels=models)
    axes.margins(y=0.15)  # headroom for the value labels and the legend
    axes.legend()
    return _save(figure, path)


def plot_population_sweep(
    results: Mapping[str, Series],
    path: str | Path,
    ylabel: str = "test accuracy",
    title: str = "Effect of the ES population size",
) -> Path:
    """Metric vs population size N for several models: {model: {N: value}}, log-2 x axis."""
    _check_not_empty(results, "results")
    figure, axes = _figure(title, "population size N", ylabel)
    sizes = _draw_lines(axes, results)
    _log2_x_axis(axes, sizes)
    return _save(figure, path)


def plot_delta_histogram(
    histograms: Mapping[str, DeltaHistogram],
    path: str | Path,
    title: str = "Magnitude of the update",
) -> Path:
    """Share of elements per bin of log10|delta| for several models: {model: delta_log10_histogram(...)}.

    The legend gives each model's share of exactly unchanged elements, which have no bin.
    """
    _check_not_empty(histograms, "histograms")
    figure, axes = _figure(title, "log10 |theta_trained - theta_base|", "share of elements")
    for label, histogram in histograms.items():
        share = histogram.counts / max(histogram.n_elements, 1)
        zero_share = histogram.n_zero / max(histogram.n_elements, 1)
        axes.stairs(share, histogram.edges, label=f"{label} (unchanged: {zero_share:.1%})", linewidth=1.6)
    axes.legend()
    return _save(figure, path)
