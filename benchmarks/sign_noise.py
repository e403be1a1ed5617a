"""Gaussian vs Rademacher (sign) noise, side by side: CPU cost of perturb and update, and ES quality.

    python -m benchmarks.sign_noise                 # throughput + toy + regression (+ countdown if run)
    python -m benchmarks.sign_noise --countdown     # also trains the countdown runs (minutes each)
    python -m benchmarks.sign_noise --quick         # seconds: the test suite checks the outputs

Both noises have mean 0 and variance 1, so the same sigma and lr give perturbations and steps of the same
size: every comparison uses identical settings and seeds, and changes `noise` only. Writes
benchmarks/results/sign-noise-<device>-<date>.{json,md,png}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

import fastes
from benchmarks.common import cpu_model, dated_stem, load_average, measure
from fastes.engine import noise, ops
from fastes.models.loading import load_model, tiny_model_path

NOISES = noise.NOISES
RESULTS = Path(__file__).resolve().parent / "results"
REPO_ROOT = Path(__file__).resolve().parents[1]
COUNTDOWN_ITERATIONS = 25  # ES iterations per countdown run (population 32 x 64 prompts: the defaults)


# ---------------------------------------------------------------------------------------------------
# Throughput: perturb and the fused update, one layout, both noises timed interleaved in one run
# ---------------------------------------------------------------------------------------------------


def layouts(quick: bool) -> dict[str, list[int]]:
    """Element counts of the evolved tensors: the tiny model's linear weights and a 4M-element set."""
    if quick:
        return {"small": [64 * 64, 7, 1000]}
    tiny = [p.numel() for _, p in fastes.linear_weights(load_model(tiny_model_path())[0])]
    return {"tiny model (135K)": tiny, "4 x 1024^2 (4.2M)": [1024 * 1024] * 4}


# The CPU backends: the compiled one (fastes/engine/cpu_library.py) where it exists, and the eager reference.
BACKENDS = [b for b in ("cpu", "torch") if b in ops.BACKENDS]


def perturb_call(params: list, work: list, ids: list, kind: str, backend: str) -> Callable[[], None]:
    return lambda: ops.perturb(params, work, ids, (1, 2), 1e-3, noise_kind=kind, backend=backend)


