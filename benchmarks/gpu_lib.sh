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

gpu_build() {
    local began
    began=$(date +%s)
    MAX_JOBS=16 python3 -m pip install -q --no-build-isolation --no-deps --no-index -e . > "$LOG/build.log" 2>&1 \
        || { tail -30 "$LOG/build.log"; echo BUILD FAILED; exit 1; }
    echo "build $(( $(date +%s) - began )) s"
}

run() {
    local limit=$1 name=$2 rc=0
    shift 2
    echo "===== $name"
    timeout -s "${STOP_SIGNAL:-INT}" -k 15 "$limit" "$@" > "$LOG/$name.log" 2>&1 || rc=$?
    [ $rc -eq 0 ] || { status=1; echo "($name: exit $rc)"; }
    tail -n "${TAIL:-25}" "$LOG/$name.log"
}
