#!/usr/bin/env bash
# Session 60, call 2: the grouped SwiGLU backward with its K tiles split among CTAs where no probability gradient
# is asked (csrc/quant/cast_cuda.cu), and LayerNormMLP's one-pass FP8 SwiGLU on it again: check_cast (CUDA
# against the CPU reference; its time at Llama 1B's MLP), the cuda tests, the in-process A/B of accelerate()'s FP8
# step, accelerate()'s FP8 row beside eager transformers at 4,096 tokens, then session 59's unrun embed check and
# the tied A/B.
# Carry .whl, .s60/carry (lib312.tar.xz, checks.tar.xz) and .s54/carry (pkg_head.tar.xz: git archive HEAD
# python/seqfuse | xz):
#   SEQFUSE_GIT_COMMIT=<sha> bash benchmarks/results/logs/gpu_call_s60_2.sh
set -uo pipefail
source benchmarks/gpu_lib.sh  # gpu_prebuilt, run
tar xJf .s54/carry/pkg_head.tar.xz && echo "python/seqfuse from HEAD's archive"
gpu_prebuilt s60 .s60/carry
TAIL=12 run 150 check_cast bin/check_quant_cast
TAIL=14 run 120 ab_one_pass python3 benchmarks/hf/fusion_ab.py seqfuse_fp8_delayed --switch one_pass_swiglu \
  --seq 4096 --rounds 4 --profile --out fusion_ab_one_pass_swiglu_s60
cp benchmarks/results/fusion_ab_one_pass_swiglu_s60.json "$LOG/" 2>/dev/null
TAIL=6 run 120 cuda_tests python3 -m pytest -q -m cuda -p no:cacheprovider -n 4 tests/test_swiglu_backward_cast_grouped.py \
  tests/test_tied_embedding.py tests/test_layernorm_mlp_fp8_recompute.py tests/test_layernorm_modules.py \
  -k "grouped or tied or embedding or recompute or one_pass or activation_gradient"
TAIL=24 run 120 accel4096 python3 benchmarks/hf/bench_accelerate.py --shape llama1b --seq 4096 --steps 12 \
  --rows hf_eager,seqfuse_fp8_delayed --out hf_accelerate_s60_4096
cp benchmarks/results/hf_accelerate_s60_4096.json "$LOG/" 2>/dev/null
TAIL=14 run 40 check_embed bin/check_embed_embed
exit $status
