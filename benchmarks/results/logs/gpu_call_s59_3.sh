#!/usr/bin/env bash
# Session 59, call 3: accelerate()'s FP8 delayed row at 4,096 tokens on the session's final code (the tied
# embedding's gradient path; LayerNormMLP's one-pass SwiGLU taken out after call 1) with eager transformers in the
# same process (the device time left allows no more rows), then the tied embedding's in-process A/B on that code.
# Carry .whl, .s59/carry and .s54/carry (see gpu_call_s59_1.sh):
#   SEQFUSE_GIT_COMMIT=<sha> bash benchmarks/results/logs/gpu_call_s59_3.sh
set -uo pipefail
source benchmarks/gpu_lib.sh  # gpu_prebuilt, run
tar xJf .s54/carry/pkg_head.tar.xz && echo "python/seqfuse from HEAD's archive"
gpu_prebuilt s59 .s59/carry
TAIL=24 run 120 accel4096 python3 benchmarks/hf/bench_accelerate.py --shape llama1b --seq 4096 --steps 12 \
  --rows hf_eager,seqfuse_fp8_delayed --out hf_accelerate_s59_4096_final
cp benchmarks/results/hf_accelerate_s59_4096_final.json "$LOG/" 2>/dev/null
TAIL=14 run 110 ab_tied python3 benchmarks/hf/fusion_ab.py seqfuse_fp8_delayed --switch tied_embedding \
  --seq 4096 --rounds 4 --profile --out fusion_ab_tied_embedding_s59_final
cp benchmarks/results/fusion_ab_tied_embedding_s59_final.json "$LOG/" 2>/dev/null
exit $status
