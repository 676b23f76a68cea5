"""Linear layer forward+backward: seqfuse.pytorch.Linear (bf16, and FP8
under DelayedScaling / Float8CurrentScaling / Float8BlockScaling) against
torch.nn.Linear in bf16, same weights and inputs, in the same process; and
the host time of one Linear call beside torch.nn.Linear's.

Device time: 16384 tokens x 4096 -> 4096 (also 16384 x 4096 -> 16384, the
MLP up-projection), one step = forward + backward (+ the delayed-scaling
update at the autocast exit, as a training step pays it).  Goal (issue 4):
FP8 delayed scaling >= 1.5x torch bf16.

Host time: a tiny layer (16 x 64 -> 64) so the GPU never limits: microseconds
of Python + C per forward call, bf16 and FP8.

Block FP8 breakdown (16384 x 4096 -> 4096): each piece of a
Float8BlockScaling step timed alone -- the one-pass row+column 1x128
quantization of x and of dy, the three block-scaled GEMMs (fprop and dgrad
1x128 x 128x128, wgrad 1x128 x 1x128), the bias-gradient sum -- beside the
bf16 GEMM, and the older three-pass quantization (1x128 rows, a torch
transpose, 1x128 rows again) for comparison.  Quantization rows report
GB/s of bytes moved (read bf16 + written FP8 and scales).

Writes results/linear.json, results/linear_block_breakdown.json and
results/linear.png.
"""
import os

import torch

import seqfuse
import seqfuse.pytorch as te
from harness import RESULTS, Table, cuda_time_ms, host_time_us, plot_bars
from seqfuse.common.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling

RECIPES = [("fp8 delayed", DelayedScaling()), ("fp8 current", Float8CurrentScaling()),
           ("fp8 block", Float8BlockScaling())]


