#!/usr/bin/env bash
# s49 call 1 (carry .s49): GroupedMLP's two device-ends layers as one autograd node (no bf16 gate-up gradient):
# the corpus's CUDA cases of swiglu_backward_cast_fp8_grouped*, cuda tests, bench_swiglu_backward, and a same-machine
# A/B of the Mixtral FP8 row: this commit's Python package against d60fe73's (the same C extension).
set -uo pipefail
D=$(cd $(dirname "$0") && pwd); GITC=${GITC:-unknown}
L=/tmp/logs; mkdir -p $L
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
finish() { tar czf $OUT/logs.tgz -C /tmp logs; echo "end $(el) s"; }
trap finish EXIT
python3 -m pip install -q --no-index --no-deps $D/*.whl > /dev/null 2>&1 && echo "hydra installed"
MAX_JOBS=16 SEQFUSE_CUDA_ARCHS=90a python3 -m pip install -q --no-build-isolation --no-deps --no-index -e . > $L/build.log 2>&1; echo "build rc=$? $(el) s"
rm -rf /tmp/old && mkdir -p /tmp/old && cp -r python/seqfuse /tmp/old/ && cp -r $D/old/* /tmp/old/seqfuse/
(cd /tmp && PYTHONPATH=/tmp/old python3 -c "import seqfuse, seqfuse.modules.grouped_linear as g; print('old package:', seqfuse.__file__, hasattr(g, 'DeviceEndsFp8GroupedMLPFunction'))")
(cd tests && R=$(python3 -c "
import bad_input_cases as c
i=[k for k,x in enumerate(c.build_cases('cuda')) if 'swiglu_backward_cast' in x.name]; print(i[0], i[-1]+1)") && \
 timeout 150 python3 bad_input_cases.py cuda $R > $L/corpus.log 2>&1; echo "corpus rc=$? cases $R: $(grep -c '^R' $L/corpus.log) run, $(grep '^R' $L/corpus.log | grep -c '"ok": false') failed")
grep '"ok": false' $L/corpus.log | head -5 | cut -c1-300
timeout 170 python3 -m pytest -q -rfE -m cuda -p no:cacheprovider -n 14 --timeout 150 tests/test_swiglu_backward_cast_grouped.py \
  tests/test_moe_device_ends_fp8.py tests/test_fp8_grouped_cast_ends.py tests/test_moe_grouped_sm90.py tests/test_moe_device_split_fp8.py tests/test_fp8_grouped_cast.py tests/test_moe_modules.py \
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
run new1 "" hf_bf16,hf_bf16_compile,seqfuse_fp8_delayed_torch_adamw
run old1 /tmp/old seqfuse_fp8_delayed_torch_adamw
run new2 "" seqfuse_fp8_delayed_torch_adamw
run old2 /tmp/old seqfuse_fp8_delayed_torch_adamw
SEQFUSE_PROFILE_TRACE=1 SEQFUSE_GIT_COMMIT=$GITC timeout 80 python3 moe/bench_mixtral_train.py --steps 4 --timed-passes 1 --rows seqfuse_fp8_delayed_torch_adamw --profile $L/prof > $L/mixtral_prof.log 2>&1
f=$L/prof/seqfuse_fp8_delayed_torch_adamw_profile.txt; sed -n '3,9p' $f; sed -n '/GPU idle time by/,/^$/p' $f | head -8 | cut -c1-160; sed -n '/top 40 GPU/,/^$/p' $f | head -14 | cut -c1-140
