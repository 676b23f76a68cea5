#!/usr/bin/env bash
# s48 call 6 (carry .s48): the stacked weight cast in one C call and the kernel's scale helper: cuda tests, the
# Mixtral FP8 row with eager transformers, and profiles of this package and of 1b5b220's ops/moe.py (the list cast)
set -uo pipefail
D=$(cd $(dirname "$0") && pwd); GITC=${GITC:-unknown}
L=/tmp/logs; mkdir -p $L
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
finish() { tar czf $OUT/logs.tgz -C /tmp logs; echo "end $(el) s"; }
trap finish EXIT
python3 -m pip install -q --no-index --no-deps $D/*.whl > /dev/null 2>&1 && echo "hydra installed"
MAX_JOBS=16 SEQFUSE_CUDA_ARCHS=90a python3 -m pip install -q --no-build-isolation --no-deps --no-index -e . > $L/build.log 2>&1; echo "build rc=$? $(el) s"
rm -rf /tmp/old && mkdir -p /tmp/old && cp -r python/seqfuse /tmp/old/ && cp -r $D/old/* /tmp/old/seqfuse/
timeout 110 python3 -m pytest -q -rfE -m cuda -p no:cacheprovider -n 14 --timeout 100 tests/test_swiglu_backward_cast_grouped.py \
  tests/test_moe_device_ends_fp8.py tests/test_moe_device_split_fp8.py tests/test_moe_modules.py > $L/pytest.log 2>&1
echo "pytest rc=$? $(el) s"; tail -1 $L/pytest.log; grep -E "^(FAILED|ERROR)" $L/pytest.log | head -8 || true
cd benchmarks
SEQFUSE_GIT_COMMIT=$GITC timeout 80 python3 moe/bench_mixtral_train.py --steps 8 --timed-passes 5 --rows hf_bf16,seqfuse_fp8_delayed_torch_adamw > $L/mixtral.log 2>&1
echo "mixtral rc=$? $(el) s"; grep -E "\[mixtral bench\] (hf|seqfuse)[a-z0-9_]*:" $L/mixtral.log | cut -c1-110
cp results/moe_mixtral_train.json $L/mixtral.json 2>/dev/null
for t in new old new2; do
  pp=""; [ $t = old ] && pp=/tmp/old
  SEQFUSE_GIT_COMMIT=$GITC PYTHONPATH=$pp timeout 60 python3 moe/bench_mixtral_train.py --steps 4 --timed-passes 1 --rows seqfuse_fp8_delayed_torch_adamw --profile $L/prof_$t > $L/prof_$t.log 2>&1
  f=$L/prof_$t/seqfuse_fp8_delayed_torch_adamw_profile.txt; echo "$t: $(sed -n '3,4p' $f | tr '\n' ' ')"; grep -E "^DeviceEndsFp8GroupedLinearFunction:" $f | head -1; sed -n '/busy (any/p' $f
done
