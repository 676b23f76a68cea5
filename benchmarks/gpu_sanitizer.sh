#!/usr/bin/env bash
# compute-sanitizer over seqfuse's CUDA kernels (issue 23), one command from
# the repository root on the GPU machine, about 4 minutes:
#   bash benchmarks/gpu_sanitizer.sh            # logs in $OUT (default /tmp/seqfuse-sanitizer)
#
# Steps (PARTS, comma list; default build,memcheck,racecheck):
#   build      pip install -e . (skip with BUILD=0 where the tree is built)
#   memcheck   a sample of the cuda tests of attention (sm80 and sm90),
#              gemm, FP8 quantization (cast, amax), norms, cross-entropy,
#              RoPE, activations, AdamW and the MoE kernels (grouped GEMM,
#              router, permutation) (PER ids per file, default 10), in three processes under
#              compute-sanitizer --tool memcheck (leak check with LEAKS=1), with torch's
#              caching allocator off (PYTORCH_NO_CUDA_MEMORY_CACHING=1) so
#              every tensor is its own cudaMalloc and an access past a
#              tensor's end is reported instead of landing in a pooled block
#   racecheck  two attention tests per file (forward + backward, sm80 and sm90)
#              under --tool racecheck (shared-memory hazards)
#   initcheck, synccheck   the same attention test under those tools (not in
#              the default PARTS; add them when time allows)
#   checks     the standalone kernel checks (csrc/*/check_*.cu, built by
#              csrc/build_checks.sh) under memcheck (not in the default PARTS:
#              the build takes minutes)
# Each step has a time limit; a step's verdict is the sanitizer's own summary
# ("ERROR SUMMARY: 0 errors") and the tests' exit status.  The last lines
# printed are one verdict per step; status 0 means every step was clean.
set -uo pipefail
set -f  # test ids hold [ ]: no globbing
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/seqfuse-sanitizer}
mkdir -p "$OUT"
SAN=${SANITIZER:-compute-sanitizer}
command -v "$SAN" > /dev/null || SAN=/usr/local/cuda/bin/compute-sanitizer
PARTS=${PARTS:-build,memcheck,racecheck}
want() { [[ ",$PARTS," == *",$1,"* ]]; }
status=0
verdicts=()
start=$(date +%s)
trap 'printf "%s\n" "${verdicts[@]}" > "$OUT/verdicts.txt"' EXIT

# run LIMIT NAME TOOL CMD...: CMD under the sanitizer TOOL, log $OUT/NAME.log
san() {
    local limit=$1 name=$2 tool=$3; shift 3
    local extra=()
    # leak reports are opt-in (LEAKS=1): torch tensors still alive at exit are reported as leaks,
    # which says nothing about seqfuse's kernels
    [ "$tool" = memcheck ] && [ "${LEAKS:-0}" = 1 ] && extra=(--leak-check full)
    echo "===== $name ($tool, limit ${limit}s)"
    timeout "$limit" "$SAN" --tool "$tool" "${extra[@]}" --target-processes all --print-limit 30 \
        --error-exitcode 97 "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    local summary
    summary=$(grep -h "ERROR SUMMARY\|RACECHECK SUMMARY\|LEAK SUMMARY" "$OUT/$name.log" | sort | uniq -c | tr '\n' ';')
    if [ $rc -eq 0 ]; then
        verdicts+=("CLEAN  $name ($tool): $summary")
    else
        status=1
        verdicts+=("FAIL   $name ($tool) exit $rc: $summary")
        grep -m 20 -B2 -A8 "=========     \(Invalid\|Race\|Uninitialized\|Barrier\)\|Program hit\|FAILED\|Error" \
            "$OUT/$name.log" | head -60
    fi
    tail -n 4 "$OUT/$name.log"
}

if want build && [ "${BUILD:-1}" != 0 ]; then
    MAX_JOBS=16 timeout 200 python3 -m pip install -q --no-build-isolation --no-deps --no-index -e . \
        > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; echo BUILD FAILED; exit 1; }
    echo "build $(( $(date +%s) - start )) s"
fi

# A sample of each file's cuda tests (the full set is thousands of cases;
# under memcheck a kernel runs 10-100x slower): PER evenly spaced test ids
# per file, picked from pytest's own collection, listed in $OUT/selected_*.txt.
pick() {  # pick PER FILE...: print the chosen node ids
    local per=$1; shift
    python3 -m pytest -q --collect-only -m cuda -p no:cacheprovider "$@" 2>/dev/null | python3 -c "
import sys, collections
per = int(sys.argv[1]); by = collections.OrderedDict()
for line in sys.stdin:
    line = line.strip()
    if '::' in line:
        by.setdefault(line.split('::')[0], []).append(line)
for ids in by.values():
    step = max(1, len(ids) // per)
    print('\n'.join(ids[::step][:per]))
" "$per"
}
PYT=(python3 -m pytest -q -p no:cacheprovider)
if want memcheck; then
    pick ${PER:-10} tests/test_attn_cuda.py tests/test_attn_sm90_cuda.py > "$OUT/selected_attention.txt"
    pick ${PER:-10} tests/test_gemm.py tests/test_quant_cast.py tests/test_amax.py tests/test_norm.py \
        tests/test_cross_entropy.py tests/test_rope.py > "$OUT/selected_kernels.txt"
    pick ${PER:-10} tests/test_act.py tests/test_adamw.py tests/test_moe_grouped_gemm.py tests/test_moe_permute.py \
        tests/test_moe_router.py > "$OUT/selected_act_optim_moe.txt"
    echo "memcheck sample: $(wc -l < "$OUT/selected_attention.txt") attention, $(wc -l < "$OUT/selected_kernels.txt")" \
         "gemm/quant/norm/loss/rope, $(wc -l < "$OUT/selected_act_optim_moe.txt") act/optim/moe tests"
    export PYTORCH_NO_CUDA_MEMORY_CACHING=1
    # shellcheck disable=SC2046
    san ${MEM_LIMIT:-90} memcheck_attention memcheck "${PYT[@]}" $(cat "$OUT/selected_attention.txt")
    # shellcheck disable=SC2046
    san ${MEM_LIMIT:-90} memcheck_gemm_quant_norm_loss_rope memcheck "${PYT[@]}" $(cat "$OUT/selected_kernels.txt")
    # shellcheck disable=SC2046
    san ${MEM_LIMIT:-90} memcheck_act_optim_moe memcheck "${PYT[@]}" $(cat "$OUT/selected_act_optim_moe.txt")
    unset PYTORCH_NO_CUDA_MEMORY_CACHING
fi
pick 2 tests/test_attn_cuda.py tests/test_attn_sm90_cuda.py > "$OUT/selected_race.txt"
ATTN_ONE=("${PYT[@]}" $(cat "$OUT/selected_race.txt"))
want racecheck && san 60 racecheck_attention racecheck "${ATTN_ONE[@]}"
want initcheck && san 60 initcheck_attention initcheck "${ATTN_ONE[@]}"
want synccheck && san 60 synccheck_attention synccheck "${ATTN_ONE[@]}"
if want checks; then
    timeout 300 bash csrc/build_checks.sh > "$OUT/build_checks.log" 2>&1 || { status=1; tail -20 "$OUT/build_checks.log"; }
    for b in bin/check_*; do
        [ -x "$b" ] && san 60 "memcheck_$(basename "$b")" memcheck "$b"
    done
fi
echo "----- verdicts ($(( $(date +%s) - start )) s)"
printf "%s\n" "${verdicts[@]}"
exit $status
