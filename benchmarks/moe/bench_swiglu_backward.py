"""The SwiGLU's backward in an FP8 grouped MLP's down projection: the fused
pass (ops.moe.swiglu_backward_cast_fp8_grouped) against the three steps it
replaces, on the same inputs in one process.

Unfused (what the device-ends FP8 route ran before): the real rows taken
out of the grouped GEMM's padded input-gradient blocks (a torch.cat),
moe_swiglu_backward over them (dx, dprobs), then swiglu_cast_fp8_grouped
of the saved gate|up pairs for the weight gradient's transposed FP8 operand.
Fused: one pass reading the padded blocks and the pairs once.  Rows
"+ grad cast": the same with the gate-up layer's output-gradient cast
(E5M2 row-wise and transposed, delayed scaling) that GroupedMLP's
device-ends route now makes in the fused pass (GradHandoff), against
cast_fp8_grouped of dx after the unfused steps; and the same without dx
itself (want_dx=False: GroupedMLP's one-node backward reads the copies
alone).  Shapes:
Mixtral-small's (2 x 8,192 tokens, top-2: 32,768 rows, FFN 3,584, 8
experts with skewed counts), a 64-expert one, and 64 experts over 4,096
rows (about 64 rows an expert: one 128-row block each, a grid of 64 CTAs,
the fused kernel's worst case).  Times: median device time
of 30 calls (CUDA events, L2 flushed), each row's bytes moved and the
achieved bandwidth; the ratio is unfused / fused.

    python benchmarks/moe/bench_swiglu_backward.py
"""
import importlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import Table, cuda_time_ms  # noqa: E402

moe = importlib.import_module("seqfuse.ops.moe")


def _splits(m, groups, gen):
    w = torch.rand(groups, generator=gen) + 0.3
    s = [int(v) for v in (w / w.sum() * m).floor()]
    s[0] += m - sum(s)
    return s


def _unpad(y, splits, padded):
    parts, o = [], 0
    for mg, pg in zip(splits, padded):
        parts.append(y[o:o + mg])
        o += pg
    return torch.cat(parts)


def main():
    gen = torch.Generator().manual_seed(0)
    table = Table("moe_swiglu_backward", ["shape", "unfused_ms", "fused_ms", "ratio", "fused_gbps"])
    for name, m, k, groups in (("mixtral_small", 32768, 3584, 8), ("64_experts", 32768, 1408, 64),
                               ("64_experts_few_rows", 4096, 1408, 64)):
        splits = _splits(m, groups, gen)
        padded = moe.padded_splits(splits)
        x = torch.randn(m, 2 * k, device="cuda", dtype=torch.bfloat16)
        probs = torch.rand(m, device="cuda")
        dgrad = torch.randn(sum(padded), k, device="cuda", dtype=torch.bfloat16)
        scale = torch.rand(groups, device="cuda") + 0.5

        gscale, gamax = torch.rand(groups, device="cuda") + 0.5, torch.zeros(groups, device="cuda")

        def unfused(grad=False):
            dx, dp = moe.swiglu_backward(_unpad(dgrad, splits, padded), x, probs)
            out = (dx, dp, moe.swiglu_cast_fp8_grouped(x, probs, splits, torch.float8_e4m3fn, scale=scale,
                                                       rowwise=False))
            if grad:
                out += (moe.cast_fp8_grouped(dx, splits, torch.float8_e5m2, scale=gscale, amax=gamax),)
            return out

        def fused(grad=False, want_dx=True):
            kw = dict(grad_fp8_dtype=torch.float8_e5m2, grad_scale=gscale, grad_amax=gamax) if grad else {}
            return moe.swiglu_backward_cast_fp8_grouped(dgrad, x, probs, splits, torch.float8_e4m3fn, scale=scale,
                                                        want_dx=want_dx, **kw)

        a, b, c = unfused(True), fused(True), fused(True, want_dx=False)
        assert torch.equal(a[0], b[0]) and torch.equal(a[2][1].view(torch.uint8), b[2].view(torch.uint8))
        assert all(torch.equal(u.view(torch.uint8), v.view(torch.uint8)) for u, v in zip(a[3][:2], b[4][:2]))
        assert c[0] is None and all(torch.equal(u.view(torch.uint8), v.view(torch.uint8))
                                    for u, v in zip(b[4][:2], c[4][:2]))
        for grad, want_dx, label in ((False, True, ""), (True, True, " + grad cast"),
                                     (True, False, " + grad cast, no dx (GroupedMLP's one node)")):
            t_u = cuda_time_ms(lambda: unfused(grad), warmup=5, repeats=30)
            t_f = cuda_time_ms(lambda: fused(grad, want_dx), warmup=5, repeats=30)
            # fused: reads the pairs, the real rows of dout, probs; writes dx (unless not wanted), dprobs, the FP8
            # copy (+ dx's two)
            moved = x.numel() * 2 + m * k * 2 + m * 4 + (x.numel() * 2 if want_dx else 0) + m * 4 + k * sum(padded)
            moved += 2 * 2 * k * sum(padded) if grad else 0
            table.add(shape=f"{name}{label}: {m} rows, K {k}, {groups} experts",
                      unfused_ms=t_u, fused_ms=t_f, ratio=t_u / t_f, fused_gbps=moved / t_f / 1e6)
    table.save({"command": "python benchmarks/moe/bench_swiglu_backward.py"})


if __name__ == "__main__":
    main()
