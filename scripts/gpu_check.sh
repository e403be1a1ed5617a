#!/usr/bin/env bash
# GPU check of fastes: one command, under 8 minutes on one H200 including the install.
#
#   bash scripts/gpu_check.sh [out_dir]        (default: gpu_check-<UTC time>)
#
# Steps, each in its own process with its own time limit, so that a failure, a crash or a hang in one
# (a CUDA error poisons its process) never stops the others:
#   facts        nvidia-smi, python / torch / triton versions            -> out/facts.log
#   install      pip install -e . --no-deps, only when fastes.engine.kernels does not import
#   environment stream perturb update virtual es large bench
#                python -m benchmarks.gpu_check --steps <step>: compiled kernels vs the torch reference
#                (keys and tensor ids of 1 included), a tensor past 2^31 elements, a short benchmark
#   model        python -m benchmarks.gpu_check --steps model: one ES iteration of Qwen2.5-0.5B's shape
#                (random weights; materialised, virtual, low-rank), its noise time vs the prediction
#   static       python -m benchmarks --static: the predicted SASS report, to set beside the bench
# After every step: out/<step>.log and out/<step>.json (written by the step), out/gpu_check.log (all
# output) and out/script.json (each step's exit status and seconds). Exit status: 0 when every step passed.
#
# Environment: PYTHON (default python3), GPU_CHECK_BUDGET (seconds for all steps, default 430),
# GPU_CHECK_STEPS (which steps, in order), GPU_CHECK_ARGS (extra arguments for benchmarks.gpu_check;
# the test suite runs this script with "--device cpu --small" under TRITON_INTERPRET=1).
set -uo pipefail  # not -e: a failed step is recorded and the next one runs
cd "$(dirname "$0")/.."
out="${1:-gpu_check-$(date -u +%Y%m%dT%H%M%SZ)}"
py="${PYTHON:-python3}"
budget="${GPU_CHECK_BUDGET:-430}"
steps="${GPU_CHECK_STEPS:-facts install environment stream perturb update virtual es large bench model static}"
extra="${GPU_CHECK_ARGS:-}"
mkdir -p "$out"
log="$out/gpu_check.log"
: >"$log"
records=()
failures=0

say() { echo "[gpu_check $(date -u +%H:%M:%S) +${SECONDS}s] $*" | tee -a "$log"; }

write_records() {  # out/script.json, rewritten after every step
  local IFS=,
  printf '{"out": "%s", "budget_s": %s, "elapsed_s": %s, "failures": %s, "steps": [%s]}\n' \
    "$out" "$budget" "$SECONDS" "$failures" "${records[*]}" >"$out/script.json"
}

# run_step NAME LIMIT COMMAND...: run with a time limit (and what is left of the budget), log, record.
run_step() {
  local name=$1 limit=$2
  shift 2
  local left=$((budget - SECONDS)) start=$SECONDS rc
  if ((left < 15)); then
    say "$name: skipped, the time budget is spent"
    records+=("{\"step\": \"$name\", \"status\": \"skipped\", \"rc\": null, \"seconds\": 0}")
    failures=$((failures + 1))
    write_records
    return
  fi
  ((limit > left)) && limit=$left
  say "$name (limit ${limit}s): $*"
  timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  local status=passed
  if ((rc == 124 || rc == 137)); then
    status=timeout
  elif ((rc != 0)); then
    status=failed
  fi
  ((rc != 0)) && failures=$((failures + 1))
  say "$name: $status (exit $rc, $((SECONDS - start)) s)"
  records+=("{\"step\": \"$name\", \"status\": \"$status\", \"rc\": $rc, \"seconds\": $((SECONDS - start))}")
  write_records
}

facts() {
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv
    nvidia-smi | head -4
  else
    echo "nvidia-smi: not found"
  fi
  "$py" - <<'PY'
import platform, sys
print("python", platform.python_version(), sys.executable)
for name in ("torch", "triton"):
    try:
        module = __import__(name)
        print(name, module.__version__, getattr(getattr(module, "version", None), "cuda", ""))
    except Exception as error:
        print(name, "unavailable:", error)
PY
}

install() {
  # fastes (with fastes.engine.kernels) must be installed (editable) for the steps to import it.
  if "$py" -c "import fastes.engine.kernels" 2>/dev/null; then
    echo "fastes is installed: $("$py" -c 'import fastes, os; print(os.path.dirname(fastes.__file__))')"
  else
    "$py" -m pip install -q --no-deps --no-build-isolation -e .
  fi
}

# Compiled kernels and automatic dispatch: a setting left in the shell would make them crawl (the
# interpreter) or pick the wrong backend. Tests that run this on CPU pass it back in GPU_CHECK_ARGS.
[[ "$extra" == *"--device cpu"* ]] || unset TRITON_INTERPRET
unset FASTES_BACKEND
export py
export -f facts install
say "output folder: $out; steps: $steps; budget ${budget}s"
for step in $steps; do
  case "$step" in
    facts) run_step facts 30 bash -c facts ;;
    install) run_step install 120 bash -c install ;;
    static) run_step static 90 "$py" -m benchmarks --static --out "$out" ;;
    large | bench | model) run_step "$step" 90 "$py" -m benchmarks.gpu_check --out "$out" --steps "$step" $extra ;;
    *) run_step "$step" 60 "$py" -m benchmarks.gpu_check --out "$out" --steps "$step" $extra ;;
  esac
done
say "done: $failures step(s) failed; results in $out (summary.json, script.json, <step>.json, gpu_check.log)"
((failures == 0))
