#!/usr/bin/env bash
# Session 53's fourth GPU call, asked of an H200 first (issue 18's machine): the Mixtral rows with the graphed row
# captured after two eager training steps (--eager-before-graphs 2: under delayed scaling no step then runs
# eagerly beside the graphs' pool), in one process with the transformers rows (run a) and again (run b); then the
# compiled transformers row, the eager-layer row and the graphed row each alone, for reserved memory from an empty
# allocator.  First the cuda tests of graphed modules: graphed layers now hold each parameter's gradient once (the
# graph's buffer, copied out only before a replay that would overwrite it).  Carry .whl and .s52/carry
# (gpu_call_s53_1_not_run.sh's header says how to make them):
#   SEQFUSE_GIT_COMMIT=<sha> bash benchmarks/results/logs/gpu_call_s53_4.sh
set -uo pipefail
pack() { tar czf "$OUT/logs.tgz" -C "$LOG" .; }
source benchmarks/gpu_lib.sh  # gpu_setup, gpu_extension, gpu_build, run
gpu_setup s53
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-index --no-deps .whl/*.whl > /dev/null 2>&1 && echo "hydra installed"
gpu_extension .s52/carry
TAIL=4 run 240 cuda_tests python3 -m pytest -q -rfE -m cuda -p no:cacheprovider -n 8 tests/test_graphs_first_step.py \
    tests/test_hf_decoder_graphs.py tests/test_hf_esm_graphs.py tests/test_recipe_esm2_graphs.py \
    tests/test_fp8_any_rows.py -k "graph"
M="cd benchmarks && python3 moe/bench_mixtral_train.py --steps 8 --timed-passes 5 --eager-before-graphs 2 --rows"
G=seqfusegraph_fp8_delayed_fused_adamw
E=seqfuse_fp8_delayed_fused_adamw
TAIL=9 run 200 mixtral_a bash -c "$M hf_bf16,hf_bf16_compile,$G,$E"
cp benchmarks/results/moe_mixtral_train.json "$LOG/moe_mixtral_train_a.json"
TAIL=5 run 100 mixtral_b bash -c "$M hf_bf16,$G"
cp benchmarks/results/moe_mixtral_train.json "$LOG/moe_mixtral_train_b.json"
for r in hf_bf16_compile $E $G; do
  TAIL=1 run 90 alone_$r bash -c "$M $r"
  cp benchmarks/results/moe_mixtral_train.json "$LOG/moe_mixtral_train_alone_$r.json"
done
exit $status
