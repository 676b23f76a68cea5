#!/usr/bin/env bash
# A GPU call for an H200 (issue 18 asks for its figures there), written in s52, whose H200 tries were all refused: check_cast and check_adamw after the
# review's changes (the dx bound's terms, AdamW's four-wide path for 16-bit lists 8 bytes from 16-byte alignment),
# the Mixtral rows of call 3 (both runs) and bench_adamw, the extension prebuilt as in gpu_call_s52_2.sh (carry .whl and .s52/carry):
#   SEQFUSE_GIT_COMMIT=<sha> bash benchmarks/results/logs/gpu_call_s53_1_not_run.sh
set -uo pipefail
pack() { tar czf "$OUT/logs.tgz" -C "$LOG" .; }
source benchmarks/gpu_lib.sh  # gpu_setup, gpu_build, run
gpu_setup s52
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-index --no-deps .whl/*.whl > /dev/null 2>&1 && echo "hydra installed"
[ -f .s52/carry/lib312.tar.xz ] && mkdir -p .s52/lib312 && tar xJf .s52/carry/lib312.tar.xz -C .s52/lib312
[ -f .s52/carry/checks.tar.xz ] && tar xJf .s52/carry/checks.tar.xz
so=$(ls .s52/lib312/seqfuse/_C.cpython-312-*.so 2>/dev/null)
if [ -n "$so" ] && cp "$so" python/seqfuse/ && PYTHONPATH=python python3 -c "import seqfuse._C"; then
    export PYTHONPATH=$ROOT/python${PYTHONPATH:+:$PYTHONPATH}
    echo "prebuilt extension: $(basename "$so")"
else
    echo "no usable prebuilt extension: building"
    rm -f python/seqfuse/_C.cpython-312-*.so
    gpu_build
fi
TAIL=1 run 120 check_cast bin/check_quant_cast
grep -E "FAIL" "$LOG/check_cast.log" | head -5 | cut -c1-200
TAIL=4 run 60 check_adamw bin/check_optim_adamw
M="cd benchmarks && python3 moe/bench_mixtral_train.py --steps 8 --timed-passes 5 --rows"
TAIL=9 run 200 mixtral_a bash -c "$M hf_bf16,hf_bf16_compile,seqfusegraph_fp8_delayed_fused_adamw,\
seqfuse_fp8_delayed_fused_adamw,seqfusegraph_fp8_delayed_torch_adamw"
cp benchmarks/results/moe_mixtral_train.json "$LOG/moe_mixtral_train_a.json"
TAIL=7 run 100 mixtral_b bash -c "$M hf_bf16,seqfusegraph_fp8_delayed_fused_adamw"
cp benchmarks/results/moe_mixtral_train.json "$LOG/moe_mixtral_train_b.json"
TAIL=12 run 90 bench_adamw bash -c "cd benchmarks && python3 bench_adamw.py"
cp benchmarks/results/adamw.json "$LOG/adamw.json"
exit $status
