#!/usr/bin/env bash
# GPU check of fastes, one script, a few minutes on one GPU (hard limits add up to 8 minutes):
#   (a) the compiled Triton kernels vs the torch reference on the same CUDA tensors
#       (python -m benchmarks.gpu_check: raw Philox bits exact, normals ~1e-5, perturb / update / fill
#       in fp32, bf16 and fp16, exact restore, a tensor past 2^31 elements);
#   (b) the benchmark suites on CUDA (python -m benchmarks), result files into benchmarks/results or $1.
# Usage: bash scripts/gpu_check.sh [out_dir]    (PYTHON=... to choose the interpreter; default python3)
# Stops at once, with a message and exit status 2, where there is no CUDA device.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-benchmarks/results}"
py="${PYTHON:-python3}"
# Compiled kernels and automatic dispatch: an interpreter setting left in the shell would make them crawl.
unset TRITON_INTERPRET FASTES_BACKEND

"$py" - <<'PY' || exit 2
import sys
try:
    import torch
except ImportError:
    sys.exit("gpu_check: torch is not installed for this python; set PYTHON to one that has it")
if not torch.cuda.is_available():
    sys.exit(
        f"gpu_check: no CUDA device (torch {torch.__version__}, CUDA build {torch.version.cuda}); "
        "run this on a machine with an NVIDIA GPU"
    )
try:
    import triton
except ImportError:
    sys.exit("gpu_check: triton is not installed; the kernels need triton >= 3.6")
print(f"[gpu_check] {torch.cuda.get_device_name()}: torch {torch.__version__}, triton {triton.__version__}")
PY

if ! "$py" -c "import fastes.kernels" >/dev/null 2>&1; then
  # fastes.kernels is the kernels/ folder mapped by the package config: it needs an (editable) install.
  echo "[gpu_check] installing fastes (editable, no dependencies)"
  "$py" -m pip install -q --no-deps --no-build-isolation -e .
fi

echo "[gpu_check] (a) compiled kernels vs torch reference"
timeout 150 "$py" -m benchmarks.gpu_check

echo "[gpu_check] (b) benchmarks on CUDA -> $out"
timeout 330 "$py" -m benchmarks --device cuda --out "$out"
echo "[gpu_check] done"
