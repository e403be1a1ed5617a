#!/usr/bin/env bash
# Set up .venv and run the main job: ES on the built-in tiny model and the countdown task.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
fastes demo "$@"
