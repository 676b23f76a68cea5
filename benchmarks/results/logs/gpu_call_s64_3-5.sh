#!/usr/bin/env bash
# Session 64's calls 3-5, as they ran: one-line commands on the machine calls 1-2 had left warm (carrying .whl and
# .s64/carry; SEQFUSE_GIT_COMMIT not passed, so their JSONs name the commit the bench found).
set -uo pipefail
source benchmarks/gpu_lib.sh
case "${1:-3}" in
3)  # the one-launch RoPE A/B again, 8 rounds, FP8 delayed and bf16
    gpu_prebuilt s64c .s64/carry
    TAIL=14 run 200 ab_qkv2 env SEQFUSE_GEMM_TUNE=1 python3 benchmarks/hf/fusion_ab.py seqfuse_fp8_delayed,seqfuse_bf16 \
      --switch qkv_one_launch --rounds 8 --profile --out fusion_ab_qkv_one_launch_s64b
    cp benchmarks/results/fusion_ab_qkv_one_launch_s64b.json "$LOG/" ;;
4)  # accelerate() at 4,096 over 30 timed steps, eager / compiled / bf16 / FP8
    gpu_prebuilt s64d .s64/carry
    TAIL=14 run 200 accel4096_30 env SEQFUSE_GEMM_TUNE=1 python3 benchmarks/hf/bench_accelerate.py --shape llama1b \
      --seq 4096 --steps 30 --out hf_accelerate_s64_4096_30steps --rows hf_eager,hf_compile,seqfuse_bf16,seqfuse_fp8_delayed
    cp benchmarks/results/hf_accelerate_s64_4096_30steps.json "$LOG/" ;;
5)  # the Mistral shape, every peer but Liger compiled
    gpu_prebuilt s64e .s64/carry
    TAIL=16 run 170 accel_mistral env SEQFUSE_GEMM_TUNE=1 python3 benchmarks/hf/bench_accelerate.py --shape mistral \
      --seq 4096 --steps 12 --out hf_accelerate_s64_mistral_4096 \
      --rows hf_eager,hf_compile,seqfuse_bf16,seqfuse_fp8_delayed,torchao_float8,liger
    cp benchmarks/results/hf_accelerate_s64_mistral_4096.json "$LOG/" ;;
esac
exit $status
