#!/usr/bin/env bash
# accelerate() at the Qwen2 1.5B shape (28 layers) and Mistral 7B's layer shape (4 layers), 1 x 4,096 tokens, every
# peer in one process per shape: their FP8 rows were last measured before FP8 weights were cast again after each
# optimizer step (s28), so stale.  The logs are packed after each shape.
# Carry .whl and .s63/carry:  SEQFUSE_GIT_COMMIT=<sha> bash benchmarks/results/logs/gpu_call_s63_3.sh
set -uo pipefail
source benchmarks/gpu_lib.sh  # gpu_prebuilt, run
tar xJf .s63/carry/pkg_head.tar.xz && echo "python/seqfuse from HEAD's archive"
gpu_prebuilt s63 .s63/carry
ROWS=hf_eager,hf_compile,seqfuse_bf16,seqfuse_fp8_delayed,torchao_float8,liger
for shape in qwen2_1.5b mistral; do
  TAIL=30 run 280 "accel_$shape" python3 benchmarks/hf/bench_accelerate.py --shape "$shape" --seq 4096 --steps 8 \
    --out "hf_accelerate_s63_${shape}_4096" --rows "$ROWS"
  cp "benchmarks/results/hf_accelerate_s63_${shape}_4096.json" "$LOG/" 2>/dev/null
  pack
done
exit $status
