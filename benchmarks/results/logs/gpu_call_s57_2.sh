#!/usr/bin/env bash
# Session 57 call 2: after Linear's save_original_input on the fused layers' attention projection (the attention
# output kept once, its FP8 transposed copy made again in the backward) and LayerNormMLP's FP8 backward freeing the
# activation's input gradient before FC1's GEMMs, and the loss's default chunk of 2,048 rows from 8,192 tokens on
# (512 MiB at a 128k vocabulary; 1,024 rows at 4,096 tokens as before) -- accelerate()'s rows at 4,096 and 8,192 tokens with eager
# transformers and Liger-Kernel (compiled transformers and torchao left out: call 1 has them, and this session's
# device time ran short) and each row's memory at its peak (issue 21: FP8 delayed peak memory at most Liger's), then
# where the bf16 and FP8 steps' GPU time goes (--profile: the kernels' summary), then the cuda tests of the
# touched modules.
# Make .s54/carry/pkg_head.tar.xz: git archive HEAD python/seqfuse | xz > .s54/carry/pkg_head.tar.xz.
# Carry .whl, .s52/carry and .s54/carry:
#   SEQFUSE_GIT_COMMIT=<sha> bash benchmarks/results/logs/gpu_call_s57_2.sh
set -uo pipefail
source benchmarks/gpu_lib.sh  # gpu_prebuilt, run
tar xJf .s54/carry/pkg_head.tar.xz && echo "python/seqfuse from HEAD's archive"
gpu_prebuilt s57 .s52/carry
A=hf_eager,seqfuse_bf16,seqfuse_fp8_delayed,liger
TAIL=40 run 160 accel4096 python3 benchmarks/hf/bench_accelerate.py --shape llama1b --seq 4096 --steps 20 \
  --rows $A --out hf_accelerate_s57_4096_call2 --memory "$LOG/memory"
cp benchmarks/results/hf_accelerate_s57_4096_call2.json "$LOG/" 2>/dev/null
pack
TAIL=30 run 120 accel8192 python3 benchmarks/hf/bench_accelerate.py --shape llama1b --seq 8192 --steps 10 \
  --rows $A --out hf_accelerate_s57_8192_call2
cp benchmarks/results/hf_accelerate_s57_8192_call2.json "$LOG/" 2>/dev/null
pack
TAIL=12 run 90 profile4096 python3 benchmarks/hf/bench_accelerate.py --shape llama1b --seq 4096 --steps 5 \
  --rows seqfuse_bf16,seqfuse_fp8_delayed --out hf_accelerate_s57_4096_call2_profiled --profile "$LOG/profile"
pack
TAIL=8 run 120 cuda_tests python3 -m pytest -q -rfE -m cuda -p no:cacheprovider -n 14 --timeout 90 \
  tests/test_linear_save_original_input.py tests/test_linear.py tests/test_fp8_any_rows.py \
  tests/test_layernorm_mlp_fp8_recompute.py tests/test_hf_accelerate_fused.py tests/test_te_api_table.py
exit $status