def make_pair(in_f, out_f):
    ours = te.Linear(in_f, out_f, params_dtype=torch.bfloat16, device="cuda")
    ref = torch.nn.Linear(in_f, out_f, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        ref.weight.copy_(ours.weight)
        ref.bias.copy_(ours.bias)
    return ours, ref


def step_fn(module, x, dy, recipe=None):
    def step():
        if recipe is None:
            y = module(x)
        else:
            with te.fp8_autocast(fp8_recipe=recipe):
                y = module(x)
        y.backward(dy)
        x.grad = None
    return step


def block_breakdown():
    """Time each piece of a block-FP8 Linear step alone (see the module note)."""
    from seqfuse import ops
    from seqfuse import quantization as Q

    tokens, in_f, out_f = 16384, 4096, 4096
    table = Table("linear_block_breakdown", ["piece", "ms", "GB_s", "TFLOP_s"])
    x = torch.randn(tokens, in_f, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(tokens, out_f, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16) * 0.02
    e4m3 = torch.float8_e4m3fn
    qbytes = x.numel() * (2 + 2 * 1) + 2 * 4 * x.numel() // 128  # bf16 in, two fp8 copies + scales
    flops = 2.0 * tokens * in_f * out_f

    def add(piece, fn, nbytes=None, nflops=None):
        ms = cuda_time_ms(fn, warmup=5, repeats=20)
        table.add(piece=piece, ms=ms, GB_s=nbytes / ms / 1e6 if nbytes else None,
                  TFLOP_s=nflops / ms / 1e9 if nflops else None)

    add("quantize x: rowcol 1x128 (one pass, both copies)",
        lambda: ops.quantize_block_fp8_rowcol(x, e4m3), qbytes)
    add("quantize x: old 1x128 + torch transpose + 1x128",
        lambda: (ops.quantize_block_fp8(x, 1, e4m3),
                 ops.quantize_block_fp8(x.t().contiguous(), 1, e4m3)), qbytes)
    add("quantize x: row-wise 1x128 only (warp kernel)", lambda: ops.quantize_block_fp8(x, 1, e4m3),
        x.numel() * 3 + 4 * x.numel() // 128)
    add("quantize x: row-wise 1x128 only (rowcol kernel)",
        lambda: ops.quantize_block_fp8_rowcol(x, e4m3, columnwise=False), x.numel() * 3 + 4 * x.numel() // 128)
    from seqfuse.quantization.gemm_quantizers import block_weight_transposed

    add("quantize W 128x128 + W^T copy (once per weight update)",
        lambda: block_weight_transposed(Q.quantize_block(w, 128, e4m3)))
    add("quantize W 128x128 + W^T copy in one call (quantize_block_fp8_weight)",
        lambda: ops.quantize_block_fp8_weight(w, e4m3))
    wq = Q.quantize_block(w, 128, e4m3)
    wt = block_weight_transposed(wq)
    xq = Q.quantize_block(x, 1, e4m3, columnwise=True)
    gq = Q.quantize_block(dy, 1, e4m3, columnwise=True)
    add("gemm fprop 1x128 x 128x128", lambda: ops.gemm(
        xq.data, wq.data, transb=True, a_scale_inv=xq.scale_inv, b_scale_inv=wq.scale_inv,
        a_scaling="block_1x128", b_scaling="block_128x128"), nflops=flops)
    add("gemm dgrad 1x128 x 128x128", lambda: ops.gemm(
        gq.data, wt.data, transb=True, a_scale_inv=gq.scale_inv, b_scale_inv=wt.scale_inv,
        a_scaling="block_1x128", b_scaling="block_128x128"), nflops=flops)
    add("gemm wgrad 1x128 x 1x128", lambda: ops.gemm(
        gq.data_t, xq.data_t, transb=True, a_scale_inv=gq.scale_inv_t, b_scale_inv=xq.scale_inv_t,
        a_scaling="block_1x128", b_scaling="block_1x128"), nflops=flops)
    add("bias gradient dy.sum(0) in fp32", lambda: dy.sum(0, dtype=torch.float32), dy.numel() * 2)
    add("torch bf16 gemm x @ W^T", lambda: torch.matmul(x, w.t()), nflops=flops)
    table.save()


def main():
    torch.manual_seed(0)
    table = Table("linear", ["case", "tokens", "in", "out", "seqfuse_ms", "torch_bf16_ms",
                             "speedup_vs_torch_bf16", "tflops"])
    labels, speed = [], {}
    for tokens, in_f, out_f in [(16384, 4096, 4096), (16384, 4096, 16384)]:
        ours, ref = make_pair(in_f, out_f)
        x = torch.randn(tokens, in_f, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(tokens, out_f, device="cuda", dtype=torch.bfloat16)
        flops = 3 * 2.0 * tokens * in_f * out_f
        t_ms = cuda_time_ms(step_fn(ref, x, dy), warmup=5, repeats=20)
        cases = [("bf16", None)] + RECIPES
        for name, recipe in cases:
            ms = cuda_time_ms(step_fn(ours, x, dy, recipe), warmup=5, repeats=20)
            row = table.add(case=name, tokens=tokens, **{"in": in_f, "out": out_f}, seqfuse_ms=ms,
                            torch_bf16_ms=t_ms, speedup_vs_torch_bf16=t_ms / ms,
                            tflops=flops / (ms * 1e-3) / 1e12)
            speed.setdefault(name, []).append(row["speedup_vs_torch_bf16"])
        labels.append(f"{tokens}x{in_f}->{out_f}")
        del ours, ref, x, dy
        torch.cuda.empty_cache()

    # host time per call: tiny shapes, forward only (the GPU idles)
    host = Table("linear_host", ["call", "us_per_call"])
    ours, ref = make_pair(64, 64)
    xs = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16)
    w_ours, w_ref = ours.weight.detach(), ref.weight.detach()

    def timed(call, fn):
        host.add(call=call, us_per_call=host_time_us(fn, calls=5000))

    with torch.no_grad():
        timed("torch.nn.Linear bf16 (no grad)", lambda: ref(xs))
        timed("seqfuse Linear bf16 (no grad)", lambda: ours(xs))
        with te.fp8_autocast(fp8_recipe=DelayedScaling()):
            timed("seqfuse Linear fp8 delayed (no grad)", lambda: ours(xs))
    xg = xs.clone().requires_grad_(True)
    timed("torch.nn.Linear bf16 (grad)", lambda: ref(xg))
    timed("seqfuse Linear bf16 (grad)", lambda: ours(xg))
    timed("seqfuse.ops.gemm bf16 16x64x64", lambda: seqfuse.ops.gemm(xs, w_ours, transb=True))
    timed("torch.matmul bf16 16x64x64", lambda: torch.matmul(xs, w_ref.t()))
    torch.cuda.synchronize()
    host.save()

    fp8_delayed = [r for r in table.rows if r["case"] == "fp8 delayed" and r["out"] == 4096][0]
    table.save({"goal_fp8_delayed_vs_torch_bf16": 1.5,
                "fp8_delayed_vs_torch_bf16_4096": fp8_delayed["speedup_vs_torch_bf16"],
                "host_us": {r["call"]: r["us_per_call"] for r in host.rows}})
    plot_bars(os.path.join(RESULTS, "linear.png"), "Linear forward+backward speedup over torch.nn.Linear bf16",
              labels, speed, "x torch bf16")
    block_breakdown()  # last: the tables above are saved whatever happens here


if __name__ == "__main__":
    if not (seqfuse.cuda_available() and torch.cuda.is_available()):
        raise SystemExit("bench_linear needs a CUDA GPU and a CUDA build of seqfuse")
    main()
