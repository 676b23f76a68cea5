#!/usr/bin/env bash
# Session 55, call 3 (gpu_call_s55_2.sh cut to what little device time was left): the cuda tests of the lean FP8
# weight cache (tests/test_fp8_any_rows.py) and bench_fp8_weight_transpose.py's three cache layouts at the Llama 1B
# (accelerate) shape, two rounds.  Carry .whl, .s52/carry and .s54/carry (pkg_head.tar.xz of HEAD):
#   SEQFUSE_GIT_COMMIT=<sha> bash benchmarks/results/logs/gpu_call_s55_3.sh
set -uo pipefail
source benchmarks/gpu_lib.sh  # gpu_prebuilt, run
tar xJf .s54/carry/pkg_head.tar.xz && echo "python/seqfuse from HEAD's archive"
gpu_prebuilt s55 .s52/carry
TAIL=8 run 60 cuda_tests python3 -m pytest -q -rfE -m cuda -p no:cacheprovider -n 14 --timeout 60 \
  tests/test_fp8_any_rows.py tests/test_cross_entropy.py
pack
TAIL=12 run 80 weight_cache bash -c "python3 benchmarks/bench_fp8_weight_transpose.py --rows llama1b --rounds 2 \
  --steps 4 --out fp8_weight_cache_s55 && cp benchmarks/results/fp8_weight_cache_s55.json $LOG/"
exit $status
