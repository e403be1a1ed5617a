"""Every script in examples/ runs as a user would run it (a subprocess, in a fresh directory), with small
settings, and prints something sensible."""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "examples").glob("*.py"))


def check_es_by_hand(out: str) -> None:
    rewards = [float(r) for r in re.findall(r"iteration \d+/2: mean reward (\S+)", out)]
    assert len(rewards) == 2 and all(0 <= r <= 1.1 for r in rewards), out  # 0.1 format + 1 answer at most
    base, trained = map(
        float, re.search(r"base accuracy (\S+) -> trained accuracy (\S+) on 10 ", out).groups()
    )
    assert 0 <= base <= 1 and 0 <= trained <= 1


def check_side_by_side(out: str) -> None:  # the ES half; tests/test_trainer.py runs both halves with TRL
    records = [ast.literal_eval(line) for line in out.splitlines() if line.startswith("{")]
    steps = [r for r in records if "rewards/short/mean" in r]
    assert len(steps) == 2, out
    assert all(0 <= r["rewards/short/mean"] <= 1 for r in steps)


# script name -> (small command-line arguments, check of its output)
RUNS = {
    "es_by_hand.py": (
        ["--iterations", "2", "--population", "4", "--prompts", "8", "--test", "10"],
        check_es_by_hand,
    ),
    "side_by_side.py": (["es", "2"], check_side_by_side),
}


def test_every_example_has_a_run():
    assert SCRIPTS and {s.name for s in SCRIPTS} == set(RUNS), "add the new example to RUNS"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s.name)
def test_example_runs(script, tmp_path):
    args, check = RUNS[script.name]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(script), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    check(done.stdout)
