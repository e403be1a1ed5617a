"""Seeded random inputs to `fastes train`, as a careless or hostile user gives them: data files, reward
functions and flags (in process, on the built-in tiny model).

    python scripts/fuzz_trainer.py --n 200 --seed 0 [--json report.json]

The invariant for every case: exit status 0 with every weight file under out_dir finite (the checkpoints
and final/), or exit status 2 with one line `fastes: ...` on stderr and nothing written; in both cases the
files that were there before (a bystander file, a copy of the model) are unchanged. Anything else (a
traceback, another status, a non-finite weight, a changed or deleted file) is a finding, and the run
exits with status 1. The same seed gives the same cases.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import random
import shutil
import sys
import tempfile
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from fastes import cli
from fastes.models.loading import tiny_model_path

PROMPTS = ["2+2=", "", "\u0663 \u2603 \x00", "x" * 300, 3, None, [{"role": "user", "content": "hi"}]]
PROMPTS += [[{"role": "wizard", "content": "hi"}], [{"role": "user"}]]
# Bodies of `reward(completions, **kwargs)`: numbers, TRL's None, and everything a reward must not return.
RETURNS = [
    "[1.0] * len(completions)",
    "[float(len(c)) for c in completions]",
    "[None] * len(completions)",
    "[None if i % 2 else 1.0 for i in range(len(completions))]",
    "[float('nan')] * len(completions)",
    "[float('inf')] * len(completions)",
    "['1.0'] * len(completions)",
    "{'a': 1.0}",
    "[1.0]",
    "[[1.0]] * len(completions)",
    "1.0",
    "[1e308 * (i % 2) for i in range(len(completions))]",
    "[True] * len(completions)",
    "sys.exit(3)",
    "1 / 0",
]
# Flags and the values drawn for them: sensible ones, absurd ones, and ones of the wrong type.
FLAGS = {
    "--algorithm": ["es", "es", "grpo"],
    "--es.lr": ["0.001", "0.1", "1e300", "-1", "abc"],
    "--es.sigma": ["0.002", "1e-30", "1e30", "1e300"],
    "--es.population": ["2", "4", "3", "1000000000"],
    "--es.weight_decay": ["0", "0.1", "1e300"],
    "--es.noise_type": ["full", "lowrank"],
    "--es.noise": ["gaussian", "rademacher"],
    "--es.eval_mode": ["member", "materialised", "lowrank"],
    "--es.shaping": ["centered_rank", "zscore", "raw"],
    "--grpo.lr": ["0.0001", "1e30", "1e300"],
    "--grpo.weight_decay": ["0", "1e300"],
    "--batch_size": ["1", "2", "1000000000"],
    "--max_new_tokens": ["1", "4", "1000000"],
    "--reward_timeout": ["5", "0", "1e300"],
    "--dtype": ["float32", "float32", "bfloat16", "float16"],
}
MESSAGES: list[str] = []  # the refusals' lines, for the report
BYSTANDER = "notes.txt"
MODEL_COPY = "model"


SANE_RETURN = "[float(len(c)) for c in completions]"


def write_data(rng: random.Random, path: Path, hostile: bool) -> Path:
    """A data file of six rows; a hostile one of a random kind and size, with odd prompts, sometimes
    damaged."""
    kind = rng.choice(["jsonl", "csv", "json"]) if hostile else "jsonl"
    rows = []
    for i in range(rng.choice([0, 1, 2, 6]) if hostile else 6):
        prompt = rng.choice(PROMPTS) if hostile and kind != "csv" else f"{i}+{i}="
        rows.append({"prompt": prompt, "answer": rng.choice(["4", 4, ""]) if hostile else str(2 * i)})
    target = path / f"data.{kind}"
    if kind == "jsonl":
        text = "".join(json.dumps(r) + "\n" for r in rows)
    elif kind == "json":
        text = json.dumps(rows if rng.random() < 0.7 else {"prompt": [r.get("prompt") for r in rows]})
    else:
        header = rng.choice(["prompt,answer", "prompt,answer,answer", "prompt"])
        text = header + "\n" + "".join(f"{r['prompt']},{r['answer']}\n" for r in rows)
    data = text.encode()
    if hostile and rng.random() < 0.3:
        data = rng.choice([b"\xff" + data, data[: len(data) // 2], b""])
    target.write_bytes(data)
    return target


def write_rewards(rng: random.Random, path: Path, hostile: bool) -> list[str]:
    """One reward function (hostile: one or two, each returning one of RETURNS); their FILE.py:NAME."""
    names = ["first", "second"][: rng.choice([1, 2]) if hostile else 1]
    bodies = [rng.choice(RETURNS) if hostile else SANE_RETURN for _ in names]
    code = "".join(f"def {n}(completions, **kwargs):\n    return {b}\n\n" for n, b in zip(names, bodies))
    (path / "rewards.py").write_text("import sys\n\n" + code)
    return [f"{path / 'rewards.py'}:{n}" for n in names]


# What a case may get wrong; each case draws a few (none: a sensible run that must train).
HOSTILE = ("data", "rewards", "weights", "flag", "flag", "flag", "out_dir", "model", "mode")


def make_case(rng: random.Random, root: Path) -> list[str]:
    """The arguments of one `fastes train` call in `root` (which holds the bystanders)."""
    hostile = rng.sample(HOSTILE, rng.choice([0, 1, 1, 2, 3]))
    args = ["train", "--dataset", str(write_data(rng, root, "data" in hostile))]
    args += ["--reward", *write_rewards(rng, root, "rewards" in hostile)]
    if "weights" in hostile:
        args += ["--reward_weights", rng.choice(["1", "0", "1,0.5", "x", "nan"])]
    for _ in range(hostile.count("flag")):
        flag = rng.choice(list(FLAGS))
        args += [flag, rng.choice(FLAGS[flag])]
    out = rng.choice([BYSTANDER, f"{BYSTANDER}/run", MODEL_COPY]) if "out_dir" in hostile else "run"
    args += ["--out_dir", str(root / out)]
    if "model" in hostile:
        args += ["--model", str(root / MODEL_COPY)]
    if "mode" in hostile:
        args.append(rng.choice(["--overwrite", "--resume"]))
    fixed = ["--progress", "false", "--es.iterations", "2", "--es.population", "4", "--grpo.steps", "1"]
    return args + fixed + ["--grpo.num_generations", "2", "--batch_size", "2", "--max_new_tokens", "3"]


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def call(args: list[str]) -> tuple[int, str, str]:
    """cli.main(args) in this process: (exit status, stdout, stderr); an exception is a finding."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            status = cli.main(args)
        except SystemExit as exit_:  # argparse's usage errors
            status = exit_.code if isinstance(exit_.code, int) else 1
    return status, out.getvalue(), err.getvalue()


