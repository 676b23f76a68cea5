#!/usr/bin/env bash
# The peer benchmarks' GPU run (issue 15), one command from the repository
# root on the GPU machine:
#   SEQFUSE_GIT_COMMIT=<sha> bash benchmarks/gpu_peers.sh [PARTS]
# PARTS is a comma list, run in the order given:
#   esm2         benchmarks/esm2/bench_esm2.py at 650M (HF length-grouped and
#                compiled, HF on torchao float8 tensorwise compiled, TE
#                TransformerLayer thd/bshd, seqfuse)               -> esm2_peers.json
#   te_modules   benchmarks/peers/bench_te_modules.py (seqfuse vs Transformer
#                Engine modules)                                    -> te_modules.json
#   torchao      benchmarks/peers/bench_torchao.py (torchao float8 training,
#                torch.compile)                                     -> torchao.json
#   liger_llama  benchmarks/llama3/bench_llama3.py, Llama 3 1B training with
#                transformers eager, Liger-patched and compiled    -> llama3_liger.json
#   liger        benchmarks/peers/bench_liger.py (Liger-Kernel's kernels, torch
#                eager and compiled)                                -> liger.json
# default: te_modules,torchao,liger.  Extra arguments per part: ESM_ARGS,
# TE_MODULES_ARGS, TORCHAO_ARGS, LIGER_LLAMA_ARGS, LIGER_ARGS (ESM_ROWS,
# ESM_STEPS pick the ESM-2 rows, LLAMA_ROWS the Llama rows); time limits in
# seconds: ESM2_LIMIT, TE_MODULES_LIMIT, TORCHAO_LIMIT, LIGER_LLAMA_LIMIT,
# LIGER_LIMIT, TE_BUILD_LIMIT, and DEADLINE for all the parts together.
# Steps:
#   1. the carried wheels (.whl: torchao, liger-kernel) into /tmp/site (PYTHONPATH);
#      without a torchao wheel there the torchao part and the ESM-2 hfao rows
#      are skipped (not importable), and the run says so;
#   2. two builds at once: Transformer Engine 2.20 from the carried .te (as
#      ../shared/peers/prepare_te.py's docstring says, then shrunk by
#      benchmarks/peers/shrink_te_wheels.py to fit 64 MiB beside the tree; its PyTorch extension
#      builds here in about 2 minutes), where a part compares with it, in the
#      background, and seqfuse (pip install -e; SEQFUSE_CUDA_ARCHS passes
#      through, e.g. "90a" for the H200 alone; at nice 10 beside TE's build,
#      the longer one), then waits for both;
#   3. where TE built: TE and torch share torch's cuDNN (CUDNN_HOME, see
#      below), and benchmarks/peers/te_probe.py says which attention TE runs
#      (TE_PROBE lines).  Where it is not cuDNN's fused attention, the ESM-2
#      TE rows on packed batches are left out (unfused attention ran out of
#      memory on them), unless TE_UNFUSED_PACKED=1;
#   4. each part under its own time limit, all inside DEADLINE seconds (570)
#      of the start; after every part its JSON is copied to $OUT and the logs
#      packed, so a run cut short still brings back what it measured.
#   5. benchmarks/peers/summary.py: one short line per result row of the
#      JSONs this run wrote (the results folder also holds earlier sessions'
#      files, which are neither summarized nor sent back; the reply's output
#      tail is short, the full logs are in the tarball).
# Every step fails loudly (its log's tail and "(... FAILED)" in the output,
# exit status 1 at the end) but the later parts still run: a peer that does
# not install or import leaves its rows skipped with the reason, not the run
# lost.  Logs and result JSON go into $OUT/peers_run.tgz, the JSONs also into
# $OUT directly (at most 8 files come back: six JSONs and the tarball).
# The working tree arrives without a current .git: SEQFUSE_GIT_COMMIT names
# the commit that every result JSON then records (benchmarks/peers/meta.py).
# DRY_RUN=1 prints the plan (steps, parts, limits, commands) and runs
# nothing: the CPU check of this script's plumbing (tests/test_gpu_peers_plan.py);
# there TE_PROBE=fused|unfused stands for the probe's verdict.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$(pwd)
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/seqfuse-peers}
LOG=$(mktemp -d /tmp/peers_run.XXXX)
SITE=${SITE:-/tmp/site}
PARTS=${1:-te_modules,torchao,liger}
DEADLINE=${DEADLINE:-570}
DRY=${DRY_RUN:-0}
ESM_STEPS=${ESM_STEPS:-8}
# TE's own rows first in each pair (its import and first cuDNN graphs are paid
# before seqfuse's twin runs); the compiled HF row on real lengths (a ~30 s
# compile), then HF on torchao's float8 (tensorwise) compiled the same way,
# fixed and real lengths, and the block-scaling rows last, so a cut drops
# those first.
ESM_ROWS=${ESM_ROWS:-te_bf16_packed,seqfuse_bf16_packed,te_fp8_delayed_packed,seqfuse_fp8_delayed_packed,seqfusegraph_fp8_delayed_packed,hf_bf16_padded,te_bf16_fixed,seqfuse_bf16_fixed,te_fp8_delayed_fixed,seqfuse_fp8_delayed_fixed,seqfusegraph_fp8_delayed_fixed,hfcompile_bf16_fixed,hf_bf16_fixed,hfcompile_bf16_padded,hfao_fp8_tensorwise_fixed,hfao_fp8_tensorwise_padded,te_fp8_block_fixed,seqfuse_fp8_block_fixed}
LLAMA_ROWS=${LLAMA_ROWS:-hf_bf16,hf_bf16_liger,seqfuse_bf16_packed,seqfuse_fp8_delayed_packed,hf_bf16_compiled}
# in the order the summary prints them: the headline tables last, since the reply keeps the end of the output
RESULT_NAMES="liger torchao llama3_liger te_modules te_attention_probe esm2_peers"
mkdir -p "$OUT"
start=$(date +%s)
status=0

