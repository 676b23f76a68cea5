#!/usr/bin/env bash
# Time each CUDA compilation unit of the library, one at a time, with
# setup.py's nvcc flags, and keep the objects (for a machine-code comparison:
# cuobjdump -sass OLD/x.o vs NEW/x.o).  Used to find the slowest unit of the
# build and to report before/after times.
#   csrc/time_units.sh OUT_DIR [unit.cu ...]     (default: every library .cu)
# EXTRA adds flags (e.g. -DSF_WORKBENCH=1, as csrc/build_checks.sh builds).
# KERNEL_ARCH overrides the gencode (default: setup.py's default targets,
# sm_90a, sm_80 and compute_80 PTX; e.g. -gencode=arch=compute_90a,code=sm_90a
# for sm_90a only).  The CPU seconds of a default run are the figures of
# setup.py's UNIT_CPU_S, which orders the build's units.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: csrc/time_units.sh OUT_DIR [unit.cu ...]}
shift
mkdir -p "$out"
NVCC=${NVCC:-nvcc}
ARCH=${KERNEL_ARCH:--gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_80,code=compute_80}
EXTRA=${EXTRA:-}
CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v "$NVCC")")")}
units=("$@")
if [ ${#units[@]} -eq 0 ]; then
    for f in csrc/*/*.cu; do
        case $(basename "$f") in check_*) ;; *) units+=("$f") ;; esac
    done
fi
# CPU seconds (user + sys of nvcc and the cicc / ptxas it runs) are what a
# unit costs a build; wall seconds are shown too but grow with the machine's
# other load.
printf '%8s %8s  %s\n' cpu_s wall_s unit
tcpu=0
twall=0
: > "$out/.cpu"
for src in "${units[@]}"; do
    obj="$out/$(basename "$src" .cu).o"
    /usr/bin/time -f '%U %S %e' -o "$out/.time" \
        "$NVCC" -c "$src" -o "$obj" -O3 -std=c++17 --expt-relaxed-constexpr -lineinfo -Xcompiler -fPIC \
        -DSF_WITH_CUDA=1 $EXTRA -Icsrc/include -Icsrc -I"$CUDA_HOME/include" $ARCH
    read -r user sys wall < "$out/.time"
    cpu=$(echo "$user + $sys" | bc)
    tcpu=$(echo "$tcpu + $cpu" | bc)
    twall=$(echo "$twall + $wall" | bc)
    printf '%8.1f %8.1f  %s\n' "$cpu" "$wall" "$src"
    echo "$src $cpu" >> "$out/.cpu"
done
printf '%8.1f %8.1f  total (%d units, one at a time)\n' "$tcpu" "$twall" "${#units[@]}"
# What a build of JOBS parallel jobs (default 2) would take for these units,
# from their CPU seconds, two ways: the units in name order, and costliest
# first as setup.py hands them to its pool; each job takes the next unit when
# it is free.
python3 - "$out/.cpu" "${JOBS:-2}" <<'PY'
import sys
rows = [l.split() for l in open(sys.argv[1])]
jobs = int(sys.argv[2])
for label, order in (("name order", sorted(rows)),
                     ("costliest first (setup.py)", sorted(rows, key=lambda r: -float(r[1])))):
    free = [0.0] * jobs
    for unit, cpu in order:
        i = free.index(min(free))
        free[i] += float(cpu)
    print(f"{max(free):8.1f} {'':8}  {jobs} jobs, {label} (CPU seconds, the units above only)")
PY
