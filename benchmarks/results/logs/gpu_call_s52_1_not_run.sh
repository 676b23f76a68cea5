#!/usr/bin/env bash
# First GPU call for session 52 (written in s51, which had no device time left to run it): what s51's review
# changed after its last call (568b944: the SwiGLU backward's two-row staging for small-shared-memory devices, the
# ends cast's tiling by form and its K = 0 guard, sf_allow_smem's static bound for the norms, check_cast's NaN poison),
# on one GPU: check_cast in full, the cuda tests of the kernels' users, and the Mixtral rows.
#   carry: .whl (hydra-core 1.3.x, omegaconf 2.3.0, antlr4-python3-runtime 4.9.3 wheels; s51 built antlr's here with
#   `pip wheel --no-deps antlr4-python3-runtime==4.9.3`)
#   GITC=<sha> bash benchmarks/results/logs/gpu_call_s52_1_not_run.sh
set -uo pipefail
GITC=${GITC:-unknown}; L=/tmp/logs; mkdir -p $L
trap 'tar czf $OUT/logs.tgz -C $L . ; cp $L/mixtral.log $L/moe_mixtral_train.json $OUT/ 2>/dev/null' EXIT
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-index --no-deps .whl/*.whl > /dev/null 2>&1 && echo "hydra installed"
(MAX_JOBS=12 SEQFUSE_CUDA_ARCHS=90a python3 -m pip install -q --no-build-isolation --no-deps --no-index -e . > $L/build.log 2>&1; echo "build rc=$?" >> $L/build.log) &
bp=$!
JOBS=4 bash csrc/build_checks.sh quant > $L/checks_build.log 2>&1; echo "checks built rc=$? $(el) s"
timeout 200 bin/check_quant_cast > $L/check_cast.log 2>&1; echo "check_cast rc=$? $(tail -1 $L/check_cast.log)"
grep -E "FAIL|(swiglu_backward_grouped|cast_grouped_ends).* us" $L/check_cast.log | head -12 | cut -c1-200
wait $bp; tail -1 $L/build.log; echo "built $(el) s"
timeout 200 python3 -m pytest -q -rfE -m cuda -p no:cacheprovider -n 14 --timeout 180 tests/test_swiglu_backward_cast_grouped.py \
  tests/test_fp8_grouped_cast_ends.py tests/test_moe_device_ends_fp8.py tests/test_norm.py tests/test_norm_modules.py \
  tests/test_moe_modules.py tests/test_hf_mixtral.py > $L/pytest.log 2>&1
echo "pytest rc=$? $(el) s"; tail -1 $L/pytest.log; grep -E "^(FAILED|ERROR)|^E  " $L/pytest.log | head -6 | cut -c1-300
cd benchmarks
left=$(( 560 - $(el) )); [ $left -gt 170 ] && left=170
SEQFUSE_GIT_COMMIT=$GITC timeout $left python3 moe/bench_mixtral_train.py --steps 8 --timed-passes 5 \
  --rows hf_bf16,hf_bf16_compile,seqfuse_fp8_delayed_torch_adamw,seqfusegraph_fp8_delayed_torch_adamw > $L/mixtral.log 2>&1
echo "mixtral rc=$? $(el) s"; grep -E "\[mixtral bench\] (hf|seqfuse)[a-z0-9_]*:|Error" $L/mixtral.log | cut -c1-150 | head -8
cp results/moe_mixtral_train.json $L/ 2>/dev/null
