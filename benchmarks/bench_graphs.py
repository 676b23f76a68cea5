"""CUDA graphs of FP8 layers: seqfuse.pytorch.make_graphed_callables against
the same layers run eagerly, in the same process on the same inputs.

A stack of TransformerLayers at ESM-2 650M's width (hidden 1280, 20 heads,
FFN 5120) trains one step (forward + backward, every weight's version
bumped after it as an optimizer step would, the delayed-scaling update at
the autocast exit) at a small token count, where the host's work per layer
decides the step time (FP8 issues more calls than bf16), and at a large one,
where the GPU does.  Rows: bf16 and FP8 delayed / current / block, eager and
graphed (each layer its own pair of graphs), milliseconds per step (median
of CUDA-event timings after warm-up on the same shapes), and the graphed
speed-up.

Writes results/graphs.json.  On the GPU machine:
    python benchmarks/bench_graphs.py
"""
import argparse

import torch

import seqfuse.pytorch as te
from harness import Table, cuda_time_ms
from seqfuse.common.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling

RECIPES = [("bf16", None), ("fp8 delayed", DelayedScaling()), ("fp8 current", Float8CurrentScaling()),
           ("fp8 block", Float8BlockScaling())]


def make_stack(n, h=1280, heads=20, ffn=5120):
    torch.manual_seed(0)
    return [te.TransformerLayer(h, ffn, heads, hidden_dropout=0.0, attention_dropout=0.0,
                                self_attn_mask_type="no_mask", params_dtype=torch.bfloat16,
                                device="cuda") for _ in range(n)]


def step_fn(layers, x, dy, recipe):
    weights = [p for m in layers for p in m.parameters() if p.dim() == 2]

    def step():
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            y = x
            for layer in layers:
                y = layer(y)
        y.backward(dy)
        x.grad = None
        with torch.no_grad():
            for w in weights:
                w.mul_(1.0)
    return step


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--shapes", default="1x512,8x1024", help="batch x sequence, sbhd")
    args = p.parse_args()
    table = Table("graphs", ["tokens", "precision", "eager_ms", "graphed_ms", "speedup"])
    for shape in args.shapes.split(","):
        b, s = (int(v) for v in shape.split("x"))
        for name, recipe in RECIPES:
            layers = make_stack(args.layers)
            x = torch.randn(s, b, 1280, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            dy = torch.randn_like(x)
            eager = cuda_time_ms(step_fn(layers, x, dy, recipe), warmup=5, repeats=30)
            sample = tuple((torch.randn_like(x).requires_grad_(True),) for _ in layers)
            graphed = te.make_graphed_callables(tuple(layers), sample, fp8_enabled=recipe is not None,
                                                fp8_recipe=recipe)
            g = cuda_time_ms(step_fn(list(graphed), x, dy, recipe), warmup=5, repeats=30)
            table.add(tokens=f"{b}x{s}", precision=name, eager_ms=eager, graphed_ms=g, speedup=eager / g)
            del layers, graphed
            torch.cuda.empty_cache()
    table.save({"note": f"{args.layers} TransformerLayers (ESM-2 650M width), forward+backward per step, weights bumped "
                        "after each step, median of 30 CUDA-event timings after 5 warm-up steps"})


if __name__ == "__main__":
    main()
