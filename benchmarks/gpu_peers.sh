#!/usr/bin/env bash
# The peer benchmarks' GPU run (issue 15), one command from the repository
# root on the GPU machine:
#   SEQFUSE_GIT_COMMIT=<sha> bash benchmarks/gpu_peers.sh [PARTS]
# PARTS is a comma list of
#   te_modules  benchmarks/peers/bench_te_modules.py  (seqfuse vs Transformer Engine modules)
#   torchao     benchmarks/peers/bench_torchao.py     (torchao float8 training, torch.compile)
#   liger       benchmarks/peers/bench_liger.py       (Liger-Kernel, torch eager and compiled)
#   esm2        benchmarks/esm2/bench_esm2.py at 650M  (HF length-grouped and compiled, TE, seqfuse)
# default: te_modules,torchao,liger.  Extra arguments per part: TE_MODULES_ARGS,
# TORCHAO_ARGS, LIGER_ARGS, ESM_ARGS (ESM_ROWS, ESM_STEPS pick the ESM-2 rows);
# time limits: TE_MODULES_LIMIT, TORCHAO_LIMIT, LIGER_LIMIT, ESM2_LIMIT, DEADLINE.
# Steps:
#   1. the carried wheels (.whl: torchao, liger-kernel) into /tmp/site (PYTHONPATH);
#   2. where a part needs it and .te was carried: Transformer Engine 2.20 as
#      ../shared/peers/prepare_te.py's docstring says (its PyTorch extension
#      builds here, about 2 minutes with MAX_JOBS=16);
#   3. seqfuse (pip install -e, about a minute);
#   4. each part under its own time limit, all inside DEADLINE seconds (570)
#      of the start, so the packing below always happens before the call's
#      10 minutes run out.
# Every step fails loudly (its log's tail and "(... FAILED)" in the output,
# exit status 1 at the end) but the later parts still run: a peer that does
# not install or import leaves its rows skipped with the reason, not the run
# lost.  Logs and result JSON go into $OUT/peers_run.tgz, the JSONs also into
# $OUT directly (at most 8 files come back).
# The working tree arrives without .git: SEQFUSE_GIT_COMMIT names the commit
# that every result JSON then records (benchmarks/peers/meta.py).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$(pwd)
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/seqfuse-peers}
LOG=$(mktemp -d /tmp/peers_run.XXXX)
SITE=/tmp/site
PARTS=${1:-te_modules,torchao,liger}
DEADLINE=${DEADLINE:-570}
ESM_STEPS=${ESM_STEPS:-8}
ESM_ROWS=${ESM_ROWS:-hf_bf16_padded,seqfuse_fp8_delayed_packed,te_fp8_delayed_packed,seqfuse_bf16_packed,te_bf16_packed,hfcompile_bf16_padded,hf_bf16_fixed,seqfuse_fp8_delayed_fixed,te_fp8_delayed_fixed,seqfuse_bf16_fixed,te_bf16_fixed,hfcompile_bf16_fixed,seqfuse_fp8_block_packed,te_fp8_block_packed,seqfuse_fp8_block_fixed,te_fp8_block_fixed}
RESULT_NAMES="te_modules torchao liger esm2_peers"
mkdir -p "$OUT"
start=$(date +%s)
status=0

pack() {
    for n in $RESULT_NAMES; do
        f="$ROOT/benchmarks/results/$n.json"
        [ -f "$f" ] && cp "$f" "$LOG/" && cp "$f" "$OUT/"
        [ -f "$ROOT/benchmarks/results/$n.png" ] && cp "$ROOT/benchmarks/results/$n.png" "$LOG/"
    done
    tar czf "$OUT/peers_run.tgz" -C "$LOG" .
    echo "packed $(ls "$LOG" | wc -l) files into \$OUT/peers_run.tgz after $(( $(date +%s) - start )) s"
}
trap pack EXIT
trap "exit 143" TERM

need() { [[ ",$PARTS," == *",$1,"* ]]; }
left() { echo $(( DEADLINE - ($(date +%s) - start) )); }

run() {  # run LIMIT NAME CMD...: log to $LOG/NAME.log, print its tail; the limit is cut to the deadline
    local limit=$1 name=$2; shift 2
    local rest; rest=$(left)
    (( rest < limit )) && limit=$rest
    if (( limit < 20 )); then
        echo "===== $name: NOT RUN (${rest} s left before the ${DEADLINE} s deadline)"; status=1; return
    fi
    echo "===== $name (limit ${limit} s, at $(( $(date +%s) - start )) s)"
    timeout "$limit" "$@" > "$LOG/$name.log" 2>&1
    local rc=$?
    (( rc != 0 )) && { status=1; echo "($name FAILED: exit $rc$( ((rc == 124)) && echo ', timed out'))"; }
    tail -n "${TAIL:-25}" "$LOG/$name.log"
}

for p in ${PARTS//,/ }; do
    case $p in te_modules|torchao|liger|esm2) ;; *) echo "unknown part '$p' (te_modules, torchao, liger, esm2)"; exit 2;; esac
