#!/usr/bin/env bash
# The short form of gpu_call_s63_4.sh for the device time left: the cuda tests of seqfuse.ops.gemm.tune, then the
# fused loss alone at Llama 1B's head (4,096 tokens, 1,024-row chunks) with its weight-gradient sum tuned against
# cuBLASLt's first choice, alternating rounds in one process (bench_linear_ce_chunks.py --tune-ab).
# Carry .whl and .s63/carry:  SEQFUSE_GIT_COMMIT=<sha> bash benchmarks/results/logs/gpu_call_s63_5.sh
set -uo pipefail
source benchmarks/gpu_lib.sh  # gpu_prebuilt, run
tar xJf .s63/carry/pkg_head.tar.xz && echo "python/seqfuse from HEAD's archive"
gpu_prebuilt s63 .s63/carry
TAIL=6 run 60 cuda_tests python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_gemm.py tests/test_cross_entropy.py \
  -k "tune or tuning"
pack
TAIL=12 run 80 loss_tune_ab python3 benchmarks/bench_linear_ce_chunks.py --tune-ab --tokens 4096 --chunks 1024 \
  --rounds 4 --out linear_ce_tune_ab_s63
cp benchmarks/results/linear_ce_tune_ab_s63.json "$LOG/" 2>/dev/null
pack
exit $status
