#!/usr/bin/env bash
# Session 47 call 3: the FP8 delayed device-ends route (cast_fp8_grouped_ends, DeviceEndsFp8GroupedLinearFunction),
# the sm90 kernel's e5m2 / split-accumulation forms (check binary), Mixtral rows and a profile of the FP8 row.
set -uo pipefail
D=$(dirname "$0"); GITC=${GITC:-unknown}
L=/tmp/logs; mkdir -p $L
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
finish() { tar czf $OUT/logs.tgz -C /tmp logs; echo "end $(el) s"; }
trap finish EXIT
python3 -m pip install -q --no-index --no-deps $D/*.whl > /dev/null 2>&1 && echo "hydra installed"
(MAX_JOBS=16 SEQFUSE_CUDA_ARCHS=90a python3 -m pip install -q --no-build-isolation --no-deps --no-index -e . > $L/build.log 2>&1; echo "build rc=$? $(el) s" > $L/build_rc.txt) &
BUILD=$!
if [ -x $D/check_grouped_sm90 ]; then
  CHECK_SEED=47 timeout 90 $D/check_grouped_sm90 > $L/check_sm90.log 2>&1; echo "check_sm90 rc=$? $(el) s"
  grep -v '^bench' $L/check_sm90.log | grep -v '^  ' | grep -iE "fail|passed" | tail -5; grep -E '^bench' $L/check_sm90.log | grep -iE "e5m2|split|promot|dgrad" | cut -c1-200 | head -20
fi
wait $BUILD; cat $L/build_rc.txt; grep -q 'rc=0' $L/build_rc.txt || { tail -30 $L/build.log; exit 1; }
timeout 170 python3 -m pytest -q -rfE -m cuda -p no:cacheprovider -n 14 --timeout 150 tests/test_fp8_grouped_cast_ends.py \
  tests/test_moe_device_ends_fp8.py tests/test_moe_device_split_fp8.py tests/test_moe_grouped_sm90.py tests/test_fp8_grouped_cast.py \
  tests/test_moe_modules.py tests/test_hf_mixtral.py tests/test_moe_grouped_gemm.py > $L/pytest.log 2>&1
echo "pytest rc=$? $(el) s"; tail -1 $L/pytest.log; grep -E "^(FAILED|ERROR)" $L/pytest.log | head -12
cd benchmarks
SEQFUSE_GIT_COMMIT=$GITC timeout 200 python3 moe/bench_mixtral_train.py --steps 8 --rows hf_bf16,hf_bf16_compile,seqfuse_bf16_torch_adamw,seqfuse_fp8_delayed_torch_adamw,seqfuse_fp8_delayed_hostsplits_torch_adamw > $L/mixtral.log 2>&1
echo "mixtral rc=$? $(el) s"; grep -E "\[mixtral bench\] (hf|seqfuse)|Error|error" $L/mixtral.log | cut -c1-220 | head -12
cp results/moe_mixtral_train.json $L/mixtral.json 2>/dev/null
SEQFUSE_GIT_COMMIT=$GITC timeout 100 python3 moe/bench_mixtral_train.py --steps 4 --timed-passes 2 --rows seqfuse_fp8_delayed_torch_adamw --profile $L/prof > $L/mixtral_prof.log 2>&1
echo "mixtral prof rc=$? $(el) s"; grep -E "\[mixtral bench\] seqfuse" $L/mixtral_prof.log | cut -c1-200
sed -n '1,12p' $L/prof/*_profile.txt | cut -c1-180
