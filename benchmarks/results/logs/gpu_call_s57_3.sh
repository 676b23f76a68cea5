#!/usr/bin/env bash
# Session 57 call 3: an in-process A/B of the loss's new default chunk (benchmarks/hf/fusion_ab.py --switch
# loss_chunk: 256 MiB chunks patched back in the same process, interleaved rounds, GPU kernel time by
# torch.profiler): accelerate()'s bf16 row at 8,192 tokens, 2,048- against 1,024-row chunks.  The save_original_input
# A/B (`fusion_ab.py seqfuse_fp8_delayed --switch save_original_input`) is left for a later call: the session's
# device time was short.
# Make .s54/carry/pkg_head.tar.xz: git archive HEAD python/seqfuse | xz > .s54/carry/pkg_head.tar.xz.
# Carry .whl, .s52/carry and .s54/carry:
#   SEQFUSE_GIT_COMMIT=<sha> bash benchmarks/results/logs/gpu_call_s57_3.sh
set -uo pipefail
source benchmarks/gpu_lib.sh  # gpu_prebuilt, run
tar xJf .s54/carry/pkg_head.tar.xz && echo "python/seqfuse from HEAD's archive"
gpu_prebuilt s57 .s52/carry
TAIL=16 run 150 ab_loss_chunk python3 benchmarks/hf/fusion_ab.py seqfuse_bf16 --switch loss_chunk \
  --seq 8192 --rounds 4 --profile --out fusion_ab_loss_chunk_s57
cp benchmarks/results/fusion_ab_loss_chunk_s57.json "$LOG/" 2>/dev/null
exit $status
