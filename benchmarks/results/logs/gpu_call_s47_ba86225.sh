#!/usr/bin/env bash
# Session 47 call 5: cuda tests of every file that runs the MoE layers or the grouped GEMM, and the Mixtral A/B
# of FP8 delayed on the device-ends route (every layer now) against host counts, with its peers.
set -uo pipefail
D=$(dirname "$0"); GITC=${GITC:-unknown}
L=/tmp/logs; mkdir -p $L
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
finish() { tar czf $OUT/logs.tgz -C /tmp logs; echo "end $(el) s"; }
trap finish EXIT
python3 -m pip install -q --no-index --no-deps $D/*.whl > /dev/null 2>&1 && echo "hydra installed"
MAX_JOBS=16 SEQFUSE_CUDA_ARCHS=90a python3 -m pip install -q --no-build-isolation --no-deps --no-index -e . > $L/build.log 2>&1; echo "build rc=$? $(el) s"
timeout 170 python3 -m pytest -q -rfE -m cuda -p no:cacheprovider -n 14 --timeout 150 tests/test_moe_device_ends_fp8.py \
  tests/test_fp8_grouped_cast_ends.py tests/test_moe_grouped_sm90.py tests/test_moe_device_split_fp8.py tests/test_moe_device_split.py \
  tests/test_fp8_grouped_cast.py tests/test_moe_modules.py tests/test_hf_mixtral.py tests/test_moe_grouped_gemm.py \
  tests/test_fp8_any_rows.py tests/test_bad_inputs_s38.py tests/test_moe_bad_inputs_s40.py tests/test_recipe_mixtral.py \
  tests/test_te_ops_grouped_linear.py tests/test_te_args_s41.py tests/test_hf_accelerate_experts.py tests/test_out_arguments.py \
  > $L/pytest.log 2>&1
echo "pytest rc=$? $(el) s"; tail -1 $L/pytest.log; grep -E "^(FAILED|ERROR)" $L/pytest.log | head -12
cd benchmarks
SEQFUSE_GIT_COMMIT=$GITC timeout 200 python3 moe/bench_mixtral_train.py --steps 8 --timed-passes 5 --rows hf_bf16,hf_bf16_compile,seqfuse_fp8_delayed_torch_adamw,seqfuse_fp8_delayed_hostsplits_torch_adamw > $L/mixtral.log 2>&1
echo "mixtral rc=$? $(el) s"; grep -E "\[mixtral bench\] (hf|seqfuse)|Error|error" $L/mixtral.log | cut -c1-220 | head -12
cp results/moe_mixtral_train.json $L/mixtral.json 2>/dev/null
cp results/moe_mixtral_train.png $L/mixtral.png 2>/dev/null
