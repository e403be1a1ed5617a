"""python -m benchmarks: run the suites and write the result files."""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.runner import run
from benchmarks.suites import SUITES


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run of a few seconds")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results", help="result folder")
    parser.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda[:i]")
    parser.add_argument(
        "--dtype", default=None, help="float32 / bfloat16 (default: fp32 on CPU, bf16 on CUDA)"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument(
        "--suites", default=",".join(SUITES), help=f"comma-separated subset of {list(SUITES)}"
    )
    parser.add_argument("--note", action="append", default=[], help="a line for the report's notes")
    parser.add_argument(
        "--static",
        action="store_true",
        help="no timing: compile the kernels for sm_90 and write the predicted (SASS-based) report",
    )
    args = parser.parse_args(argv)
    if args.static:
        from benchmarks.static import run_static

        run_static(args.out)
        return
    _, paths = run(
        quick=args.quick,
        out=args.out,
        device=args.device,
        dtype=args.dtype,
        threads=args.threads,
        suites=[s for s in args.suites.split(",") if s],
        notes=args.note,
    )
    for kind, path in paths.items():
        print(f"wrote {kind:6s} {path}")


if __name__ == "__main__":
    main()
