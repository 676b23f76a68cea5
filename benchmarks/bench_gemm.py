"""GEMM throughput: seqfuse.ops.gemm (cuBLASLt) against torch in the same
process on the same inputs, at 4096^3, 8192^3, 16384^3 and at transformer
shapes (16384 tokens x hidden 1280 / 2048 / 4096 / 5120: the square
projection, the 4x MLP up-projection and the down-projection).

Per shape:
  bf16         seqfuse gemm(x, w, transb=True) vs torch.matmul(x, w.t())
  fp8          E4M3 x E4M3 per-tensor scales, fast accumulation, bf16 out,
               vs torch._scaled_mm on the same FP8 bytes and scales
  fp8 block    1x128 (x) x 128x128 (w) block scales vs torch's block-scaled
               scaled_mm where the installed torch has it ("n/a" otherwise)
Goals (issue 4): >= 0.98x torch at the same precision; FP8 >= 1.7x bf16 at
8192^3; block-scaled FP8 >= 1.3x bf16.  Writes results/gemm.json and
results/gemm.png.
"""
import importlib
import os

import torch

import seqfuse
from harness import RESULTS, Table, cuda_time_ms, plot_bars

E4M3 = torch.float8_e4m3fn


def shapes():
    out = [("cube 4096", 4096, 4096, 4096), ("cube 8192", 8192, 8192, 8192),
           ("cube 16384", 16384, 16384, 16384)]
    t = 16384
    for h in (1280, 2048, 4096, 5120):
        out += [(f"h{h} proj", t, h, h), (f"h{h} fc1", t, 4 * h, h), (f"h{h} fc2", t, h, 4 * h)]
    return out


def per_tensor_fp8(x):
    amax = x.abs().max().float()
    scale = 448.0 / amax
    return (x.float() * scale).to(E4M3), (1.0 / scale).reshape(1)


