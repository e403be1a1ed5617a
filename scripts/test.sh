#!/usr/bin/env bash
# Set up .venv with the test extra, lint, and run the whole test suite (CPU; kernels interpreted).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
# shellcheck disable=SC1091
. .venv/bin/activate
ruff check .
ruff format --check .
python -m pytest -q "$@"
