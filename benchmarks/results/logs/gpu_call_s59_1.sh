#!/usr/bin/env bash
# Session 59, call 1: the tied embedding's gradient added into the fused loss's head gradient (csrc/embed) and
# LayerNormMLP's one-pass FP8 SwiGLU (the grouped MLP's kernels with one group): the embed check (CUDA bits
# against the CPU reference, then its time at Llama 1B's head), the cuda tests of both, an in-process A/B of
# accelerate()'s FP8 step for each (fusion_ab.py: kernel time and interleaved rounds), and accelerate()'s rows
# at 4,096 tokens with eager transformers and Liger in the same process.
# Carry .whl, .s59/carry (lib312.tar.xz, checks.tar.xz) and .s54/carry (pkg_head.tar.xz: git archive HEAD
# python/seqfuse | xz):
#   SEQFUSE_GIT_COMMIT=<sha> bash benchmarks/results/logs/gpu_call_s59_1.sh
set -uo pipefail
source benchmarks/gpu_lib.sh  # gpu_prebuilt, run
tar xJf .s54/carry/pkg_head.tar.xz && echo "python/seqfuse from HEAD's archive"
gpu_prebuilt s59 .s59/carry
TAIL=12 run 60 check_embed bin/check_embed_embed
TAIL=6 run 90 cuda_tests python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_tied_embedding.py \
  tests/test_layernorm_mlp_fp8_recompute.py tests/test_layernorm_modules.py -k "tied or embedding or recompute or one_pass or activation_gradient"
TAIL=14 run 120 ab_one_pass python3 benchmarks/hf/fusion_ab.py seqfuse_fp8_delayed --switch one_pass_swiglu \
  --seq 4096 --rounds 4 --profile --out fusion_ab_one_pass_swiglu_s59
cp benchmarks/results/fusion_ab_*_s59.json "$LOG/" 2>/dev/null
TAIL=24 run 150 accel4096 python3 benchmarks/hf/bench_accelerate.py --shape llama1b --seq 4096 --steps 12 \
  --rows hf_eager,seqfuse_bf16,seqfuse_fp8_delayed,liger --out hf_accelerate_s59_4096
cp benchmarks/results/hf_accelerate_s59_4096.json "$LOG/" 2>/dev/null
TAIL=14 run 130 ab_tied python3 benchmarks/hf/fusion_ab.py seqfuse_fp8_delayed --switch tied_embedding \
  --seq 4096 --rounds 4 --profile --out fusion_ab_tied_embedding_s59
cp benchmarks/results/fusion_ab_*_s59.json "$LOG/" 2>/dev/null
exit $status
