#!/usr/bin/env bash
# check_cast (its FP8 codes compared by their place on the number line), then accelerate()'s FP8 delayed and bf16
# steps at 4,096 tokens profiled (bench_accelerate --profile: host issue time, GPU idle gaps by what ends them, the
# synchronizing calls' stacks): where the step's time beyond its kernels goes.
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
