#!/usr/bin/env bash
# s48 call 3 (carry .s48): the fused grouped SwiGLU backward with the gate-up gradient handoff (0ed5abb):
# cuda tests, bench_swiglu_backward, and a same-machine A/B of the Mixtral FP8 rows: this commit's Python package
# against 514d619's grouped_linear.py / modules/moe.py / quantization/grouped.py (the same C extension).
set -uo pipefail
D=$(cd $(dirname "$0") && pwd); GITC=${GITC:-unknown}
L=/tmp/logs; mkdir -p $L
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
finish() { tar czf $OUT/logs.tgz -C /tmp logs; echo "end $(el) s"; }
trap finish EXIT
python3 -m pip install -q --no-index --no-deps $D/*.whl > /dev/null 2>&1 && echo "hydra installed"
MAX_JOBS=16 SEQFUSE_CUDA_ARCHS=90a python3 -m pip install -q --no-build-isolation --no-deps --no-index -e . > $L/build.log 2>&1; echo "build rc=$? $(el) s"
rm -rf /tmp/old && mkdir -p /tmp/old && cp -r python/seqfuse /tmp/old/ && cp -r $D/old/* /tmp/old/seqfuse/
(cd /tmp && PYTHONPATH=/tmp/old python3 -c "import seqfuse, seqfuse.modules.grouped_linear as g; print('old package:', seqfuse.__file__, hasattr(g, 'GradHandoff'))")
timeout 170 python3 -m pytest -q -rfE -m cuda -p no:cacheprovider -n 14 --timeout 150 tests/test_swiglu_backward_cast_grouped.py \
  tests/test_moe_device_ends_fp8.py tests/test_moe_device_split_fp8.py tests/test_fp8_grouped_cast.py tests/test_moe_modules.py \
  tests/test_hf_mixtral.py tests/test_recipe_mixtral.py > $L/pytest.log 2>&1
echo "pytest rc=$? $(el) s"; tail -1 $L/pytest.log; grep -E "^(FAILED|ERROR)" $L/pytest.log | head -12
cd benchmarks
SEQFUSE_GIT_COMMIT=$GITC timeout 90 python3 moe/bench_swiglu_backward.py > $L/swiglu_bwd.log 2>&1; echo "swiglu bench rc=$? $(el) s"
grep "^\[moe_swiglu_backward\]" $L/swiglu_bwd.log | cut -c1-200; grep -i error $L/swiglu_bwd.log | head -3
cp results/moe_swiglu_backward.json $L/ 2>/dev/null
run() { # tag pythonpath rows
  SEQFUSE_GIT_COMMIT=$GITC PYTHONPATH=$2 timeout 150 python3 moe/bench_mixtral_train.py --steps 8 --timed-passes 5 --rows $3 > $L/mixtral_$1.log 2>&1
  echo "mixtral $1 rc=$? $(el) s"; grep -E "\[mixtral bench\] (hf|seqfuse)[a-z0-9_]*:|Error|error" $L/mixtral_$1.log | cut -c1-110 | head -4
  cp results/moe_mixtral_train.json $L/mixtral_$1.json 2>/dev/null
}
run new1 "" hf_bf16,seqfuse_fp8_delayed_torch_adamw,seqfuse_fp8_delayed_hostsplits_torch_adamw
run old1 /tmp/old seqfuse_fp8_delayed_torch_adamw,seqfuse_fp8_delayed_hostsplits_torch_adamw
run new2 "" seqfuse_fp8_delayed_torch_adamw,seqfuse_fp8_delayed_hostsplits_torch_adamw
run old2 /tmp/old seqfuse_fp8_delayed_torch_adamw
SEQFUSE_GIT_COMMIT=$GITC timeout 80 python3 moe/bench_mixtral_train.py --steps 4 --timed-passes 1 --rows seqfuse_fp8_delayed_torch_adamw --profile $L/prof > $L/mixtral_prof.log 2>&1
f=$L/prof/seqfuse_fp8_delayed_torch_adamw_profile.txt; sed -n '3,9p' $f; sed -n '/top 40 GPU/,/^$/p' $f | head -14 | cut -c1-140
