#!/usr/bin/env bash
# The Llama 3 recipe under context parallelism on two GPUs, one command from
# the repository root: Llama 3.2 1B's shape (nucleotide vocabulary), bf16,
# one 16,384-token genome window per micro-batch (benchmarks/cp/data, real
# DNA: make_cp_data.py), torchrun --nproc_per_node 2 train_fsdp2_cp.py
# --config-name L0_sanity_cp cp_size=2 (FSDP2 over both ranks, each holding
# half of every sequence), STEPS optimizer steps (default 12; log every 4:
# the last window's tokens/s is the steady state), then prints tokens/s,
# step time, MFU and peak memory per GPU from the metrics JSONL.
# WITH_CP1=1 adds the same run on one GPU (cp_size=1) for comparison;
# COMM=all_gather switches the K/V exchange; PACKED=true runs the packed
# (thd) layout instead of [1, LEN] rows (every window is exactly LEN tokens,
# so the rows carry no padding; under CP the thd rotary path reads
# cu_seqlens on the host in every layer, which the rows avoid); LEN=32768
# with data made by make_cp_data.py --window 32768.  About 40 s per run on
# an H200 pair.
# Before the runs, on a bare machine: hydra from the carried wheels (.whl),
# the build (BUILD=0 skips it) and the CP cuda tests on two GPUs (TESTS=0
# skips them; about 2-3 minutes).
#   bash benchmarks/cp/gpu_cp_recipe.sh          (carry benchmarks/cp/data and .whl)
# Knobs for a CPU smoke: BUILD=0 TESTS=0 DEVICE=cpu MODEL="model.size=null" LEN=1024.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/seqfuse-cp}
mkdir -p "$OUT"
python3 -c "import hydra" 2>/dev/null || python3 -m pip install -q --no-index --no-deps .whl/hydra_core-*.whl \
    .whl/omegaconf-*.whl .whl/antlr4_python3_runtime-*.whl || { echo "hydra wheels missing: carry .whl"; exit 1; }
if [ "${BUILD:-1}" != 0 ]; then
    start=$(date +%s)
    MAX_JOBS=16 python3 -m pip install -q --no-build-isolation --no-deps --no-index -e . > "$OUT/build.log" 2>&1 \
        || { tail -30 "$OUT/build.log"; echo BUILD FAILED; exit 1; }
    echo "build $(( $(date +%s) - start )) s"
fi
if [ "${TESTS:-1}" != 0 ]; then
    echo "===== cuda tests (two GPUs)"
    timeout "${TEST_LIMIT:-300}" python3 -m pytest -q -m cuda -p no:cacheprovider -rfEs \
        tests/test_llama_context_parallel.py tests/test_recipe_llama3_cp.py > "$OUT/cuda_tests.log" 2>&1 \
        || echo "(cuda tests: exit $?)"
    tail -n 12 "$OUT/cuda_tests.log"
fi
if [ ! -f benchmarks/cp/data/train.parquet ]; then
    echo "benchmarks/cp/data is missing: run python3 benchmarks/cp/make_cp_data.py where recipes/llama3/data/full" \
         "is prepared, then carry benchmarks/cp/data"
    exit 2
fi
LEN=${LEN:-16384}
COMMON=(${MODEL:-model.size=1B} data.path=benchmarks/cp/data data.max_length=$LEN data.micro_batch_tokens=$LEN
        data.val_batches=1 train.steps=${STEPS:-12} train.warmup_steps=2 train.lr=3e-4 train.log_interval=4
        train.eval_interval=0 logging.progress_bar=false device=${DEVICE:-cuda} cp_comm_type=${COMM:-p2p}
        data.packed=${PACKED:-false})
status=0
run() {  # run NAME NPROC overrides...
    local name=$1 n=$2; shift 2
    echo "===== $name: $n process(es), $*"
    OMP_NUM_THREADS=4 timeout "${LIMIT:-120}" python3 -m torch.distributed.run --standalone --nproc_per_node "$n" \
        recipes/llama3/train_fsdp2_cp.py --config-name L0_sanity_cp "${COMMON[@]}" \
        "logging.metrics_jsonl=$OUT/$name.jsonl" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    if [ $rc != 0 ]; then status=1; echo "($name: exit $rc; 124: past LIMIT=${LIMIT:-120} s)"; tail -n 30 "$OUT/$name.log"; fi
    grep -E "context parallelism|step [0-9]+: loss" "$OUT/$name.log" | tail -n 3
}
run cp2_2gpu 2 cp_size=2
[ "${WITH_CP1:-0}" = 1 ] && run cp1_1gpu 1 cp_size=1
python3 - "$OUT" "$LEN" <<'PY'
import json, os, sys
out, n = sys.argv[1], sys.argv[2]
for name in ("cp2_2gpu", "cp1_1gpu"):
    p = os.path.join(out, f"{name}.jsonl")
    if not os.path.isfile(p):
        continue
    rows = [r for r in map(json.loads, open(p)) if "tokens_per_s" in r]
    if not rows:
        print(f"{name}: no logged step"); continue
    r = rows[-1]  # the last window: steady state
    mem = r.get("peak_mem_gib")
    print(f"{name}: {n} tokens/sequence, step {r['step']}: {r['tokens_per_s']:.0f} tokens/s (all GPUs), "
          f"step {r['step_time_ms']:.0f} ms, loss {r['loss']:.3f}, MFU {r.get('mfu_measured', float('nan')):.3f} "
          f"(measured bf16 peak), peak memory {mem if mem is None else round(mem, 2)} GiB per GPU")
PY
exit $status
