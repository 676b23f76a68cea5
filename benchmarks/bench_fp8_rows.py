"""FP8 at token counts that are not a multiple of 16: what the padding inside
the quantizers costs (seqfuse.quantization.gemm_quantizers).

For Linear (4096 -> 4096), LayerNormLinear (4096 -> 12288, the QKV shape)
and LayerNormMLP (4096 -> 16384 GELU) under each FP8 recipe, one training
step (forward + backward, the weights' version bumped in place after each
step so every step pays its weight casts, and the delayed-scaling update at
the autocast exit) at an unaligned token count M and at the next aligned
count (padded_rows(M)): the ratio is the cost of M's padding over the
aligned problem the GEMMs really run, taken per round of queued steps
(the two interleaved, so a slower stretch of the GPU or host touches both)
and its median reported.  Goal: at most 1.05 at 4,096 rows and
more.  Also the same step at M in bf16 for scale.

Writes results/fp8_rows.json.  Run on the GPU machine:
    python benchmarks/bench_fp8_rows.py
"""
import argparse
import statistics

import torch

import seqfuse.pytorch as te
from harness import Table
from seqfuse.common.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling
from seqfuse.quantization.gemm_quantizers import padded_rows

RECIPES = [("delayed", DelayedScaling), ("current", Float8CurrentScaling), ("block", Float8BlockScaling)]


def modules(h):
    kw = dict(params_dtype=torch.bfloat16, device="cuda")
    return [("Linear 4096->4096", te.Linear(h, h, **kw)),
            ("LayerNormLinear 4096->12288", te.LayerNormLinear(h, 3 * h, **kw)),
            ("LayerNormMLP 4096->16384 gelu", te.LayerNormMLP(h, 4 * h, activation="gelu", **kw))]


def make_step(m, rows, h, recipe):
    """One training step of module m at ``rows`` tokens under ``recipe``."""
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
    return step


def queued_ms(steps, rounds, queue, warmup=5):
    """Per-step milliseconds of each function in ``steps``: after ``warmup``
    calls of each, ``rounds`` rounds that time ``queue`` calls of each in
    turn between two CUDA events (queued back to back, no synchronization
    inside, so a step's host work overlaps the previous step's kernels as in
    a training loop; which function goes first rotates from round to round).  Returns (median per-step ms of each, median over the
    rounds of each one's ratio to the first)."""
    for fn in steps:
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    times = [[] for _ in steps]
    for r in range(rounds):
        for i in [(r + j) % len(steps) for j in range(len(steps))]:  # the order rotates round to round
            fn = steps[i]
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(queue):
                fn()
            end.record()
            end.synchronize()
            times[i].append(start.elapsed_time(end) / queue)
    ratios = [statistics.median(t / b for t, b in zip(ti, times[0])) for ti in times]
    return [statistics.median(t) for t in times], ratios


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="4097,8191,16383,16385")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--queue", type=int, default=10, help="steps timed back to back per round")
    args = p.parse_args()
    h = args.hidden
    table = Table("fp8_rows", ["module", "recipe", "rows", "aligned_rows", "ms", "aligned_ms", "ratio",
                               "bf16_ms"])
    for name, m in modules(h):
        for rows in (int(r) for r in args.rows.split(",")):
            for rname, rcls in RECIPES:
                # the aligned step first (the ratios' base), the unaligned one, bf16 at the same rows for scale
                # (one recipe object for both: the module keeps one scaling state per recipe)
                recipe = rcls()
                (ta, t, bf16), (_, ratio, _) = queued_ms(
                    [make_step(m, padded_rows(rows), h, recipe), make_step(m, rows, h, recipe),
                     make_step(m, rows, h, None)], args.rounds, args.queue)
                table.add(module=name, recipe=rname, rows=rows, aligned_rows=padded_rows(rows), ms=t,
                          aligned_ms=ta, ratio=ratio, bf16_ms=bf16)
        del m
        torch.cuda.empty_cache()
    table.save({"note": "forward+backward per step, weights bumped after each step (casts paid every step); "
                        f"{args.rounds} rounds, each timing {args.queue} steps queued back to back of the "
                        "aligned, the unaligned and the bf16 step in turn, after 5 warm-up steps of each; ms: "
                        "median per-step time; ratio: median over the rounds of unaligned / aligned (rows "
                        "rounded up to a multiple of 16)"})


if __name__ == "__main__":
    main()
