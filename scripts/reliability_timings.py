"""The timings docs/reliability.md quotes, measured on this machine into one dated results file.

    python scripts/reliability_timings.py [--out docs/results] [--fuzz-inputs 100000] [--trainer-cases 200]

Measures, one after the other (run it alone: other processes change every figure):
- fingerprinting a model's weight files (`fastes.run.rundir.model_fingerprint`): the tiny model, and a
  256 MiB file from the page cache (MiB/s);
- one torch-reference Philox call of a member cycle in the reliability tests (`fastes.ES` on the torch
  backend: one member entered and left);
- `torch.aminmax` over 106M fp32 weights (the bound ES checks before a generation);
- the wall time of one-line errors of `fastes train` / `fastes eval` (a fresh process each, so the
  time includes importing torch);
- the fuzzers (`scripts/fuzz_verifiers.py`, `scripts/fuzz_trainer.py`) at the sizes the page runs;
- the duration of the slow reliability tests the page names (pytest --durations).
Nothing is asserted. Writes <out>/reliability-timings-<date>.md and .json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SLOW_TESTS = [
    "tests/test_runs.py::test_sigkill_then_resume_equals_the_uninterrupted_run_in_every_mode",
    "tests/test_runs.py::test_a_rank_that_fails_on_a_hung_peer_exits_promptly",
    "tests/test_reliability.py::test_a_rank_that_dies_or_hangs_makes_the_others_fail_fast",
]
ERRORS = [
    ["train", "--es.population", "1"],
    ["train", "--task", "sudoku"],
    ["eval", "--limit", "0"],
]


def _median_seconds(call, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def fingerprints() -> dict:
    from fastes.models.loading import tiny_model_path
    from fastes.run.rundir import model_fingerprint

    tiny_s = _median_seconds(lambda: model_fingerprint(tiny_model_path()), 20)
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text("{}")
        (Path(folder) / "model.safetensors").write_bytes(os.urandom(256 << 20))
        model_fingerprint(folder)  # into the page cache
        big_s = _median_seconds(lambda: model_fingerprint(folder), 3)
    return {"tiny_model_s": tiny_s, "256_mib_s": big_s, "mib_per_s": 256 / big_s}


def member_cycle() -> dict:
    import torch

    import fastes

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    es = fastes.ES(fastes.linear_weights(model), sigma=0.5, lr=0.0, population=2000, seed=3, backend="torch")
    members = iter(es.members())

    def cycle():
        with next(members):
            pass

    return {"member_cycle_s": _median_seconds(cycle, 1000)}


def aminmax() -> dict:
    import torch

    weights = torch.randn(106_000_000)
    return {"aminmax_106m_fp32_s": _median_seconds(lambda: torch.aminmax(weights), 5)}


def error_lines() -> dict:
    found = {}
    for args in ERRORS:
        command = [sys.executable, "-c", "import sys; from fastes.cli import main; sys.exit(main())", *args]
        start = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, cwd=tempfile.gettempdir())
        found[" ".join(args)] = {
            "s": time.perf_counter() - start,
            "exit": done.returncode,
            "stderr": done.stderr.strip().splitlines()[-1:] if done.stderr else [],
        }
    return found


def fuzzers(inputs: int, cases: int) -> dict:
    found = {}
    for name, args in (
        ("fuzz_verifiers", ["--n", str(inputs), "--seed", "0"]),
        ("fuzz_trainer", ["--n", str(cases), "--seed", "0"]),
    ):
        with tempfile.NamedTemporaryFile(suffix=".json") as report:
            start = time.perf_counter()
            done = subprocess.run(
                [sys.executable, str(ROOT / "scripts" / f"{name}.py"), *args, "--json", report.name],
                capture_output=True,
                text=True,
            )
            seconds = time.perf_counter() - start
            summary = json.loads(Path(report.name).read_text() or "{}") if done.returncode in (0, 1) else {}
        found[name] = {"args": args, "s": seconds, "exit": done.returncode, "report": _small(summary)}
    return found


def _small(summary: dict) -> dict:
    """The fuzz report without its long lists (cases, findings' inputs)."""
    return {k: v for k, v in summary.items() if not isinstance(v, list) or len(v) <= 20}


def slow_tests() -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=0", *SLOW_TESTS],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    durations = {}
    for line in done.stdout.splitlines():
        match = re.match(r"\s*([\d.]+)s call\s+(.+)$", line)
        if match:
            durations[match.group(2)] = float(match.group(1))
    return {"exit": done.returncode, "summary": done.stdout.strip().splitlines()[-1:], "call_s": durations}


def markdown(report: dict) -> str:
    f, cycle, errors = report["fingerprints"], report["member_cycle"], report["error_lines"]
    rows = [
        ("fingerprint of the tiny model's files", f"{f['tiny_model_s'] * 1e3:.1f} ms"),
        (
            "fingerprint of 256 MiB from the page cache",
            f"{f['256_mib_s']:.2f} s ({f['mib_per_s']:.0f} MiB/s)",
        ),
        (
            "one member entered and left (torch reference, 2 x 64x64)",
            f"{cycle['member_cycle_s'] * 1e3:.2f} ms",
        ),
        ("torch.aminmax over 106M fp32 weights", f"{report['aminmax']['aminmax_106m_fp32_s'] * 1e3:.0f} ms"),
    ]
    rows += [
        (f"`fastes {args}`: a one-line error (exit {r['exit']}), fresh process", f"{r['s']:.2f} s")
        for args, r in errors.items()
    ]
    lines = [
        f"# Timings of docs/reliability.md, measured {report['date']} {report['time']}",
        "",
        f"`python scripts/reliability_timings.py`; {report['cpu']}; load average {report['load_average']} at "
        "the start.",
        "",
        "| what | measured |",
        "|---|---|",
        *(f"| {what} | {value} |" for what, value in rows),
    ]
    for name, result in report["fuzzers"].items():
        lines.append(
            f"| `{name}.py {' '.join(result['args'])}` (exit {result['exit']}) | {result['s']:.1f} s |"
        )
    for test, seconds in report["slow_tests"]["call_s"].items():
        lines.append(f"| `{test}` | {seconds:.1f} s |")
    lines += [
        "",
        f"Slow tests: {' '.join(report['slow_tests']['summary'])}. The one-line errors' messages: "
        + "; ".join(f"`{' '.join(r['stderr'])}`" for r in errors.values()),
        "",
        "The fuzzers' own reports (lists shortened):",
        "",
        "```json",
        json.dumps({name: r["report"] for name, r in report["fuzzers"].items()}, indent=1)[:6000],
        "```",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/reliability_timings.py", description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results")
    parser.add_argument("--fuzz-inputs", type=int, default=100_000)
    parser.add_argument("--trainer-cases", type=int, default=200)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from benchmarks.common import cpu_model, load_average, write_results

    now = datetime.datetime.now()
    report = {"date": now.strftime("%Y-%m-%d"), "time": now.strftime("%H:%M"), "cpu": cpu_model()}
    report["load_average"] = load_average()
    for name, measure in (
        ("fingerprints", fingerprints),
        ("member_cycle", member_cycle),
        ("aminmax", aminmax),
        ("error_lines", error_lines),
        ("fuzzers", lambda: fuzzers(args.fuzz_inputs, args.trainer_cases)),
        ("slow_tests", slow_tests),
    ):
        print(f"reliability timings: {name} ...", flush=True)
        report[name] = measure()
    print(f"wrote {write_results(args.out, 'reliability-timings', report, markdown(report))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
