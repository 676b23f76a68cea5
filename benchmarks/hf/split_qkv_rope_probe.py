"""A/B in one process: accelerate()'d Llama 1B steps (bench_accelerate's rows)
with seqfuse.modules.rope.split_qkv_rope (new) and with torch.split + two
apply_rotary_pos_emb patched in its place (old), interleaved rounds of
pipelined steps, medians.  A row "prefill:<row>" times generation's prefill
(no grad, key cache) instead of a training step.  On the GPU machine:

    python3 benchmarks/hf/split_qkv_rope_probe.py seqfuse_fp8_delayed,seqfuse_bf16,prefill:seqfuse_bf16

Result: benchmarks/results/logs/split_qkv_rope_ab_s30_687b3e5.log.
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import bench_accelerate as B  # noqa: E402
import seqfuse.hf.fuse_layers as FL  # noqa: E402
from seqfuse.modules.rope import apply_rotary_pos_emb  # noqa: E402

NEW = FL.split_qkv_rope


def old(mixed, freqs, heads, kv_heads, d):
    """The path before split_qkv_rope: split, then q and k turned apart."""
    b, s = mixed.shape[:2]
    q, k, v = torch.split(mixed, [heads * d, kv_heads * d, kv_heads * d], dim=-1)
    return (apply_rotary_pos_emb(q.view(b, s, heads, d), freqs, "bshd"),
            apply_rotary_pos_emb(k.view(b, s, kv_heads, d), freqs, "bshd"), v.view(b, s, kv_heads, d))


def stepper(row, base, family, ids):
    prefill = row.startswith("prefill:")
    model, _ = B.prepare(row.split(":")[-1], base, family)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    model.train(not prefill)

    def steps(n):
        for _ in range(n):
            if prefill:
                with torch.no_grad():
                    model(input_ids=ids, use_cache=True, logits_to_keep=1)
            else:
                model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

    return steps


def ab(steps, rounds=6, per_round=6):
    times = {"new": [], "old": []}
    modes = (("new", NEW), ("old", old))
    for _, fn in modes:
        FL.split_qkv_rope = fn
        steps(3)
    for _ in range(rounds):
        for name, fn in modes:
            FL.split_qkv_rope = fn
            steps(1)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            steps(per_round)
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - t0) / per_round * 1e3)
    FL.split_qkv_rope = NEW
    return times


def main():
    base, family = B.build_base("llama1b", None, "cuda")
    ids = torch.randint(0, base.config.vocab_size, (1, 4096), device="cuda")
    for row in sys.argv[1].split(","):
        times = ab(stepper(row, base, family, ids))
        med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
        print(f"{row}: step ms new {['%.2f' % x for x in times['new']]} old {['%.2f' % x for x in times['old']]}; "
              f"median new {med['new']:.2f} old {med['old']:.2f} -> {med['old'] / med['new']:.4f}x", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
