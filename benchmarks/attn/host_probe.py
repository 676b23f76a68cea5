"""Host work of one attention call on the cuDNN route: seqfuse.ops.attention
in auto against torch SDPA restricted to cuDNN (``sdpa_kernel``, the
bench_routes ceiling) and SDPA called bare, on the same tensors.

Why: a call timed alone (bench_routes: L2 flushed, CUDA events) counts the
host's work before the first kernel, so a route's per-call Python shows up
as a fixed gap at short sequences.  This separates it from the kernels:

- host: microseconds per call issued (no synchronization inside the loop;
  the shapes are small enough that the host, not the GPU, sets the pace),
  forward under no_grad and forward+backward;
- kernels: the CUDA kernels each way launches for one call at 4 x 1,024 x
  16 x 64 (torch.profiler), to show that the routes run the same kernels;
- profile: cProfile of 2,000 seqfuse forward calls, by own time.

Run on the GPU machine after the build:
    python3 benchmarks/attn/host_probe.py
(about 20 s; prints only)."""
import cProfile
import pstats
import time

import torch
from torch.nn.attention import SDPBackend
from torch.profiler import ProfilerActivity, profile

import seqfuse
from bench_routes import sdpa_bshd


def tensors(b, s, h, d, grad=False):
    return [torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).requires_grad_(grad) for _ in range(3)]


def ours(q, k, v):
    return seqfuse.ops.attention(q, k, v)


ceiling = sdpa_bshd(backends=[SDPBackend.CUDNN_ATTENTION])  # bench_routes' ceiling
ceiling.__name__ = "ceiling"
bare = sdpa_bshd()  # torch's choice, no context, as a user calls it
bare.__name__ = "bare"


def one_call(fn, args, grad):
    if grad:
        out = fn(*args)
        torch.autograd.grad(out, args, out)
    else:
        with torch.no_grad():
            fn(*args)


def host_us(fn, args, grad, n=300):
    """(us per call issued, us per call with the final synchronization)."""
    for _ in range(20):
        one_call(fn, args, grad)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        one_call(fn, args, grad)
    issued = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return issued, (time.perf_counter() - t) / n * 1e6


def main():
    print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version(), "seqfuse route:",
          seqfuse.ops.attention_backend(*tensors(1, 128, 16, 64)))
    for shape in ((1, 128, 16, 64), (2, 512, 32, 64)):
        for grad in (False, True):
            args = tensors(*shape, grad=grad)
            for fn in (ours, ceiling, bare, ours, ceiling, bare):
                issued, total = host_us(fn, args, grad)
                print(f"host {shape} {'forward+backward' if grad else 'forward'} {fn.__name__:7s} issue {issued:7.1f} us/call, "
                      f"total {total:7.1f}")
    args = tensors(4, 1024, 16, 64)
    for fn in (ours, ceiling):
        for grad in (False, True):
            a = [x.detach().requires_grad_(grad) for x in args]
            for _ in range(3):
                one_call(fn, a, grad)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                one_call(fn, a, grad)
                torch.cuda.synchronize()
            print(f"==== kernels of {fn.__name__} {'forward+backward' if grad else 'forward'}")
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    print(f"  kernel {e.name[:90]} {e.device_time:.1f} us")
    args = tensors(1, 128, 16, 64)
    with torch.no_grad():
        for _ in range(100):
            ours(*args)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(2000):
            ours(*args)
        prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
