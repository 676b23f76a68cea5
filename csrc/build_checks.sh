#!/usr/bin/env bash
# Build the standalone kernel checks (llm.c style: C + CUDA, no Python) for
# sm_90a on this machine, to be carried to the GPU machine and run there.
#   csrc/<family>/check_<name>.cu  ->  bin/check_<family>_<name>
#   csrc/build_checks.sh [family ...]   only those families' checks (e.g. attn norm)
# The families' kernel units are compiled in parallel (JOBS at a time,
# default the CPU count), then each check is linked.
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
stale() { [ ! -f "$2" ] || [ "$1" -nt "$2" ] || [ "$newest_header" -nt "$2" ] || [ csrc/build_checks.sh -nt "$2" ]; }
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
want() { # is this check's family asked for (all when none is named)?
    [ $# -gt 0 ] || return 1
    local family=$1
    shift
    [ $# -eq 0 ] && return 0
    for f in "$@"; do [ "$f" = "$family" ] && return 0; done
    return 1
}
checks=()
# A check whose first line is "// check-links: fam ..." also links those
# families (their C files and kernel units), e.g. a grouped check timing the
# gemm family's cuBLASLt route beside its own kernel.
links() { sed -n '1s#^// check-links: ##p' "$1"; }
for check in csrc/*/check_*.cu; do
    [ -e "$check" ] || continue
    want "$(basename "$(dirname "$check")")" "$@" && checks+=("$check")
done
[ ${#checks[@]} -gt 0 ] || { echo "build_checks: no check of the families: $*" >&2; exit 2; }
# the kernel units of those families, JOBS at a time (each job's status is waited for)
JOBS=${JOBS:-$(nproc)}
pids=()
for dir in $(for c in "${checks[@]}"; do dirname "$c"; for f in $(links "$c"); do echo "csrc/$f"; done; done | sort -u); do
    for f in "$dir"/*_cuda.cu; do
        [ -e "$f" ] || continue
        cu_obj "$f" > /dev/null &
        pids+=($!)
        if [ ${#pids[@]} -ge "$JOBS" ]; then wait "${pids[0]}"; pids=("${pids[@]:1}"); fi
    done
done
for p in "${pids[@]}"; do wait "$p"; done
core=""
for f in csrc/core/*.c; do core="$core $(cc_obj "$f")"; done
for check in "${checks[@]}"; do
    dir=$(dirname "$check"); family=$(basename "$dir"); name=$(basename "$check" .cu)
    objs="$core"
    for d in "$dir" $(for f in $(links "$check"); do echo "csrc/$f"; done); do
        for f in "$d"/*.c; do [ -e "$f" ] && objs="$objs $(cc_obj "$f")"; done
        for f in "$d"/*_cuda.cu; do [ -e "$f" ] && objs="$objs $(cu_obj "$f")"; done
    done
    out="bin/${name/check_/check_${family}_}"
    echo "nvcc $check -> $out"
    "$NVCC" -O3 -std=c++17 $ARCH -DSF_WITH_CUDA=1 -DSF_WORKBENCH=1 $INC "$check" $objs -o "$out" \
        -L"$CUDA_HOME/lib64" -lcublasLt -ldl
done
