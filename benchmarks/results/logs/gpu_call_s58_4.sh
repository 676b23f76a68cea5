#!/usr/bin/env bash
# Session 58, call 4: delayed scaling's weight casts with the history's scale as the default (where the history
# describes the weight; fp8_weight_history = False for the own-amax rows): the cuda tests of the weight casts, the
# graphs and the fused layers; accelerate()'s rows at 4,096 tokens with every peer and at 8,192.
# Carry .whl, .s58/carry (the extension built here: see gpu_call_s58_3.sh) and .s54/carry (HEAD's package:
# git archive HEAD python/seqfuse | xz > .s54/carry/pkg_head.tar.xz):
#   SEQFUSE_GIT_COMMIT=<sha> bash benchmarks/results/logs/gpu_call_s58_4.sh
set -uo pipefail
source benchmarks/gpu_lib.sh  # gpu_prebuilt, run
tar xJf .s54/carry/pkg_head.tar.xz && echo "python/seqfuse from HEAD's archive"
gpu_prebuilt s58 .s58/carry
TAIL=10 run 150 cuda_tests python3 -m pytest -q -rfE -m cuda -p no:cacheprovider -n 14 --timeout 140 \
  tests/test_fp8_weight_history.py tests/test_fp8_any_rows.py tests/test_weight_cast_paths.py tests/test_linear.py \
  tests/test_hf_accelerate_fused.py tests/test_scaling.py tests/test_moe_modules.py tests/test_cross_entropy.py
TAIL=30 run 300 accel4096 python3 benchmarks/hf/bench_accelerate.py --shape llama1b --seq 4096 --steps 20 \
  --rows hf_eager,hf_compile,seqfuse_bf16,seqfuse_fp8_delayed,seqfuse_fp8_delayed_own_amax,seqfuse_fp8_delayed_head_fused_adamw,torchao_float8,liger \
  --out hf_accelerate_s58_4096_default --memory "$LOG/memory"
cp benchmarks/results/hf_accelerate_s58_4096_default.json "$LOG/" 2>/dev/null
pack
TAIL=24 run 130 accel8192 python3 benchmarks/hf/bench_accelerate.py --shape llama1b --seq 8192 --steps 10 \
  --rows hf_eager,seqfuse_fp8_delayed,seqfuse_fp8_delayed_head_fused_adamw,liger \
  --out hf_accelerate_s58_8192_default --memory "$LOG/memory"
cp benchmarks/results/hf_accelerate_s58_8192_default.json "$LOG/" 2>/dev/null
exit $status
