"""Activations (forward and forward+backward) and bias + dropout + residual on
the GPU: seqfuse against torch eager and torch.compile of the same
computation, same process, same bf16 inputs.

Bytes counted: what each pass must move at least (an element-wise forward
reads x and writes y; a gated one reads 2n and writes n per row; the backward
also reads dy and writes dx).  The ceiling is a device-to-device copy measured
here.  Goals (issue 5): >= 75 % of the copy bandwidth at large shapes,
>= 1.0x torch.compile.
"""
import os

import torch
import torch.nn.functional as F

import seqfuse
from seqfuse.modules.activation import activation, bias_dropout_add

from harness import RESULTS, Table, cuda_time_ms, plot_bars

ROWS, COLS = 16384, 16384


def torch_act(name):
    if name == "gelu":
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu_erf":
        return F.gelu
    if name == "silu":
        return F.silu
    if name == "relu":
        return F.relu
    base = {"swiglu": F.silu, "geglu": lambda t: F.gelu(t, approximate="tanh")}[name]

    def gated(x):
        a, b = x.chunk(2, dim=-1)
        return base(a) * b
    return gated


def torch_bda(x, b, r, p=0.1):
    return r + F.dropout(x + b, p, training=True)


def copy_tbs(x):
    y = torch.empty_like(x)
    ms = cuda_time_ms(lambda: y.copy_(x))
    return 2 * x.numel() * x.element_size() / ms / 1e9


def main():
    if not (torch.cuda.is_available() and seqfuse.cuda_available()):
        print("bench_act: needs a CUDA GPU and a CUDA build of seqfuse")
        return
    x = torch.randn(ROWS, COLS, device="cuda", dtype=torch.bfloat16)
    xg = x.clone().requires_grad_()
    ceiling = copy_tbs(x)
    nb = x.numel() * 2
    table = Table("act", ["op", "shape", "pass", "impl", "ms", "TB_s", "pct_copy", "x_vs_eager", "x_vs_compile"])
    labels, series = [], {"vs eager": [], "vs compile": [], "fraction of copy": []}
    for name in ("gelu", "gelu_erf", "silu", "relu", "swiglu", "geglu"):
        gated = name in ("swiglu", "geglu")
        peer = torch_act(name)
        impls = {"seqfuse": lambda t, n=name: activation(t, n), "eager": peer, "compile": torch.compile(peer, dynamic=False)}
        dy = torch.randn(ROWS, COLS // 2 if gated else COLS, device="cuda", dtype=torch.bfloat16)
        for pss, traffic in (("forward", (1.5 if gated else 2.0) * nb),
                             ("forward+backward", (4.0 if gated else 5.0) * nb),
                             ("forward+backward x4 queued", (4.0 if gated else 5.0) * nb)):
            times = {}
            for impl, fn in impls.items():
                if pss == "forward":
                    with torch.no_grad():
                        times[impl] = cuda_time_ms(lambda: fn(x))
                elif pss == "forward+backward":
                    times[impl] = cuda_time_ms(lambda: torch.autograd.grad(fn(xg), (xg,), dy))
                else:  # per pass, host running ahead as in a training step
                    times[impl] = cuda_time_ms(
                        lambda: [torch.autograd.grad(fn(xg), (xg,), dy) for _ in range(4)]) / 4
            for impl, ms in times.items():
                tbs = traffic / ms / 1e9
                table.add(op=name, shape=f"{ROWS}x{COLS}", **{"pass": pss}, impl=impl, ms=ms, TB_s=tbs,
                          pct_copy=100 * tbs / ceiling, x_vs_eager=times["eager"] / ms,
                          x_vs_compile=times["compile"] / ms)
            labels.append(f"{name} {pss}")
            series["vs eager"].append(times["eager"] / times["seqfuse"])
            series["vs compile"].append(times["compile"] / times["seqfuse"])
            series["fraction of copy"].append(traffic / times["seqfuse"] / 1e9 / ceiling)

    rows, cols = 16384, 4096
    xs = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(cols, device="cuda", dtype=torch.bfloat16)
    r = torch.randn_like(xs)
    xs_g, b_g, r_g = (t.clone().requires_grad_() for t in (xs, b, r))
    dy = torch.randn_like(xs)
    nb = xs.numel() * 2
    compiled = torch.compile(torch_bda, dynamic=False)
    impls = {"seqfuse": lambda a, bb, rr: bias_dropout_add(a, bb, rr, 0.1), "eager": torch_bda,
             "compile": compiled}
    for pss, traffic in (("forward", 3 * nb), ("forward+backward", 5 * nb)):
        times = {}
        for impl, fn in impls.items():
            if pss == "forward":
                with torch.no_grad():
                    times[impl] = cuda_time_ms(lambda: fn(xs, b, r))
            else:
                times[impl] = cuda_time_ms(lambda: torch.autograd.grad(fn(xs_g, b_g, r_g), (xs_g, b_g, r_g), dy))
        for impl, ms in times.items():
            tbs = traffic / ms / 1e9
            table.add(op="bias_dropout_add p=0.1", shape=f"{rows}x{cols}", **{"pass": pss}, impl=impl, ms=ms,
                      TB_s=tbs, pct_copy=100 * tbs / ceiling, x_vs_eager=times["eager"] / ms,
                      x_vs_compile=times["compile"] / ms)
        labels.append(f"bias_dropout_add {pss}")
        series["vs eager"].append(times["eager"] / times["seqfuse"])
        series["vs compile"].append(times["compile"] / times["seqfuse"])
        series["fraction of copy"].append(traffic / times["seqfuse"] / 1e9 / ceiling)
    table.add(op="copy", shape=f"{ROWS}x{COLS}", impl="torch copy_", TB_s=ceiling, pct_copy=100.0)
    table.save({"dtype": "bfloat16", "note": "bias_dropout_add forward+backward bytes: x, b, r read + out write; "
                "dout read + dx write (dresidual is dout itself)"})
    plot_bars(os.path.join(RESULTS, "act.png"), "seqfuse activations (bf16, H200)", labels, series,
              "x (speedup) / fraction of copy")


if __name__ == "__main__":
    main()
