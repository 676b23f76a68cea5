"""FP8 at token counts that are not a multiple of 16: what the padding inside
the quantizers costs (seqfuse.quantization.gemm_quantizers).

For Linear (4096 -> 4096), LayerNormLinear (4096 -> 12288, the QKV shape)
and LayerNormMLP (4096 -> 16384 GELU) under each FP8 recipe, one training
step (forward + backward, the weights' version bumped in place after each
step so every step pays its weight casts, and the delayed-scaling update at
the autocast exit) at an unaligned token count M and at the next aligned
count (padded_rows(M)): the ratio is the cost of M's padding over the
aligned problem the GEMMs really run.  Goal: at most 1.05 at 4,096 rows and
more.  Also the same step at M in bf16 for scale.

Writes results/fp8_rows.json.  Run on the GPU machine:
    python benchmarks/bench_fp8_rows.py
"""
import argparse

import torch

import seqfuse.pytorch as te
from harness import Table, cuda_time_ms
from seqfuse.common.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling
from seqfuse.quantization.gemm_quantizers import padded_rows

RECIPES = [("delayed", DelayedScaling), ("current", Float8CurrentScaling), ("block", Float8BlockScaling)]


def modules(h):
    kw = dict(params_dtype=torch.bfloat16, device="cuda")
    return [("Linear 4096->4096", te.Linear(h, h, **kw)),
            ("LayerNormLinear 4096->12288", te.LayerNormLinear(h, 3 * h, **kw)),
            ("LayerNormMLP 4096->16384 gelu", te.LayerNormMLP(h, 4 * h, activation="gelu", **kw))]


def step_ms(m, rows, h, recipe):
    x = torch.randn(rows, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out_f = m(x.detach()[:1]).shape[-1]
    dy = torch.randn(rows, out_f, device="cuda", dtype=torch.bfloat16)
    weights = [p for p in m.parameters() if p.dim() == 2]

    def step():
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            y = m(x)
        y.backward(dy)
        x.grad = None
        with torch.no_grad():
            for w in weights:  # an optimizer step's effect on the FP8 weight cache
                w.mul_(1.0)
    return cuda_time_ms(step, warmup=5, repeats=25)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="4097,8191,16383,16385")
    p.add_argument("--hidden", type=int, default=4096)
    args = p.parse_args()
    h = args.hidden
    table = Table("fp8_rows", ["module", "recipe", "rows", "aligned_rows", "ms", "aligned_ms", "ratio",
                               "bf16_ms"])
    for name, m in modules(h):
        for rows in (int(r) for r in args.rows.split(",")):
            bf16 = step_ms(m, rows, h, None)
            for rname, rcls in RECIPES:
                t = step_ms(m, rows, h, rcls())
                ta = step_ms(m, padded_rows(rows), h, rcls())
                table.add(module=name, recipe=rname, rows=rows, aligned_rows=padded_rows(rows), ms=t,
                          aligned_ms=ta, ratio=t / ta, bf16_ms=bf16)
        del m
        torch.cuda.empty_cache()
    table.save({"note": "forward+backward per step, weights bumped after each step (casts paid every step), "
                        "median of 25 after 5 warm-up steps on the same shapes, L2 flushed; ratio = "
                        "unaligned rows / next multiple of 16"})


if __name__ == "__main__":
    main()
