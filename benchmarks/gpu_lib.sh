# The pieces the one-command GPU scripts share (gpu_fp8.sh,
# llama3/gpu_llama3.sh, moe/gpu_mixtral.sh): where the logs go and how they
# come back, the build, and a step with its own time limit.  Sourced by a
# script from the repository root, after it has defined pack() (what it
# copies into $LOG and archives into $OUT at exit):
#
#   gpu_setup NAME     ROOT (the repository root), OUT (${OUT:-/tmp/seqfuse-NAME},
#                      what the device call brings back), LOG (a fresh
#                      /tmp/NAME_run.XXXX), status=0; pack runs at exit, and a
#                      TERM (the device call's time limit) exits 143 through it
#   gpu_build          the editable build with 16 jobs, its log $LOG/build.log;
#                      a failed build prints the log's tail and ends the script
#   gpu_extension DIR  the extension built on the development machine where DIR
#                      holds it (DIR/lib312.tar.xz: seqfuse/_C.cpython-312-*.so,
#                      built with SEQFUSE_CUDA_ARCHS=90a python3.12 setup.py
#                      build_ext; DIR/checks.tar.xz: bin/ checks, unpacked in
#                      place), imported from python/ through PYTHONPATH; else,
#                      or where it does not import, gpu_build (said either way).
#                      Carried xz-compressed: the tree and what is carried must
#                      stay under 64 MiB
#   gpu_prebuilt NAME DIR
#                      gpu_setup NAME (with pack archiving $LOG into
#                      $OUT/logs.tgz where the script defined none), the GPU's
#                      name, the wheels carried in .whl installed without an
#                      index (hydra for the recipes' configs), then
#                      gpu_extension DIR: the start of a call that carries a
#                      prebuilt extension
#   run LIMIT NAME CMD...
#                      CMD with a LIMIT-second limit, its output in $LOG/NAME.log,
#                      then the log's last ${TAIL:-25} lines; a failure sets
#                      status=1 and prints the exit status.  At the limit CMD
#                      gets ${STOP_SIGNAL:-INT} (SIGINT: pytest then prints its
#                      summary of failures), SIGKILL 15 s later.

gpu_setup() {
    ROOT=$(pwd)
    export PYTHONUNBUFFERED=1
    OUT=${OUT:-/tmp/seqfuse-$1}
    LOG=$(mktemp -d "/tmp/$1_run.XXXX")
    mkdir -p "$OUT"
    trap pack EXIT
    trap "exit 143" TERM
    status=0
}

gpu_prebuilt() {
    declare -F pack > /dev/null || pack() { tar czf "$OUT/logs.tgz" -C "$LOG" .; }
    gpu_setup "$1"
    nvidia-smi --query-gpu=name --format=csv,noheader
    if ls .whl/*.whl > /dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps .whl/*.whl > /dev/null 2>&1 && echo "wheels from .whl installed"
    fi
    gpu_extension "$2"
}

gpu_build() {
    local began
    began=$(date +%s)
    MAX_JOBS=16 python3 -m pip install -q --no-build-isolation --no-deps --no-index -e . > "$LOG/build.log" 2>&1 \
        || { tail -30 "$LOG/build.log"; echo BUILD FAILED; exit 1; }
    echo "build $(( $(date +%s) - began )) s"
}

gpu_extension() {
    local dir=$1 so
    [ -f "$dir/checks.tar.xz" ] && tar xJf "$dir/checks.tar.xz"
    if [ -f "$dir/lib312.tar.xz" ]; then
        mkdir -p "$dir/lib312" && tar xJf "$dir/lib312.tar.xz" -C "$dir/lib312"
        so=$(ls "$dir"/lib312/seqfuse/_C.cpython-312-*.so 2>/dev/null | head -1)
    fi
    if [ -n "${so:-}" ] && cp "$so" python/seqfuse/ && PYTHONPATH=python python3 -c "import seqfuse._C"; then
        export PYTHONPATH=$ROOT/python${PYTHONPATH:+:$PYTHONPATH}
        echo "prebuilt extension: $(basename "$so")"
    else
        echo "no usable prebuilt extension in $dir: building"
        rm -f python/seqfuse/_C.cpython-312-*.so
        gpu_build
    fi
}

run() {
    local limit=$1 name=$2 rc=0
    shift 2
    echo "===== $name"
    # (stdout line-buffered: what a program killed at its limit had printed stays in its log)
    local lines=()
    command -v stdbuf > /dev/null && lines=(stdbuf -oL -eL)
    timeout -s "${STOP_SIGNAL:-INT}" -k 15 "$limit" "${lines[@]}" "$@" > "$LOG/$name.log" 2>&1 || rc=$?
    [ $rc -eq 0 ] || { status=1; echo "($name: exit $rc)"; }
    tail -n "${TAIL:-25}" "$LOG/$name.log"
}
