#!/usr/bin/env bash
# First GPU call of session 51 (written in s50, which could not run it; run in s51 at ccaf66b, carry .s51/next): the cuda tests of e062ae0..bafa76e
# (the Mixtral layer's residuals folded: MultiheadAttention's residual, RMSNorm's input alias; graph_layers' split
# checks; the attention-block graphs replaying after the eager FP8 first steps), then a same-machine A/B of the Mixtral
# FP8 delayed rows (eager layers and attention blocks graphed) against 9df4dba's mixtral.py and norm.py over the same
# extension (old/), with eager, compiled and Liger transformers in run 1, and a profile of the graphed row.
#   GITC=<sha> bash .s51/next/call.sh
set -uo pipefail
D=$(cd $(dirname "$0") && pwd); GITC=${GITC:-unknown}
L=$OUT/logs; mkdir -p $L
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
python3 -m pip install -q --no-index --no-deps $D/*.whl > /dev/null 2>&1 && echo "hydra installed"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $D/liger/*.whl > /dev/null 2>&1; echo "liger rc=$?"
MAX_JOBS=16 SEQFUSE_CUDA_ARCHS=90a python3 -m pip install -q --no-build-isolation --no-deps --no-index -e . > $L/build.log 2>&1; echo "build rc=$? $(el) s"
rm -rf /tmp/old && mkdir -p /tmp/old && cp -r python/seqfuse /tmp/old/ && cp -r $D/old/* /tmp/old/seqfuse/
(cd /tmp && PYTHONPATH=/tmp/old python3 -c "import seqfuse, inspect, seqfuse.modules.norm as n; print('old package:', seqfuse.__file__, 'return_input_alias' in inspect.getsource(n))")
timeout 150 python3 -m pytest -q -rfE -m cuda -p no:cacheprovider -n 14 --timeout 140 tests/test_norm_modules.py tests/test_hf_mixtral.py \
  tests/test_recipe_mixtral.py tests/test_hf_decoder_graphs.py tests/test_moe_modules.py tests/test_expert_parallel.py > $L/pytest.log 2>&1
echo "pytest rc=$? $(el) s"; tail -1 $L/pytest.log; grep -E "^(FAILED|ERROR)|^E  " $L/pytest.log | head -8 | cut -c1-300
cd benchmarks
run() { # tag pythonpath rows
  SEQFUSE_GIT_COMMIT=$GITC PYTHONPATH=$2 timeout 120 python3 moe/bench_mixtral_train.py --steps 8 --timed-passes 5 --rows $3 > $L/mixtral_$1.log 2>&1
  echo "mixtral $1 rc=$? $(el) s"; grep -E "\[mixtral bench\] (hf|seqfuse)[a-z0-9_]*:|Error" $L/mixtral_$1.log | cut -c1-110 | head -6
  cp results/moe_mixtral_train.json $L/mixtral_$1.json 2>/dev/null
}
R=seqfuse_fp8_delayed_torch_adamw,seqfusegraph_fp8_delayed_torch_adamw
run new1 /tmp/site hf_bf16,hf_bf16_compile,$R,hf_bf16_liger
run old1 /tmp/old $R
run new2 "" $R
run old2 /tmp/old $R
left=$(( 570 - $(el) )); [ $left -gt 90 ] && left=90
SEQFUSE_GIT_COMMIT=$GITC timeout $left python3 moe/bench_mixtral_train.py --steps 4 --timed-passes 1 \
  --rows seqfusegraph_fp8_delayed_torch_adamw --profile $L/mprof > $L/mixtral_prof.log 2>&1
echo "profile rc=$? $(el) s"; f=$L/mprof/seqfusegraph_fp8_delayed_torch_adamw_profile.txt; sed -n '3,9p' $f
sed -n '/top 40 GPU/,/^$/p' $f | head -14 | cut -c1-140
