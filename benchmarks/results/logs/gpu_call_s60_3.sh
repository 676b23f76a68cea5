#!/usr/bin/env bash
# Session 60, call 3: why the one-pass FP8 SwiGLU only broke even in call 2 (its backward 177 us at 2.08 TB/s
# and its forward cast 87 us a call, against about 125 / 63 us the bytes allow): the probe at Llama 1B's MLP for
# five builds of cast_cuda.cu (base; moe.h's fast sigmoid; the backward's staging 2/3/2 and 4/3/1), Nsight
# Compute's view of the base build's kernels, then check_cast with its float16 floor.
# Carry .s60/carry (probes.tar.xz: bin/swiglu_probe_*, bin/check_quant_cast):
#   bash benchmarks/results/logs/gpu_call_s60_3.sh
set -uo pipefail
source benchmarks/gpu_lib.sh  # gpu_setup, run
gpu_setup s60
pack() { tar czf "$OUT/logs.tgz" -C "$LOG" .; }
nvidia-smi --query-gpu=name --format=csv,noheader
tar xJf .s60/carry/probes.tar.xz
for b in base fast b232 fastb232 b431; do
  TAIL=8 run 40 probe_$b bin/swiglu_probe_$b
done
for k in grouped_swiglu_backward grouped_cast_kernel grouped_ends_cast act_vec; do
  TAIL=6 run 60 ncu_$k ncu --clock-control none --section SpeedOfLight --section Occupancy --section WarpStateStats \
    --section LaunchStats --section MemoryWorkloadAnalysis -k "regex:$k" -c 1 bin/swiglu_probe_base
done
TAIL=4 run 150 check_cast bin/check_quant_cast
exit $status
