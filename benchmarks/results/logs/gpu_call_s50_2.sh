#!/usr/bin/env bash
# s50 GPU call 2 (carry .s50/next): the Mixtral attention-block graphs under FP8 delayed (fixed), tests and rows.
set -uo pipefail
D=$(cd $(dirname "$0") && pwd); GITC=${GITC:-unknown}
L=$OUT/logs; mkdir -p $L
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
python3 -m pip install -q --no-index --no-deps $D/*.whl > /dev/null 2>&1 && echo "hydra installed"
MAX_JOBS=16 SEQFUSE_CUDA_ARCHS=90a python3 -m pip install -q --no-build-isolation --no-deps --no-index -e . > $L/build.log 2>&1; echo "build rc=$? $(el) s"
timeout 150 python3 -m pytest -q -rfE -m cuda -p no:cacheprovider -n 6 --timeout 140 tests/test_hf_decoder_graphs.py > $L/pytest.log 2>&1
echo "pytest rc=$? $(el) s"; tail -1 $L/pytest.log; grep -E "^(FAILED|ERROR)|^E  " $L/pytest.log | head -8 | cut -c1-300
cd benchmarks
SEQFUSE_GIT_COMMIT=$GITC timeout 200 python3 moe/bench_mixtral_train.py --steps 8 --timed-passes 5 \
  --rows hf_bf16,hf_bf16_compile,seqfuse_fp8_delayed_torch_adamw,seqfusegraph_fp8_delayed_torch_adamw > $L/mixtral.log 2>&1
echo "mixtral rc=$? $(el) s"; grep -E "\[mixtral bench\] (hf|seqfuse)[a-z0-9_]*:" $L/mixtral.log | cut -c1-120
grep -E "Error|Traceback" $L/mixtral.log | head -5 | cut -c1-300
cp results/moe_mixtral_train.json $L/mixtral.json 2>/dev/null
left=$(( 560 - $(el) )); [ $left -gt 100 ] && left=100
SEQFUSE_PROFILE_TRACE=1 SEQFUSE_GIT_COMMIT=$GITC timeout $left python3 moe/bench_mixtral_train.py --steps 4 --timed-passes 1 \
  --rows seqfusegraph_fp8_delayed_torch_adamw --profile $L/mprof > $L/mixtral_prof.log 2>&1
echo "mixtral graph profile rc=$? $(el) s"; f=$L/mprof/seqfusegraph_fp8_delayed_torch_adamw_profile.txt; sed -n '1,14p' $f
