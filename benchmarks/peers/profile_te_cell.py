"""Where one bench_te_modules cell's time goes: seqfuse's module and Transformer
Engine's, same shape, recipe and inputs, each run ``--steps`` training
iterations (bench_te_modules.train_step) under torch.profiler after
``--warmup`` untimed ones; prints each library's CUDA kernels by total time
per iteration (name, calls, microseconds), its kernel total, and the
iteration's wall time (CUDA events around the profiled steps).

Why: the cell llama_1b LayerNormMLP bf16 stays under TE's (0.98-0.995x on
the H100/H200) while the GEMMs should be the same cuBLASLt kernels; this
says which kernels differ.

    python3 benchmarks/peers/profile_te_cell.py --shape llama_1b --module LayerNormMLP --recipe bf16
"""
import argparse
import os
import sys

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, BENCH)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import peers  # noqa: E402,F401  (seqfuse from a source checkout)
from bench_te_modules import MODULES, RECIPES, SHAPES, Case, copy_weights, head_dim, make_inputs  # noqa: E402


def kernels(case, steps, warmup, top):
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        case.step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start.record()
        for _ in range(steps):
            case.step()
        end.record()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0 and e.count > 0 and not e.key.startswith("ProfilerStep"):
            rows.append((t / steps, e.count // steps, e.key[:120]))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    print(f"== {case.lib_name}: {start.elapsed_time(end) / steps * 1e3:.1f} us a step (profiled), "
          f"kernels {total:.1f} us")
    for t, n, k in rows[:top]:
        print(f"  {t:9.1f} us  x{n:<3d} {k}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama_1b", choices=sorted(SHAPES))
    p.add_argument("--module", default="LayerNormMLP", choices=MODULES)
    p.add_argument("--recipe", default="bf16", choices=RECIPES)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    import seqfuse.pytorch as sf

    c, device = SHAPES[args.shape], torch.device("cuda")
    x, dy = make_inputs(args.module, c, device, torch.bfloat16)
    freqs = sf.RotaryPositionEmbedding(head_dim(c), device=device)(c["seq"])
    cases = {lib: Case(lib, args.module, c, args.recipe, x, dy, freqs) for lib in ("seqfuse", "te")}
    copy_weights(cases["seqfuse"].mod, cases["te"].mod)
    for case in cases.values():
        kernels(case, args.steps, args.warmup, args.top)


if __name__ == "__main__":
    main()