touch "$LOG/.start"
fresh() {  # the result names whose JSON this run wrote (older ones in the tree are earlier sessions' records)
    local n
    for n in $RESULT_NAMES; do
        [ "$ROOT/benchmarks/results/$n.json" -nt "$LOG/.start" ] && echo "$n"
    done
}

pack() {
    for n in $(fresh); do
        cp "$ROOT/benchmarks/results/$n.json" "$LOG/" && cp "$ROOT/benchmarks/results/$n.json" "$OUT/"
        [ "$ROOT/benchmarks/results/$n.png" -nt "$LOG/.start" ] && cp "$ROOT/benchmarks/results/$n.png" "$LOG/"
    done
    tar czf "$OUT/peers_run.tgz" -C "$LOG" . 2>/dev/null
    echo "(packed $(ls "$LOG" | wc -l) files into \$OUT/peers_run.tgz at $(( $(date +%s) - start )) s)"
}
if (( DRY )); then trap 'rm -rf "$LOG"' EXIT; else trap pack EXIT; fi
trap "exit 143" TERM

need() { [[ ",$PARTS," == *",$1,"* ]]; }
left() { echo $(( DEADLINE - ($(date +%s) - start) )); }

run() {  # run LIMIT NAME CMD...: log to $LOG/NAME.log, print its tail; the limit is cut to the deadline
    local limit=$1 name=$2; shift 2
    local rest; rest=$(left)
    (( rest < limit )) && limit=$rest
    if (( DRY )); then
        echo "===== $name (limit ${limit} s): $*"; return
    fi
    if (( limit < 20 )); then
        echo "===== $name: NOT RUN (${rest} s left before the ${DEADLINE} s deadline)"; status=1; return
    fi
    echo "===== $name (limit ${limit} s, at $(( $(date +%s) - start )) s)"
    timeout -k 10 "$limit" "$@" > "$LOG/$name.log" 2>&1
    local rc=$?
    (( rc != 0 )) && { status=1; echo "($name FAILED: exit $rc$( ((rc == 124 || rc == 137)) && echo ', timed out'))"; }
    # the lines that carry results (tables of every column are in the log, too wide for the reply)
    grep -E "${KEEP:-^\[|^goal|Error|error:}" "$LOG/$name.log" | cut -c1-"${WIDTH:-220}" | tail -n "${TAIL:-25}"
}

for p in ${PARTS//,/ }; do
    case $p in esm2|te_modules|torchao|liger_llama|liger) ;;
        *) echo "unknown part '$p' (esm2, te_modules, torchao, liger_llama, liger)"; exit 2;; esac
done
[ -d .git ] || [ -n "${SEQFUSE_GIT_COMMIT:-}" ] || echo "WARNING: no .git and SEQFUSE_GIT_COMMIT unset: the JSONs cannot name their commit"
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "parts: $PARTS; commit ${SEQFUSE_GIT_COMMIT:-from git}; deadline ${DEADLINE} s$( ((DRY)) && echo '; DRY RUN: nothing runs')"

