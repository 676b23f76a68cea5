#!/usr/bin/env bash
# accelerate() at the Llama 3.2 1B shape with every peer in one process at 1 x 4,096 tokens (eager and compiled
# transformers, torchao's float8 on compiled layers, Liger-Kernel; seqfuse bf16 and FP8 delayed); then the checks of
# e2517ec's kernels (check_cast with FP8 codes compared by place on the number line, the Hopper attention forward
# and grouped GEMM after sf_sm90_kernel_fit's device mend); then FP8 delayed and bf16 profiled (bench_accelerate
# --profile), and the FP8 step once more with Python stacks (what launches its memsets).  The logs are packed
# after each part (a call cut at its limit keeps what ran).
# Carry .whl (torchao 0.18.0, liger-kernel 0.8.5) and .s63/carry (lib312.tar.xz, checks.tar.xz, pkg_head.tar.xz):
#   SEQFUSE_GIT_COMMIT=<sha> bash benchmarks/results/logs/gpu_call_s63_1.sh
set -uo pipefail
source benchmarks/gpu_lib.sh  # gpu_prebuilt, run
tar xJf .s63/carry/pkg_head.tar.xz && echo "python/seqfuse from HEAD's archive"
gpu_prebuilt s63 .s63/carry
B="python3 benchmarks/hf/bench_accelerate.py --shape llama1b"
TAIL=40 run 240 accel4096 $B --seq 4096 --steps 12 --out hf_accelerate_s63_4096_all \
  --rows hf_eager,hf_compile,seqfuse_bf16,seqfuse_fp8_delayed,seqfuse_fp8_delayed_fused_adamw,torchao_float8,liger
cp benchmarks/results/hf_accelerate_s63_4096_all.json "$LOG/" 2>/dev/null
pack
TAIL=6 run 120 check_cast bin/check_quant_cast
TAIL=6 run 40 check_attn_sm90 bin/check_attn_attn_sm90
TAIL=6 run 40 check_grouped_sm90 bin/check_grouped_sm90
pack
mkdir -p "$LOG/profile"
TAIL=12 run 130 accel_profile $B --seq 4096 --steps 8 \
  --rows seqfuse_fp8_delayed,seqfuse_bf16 --profile "$LOG/profile" --out hf_accelerate_s63_4096_profile
cp benchmarks/results/hf_accelerate_s63_4096_profile.json "$LOG/" 2>/dev/null
pack
TAIL=8 run 100 accel_stacks $B --seq 4096 --steps 3 --rows seqfuse_fp8_delayed --profile "$LOG/profile" \
  --profile-steps 1 --profile-stacks --out hf_accelerate_s63_4096_stacks
pack
exit $status
