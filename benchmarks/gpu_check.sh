#!/usr/bin/env bash
# The GPU check: one command, run from the repository root on the GPU machine.
#   1. builds and installs seqfuse there (its Python differs from ours),
#   2. runs the standalone kernel checks carried in bin/ (built here by
#      `make kernels`) and the `cuda` tests,
#   3. runs every benchmarks/bench_*.py (or those named in BENCHES),
#   4. prints a short summary table last.
# Logs and results go to $OUT (the device tool brings them back) when set.
# STEPS picks the steps (default "build checks tests benches"); BENCHES the
# benchmark scripts; TESTS and PYTEST_ARGS the cuda test selection.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
export PYTHONUNBUFFERED=1
# Logs collect in $LOG and are packed into one archive in $OUT at the end
# (the device tool brings back at most 8 files).
FINAL_OUT=${OUT:-/tmp/seqfuse-gpu-check}
OUT=$(mktemp -d /tmp/gpu_check.XXXX)
mkdir -p "$FINAL_OUT"
pack() { cp "$ROOT"/benchmarks/results/*.json "$ROOT"/benchmarks/results/*.png "$OUT/" 2>/dev/null; tar czf "$FINAL_OUT/gpu_check.tgz" -C "$OUT" .; }
trap pack EXIT
trap "exit 143" TERM
status=0
step() { echo; echo "===== $* ====="; }
STEPS=${STEPS:-build checks tests benches}
want() { [[ " $STEPS " == *" $1 "* ]]; }

if want build; then
step build
start=$(date +%s)
MAX_JOBS=${MAX_JOBS:-16} python3 -m pip install -q --no-build-isolation --no-deps --no-index -e . \
    > "$OUT/build.log" 2>&1 || { cat "$OUT/build.log"; echo "BUILD FAILED"; exit 1; }
echo "build took $(( $(date +%s) - start )) s"; grep "seqfuse: built" "$OUT/build.log"
python3 -m seqfuse || status=1
fi

if want checks; then
step "standalone kernel checks"
for b in bin/check_*; do
    [ -x "$b" ] || continue
    timeout ${CHECK_TIMEOUT:-300} "$b" 2>&1 | tee -a "$OUT/checks.log" | grep -E "passed|FAIL|TB/s|TFLOP" || status=1
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
done
fi

if want tests; then
step "cuda tests"
python3 -m pytest -q -m cuda ${TESTS:-tests} -p no:cacheprovider ${PYTEST_ARGS:--n 8 --timeout 600} 2>&1 | tee "$OUT/pytest_cuda.log" | tail -25
[ "${PIPESTATUS[0]}" = 0 ] || status=1
fi

if want benches; then
step benchmarks
for b in ${BENCHES:-benchmarks/bench_*.py}; do
    echo "--- $b"
    (cd benchmarks && timeout ${BENCH_TIMEOUT:-300} python3 "$(basename "$b")") > "$OUT/$(basename "$b" .py).log" 2>&1 \
        || { status=1; tail -20 "$OUT/$(basename "$b" .py).log"; }
done
fi

step summary
python3 benchmarks/summary.py
echo "gpu_check status: $status"
exit $status
