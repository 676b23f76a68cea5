#!/usr/bin/env bash
# cuBLASLt's top algorithms timed against its first choice at the Llama 1B step's GEMMs and the bf16 LM head's per
# chunk (benchmarks/gemm/cublaslt_algos_probe.cu, built here), then accelerate() at the Llama 3.2 1B shape with every
# peer in one process at 1 x 8,192 tokens (the second command on the machine that ran gpu_call_s63_1.sh, or a fresh
# one).
# Carry .whl and .s63/carry:  SEQFUSE_GIT_COMMIT=<sha> bash benchmarks/results/logs/gpu_call_s63_2.sh
set -uo pipefail
source benchmarks/gpu_lib.sh  # gpu_prebuilt, run
tar xJf .s63/carry/pkg_head.tar.xz && echo "python/seqfuse from HEAD's archive"
gpu_prebuilt s63 .s63/carry
TAIL=60 run 100 algos_probe bin/cublaslt_algos_probe
pack
TAIL=40 run 200 accel8192 python3 benchmarks/hf/bench_accelerate.py --shape llama1b --seq 8192 --steps 5 \
  --out hf_accelerate_s63_8192_all --rows hf_eager,hf_compile,seqfuse_bf16,seqfuse_fp8_delayed,torchao_float8,liger
cp benchmarks/results/hf_accelerate_s63_8192_all.json "$LOG/" 2>/dev/null
pack
exit $status
