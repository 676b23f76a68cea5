#!/usr/bin/env bash
# First GPU call for session 48 (carry .s47): measure s47's lean trims of the device-ends FP8 route (de19766..32bbe40,
# not run on a GPU): cuda tests of the MoE files, the Mixtral A/B (device-ends vs host counts) with peers, a profile.
# Run as: GITC=<commit> bash .s47/next/call.sh  (carry [".s47"]); logs tarred into $OUT/logs.tgz.
set -uo pipefail
D=$(dirname "$0"); GITC=${GITC:-unknown}
L=/tmp/logs; mkdir -p $L
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
finish() { tar czf $OUT/logs.tgz -C /tmp logs; echo "end $(el) s"; }
trap finish EXIT
python3 -m pip install -q --no-index --no-deps $D/*.whl > /dev/null 2>&1 && echo "hydra installed"
MAX_JOBS=16 SEQFUSE_CUDA_ARCHS=90a python3 -m pip install -q --no-build-isolation --no-deps --no-index -e . > $L/build.log 2>&1; echo "build rc=$? $(el) s"
timeout 170 python3 -m pytest -q -rfE -m cuda -p no:cacheprovider -n 14 --timeout 150 tests/test_moe_device_ends_fp8.py \
  tests/test_fp8_grouped_cast_ends.py tests/test_moe_grouped_sm90.py tests/test_moe_device_split_fp8.py tests/test_fp8_grouped_cast.py \
  tests/test_moe_modules.py tests/test_hf_mixtral.py tests/test_moe_grouped_gemm.py tests/test_recipe_mixtral.py > $L/pytest.log 2>&1
echo "pytest rc=$? $(el) s"; tail -1 $L/pytest.log; grep -E "^(FAILED|ERROR)" $L/pytest.log | head -12
cd benchmarks
SEQFUSE_GIT_COMMIT=$GITC timeout 220 python3 moe/bench_mixtral_train.py --steps 8 --timed-passes 5 --rows hf_bf16,hf_bf16_compile,seqfuse_fp8_delayed_torch_adamw,seqfuse_fp8_delayed_hostsplits_torch_adamw > $L/mixtral.log 2>&1
echo "mixtral rc=$? $(el) s"; grep -E "\[mixtral bench\] (hf|seqfuse)|Error|error" $L/mixtral.log | cut -c1-220 | head -8
cp results/moe_mixtral_train.json $L/mixtral.json 2>/dev/null
SEQFUSE_GIT_COMMIT=$GITC timeout 100 python3 moe/bench_mixtral_train.py --steps 4 --timed-passes 1 --rows seqfuse_fp8_delayed_torch_adamw --profile $L/prof > $L/mixtral_prof.log 2>&1
f=$L/prof/seqfuse_fp8_delayed_torch_adamw_profile.txt; sed -n '3,9p' $f; sed -n '/heaviest/,/CUDA runtime/p' $f | head -30 | cut -c1-130
