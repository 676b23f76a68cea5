#!/usr/bin/env bash
# s51 call 2 (carry .s51/next, .s51/bins.tgz): the grouped SwiGLU backward staged through shared memory.
#  1. check_cast built here with the new kernel (r4s3c1: 4 rows a phase, 3 stages, 1 CTA/SM): every check, section 9
#     (the fused backward against the CPU) included; the same program with HEAD~'s kernel (old) and three other
#     stagings, cases thinned, for section 9's times at Mixtral-small's shape on this machine.
#  2. the extension, the cuda tests of the kernel's users, bench_swiglu_backward, the Mixtral FP8 rows with eager and
#     compiled transformers.
set -uo pipefail
D=.s51; GITC=${GITC:-unknown}; L=$OUT/logs; mkdir -p $L
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-index --no-deps $D/next/*.whl > /dev/null 2>&1 && echo "hydra installed"
(MAX_JOBS=16 SEQFUSE_CUDA_ARCHS=90a python3 -m pip install -q --no-build-isolation --no-deps --no-index -e . > $L/build.log 2>&1; echo "build rc=$?" >> $L/build.log) &
bp=$!
mkdir -p /tmp/b && tar xzf $D/bins.tgz -C /tmp/b
CHECK_EVERY=2 timeout 150 /tmp/b/bins/check_quant_cast_r4s3c1 > $L/check_new.log 2>&1; echo "check new rc=$? $(el) s"
grep -E "FAIL|(swiglu_backward_grouped|cast_grouped_ends).* us|check_cast" $L/check_new.log | head -12 | cut -c1-230
grep -c PASS $L/check_new.log
for v in old r2s2c2 r4s2c1 r4s3c1; do
  CHECK_EVERY=1000000 timeout 60 /tmp/b/bins/check_quant_cast_$v > $L/check_$v.log 2>&1
  echo "$v rc=$?"; grep -E "(swiglu_backward_grouped|cast_grouped_ends).* us|FAIL" $L/check_$v.log | cut -c1-200
done
wait $bp; tail -1 $L/build.log; echo "built $(el) s"
timeout 170 python3 -m pytest -q -rfE -m cuda -p no:cacheprovider -n 14 --timeout 160 tests/test_swiglu_backward_cast_grouped.py tests/test_fp8_grouped_cast_ends.py tests/test_moe_device_ends_fp8.py \
  tests/test_norm_modules.py tests/test_moe_modules.py tests/test_hf_mixtral.py tests/test_recipe_mixtral.py tests/test_norm.py > $L/pytest.log 2>&1
echo "pytest rc=$? $(el) s"; tail -1 $L/pytest.log; grep -E "^(FAILED|ERROR)|^E  " $L/pytest.log | head -8 | cut -c1-300
cd benchmarks
timeout 60 python3 moe/bench_swiglu_backward.py > $L/bench_swiglu.log 2>&1; echo "bench_swiglu rc=$?"; grep -E "mixtral|64_exp" $L/bench_swiglu.log | head -8 | cut -c1-200
left=$(( 590 - $(el) )); [ $left -gt 150 ] && left=150
SEQFUSE_GIT_COMMIT=$GITC timeout $left python3 moe/bench_mixtral_train.py --steps 8 --timed-passes 5 \
  --rows hf_bf16,hf_bf16_compile,seqfuse_fp8_delayed_torch_adamw,seqfusegraph_fp8_delayed_torch_adamw > $L/mixtral.log 2>&1
echo "mixtral rc=$? $(el) s"; grep -E "\[mixtral bench\] (hf|seqfuse)[a-z0-9_]*:|Error" $L/mixtral.log | cut -c1-150 | head -8
cp results/moe_mixtral_train.json $L/ 2>/dev/null
