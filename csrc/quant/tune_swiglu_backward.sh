#!/usr/bin/env bash
# Builds check_cast with other stagings of the grouped SwiGLU backward
# (rows a phase, stages in flight, CTAs an SM: cast_cuda.cu's SF_BWD_*),
# for a same-machine comparison of their times (check_cast's section 9):
#   csrc/quant/tune_swiglu_backward.sh "4 3 1" "2 2 2" ...  ->  bin/check_quant_cast_r4s3c1 ...
# Run csrc/build_checks.sh quant first (the other objects come from it).
set -euo pipefail
cd "$(dirname "$0")/../.."
O=build/checks
objs=$(ls $O/csrc_core_*.o $O/csrc_moe_*.o $O/csrc_quant_*.o | grep -v cast_cuda)
FLAGS="-O3 -std=c++17 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -DSF_WITH_CUDA=1 -DSF_WORKBENCH=1"
for v in "$@"; do
    set -- $v
    tag="r$1s$2c$3"
    nvcc $FLAGS -DSF_BWD_ROWS=$1 -DSF_BWD_STAGES=$2 -DSF_BWD_CTAS_PER_SM=$3 -Icsrc/include -Icsrc \
        -c csrc/quant/cast_cuda.cu -o $O/cast_cuda_$tag.o
    nvcc $FLAGS -Icsrc/include -Icsrc csrc/quant/check_cast.cu $objs $O/cast_cuda_$tag.o \
        -o bin/check_quant_cast_$tag -L"$(dirname "$(dirname "$(command -v nvcc)")")/lib64" -lcublasLt -ldl
    echo "bin/check_quant_cast_$tag"
done
