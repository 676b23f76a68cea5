#!/usr/bin/env bash
# Builds check_cast with other tunings of two of cast_cuda.cu's kernels, for
# a same-machine comparison of their times (check_cast's sections 9 and 10):
# the grouped SwiGLU backward's staging (rows a phase, stages in flight, CTAs
# an SM: SF_BACKWARD_*) and the SwiGLU form of the grouped cast with the ends on
# the device (rows a CTA, vectors loaded at once, CTAs an SM: SF_ENDS_*).  Each argument is
# "backward_rows backward_stages backward_ctas ends_rows ends_unroll ends_ctas":
#   csrc/quant/tune_cast.sh "4 2 1 32 4 3" "4 2 1 8 4 3"  ->  bin/check_quant_cast_b421_e3243 ...
# Run csrc/build_checks.sh quant first (the other objects come from it).
set -euo pipefail
cd "$(dirname "$0")/../.."
O=build/checks
objs=$(ls $O/csrc_core_*.o $O/csrc_moe_*.o $O/csrc_quant_*.o | grep -v cast_cuda)
FLAGS="-O3 -std=c++17 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -DSF_WITH_CUDA=1 -DSF_WORKBENCH=1"
for v in "$@"; do
    set -- $v
    tag="b$1$2$3_e$4$5$6"
    nvcc $FLAGS -DSF_BACKWARD_ROWS=$1 -DSF_BACKWARD_STAGES=$2 -DSF_BACKWARD_CTAS_PER_SM=$3 -DSF_ENDS_ROWS=$4 -DSF_ENDS_UNROLL=$5 \
        -DSF_ENDS_CTAS_PER_SM=$6 -Icsrc/include -Icsrc -c csrc/quant/cast_cuda.cu -o $O/cast_cuda_$tag.o
    nvcc $FLAGS -Icsrc/include -Icsrc csrc/quant/check_cast.cu $objs $O/cast_cuda_$tag.o \
        -o bin/check_quant_cast_$tag -L"$(dirname "$(dirname "$(command -v nvcc)")")/lib64" -lcublasLt -ldl
    echo "bin/check_quant_cast_$tag"
done
