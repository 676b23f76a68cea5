"""Grouped GEMM throughput at Mixtral-small shapes: seqfuse.ops.moe.grouped_gemm
(one cuBLASLt call per expert from host m_splits) against torch's grouped
matmul (torch._grouped_mm, one kernel for all experts) and a loop of
torch.matmul over the experts, same process, same inputs.

Problem: 16,384 tokens x top-2 = 32,768 expert rows, hidden 1024, FFN 3584
(so fc1 is 1024 -> 7168 gate+up and fc2 3584 -> 1024), for 8, 16 and 64
experts, the rows split evenly ("balanced"), by a Zipf-like law with
some experts empty ("skewed"), or at random afresh on every call
("fresh", bf16 only: as in training, where the counts change every step,
so each call meets row counts the GEMM plans have not seen exactly: each
runs its size class's algorithm, chosen once at the class's bound; see
csrc/gemm/gemm_cuda.cu); every group a multiple of 16 rows (FP8's rule).
Rows:

  bf16        seqfuse grouped_gemm vs torch._grouped_mm vs torch.matmul loop
  fp8         seqfuse grouped_gemm, E4M3 per-tensor scales (one per expert),
              fast accumulation, bf16 out; vs torch._scaled_grouped_mm with
              row-wise scales where this torch has it (a different scaling:
              labelled), and reported as a rate against seqfuse's bf16
  fp8 block   seqfuse grouped_gemm, 1x128 activation x 128x128 weight block
              scales per expert (no torch peer on Hopper), against seqfuse's bf16

seqfuse's rows are timed once per --lanes value (the grouped GEMM's
concurrent CUDA streams, ops.moe.grouped_gemm's ``lanes``; 1 = every group
on the current stream; 0 = the default, chosen from the groups' sizes), the
peers once per shape.

Goals (issue 18): bf16 >= 1.0x torch._grouped_mm; FP8 >= 1.6x seqfuse's bf16
(at the same lanes).  Prints one line per row and the JSON document; writes
benchmarks/results/moe_grouped_gemm.json.  About 30-60 s on an H200 with
one lanes value.

    python3 benchmarks/moe/bench_grouped_gemm.py [--lanes 0,1,4] [--experts 8,16,64]
"""
import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # benchmarks/: harness
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "python"))

from harness import Table, cuda_time_ms  # noqa: E402

from seqfuse.ops import moe, quant  # noqa: E402

E4M3 = torch.float8_e4m3fn
TOKENS, TOPK, HIDDEN, FFN = 16384, 2, 1024, 3584


