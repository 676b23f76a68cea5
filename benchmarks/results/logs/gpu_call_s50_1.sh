#!/usr/bin/env bash
# s50 GPU call (carry .s49 and .whl).  Validates s49's unrun MoE changes (5dfd6bc..1ea0e59) and s50's
# graph_layers(experts="auto"): each Mixtral layer's attention block as CUDA graphs under FP8 delayed scaling,
# the experts eager.  Then the Mixtral rows with the new graphed row, its profile, and accelerate() (issue 21).
set -uo pipefail
D=$(cd $(dirname "$0") && pwd); GITC=93d8e94
L=$OUT/logs; mkdir -p $L
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
python3 -m pip install -q --no-index --no-deps $D/*.whl > /dev/null 2>&1 && echo "hydra installed"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > $L/wheels.log 2>&1; echo "liger rc=$?"
MAX_JOBS=16 SEQFUSE_CUDA_ARCHS=90a python3 -m pip install -q --no-build-isolation --no-deps --no-index -e . > $L/build.log 2>&1; echo "build rc=$? $(el) s"
(cd tests && R=$(python3 -c "
import bad_input_cases as c
i=[k for k,x in enumerate(c.build_cases('cuda')) if 'swiglu_backward_cast' in x.name]; print(i[0], i[-1]+1)") && \
 timeout 60 python3 bad_input_cases.py cuda $R > $L/corpus.log 2>&1; echo "corpus rc=$? cases $R: $(grep -c '^R' $L/corpus.log) run, $(grep '^R' $L/corpus.log | grep -c '"ok": false') failed")
timeout 140 python3 -m pytest -q -rfE -m cuda -p no:cacheprovider -n 14 --timeout 120 tests/test_swiglu_backward_cast_grouped.py \
  tests/test_moe_device_ends_fp8.py tests/test_fp8_grouped_cast_ends.py tests/test_moe_device_split_fp8.py tests/test_moe_modules.py \
  tests/test_hf_mixtral.py tests/test_recipe_mixtral.py tests/test_hf_decoder_graphs.py > $L/pytest.log 2>&1
echo "pytest rc=$? $(el) s"; tail -1 $L/pytest.log; grep -E "^(FAILED|ERROR)" $L/pytest.log | head -8
cd benchmarks
SEQFUSE_GIT_COMMIT=$GITC timeout 170 python3 moe/bench_mixtral_train.py --steps 8 --timed-passes 5 \
  --rows hf_bf16,hf_bf16_compile,seqfuse_fp8_delayed_torch_adamw,seqfusegraph_fp8_delayed_torch_adamw > $L/mixtral.log 2>&1
echo "mixtral rc=$? $(el) s"; grep -E "\[mixtral bench\] (hf|seqfuse)[a-z0-9_]*:" $L/mixtral.log | cut -c1-120
grep -iE "error|Traceback|attention block is graphed" $L/mixtral.log | head -5 | cut -c1-300
cp results/moe_mixtral_train.json $L/mixtral.json 2>/dev/null
SEQFUSE_PROFILE_TRACE=1 SEQFUSE_GIT_COMMIT=$GITC timeout 80 python3 moe/bench_mixtral_train.py --steps 4 --timed-passes 1 \
  --rows seqfusegraph_fp8_delayed_torch_adamw --profile $L/mprof > $L/mixtral_prof.log 2>&1
echo "mixtral graph profile rc=$? $(el) s"; f=$L/mprof/seqfusegraph_fp8_delayed_torch_adamw_profile.txt; sed -n '1,12p' $f
cd ..
left=$(( 588 - $(el) ))
if [ $left -gt 60 ]; then
PYTHONPATH=/tmp/site SEQFUSE_GIT_COMMIT=$GITC timeout $left python3 benchmarks/hf/bench_accelerate.py --shape llama1b --seq 4096 \
  --steps 20 --rows hf_eager,hf_compile,seqfuse_fp8_delayed,seqfuse_fp8_delayed_graphed,seqfuse_bf16,liger --out hf_accelerate_s50_4096 > $L/accel.log 2>&1
echo "accel rc=$? $(el) s"; grep -E "row=" $L/accel.log | sed 's/convert_peak.*//' | cut -c1-140
cp benchmarks/results/hf_accelerate_s50_4096.json $L/ 2>/dev/null
fi
