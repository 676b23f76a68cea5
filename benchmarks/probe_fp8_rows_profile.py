"""Where an unaligned token count's extra time goes in one FP8 module step
(issue 20's "at most 5 % over the next aligned count"): bench_fp8_rows.py's
step of a module at M rows and at padded_rows(M), each queued ``--steps``
times, with (1) the host's issue time per step (no synchronization inside
the loop: the host's own cost, unless the GPU queue fills up), (2) the
wall time per step after a synchronize, and (3) the CUDA kernels of the
steps from torch.profiler, the largest first, with their per-step time.

    python benchmarks/probe_fp8_rows_profile.py --module Linear --recipe block --rows 4097
"""
import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench_fp8_rows import RECIPES, make_step, modules
from seqfuse.quantization.gemm_quantizers import padded_rows


def issue_and_wall(step, steps):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / steps * 1e3, (t2 - t0) / steps * 1e3


def kernels(step, steps, top):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0:
            rows.append((t / steps, e.count // steps, e.key[:110]))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    return total, rows[:top]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--module", default="Linear")
    p.add_argument("--recipe", default="block")
    p.add_argument("--rows", type=int, default=4097)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--top", type=int, default=14)
    p.add_argument("--host", action="store_true",
                   help="also: one step under torch's sync debug mode (each synchronizing call printed with "
                        "where it came from) and --steps steps under cProfile (the host's functions by own time, "
                        "C entries included as builtins)")
    args = p.parse_args()
    name, m = next((n, mod) for n, mod in modules(args.hidden) if n.startswith(args.module))
    recipe = dict(RECIPES)[args.recipe]()
    for rows in (padded_rows(args.rows), args.rows):
        step = make_step(m, rows, args.hidden, recipe)
        for _ in range(5):
            step()
        issue, wall = issue_and_wall(step, args.steps)
        issue2, wall2 = issue_and_wall(step, args.steps)
        total, top = kernels(step, args.steps, args.top)
        print(f"== {name} {args.recipe} rows={rows}: host issue {issue:.3f} / {issue2:.3f} ms a step, wall "
              f"{wall:.3f} / {wall2:.3f} ms a step, CUDA kernel time {total / 1e3:.3f} ms a step")
        for us, count, key in top:
            print(f"   {us:9.1f} us  x{count:<3d} {key}")
        if args.host:
            host_report(step, args.steps, args.top)


def host_report(step, steps, top):
    """Where a step's host time goes: the calls that synchronize with the GPU
    in one step (torch.cuda.set_sync_debug_mode's warnings: their count and
    the first five with the file and line torch gives), then cProfile's
    functions by own time over ``steps`` steps."""
    import cProfile
    import pstats
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        before = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(before)
    # (torch's own note that the mode is a prototype is not a synchronizing call)
    syncs = [w for w in caught if "called a synchronizing" in str(w.message)]
    print(f"   synchronizing calls in one step: {len(syncs)}")
    for w in syncs[:5]:
        print(f"     {w.message} ({w.filename}:{w.lineno})")
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


if __name__ == "__main__":
    main()
