#!/usr/bin/env bash
# Session 61, the last try with the device time left (~340 s, most of the session's spent on refused starts):
# accelerate() at the Llama 3.2 1B shape, 1 x 4,096 tokens, with every peer in one process (eager and compiled
# transformers, torchao's float8 on compiled layers, Liger-Kernel; seqfuse bf16 and FP8 delayed), then check_cast
# as far as the time goes.  The logs are packed after each part.
# Carry .whl (torchao 0.18.0, liger-kernel), .s61/carry (lib312.tar.xz, checks.tar.xz, pkg_head.tar.xz):
#   SEQFUSE_GIT_COMMIT=<sha> bash benchmarks/results/logs/gpu_call_s61_2.sh
set -uo pipefail
source benchmarks/gpu_lib.sh  # gpu_prebuilt, run
tar xJf .s61/carry/pkg_head.tar.xz && echo "python/seqfuse from HEAD's archive"
gpu_prebuilt s61 .s61/carry
TAIL=40 run 220 accel4096 python3 benchmarks/hf/bench_accelerate.py --shape llama1b --seq 4096 --steps 10 \
  --rows hf_eager,hf_compile,seqfuse_bf16,seqfuse_fp8_delayed,torchao_float8,liger --out hf_accelerate_s61_4096_all
cp benchmarks/results/hf_accelerate_s61_4096_all.json "$LOG/" 2>/dev/null
pack
TAIL=4 run 60 check_cast bin/check_quant_cast
exit $status
