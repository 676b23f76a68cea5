#!/usr/bin/env bash
# Session 62, call 2: check_cast with 10c6e5a's comparison of FP8 codes by their place on the number line (call 1's
# run: 861 passed, 1 failed, in the float32 K-split SwiGLU backward's FP8 copies), then where accelerate()'s FP8 step
# at 4,096 tokens spends the 2.3 ms its kernels leave idle (call 1: 57.70 ms a step, s60's kernels 55.4): the FP8
# delayed and bf16 rows profiled (bench_accelerate --profile: host issue time, GPU idle gaps by what ends them,
# the synchronizing calls' stacks).
# Carry .whl and .s62/carry (lib312.tar.xz, checks.tar.xz, pkg_head.tar.xz):
#   SEQFUSE_GIT_COMMIT=<sha> bash benchmarks/results/logs/gpu_call_s62_2.sh
set -uo pipefail
source benchmarks/gpu_lib.sh  # gpu_prebuilt, run
tar xJf .s62/carry/pkg_head.tar.xz && echo "python/seqfuse from HEAD's archive"
gpu_prebuilt s62 .s62/carry
TAIL=6 run 110 check_cast bin/check_quant_cast
pack
mkdir -p "$LOG/profile"
TAIL=12 run 200 accel_profile python3 benchmarks/hf/bench_accelerate.py --shape llama1b --seq 4096 --steps 8 \
  --rows seqfuse_fp8_delayed,seqfuse_bf16 --profile "$LOG/profile" --out hf_accelerate_s62_4096_profile
cp benchmarks/results/hf_accelerate_s62_4096_profile.json "$LOG/" 2>/dev/null
pack
exit $status
