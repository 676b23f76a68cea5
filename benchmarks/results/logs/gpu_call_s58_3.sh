#!/usr/bin/env bash
# Session 58, call 3: the fused loss's gradients scaled by seqfuse's multi-tensor scale (no pass when the loss's
# gradient is 1) against torch's multiply, in one process (fusion_ab.py --switch loss_grad_scale); accelerate()'s
# rows at 4,096 tokens with every peer and the opt-in weight history rows; the cuda tests of the scale and the loss.
# The extension changed (csrc/optim: the scale kernel's skip): carry the one built here,
#   SEQFUSE_CUDA_ARCHS=90a python3.12 setup.py build_ext --build-temp .s52/bt312 --build-lib .s58/lib312
#   (cd .s58/lib312 && tar cJf ../carry/lib312.tar.xz seqfuse/_C.cpython-312-x86_64-linux-gnu.so)
# and .s54/carry/pkg_head.tar.xz: git archive HEAD python/seqfuse | xz > .s54/carry/pkg_head.tar.xz.
# Carry .whl, .s58/carry and .s54/carry:
#   SEQFUSE_GIT_COMMIT=<sha> bash benchmarks/results/logs/gpu_call_s58_3.sh
set -uo pipefail
source benchmarks/gpu_lib.sh  # gpu_prebuilt, run
tar xJf .s54/carry/pkg_head.tar.xz && echo "python/seqfuse from HEAD's archive"
gpu_prebuilt s58 .s58/carry
TAIL=8 run 100 cuda_tests python3 -m pytest -q -rfE -m cuda -p no:cacheprovider -n 14 --timeout 90 \
  tests/test_adamw.py tests/test_cross_entropy.py tests/test_fp8_weight_history.py
TAIL=16 run 130 ab_loss_grad_scale python3 benchmarks/hf/fusion_ab.py seqfuse_fp8_delayed,seqfuse_bf16 \
  --switch loss_grad_scale --seq 4096 --profile --out fusion_ab_loss_grad_scale_s58
cp benchmarks/results/fusion_ab_loss_grad_scale_s58.json "$LOG/" 2>/dev/null
pack
TAIL=40 run 330 accel4096 python3 benchmarks/hf/bench_accelerate.py --shape llama1b --seq 4096 --steps 20 \
  --rows hf_eager,hf_compile,seqfuse_bf16,seqfuse_fp8_delayed,seqfuse_fp8_delayed_history,seqfuse_fp8_delayed_head_fused_adamw,seqfuse_fp8_delayed_head_history_fused_adamw,torchao_float8,liger \
  --out hf_accelerate_s58_4096_all --memory "$LOG/memory"
cp benchmarks/results/hf_accelerate_s58_4096_all.json "$LOG/" 2>/dev/null
exit $status
