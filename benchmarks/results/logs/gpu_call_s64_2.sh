#!/usr/bin/env bash
# Session 64's second GPU call: accelerate() on Llama 1B at 1 x 4,096 and 1 x 8,192 tokens, every peer in one
# process per length (transformers eager and compiled, torchao float8, Liger-Kernel alone and with every decoder
# layer compiled: the liger_compile row, new), seqfuse bf16 and FP8 delayed with split_qkv_rope in one launch.
# TUNE=1 runs seqfuse's rows with SEQFUSE_GEMM_TUNE=1 (the loss's weight-gradient sum tuned).
# Carry .whl and .s64/carry:  SEQFUSE_GIT_COMMIT=<sha> [TUNE=1] bash benchmarks/results/logs/gpu_call_s64_2.sh
set -uo pipefail
source benchmarks/gpu_lib.sh  # gpu_prebuilt, run
gpu_prebuilt s64b .s64/carry
ROWS=hf_eager,hf_compile,seqfuse_bf16,seqfuse_fp8_delayed,torchao_float8,liger,liger_compile
TAIL=30 run 240 accel4096 env SEQFUSE_GEMM_TUNE=${TUNE:-0} python3 benchmarks/hf/bench_accelerate.py \
  --shape llama1b --seq 4096 --steps 12 --out hf_accelerate_s64_4096_all --rows $ROWS
cp benchmarks/results/hf_accelerate_s64_4096_all.json "$LOG/" 2>/dev/null
pack
TAIL=30 run 260 accel8192 env SEQFUSE_GEMM_TUNE=${TUNE:-0} python3 benchmarks/hf/bench_accelerate.py \
  --shape llama1b --seq 8192 --steps 5 --out hf_accelerate_s64_8192_all --rows $ROWS
cp benchmarks/results/hf_accelerate_s64_8192_all.json "$LOG/" 2>/dev/null
exit $status
