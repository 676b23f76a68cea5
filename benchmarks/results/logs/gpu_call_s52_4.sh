#!/usr/bin/env bash
# Session 52's fourth GPU call, asked of an H200 (issue 18 asks for its figures there; it ran on the H100 held
# from call 3): the Mixtral rows of call 3's first run, the extension prebuilt as in gpu_call_s52_2.sh (carry .whl
# and .s52/carry):
#   SEQFUSE_GIT_COMMIT=<sha> bash benchmarks/results/logs/gpu_call_s52_4.sh
set -uo pipefail
pack() { tar czf "$OUT/logs.tgz" -C "$LOG" .; }
source benchmarks/gpu_lib.sh  # gpu_setup, gpu_extension, gpu_build, run
gpu_setup s52
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-index --no-deps .whl/*.whl > /dev/null 2>&1 && echo "hydra installed"
gpu_extension .s52/carry
M="cd benchmarks && python3 moe/bench_mixtral_train.py --steps 8 --timed-passes 5 --rows"
TAIL=9 run 200 mixtral_a bash -c "$M hf_bf16,hf_bf16_compile,seqfusegraph_fp8_delayed_fused_adamw,\
seqfuse_fp8_delayed_fused_adamw,seqfusegraph_fp8_delayed_torch_adamw"
cp benchmarks/results/moe_mixtral_train.json "$LOG/moe_mixtral_train_a.json"
exit $status
