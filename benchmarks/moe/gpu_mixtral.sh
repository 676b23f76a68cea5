#!/usr/bin/env bash
# The Mixtral recipe on one H200 (issue 18, deliverable 5), one command from
# the repository root on the GPU machine: hydra from the carried wheels, the
# build (BUILD=0 skips it), the recipe's cuda tests (L0_sanity in bf16 and
# FP8 delayed / current / block), a short mixtral_small run of the recipe in
# bf16 and in FP8 block printing tokens/s, MFU and peak memory, then the
# training benchmark against transformers' MixtralForCausalLM (bf16 eager:
# grouped_mm experts and the expert loop).  Each step has its own time
# limit; the run is about 3-4 minutes after the build.  Logs and the result
# JSON are packed into $OUT/mixtral_run.tgz.
#
# Carry: .whl (hydra-core, omegaconf, antlr4 wheels), recipes/llama3/data/full
# (the prepared genomes, 42 MB: without it the recipe runs fall back to the
# committed subset and say so below), benchmarks/llama3/data (the benchmark's
# 8,192-base windows; without it the benchmark uses the subset and says so).
#   bash benchmarks/moe/gpu_mixtral.sh
# Knobs: TEST_LIMIT RUN_LIMIT BENCH_LIMIT (seconds), RUN_STEPS, BENCH_ARGS.
set -uo pipefail
cd "$(dirname "$0")/../.."
pack() { cp "$ROOT"/benchmarks/results/moe_mixtral_train.json "$LOG/" 2>/dev/null
         tar czf "$OUT/mixtral_run.tgz" -C "$LOG" .; cp "$LOG"/*.json "$OUT/" 2>/dev/null; }
source benchmarks/gpu_lib.sh  # gpu_setup, gpu_build, run
gpu_setup mixtral
STOP_SIGNAL=TERM  # a step at its limit is stopped at once
TAIL=${TAIL:-12}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
start=$(date +%s)
python3 -c "import hydra" 2>/dev/null || python3 -m pip install -q --no-index --no-deps .whl/hydra_core-*.whl \
    .whl/omegaconf-*.whl .whl/antlr4_python3_runtime-*.whl || { echo "hydra wheels missing: carry .whl"; exit 1; }
[ "${BUILD:-1}" = 0 ] || gpu_build
DATA=recipes/llama3/data/full
[ -f "$DATA/train.parquet" ] || { echo "$DATA not carried: the recipe runs use the committed subset (1,026-token windows)"
                                  DATA=recipes/llama3/data/subset; }
TAIL=8 run ${TEST_LIMIT:-150} cuda_tests python3 -m pytest -q -m cuda -p no:cacheprovider -rfEs tests/test_recipe_mixtral.py
STEPS=${RUN_STEPS:-40}
common=(--config mixtral_small "train.steps=$STEPS" train.warmup_steps=5 train.log_interval=10 train.eval_interval=0
        data.val_batches=2 logging.progress_bar=false "data.path=$DATA")
run ${RUN_LIMIT:-100} recipe_bf16 python3 recipes/mixtral/train_fsdp2.py "${common[@]}" precision.recipe=bf16
run ${RUN_LIMIT:-100} recipe_fp8_block python3 recipes/mixtral/train_fsdp2.py "${common[@]}" precision.recipe=fp8_block
TAIL=22 run ${BENCH_LIMIT:-150} bench python3 benchmarks/moe/bench_mixtral_train.py ${BENCH_ARGS:-}
echo "gpu_mixtral status $status, $(( $(date +%s) - start )) s"
exit $status
