#!/usr/bin/env bash
# Session 59, call 1: where accelerate()'s FP8 delayed step (Llama 1B shape, 1 x 4,096 tokens) spends its time now:
# a profile of two steps with the trace kept (SEQFUSE_PROFILE_TRACE: every kernel with the host ops that launched
# it, read on the development machine), and host_forward.py (host issue time against the GPU's, unprofiled).
# Carry .whl, .s58/carry and .s54/carry (pkg_head.tar.xz: git archive HEAD python/seqfuse | xz):
#   SEQFUSE_GIT_COMMIT=<sha> bash benchmarks/results/logs/gpu_call_s59_1.sh
set -uo pipefail
source benchmarks/gpu_lib.sh  # gpu_prebuilt, run
tar xJf .s54/carry/pkg_head.tar.xz && echo "python/seqfuse from HEAD's archive"
gpu_prebuilt s59 .s58/carry
mkdir -p "$LOG/profile"
SEQFUSE_PROFILE_TRACE=1 TAIL=12 run 200 accel_profile python3 benchmarks/hf/bench_accelerate.py --shape llama1b \
  --seq 4096 --steps 10 --rows hf_eager,seqfuse_fp8_delayed,seqfuse_bf16 --profile "$LOG/profile" \
  --out hf_accelerate_s59_4096_profiled
cp benchmarks/results/hf_accelerate_s59_4096_profiled.json "$LOG/" 2>/dev/null
TAIL=40 run 150 host_forward python3 benchmarks/hf/host_forward.py --rows seqfuse_fp8_delayed,seqfuse_bf16 --steps 8
exit $status
