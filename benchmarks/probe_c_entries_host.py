"""Host cost of each seqfuse C entry on the FP8 modules' path, one call at a
time, beside torch's cheapest launch: microseconds per call at tiny shapes
(16 x 128 activations, 128 x 128 weights), where the GPU finishes each
kernel sooner than the host issues the next, so the figure is the host's
work: the Python wrapper, the DLPack exchange, seqfuse's checks, the runtime
calls and the launch.

Why: bench_fp8_host's real-kernel rows put an FP8 layer step's host work on
the GPU machine far above its stubbed (Python-only) figure: the C entries
and launches, of which FP8 makes 35 a layer step against bf16's 18.  This
says which entry costs what there.  Each row: the best of --rounds rounds
of --iters calls, the GPU drained before and after each round (not timed).
JSON: results/c_entries_host.json.
"""
import argparse
import time

import torch

from harness import Table


def main():
    import seqfuse
    from seqfuse import _C, ops
    from seqfuse.ops import quant as qops
    from seqfuse.ops.gemm import fp8_gemm_nt

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=400)
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()
    dev = "cuda" if seqfuse.cuda_available() and torch.cuda.is_available() else "cpu"
    bf, f8 = torch.bfloat16, torch.float8_e4m3fn
    m, k, n = 16, 128, 128
    x = torch.randn(m, k, device=dev, dtype=bf)
    w = torch.randn(n, k, device=dev, dtype=bf)
    y = torch.empty(m, n, device=dev, dtype=bf)
    one = lambda: torch.ones(1, device=dev)  # noqa: E731
    scale, amax, scale_inv = one(), torch.zeros(1, device=dev), one()
    xq, xq_t = torch.empty(m, k, device=dev, dtype=f8), torch.empty(k, m, device=dev, dtype=f8)
    wq, wq_t = torch.empty(n, k, device=dev, dtype=f8), torch.empty(k, n, device=dev, dtype=f8)
    qops.cast_fp8_into(x, scale, amax, xq, xq_t, scale_inv)
    qops.cast_fp8_into(w, scale, amax, wq, wq_t, scale_inv)
    sums = torch.empty(*qops.block_sums_shape(m, k), device=dev)
    hist, sc, si = torch.zeros(16, 8, device=dev), torch.ones(8, device=dev), torch.ones(8, device=dev)
    g, b = torch.ones(k, device=dev, dtype=bf), torch.zeros(k, device=dev, dtype=bf)
    a1, a2, a3 = (torch.randn(16, device=dev) for _ in range(3))
    calls = [
        ("torch.add(a, b, out=c)", lambda: torch.add(a1, a2, out=a3)),
        ("torch.empty(16, 128)", lambda: torch.empty(m, k, dtype=bf, device=dev)),
        ("_C.probe(a, b, c): exchange only", lambda: _C.probe(a1, a2, a3)),
        ("ops.amax(x, out)", lambda: qops.amax(x, out=amax)),
        ("cast_fp8_into (delayed, row+col)", lambda: qops.cast_fp8_into(x, scale, amax, xq, xq_t, scale_inv)),
        ("cast_fp8_into (delayed, row only)", lambda: qops.cast_fp8_into(x, scale, amax, xq, None, scale_inv)),
        ("cast_fp8_into + dbias sums", lambda: qops.cast_fp8_into(x, scale, amax, xq, xq_t, scale_inv, sums)),
        ("column_sums (new output)", lambda: qops.column_sums(sums, bf)),
        ("cast_fp8_current_into (cooperative, row+col)",
         lambda: qops.cast_fp8_current_into(w, amax, scale, scale_inv, wq, wq_t)),
        ("transpose_fp8_into", lambda: qops.transpose_fp8_into(xq, xq_t)),
        ("fp8_scale_update (8 tensors, history 16)", lambda: qops.fp8_scale_update(hist, sc, si, 448.0)),
        ("fp8_gemm_nt 16x128x128 into y", lambda: fp8_gemm_nt(xq, scale_inv, None, wq, scale_inv, None, y)),
        ("ops.gemm bf16 16x128x128 into y", lambda: ops.gemm(x, w, transb=True, out=y)),
        ("torch.mm bf16 16x128x128 (out=)", lambda: torch.mm(x, w.t(), out=y)),
        ("layernorm_forward (bf16 out)", lambda: ops.layernorm_forward(x, g, b)),
    ]
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    best = {name: float("inf") for name, _ in calls}
    for name, fn in calls:
        for _ in range(20):
            fn()
    for r in range(args.rounds):
        for name, fn in calls[r % len(calls):] + calls[:r % len(calls)]:
            sync()
            t0 = time.perf_counter()
            for _ in range(args.iters):
                fn()
            best[name] = min(best[name], (time.perf_counter() - t0) / args.iters * 1e6)
            sync()
    table = Table("c_entries_host", ["call", "device", "us_per_call"])
    for name, _ in calls:
        table.add(call=name, device=dev, us_per_call=round(best[name], 2))
    table.save({"iters": args.iters, "rounds": args.rounds})


if __name__ == "__main__":
    main()
