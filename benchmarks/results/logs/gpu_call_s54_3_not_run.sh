#!/usr/bin/env bash
# Session 54, call 3 (any H100 / H200): the FP8 host-work trims (25ed71e) on a GPU: the cuda tests of the FP8
# modules, then bench_fp8_host alternating the package before them (820b22b, from .s54/carry/pkg_old_820b22b.tar.xz)
# and after (HEAD's archive), two rounds each with seqfuse's kernels running and stubbed, over one prebuilt
# extension.  Carry .whl, .s52/carry and .s54/carry:
#   SEQFUSE_GIT_COMMIT=<sha> bash benchmarks/results/logs/gpu_call_s54_3_not_run.sh
set -uo pipefail
source benchmarks/gpu_lib.sh  # gpu_prebuilt, run
tar xJf .s54/carry/pkg_head.tar.xz && echo "python/seqfuse from HEAD's archive"
gpu_prebuilt s54 .s52/carry
mkdir -p /tmp/old && tar xJf .s54/carry/pkg_old_820b22b.tar.xz -C /tmp/old && cp python/seqfuse/_C.cpython-312-*.so /tmp/old/python/seqfuse/
TAIL=6 run 200 cuda_tests python3 -m pytest -q -rfE -m cuda -p no:cacheprovider -n 14 --timeout 150 tests/test_linear.py \
  tests/test_fp8_any_rows.py tests/test_scaling.py tests/test_quant_cast.py tests/test_layernorm_mlp_fp8_recompute.py \
  tests/test_graphs_first_step.py tests/test_hf_decoder_graphs.py tests/test_moe_device_ends_fp8.py tests/test_bench_fp8_host.py
for kernels in real stubbed; do
  for i in 1 2; do
    for v in old new; do
      P=$ROOT/python; [ $v = old ] && P=/tmp/old/python
      TAIL=9 run 60 host_${kernels}_${v}_$i bash -c "cd benchmarks && PYTHONPATH=$P python3 bench_fp8_host.py \
        --device cuda --kernels $kernels && cp results/fp8_host.json $LOG/fp8_host_${kernels}_${v}_$i.json"
    done
  done
done
exit $status
