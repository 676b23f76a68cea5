#!/usr/bin/env bash
# Session 52's second GPU call, on one GPU: check_cast in full (section 9's dx tolerance against the size of the
# terms, 5ecd965), the AdamW kernel's 16-byte accesses over 16-bit lists (9bf653b) checked and timed against the
# old width (bin/check_optim_adamw_narrow, SF_ADAMW_WIDE=0) and against torch's fused AdamW (bench_adamw.py), the
# optimizer's cuda tests, the Mixtral rows with seqfuse's FusedAdamW set to the transformers row's update, and a
# profile of the graphed one.
# The extension comes prebuilt for CPython 3.12 and sm_90a when carried (.s52/lib312, built on the development
# machine: SEQFUSE_CUDA_ARCHS=90a python3.12 setup.py build_ext --build-temp .s52/bt312 --build-lib .s52/lib312;
# imported from python/ through PYTHONPATH), else built here.  bin/check_optim_adamw_narrow is check_adamw with the
# old AdamW width: nvcc -O3 -std=c++17 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -DSF_WITH_CUDA=1
# -DSF_WORKBENCH=1 -DSF_ADAMW_WIDE=0 -Icsrc/include -Icsrc -c csrc/optim/optim_cuda.cu -o build/checks/optim_cuda_narrow.o,
# then linked as csrc/build_checks.sh links check_adamw, with that object for csrc_optim_optim_cuda.cu.o.  Carry .whl (hydra) and .s52/carry (lib312.tar.xz:
# tar cJf .s52/carry/lib312.tar.xz -C .s52/lib312 seqfuse; checks.tar.xz: the three bin/ checks below):
#   SEQFUSE_GIT_COMMIT=<sha> bash benchmarks/results/logs/gpu_call_s52_2.sh
set -uo pipefail
pack() { cp "$ROOT"/benchmarks/results/adamw.json "$LOG/" 2>/dev/null; tar czf "$OUT/logs.tgz" -C "$LOG" .; }
source benchmarks/gpu_lib.sh  # gpu_setup, gpu_extension, gpu_build, run
gpu_setup s52
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-index --no-deps .whl/*.whl > /dev/null 2>&1 && echo "hydra installed"
gpu_extension .s52/carry
TAIL=1 run 150 check_cast bin/check_quant_cast
grep -E "FAIL" "$LOG/check_cast.log" | head -5 | cut -c1-200
TAIL=4 run 60 check_adamw bin/check_optim_adamw
TAIL=4 run 60 check_adamw_narrow bin/check_optim_adamw_narrow
TAIL=4 run 60 check_adamw_2 bin/check_optim_adamw
TAIL=6 run 120 cuda_tests python3 -m pytest -q -rfE -m cuda -p no:cacheprovider -n 8 tests/test_adamw.py
TAIL=12 run 90 bench_adamw bash -c "cd benchmarks && python3 bench_adamw.py"
TAIL=10 run 200 mixtral bash -c "cd benchmarks && python3 moe/bench_mixtral_train.py --steps 8 --timed-passes 5 \
    --rows hf_bf16,hf_bf16_compile,seqfusegraph_fp8_delayed_torch_adamw,seqfusegraph_fp8_delayed_fused_adamw"
cp benchmarks/results/moe_mixtral_train.json "$LOG/moe_mixtral_train_timed.json"
# a fresh profile of the graphed row with seqfuse's optimizer (its own process: a profiled run's figures are not
# headline figures), summarised into $LOG/profile/
TAIL=4 run 130 mixtral_profile bash -c "cd benchmarks && python3 moe/bench_mixtral_train.py --steps 8 \
    --timed-passes 1 --warm-passes 2 --rows seqfusegraph_fp8_delayed_fused_adamw --profile $LOG/profile"
exit $status
