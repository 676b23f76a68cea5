#!/usr/bin/env bash
# Session 52's check of the review's changes on one GPU (an H100: no H200 came): check_cast (the dx bound against its
# terms' true size) and check_adamw (AdamW's four-wide fallback for 16-bit lists 8 bytes from 16-byte alignment, a
# tensor at a four-element offset), and test_adamw.py's cuda tests, on the extension prebuilt as in gpu_call_s52_2.sh
# (carry .whl and .s52/carry):
#   SEQFUSE_GIT_COMMIT=<sha> bash benchmarks/results/logs/gpu_call_s52_6.sh
set -uo pipefail
pack() { tar czf "$OUT/logs.tgz" -C "$LOG" .; }
source benchmarks/gpu_lib.sh  # gpu_setup, gpu_extension, gpu_build, run
gpu_setup s52
nvidia-smi --query-gpu=name --format=csv,noheader
gpu_extension .s52/carry
TAIL=1 run 120 check_cast bin/check_quant_cast
grep -E "FAIL" "$LOG/check_cast.log" | head -5 | cut -c1-200
TAIL=4 run 60 check_adamw bin/check_optim_adamw
TAIL=3 run 100 cuda_tests python3 -m pytest -q -rfE -m cuda -p no:cacheprovider -n 8 tests/test_adamw.py
exit $status
