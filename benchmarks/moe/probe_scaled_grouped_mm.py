"""What torch's grouped GEMMs do on this GPU, measured once to choose the
device-split FP8 route (s21, H200, torch 2.11): torch._grouped_mm (bf16)
against torch._scaled_grouped_mm with row-wise scales at Mixtral-small's
expert shapes (32,768 routed rows, 8 experts; fc1 1,024 -> 7,168, fc2
3,584 -> 1,024; balanced and skewed counts), forward (fast accumulation on
and off), input gradient and the 2d x 2d weight-gradient form, their errors
against the dequantized operands and against bf16, and the small unaligned
case (groups not multiples of 16 rows: the FP8 weight-gradient form
stops with a device-side assertion, which ends the process's CUDA use; run
it last).  Pure torch, no seqfuse: python3 benchmarks/moe/probe_scaled_grouped_mm.py
writes $OUT/probe.json (or ./probe.json) with its run record (commit, command, versions).  CUDA events, median of 20 calls
after 3 warm-up calls on the same operands (harness.cuda_time_ms)."""
import json
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: harness
from harness import cuda_time_ms  # noqa: E402

torch.manual_seed(0)
dev = "cuda"
E4 = torch.float8_e4m3fn
FMAX = 448.0
out = {}

def rowcast(x):
    amax = x.float().abs().amax(1).clamp_min(1e-12)
    s = FMAX / amax
    q = (x.float() * s[:, None]).to(E4)
    return q, (1.0 / s).contiguous()

def timeit(fn):
    # harness.cuda_time_ms: median of 20 event-timed calls after 3 warm-up calls, caches warm (the s21 run's
    # JSON was the mean of 20 back-to-back calls, timed by one pair of events)
    return cuda_time_ms(fn, warmup=3, repeats=20, flush=False)

def counts_for(M, G, kind):
    if kind == "balanced":
        c = [M // G] * G; c[-1] += M - sum(c)
    else:
        w = torch.tensor([0.4, 0.2, 0.1, 0.1, 0.1, 0.05, 0.05, 0.0])[:G]
        c = (w / w.sum() * M).long().tolist(); c[0] += M - sum(c)
        c[1] += 3; c[2] -= 3  # not multiples of 16
    return c

def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()

M, G = 32768, 8
for name, K, N in (("fc1", 1024, 7168), ("fc2", 3584, 1024)):
    for kind in ("balanced", "skewed"):
        key = f"{name}_{kind}"
        r = {}
        try:
            c = counts_for(M, G, kind)
            offs = torch.tensor(c, device=dev).cumsum(0).to(torch.int32)
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            w = torch.randn(G, N, K, device=dev, dtype=torch.bfloat16) * 0.02
            dy = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
            # bf16 references
            y16 = torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
            r["bf16_forward_ms"] = timeit(lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offs))
            r["bf16_dgrad_ms"] = timeit(lambda: torch._grouped_mm(dy, w, offs=offs))
            r["bf16_wgrad_ms"] = timeit(lambda: torch._grouped_mm(dy.t(), x, offs=offs))
            # fp8 forward
            xq, sx = rowcast(x)
            wq2, sw = rowcast(w.reshape(G * N, K)); wq = wq2.view(G, N, K); sw = sw.view(G, N)
            yq = torch._scaled_grouped_mm(xq, wq.transpose(1, 2), sx, sw, offs=offs, out_dtype=torch.bfloat16)
            # reference from dequantized operands
            xd = xq.float() * sx[:, None]; wd = (wq.float() * sw[:, :, None])
            ref = torch.empty(M, N, device=dev)
            s = 0
            for g in range(G):
                e = s + c[g]; ref[s:e] = xd[s:e] @ wd[g].t(); s = e
            r["fp8_forward_rel_vs_dequant"] = rel(yq, ref)
            r["fp8_forward_rel_vs_bf16"] = rel(yq, y16)
            for fa in (False, True):
                r[f"fp8_forward_ms_fast{int(fa)}"] = timeit(lambda: torch._scaled_grouped_mm(
                    xq, wq.transpose(1, 2), sx, sw, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=fa))
            # dgrad: dx = dy @ W_g ; mat_b [G, N, K] col-major from W^T stored [G, K, N]
            wT = w.transpose(1, 2).contiguous()
            wTq2, swT = rowcast(wT.reshape(G * K, N)); wTq = wTq2.view(G, K, N); swT = swT.view(G, K)
            dyq, sdy = rowcast(dy)
            dxq = torch._scaled_grouped_mm(dyq, wTq.transpose(1, 2), sdy, swT, offs=offs, out_dtype=torch.bfloat16)
            dx16 = torch._grouped_mm(dy, w, offs=offs)
            r["fp8_dgrad_rel_vs_bf16"] = rel(dxq, dx16)
            r["fp8_dgrad_ms"] = timeit(lambda: torch._scaled_grouped_mm(dyq, wTq.transpose(1, 2), sdy, swT, offs=offs,
                                                                        out_dtype=torch.bfloat16, use_fast_accum=True))
            # wgrad 2d x 2d: a = dy^T [N, M] row-major, b = x [M, K] col-major (x^T [K, M] stored)
            dw16 = torch._grouped_mm(dy.t(), x, offs=offs)
            try:
                dyT = dy.t().contiguous(); xT = x.t().contiguous()
                # per-tensor scales per group broadcast (simple): one scale for all
                sa = torch.full((G * N,), 1.0, device=dev); sb = torch.full((G * K,), 1.0, device=dev)
                aq = dyT.to(E4); bq = xT.to(E4)
                dwq = torch._scaled_grouped_mm(aq, bq.t(), sa, sb, offs=offs, out_dtype=torch.bfloat16)
                r["fp8_wgrad_shape"] = list(dwq.shape)
                r["fp8_wgrad_rel_vs_bf16"] = rel(dwq, dw16)
                r["fp8_wgrad_ms"] = timeit(lambda: torch._scaled_grouped_mm(aq, bq.t(), sa, sb, offs=offs,
                                                                            out_dtype=torch.bfloat16, use_fast_accum=True))
            except Exception as err:
                r["fp8_wgrad_error"] = repr(err)[:400]
            r["torch_rowcast_x_ms"] = timeit(lambda: rowcast(x))
            r["dense_bf16_mm_ms"] = timeit(lambda: x @ w[0].t())
            r["dense_fp8_mm_ms"] = timeit(lambda: torch._scaled_mm(xq, wq[0].t(), sx[:, None], sw[0][None, :], out_dtype=torch.bfloat16, use_fast_accum=True))
        except Exception:
            r["error"] = traceback.format_exc()[-1500:]
        out[key] = r
        print(key, json.dumps(r), flush=True)
