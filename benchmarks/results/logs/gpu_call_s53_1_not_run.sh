#!/usr/bin/env bash
# A GPU call for an H200 (issue 18 asks for its figures there), written in s52, whose H200 tries were all refused:
# check_cast and check_adamw, the Mixtral rows (hf_bf16, hf_bf16_compile, the graphed and eager-layer FP8 delayed
# rows with FusedAdamW, the graphed one with torch AdamW; then hf_bf16 and the graphed FusedAdamW row again) and
# bench_adamw.  The extension comes prebuilt for CPython 3.12 / sm_90a (about 2 minutes here, against 3.5 on the
# device), the checks beside it, both xz-compressed (the tree and what is carried must stay under 64 MiB):
#   /root/.pyenv/versions/3.12.1/bin/python3.12 -m pip install -q setuptools wheel
#   SEQFUSE_CUDA_ARCHS=90a MAX_JOBS=2 /root/.pyenv/versions/3.12.1/bin/python3.12 setup.py build_ext \
#       --build-temp .s52/bt312 --build-lib .s52/lib312
#   JOBS=2 bash csrc/build_checks.sh quant optim
#   mkdir -p .s52/carry && tar cJf .s52/carry/lib312.tar.xz -C .s52/lib312 seqfuse \
#       && tar cJf .s52/carry/checks.tar.xz bin/check_quant_cast bin/check_optim_adamw
# and hydra's wheels in .whl (pip download --no-deps hydra-core==1.3.2 omegaconf==2.3.0; pip wheel --no-deps
# antlr4-python3-runtime==4.9.3).  Carry .whl and .s52/carry:
#   SEQFUSE_GIT_COMMIT=<sha> bash benchmarks/results/logs/gpu_call_s53_1_not_run.sh
set -uo pipefail
source benchmarks/gpu_lib.sh  # gpu_prebuilt, run
gpu_prebuilt s52 .s52/carry
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
