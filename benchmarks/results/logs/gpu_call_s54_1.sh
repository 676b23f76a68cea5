#!/usr/bin/env bash
# Session 54, call 1 (best on an H200, issue 18's machine): s53 call 4's Mixtral rows at the shipped code (graphed
# gradients copied beside the graph's buffers), the graphed row captured after two eager steps: run a with the
# transformers rows, then the graphed row alone for its reserved memory; then issue 20's per-layer host cost with
# seqfuse's kernels running (issue time) and stubbed, on the GPU.  Carry .whl and .s52/carry
# (gpu_call_s53_1_not_run.sh's header says how to make them):
#   SEQFUSE_GIT_COMMIT=<sha> bash benchmarks/results/logs/gpu_call_s54_1.sh
set -uo pipefail
source benchmarks/gpu_lib.sh  # gpu_prebuilt, run
gpu_prebuilt s54 .s52/carry
M="cd benchmarks && python3 moe/bench_mixtral_train.py --steps 8 --timed-passes 5 --eager-before-graphs 2 --rows"
G=seqfusegraph_fp8_delayed_fused_adamw
TAIL=9 run 200 mixtral_a bash -c "$M hf_bf16,hf_bf16_compile,$G,seqfuse_fp8_delayed_fused_adamw"
cp benchmarks/results/moe_mixtral_train.json "$LOG/moe_mixtral_train_a.json"
TAIL=1 run 90 alone_graphed bash -c "$M $G"
cp benchmarks/results/moe_mixtral_train.json "$LOG/moe_mixtral_train_alone_graphed.json"
TAIL=10 run 90 fp8_host_real bash -c "cd benchmarks && python3 bench_fp8_host.py --device cuda --kernels real"
cp benchmarks/results/fp8_host.json "$LOG/fp8_host_real.json"
TAIL=10 run 60 fp8_host_stubbed bash -c "cd benchmarks && python3 bench_fp8_host.py --device cuda"
cp benchmarks/results/fp8_host.json "$LOG/fp8_host_stubbed.json"
exit $status
