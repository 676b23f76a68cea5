#!/usr/bin/env bash
# Session 54, call 2 (an H200): where the graphed Mixtral-small FP8 step's time goes on the H200 (call 1 measured
# it at 2.128x eager transformers there, under the 2.2x goal: one profiled step after two eager steps and the
# capture), the SwiGLU backward pass alone (bench_swiglu_backward.py), and accelerate() on the Llama 1B shape at
# 4,096 tokens (issue 21) with its peers, Liger-Kernel from .whl.  The committed Python package comes from
# .s54/carry/pkg_head.tar.xz (git archive HEAD python/seqfuse), over any uncommitted edits in the working tree.
# Carry .whl, .s52/carry and .s54/carry:
#   SEQFUSE_GIT_COMMIT=<sha> bash benchmarks/results/logs/gpu_call_s54_2_not_run.sh
set -uo pipefail
source benchmarks/gpu_lib.sh  # gpu_prebuilt, run
tar xJf .s54/carry/pkg_head.tar.xz && echo "python/seqfuse from HEAD's archive"
gpu_prebuilt s54 .s52/carry
R=seqfusegraph_fp8_delayed_fused_adamw
TAIL=3 run 100 mixtral_prof bash -c "cd benchmarks && python3 moe/bench_mixtral_train.py --rows $R --steps 2 \
  --timed-passes 1 --warm-passes 1 --eager-before-graphs 2 --profile $LOG/mixtral_prof"
TAIL=12 run 60 swiglu_backward bash -c "cd benchmarks && python3 moe/bench_swiglu_backward.py"
TAIL=10 run 300 accel bash -c "python3 benchmarks/hf/bench_accelerate.py --shape llama1b --seq 4096 --steps 20 \
  --rows hf_eager,hf_compile,seqfuse_fp8_delayed,seqfuse_bf16,liger --out hf_accelerate_s54_4096"
cp benchmarks/results/hf_accelerate_s54_4096.json "$LOG/" 2>/dev/null
exit $status
