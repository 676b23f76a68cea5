#!/usr/bin/env bash
# Session 61, call 1: accelerate() at the Llama 3.2 1B shape, 1 x 4,096
# tokens, with every peer in one process: eager and compiled transformers, torchao's float8 on compiled layers,
# Liger-Kernel; seqfuse bf16, FP8 delayed, and FP8 delayed stepping seqfuse's FusedAdamW (torch AdamW's update);
# then check_cast on session 60's final kernels (the approximate sigmoid, the K-split SwiGLU backward; its call 5
# run passed its limit unchecked).
# Carry .whl (torchao 0.18.0, liger-kernel), .s61/carry (lib312.tar.xz, checks.tar.xz, pkg_head.tar.xz):
#   SEQFUSE_GIT_COMMIT=<sha> bash benchmarks/results/logs/gpu_call_s61_1.sh
set -uo pipefail
source benchmarks/gpu_lib.sh  # gpu_prebuilt, run
tar xJf .s61/carry/pkg_head.tar.xz && echo "python/seqfuse from HEAD's archive"
gpu_prebuilt s61 .s61/carry
TAIL=40 run 330 accel4096 python3 benchmarks/hf/bench_accelerate.py --shape llama1b --seq 4096 --steps 12 \
  --rows hf_eager,hf_compile,seqfuse_bf16,seqfuse_fp8_delayed,seqfuse_fp8_delayed_fused_adamw,torchao_float8,liger\
  --out hf_accelerate_s61_4096_all
cp benchmarks/results/hf_accelerate_s61_4096_all.json "$LOG/" 2>/dev/null
TAIL=4 run 150 check_cast bin/check_quant_cast
exit $status