done
[ -d .git ] || [ -n "${SEQFUSE_GIT_COMMIT:-}" ] || echo "WARNING: no .git and SEQFUSE_GIT_COMMIT unset: the JSONs cannot name their commit"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "parts: $PARTS; commit ${SEQFUSE_GIT_COMMIT:-from git}"

# 1. carried wheels (torchao, liger-kernel, ...)
if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
        > "$LOG/wheels.log" 2>&1 || { status=1; echo "(wheels FAILED)"; tail -20 "$LOG/wheels.log"; }
    export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
    echo "wheels: $(ls .whl | tr '\n' ' ')"
else
    echo "no .whl carried: torchao and Liger rows will be skipped (not importable)"
fi

# 2. Transformer Engine, for the parts that compare with it
if need te_modules || need esm2; then
    if ls .te/transformer_engine_torch-*.tar.gz > /dev/null 2>&1; then
        t0=$(date +%s)
        { python3 -m pip install -q --no-index --no-deps .te/*.whl &&
          NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_FRAMEWORK=pytorch NVTE_CUDA_ARCHS=90 MAX_JOBS=16 \
              timeout "$(( $(left) - 200 ))" python3 -m pip install -q --no-deps --no-build-isolation --no-index \
              .te/transformer_engine_torch-*.tar.gz; } > "$LOG/te_install.log" 2>&1 \
            || { status=1; echo "(Transformer Engine install FAILED: its rows will be skipped)"; tail -30 "$LOG/te_install.log"; }
        echo "Transformer Engine install $(( $(date +%s) - t0 )) s"
        # One cuDNN per process, torch's bundled one.  TE's import loads the
        # first libcudnn it finds under CUDNN_HOME, CUDNN_PATH, CUDA_HOME,
        # /usr/local/cuda (the GPU machine has 9.14 there, torch runs 9.19):
        # with torch's cuDNN loaded first, TE's import failed (undefined
        # symbol in libcudnn_cnn.so.9); with TE's loaded first, torch refused
        # the version; with only LD_LIBRARY_PATH set, TE still loaded 9.14 and
        # its FusedAttention failed with CUDNN_STATUS_SUBLIBRARY_LOADING_FAILED,
        # so TE ran unfused attention (logs/te_attention_backend_h200_s10.log).
        # CUDNN_HOME points TE's search at torch's cuDNN; LD_LIBRARY_PATH puts
        # the same directory first for the sub-libraries.
        CUDNN_LIB=$(python3 -c "import os, nvidia.cudnn as c; print(os.path.join(list(c.__path__)[0], 'lib'))" 2>/dev/null)
        if [ -n "$CUDNN_LIB" ] && [ -d "$CUDNN_LIB" ]; then
            export LD_LIBRARY_PATH=$CUDNN_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
            export CUDNN_HOME=$(dirname "$CUDNN_LIB")
            echo "TE and torch share torch's cuDNN: CUDNN_HOME=$CUDNN_HOME, LD_LIBRARY_PATH starts with $CUDNN_LIB"
        fi
        python3 -c "import transformer_engine.pytorch as te, transformer_engine as t; print('transformer_engine', getattr(t, '__version__', '?'), 'imports')" \
            2>&1 | tail -3 | tee -a "$LOG/te_install.log"
    else
        echo "no .te carried: Transformer Engine rows will be skipped (not importable)"
    fi
fi

# 3. seqfuse (SKIP_BUILD=1: use the seqfuse already importable, for a dry run of this script's plumbing)
t0=$(date +%s)
if [ "${SKIP_BUILD:-0}" != 1 ]; then
    MAX_JOBS=16 python3 -m pip install -q --no-build-isolation --no-deps --no-index -e . > "$LOG/build.log" 2>&1 \
        || { tail -30 "$LOG/build.log"; echo "seqfuse BUILD FAILED"; exit 1; }
    echo "seqfuse build $(( $(date +%s) - t0 )) s"
fi
python3 -c "import seqfuse; assert seqfuse.cuda_available(), 'seqfuse has no CUDA backend here'; print('seqfuse CUDA build')" \
    || { status=1; echo "(seqfuse CUDA check FAILED: the parts below will fail)"; }

# 4. the parts, in the order given
for p in ${PARTS//,/ }; do
    # shellcheck disable=SC2086  # the *_ARGS are word lists
    case $p in
        te_modules) TAIL=40 run "${TE_MODULES_LIMIT:-200}" te_modules python3 benchmarks/peers/bench_te_modules.py \
                        ${TE_MODULES_ARGS:-} ;;
        torchao)    TAIL=30 run "${TORCHAO_LIMIT:-240}" torchao python3 benchmarks/peers/bench_torchao.py \
                        ${TORCHAO_ARGS:-} ;;
        liger)      TAIL=14 run "${LIGER_LIMIT:-150}" liger python3 benchmarks/peers/bench_liger.py ${LIGER_ARGS:-} ;;
        esm2)       TAIL=45 run "${ESM2_LIMIT:-420}" esm2 python3 benchmarks/esm2/bench_esm2.py --size 650M \
                        --steps "$ESM_STEPS" --out esm2_peers --rows "$ESM_ROWS" ${ESM_ARGS:-} ;;
    esac
done
echo "gpu_peers status $status, $(( $(date +%s) - start )) s"
exit $status