def check(root: Path, args: list[str]) -> tuple[int, str | None]:
    """Run one case; (exit status, the problem found or None). A refusal may come after the run started
    (a reward that returns None at the first step): what it wrote must then be finite too."""
    before = {k: v for k, v in _files(root).items() if k.startswith((BYSTANDER, MODEL_COPY))}
    out_dir = Path(args[args.index("--out_dir") + 1])
    try:
        status, _, err = call(args)
    except BaseException as error:  # noqa: BLE001 - the finding
        return -1, f"raised {type(error).__name__}: {str(error)[:300]}"
    after = _files(root)
    lost = [k for k, v in before.items() if after.get(k) != v]
    if lost:
        return status, f"changed or deleted {lost[:3]}"
    if status == 2:
        lines = err.strip().splitlines()
        if len(lines) != 1 or not lines[0].startswith("fastes: "):
            return status, f"status 2 with stderr {err[-500:]!r}"
        MESSAGES.append(lines[0].replace(str(root), "<tmp>")[:120])
    elif status != 0:
        return status, f"exit status {status}, stderr {err[-500:]!r}"
    elif not (out_dir / "final").is_dir():
        return status, "exit status 0 without final/"
    weights = (
        out_dir.rglob("*.safetensors") if out_dir.is_dir() and str(out_dir) != str(root / MODEL_COPY) else []
    )
    for path in weights:
        if not all(bool(torch.isfinite(t).all()) for t in load_file(path).values()):
            return status, f"non-finite weights in {path.relative_to(out_dir)}"
    return status, None


def run(n: int = 200, seed: int = 0, log: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Fuzz `n` cases; the report counts the exit statuses and lists the findings with their arguments."""
    torch.set_num_threads(1)
    rng = random.Random(seed)
    statuses: Counter[int] = Counter()
    findings = []
    for index in range(n):
        with tempfile.TemporaryDirectory(prefix="fastes-fuzz-") as tmp:
            root = Path(tmp)
            (root / BYSTANDER).write_text("a user's notes\n")
            shutil.copytree(tiny_model_path(), root / MODEL_COPY)
            args = make_case(rng, root)
            status, problem = check(root, args)
        statuses[status] += 1
        if problem:
            findings.append(
                {"case": index, "args": [a.replace(tmp, "<tmp>") for a in args], "problem": problem}
            )
        log(f"case {index}: status {status}{': ' + problem if problem else ''}")
    refused = sorted(set(MESSAGES[-statuses[2] :])) if statuses[2] else []
    return {"cases": n, "seed": seed, "statuses": dict(statuses), "findings": findings, "refused": refused}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=200, help="number of cases (default 200)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the report to this file")
    args = parser.parse_args(argv)
    report = run(args.n, args.seed, log=lambda line: print(line, file=sys.stderr))
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 1 if report["findings"] else 0


if __name__ == "__main__":
    sys.exit(main())
