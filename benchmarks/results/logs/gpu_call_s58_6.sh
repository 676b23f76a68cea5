#!/usr/bin/env bash
# Session 58, call 6: issue 16's Llama 3.2 1B training rows (the seqfuse Llama family, 4 x 8,192 committed
# lambda-phage windows, packed) with this session's FP8 defaults (the weights' history scale, the loss's skipped
# gradient multiply), transformers eager and compiled in the same process (s52's call 3 command).
# Carry .whl, .s58/carry and .s54/carry (see gpu_call_s58_4.sh):
#   SEQFUSE_GIT_COMMIT=<sha> bash benchmarks/results/logs/gpu_call_s58_6.sh
set -uo pipefail
source benchmarks/gpu_lib.sh  # gpu_prebuilt, run
tar xJf .s54/carry/pkg_head.tar.xz && echo "python/seqfuse from HEAD's archive"
gpu_prebuilt s58 .s58/carry
STOP_SIGNAL=TERM TAIL=14 run 300 llama_train python3 benchmarks/llama3/bench_llama3.py --size 1B --parts train \
    --batch-size 4 --steps 3 --warm-passes 1 --rows hf_bf16,seqfuse_bf16_packed,seqfuse_fp8_delayed_packed,hf_bf16_compiled \
    --out llama3_s58
cp benchmarks/results/llama3_s58.json "$LOG/" 2>/dev/null
exit $status
