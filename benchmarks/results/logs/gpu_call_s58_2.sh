#!/usr/bin/env bash
# Session 58, call 2: delayed scaling's weight casts from the amax history (one pass over the weight) against
# casts from the weight's own amax, in one process (fusion_ab.py --switch weight_history) on accelerate()'s FP8
# Llama 1B step and the ESM-2 650M-shape FP8 stack, with the kernels' time; accelerate()'s rows at 4,096 tokens;
# the cuda tests of the weight casts.
# Make .s54/carry/pkg_head.tar.xz: git archive HEAD python/seqfuse | xz > .s54/carry/pkg_head.tar.xz.
# Carry .whl, .s52/carry and .s54/carry:
#   SEQFUSE_GIT_COMMIT=<sha> bash benchmarks/results/logs/gpu_call_s58_2.sh
set -uo pipefail
source benchmarks/gpu_lib.sh  # gpu_prebuilt, run
tar xJf .s54/carry/pkg_head.tar.xz && echo "python/seqfuse from HEAD's archive"
gpu_prebuilt s58 .s52/carry
TAIL=20 run 150 ab_weight_history python3 benchmarks/hf/fusion_ab.py seqfuse_fp8_delayed,stack:esm650 \
  --switch weight_history --seq 4096 --profile --out fusion_ab_weight_history_s58
cp benchmarks/results/fusion_ab_weight_history_s58.json "$LOG/" 2>/dev/null
pack
TAIL=30 run 150 accel4096 python3 benchmarks/hf/bench_accelerate.py --shape llama1b --seq 4096 --steps 20 \
  --rows hf_eager,seqfuse_bf16,seqfuse_fp8_delayed,seqfuse_fp8_delayed_head_fused_adamw,liger \
  --out hf_accelerate_s58_4096 --memory "$LOG/memory"
cp benchmarks/results/hf_accelerate_s58_4096.json "$LOG/" 2>/dev/null
pack
TAIL=8 run 120 cuda_tests python3 -m pytest -q -rfE -m cuda -p no:cacheprovider -n 14 --timeout 110 \
  tests/test_fp8_weight_history.py tests/test_weight_cast_paths.py tests/test_fp8_grouped_cast.py \
  tests/test_linear_save_original_input.py tests/test_fp8_any_rows.py tests/test_scaling.py
exit $status
