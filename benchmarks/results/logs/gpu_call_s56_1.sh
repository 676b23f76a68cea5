#!/usr/bin/env bash
# Written in session 55, run in session 56 (call 1, on an H100, at 41b645f: logs/s56_call1_41b645f/): the FP8 weight cache
# keeping W^T alone in training (the forward operand in a transient buffer: set_weight_rowwise_cache, the new
# default) on a GPU -- the cuda tests of the FP8 modules (the new
# ones in tests/test_fp8_any_rows.py included), bench_fp8_weight_transpose.py's three cache layouts at the Llama 1B
# (accelerate) and ESM-2 650M-stack shapes (step time and peak memory, one process), and accelerate()'s FP8 rows at
# 4,096 tokens with their peers, to set beside s55's call 1 (which ran the package before this change), with each
# row's memory by phase of a step and what is live at its peak (bench_accelerate.py --memory, benchmarks/memory_peak.py).
# Make .s54/carry/pkg_head.tar.xz: git archive HEAD python/seqfuse | xz > .s54/carry/pkg_head.tar.xz.
# Carry .whl, .s52/carry and .s54/carry:
#   SEQFUSE_GIT_COMMIT=<sha> bash benchmarks/results/logs/gpu_call_s56_1.sh
set -uo pipefail
source benchmarks/gpu_lib.sh  # gpu_prebuilt, run
tar xJf .s54/carry/pkg_head.tar.xz && echo "python/seqfuse from HEAD's archive"
gpu_prebuilt s55 .s52/carry
TAIL=8 run 90 cuda_tests python3 -m pytest -q -rfE -m cuda -p no:cacheprovider -n 14 --timeout 120 \
  tests/test_fp8_any_rows.py tests/test_weight_cast_paths.py tests/test_linear.py tests/test_graphs_first_step.py \
  tests/test_layernorm_mlp_fp8_recompute.py tests/test_scaling.py tests/test_cross_entropy.py
pack
TAIL=12 run 120 weight_cache bash -c "python3 benchmarks/bench_fp8_weight_transpose.py --rows llama1b,esm650 \
  --rounds 4 --out fp8_weight_cache_s56 && cp benchmarks/results/fp8_weight_cache_s56.json $LOG/"
pack
A=hf_eager,seqfuse_bf16,seqfuse_fp8_delayed,seqfuse_fp8_delayed_recompute,seqfuse_fp8_delayed_fused_adamw
A=$A,seqfuse_fp8_delayed_head_fused_adamw,liger
TAIL=30 run 150 accel4096 python3 benchmarks/hf/bench_accelerate.py --shape llama1b --seq 4096 --steps 20 \
  --rows $A --out hf_accelerate_s56_4096_lean --memory "$LOG/memory"
cp benchmarks/results/hf_accelerate_s56_4096_lean.json "$LOG/" 2>/dev/null
pack
head -n 40 "$LOG"/memory/*seqfuse_fp8_delayed_memory.txt "$LOG"/memory/*liger_memory.txt 2>/dev/null
TAIL=16 run 100 accel8192 python3 benchmarks/hf/bench_accelerate.py --shape llama1b --seq 8192 --steps 10 \
  --rows hf_eager,seqfuse_bf16,seqfuse_fp8_delayed,seqfuse_fp8_delayed_recompute,liger --out hf_accelerate_s56_8192_lean
cp benchmarks/results/hf_accelerate_s56_8192_lean.json "$LOG/" 2>/dev/null
exit $status
