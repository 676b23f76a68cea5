"""Where a grouped GEMM's time goes, at Mixtral-small's expert shapes
(32,768 routed rows, hidden 1024, FFN 3584; 8 and 64 experts, balanced):

  host issue  the host's time per call while the GPU is kept busy ahead (so
              nothing waits on it): what a call costs the training loop's
              thread;
  wall        one call after another, synchronized: the larger of the host's
              and the GPU's time;
  kernels     the kernels' own summed durations (torch.profiler), with the
              three commonest kernels, their count and mean duration;

for seqfuse's grouped GEMM on one stream (lanes=1), on its default lanes
(None: chosen from the groups' sizes) and on 4 lanes, and torch._grouped_mm.
Then the host issue time of single GEMM calls on one expert's down
projection (512 x 1024 x 3584): torch.matmul (cuBLASLt under torch),
seqfuse.ops.gemm, and the grouped GEMM's cost per group.  A diagnosis, not a
claim: no ratio here is a goal.

    python3 benchmarks/moe/profile_grouped_gemm.py
"""
import collections
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "python"))

from seqfuse import ops  # noqa: E402
from seqfuse.ops import moe  # noqa: E402

ROWS, HIDDEN, FFN = 32768, 1024, 3584


def busy_gpu():
    """About 40 ms of queued matmuls: calls issued after this never wait."""
    big = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(40):
        big @ big


def host_us(fn, reps):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    busy_gpu()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    dt = (time.perf_counter() - t0) / reps * 1e6
    torch.cuda.synchronize()
    return dt


def wall_us(fn, reps=10):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e6


def kernels(fn, reps=3):
    """(summed kernel us per call, [(count per call, mean us, name)] of the commonest three)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    count, total = collections.Counter(), collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            count[e.name[:90]] += 1
            total[e.name[:90]] += e.device_time
    top = [(c / reps, total[name] / c, name) for name, c in count.most_common(3)]
    return sum(total.values()) / reps, top


def main():
    for experts in (8, 64):
        splits = [ROWS // experts] * experts
        offs = torch.tensor(splits, device="cuda").cumsum(0).to(torch.int32)
        for gemm, n, k in (("fc1", 2 * FFN, HIDDEN), ("fc2", HIDDEN, FFN)):
            x = torch.randn(ROWS, k, device="cuda").bfloat16()
            w = (torch.randn(experts, n, k, device="cuda") * 0.02).bfloat16()
            ws, wt = list(w.unbind(0)), w.transpose(-2, -1)
            out = torch.empty(ROWS, n, device="cuda", dtype=torch.bfloat16)
            calls = {f"seqfuse lanes={ln}": (lambda ln=ln: moe.grouped_gemm(x, ws, splits, transb=True, out=out,
                                                                             lanes=ln))
                     for ln in (1, None, 4)}
            calls["torch._grouped_mm"] = lambda: torch._grouped_mm(x, wt, offs=offs, out_dtype=torch.bfloat16)
            for name, fn in calls.items():
                host, wall = host_us(fn, 10), wall_us(fn)
                ktot, top = kernels(fn)
                print(f"{experts:3d} experts {gemm} {name:20s} host issue {host:8.1f} us  wall {wall:8.1f} us  "
                      f"kernels {ktot:8.1f} us")
                for c, mean, kname in top:
                    print(f"      {c:5.1f}x {mean:7.1f} us  {kname}")
            torch.cuda.empty_cache()

    m, n, k = ROWS // 64, HIDDEN, FFN
    x = torch.randn(ROWS, k, device="cuda").bfloat16()
    w = (torch.randn(64, n, k, device="cuda") * 0.02).bfloat16()
    ws = list(w.unbind(0))
    out = torch.empty(ROWS, n, device="cuda", dtype=torch.bfloat16)
    one = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    splits = [m] * 64
    print(f"host issue per GEMM call, one expert's down projection {m} x {n} x {k}:")
    rows = {
        "torch.matmul(out=)": host_us(lambda: torch.matmul(x[:m], ws[0].t(), out=one), 200),
        "seqfuse ops.gemm(out=)": host_us(lambda: ops.gemm(x[:m], ws[0], transb=True, out=one), 200),
        "grouped_gemm, 1 group, lanes=1 (whole call)": host_us(
            lambda: moe.grouped_gemm(x[:m], ws[:1], [m], transb=True, out=one, lanes=1), 200),
        "grouped_gemm, 64 groups, lanes=1, per group": host_us(
            lambda: moe.grouped_gemm(x, ws, splits, transb=True, out=out, lanes=1), 20) / 64,
        "grouped_gemm, 64 groups, default lanes, per group": host_us(
            lambda: moe.grouped_gemm(x, ws, splits, transb=True, out=out), 20) / 64,
    }
    for name, us in rows.items():
        print(f"  {us:8.2f} us  {name}")


if __name__ == "__main__":
    main()
