"""Where does seqfuse's bf16 Linear step lose time against torch.nn.Linear?

Session 12 measured, at the Llama 3.2 1B QKV shape (x [8192, 2048] bf16,
W [3072, 2048], no bias), one training step (forward, backward with the input
requiring grad, an in-place weight update) at 0.714 ms for
seqfuse.pytorch.Linear against 0.425 ms for torch.nn.Linear, while the
step's three GEMMs as torch matmuls take about 0.45 ms together.  This probe
splits that gap into its possible sources, each measured on its own:

  A. the three GEMMs one by one: torch's matmul, seqfuse.ops.gemm called
     exactly as modules/linear.py calls it (forward x@W^T, dgrad dy@W,
     wgrad dy^T@x), ops.gemm with a smaller cuBLASLt workspace (the
     workspace size steers cuBLASLt's heuristic, e.g. towards or away from
     split-K), and torch's matmul through its own cuBLASLt path
     (preferred_blas_library("cublaslt")) -- a slower kernel choice by
     cuBLASLt's first heuristic answer shows up here;
  B. the whole step, and the three seqfuse GEMMs back to back without
     autograd: if the step is close to the three GEMMs, the module adds
     nothing on the GPU;
  C. the host time to enqueue one step while the GPU is held busy (a
     torch.cuda._sleep kernel in front), beside the step's device time: a
     step whose host time exceeds its device time is host-bound;
  D. a torch.profiler kernel table of one seqfuse step and one torch step
     side by side (kernel name, launches and microseconds per step): extra
     kernels (casts, copies, zero-fills, split-K reductions) and the GEMM
     kernels each library picked, by name;
  E. the cuBLASLt heuristic queries made during the timed steps (must be 0:
     plans are cached).

Prints only (small output, nothing written).  On an H200 it runs in about
30 s.  Usage:

    python3 benchmarks/gemm/linear_overhead_probe.py [--tokens 8192] [--in 2048] [--out 3072]

Without a GPU it runs a tiny smoke version on the CPU (timings meaningless)
so that the script itself can be checked anywhere: --smoke.
"""
import argparse
import importlib
import time

import torch

import seqfuse.pytorch as sf
from seqfuse import ops

#: the module seqfuse.ops.gemm (the name ops.gemm is the function): its plan-cache counters
gemm_module = importlib.import_module("seqfuse.ops.gemm")


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--in", dest="in_f", type=int, default=2048)
    p.add_argument("--out", dest="out_f", type=int, default=3072)
    p.add_argument("--steps", type=int, default=50, help="timed steps per repeat")
    p.add_argument("--smoke", action="store_true", help="tiny CPU run that checks the script only")
    return p.parse_args()


class Timer:
    """Best-of-3 mean time of fn over `steps` calls after warm-up: CUDA
    events on the GPU (the device time of a queue of calls), perf_counter on
    the CPU (smoke runs only)."""

    def __init__(self, cuda, steps):
        self.cuda, self.steps = cuda, steps

    def ms(self, fn, warmup=10):
        for _ in range(warmup):
            fn()
        self.sync()
        best = float("inf")
        for _ in range(3):
            if self.cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(self.steps):
                    fn()
                b.record()
                torch.cuda.synchronize()
                best = min(best, a.elapsed_time(b) / self.steps)
            else:
                t0 = time.perf_counter()
                for _ in range(self.steps):
                    fn()
                best = min(best, (time.perf_counter() - t0) * 1e3 / self.steps)
        return best

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()


def make_step(module, x, dy):
    """One training step as the session-12 probe ran it: forward, backward
    (x requires grad), SGD update in place, gradients dropped."""
    def step():
        y = module(x)
        y.backward(dy)
        with torch.no_grad():
            for p in module.parameters():
                p.add_(p.grad, alpha=-1e-4)
                p.grad = None
        x.grad = None
    return step


def host_us_per_step(step, cuda, n=20):
    """Host time to enqueue one step while the GPU cannot hold the host back
    (a sleep kernel long enough for n steps runs first on the stream)."""
    for _ in range(3):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda._sleep(int(2e9 * 0.05))  # ~50 ms at ~2 GHz: longer than n steps' host time
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    host = (time.perf_counter() - t0) * 1e6 / n
    if cuda:
        torch.cuda.synchronize()
    return host


