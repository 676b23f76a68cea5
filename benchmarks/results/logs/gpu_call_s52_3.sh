#!/usr/bin/env bash
# Session 52's third GPU call, on one GPU: the Mixtral rows again (call 2's graphed row with seqfuse's FusedAdamW
# set to the transformers row's update passed 2.2x by 0.3 %: two more processes, the eager-layer row beside it for
# the memory goal), then the Llama 3.2 1B-shape training rows at 8,192 tokens (issue 16; last measured in s25), whose
# seqfuse rows already step FusedAdamW with torch's bf16 state.  The extension prebuilt as in gpu_call_s52_2.sh
# (carry .whl and .s52/carry):
#   SEQFUSE_GIT_COMMIT=<sha> bash benchmarks/results/logs/gpu_call_s52_3.sh
set -uo pipefail
pack() { cp "$ROOT"/benchmarks/results/llama3.json "$LOG/" 2>/dev/null; tar czf "$OUT/logs.tgz" -C "$LOG" .; }
source benchmarks/gpu_lib.sh  # gpu_setup, gpu_extension, gpu_build, run
gpu_setup s52
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-index --no-deps .whl/*.whl > /dev/null 2>&1 && echo "hydra installed"
gpu_extension .s52/carry
M="cd benchmarks && python3 moe/bench_mixtral_train.py --steps 8 --timed-passes 5 --rows"
TAIL=9 run 200 mixtral_a bash -c "$M hf_bf16,hf_bf16_compile,seqfusegraph_fp8_delayed_fused_adamw,\
seqfuse_fp8_delayed_fused_adamw,seqfusegraph_fp8_delayed_torch_adamw"
cp benchmarks/results/moe_mixtral_train.json "$LOG/moe_mixtral_train_a.json"
TAIL=7 run 100 mixtral_b bash -c "$M hf_bf16,seqfusegraph_fp8_delayed_fused_adamw"
cp benchmarks/results/moe_mixtral_train.json "$LOG/moe_mixtral_train_b.json"
STOP_SIGNAL=TERM TAIL=14 run 200 llama_train python3 benchmarks/llama3/bench_llama3.py --size 1B --parts train \
    --batch-size 4 --steps 3 --warm-passes 1 --rows hf_bf16,seqfuse_bf16_packed,seqfuse_fp8_delayed_packed,hf_bf16_compiled
exit $status
