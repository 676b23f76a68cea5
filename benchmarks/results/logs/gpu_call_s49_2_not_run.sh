#!/usr/bin/env bash
# s49 call 2 (carry .s49, .whl), at 5dfd6bc: the cuda tests of the MoE files after the one-node review, the Mixtral FP8
# row with its eager peer, a Mixtral profile with Python stacks (trace kept: where the host-bound forward goes).
set -uo pipefail
D=$(cd $(dirname "$0") && pwd); GITC=5dfd6bc
L=$OUT/logs; mkdir -p $L
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
python3 -m pip install -q --no-index --no-deps $D/*.whl > /dev/null 2>&1 && echo "hydra installed"
MAX_JOBS=16 SEQFUSE_CUDA_ARCHS=90a python3 -m pip install -q --no-build-isolation --no-deps --no-index -e . > $L/build.log 2>&1; echo "build rc=$? $(el) s"
timeout 120 python3 -m pytest -q -rfE -m cuda -p no:cacheprovider -n 14 --timeout 120 tests/test_swiglu_backward_cast_grouped.py \
  tests/test_moe_device_ends_fp8.py tests/test_fp8_grouped_cast_ends.py tests/test_moe_device_split_fp8.py tests/test_moe_modules.py \
  tests/test_hf_mixtral.py tests/test_recipe_mixtral.py > $L/pytest.log 2>&1
echo "pytest rc=$? $(el) s"; tail -1 $L/pytest.log; grep -E "^(FAILED|ERROR)" $L/pytest.log | head -8
cd benchmarks
SEQFUSE_GIT_COMMIT=$GITC timeout 80 python3 moe/bench_mixtral_train.py --steps 8 --timed-passes 5 \
  --rows hf_bf16,seqfuse_fp8_delayed_torch_adamw > $L/mixtral.log 2>&1
echo "mixtral rc=$? $(el) s"; grep -E "\[mixtral bench\] (hf|seqfuse)[a-z0-9_]*:" $L/mixtral.log | cut -c1-120
cp results/moe_mixtral_train.json $L/mixtral.json 2>/dev/null
SEQFUSE_PROFILE_TRACE=1 SEQFUSE_GIT_COMMIT=$GITC timeout 60 python3 moe/bench_mixtral_train.py --steps 4 --timed-passes 1 \
  --rows seqfuse_fp8_delayed_torch_adamw --profile $L/mprof --profile-stacks > $L/mixtral_stacks.log 2>&1
echo "mixtral stacks rc=$? $(el) s"; f=$L/mprof/seqfuse_fp8_delayed_torch_adamw_profile.txt; sed -n '3,9p' $f
ls -la $L/mprof 2>/dev/null | grep -v total
