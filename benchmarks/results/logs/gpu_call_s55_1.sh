#!/usr/bin/env bash
# Written in session 54 (its calls 3-6, never run: no machine, then no device time), best on an H200
# (what the limit cuts is the last part, the logs packed after each part): where
# the graphed Mixtral-small FP8 step's time goes on the H200 (call 1: 2.128x eager transformers, under the 2.2x goal;
# one profiled step after two eager steps and the capture); then the FP8 host-work trims (25ed71e, 6e31002) on a GPU:
# bench_fp8_host with seqfuse's kernels running, the package before them (820b22b, .s54/carry/pkg_old_820b22b.tar.xz)
# and after (HEAD's archive, .s54/carry/pkg_head.tar.xz, unpacked over the working tree) over one prebuilt extension,
# and the cuda tests of the FP8 modules.
# Make .s54/carry: git archive HEAD python/seqfuse | xz > .s54/carry/pkg_head.tar.xz, and the same of 820b22b
# as pkg_old_820b22b.tar.xz.
# Carry .whl, .s52/carry and .s54/carry:
#   SEQFUSE_GIT_COMMIT=<sha> bash benchmarks/results/logs/gpu_call_s55_1_not_run.sh
set -uo pipefail
source benchmarks/gpu_lib.sh  # gpu_prebuilt, run
tar xJf .s54/carry/pkg_head.tar.xz && echo "python/seqfuse from HEAD's archive"
gpu_prebuilt s54 .s52/carry
mkdir -p /tmp/old && tar xJf .s54/carry/pkg_old_820b22b.tar.xz -C /tmp/old && cp python/seqfuse/_C.cpython-312-*.so /tmp/old/python/seqfuse/
R=seqfusegraph_fp8_delayed_fused_adamw
TAIL=3 run 100 mixtral_prof bash -c "cd benchmarks && python3 moe/bench_mixtral_train.py --rows $R --steps 2 \
  --timed-passes 1 --warm-passes 1 --eager-before-graphs 2 --profile $LOG/mixtral_prof"
sed -n '1,40p' $LOG/mixtral_prof/*_profile.txt 2>/dev/null | cut -c1-160
pack
for i in 1; do
  for v in old new; do
    P=$ROOT/python; [ $v = old ] && P=/tmp/old/python
    TAIL=5 run 40 host_real_${v}_$i bash -c "cd benchmarks && PYTHONPATH=$P python3 bench_fp8_host.py \
      --device cuda --kernels real && cp results/fp8_host.json $LOG/fp8_host_real_${v}_$i.json"
    pack
  done
done
TAIL=6 run 90 cuda_tests python3 -m pytest -q -rfE -m cuda -p no:cacheprovider -n 14 --timeout 120 tests/test_linear.py \
  tests/test_graphs_first_step.py tests/test_scaling.py tests/test_fp8_any_rows.py
exit $status