def update_call(params: list, ids: list, population: int, kind: str, backend: str) -> Callable[[], None]:
    """The fused update of N = population antithetic members (N / 2 directions)."""
    keys = [(3, j) for j in range(population // 2)]
    weights = [1.0] * len(keys)
    return lambda: ops.es_update(params, ids, keys, weights, coef=1e-6, noise_kind=kind, backend=backend)


def throughput(quick: bool) -> list[dict]:
    records = []
    rounds = 1 if quick else 5
    for name, sizes in layouts(quick).items():
        params = [torch.randn(n) for n in sizes]
        ids = [noise.tensor_id(f"t{i}") for i in range(len(sizes))]
        work = [torch.empty_like(p) for p in params]
        numel = sum(sizes)
        calls: dict[str, Callable[[], object]] = {}
        for backend in BACKENDS:
            for kind in NOISES:
                calls[f"{backend}/perturb/{kind}"] = perturb_call(params, work, ids, kind, backend)
                for population in (2,) if quick else (8, 30):
                    calls[f"{backend}/update N={population}/{kind}"] = update_call(
                        work, ids, population, kind, backend
                    )
        timings = measure(calls, torch.device("cpu"), rounds=rounds, min_sample_s=0.02 if quick else 0.2)
        for op in sorted({c.rsplit("/", 1)[0] for c in calls}):
            gauss, sign = timings[f"{op}/gaussian"].median, timings[f"{op}/rademacher"].median
            backend, op_name = op.split("/")
            records.append(
                {
                    "layout": name,
                    "backend": backend,
                    "elements": numel,
                    "op": op_name,
                    "gaussian_s": gauss,
                    "rademacher_s": sign,
                    "gaussian_elements_per_s": numel / gauss,
                    "rademacher_elements_per_s": numel / sign,
                    "speedup": gauss / sign,
                }
            )
    return records


# ---------------------------------------------------------------------------------------------------
# ES quality: the README toy problem and a nonlinear regression, 3 seeds each
# ---------------------------------------------------------------------------------------------------


def toy_problem(seed: int, kind: str, generations: int) -> list[float]:
    """The README's example: fit sin(x_0) with a 4-16-1 tanh network; returns the loss per generation."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    x = torch.randn(256, 4)
    y = x[:, :1].sin()

    def reward() -> float:
        return -torch.nn.functional.mse_loss(model(x), y).item()

    es = fastes.ES(fastes.linear_weights(model), sigma=0.05, lr=0.02, population=16, seed=seed, noise=kind)
    losses = [-reward()]
    for _ in range(generations):
        es.step(reward)
        losses.append(-reward())
    return losses


def regression(seed: int, kind: str, generations: int) -> list[float]:
    """Teacher-student nonlinear regression: an 8-32-32-1 tanh student learns a random teacher of the same
    shape from 256 samples; returns the held-out MSE per generation (relative to the teacher's variance)."""
    torch.manual_seed(1000 + seed)

    def mlp() -> torch.nn.Module:
        return torch.nn.Sequential(
            torch.nn.Linear(8, 32),
            torch.nn.Tanh(),
            torch.nn.Linear(32, 32),
            torch.nn.Tanh(),
            torch.nn.Linear(32, 1),
        )

    teacher, student = mlp(), mlp()
    x_train, x_test = torch.randn(256, 8), torch.randn(256, 8)
    with torch.no_grad():
        y_train, y_test = teacher(x_train), teacher(x_test)
    scale = y_test.var().item()

    def test_loss() -> float:
        with torch.no_grad():
            return torch.nn.functional.mse_loss(student(x_test), y_test).item() / scale

    def reward() -> float:
        with torch.no_grad():
            return -torch.nn.functional.mse_loss(student(x_train), y_train).item()

    es = fastes.ES(
        fastes.linear_weights(student, include_biases=True),
        sigma=0.05,
        lr=0.003,
        population=16,
        seed=seed,
        noise=kind,
    )
    losses = [test_loss()]
    for _ in range(generations):
        es.step(reward)
        losses.append(test_loss())
    return losses


def quality(problem: Callable[[int, str, int], list[float]], generations: int, seeds: list[int]) -> dict:
    curves = {kind: [problem(seed, kind, generations) for seed in seeds] for kind in NOISES}
    return {
        "generations": generations,
        "seeds": seeds,
        "curves": curves,
        "final": {kind: summary([c[-1] for c in curves[kind]]) for kind in NOISES},
        "start": statistics.mean(c[0] for c in curves["gaussian"]),
    }


def summary(values: list[float]) -> dict:
    return {
        "values": values,
        "mean": statistics.mean(values),
        "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
    }


# ---------------------------------------------------------------------------------------------------
# Countdown on the tiny model: `fastes train`, 3 seeds per noise, same budget
# ---------------------------------------------------------------------------------------------------


def countdown_dir(runs: Path, kind: str, seed: int) -> Path:
    return runs / f"countdown-{kind}-seed{seed}"


def run_countdown(runs: Path, seeds: list[int], iterations: int) -> None:
    """Train the missing runs, alternating the noises so that both see the same machine load."""
    for seed in seeds:
        for kind in NOISES:
            out = countdown_dir(runs, kind, seed)
            if (out / "summary.json").exists():
                continue
            command = [
                sys.executable, "-m", "fastes", "train", "--es.noise", kind, "--seed", str(seed),
                "--es.iterations", str(iterations), "--eval_every", "0", "--checkpoint_every", "0",
                "--progress", "false", "--out_dir", str(out),
            ]  # fmt: skip
            print(" ".join(command[2:]), flush=True)
            subprocess.run(command, check=True, cwd=REPO_ROOT, stdout=subprocess.DEVNULL)


def countdown(runs: Path, seeds: list[int]) -> dict | None:
    """Training reward and test accuracy of the finished runs (None when they have not been run)."""
    found: dict[str, list[dict]] = {kind: [] for kind in NOISES}
    for kind in NOISES:
        for seed in seeds:
            out = countdown_dir(runs, kind, seed)
            if not (out / "summary.json").exists():
                return None
            metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            steps = [m for m in metrics if m["phase"] == "es"]
            found[kind].append(
                {
                    "seed": seed,
                    "rewards": [m["reward"] for m in steps],
                    "base_accuracy": metrics[0]["test_accuracy"],
                    "final_accuracy": steps[-1]["test_accuracy"],
                    "seconds": sum(m["seconds"] for m in steps),
                }
            )
    iterations = len(found["gaussian"][0]["rewards"])
    last = max(1, iterations // 5)  # the reward of one batch is noisy: average the last fifth
    return {
        "iterations": iterations,
        "seeds": seeds,
        "runs": found,
        "reward_last": {
            kind: summary([statistics.mean(r["rewards"][-last:]) for r in found[kind]]) for kind in NOISES
        },
        "reward_first": {kind: summary([r["rewards"][0] for r in found[kind]]) for kind in NOISES},
        "final_accuracy": {kind: summary([r["final_accuracy"] for r in found[kind]]) for kind in NOISES},
        "base_accuracy": found["gaussian"][0]["base_accuracy"],
        "last_fifth": last,
    }


# ---------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------


def fmt(s: dict, digits: int = 4) -> str:
    return f"{s['mean']:.{digits}f} +- {s['sd']:.{digits}f}"


def _load_line(load: list[float] | None) -> str:
    """What the machine was doing when the run started: its load average then (read before any work)."""
    if not load:
        return ""
    cores = os.cpu_count()
    return f"Load average {load[0]:.1f} (1 min) / {load[1]:.1f} (5 min) at the start, on {cores} cores. "


def report(results: dict) -> str:
    lines = [
        f"# Gaussian vs Rademacher noise ({results['date']}, {results['device']})",
        "",
        _load_line(results.get("load_average"))
        + "Every ratio is measured in one run, the two noises interleaved.",
        "",
        "## CPU throughput (1 thread, fp32; cpu: the compiled CPU backend, torch: the reference)",
        "",
        "| layout | backend | op | gaussian | rademacher | sign speedup |",
        "|---|---|---|---|---|---|",
    ]
    for r in results["throughput"]:
        lines.append(
            f"| {r['layout']} | {r['backend']} | {r['op']} | {r['gaussian_s'] * 1e3:.2f} ms "
            f"({r['gaussian_elements_per_s'] / 1e6:.1f} M elem/s) | {r['rademacher_s'] * 1e3:.2f} ms "
            f"({r['rademacher_elements_per_s'] / 1e6:.1f} M elem/s) | {r['speedup']:.2f}x |"
        )
    lines += ["", "## ES quality (mean +- sd over seeds; same sigma, lr, population, seeds)", ""]
    lines += ["| problem | budget | start | gaussian | rademacher |", "|---|---|---|---|---|"]
    for name, label in (("toy", "README toy: train MSE"), ("regression", "teacher-student: test MSE / var")):
        q = results[name]
        lines.append(
            f"| {label} | {q['generations']} generations x {len(q['seeds'])} seeds | {q['start']:.4f} | "
            f"{fmt(q['final']['gaussian'])} | {fmt(q['final']['rademacher'])} |"
        )
    c = results.get("countdown")
    if c is None:
        lines += ["", "Countdown: not run (python -m benchmarks.sign_noise --countdown)."]
    else:
        budget = f"{c['iterations']} iterations x {len(c['seeds'])} seeds"
        lines += [
            f"| countdown: train reward, mean of the last {c['last_fifth']} iterations | {budget} | "
            f"{statistics.mean(c['reward_first']['gaussian']['values']):.3f} (iteration 1) | "
            f"{fmt(c['reward_last']['gaussian'], 3)} | {fmt(c['reward_last']['rademacher'], 3)} |",
            f"| countdown: test accuracy (200 problems, greedy) | {budget} | {c['base_accuracy']:.3f} | "
            f"{fmt(c['final_accuracy']['gaussian'], 3)} | {fmt(c['final_accuracy']['rademacher'], 3)} |",
        ]
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("toy", "README toy: train MSE"), ("regression", "regression: test MSE / var")]
    if results.get("countdown"):
        panels.append(("countdown", "countdown: train reward"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6))
    for ax, (name, title) in zip(axes, panels):
        for kind, color in zip(NOISES, ("tab:blue", "tab:orange")):
            if name == "countdown":
                curves = [r["rewards"] for r in results["countdown"]["runs"][kind]]
            else:
                curves = results[name]["curves"][kind]
            for i, curve in enumerate(curves):
                ax.plot(curve, color=color, alpha=0.7, label=kind if i == 0 else None)
        ax.set_title(title)
        ax.set_xlabel("generation")
        if name != "countdown":
            ax.set_yscale("log")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.sign_noise", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes and budgets (seconds), for tests")
    parser.add_argument("--countdown", action="store_true", help="train the missing countdown runs first")
    parser.add_argument("--runs", default="runs/sign-noise", help="where the countdown runs live")
    parser.add_argument("--out", default=str(RESULTS), help="directory for the json, md and png")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    seeds = [0, 1, 2]
    runs = Path(args.runs)
    date = datetime.date.today().isoformat()
    load_at_start = load_average()  # before the countdown runs and the timings
    if args.countdown:
        run_countdown(runs, seeds, COUNTDOWN_ITERATIONS)
    results = {
        "date": date,
        "device": cpu_model(),
        "load_average": load_at_start,
        "throughput": throughput(args.quick),
        "toy": quality(toy_problem, 3 if args.quick else 200, seeds[:2] if args.quick else seeds),
        "regression": quality(regression, 3 if args.quick else 150, seeds[:2] if args.quick else seeds),
        "countdown": None if args.quick else countdown(runs, seeds),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / dated_stem(out, "sign-noise-cpu", date, endings=(".json", ".md", ".png"))
    stem.with_suffix(".json").write_text(json.dumps(results, indent=1))
    stem.with_suffix(".md").write_text(report(results))
    plot(results, stem.with_suffix(".png"))
    print(report(results))
    return results


if __name__ == "__main__":
    main()
