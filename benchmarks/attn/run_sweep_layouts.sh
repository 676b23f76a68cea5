#!/usr/bin/env bash
# Issue 19's grid, only the layouts bench_routes.py --sweep gained after s33
# (padded bshd with a key-padding mask, sbhd, sliding window (256, 0), GQA
# q/4 k/v heads), at sequences 1,024 / 4,096 / 8,192 x head dims 64 / 128 x
# full / causal (window and gqa in the causal cells only): 12 cells, 84 rows
# a direction (5 in a full cell, 9 in a causal one), in one GPU call from the
# repository root on the GPU machine:
#   SEQFUSE_GIT_COMMIT=<sha> bash benchmarks/attn/run_sweep_layouts.sh
# (SKIP_BUILD=1 uses the seqfuse already built; LIMIT the benchmark's seconds,
# default 100; NAME the result name, default bench_routes_sweep_layouts.)
#
# Estimated time, H200 (from s32's sweep at 15f96d3: cuDNN ceiling and
# varlen_attn ms per cell; SDPA with a mask assumed 4x cuDNN's full call):
# a timing is 25 calls (5 warm-ups + 20), so a cell costs 25 x the sum of its
# rows' forward and forward+backward ms, plus its output checks (about 3
# forward+backward per layout) and ~0.1 s a row of first calls (cuDNN plans):
# 1.1-1.7 s a cell at 1,024, 1.8-2.4 s at 4,096, 2.6-3.4 s at 8,192; about
# 26 s for the 12 cells, ~40 s with the imports and CUDA start, ~110-125 s
# with the build (59-83 s): one device call of at most ~150 s.
#
# Back in $OUT: NAME.json (every row: layout, ms, tflops, vs_ceiling,
# vs_peer, check_scaled_err / check_scaled_err_grad, error) and
# sweep_layouts.log; the output ends with one line per cell and layout.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
NAME=${NAME:-bench_routes_sweep_layouts}
pack() { cp "$ROOT/benchmarks/results/$NAME.json" "$LOG/" 2>/dev/null
         cp "$LOG"/*.log "$LOG"/*.json "$OUT/" 2>/dev/null; }
source benchmarks/gpu_lib.sh  # gpu_setup, gpu_build, run
gpu_setup sweep_layouts
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
start=$(date +%s)
[ "${SKIP_BUILD:-0}" = 1 ] || gpu_build
TAIL=4 run "${LIMIT:-100}" sweep_layouts python3 benchmarks/attn/bench_routes.py --sweep \
    --sweep-layouts padded,sbhd,window,gqa --sweep-seqs 1024,4096,8192 --sweep-dims 64,128 --out "$NAME"
python3 - "$ROOT/benchmarks/results/$NAME.json" <<'EOF' || status=1
import collections, json, sys
doc = json.load(open(sys.argv[1]))
groups = collections.OrderedDict()
for r in doc["rows"]:
    groups.setdefault((r["case"].replace("sweep ", ""), r.get("layout", "?")), []).append(r)
for (case, layout), rows in groups.items():
    parts = []
    for r in rows:
        tag = r["route"].split(":")[0].split(" ")[0] + (".f" if r["direction"] == "forward" else ".fb")
        if "ms" not in r:
            parts.append(f"{tag} ERROR {r.get('error', '')[:70]}")
            continue
        ratio = "".join(f" {k[3:]} {r[k]:.2f}" for k in ("vs_ceiling", "vs_peer") if k in r and tag[0] == "a")
        parts.append(f"{tag} {r['ms']:.3f}{ratio}")
    check = next((r for r in rows if "check_scaled_err" in r), None)
    err = f" | err {check['check_scaled_err']:.1e}/{check['check_scaled_err_grad']:.1e}" if check else ""
    print(f"{case:18} {layout:6} " + "; ".join(parts) + err)
print("interrupted" if doc.get("interrupted") else "complete", len(doc["rows"]), "rows")
EOF
echo "run_sweep_layouts status $status, $(( $(date +%s) - start )) s"
exit $status
