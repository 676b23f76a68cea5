#!/usr/bin/env bash
# accelerate()'s GPU run (issue 21), one command from the repository root on
# the GPU machine:
#   SEQFUSE_GIT_COMMIT=<sha> bash benchmarks/hf/gpu_accelerate.sh [PARTS]
# PARTS is a comma list of
#   tests     the cuda-marked tests of tests/test_hf_accelerate*.py
#   train     bench_accelerate.py, Llama 3.2 1B shape, 1 x 4096 tokens, every row
#   train8k   the same at 1 x 8192 tokens
#   prefill   generation's prefill at 1 x 4096 tokens (hf_eager, seqfuse_bf16, seqfuse_fp8_delayed, liger)
#   qwen2     Qwen2 1.5B shape, 1 x 4096 tokens (hf_eager, seqfuse_bf16, seqfuse_fp8_delayed, liger)
#   labels    the cross-entropy label check's cost: seqfuse_bf16 and seqfuse_fp8_delayed at 1 x 4096
#             tokens (10 timed steps) once per SEQFUSE_CHECK_LABELS mode, deferred (the default),
#             sync and 0 (off), one process each -> hf_accelerate_labels_<mode>.json
# default: tests,train.  BENCH_ARGS is added to every bench call (e.g. "--steps 3").
# Steps: the carried wheels (.whl: liger-kernel) into /tmp/site (PYTHONPATH),
# seqfuse built in place unless SKIP_BUILD=1 (pip install -e, about a
# minute), then each part under its own time limit inside DEADLINE (570 s).
# The result JSONs go to benchmarks/results/ and $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/seqfuse-accelerate}
PARTS=${1:-tests,train}
DEADLINE=${DEADLINE:-570}
SITE=/tmp/site
mkdir -p "$OUT"
start=$(date +%s)
status=0
left() { echo $(( DEADLINE - ($(date +%s) - start) )); }
run() {  # run LIMIT NAME CMD...: the limit cut to the deadline; the output's tail printed
    local limit=$1 name=$2; shift 2
    local rest; rest=$(left)
    (( rest < limit )) && limit=$rest
    if (( limit < 20 )); then echo "===== $name: NOT RUN (${rest} s left)"; status=1; return; fi
    echo "===== $name (limit ${limit} s, at $(( $(date +%s) - start )) s)"
    timeout -s INT "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    (( rc != 0 )) && { status=1; echo "($name FAILED: exit $rc$( ((rc == 124)) && echo ', timed out'))"; }
    tail -n "${TAIL:-22}" "$OUT/$name.log"
}

if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
        > "$OUT/wheels.log" 2>&1 || { status=1; echo "(wheels FAILED)"; tail -20 "$OUT/wheels.log"; }
    export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
else
    echo "no .whl carried: the Liger rows will be skipped (not importable)"
fi
if [ "${SKIP_BUILD:-0}" != 1 ]; then
    t0=$(date +%s)
    MAX_JOBS=16 python3 -m pip install -q --no-build-isolation --no-deps --no-index -e . > "$OUT/build.log" 2>&1 \
        || { tail -30 "$OUT/build.log"; echo "seqfuse BUILD FAILED"; exit 1; }
    echo "seqfuse build $(( $(date +%s) - t0 )) s"
fi
python3 -c "import seqfuse; assert seqfuse.cuda_available(), 'no CUDA backend'; print('seqfuse CUDA build')" || status=1

B="python3 benchmarks/hf/bench_accelerate.py ${BENCH_ARGS:-}"
for p in ${PARTS//,/ }; do
    # shellcheck disable=SC2086
    case $p in
        tests)   TAIL=15 run 150 tests python3 -m pytest -q -m cuda -rfE tests/test_hf_accelerate_fused.py \
                     tests/test_hf_accelerate.py ;;
        train)   TAIL=26 run 200 train $B --shape llama1b --seq 4096 ;;
        train8k) TAIL=26 run 200 train8k $B --shape llama1b --seq 8192 ;;
        prefill) TAIL=16 run 120 prefill $B --shape llama1b --seq 4096 --mode prefill \
                     --rows hf_eager,seqfuse_bf16,seqfuse_fp8_delayed,liger ;;
        qwen2)   TAIL=16 run 200 qwen2 $B --shape qwen2_1.5b --seq 4096 \
                     --rows hf_eager,seqfuse_bf16,seqfuse_fp8_delayed,liger ;;
        labels)  for m in deferred sync 0; do
                     TAIL=8 run 100 "labels_$m" env SEQFUSE_CHECK_LABELS=$m $B --shape llama1b --seq 4096 \
                         --rows seqfuse_bf16,seqfuse_fp8_delayed --steps 10 --out "hf_accelerate_labels_$m"
                 done ;;
        *) echo "unknown part '$p' (tests, train, train8k, prefill, qwen2, labels)"; status=1 ;;
    esac
done
cp benchmarks/results/hf_accelerate_*.json "$OUT/" 2>/dev/null
echo "gpu_accelerate status $status, $(( $(date +%s) - start )) s"
exit $status
