#!/usr/bin/env bash
# Session 64's first GPU call: split_qkv_rope in one launch each way (ops.rope.rope_parts) and the GEMM tuning of
# session 63, neither run on a GPU before.  The RoPE check binary (bin/check_rope_rope: sf_rope_parts against the
# CPU reference, copied heads bit for bit); the cuda tests of rope, seqfuse.ops.gemm.tune and the fused loss; then
# in-process A/Bs of accelerate()'s FP8 delayed Llama 1B step at 1 x 4,096 tokens: one launch against the old
# split (q and k in one launch, v copied in another; three backward launches) and the loss's weight-gradient sum
# tuned against cuBLASLt's first choice.
# Carry .whl and .s64/carry (lib312.tar.xz, checks.tar.xz):
#   SEQFUSE_GIT_COMMIT=<sha> bash benchmarks/results/logs/gpu_call_s64_1.sh
set -uo pipefail
source benchmarks/gpu_lib.sh  # gpu_prebuilt, run
gpu_prebuilt s64 .s64/carry
TAIL=4 run 60 check_rope bin/check_rope_rope
TAIL=6 run 100 cuda_tests python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_rope.py tests/test_gemm.py \
  tests/test_cross_entropy.py -k "rope or tune or tuning or linear_cross_entropy"
pack
TAIL=16 run 140 ab_qkv_one_launch python3 benchmarks/hf/fusion_ab.py seqfuse_fp8_delayed --switch qkv_one_launch \
  --rounds 4 --profile --out fusion_ab_qkv_one_launch_s64
cp benchmarks/results/fusion_ab_qkv_one_launch_s64.json "$LOG/" 2>/dev/null
pack
TAIL=24 run 150 ab_gemm_tune python3 -c "import logging, runpy, sys; logging.basicConfig(level=logging.WARNING); \
logging.getLogger('seqfuse').setLevel(logging.INFO); sys.argv = ['fusion_ab.py', 'seqfuse_fp8_delayed', '--switch', \
'gemm_tune', '--rounds', '4', '--profile', '--out', 'fusion_ab_gemm_tune_s64']; \
runpy.run_path('benchmarks/hf/fusion_ab.py', run_name='__main__')"
cp benchmarks/results/fusion_ab_gemm_tune_s64.json "$LOG/" 2>/dev/null
exit $status
