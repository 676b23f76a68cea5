#!/usr/bin/env bash
# accelerate() at the Llama 3.2 1B shape with every peer in one process per length: eager and compiled
# transformers, torchao's float8 on compiled layers, Liger-Kernel; seqfuse bf16 and FP8 delayed (at 4,096 tokens
# also FP8 delayed stepping seqfuse's FusedAdamW set to torch AdamW's update); 1 x 4,096 tokens; then check_cast on
# session 60's final kernels (the approximate sigmoid, the K-split SwiGLU backward); then the same peers at 1 x 8,192
# tokens, as far as the device time goes.  The logs are packed after each part (a call cut at its limit keeps what
# ran).
# Carry .whl (torchao 0.18.0, liger-kernel), .s62/carry (lib312.tar.xz, checks.tar.xz, pkg_head.tar.xz):
#   SEQFUSE_GIT_COMMIT=<sha> bash benchmarks/results/logs/gpu_call_s62_1.sh
set -uo pipefail
source benchmarks/gpu_lib.sh  # gpu_prebuilt, run
tar xJf .s62/carry/pkg_head.tar.xz && echo "python/seqfuse from HEAD's archive"
gpu_prebuilt s62 .s62/carry
B="python3 benchmarks/hf/bench_accelerate.py --shape llama1b"
TAIL=40 run 250 accel4096 $B --seq 4096 --steps 12 --out hf_accelerate_s62_4096_all \
  --rows hf_eager,hf_compile,seqfuse_bf16,seqfuse_fp8_delayed,seqfuse_fp8_delayed_fused_adamw,torchao_float8,liger
cp benchmarks/results/hf_accelerate_s62_4096_all.json "$LOG/" 2>/dev/null
pack
TAIL=4 run 45 check_cast bin/check_quant_cast
pack
TAIL=40 run 170 accel8192 $B --seq 8192 --steps 5 --out hf_accelerate_s62_8192_all \
  --rows hf_eager,hf_compile,seqfuse_bf16,seqfuse_fp8_delayed,torchao_float8,liger
cp benchmarks/results/hf_accelerate_s62_8192_all.json "$LOG/" 2>/dev/null
pack
exit $status