# 1. carried wheels (torchao, liger-kernel, ...)
if ls .whl/*.whl > /dev/null 2>&1; then
    if (( DRY )); then
        echo "would install into $SITE: $(ls .whl | tr '\n' ' ')"
    else
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
            > "$LOG/wheels.log" 2>&1 || { status=1; echo "(wheels FAILED)"; tail -20 "$LOG/wheels.log"; }
        echo "wheels: $(ls .whl | tr '\n' ' ')"
    fi
    export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
    ls .whl/torchao-*.whl > /dev/null 2>&1 ||
        echo "no torchao wheel in .whl: the torchao part and the ESM-2 hfao rows will be skipped (not importable)"
else
    echo "no .whl carried: torchao and Liger rows will be skipped (not importable)"
fi

# 2. Transformer Engine (background) and seqfuse (foreground), built at once
te_pid=
te_ok=0
if need te_modules || need esm2; then
    if ! ls .te/transformer_engine_torch-*.tar.gz > /dev/null 2>&1; then
        echo "no .te carried: Transformer Engine rows will be skipped (not importable)"
    elif (( DRY )); then
        echo "would build Transformer Engine from .te in the background (limit ${TE_BUILD_LIMIT:-280} s, MAX_JOBS ${TE_JOBS:-16})"
        te_ok=1
    else
        ( t0=$(date +%s)
          python3 -m pip install -q --no-index --no-deps .te/*.whl &&
          NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_FRAMEWORK=pytorch NVTE_CUDA_ARCHS=90 MAX_JOBS=${TE_JOBS:-16} \
              timeout -k 10 "${TE_BUILD_LIMIT:-280}" python3 -m pip install -q --no-deps --no-build-isolation --no-index \
              .te/transformer_engine_torch-*.tar.gz
          echo "$? $(( $(date +%s) - t0 ))" > "$LOG/te_build.status" ) > "$LOG/te_install.log" 2>&1 &
        te_pid=$!
    fi
fi

t0=$(date +%s)
if (( DRY )); then
    echo "would build seqfuse (pip install -e ., SEQFUSE_CUDA_ARCHS=${SEQFUSE_CUDA_ARCHS:-setup.py default}, MAX_JOBS ${SEQFUSE_JOBS:-16})"
elif [ "${SKIP_BUILD:-0}" != 1 ]; then  # SKIP_BUILD=1: use the seqfuse already importable
    # beside TE's build (the longer one, about 2 minutes) seqfuse's runs at a lower priority: TE's
    # compile jobs get the cores first and seqfuse's fill the rest, so both end about when TE alone would
    nice_cmd=(); [ -n "$te_pid" ] && nice_cmd=(nice -n 10)
    MAX_JOBS=${SEQFUSE_JOBS:-16} "${nice_cmd[@]}" python3 -m pip install -q --no-build-isolation --no-deps --no-index -e . \
        > "$LOG/build.log" 2>&1 || { tail -30 "$LOG/build.log"; echo "seqfuse BUILD FAILED"; exit 1; }
    echo "seqfuse build $(( $(date +%s) - t0 )) s (SEQFUSE_CUDA_ARCHS=${SEQFUSE_CUDA_ARCHS:-setup.py default})"
fi
if [ -n "$te_pid" ]; then
    wait "$te_pid"
    read -r te_rc te_s 2>/dev/null < "$LOG/te_build.status" || { te_rc=1; te_s=?; }
    if (( te_rc == 0 )); then
        te_ok=1; echo "Transformer Engine built in ${te_s} s (at $(( $(date +%s) - start )) s)"
    else
        status=1; echo "(Transformer Engine install FAILED: exit ${te_rc} after ${te_s} s: its rows will be skipped)"
        tail -30 "$LOG/te_install.log"
    fi
fi
(( DRY )) || python3 -c "import seqfuse; assert seqfuse.cuda_available(), 'seqfuse has no CUDA backend here'; print('seqfuse CUDA build')" \
    || { status=1; echo "(seqfuse CUDA check FAILED: the parts below will fail)"; }

# 3. One cuDNN per process, torch's own.  TE's import loads the first
# libcudnn it finds under CUDNN_HOME, CUDNN_PATH, CUDA_HOME, /usr/local/cuda
# (the GPU machine has 9.14 there, torch runs 9.19): with torch's cuDNN loaded
# first, TE's import failed (undefined symbol in libcudnn_cnn.so.9); with TE's
# loaded first, torch refused the version; with only LD_LIBRARY_PATH set, TE
# still loaded 9.14 and its FusedAttention failed with
# CUDNN_STATUS_SUBLIBRARY_LOADING_FAILED, so TE ran unfused attention
# (logs/te_attention_backend_h200_s10.log).  CUDNN_HOME points TE's search at
# the libcudnn.so that torch itself maps (read from /proc/self/maps, the
# nvidia.cudnn package as a second guess); LD_LIBRARY_PATH puts the same
# directory first for cuDNN's sub-libraries.
te_fused=0
if (( te_ok )) && (( ! DRY )); then
    CUDNN_SO=$(python3 -c "
import torch
torch.backends.cudnn.version()
maps = sorted({l.split()[-1] for l in open('/proc/self/maps') if '/libcudnn.so' in l})
print(maps[0] if maps else '')" 2>/dev/null)
    if [ -n "$CUDNN_SO" ]; then
        CUDNN_LIB=$(dirname "$CUDNN_SO")
    else
        CUDNN_LIB=$(python3 -c "import os, nvidia.cudnn as c; print(os.path.join(list(c.__path__)[0], 'lib'))" 2>/dev/null)
    fi
    if [ -n "$CUDNN_LIB" ] && [ -d "$CUDNN_LIB" ]; then
        export LD_LIBRARY_PATH=$CUDNN_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
        export CUDNN_HOME=$(dirname "$CUDNN_LIB")
        echo "TE and torch share torch's cuDNN: ${CUDNN_SO:-$CUDNN_LIB}; CUDNN_HOME=$CUDNN_HOME"
    else
        echo "WARNING: torch's cuDNN not found: TE may load another cuDNN and run unfused attention"
    fi
    # with TE's attention debug log: where a backend is disabled, TE says why ("Disabling FusedAttention: ...")
    KEEP="^TE_PROBE|Error|Disabling (FusedAttention|UnfusedDot)|Selected backend" TAIL=24 WIDTH=300 run "${TE_PROBE_LIMIT:-60}" te_probe \
        env NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2 python3 benchmarks/peers/te_probe.py
    grep -q "^TE_PROBE fused_all=yes" "$LOG/te_probe.log" && te_fused=1
elif (( te_ok )); then
    echo "would point CUDNN_HOME at torch's cuDNN, then run benchmarks/peers/te_probe.py (TE_PROBE=${TE_PROBE:-fused})"
    [ "${TE_PROBE:-fused}" = fused ] && te_fused=1
fi
if (( te_ok )) && (( ! te_fused )); then
    status=1
    echo "WARNING: Transformer Engine does NOT run cuDNN fused attention here (te_probe above): its TransformerLayer"
    echo "         and ESM-2 rows are against a handicapped TE; each row's te_attention says which backend ran"
    if [ "${TE_UNFUSED_PACKED:-0}" != 1 ]; then
        ESM_ROWS=$(echo "$ESM_ROWS" | tr ',' '\n' | grep -v -E '^te_.*_packed$' | paste -sd, -)
        echo "         the ESM-2 TE rows on packed batches are left out (unfused attention ran out of memory on them)"
    fi
fi

# 4. the parts, in the order given
for p in ${PARTS//,/ }; do
    # shellcheck disable=SC2086  # the *_ARGS are word lists
    case $p in
        esm2)        KEEP="^\[esm2 bench\]|^goal|SAMPLE" TAIL=30 run "${ESM2_LIMIT:-420}" esm2 \
                         python3 benchmarks/esm2/bench_esm2.py --size 650M --steps "$ESM_STEPS" --out esm2_peers \
                         --rows "$ESM_ROWS" ${ESM_ARGS:-} ;;
        te_modules)  if (( ! te_ok )); then
                         echo "===== te_modules: NOT RUN (Transformer Engine did not build or was not carried)"; status=1
                     else
                         TAIL=8 run "${TE_MODULES_LIMIT:-200}" te_modules python3 benchmarks/peers/bench_te_modules.py \
                             ${TE_MODULES_ARGS:-}
                     fi ;;
        torchao)     TAIL=8 run "${TORCHAO_LIMIT:-240}" torchao python3 benchmarks/peers/bench_torchao.py ${TORCHAO_ARGS:-} ;;
        liger_llama) KEEP="^\[llama3 bench\]" TAIL=12 run "${LIGER_LLAMA_LIMIT:-120}" liger_llama \
                         python3 benchmarks/llama3/bench_llama3.py --size 1B --parts train --batch-size 4 --steps 3 \
                         --warm-passes 1 --rows "$LLAMA_ROWS" --out llama3_liger ${LIGER_LLAMA_ARGS:-} ;;
        liger)       TAIL=8 run "${LIGER_LIMIT:-150}" liger python3 benchmarks/peers/bench_liger.py ${LIGER_ARGS:-} ;;
    esac
    (( DRY )) || pack
done

# 5. one line per result row, last, where the reply's output tail shows it
if (( DRY )); then
    echo "would summarize: python3 benchmarks/peers/summary.py $RESULT_NAMES"
else
    written=$(fresh | tr '\n' ' ')
    echo "===== summary (at $(( $(date +%s) - start )) s): results written by this run: ${written:-none}"
    [ -n "$written" ] && python3 benchmarks/peers/summary.py $written 2>&1
fi
echo "gpu_peers status $status, $(( $(date +%s) - start )) s"
exit $status
