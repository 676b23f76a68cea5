#!/usr/bin/env bash
# The next GPU call after session 63 (not run in it: the device time ran out).  The cuda tests of
# seqfuse.ops.gemm.tune, the fused loss's tuned weight-gradient sum and split_qkv_rope's word copies; in-process
# A/Bs of accelerate()'s FP8 delayed step: the sum tuned against cuBLASLt's first choice (fusion_ab.py --switch
# gemm_tune, seqfuse's log at INFO for the tune's own line) and the value heads' copies as 8-byte words against
# torch's element copy (--switch value_words); then accelerate() at 1 x 4,096 tokens with eager, compiled and
# Liger transformers and seqfuse bf16 / FP8 delayed in one process, tuning on (SEQFUSE_GEMM_TUNE=1; off by
# default until this call has run).
# Carry .whl and .s63/carry (lib312.tar.xz, pkg_head.tar.xz):
#   SEQFUSE_GIT_COMMIT=<sha> bash benchmarks/results/logs/gpu_call_s63_4.sh
set -uo pipefail
source benchmarks/gpu_lib.sh  # gpu_prebuilt, run
tar xJf .s63/carry/pkg_head.tar.xz && echo "python/seqfuse from HEAD's archive"
gpu_prebuilt s63 .s63/carry
TAIL=6 run 100 cuda_tests python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_gemm.py \
  tests/test_cross_entropy.py tests/test_rope.py -k "tune or tuning or linear_cross_entropy or split_qkv"
pack
TAIL=30 run 200 ab_gemm_tune python3 -c "import logging, runpy, sys; logging.basicConfig(level=logging.WARNING); \
logging.getLogger('seqfuse').setLevel(logging.INFO); sys.argv = ['fusion_ab.py', 'seqfuse_fp8_delayed', '--switch', \
'gemm_tune', '--rounds', '4', '--profile', '--out', 'fusion_ab_gemm_tune_s63']; \
runpy.run_path('benchmarks/hf/fusion_ab.py', run_name='__main__')"
cp benchmarks/results/fusion_ab_gemm_tune_s63.json "$LOG/" 2>/dev/null
pack
TAIL=12 run 150 ab_value_words python3 benchmarks/hf/fusion_ab.py seqfuse_fp8_delayed --switch value_words \
  --rounds 4 --profile --out fusion_ab_value_words_s63
cp benchmarks/results/fusion_ab_value_words_s63.json "$LOG/" 2>/dev/null
pack
TAIL=30 run 160 accel4096 env SEQFUSE_GEMM_TUNE=1 python3 benchmarks/hf/bench_accelerate.py --shape llama1b \
  --seq 4096 --steps 12 \
  --out hf_accelerate_s63_4096_tuned --rows hf_eager,hf_compile,seqfuse_bf16,seqfuse_fp8_delayed,liger
cp benchmarks/results/hf_accelerate_s63_4096_tuned.json "$LOG/" 2>/dev/null
pack
exit $status
