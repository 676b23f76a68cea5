#!/usr/bin/env bash
# s48 call 7: the bad-input corpus's CUDA cases of swiglu_backward_cast_fp8_grouped (with and without grad_*).
set -uo pipefail
L=/tmp/logs; mkdir -p $L
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
finish() { tar czf $OUT/logs.tgz -C /tmp logs; echo "end $(el) s"; }
trap finish EXIT
MAX_JOBS=16 SEQFUSE_CUDA_ARCHS=90a python3 -m pip install -q --no-build-isolation --no-deps --no-index -e . > $L/build.log 2>&1; echo "build rc=$? $(el) s"
cd tests && R=$(python3 -c "
import bad_input_cases as c
i=[k for k,x in enumerate(c.build_cases('cuda')) if 'swiglu_backward_cast' in x.name]; print(i[0], i[-1]+1)")
timeout 80 python3 bad_input_cases.py cuda $R > $L/corpus.log 2>&1; echo "corpus rc=$? cases $R: $(grep -c '^R' $L/corpus.log) run, $(grep '^R' $L/corpus.log | grep -c '"ok": false') failed"
grep '"ok": false' $L/corpus.log | head -5 | cut -c1-300
