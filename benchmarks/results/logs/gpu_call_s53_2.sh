#!/usr/bin/env bash
# Session 53's second GPU call: cuBLASLt's split-K reduction schemes in the Mixtral step.  The MoE backward's
# weight-gradient GEMMs (long K: each expert's tokens) issue cudaMemset2DAsync calls, the in-place split-K
# reduction clearing its output first.  The same tree's extension built twice: as shipped (.s52/carry) and with
# NVCC_APPEND_FLAGS=-DSF_GEMM_REDUCTION_MASK=6 (.s53/carrym: the heuristic offered only split-K through the
# workspace or none), alternated one process each over the graphed FP8 delayed FusedAdamW row, then one profiled
# step each.  Carry .whl, .s52/carry and .s53/carrym:
#   SEQFUSE_GIT_COMMIT=<sha> bash benchmarks/results/logs/gpu_call_s53_2.sh
set -uo pipefail
pack() { tar czf "$OUT/logs.tgz" -C "$LOG" .; }
source benchmarks/gpu_lib.sh  # gpu_setup, gpu_extension, gpu_build, run
gpu_setup s53
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-index --no-deps .whl/*.whl > /dev/null 2>&1 && echo "hydra installed"
gpu_extension .s52/carry
mkdir -p .s53/carrym/lib312 && tar xJf .s53/carrym/lib312.tar.xz -C .s53/carrym/lib312
cp python/seqfuse/_C.cpython-312-*.so .s53/shipped.so
M="cd benchmarks && python3 moe/bench_mixtral_train.py --steps 8 --timed-passes 5 --rows"
R=seqfusegraph_fp8_delayed_fused_adamw
for i in 1 2; do
  for v in shipped mask6; do
    if [ $v = shipped ]; then cp .s53/shipped.so python/seqfuse/_C.cpython-312-x86_64-linux-gnu.so
    else cp .s53/carrym/lib312/seqfuse/_C.cpython-312-x86_64-linux-gnu.so python/seqfuse/; fi
    TAIL=3 run 100 ab_${v}_$i bash -c "$M $R"
    cp benchmarks/results/moe_mixtral_train.json "$LOG/moe_mixtral_train_${v}_$i.json"
  done
done
for v in shipped mask6; do
  if [ $v = shipped ]; then cp .s53/shipped.so python/seqfuse/_C.cpython-312-x86_64-linux-gnu.so
  else cp .s53/carrym/lib312/seqfuse/_C.cpython-312-x86_64-linux-gnu.so python/seqfuse/; fi
  TAIL=3 run 120 prof_$v bash -c "$M $R --steps 2 --timed-passes 1 --warm-passes 1 --profile $LOG/prof_$v"
done
exit $status
