#!/usr/bin/env bash
# Builds benchmarks/moe/swiglu_onepass_probe.cu against the check objects,
# once per tuning of csrc/quant/cast_cuda.cu (its SF_BACKWARD_* staging):
#   benchmarks/moe/build_swiglu_probe.sh base "" b232 "-DSF_BACKWARD_ROWS=2 -DSF_BACKWARD_STAGES=3 \
#     -DSF_BACKWARD_CTAS_PER_SM=2" ...  ->  bin/swiglu_probe_base, bin/swiglu_probe_b232, ...
# Run csrc/build_checks.sh quant act first (the other objects come from it).
set -euo pipefail
cd "$(dirname "$0")/../.."
O=build/checks
objs=$(ls $O/csrc_core_*.o $O/csrc_moe_*.o $O/csrc_quant_*.o $O/csrc_act_*.o | grep -v "cast_cuda\|check_")
FLAGS="-O3 -std=c++17 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -DSF_WITH_CUDA=1 -DSF_WORKBENCH=1"
while [ $# -ge 2 ]; do
    tag=$1 defs=$2
    shift 2
    nvcc $FLAGS $defs -Icsrc/include -Icsrc -c csrc/quant/cast_cuda.cu -o $O/cast_cuda_probe_$tag.o
    nvcc $FLAGS -Icsrc/include -Icsrc benchmarks/moe/swiglu_onepass_probe.cu $objs $O/cast_cuda_probe_$tag.o \
        -o bin/swiglu_probe_$tag -L"$(dirname "$(dirname "$(command -v nvcc)")")/lib64" -lcublasLt -ldl
    echo "bin/swiglu_probe_$tag"
done
