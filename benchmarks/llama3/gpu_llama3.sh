#!/usr/bin/env bash
# The Llama 3 GPU run (issue 16), one command from the repository root on the
# GPU machine: build, the cuda tests of the Llama family, then the benchmark:
# training rows of Llama 3.2 1B's shape at 8,192 tokens per sequence on real
# genome windows (transformers sdpa bf16 eager, seqfuse bf16 padded/packed,
# FP8 delayed, FP8 block, then transformers under torch.compile last), and
# generate() at batch 1 and 32 for 512-token prompts (transformers static
# cache eager, seqfuse, then transformers' auto-compiled static cache last).
# Each step has its own time limit (the whole run about 6-7 minutes on one
# H200); a row cut short by its limit leaves the rows before it in the
# partial JSON.  Logs and result JSON/PNG are packed into $OUT/llama3_run.tgz
# (and the JSONs copied to $OUT).
#
# Data: benchmarks/llama3/data/train_8192.parquet (make_bench_data.py, run
# where recipes/llama3/data/full is prepared; git-ignored, carry
# benchmarks/llama3/data).  Without it the benchmark falls back to the
# committed lambda-phage subset and says so in its log and JSON.
#   SEQFUSE_GIT_COMMIT=<sha> bash benchmarks/llama3/gpu_llama3.sh
# Knobs: TEST_LIMIT TRAIN_LIMIT DECODE_LIMIT (seconds), TRAIN_ARGS /
# DECODE_ARGS (extra bench_llama3.py arguments, e.g. --rows ... / --decode-rows ...).
# The train step exits 2 when a row's loss at some step is off transformers'
# beyond its recipe's tolerance (bench_llama3.py LOSS_TOL); that row's speed
# ratios are then WITHHELD in the log and the JSON.
set -uo pipefail
cd "$(dirname "$0")/../.."
pack() { cp "$ROOT"/benchmarks/results/llama3{,_decode}.{json,png} "$LOG/" 2>/dev/null
         tar czf "$OUT/llama3_run.tgz" -C "$LOG" .; cp "$LOG"/*.json "$OUT/" 2>/dev/null; }
source benchmarks/gpu_lib.sh  # gpu_setup, gpu_build, run
gpu_setup llama3
STOP_SIGNAL=TERM  # a step at its limit is stopped at once
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
ls -la benchmarks/llama3/data 2>/dev/null || echo "benchmarks/llama3/data not carried: the benchmark falls back to the committed subset"
start=$(date +%s)
gpu_build
TAIL=15 run ${TEST_LIMIT:-90} pytest python3 -m pytest -q -m cuda -p no:cacheprovider -n 3 --timeout 80 -rfEs \
    tests/test_hf_llama.py tests/test_hf_llama_generate.py
TAIL=30 run ${TRAIN_LIMIT:-170} train python3 benchmarks/llama3/bench_llama3.py --size 1B --parts train \
    --batch-size 4 --steps 3 --warm-passes 1 ${TRAIN_ARGS:-}
TAIL=25 run ${DECODE_LIMIT:-150} decode python3 benchmarks/llama3/bench_llama3.py --size 1B --parts decode \
    --decode-batches 1,32 --prompt-len 512 --new-tokens 128 --decode-repeats 2 ${DECODE_ARGS:-}
echo "gpu_llama3 status $status, $(( $(date +%s) - start )) s"
exit $status