# empty group and fewer rows
try:
    c = [0, 100, 0, 37, 500, 0, 3, 1]
    offs = torch.tensor(c, device=dev).cumsum(0).to(torch.int32)
    Mt = sum(c); K, N = 1024, 512
    x = torch.randn(Mt, K, device=dev, dtype=torch.bfloat16); w = torch.randn(G, N, K, device=dev, dtype=torch.bfloat16)
    xq, sx = rowcast(x); wq2, sw = rowcast(w.reshape(G * N, K))
    y = torch._scaled_grouped_mm(xq, wq2.view(G, N, K).transpose(1, 2), sx, sw.view(G, N), offs=offs, out_dtype=torch.bfloat16)
    ref = torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
    out["small_unaligned_rel"] = rel(y, ref)
    # wgrad unaligned offsets
    dy = torch.randn(Mt + 13, N, device=dev, dtype=torch.bfloat16)[:Mt]
    Mp = (Mt + 15) // 16 * 16
    xx = torch.zeros(Mp, K, device=dev, dtype=torch.bfloat16); xx[:Mt] = x
    dd = torch.zeros(Mp, N, device=dev, dtype=torch.bfloat16); dd[:Mt] = dy
    dw16 = torch._grouped_mm(dd.t(), xx, offs=offs)
    aq = dd.t().contiguous().to(E4); bq = xx.t().contiguous().to(E4)
    dwq = torch._scaled_grouped_mm(aq, bq.t(), torch.ones(G * N, device=dev), torch.ones(G * K, device=dev), offs=offs, out_dtype=torch.bfloat16)
    out["wgrad_unaligned_rel"] = rel(dwq, dw16)
    out["wgrad_unaligned_empty_max"] = [dwq[g].abs().max().item() for g in (0, 2, 5)]
except Exception:
    out["small_error"] = traceback.format_exc()[-1500:]
print(json.dumps({k: v for k, v in out.items() if not k.startswith("fc")}), flush=True)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from peers.meta import run_metadata  # noqa: E402  (commit, command and versions, as every result JSON)

out["run"] = run_metadata()
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "probe.json"), "w"), indent=1)
