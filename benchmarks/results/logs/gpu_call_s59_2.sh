#!/usr/bin/env bash
# Session 59, call 2: accelerate()'s rows at 8,192 tokens with eager transformers and Liger in the same process,
# then issue 16's Llama 1B recipe rows (the one-pass SwiGLU runs in its FP8 LayerNormMLPs; s52's call 3 command,
# transformers eager and compiled in the same process).
# Carry .whl, .s59/carry and .s54/carry (see gpu_call_s59_1.sh):
#   SEQFUSE_GIT_COMMIT=<sha> bash benchmarks/results/logs/gpu_call_s59_2.sh
set -uo pipefail
source benchmarks/gpu_lib.sh  # gpu_prebuilt, run
tar xJf .s54/carry/pkg_head.tar.xz && echo "python/seqfuse from HEAD's archive"
gpu_prebuilt s59 .s59/carry
TAIL=24 run 220 accel8192 python3 benchmarks/hf/bench_accelerate.py --shape llama1b --seq 8192 --steps 10 \
  --rows hf_eager,seqfuse_fp8_delayed,seqfuse_bf16,liger --out hf_accelerate_s59_8192
cp benchmarks/results/hf_accelerate_s59_8192.json "$LOG/" 2>/dev/null
STOP_SIGNAL=TERM TAIL=14 run 300 llama_train python3 benchmarks/llama3/bench_llama3.py --size 1B --parts train \
    --batch-size 4 --steps 3 --warm-passes 1 --rows hf_bf16,seqfuse_bf16_packed,seqfuse_fp8_delayed_packed,hf_bf16_compiled \
    --out llama3_s59
cp benchmarks/results/llama3_s59.json "$LOG/" 2>/dev/null
exit $status
