#!/usr/bin/env bash
# Session 60, call 1: session 59's final code on the GPU (none of it had run there): the embed check with its
# vocabulary-of-16 case, the tied embedding's cuda tests, accelerate()'s FP8 delayed row at 4,096 tokens beside
# eager transformers in the same process, then the tied embedding's in-process A/B.
# Carry .whl, .s60/carry (lib312.tar.xz, checks.tar.xz) and .s54/carry (pkg_head.tar.xz: git archive HEAD
# python/seqfuse | xz):
#   SEQFUSE_GIT_COMMIT=<sha> bash benchmarks/results/logs/gpu_call_s60_1.sh
set -uo pipefail
source benchmarks/gpu_lib.sh  # gpu_prebuilt, run
tar xJf .s54/carry/pkg_head.tar.xz && echo "python/seqfuse from HEAD's archive"
gpu_prebuilt s60 .s60/carry
TAIL=14 run 60 check_embed bin/check_embed_embed
TAIL=6 run 90 cuda_tests python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_tied_embedding.py
TAIL=24 run 130 accel4096 python3 benchmarks/hf/bench_accelerate.py --shape llama1b --seq 4096 --steps 12 \
  --rows hf_eager,seqfuse_fp8_delayed --out hf_accelerate_s60_4096
cp benchmarks/results/hf_accelerate_s60_4096.json "$LOG/" 2>/dev/null
TAIL=14 run 120 ab_tied python3 benchmarks/hf/fusion_ab.py seqfuse_fp8_delayed --switch tied_embedding \
  --seq 4096 --rounds 4 --profile --out fusion_ab_tied_embedding_s60
cp benchmarks/results/fusion_ab_tied_embedding_s60.json "$LOG/" 2>/dev/null
exit $status
