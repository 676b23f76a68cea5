#!/usr/bin/env bash
# Session 58, call 5: the history scale as the default against fp8_weight_history = False at HEAD, in one process
# (fusion_ab.py --switch weight_history, kernel time and interleaved rounds), and accelerate()'s FP8 rows again at
# 4,096 tokens (call 4's later rows ran slow).
# Carry .whl, .s58/carry and .s54/carry (see gpu_call_s58_4.sh):
#   SEQFUSE_GIT_COMMIT=<sha> bash benchmarks/results/logs/gpu_call_s58_5.sh
set -uo pipefail
source benchmarks/gpu_lib.sh  # gpu_prebuilt, run
tar xJf .s54/carry/pkg_head.tar.xz && echo "python/seqfuse from HEAD's archive"
gpu_prebuilt s58 .s58/carry
TAIL=14 run 120 ab_weight_history python3 benchmarks/hf/fusion_ab.py seqfuse_fp8_delayed \
  --switch weight_history --seq 4096 --profile --out fusion_ab_weight_history_default_s58
cp benchmarks/results/fusion_ab_weight_history_default_s58.json "$LOG/" 2>/dev/null
pack
TAIL=24 run 150 accel4096 python3 benchmarks/hf/bench_accelerate.py --shape llama1b --seq 4096 --steps 20 \
  --rows hf_eager,seqfuse_fp8_delayed,seqfuse_fp8_delayed_own_amax,seqfuse_fp8_delayed_head_fused_adamw,liger \
  --out hf_accelerate_s58_4096_again
cp benchmarks/results/hf_accelerate_s58_4096_again.json "$LOG/" 2>/dev/null
exit $status
