#!/usr/bin/env bash
# Session 60, call 5: the SwiGLU's sigmoid from the device's hardware approximations (moe.h; call 4's probe: the
# one-pass kernels were issue-bound on the exact expf and division), in the order the little device time left
# allows: the cuda tests of the SwiGLU ops and modules, check_moe, the probe at Llama 1B's MLP, the in-process A/B
# of accelerate()'s FP8 step (one-pass against the activation kernels), accelerate()'s FP8 row beside eager
# transformers at 4,096 tokens, check_cast.
# Carry .whl, .s60/carry (lib312.tar.xz, checks.tar.xz, probes.tar.xz) and .s54/carry (pkg_head.tar.xz):
#   SEQFUSE_GIT_COMMIT=<sha> bash benchmarks/results/logs/gpu_call_s60_5.sh
set -uo pipefail
source benchmarks/gpu_lib.sh  # gpu_prebuilt, run
tar xJf .s54/carry/pkg_head.tar.xz && echo "python/seqfuse from HEAD's archive"
gpu_prebuilt s60 .s60/carry
tar xJf .s60/carry/probes.tar.xz
TAIL=3 run 70 cuda_tests python3 -m pytest -q -m cuda -p no:cacheprovider -n 8 tests/test_swiglu_backward_cast_grouped.py \
  tests/test_fp8_grouped_cast.py tests/test_fp8_grouped_cast_ends.py tests/test_layernorm_mlp_fp8_recompute.py \
  tests/test_moe_modules.py tests/test_moe_device_ends_fp8.py tests/test_moe_device_split_fp8.py
TAIL=3 run 30 check_moe bin/check_moe_moe
TAIL=4 run 30 probe bin/swiglu_probe_base
TAIL=10 run 80 ab_one_pass_swiglu python3 benchmarks/hf/fusion_ab.py seqfuse_fp8_delayed --switch one_pass_swiglu \
  --seq 4096 --rounds 4 --profile --out fusion_ab_one_pass_swiglu_s60_5
cp benchmarks/results/fusion_ab_one_pass_swiglu_s60_5.json "$LOG/" 2>/dev/null
TAIL=8 run 70 accel4096 python3 benchmarks/hf/bench_accelerate.py --shape llama1b --seq 4096 --steps 12 \
  --rows hf_eager,seqfuse_fp8_delayed --out hf_accelerate_s60_4096_5
cp benchmarks/results/hf_accelerate_s60_4096_5.json "$LOG/" 2>/dev/null
TAIL=3 run 90 check_cast bin/check_quant_cast
exit $status
