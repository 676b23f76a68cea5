#!/usr/bin/env bash
# Session 53's first GPU call, for an H200 (issue 18 asks for its Mixtral figures there): the Mixtral rows twice
# (hf_bf16, hf_bf16_compile, the graphed and eager-layer FP8 delayed rows with FusedAdamW; then hf_bf16 and the
# graphed row again), each row's peak memory now also after each untimed step and over the timed passes alone.
# The extension and checks come prebuilt and xz-compressed, hydra's wheels in .whl (gpu_call_s53_1_not_run.sh's
# header says how to make them); carry .whl and .s52/carry:
#   SEQFUSE_GIT_COMMIT=<sha> bash benchmarks/results/logs/gpu_call_s53_1.sh
set -uo pipefail
pack() { tar czf "$OUT/logs.tgz" -C "$LOG" .; }
source benchmarks/gpu_lib.sh  # gpu_setup, gpu_extension, gpu_build, run
gpu_setup s53
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-index --no-deps .whl/*.whl > /dev/null 2>&1 && echo "hydra installed"
gpu_extension .s52/carry
M="cd benchmarks && python3 moe/bench_mixtral_train.py --steps 8 --timed-passes 5 --rows"
TAIL=9 run 200 mixtral_a bash -c "$M hf_bf16,hf_bf16_compile,seqfusegraph_fp8_delayed_fused_adamw,\
seqfuse_fp8_delayed_fused_adamw"
cp benchmarks/results/moe_mixtral_train.json "$LOG/moe_mixtral_train_a.json"
TAIL=7 run 100 mixtral_b bash -c "$M hf_bf16,seqfusegraph_fp8_delayed_fused_adamw"
cp benchmarks/results/moe_mixtral_train.json "$LOG/moe_mixtral_train_b.json"
exit $status
