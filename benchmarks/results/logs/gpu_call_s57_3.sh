#!/usr/bin/env bash
# Session 57 call 3: in-process A/Bs of this session's two accelerate() changes (benchmarks/hf/fusion_ab.py, each
# switch's old path patched back in the same process, interleaved rounds, GPU kernel time by torch.profiler):
# save_original_input on the attention projection (the FP8 row at 4,096 tokens) and the loss's default chunk
# (bf16 and FP8 at 8,192 tokens, 2,048- against 1,024-row chunks).
# Make .s54/carry/pkg_head.tar.xz: git archive HEAD python/seqfuse | xz > .s54/carry/pkg_head.tar.xz.
# Carry .whl, .s52/carry and .s54/carry:
#   SEQFUSE_GIT_COMMIT=<sha> bash benchmarks/results/logs/gpu_call_s57_3.sh
set -uo pipefail
source benchmarks/gpu_lib.sh  # gpu_prebuilt, run
tar xJf .s54/carry/pkg_head.tar.xz && echo "python/seqfuse from HEAD's archive"
gpu_prebuilt s57 .s52/carry
TAIL=12 run 100 ab_save_original python3 benchmarks/hf/fusion_ab.py seqfuse_fp8_delayed --switch save_original_input \
  --seq 4096 --profile --out fusion_ab_save_original_input_s57
cp benchmarks/results/fusion_ab_save_original_input_s57.json "$LOG/" 2>/dev/null
pack
TAIL=16 run 150 ab_loss_chunk python3 benchmarks/hf/fusion_ab.py seqfuse_bf16,seqfuse_fp8_delayed --switch loss_chunk \
  --seq 8192 --profile --out fusion_ab_loss_chunk_s57
cp benchmarks/results/fusion_ab_loss_chunk_s57.json "$LOG/" 2>/dev/null
exit $status
