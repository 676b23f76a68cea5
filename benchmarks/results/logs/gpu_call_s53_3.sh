#!/usr/bin/env bash
# Session 53's GPU call (s53_1 and s53_2 in one, after five refused starts): the Mixtral rows (hf_bf16,
# hf_bf16_compile, the graphed and eager-layer FP8 delayed rows with FusedAdamW: issue 18's figures, each row's
# peak memory after each untimed step, over the timed passes, and reserved), then cuBLASLt's split-K reduction
# schemes: the same tree's extension as shipped (.s52/carry) against a build with
# NVCC_APPEND_FLAGS=-DSF_GEMM_REDUCTION_MASK=6 (.s53/carrym: the heuristic offered split-K through the workspace
# or none, not in place, which clears its output with cudaMemset2DAsync first), alternated one process each over
# the graphed row, then one profiled step of each.  Carry .whl, .s52/carry and .s53/carrym (how to make them:
# gpu_call_s53_1_not_run.sh's header; carrym the same build_ext with that NVCC_APPEND_FLAGS into .s53/lib312m):
#   SEQFUSE_GIT_COMMIT=<sha> bash benchmarks/results/logs/gpu_call_s53_3.sh
set -uo pipefail
pack() { tar czf "$OUT/logs.tgz" -C "$LOG" .; }
source benchmarks/gpu_lib.sh  # gpu_setup, gpu_extension, gpu_build, run
gpu_setup s53
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-index --no-deps .whl/*.whl > /dev/null 2>&1 && echo "hydra installed"
gpu_extension .s52/carry
SO=python/seqfuse/_C.cpython-312-x86_64-linux-gnu.so
cp $SO .s53/shipped.so
mkdir -p .s53/carrym/lib312 && tar xJf .s53/carrym/lib312.tar.xz -C .s53/carrym/lib312
cp .s53/carrym/lib312/seqfuse/_C.cpython-312-x86_64-linux-gnu.so .s53/mask6.so
M="cd benchmarks && python3 moe/bench_mixtral_train.py --steps 8 --timed-passes 5 --rows"
TAIL=6 run 200 mixtral_a bash -c "$M hf_bf16,hf_bf16_compile,seqfusegraph_fp8_delayed_fused_adamw,\
seqfuse_fp8_delayed_fused_adamw"
cp benchmarks/results/moe_mixtral_train.json "$LOG/moe_mixtral_train_a.json"
R=seqfusegraph_fp8_delayed_fused_adamw
for i in 1 2; do
  for v in mask6 shipped; do
    cp .s53/$v.so $SO
    TAIL=2 run 80 ab_${v}_$i bash -c "$M $R"
    cp benchmarks/results/moe_mixtral_train.json "$LOG/moe_mixtral_train_${v}_$i.json"
  done
done
for v in mask6 shipped; do
  cp .s53/$v.so $SO
  TAIL=2 run 90 prof_$v bash -c "$M $R --steps 2 --timed-passes 1 --warm-passes 1 --profile $LOG/prof_$v"
done
exit $status
