#!/usr/bin/env bash
# s48 call 5: the fixed misaligned-SwiGLU test and the op's tests.  GITC=<commit> bash .s48/c5/call.sh
set -uo pipefail
L=/tmp/logs; mkdir -p $L
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
finish() { tar czf $OUT/logs.tgz -C /tmp logs; echo "end $(el) s"; }
trap finish EXIT
MAX_JOBS=16 SEQFUSE_CUDA_ARCHS=90a python3 -m pip install -q --no-build-isolation --no-deps --no-index -e . > $L/build.log 2>&1; echo "build rc=$? $(el) s"
timeout 100 python3 -m pytest -q -rfE -m cuda -p no:cacheprovider -n 8 --timeout 90 tests/test_swiglu_backward_cast_grouped.py \
  "tests/test_fp8_grouped_cast.py::test_grouped_linear_fp8_cuda_misaligned_swiglu_input_trains" > $L/pytest.log 2>&1
echo "pytest rc=$? $(el) s"; tail -1 $L/pytest.log; grep -E "^(FAILED|ERROR)" $L/pytest.log | head