def splits_for(rows, experts, kind):
    """Row counts (multiples of 16) adding up to rows."""
    units = rows // 16
    if kind == "balanced":
        base = [units // experts] * experts
        for i in range(units - sum(base)):
            base[i] += 1
    else:  # Zipf-like with exponent 1.2, the last eighth of the experts empty
        live = experts - experts // 8
        w = [1.0 / (i + 1) ** 1.2 for i in range(live)]
        base = [int(units * x / sum(w)) for x in w] + [0] * (experts - live)
        base[0] += units - sum(base)
    return [16 * u for u in base]


def fresh_splits(rows, experts, count, gen):
    """`count` random split vectors (multiples of 16, all distinct draws)."""
    units = rows // 16
    out = []
    for _ in range(count):
        draw = torch.multinomial(torch.ones(experts), units, replacement=True, generator=gen)
        out.append([16 * int(c) for c in torch.bincount(draw, minlength=experts)])
    return out


def per_variant(variants, call):
    """{(kernel, lanes): median ms of call(kernel=..., lanes=...)} for each
    variant (lanes 0: None, the default, which the C entry sizes from the
    groups)."""
    return {v: cuda_time_ms(lambda: call(kernel=v[0], lanes=v[1] or None)) for v in variants}


def tflops(splits, n, k, ms):
    return 2.0 * sum(splits) * n * k / (ms * 1e-3) / 1e12


def torch_grouped(x, w_t, offs):
    """torch._grouped_mm(x [M, K], w^T [G, K, N], offs), or None with the reason."""
    fn = getattr(torch, "_grouped_mm", None)
    if fn is None:
        return None, "torch has no _grouped_mm"
    try:
        fn(x, w_t, offs=offs, out_dtype=torch.bfloat16)
        return (lambda: fn(x, w_t, offs=offs, out_dtype=torch.bfloat16)), "torch._grouped_mm"
    except Exception as e:  # noqa: BLE001 - report why the peer is missing
        return None, f"torch._grouped_mm failed: {type(e).__name__}: {str(e)[:160]}"


def torch_scaled_grouped(xq, xs_row, wq_t, ws_row, offs):
    fn = getattr(torch, "_scaled_grouped_mm", None)
    if fn is None:
        return None, "torch has no _scaled_grouped_mm"
    try:
        call = lambda: fn(xq, wq_t, xs_row, ws_row, offs=offs, out_dtype=torch.bfloat16,  # noqa: E731
                          use_fast_accum=True)
        call()
        return call, "torch._scaled_grouped_mm (row-wise scales)"
    except Exception as e:  # noqa: BLE001
        return None, f"torch._scaled_grouped_mm failed: {type(e).__name__}: {str(e)[:160]}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lanes", default="0", help="comma-separated lanes values to time seqfuse at "
                    "(0: the default, chosen by the C entry from the groups' sizes)")
    ap.add_argument("--kernels", default="auto", help="comma-separated ops.moe.grouped_gemm kernels to time "
                    "seqfuse with (auto, cublaslt, sm90); --lanes applies to cublaslt")
    ap.add_argument("--experts", default="8,16,64", help="comma-separated expert counts")
    ap.add_argument("--device-ends", action="store_true",
                    help="also time ops.moe.grouped_gemm_device(kernel='sm90') (the offsets read on the GPU) "
                         "against torch._grouped_mm on the same offsets, bf16 (kernel 'sm90 device ends')")
    args = ap.parse_args()
    lanes_list = [int(v) for v in args.lanes.split(",")]
    variants = [(kn, ln) for kn in args.kernels.split(",") for ln in (lanes_list if kn == "cublaslt" else [0])]
    torch.manual_seed(0)
    table = Table("moe_grouped_gemm", ["experts", "split", "gemm", "precision", "kernel", "lanes", "seqfuse_tflops",
                                       "peer_tflops", "vs_peer", "loop_tflops", "vs_loop",
                                       "vs_seqfuse_bf16", "peer"])
    rows = TOKENS * TOPK
    notes = set()
    for experts in [int(v) for v in args.experts.split(",")]:
        for kind in ("balanced", "skewed"):
            splits = splits_for(rows, experts, kind)
            offs = torch.tensor(splits, device="cuda").cumsum(0).to(torch.int32)
            for gemm, n, k in (("fc1", 2 * FFN, HIDDEN), ("fc2", HIDDEN, FFN)):
                x = torch.randn(rows, k, device="cuda").bfloat16()
                w = (torch.randn(experts, n, k, device="cuda") * 0.02).bfloat16()
                ws = list(w.unbind(0))
                out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
                s_ms = per_variant(variants, lambda **kw: moe.grouped_gemm(x, ws, splits, transb=True, out=out, **kw))
                peer, name = torch_grouped(x, w.transpose(-2, -1), offs)
                notes.add(name) if peer is None else None
                p_ms = cuda_time_ms(peer) if peer else float("nan")
                bounds = []
                o = 0
                for m in splits:
                    bounds.append((o, o + m))
                    o += m

                def loop():
                    for g, (lo, hi) in enumerate(bounds):
                        if hi > lo:
                            torch.matmul(x[lo:hi], ws[g].t(), out=out[lo:hi])
                l_ms = cuda_time_ms(loop)
                bf = {v: tflops(splits, n, k, t) for v, t in s_ms.items()}
                for v, t in s_ms.items():
                    table.add(experts=experts, split=kind, gemm=gemm, precision="bf16", kernel=v[0], lanes=v[1],
                              seqfuse_tflops=bf[v], peer_tflops=tflops(splits, n, k, p_ms), vs_peer=p_ms / t,
                              loop_tflops=tflops(splits, n, k, l_ms), vs_loop=l_ms / t,
                              vs_seqfuse_bf16=1.0, peer=name)

                if args.device_ends:
                    try:
                        d_ms = cuda_time_ms(lambda: moe.grouped_gemm_device(x, w, offs, transb=True, kernel="sm90"))
                    except (NotImplementedError, ValueError) as e:  # (a GPU the kernel does not run on: said once)
                        notes.add(f"sm90 device ends: {e}")
                    else:
                        table.add(experts=experts, split=kind, gemm=gemm, precision="bf16", kernel="sm90 device ends",
                                  lanes=0, seqfuse_tflops=tflops(splits, n, k, d_ms),
                                  peer_tflops=tflops(splits, n, k, p_ms), vs_peer=p_ms / d_ms,
                                  loop_tflops=tflops(splits, n, k, l_ms), vs_loop=l_ms / d_ms,
                                  vs_seqfuse_bf16=float("nan"), peer=name)

                # FP8: per-expert per-tensor scales (the same bytes for the peer)
                amax_x = x.float().abs().amax().clamp(min=1e-12)
                xq = (x.float() * (448.0 / amax_x)).to(E4M3)
                xs = (amax_x / 448.0).reshape(1).float()
                amax_w = w.float().abs().amax(dim=(1, 2)).clamp(min=1e-12)
                wq = (w.float() * (448.0 / amax_w)[:, None, None]).to(E4M3)
                wsc = (amax_w / 448.0).float().contiguous()
                wql = list(wq.unbind(0))
                s8 = per_variant(variants, lambda **kw: moe.grouped_gemm(xq, wql, splits, transb=True, a_scale_inv=xs,
                                                                         b_scale_inv=wsc, out=out, fast_accum=True,
                                                                         **kw))
                peer8, name8 = torch_scaled_grouped(xq, xs.expand(rows).contiguous(), wq.transpose(-2, -1),
                                                    wsc[:, None].expand(experts, n).contiguous(), offs)
                notes.add(name8) if peer8 is None else None
                p8 = cuda_time_ms(peer8) if peer8 else float("nan")
                for v, t in s8.items():
                    f8 = tflops(splits, n, k, t)
                    table.add(experts=experts, split=kind, gemm=gemm, precision="fp8 tensor", kernel=v[0], lanes=v[1],
                              seqfuse_tflops=f8, peer_tflops=tflops(splits, n, k, p8), vs_peer=p8 / t,
                              loop_tflops=float("nan"), vs_loop=float("nan"), vs_seqfuse_bf16=f8 / bf[v],
                              peer=name8)
                # FP8 block scales, per expert (the grouped GEMM takes per-group scale lists)
                bounds_nz = [(g, lo, hi) for g, (lo, hi) in enumerate(bounds)]
                xb, xbs, wb, wbs = [], [], [], []
                for g, lo, hi in bounds_nz:
                    if hi > lo:
                        d, si = quant.quantize_block_fp8(x[lo:hi], 1)
                    else:
                        d, si = torch.empty(0, k, dtype=E4M3, device="cuda"), torch.ones(1, device="cuda")
                    xb.append(d)
                    xbs.append(si)
                    d, si = quant.quantize_block_fp8(w[g], 128)
                    wb.append(d)
                    wbs.append(si)
                # (block scales: cuBLASLt's; kernel="sm90" would refuse them)
                sb_ms = per_variant([v for v in variants if v[0] != "sm90"], lambda **kw: moe.grouped_gemm(
                    xb, wb, splits, transb=True, a_scale_inv=xbs, b_scale_inv=wbs, a_scaling="block_1x128",
                    b_scaling="block_128x128", out=out, **kw))
                for v, sb in sb_ms.items():
                    fb = tflops(splits, n, k, sb)
                    table.add(experts=experts, split=kind, gemm=gemm, precision="fp8 block", kernel=v[0], lanes=v[1],
                              seqfuse_tflops=fb, peer_tflops=float("nan"), vs_peer=float("nan"),
                              loop_tflops=float("nan"), vs_loop=float("nan"), vs_seqfuse_bf16=fb / bf[v],
                              peer="none on Hopper")
                del x, w, ws, out, xq, wq, wql, xb, wb
                torch.cuda.empty_cache()
        # fresh row counts on every call (25 calls per timing: 5 warm-up + 20 timed)
        gen = torch.Generator().manual_seed(experts)
        draws = fresh_splits(rows, experts, 25, gen)
        offs_list = [torch.tensor(d, device="cuda").cumsum(0).to(torch.int32) for d in draws]
        for gemm, n, k in (("fc1", 2 * FFN, HIDDEN), ("fc2", HIDDEN, FFN)):
            x = torch.randn(rows, k, device="cuda").bfloat16()
            w = (torch.randn(experts, n, k, device="cuda") * 0.02).bfloat16()
            ws = list(w.unbind(0))
            wt = w.transpose(-2, -1)
            out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
            state = {"i": 0}

            def next_draw():
                state["i"] = (state["i"] + 1) % len(draws)
                return state["i"]

            s_ms = per_variant(variants, lambda **kw: moe.grouped_gemm(x, ws, draws[next_draw()], transb=True,
                                                                       out=out, **kw))
            peer, name = torch_grouped(x, wt, offs_list[0])
            p_ms = float("nan")
            if peer is not None:
                p_ms = cuda_time_ms(lambda: torch._grouped_mm(x, wt, offs=offs_list[next_draw()],
                                                              out_dtype=torch.bfloat16))
            for v, t in s_ms.items():
                table.add(experts=experts, split="fresh", gemm=gemm, precision="bf16", kernel=v[0], lanes=v[1],
                          seqfuse_tflops=tflops(draws[0], n, k, t), peer_tflops=tflops(draws[0], n, k, p_ms),
                          vs_peer=p_ms / t, loop_tflops=float("nan"), vs_loop=float("nan"),
                          vs_seqfuse_bf16=float("nan"), peer=name)
            del x, w, ws, wt, out
            torch.cuda.empty_cache()
    goals = {}
    for kn, ln in variants:
        mine = [r for r in table.rows if r["lanes"] == ln and r["kernel"] == kn]
        bf_rows = [r for r in mine if r["precision"] == "bf16" and r["split"] != "fresh"]
        goals[f"kernel={kn},lanes={ln}"] = {
            "bf16_min_vs_torch_grouped_mm": min(r["vs_peer"] for r in bf_rows),
            "bf16_min_vs_loop": min(r["vs_loop"] for r in bf_rows),
            "bf16_fresh_splits_min_vs_torch_grouped_mm": min(r["vs_peer"] for r in mine
                                                             if r["split"] == "fresh"),
            "fp8_min_vs_seqfuse_bf16": min(r["vs_seqfuse_bf16"] for r in mine
                                           if r["precision"] == "fp8 tensor"),
            "fp8_block_min_vs_seqfuse_bf16": min((r["vs_seqfuse_bf16"] for r in mine
                                                  if r["precision"] == "fp8 block"), default=float("nan")),
        }
    dev = [r for r in table.rows if r["kernel"] == "sm90 device ends"]
    if dev:
        goals["kernel=sm90 device ends"] = {"bf16_min_vs_torch_grouped_mm": min(r["vs_peer"] for r in dev)}
    goals.update({
        "goal_bf16_vs_torch": 1.0, "goal_fp8_vs_bf16": 1.6,
        "kernels": "cublaslt: one cuBLASLt call per non-empty expert from host m_splits, on `lanes` CUDA "
                   "streams (lanes=0: the C entry's own choice); sm90: seqfuse's persistent Hopper kernel, every "
                   "expert in one launch; auto: sm90 where the call fits it (fp8 block scales do not) and it pays (sf_grouped_sm90_pays: e4m3, or bf16 groups of at most two waves of the SMs in 128 x 256 tiles on average), else cublaslt",
        "peers_missing": sorted(notes),
        "command": "python3 benchmarks/moe/bench_grouped_gemm.py " + " ".join(sys.argv[1:]),
    })
    path = table.save({"goals": goals, "shape": {"tokens": TOKENS, "topk": TOPK, "hidden": HIDDEN,
                                                 "ffn": FFN}})
    with open(path) as f:
        print(json.dumps(json.load(f), indent=1))


if __name__ == "__main__":
    main()
