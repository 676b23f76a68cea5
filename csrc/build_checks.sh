#!/usr/bin/env bash
# Build the standalone kernel checks (llm.c style: C + CUDA, no Python) for
# sm_90a on this machine, to be carried to the GPU machine and run there.
#   csrc/<family>/check_<name>.cu  ->  bin/check_<family>_<name>
# Each check links its family's C files (API entry and CPU reference), its
# *_cuda.cu kernels and the core, and compares CUDA against the CPU backend.
# The kernels are compiled here with SF_WORKBENCH: that adds what only the
# checks use (the attention forward's other schedules, the norm split's
# tuning), which the library build (setup.py) leaves out.
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC=${NVCC:-nvcc}
ARCH=${KERNEL_ARCH:--gencode=arch=compute_90a,code=sm_90a}
CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v "$NVCC")")")}
OBJ=build/checks
mkdir -p "$OBJ" bin
INC="-Icsrc/include -Icsrc -I$CUDA_HOME/include"
# An object is rebuilt when its source, ANY header under csrc or this script
# (its flags) is newer than it: conservative (a header edit rebuilds every
# object), never stale.
newest_header=$(ls -t $(find csrc -name '*.h' -o -name '*.cuh') | head -1)
stale() { [ ! -f "$2" ] || [ "$1" -nt "$2" ] || [ "$newest_header" -nt "$2" ] || [ "$0" -nt "$2" ]; }
cc_obj() { # gcc-compile a C file once
    local o="$OBJ/$(echo "$1" | tr / _).o"
    if stale "$1" "$o"; then
        cc -std=c11 -O2 -fPIC -DSF_WITH_CUDA=1 $INC -c "$1" -o "$o"
    fi
    echo "$o"
}
cu_obj() {
    local o="$OBJ/$(echo "$1" | tr / _).o"
    if stale "$1" "$o"; then
        "$NVCC" -O3 -std=c++17 --expt-relaxed-constexpr $ARCH -DSF_WITH_CUDA=1 -DSF_WORKBENCH=1 $INC -c "$1" -o "$o"
    fi
    echo "$o"
}
core=""
for f in csrc/core/*.c; do core="$core $(cc_obj "$f")"; done
for check in csrc/*/check_*.cu; do
    [ -e "$check" ] || continue
    dir=$(dirname "$check"); family=$(basename "$dir"); name=$(basename "$check" .cu)
    objs="$core"
    for f in "$dir"/*.c; do [ -e "$f" ] && objs="$objs $(cc_obj "$f")"; done
    for f in "$dir"/*_cuda.cu; do [ -e "$f" ] && objs="$objs $(cu_obj "$f")"; done
    out="bin/${name/check_/check_${family}_}"
    echo "nvcc $check -> $out"
    "$NVCC" -O3 -std=c++17 $ARCH -DSF_WITH_CUDA=1 -DSF_WORKBENCH=1 $INC "$check" $objs -o "$out" \
        -L"$CUDA_HOME/lib64" -lcublasLt -ldl
done
