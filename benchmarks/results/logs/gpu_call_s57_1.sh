#!/usr/bin/env bash
# Session 57 call 1 (written in s56, whose device time ran out on failed starts): after s56 call 1's
# memory breakdown -- the split QKV's v copied out (the attention keeps none of
# the QKV output), recompute_activation on by default under FP8, the loss's 256 MiB chunks -- accelerate()'s rows
# at 4,096 and 8,192 tokens with their peers and each row's memory at its peak; linear_cross_entropy's cost by
# chunk size and sum dtype beside Liger-Kernel's; torchao's FP8 training as a peer row (its wheel in .whl); the
# cuda tests.
# Make .s54/carry/pkg_head.tar.xz: git archive HEAD python/seqfuse | xz > .s54/carry/pkg_head.tar.xz.
# Carry .whl, .s52/carry and .s54/carry:
#   SEQFUSE_GIT_COMMIT=<sha> bash benchmarks/results/logs/gpu_call_s57_1.sh
set -uo pipefail
source benchmarks/gpu_lib.sh  # gpu_prebuilt, run
tar xJf .s54/carry/pkg_head.tar.xz && echo "python/seqfuse from HEAD's archive"
gpu_prebuilt s57 .s52/carry
A=hf_eager,hf_compile,seqfuse_bf16,seqfuse_fp8_delayed,seqfuse_fp8_delayed_keep
A=$A,seqfuse_fp8_delayed_head_fused_adamw,torchao_float8,liger
TAIL=40 run 160 accel4096 python3 benchmarks/hf/bench_accelerate.py --shape llama1b --seq 4096 --steps 20 \
  --rows $A --out hf_accelerate_s57_4096_call1 --memory "$LOG/memory"
cp benchmarks/results/hf_accelerate_s57_4096_call1.json "$LOG/" 2>/dev/null
pack
TAIL=30 run 120 accel8192 python3 benchmarks/hf/bench_accelerate.py --shape llama1b --seq 8192 --steps 10 \
  --rows hf_eager,hf_compile,seqfuse_bf16,seqfuse_fp8_delayed,torchao_float8,liger --out hf_accelerate_s57_8192_call1
cp benchmarks/results/hf_accelerate_s57_8192_call1.json "$LOG/" 2>/dev/null
pack
TAIL=20 run 60 linear_ce bash -c "cd benchmarks && python3 bench_linear_ce_chunks.py --tokens 4096,8192 \
  --chunks 0,2048,1024 --out linear_ce_chunks_s57 && cp results/linear_ce_chunks_s57.json $LOG/"
pack
TAIL=8 run 90 cuda_tests python3 -m pytest -q -rfE -m cuda -p no:cacheprovider -n 14 --timeout 60 \
  tests/test_rope.py tests/test_cross_entropy.py tests/test_hf_accelerate_fused.py
exit $status
