#!/usr/bin/env bash
# GPU check: install missing engines from carried wheels, run the GPU tests, run a short
# engine benchmark and the utilization sections (compiled decode, MFU per stage of the
# built-in job and of a SmolLM2-shaped model, TRL's GRPOTrainer beside ours), write JSON
# (OUT, and OUT with .json -> _mfu.json). Budget: under 8 minutes on one GPU.
#
#   bench/gpu_check.sh [--dry-run] [--out FILE]
#
# --dry-run: CPU, tiny sizes, installs nothing (exercised by tests/integration/test_gpu_check.py).
# Wheels: put deepspeed/vllm/trl wheels (and their deps: trl needs datasets, dill,
# multiprocess) in .whl/ at the repository root; only what `import` cannot find is
# installed, with --no-index (no network needed).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DRY=0
OUT=bench/results/gpu_check.json
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) DRY=1; shift ;;
    --out) OUT="$2"; shift 2 ;;
    *) echo "gpu_check.sh: unknown argument '$1' (accepted: --dry-run, --out FILE)" >&2; exit 2 ;;
  esac
done
START=$(date +%s)

if [[ $DRY -eq 0 ]]; then
  for mod in deepspeed vllm trl; do
    if ! "$PY" -c "import $mod" 2>/dev/null; then
      if ls .whl/"$mod"-*.whl >/dev/null 2>&1; then
        echo "gpu_check: installing $mod from .whl/"
        "$PY" -m pip install -q --no-index --find-links .whl "$mod" || echo "gpu_check: $mod install failed"
      else
        echo "gpu_check: $mod missing and no wheel in .whl/; its tests will skip"
      fi
    fi
  done
  "$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'" || {
    echo "gpu_check: no CUDA device; use --dry-run on CPU" >&2; exit 1; }
fi

echo "gpu_check: GPU tests"
TESTS_RC=0
timeout 120 "$PY" -m pytest -q -p no:cacheprovider tests/gpu || TESTS_RC=$?
# pytest exit 5 = nothing collected/all skipped is fine on CPU
[[ $TESTS_RC -eq 5 ]] && TESTS_RC=0

echo "gpu_check: benchmark"
BENCH_ARGS=(--out "$OUT")
[[ $DRY -eq 1 ]] && BENCH_ARGS+=(--dry-run)
BENCH_RC=0
timeout 150 "$PY" -m bench.gpu_bench "${BENCH_ARGS[@]}" || BENCH_RC=$?

echo "gpu_check: utilization"
MFU_OUT="${OUT%.json}_mfu.json"
MFU_ARGS=(--out "$MFU_OUT")
# the dry run leaves out what needs minutes on CPU (inductor's compile, TRL)
[[ $DRY -eq 1 ]] && MFU_ARGS+=(--dry-run --sections mfu_builtin mfu_smollm2)
MFU_RC=0
timeout 200 "$PY" -m bench.gpu_mfu "${MFU_ARGS[@]}" || MFU_RC=$?

echo "gpu_check: tests rc=$TESTS_RC bench rc=$BENCH_RC mfu rc=$MFU_RC in" \
  "$(( $(date +%s) - START ))s -> $OUT $MFU_OUT"
[[ $TESTS_RC -eq 0 && $BENCH_RC -eq 0 && $MFU_RC -eq 0 ]]