def kernel_table(fn, cuda, steps=5):
    """{kernel name: (launches per step, device us per step)} over `steps`
    calls of fn (CPU ops in smoke runs)."""
    fn()
    if cuda:
        torch.cuda.synchronize()
    act = [torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=act) as prof:
        for _ in range(steps):
            fn()
        if cuda:
            torch.cuda.synchronize()
    rows = {}
    for e in prof.events():
        if cuda and e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if not cuda and e.cpu_parent is not None:  # top-level CPU ops only in the smoke run
            continue
        n, us = rows.get(e.name, (0, 0.0))
        rows[e.name] = (n + 1, us + e.time_range.elapsed_us())
    return {k: (n / steps, us / steps) for k, (n, us) in rows.items()}


def print_kernels(title, table):
    if not table:
        print(f"  {title}: the profiler recorded no device events (kernel table unavailable)")
        return
    total = sum(us for _, us in table.values())
    print(f"  {title}: {total:.1f} us of kernels per step")
    for name, (n, us) in sorted(table.items(), key=lambda kv: -kv[1][1]):
        short = name if len(name) <= 110 else name[:107] + "..."
        print(f"    {us:8.1f} us  x{n:4.1f}  {short}")


def main():
    args = parse()
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        raise SystemExit("linear_overhead_probe: no CUDA device; pass --smoke for a CPU check of the script")
    T, H, O = (args.tokens, args.in_f, args.out_f) if cuda else (64, 32, 48)
    dev = "cuda" if cuda else "cpu"
    timer = Timer(cuda, args.steps if cuda else 3)
    torch.manual_seed(0)
    x = (torch.randn(T, H, device=dev) * 0.5).bfloat16().requires_grad_()
    dy = (torch.randn(T, O, device=dev) * 0.1).bfloat16()
    tl = torch.nn.Linear(H, O, bias=False, device=dev, dtype=torch.bfloat16)
    sl = sf.Linear(H, O, bias=False, params_dtype=torch.bfloat16, device=dev)
    with torch.no_grad():
        sl.weight.copy_(tl.weight)
    W, xd = tl.weight.detach(), x.detach()
    flop = 2.0 * T * H * O
    print(f"[linear_overhead_probe] device {torch.cuda.get_device_name() if cuda else 'cpu (smoke)'}, "
          f"torch {torch.__version__}, x [{T}, {H}] bf16, W [{O}, {H}], no bias; "
          f"one GEMM = {flop / 1e9:.1f} GFLOP")

    # A. the three GEMMs alone ------------------------------------------------
    outs = {"forward": torch.empty(T, O, dtype=torch.bfloat16, device=dev),
            "dgrad": torch.empty(T, H, dtype=torch.bfloat16, device=dev),
            "wgrad": torch.empty(O, H, dtype=torch.bfloat16, device=dev)}
    small_ws = {mib: torch.empty(mib * 1024 * 1024, dtype=torch.uint8, device=dev) for mib in (1, 4)}
    gemms = {  # name: (torch matmul, seqfuse call as modules/linear.py makes it, kwargs for a given workspace)
        "forward   x@W^T": (lambda: xd @ W.t(), lambda **kw: ops.gemm(xd, W, transb=True, out=outs["forward"], **kw)),
        "dgrad dy@W": (lambda: dy @ W, lambda **kw: ops.gemm(dy, W, out=outs["dgrad"], **kw)),
        "wgrad dy^T@x": (lambda: dy.t() @ xd, lambda **kw: ops.gemm(dy, xd, transa=True, out=outs["wgrad"], **kw)),
    }
    # correctness of what is being timed (bf16 outputs against torch's, loose: a layout mix-up is O(1))
    for name, (tf, sfn) in gemms.items():
        ref, got = tf().float(), sfn().float()
        err = ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        if err > 1e-2:
            raise SystemExit(f"linear_overhead_probe: seqfuse {name} differs from torch (relative error {err:.3g})")
    print("\nA. each GEMM alone, ms (TFLOP/s); lt = torch through its cuBLASLt path")
    print(f"  {'gemm':14s} {'torch':>15s} {'torch lt':>15s} {'seqfuse 32MiB':>15s} {'seqfuse 4MiB':>15s} "
          f"{'seqfuse 1MiB':>15s}")
    gemm_ms = {}
    for name, (tf, sfn) in gemms.items():
        row = {"torch": timer.ms(tf)}
        if cuda:
            prev = torch.backends.cuda.preferred_blas_library()
            try:
                torch.backends.cuda.preferred_blas_library("cublaslt")
                row["torch lt"] = timer.ms(tf)
            finally:
                torch.backends.cuda.preferred_blas_library(prev)
        row["seqfuse 32MiB"] = timer.ms(sfn)
        for mib, ws in small_ws.items():
            row[f"seqfuse {mib}MiB"] = timer.ms(lambda: sfn(workspace=ws))
        gemm_ms[name] = row

        def cell(k):
            if k not in row:
                return f"{'-':>15s}"
            return f"{row[k]:7.3f} ({flop / row[k] / 1e9:4.0f})"
        print(f"  {name:14s} " + " ".join(cell(k) for k in
                                         ("torch", "torch lt", "seqfuse 32MiB", "seqfuse 4MiB", "seqfuse 1MiB")))
    sum_t = sum(r["torch"] for r in gemm_ms.values())
    sum_s = sum(r["seqfuse 32MiB"] for r in gemm_ms.values())
    print(f"  sum: torch {sum_t:.3f} ms, seqfuse {sum_s:.3f} ms (seqfuse - torch = {sum_s - sum_t:+.3f} ms)")

    # B. whole steps -----------------------------------------------------------
    step_t, step_s = make_step(tl, x, dy), make_step(sl, x, dy)

    def raw_three():  # the seqfuse step's GEMMs with nothing around them (fresh outputs, as the module)
        y = ops.gemm(xd, W, transb=True)
        ops.gemm(dy, W)
        ops.gemm(dy, xd, transa=True)
        return y
    q0 = gemm_module.heuristic_queries()
    ms_t, ms_s, ms_raw = timer.ms(step_t), timer.ms(step_s), timer.ms(raw_three)
    ms_t2 = timer.ms(step_t)
    queries = gemm_module.heuristic_queries() - q0
    print("\nB. steps, ms")
    print(f"  torch nn.Linear step {ms_t:.3f} (again {ms_t2:.3f}); seqfuse Linear step {ms_s:.3f}; "
          f"seqfuse's three ops.gemm back to back, no autograd {ms_raw:.3f}")
    print(f"  -> seqfuse step - its three GEMMs = {ms_s - ms_raw:+.3f} ms (module, autograd, update); "
          f"its three GEMMs - torch's = {sum_s - sum_t:+.3f} ms (GEMM choice)")

    # C. host time per step ----------------------------------------------------
    h_t, h_s = host_us_per_step(step_t, cuda), host_us_per_step(step_s, cuda)
    print("\nC. host time to enqueue one step (GPU held busy), us")
    print(f"  torch {h_t:.0f} us (device {ms_t * 1e3:.0f} us); seqfuse {h_s:.0f} us (device {ms_s * 1e3:.0f} us)"
          f" -> seqfuse step {'HOST-BOUND' if h_s >= 0.9 * ms_s * 1e3 else 'device-bound'}")

    # D. kernels per step ------------------------------------------------------
    print("\nD. kernels per step (torch.profiler, mean of 5 steps)")
    print_kernels("seqfuse Linear step", kernel_table(step_s, cuda))
    print_kernels("torch nn.Linear step", kernel_table(step_t, cuda))
    print_kernels("seqfuse three ops.gemm", kernel_table(raw_three, cuda))

    # E. plan cache ------------------------------------------------------------
    print(f"\nE. cuBLASLt heuristic queries during the timed steps: {queries} (expected 0); "
          f"plans cached: {gemm_module.plan_cache_size()}")


if __name__ == "__main__":
    main()