def block_fp8(x, rows):
    """x [R, K] -> (fp8, scale_inv) in seqfuse's layouts (1x128: [K/128, R];
    128x128: [R/128, roundup(K/128, 4)])."""
    r, k = x.shape
    kb = k // 128
    if rows == 1:
        blocks = x.float().view(r, kb, 128)
        s = 448.0 / blocks.abs().amax(-1).clamp(min=1e-12)
        data = (blocks * s[..., None]).to(E4M3).view(r, k)
        return data, (1.0 / s).t().contiguous()
    blocks = x.float().view(r // 128, 128, kb, 128)
    s = 448.0 / blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    data = (blocks * s[:, None, :, None]).to(E4M3).view(r, k)
    kb4 = (kb + 3) // 4 * 4
    si = torch.ones(r // 128, kb4, device=x.device)
    si[:, :kb] = 1.0 / s
    return data, si


def torch_block_mm(xq, xs, wq, ws, kb):
    """torch's block-scaled FP8 GEMM, or None where this torch has none."""
    sa = xs.t()                          # (M, K/128), outer-dim-major
    sb = ws[:, :kb].contiguous().t()     # (K/128, N/128)
    F = torch.nn.functional
    if hasattr(F, "scaled_mm") and hasattr(F, "ScalingType"):
        ST = F.ScalingType
        try:
            fn = lambda: F.scaled_mm(xq, wq.t(), sa, ST.BlockWise1x128, sb, ST.BlockWise128x128,  # noqa: E731
                                     output_dtype=torch.bfloat16)
            fn()
            return fn, "F.scaled_mm"
        except Exception as e:  # noqa: BLE001 - report why, then try the next spelling
            print(f"  F.scaled_mm block: {type(e).__name__}: {str(e)[:120]}")
    try:
        fn = lambda: torch._scaled_mm(xq, wq.t(), sa, sb, out_dtype=torch.bfloat16)  # noqa: E731
        fn()
        return fn, "torch._scaled_mm"
    except Exception as e:  # noqa: BLE001
        print(f"  torch._scaled_mm block: {type(e).__name__}: {str(e)[:120]}")
    return None, "n/a"


def tflops(m, n, k, ms):
    return 2.0 * m * n * k / (ms * 1e-3) / 1e12


def main():
    torch.manual_seed(0)
    table = Table("gemm", ["shape", "m", "n", "k", "precision", "seqfuse_tflops", "torch_tflops",
                           "vs_torch", "vs_seqfuse_bf16", "peer"])
    gemm = seqfuse.ops.gemm
    labels, bf_s, f8_s, blk_s, bf_t = [], [], [], [], []
    for name, m, n, k in shapes():
        x = torch.randn(m, k, device="cuda").bfloat16()
        w = (torch.randn(n, k, device="cuda") * 0.02).bfloat16()
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)

        s_ms = cuda_time_ms(lambda: gemm(x, w, transb=True, out=out))
        t_ms = cuda_time_ms(lambda: torch.matmul(x, w.t(), out=out))
        bf = tflops(m, n, k, s_ms)
        table.add(shape=name, m=m, n=n, k=k, precision="bf16", seqfuse_tflops=bf,
                  torch_tflops=tflops(m, n, k, t_ms), vs_torch=t_ms / s_ms, vs_seqfuse_bf16=1.0,
                  peer="torch.matmul")

        xq, xs = per_tensor_fp8(x)
        wq, ws = per_tensor_fp8(w)
        s_ms = cuda_time_ms(lambda: gemm(xq, wq, transb=True, a_scale_inv=xs, b_scale_inv=ws, out=out,
                                         fast_accum=True))
        t_ms = cuda_time_ms(lambda: torch._scaled_mm(xq, wq.t(), xs, ws, out_dtype=torch.bfloat16,
                                                     use_fast_accum=True))
        f8 = tflops(m, n, k, s_ms)
        table.add(shape=name, m=m, n=n, k=k, precision="fp8 tensor", seqfuse_tflops=f8,
                  torch_tflops=tflops(m, n, k, t_ms), vs_torch=t_ms / s_ms, vs_seqfuse_bf16=f8 / bf,
                  peer="torch._scaled_mm")
        del xq, wq

        xb, xbs = block_fp8(x, 1)
        wb, wbs = block_fp8(w, 128)
        s_ms = cuda_time_ms(lambda: gemm(xb, wb, transb=True, a_scale_inv=xbs, b_scale_inv=wbs,
                                         a_scaling="block_1x128", b_scaling="block_128x128", out=out))
        fn, peer = torch_block_mm(xb, xbs, wb, wbs, k // 128)
        t_ms = cuda_time_ms(fn) if fn else float("nan")
        blk = tflops(m, n, k, s_ms)
        table.add(shape=name, m=m, n=n, k=k, precision="fp8 block", seqfuse_tflops=blk,
                  torch_tflops=tflops(m, n, k, t_ms) if fn else float("nan"),
                  vs_torch=t_ms / s_ms if fn else float("nan"), vs_seqfuse_bf16=blk / bf, peer=peer)
        labels.append(name)
        bf_s.append(bf)
        f8_s.append(f8)
        blk_s.append(blk)
        bf_t.append(table.rows[-3]["torch_tflops"])
        del x, w, out, xb, wb
        torch.cuda.empty_cache()

    rows = {(r["shape"], r["precision"]): r for r in table.rows}
    goals = {
        "bf16_min_vs_torch": min(r["vs_torch"] for r in table.rows if r["precision"] == "bf16"),
        "fp8_min_vs_torch": min(r["vs_torch"] for r in table.rows if r["precision"] == "fp8 tensor"),
        "fp8_vs_bf16_8192": rows[("cube 8192", "fp8 tensor")]["vs_seqfuse_bf16"],
        "block_vs_bf16_8192": rows[("cube 8192", "fp8 block")]["vs_seqfuse_bf16"],
        "goal_bf16_vs_torch": 0.98, "goal_fp8_vs_bf16": 1.7, "goal_block_vs_bf16": 1.3,
    }
    print("\n".join(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}" for k, v in goals.items()))
    gemm_mod = importlib.import_module("seqfuse.ops.gemm")
    table.save({"goals": goals, "plan_cache_size": gemm_mod.plan_cache_size(),
                "heuristic_queries": gemm_mod.heuristic_queries()})
    plot_bars(os.path.join(RESULTS, "gemm.png"), "GEMM TFLOP/s on H200 (bf16 out)", labels,
              {"torch bf16": bf_t, "seqfuse bf16": bf_s, "seqfuse fp8": f8_s,
               "seqfuse fp8 block": blk_s}, "TFLOP/s")


if __name__ == "__main__":
    if not (seqfuse.cuda_available() and torch.cuda.is_available()):
        raise SystemExit("bench_gemm needs a CUDA GPU and a CUDA build of seqfuse")
    main()
