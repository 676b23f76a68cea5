"""FP8 attention inside a TransformerLayer step: seqfuse's te.TransformerLayer at
a Llama 3 8B layer's shape (hidden 4096, 32 query heads of 128, 8 key/value
heads, SwiGLU FFN 14,336, RMSNorm, causal), one sequence of 8,192 tokens,
bf16 weights, forward+backward under FP8 DelayedScaling with fp8_dpa off
(GEMMs in FP8, attention in bf16 on cuDNN) and on (attention in FP8 too,
seqfuse.quantization.attention), and the same layer in bf16, in one process
on the same inputs and weights.  Timing: harness.cuda_time_ms of CALLS
back-to-back steps (median per step), after warm-up steps that also run the
delayed-scaling updates.

    python3 benchmarks/attn/bench_fp8_dpa_layer.py
Writes benchmarks/results/fp8_dpa_layer.json (commit, versions, command).
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from harness import Table, cuda_time_ms  # noqa: E402

import seqfuse.pytorch as te  # noqa: E402
from seqfuse.common.recipe import DelayedScaling  # noqa: E402

CALLS = 5


def main():
    torch.manual_seed(0)
    layer = te.TransformerLayer(4096, 14336, 32, num_gqa_groups=8, hidden_dropout=0.0, attention_dropout=0.0,
                                self_attn_mask_type="causal", bias=False, activation="swiglu",
                                normalization="RMSNorm", attn_input_format="bshd", params_dtype=torch.bfloat16,
                                device="cuda")
    x = torch.randn(1, 8192, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x) * 1e-3
    table = Table("fp8_dpa_layer", ["row", "ms", "vs_fp8_gemms_only", "vs_bf16"])
    rows = {"bf16": None, "fp8_gemms_bf16_attention": DelayedScaling(), "fp8_gemms_fp8_attention":
            DelayedScaling(fp8_dpa=True)}
    ms = {}
    for name, recipe in rows.items():
        def step(recipe=recipe):
            with te.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
                y = layer(x)
            y.backward(dy)

        def many():
            for _ in range(CALLS):
                step()
        for _ in range(3):
            step()
        ms[name] = cuda_time_ms(many, warmup=1, repeats=5) / CALLS
    for name, t in ms.items():
        table.add(row=name, ms=round(t, 3), vs_fp8_gemms_only=round(ms["fp8_gemms_bf16_attention"] / t, 3),
                  vs_bf16=round(ms["bf16"] / t, 3))
    table.save()


if __name__ == "__main__":
    main()
