#!/usr/bin/env bash
# Written in session 57 for the next session (its device time was spent): what s57 left unmeasured --
# save_original_input's speed cost on accelerate()'s FP8 step (an in-process A/B, fusion_ab.py, with the kernels'
# time), the FP8-head row's memory at 8,192 tokens now that the loss's chunk budget counts the gradient's FP8 copies,
# and the cuda tests of the loss.
# Make .s54/carry/pkg_head.tar.xz: git archive HEAD python/seqfuse | xz > .s54/carry/pkg_head.tar.xz.
# Carry .whl, .s52/carry and .s54/carry:
#   SEQFUSE_GIT_COMMIT=<sha> bash benchmarks/results/logs/gpu_call_s58_1_not_run.sh
set -uo pipefail
source benchmarks/gpu_lib.sh  # gpu_prebuilt, run
tar xJf .s54/carry/pkg_head.tar.xz && echo "python/seqfuse from HEAD's archive"
gpu_prebuilt s58 .s52/carry
TAIL=16 run 120 ab_save_original python3 benchmarks/hf/fusion_ab.py seqfuse_fp8_delayed \
  --switch save_original_input --seq 4096 --profile --out fusion_ab_save_original_input_s58
cp benchmarks/results/fusion_ab_save_original_input_s58.json "$LOG/" 2>/dev/null
pack
TAIL=30 run 120 accel8192 python3 benchmarks/hf/bench_accelerate.py --shape llama1b --seq 8192 --steps 10 \
  --rows hf_eager,seqfuse_fp8_delayed,seqfuse_fp8_delayed_head_fused_adamw,liger --out hf_accelerate_s58_8192 \
  --memory "$LOG/memory"
cp benchmarks/results/hf_accelerate_s58_8192.json "$LOG/" 2>/dev/null
pack
TAIL=8 run 90 cuda_tests python3 -m pytest -q -rfE -m cuda -p no:cacheprovider -n 14 --timeout 90 \
  tests/test_cross_entropy.py tests/test_linear_save_original_input.py
exit $status
