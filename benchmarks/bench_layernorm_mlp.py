"""LayerNormMLP forward+backward at 16384 tokens x 4096 hidden x 16384 FFN:
seqfuse in FP8 (DelayedScaling, HYBRID: E4M3 forward, E5M2 gradients; and
Float8BlockScaling, E4M3 1x128 / 128x128 blocks) and in bf16, against the same block in torch bf16 (F.layer_norm, F.linear, the
activation, F.linear) eager and under torch.compile; same process, same
inputs and weights (bf16 parameters everywhere).

Throughput counts the GEMM FLOPs only: forward 2 x N x H x F x (1 + fc1
width factor), backward twice that.  Goal (issue 5): FP8 forward+backward >= 1.5x the
torch bf16 block.
"""
import os

import torch
import torch.nn.functional as F

import seqfuse
import seqfuse.pytorch as te
from seqfuse.common.recipe import DelayedScaling, Float8BlockScaling, Format
from seqfuse.quantization import autocast

from harness import H200_BF16_TFLOPS, H200_FP8_TFLOPS, RESULTS, Table, cuda_time_ms, plot_bars

TOKENS, HIDDEN, FFN = 16384, 4096, 16384


def torch_block(activation):
    def act(h):
        if activation == "gelu":
            return F.gelu(h, approximate="tanh")
        a, g = h.chunk(2, dim=-1)
        return F.silu(a) * g

    def block(x, lw, lb, w1, b1, w2, b2):
        ln = F.layer_norm(x, (x.shape[-1],), lw, lb, 1e-5)
        return F.linear(act(F.linear(ln, w1, b1)), w2, b2)
    return block


def main():
    if not (torch.cuda.is_available() and seqfuse.cuda_available()):
        print("bench_layernorm_mlp: needs a CUDA GPU and a CUDA build of seqfuse")
        return
    table = Table("layernorm_mlp", ["activation", "shape", "impl", "ms", "TFLOP_s", "x_vs_torch_bf16",
                                    "x_vs_compile"])
    labels, series = [], {"vs torch bf16 eager": [], "vs torch bf16 compile": []}
    for activation in ("gelu", "swiglu"):
        torch.manual_seed(0)
        m = te.LayerNormMLP(HIDDEN, FFN, activation=activation, params_dtype=torch.bfloat16, device="cuda")
        with torch.no_grad():
            for p in m.parameters():
                if p.dim() == 2:
                    p.normal_(0, 0.02)
        x = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16)
        params = [x] + list(m.parameters())
        width = 2 if activation == "swiglu" else 1
        flops = 3 * 2 * TOKENS * HIDDEN * FFN * (1 + width)
        recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16, amax_compute_algo="max")

        def seqfuse_fp8():
            with autocast(recipe=recipe):
                y = m(x)
            torch.autograd.grad(y, params, dy)

        block_recipe = Float8BlockScaling()

        def seqfuse_fp8_block():
            with autocast(recipe=block_recipe):
                y = m(x)
            torch.autograd.grad(y, params, dy)

        def seqfuse_bf16():
            torch.autograd.grad(m(x), params, dy)

        block = torch_block(activation)
        compiled = torch.compile(block)
        args = [x, m.layer_norm_weight, m.layer_norm_bias, m.fc1_weight, m.fc1_bias, m.fc2_weight, m.fc2_bias]

        def torch_bf16():
            torch.autograd.grad(block(*args), params, dy)

        def torch_compile():
            torch.autograd.grad(compiled(*args), params, dy)

        times = {}
        for name, fn in (("seqfuse fp8", seqfuse_fp8), ("seqfuse fp8 block", seqfuse_fp8_block),
                         ("seqfuse bf16", seqfuse_bf16),
                         ("torch bf16", torch_bf16), ("torch.compile bf16", torch_compile)):
            times[name] = cuda_time_ms(fn, warmup=3, repeats=10)
        for name, ms in times.items():
            table.add(activation=activation, shape=f"{TOKENS}x{HIDDEN}x{FFN}", impl=name, ms=ms,
                      TFLOP_s=flops / ms / 1e9, x_vs_torch_bf16=times["torch bf16"] / ms,
                      x_vs_compile=times["torch.compile bf16"] / ms)
        for name in ("seqfuse fp8", "seqfuse fp8 block", "seqfuse bf16"):
            labels.append(f"{activation} {name}")
            series["vs torch bf16 eager"].append(times["torch bf16"] / times[name])
            series["vs torch bf16 compile"].append(times["torch.compile bf16"] / times[name])
        del m, x, dy
        torch.cuda.empty_cache()
    table.save({"ceilings_tflops": {"bf16": H200_BF16_TFLOPS, "fp8": H200_FP8_TFLOPS},
                "recipe": "seqfuse fp8: DelayedScaling(HYBRID, amax_history_len=16, max); "
                          "seqfuse fp8 block: Float8BlockScaling() (E4M3, 1x128 / 128x128)"})
    plot_bars(os.path.join(RESULTS, "layernorm_mlp.png"),
              "LayerNormMLP forward+backward 16384x4096x16384 (H200): speedup over torch bf16", labels, series,
              "x speedup")


if __name__ == "__main__":
    main()
