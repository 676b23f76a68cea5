#!/usr/bin/env bash
# Session 53's fifth GPU call: the cuda tests of graphed modules again after the gradient buffers' copy moved to
# the first graphed forward after a graphed backward (call 4 found that the backward's static buffers are also
# overwritten by the next forward replay: its accumulation tests failed), then the graphed Mixtral row alone
# (captured after two eager steps).  Carry .whl and .s52/carry:
#   SEQFUSE_GIT_COMMIT=<sha> bash benchmarks/results/logs/gpu_call_s53_5.sh
set -uo pipefail
pack() { tar czf "$OUT/logs.tgz" -C "$LOG" .; }
source benchmarks/gpu_lib.sh  # gpu_setup, gpu_extension, gpu_build, run
gpu_setup s53
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-index --no-deps .whl/*.whl > /dev/null 2>&1 && echo "hydra installed"
gpu_extension .s52/carry
TAIL=6 run 150 cuda_tests python3 -m pytest -q -rfE -m cuda -p no:cacheprovider -n 8 tests/test_graphs_first_step.py \
    tests/test_hf_decoder_graphs.py tests/test_hf_esm_graphs.py tests/test_recipe_esm2_graphs.py \
    tests/test_fp8_any_rows.py -k "graph"
M="cd benchmarks && python3 moe/bench_mixtral_train.py --steps 8 --timed-passes 5 --eager-before-graphs 2 --rows"
TAIL=1 run 90 alone_graphed bash -c "$M seqfusegraph_fp8_delayed_fused_adamw"
cp benchmarks/results/moe_mixtral_train.json "$LOG/moe_mixtral_train_alone_graphed.json"
exit $status
