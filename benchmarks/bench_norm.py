"""LayerNorm and RMSNorm, forward and forward+backward, on the GPU: seqfuse
against torch eager and torch.compile of the same computation, same process,
same bf16 inputs (weights in bf16 too, so every peer reads the same bytes).

Bandwidth counts the bytes each direction must move at least: forward reads x
and writes y (2 x n x 2 bytes), backward reads x and dy and writes dx
(3 x n x 2 bytes), forward+backward both (5 x n x 2 bytes); the ceiling is a
device-to-device copy of x measured here, in the same process.
Goals (issue 5): >= 75 % of the copy bandwidth at large shapes, >= 1.0x
torch.compile and >= 2x eager for forward+backward.

What is reachable against eager: torch's LayerNorm backward reads x and dy
twice (dx kernel, then a separate gamma/beta kernel), so eager moves ~7 x n x 2
bytes for forward+backward against seqfuse's 5: at equal bandwidth 1.4x, more
only where eager runs further from the copy ceiling than seqfuse does.

Passes: "forward" (no autograd), "backward" (autograd.grad over a kept graph: the
backward kernels plus autograd's own host work), "forward+backward" (one isolated pass
after an L2 flush: host overhead exposed), "forward+backward xN queued" (N passes back
to back, per pass: host overhead hidden behind the GPU, as in a training step).
"""
import os

import torch
import torch.nn.functional as F

import seqfuse
from seqfuse.modules.norm import layer_norm, rms_norm

from harness import RESULTS, Table, allow_recompiles, cuda_time_ms, plot_bars

# Llama 4096 / 8192, ESM-2 650M / 15B (1280, 5120) and 8M (320, at 65536
# tokens), an FFN-wide 16384.  (check_norm covers 640 and 2560 too; each
# shape here costs two torch.compile runs per op.)
SHAPES = [(16384, 4096), (16384, 1280), (16384, 5120), (65536, 320), (8192, 8192), (4096, 16384)]
#: The "queued" rows time this many forward+backward passes back to back (per pass):
#: a single isolated pass also measures the host's Python and autograd time,
#: which a training step overlaps with earlier GPU work.
BACK_TO_BACK = 8
EPS = 1e-5


def torch_rms(x, w, b):
    if hasattr(F, "rms_norm"):
        return F.rms_norm(x, (x.shape[-1],), w, EPS)
    return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype) * w


def torch_ln(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b, EPS)


def ours_ln(x, w, b):
    return layer_norm(x, w, b, EPS)


def ours_rms(x, w, b):
    return rms_norm(x, w, EPS)


def forward_backward(fn, x, w, b, dy):
    inputs = (x, w) if b is None else (x, w, b)

    def run():
        y = fn(x, w, b)
        torch.autograd.grad(y, inputs, dy)
    return run


def backward_only(fn, x, w, b, dy):
    """The backward alone: one forward builds the graph, each call runs
    autograd over it again (retain_graph)."""
    inputs = (x, w) if b is None else (x, w, b)
    y = fn(x, w, b)

    def run():
        torch.autograd.grad(y, inputs, dy, retain_graph=True)
    return run


def copy_tbs(x):
    y = torch.empty_like(x)
    ms = cuda_time_ms(lambda: y.copy_(x))
    return 2 * x.numel() * x.element_size() / ms / 1e9


def main():
    allow_recompiles()
    if not (torch.cuda.is_available() and seqfuse.cuda_available()):
        print("bench_norm: needs a CUDA GPU and a CUDA build of seqfuse")
        return
    table = Table("norm", ["op", "shape", "pass", "impl", "ms", "TB_s", "pct_copy", "x_vs_eager",
                           "x_vs_compile"])
    labels, series = [], {"vs eager": [], "vs compile": [], "% copy": []}
    for rows, hidden in SHAPES:
        x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        ceiling = copy_tbs(x)
        n_bytes = x.numel() * 2
        for name, ours, peer in (("layernorm", ours_ln, torch_ln), ("rmsnorm", ours_rms, torch_rms)):
            w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16).requires_grad_()
            b = torch.randn(hidden, device="cuda", dtype=torch.bfloat16).requires_grad_() \
                if name == "layernorm" else None
            xg = x.clone().requires_grad_()
            compiled = torch.compile(peer, dynamic=False)  # specialized to the shape, as in a fixed-size step
            impls = {"seqfuse": ours, "eager": peer, "compile": compiled}
            for pss, traffic in (("forward", 2 * n_bytes), ("backward", 3 * n_bytes), ("forward+backward", 5 * n_bytes),
                                 (f"forward+backward x{BACK_TO_BACK} queued", 5 * n_bytes)):
                times = {}
                for impl, fn in impls.items():
                    if pss == "forward":
                        with torch.no_grad():
                            times[impl] = cuda_time_ms(lambda: fn(x, w, b))
                    elif pss == "backward":
                        try:
                            times[impl] = cuda_time_ms(backward_only(fn, xg, w, b, dy))
                        except RuntimeError as e:  # a peer that cannot re-run its backward
                            print(f"bench_norm: {name} {impl} backward alone not timed: {e}")
                            times[impl] = float("nan")
                    elif pss == "forward+backward":
                        times[impl] = cuda_time_ms(forward_backward(fn, xg, w, b, dy))
                    else:  # per pass, with the host running ahead as in a training step
                        run = forward_backward(fn, xg, w, b, dy)
                        times[impl] = cuda_time_ms(lambda: [run() for _ in range(BACK_TO_BACK)]) / BACK_TO_BACK
                for impl, ms in times.items():
                    tbs = traffic / ms / 1e9
                    table.add(op=name, shape=f"{rows}x{hidden}", **{"pass": pss}, impl=impl, ms=ms,
                              TB_s=tbs, pct_copy=100 * tbs / ceiling,
                              x_vs_eager=times["eager"] / ms, x_vs_compile=times["compile"] / ms)
                labels.append(f"{name} {pss} {rows}x{hidden}")
                series["vs eager"].append(times["eager"] / times["seqfuse"])
                series["vs compile"].append(times["compile"] / times["seqfuse"])
                series["% copy"].append(traffic / times["seqfuse"] / 1e9 / ceiling)
        table.add(op="copy", shape=f"{rows}x{hidden}", impl="torch copy_", TB_s=ceiling, pct_copy=100.0)
    table.save({"dtype": "bfloat16", "eps": EPS})
    plot_bars(os.path.join(RESULTS, "norm.png"), "seqfuse LayerNorm/RMSNorm (bf16, H200): speedup and fraction of copy bandwidth",
              labels, series, "x (speedup) / fraction of copy")


if __name__ == "__main__":
    main()
