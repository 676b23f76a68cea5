#!/usr/bin/env bash
# Session 52's first GPU call (written in s51; ran in s52 at 8235506 on an H100 80GB, 577 s; logs in
# s52_call1_8235506/): what s51's review changed after its last call (568b944 and the read-through after it: the SwiGLU backward's two-row staging for
# small-shared-memory devices, the ends cast's tiling by form and its K = 0 guard, sf_allow_smem's static bound for
# the norms, check_cast's sections 9 and 10 on CheckBuf), on one GPU: check_cast in full, the cuda tests of the
# kernels' users, and the Mixtral rows.  From the repository root, carrying .whl (hydra-core 1.3.x, omegaconf 2.3.0,
# antlr4-python3-runtime 4.9.3: s51 built antlr's wheel with `pip wheel --no-deps antlr4-python3-runtime==4.9.3`):
#   SEQFUSE_GIT_COMMIT=<sha> bash benchmarks/results/logs/gpu_call_s52_1.sh
set -uo pipefail
pack() { cp "$ROOT"/benchmarks/results/moe_mixtral_train.json "$LOG/" 2>/dev/null; tar czf "$OUT/logs.tgz" -C "$LOG" .; }
source benchmarks/gpu_lib.sh  # gpu_setup, gpu_build, run
gpu_setup s52
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-index --no-deps .whl/*.whl > /dev/null 2>&1 && echo "hydra installed"
TAIL=2 run 240 checks_build env JOBS=16 bash csrc/build_checks.sh quant
TAIL=1 run 200 check_cast bin/check_quant_cast
grep -E "FAIL|(swiglu_backward_grouped|cast_grouped_ends).* us" "$LOG/check_cast.log" | head -12 | cut -c1-200
gpu_build
TAIL=8 run 200 cuda_tests python3 -m pytest -q -rfE -m cuda -p no:cacheprovider -n 14 tests/test_swiglu_backward_cast_grouped.py \
    tests/test_fp8_grouped_cast_ends.py tests/test_moe_device_ends_fp8.py tests/test_norm.py tests/test_norm_modules.py \
    tests/test_moe_modules.py tests/test_hf_mixtral.py
TAIL=8 run 170 mixtral bash -c "cd benchmarks && python3 moe/bench_mixtral_train.py --steps 8 --timed-passes 5 \
    --rows hf_bf16,hf_bf16_compile,seqfuse_fp8_delayed_torch_adamw,seqfusegraph_fp8_delayed_torch_adamw"
exit $status
