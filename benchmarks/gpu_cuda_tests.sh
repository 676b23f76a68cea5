#!/usr/bin/env bash
# Every cuda-marked test on the GPU machine, file by file, so that one slow or
# hanging file cannot hide the others' results: one command from the
# repository root,
#   bash benchmarks/gpu_cuda_tests.sh [FILES...]      (default: every tests/test_*.py with cuda tests)
# Each file runs under its own limit (PER_FILE_LIMIT, 150 s) inside DEADLINE
# (540 s from the start), with 8 xdist workers, pytest's summary of failures
# (-rfE) kept even when the limit stops it (SIGINT first).  Prints one line
# per file (passed / failed / skipped / cut) and the failing test ids; the
# logs go to $OUT/cuda_tests.tgz.  BUILD=0 skips the build.  ONE_RUN=1 runs
# the given files in one pytest process instead (one start-up of the workers
# and CUDA, ~14 s saved per file; a hang then cuts them all, under DEADLINE).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/seqfuse-cuda-tests}
LOG=$(mktemp -d /tmp/cuda_tests.XXXX)
mkdir -p "$OUT"
trap 'tar czf "$OUT/cuda_tests.tgz" -C "$LOG" . ; cp "$LOG/summary.txt" "$OUT/" 2>/dev/null' EXIT
start=$(date +%s)
DEADLINE=${DEADLINE:-540}
PER=${PER_FILE_LIMIT:-150}
if [ "${BUILD:-1}" != 0 ]; then
    MAX_JOBS=16 python3 -m pip install -q --no-build-isolation --no-deps --no-index -e . > "$LOG/build.log" 2>&1 \
        || { tail -30 "$LOG/build.log"; echo BUILD FAILED; exit 1; }
    echo "build $(( $(date +%s) - start )) s"
fi
# pytest-xdist and pytest-timeout where installed (the GPU machine has both)
extra=()
python3 -c "import xdist" 2>/dev/null && extra+=(-n 8)
python3 -c "import pytest_timeout" 2>/dev/null && extra+=(--timeout 120)
files=("$@")
[ ${#files[@]} -eq 0 ] && mapfile -t files < <(grep -l "mark.cuda" tests/test_*.py)
status=0
if [ "${ONE_RUN:-0}" = 1 ]; then
    left=$(( DEADLINE - ($(date +%s) - start) ))
    rc=0
    timeout -s INT -k 15 "$left" python3 -m pytest -q -rfE -m cuda -p no:cacheprovider "${extra[@]}" "${files[@]}" \
        > "$LOG/all.log" 2>&1 || rc=$?
    verdict=$(grep -E "passed|failed|skipped|deselected|no tests ran" "$LOG/all.log" | tail -1)
    [ $rc -eq 124 ] || [ $rc -eq 130 ] && verdict="CUT at ${left} s: $verdict"
    echo "all ${#files[@]} files: ${verdict:-exit $rc}" | tee -a "$LOG/summary.txt"
    grep -E "^(FAILED|ERROR) " "$LOG/all.log" | head -40 | tee -a "$LOG/summary.txt"
    [ $rc -eq 0 ] || [ $rc -eq 5 ] || status=1
    files=()
fi
for f in "${files[@]}"; do
    left=$(( DEADLINE - ($(date +%s) - start) ))
    name=$(basename "$f" .py)
    if [ "$left" -lt 20 ]; then echo "$name: not run (deadline)" | tee -a "$LOG/summary.txt"; status=1; continue; fi
    limit=$(( left < PER ? left : PER ))
    rc=0
    timeout -s INT -k 15 "$limit" python3 -m pytest -q -rfE -m cuda -p no:cacheprovider "${extra[@]}" "$f" \
        > "$LOG/$name.log" 2>&1 || rc=$?
    verdict=$(grep -E "^[0-9]+ (passed|failed|skipped|error)|no tests ran|passed|failed" "$LOG/$name.log" | tail -1)
    [ $rc -eq 124 ] || [ $rc -eq 130 ] && verdict="CUT at ${limit} s: $verdict"
    [ $rc -eq 0 ] || [ $rc -eq 5 ] || status=1
    echo "$name: ${verdict:-exit $rc}" | tee -a "$LOG/summary.txt"
    grep -E "^(FAILED|ERROR) " "$LOG/$name.log" | head -20 | tee -a "$LOG/summary.txt"
done
echo "cuda tests status $status, $(( $(date +%s) - start )) s" | tee -a "$LOG/summary.txt"
exit $status
