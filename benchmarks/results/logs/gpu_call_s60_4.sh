#!/usr/bin/env bash
# Session 60, call 4: why the one-pass FP8 SwiGLU only broke even in call 2 (its backward 177 us at 2.08 TB/s and
# its forward cast 87 us a call, where the bytes allow about 125 / 63 us), and the one-pass path with its forward's
# row-wise cast on the ends kernel: the probe at Llama 1B's MLP for five builds of cast_cuda.cu (base; moe.h's fast
# sigmoid; the backward's staging 2/3/2 and 4/3/1), Nsight Compute's view of the base build's kernels, the cuda
# tests, the in-process A/Bs of accelerate()'s FP8 step (one-pass against the activation kernels; the ends kernel
# against the tiled cast), accelerate()'s FP8 row beside eager transformers at 4,096 tokens, check_cast.
# Carry .whl, .s60/carry (lib312.tar.xz, checks.tar.xz, probes.tar.xz) and .s54/carry (pkg_head.tar.xz):
#   SEQFUSE_GIT_COMMIT=<sha> bash benchmarks/results/logs/gpu_call_s60_4.sh
set -uo pipefail
source benchmarks/gpu_lib.sh  # gpu_prebuilt, run
tar xJf .s54/carry/pkg_head.tar.xz && echo "python/seqfuse from HEAD's archive"
gpu_prebuilt s60 .s60/carry
tar xJf .s60/carry/probes.tar.xz
for b in base fast b232 fastb232 b431; do
  TAIL=4 run 40 probe_$b bin/swiglu_probe_$b
done
for k in grouped_swiglu_backward grouped_ends_cast grouped_cast_kernel; do
  TAIL=3 run 60 ncu_$k ncu --clock-control none --section SpeedOfLight --section Occupancy --section WarpStateStats \
    --section LaunchStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis -k "regex:$k" -c 1 \
    bin/swiglu_probe_base
done
TAIL=3 run 60 cuda_tests python3 -m pytest -q -m cuda -p no:cacheprovider -n 4 tests/test_layernorm_mlp_fp8_recompute.py \
  tests/test_hf_accelerate_bench.py
for sw in one_pass_swiglu swiglu_rowwise_ends; do
  TAIL=12 run 110 ab_$sw python3 benchmarks/hf/fusion_ab.py seqfuse_fp8_delayed --switch $sw \
    --seq 4096 --rounds 4 --profile --out fusion_ab_${sw}_s60_4
  cp benchmarks/results/fusion_ab_${sw}_s60_4.json "$LOG/" 2>/dev/null
done
TAIL=8 run 110 accel4096 python3 benchmarks/hf/bench_accelerate.py --shape llama1b --seq 4096 --steps 12 \
  --rows hf_eager,seqfuse_fp8_delayed --out hf_accelerate_s60_4096_4
cp benchmarks/results/hf_accelerate_s60_4096_4.json "$LOG/" 2>/dev/null
TAIL=3 run 120 check_cast bin/check_quant_cast
exit $status
