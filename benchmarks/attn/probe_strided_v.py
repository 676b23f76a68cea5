"""Does attention run slower when v is a strided view of one q / k / v tensor?

split_qkv_rope's one launch (seqfuse.modules.rope, ONE_LAUNCH) returns q, k and v as views of one new
[b, s, heads + 2 kv_heads, d] tensor, so v's token stride is (heads + 2 kv_heads) d where the two-launch path
gave a contiguous v.  This probe times seqfuse.ops.attention forward + backward (the route accelerate()'s layers
take: cuDNN through torch SDPA on Hopper) on the same values in both layouts, interleaved rounds of CUDA-event
timed calls, medians, and checks the outputs and gradients are equal.  Llama 1B's attention by default:

    python3 benchmarks/attn/probe_strided_v.py [--seq 4096 --heads 32 --kv-heads 8 --dim 64 --rounds 8]
"""
import argparse
import statistics

import torch

from seqfuse.ops import attention


def layouts(b, s, h, kv, d, device):
    qkv = torch.randn(b, s, h + 2 * kv, d, device=device, dtype=torch.bfloat16)
    one = (qkv[:, :, :h], qkv[:, :, h:h + kv], qkv[:, :, h + kv:])
    two = (one[0], one[1], one[2].contiguous())  # q and k strided, v contiguous: the two-launch path
    return {"v strided (one launch)": one, "v contiguous (two launches)": two}


def step(q, k, v, grad):
    q, k, v = (x.detach().requires_grad_(True) for x in (q, k, v))
    out = attention(q, k, v, qkv_format="bshd", attn_mask_type="causal")
    out.backward(grad)
    return out, q.grad, k.grad, v.grad


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args()
    torch.manual_seed(0)
    cases = layouts(a.batch, a.seq, a.heads, a.kv_heads, a.dim, "cuda")
    grad = torch.randn(a.batch, a.seq, a.heads, a.dim, device="cuda", dtype=torch.bfloat16)
    results = {name: step(*qkv, grad) for name, qkv in cases.items()}
    first, second = results.values()
    same = all(torch.equal(x, y) for x, y in zip(first, second))
    times = {name: [] for name in cases}
    for r in range(a.rounds):
        for name in (list(cases) if r % 2 == 0 else list(cases)[::-1]):
            for _ in range(3):
                step(*cases[name], grad)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(a.iters):
                step(*cases[name], grad)
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end) / a.iters)
    med = {name: statistics.median(t) for name, t in times.items()}
    print(f"attention forward+backward, {a.batch} x {a.seq} tokens, {a.heads} / {a.kv_heads} heads of {a.dim}, causal, "
          f"bf16, {torch.cuda.get_device_name()}; outputs and gradients equal: {same}")
    for name, t in times.items():
        print(f"  {name:30s} median {med[name]:.3f} ms  rounds {['%.3f' % x for x in t]}")
    names = list(cases)
    print(f"  strided / contiguous: {med[names[0]] / med[names[1]]:.4f}x the time")


if __name__ == "__main__":
    main()
