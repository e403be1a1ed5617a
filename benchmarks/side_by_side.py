"""Two fastes runs side by side against the same two one after the other, on this machine's cores.

    python -m benchmarks.side_by_side [--command "fastes eval ..."] [--out benchmarks/results]

Runs the command once (warm-up: model conversion, compiled library), then, as fastes runs by default
and with the threads fixed by OMP_NUM_THREADS (what every run did before fastes.engine.cpu_share), twice one
after the other and twice started together, each its own process, and reports the pair's wall time over
the sequential pair's (target: at most 1.2x; torch's spinning threads made it ~2.4x before fastes
processes shared the cores, fastes.engine.cpu_share). The default command evaluates SmolLM2-135M-Instruct
(`bash scripts/setup.sh real`). Measured, not asserted. Writes <out>/side-by-side-<date>-<time>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from fastes.engine import cpu_share

DEFAULT = "fastes eval --model smollm2-135m-instruct --task arithmetic --limit 48 --samples 4"
TARGET = 1.2


def _fastes_command(command: str) -> list[str]:
    """The command's words, `fastes` run by this Python (the venv's console script may not be on PATH)."""
    words = shlex.split(command)
    if words[0] == "fastes":
        words = [
            sys.executable,
            "-c",
            "import sys; from fastes.cli import main; sys.exit(main())",
            *words[1:],
        ]
    return words


def _wall(commands: list[list[str]], together: bool, env: dict) -> float:
    """Seconds until every command has finished: started together, or one after the other."""
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "env": env}
    start = time.perf_counter()
    if together:
        running = [subprocess.Popen(c, **quiet) for c in commands]
        codes = [p.wait() for p in running]
    else:
        codes = [subprocess.run(c, **quiet).returncode for c in commands]
    if any(codes):
        raise SystemExit(f"side_by_side: the command failed (exit {codes}); run it alone to see why")
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.side_by_side", description=__doc__)
    parser.add_argument("--command", default=DEFAULT)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    command = _fastes_command(args.command)
    load_average = os.getloadavg()[0]
    cores = cpu_share.cores()
    settings = {
        "shared (fastes' default)": {
            k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "FASTES_THREADS")
        },
        # a thread count the user set is left alone: every process runs on every core, as before
        "unshared (OMP_NUM_THREADS = cores)": {**os.environ, "OMP_NUM_THREADS": str(cores)},
    }
    _wall([command], False, settings["shared (fastes' default)"])  # warm-up: conversion, library build
    results = {}
    for name, env in settings.items():
        sequential = _wall([command, command], False, env)
        together = _wall([command, command], True, env)
        results[name] = {
            "one_after_the_other_s": sequential,
            "side_by_side_s": together,
            "side_by_side_over_one_after_the_other": together / sequential,
        }
    now = datetime.datetime.now()
    report = {
        "date": now.date().isoformat(),
        "time": now.strftime("%H%M"),
        "command": args.command,
        "cores": cores,
        "load_average_at_start": load_average,
        "results": results,
        "target": TARGET,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"side-by-side-{report['date']}-{report['time']}.json").write_text(
        json.dumps(report, indent=2)
    )
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
