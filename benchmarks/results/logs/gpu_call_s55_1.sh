#!/usr/bin/env bash
# Session 55, call 1 (best on an H200, the issues' machine; what the limit cuts is the last part, the logs packed
# after each part): accelerate() on the Llama 1B shape at 4,096 and 8,192 tokens (issue 21) with its peers
# (compiled transformers, Liger-Kernel from .whl) and the rows stepping seqfuse's FusedAdamW set to torch AdamW's
# update (94cb1d7); the cuda tests of the FP8 modules on the package since s54's host-work trims (25ed71e, 6e31002,
# 2a8cb55: not yet run on a GPU); bench_fp8_host with seqfuse's kernels running, the package before those trims
# (820b22b) and after (HEAD) over one prebuilt extension.
# Make .s54/carry: git archive HEAD python/seqfuse | xz > .s54/carry/pkg_head.tar.xz, and the same of 820b22b
# as pkg_old_820b22b.tar.xz.  Carry .whl, .s52/carry and .s54/carry:
#   SEQFUSE_GIT_COMMIT=<sha> bash benchmarks/results/logs/gpu_call_s55_1.sh
set -uo pipefail
source benchmarks/gpu_lib.sh  # gpu_prebuilt, run
tar xJf .s54/carry/pkg_head.tar.xz && echo "python/seqfuse from HEAD's archive"
gpu_prebuilt s55 .s52/carry
A=hf_eager,hf_compile,seqfuse_bf16,seqfuse_fp8_delayed,seqfuse_fp8_delayed_head,seqfuse_bf16_fused_adamw
A=$A,seqfuse_fp8_delayed_fused_adamw,seqfuse_fp8_delayed_head_fused_adamw,liger
for S in 4096 8192; do
  TAIL=30 run 200 accel$S python3 benchmarks/hf/bench_accelerate.py --shape llama1b --seq $S --steps 20 \
    --rows $A --out hf_accelerate_h200_s55_$S
  cp benchmarks/results/hf_accelerate_h200_s55_$S.json "$LOG/" 2>/dev/null
  pack
done
TAIL=6 run 100 cuda_tests python3 -m pytest -q -rfE -m cuda -p no:cacheprovider -n 14 --timeout 120 tests/test_linear.py \
  tests/test_graphs_first_step.py tests/test_scaling.py tests/test_fp8_any_rows.py tests/test_weight_cast_paths.py
pack
mkdir -p /tmp/old && tar xJf .s54/carry/pkg_old_820b22b.tar.xz -C /tmp/old && cp python/seqfuse/_C.cpython-312-*.so /tmp/old/python/seqfuse/
for v in new old; do
  P=$ROOT/python; [ $v = old ] && P=/tmp/old/python
  TAIL=5 run 40 host_real_$v bash -c "cd benchmarks && PYTHONPATH=$P python3 bench_fp8_host.py \
    --device cuda --kernels real && cp results/fp8_host.json $LOG/fp8_host_real_$v.json"
  pack
done
exit $status
