#!/usr/bin/env bash
# The Llama 3 FP8 convergence check (issue 16), one command from the
# repository root on the GPU machine: build, the cuda test of
# tests/test_llama3_fp8_convergence.py (seqfuse's FP8 gradients against the
# plain-torch emulation, bf16), then bench_llama3_convergence.py: one-step
# gradients per parameter, and training rows (seqfuse bf16, FP8 delayed, FP8
# block, the one-ulp control, the emulated FP8) of a 25M-parameter Llama on
# real genome windows, warm-up + cosine, within a 130 s budget.  About 4
# minutes in all on one H200 (build 60-80 s).  Logs, JSON and PNG come back
# in $OUT (llama3_convergence_run.tgz and the JSON).
#
# Data: carry benchmarks/llama3/data (git-ignored; make_bench_data.py); without
# it the run falls back to the committed lambda-phage subset and says so.
#   SEQFUSE_GIT_COMMIT=<sha> bash benchmarks/llama3/gpu_llama3_convergence.sh
# Knobs: TEST_LIMIT CONV_LIMIT (seconds), CONV_ARGS (extra script arguments).
# Exit status 1 when the test or the script fails (the script's own status,
# in its log's last line: 1 the gradient rule failed, 2 a training bound
# failed, 3 both).
set -uo pipefail
cd "$(dirname "$0")/../.."
pack() { cp "$ROOT"/benchmarks/results/llama3_convergence.{json,png} "$LOG/" 2>/dev/null
         tar czf "$OUT/llama3_convergence_run.tgz" -C "$LOG" .; cp "$LOG"/*.json "$OUT/" 2>/dev/null; }
source benchmarks/gpu_lib.sh  # gpu_setup, gpu_build, run
gpu_setup llama3_convergence
STOP_SIGNAL=TERM
ls -la benchmarks/llama3/data 2>/dev/null || echo "benchmarks/llama3/data not carried: the run falls back to the committed subset"
start=$(date +%s)
gpu_build
TAIL=10 run ${TEST_LIMIT:-60} pytest python3 -m pytest -q -m cuda -p no:cacheprovider --timeout 50 -rfEs \
    tests/test_llama3_fp8_convergence.py
TAIL=60 run ${CONV_LIMIT:-160} convergence python3 benchmarks/llama3/bench_llama3_convergence.py --device cuda \
    --size small --seq-len 2048 --batch-size 4 --steps 600 --warmup 60 --lr 1e-3 --window 100 \
    --time-budget 130 ${CONV_ARGS:-}
echo "gpu_llama3_convergence status $status, $(( $(date +%s) - start )) s"
exit $status
