"""Fused attention: seqfuse's kernels against torch's
scaled_dot_product_attention (which picks cuDNN or flash) in one process on
the same inputs (ops.attention pinned to seqfuse's kernels: its default sends
padding-free bshd calls on Hopper to cuDNN, see seqfuse.ops.attn).

Part 1, padded (bshd), 16k tokens per batch: seqlens 1024, 4096, 8192, head
dims 64 (32 heads) and 128 (16 heads), causal and not, forward and
forward+backward, bf16.  TFLOP/s = 4*b*h*s^2*d (halved when causal), x3.5
with the backward; ratio = seqfuse / torch (goal >= 1.0).  On Hopper,
sm90_tflops and sm90_ratio (forward rows) time the same call with the wgmma
forward (attn_forward_sm90_cuda.cu) selected, whatever the default is, so the
sm90 and sm80 forwards and torch stand side by side.  The wgmma forward's
other schedules are timed by the check program (csrc/attn/check_attn_sm90.cu,
part (d)): the library builds only its own.  sm80backward_tflops and sm80backward_ratio (forward+backward rows) time the
same call with the sm80 (mma.sync) backward selected instead of the default
wgmma one (attn_backward_sm90_cuda.cu).

Part 2, packed (thd) proteins: ESM-2 attention, 20 heads of 64 (650M), 32
(150M), 24 (35M; the kernel runs it as a 32-wide tile) and 16 (8M), 16k
tokens of real UniProt lengths (recipes/esm2/data/subset, +2 special
tokens, cropped to 1024; a lognormal fit with median 345 and 90th percentile
872 where the data or pyarrow is missing), bidirectional.  seqfuse runs the
packed batch; torch runs the same sequences padded to the longest with a
key-padding mask (how Hugging Face's ESM runs sdpa).  Figures are useful
TFLOP/s over the real tokens only (4*h*d*sum(len^2)), so the ratio is the
end-to-end speedup of packing plus the kernel.

Part 3, attention dropout (p = 0.1, the TransformerLayer default): head dim
64 (32 heads), seqlens 1024 and 4096, not causal, forward and
forward+backward; torch runs scaled_dot_product_attention(dropout_p=0.1) on
the same inputs.  seqfuse's dropout forward is the sm80 (mma.sync) kernel on
every GPU (the wgmma forward has no dropout).  FLOPs counted as in part 1.
``python bench_attn.py --dropout`` runs part 3 alone.
"""
import itertools
import math
import os
import random
import sys

import torch
import torch.nn.functional as F

import seqfuse
from harness import RESULTS, Table, cuda_time_ms, plot_bars

TOKENS = 16384
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sdpa_flops(b, h, s, d, causal, backward):
    return 4.0 * b * h * s * s * d * (0.5 if causal else 1.0) * (3.5 if backward else 1.0)


def _hopper_time(fn, forward_kernel=None, backward_kernel=None):
    """cuda_time_ms(fn) with the forward kernel ``forward_kernel`` and / or the
    backward kernel ``backward_kernel`` (90 or 80) selected; None off Hopper.  The
    process's kernel choices (SEQFUSE_ATTN_FORWARD_KERNEL /
    SEQFUSE_ATTN_BACKWARD_KERNEL or an earlier set_attention_*_kernel) are put
    back after."""
    if torch.cuda.get_device_capability() != (9, 0):
        return None
    forward_was = seqfuse.ops.attention_forward_kernel(64)[0]
    backward_was = seqfuse.ops.attention_backward_kernel(64)[0]
    if forward_kernel is not None:
        seqfuse.ops.set_attention_forward_kernel(forward_kernel)
    if backward_kernel is not None:
        seqfuse.ops.set_attention_backward_kernel(backward_kernel)
    try:
        return cuda_time_ms(fn)
    finally:
        seqfuse.ops.set_attention_forward_kernel(forward_was)
        seqfuse.ops.set_attention_backward_kernel(backward_was)


def sdpa_pair(ours_in, peer_in, backward, ours_kw, peer_kw):
    """(ours, peer) timing closures: seqfuse on ours_in = (q, k, v, dout) and
    torch SDPA on peer_in (the same data in torch's [b, h, s, d] layout),
    forward only (no grad) or forward + backward; ours_kw go to seqfuse.ops,
    peer_kw to SDPA."""
    q, k, v, dout = ours_in
    qt, kt, vt, dt = peer_in
    if backward:
        qs, ks, vs = (x.detach().requires_grad_() for x in (q, k, v))
        qg, kg, vg = (x.detach().requires_grad_() for x in (qt, kt, vt))

        def ours():
            seqfuse.ops.attention(qs, ks, vs, **ours_kw).backward(dout)

        def peer():
            F.scaled_dot_product_attention(qg, kg, vg, **peer_kw).backward(dt)
    else:
        def ours():
            seqfuse.ops.attention_forward(q, k, v, **ours_kw)

        def peer():
            with torch.no_grad():
                F.scaled_dot_product_attention(qt, kt, vt, **peer_kw)
    return ours, peer


def bshd_pair(q, k, v, dout, backward, ours_kw, peer_kw):
    """sdpa_pair on bshd tensors (torch reads [b, h, s, d] views of them)."""
    return sdpa_pair((q, k, v, dout), tuple(x.transpose(1, 2) for x in (q, k, v, dout)), backward,
                     ours_kw, peer_kw)


def padded_rows(table):
    for d, h in ((64, 32), (128, 16)):
        for s in (1024, 4096, 8192):
            b = TOKENS // s
            for causal in (False, True):
                q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
                mask = "causal" if causal else "no_mask"
                for backward in (False, True):
                    ours, peer = bshd_pair(q, k, v, dout, backward, dict(attn_mask_type=mask), dict(is_causal=causal))
                    t_ours, t_peer = cuda_time_ms(ours), cuda_time_ms(peer)
                    t90 = None if backward else _hopper_time(ours, forward_kernel=90)
                    t80b = _hopper_time(ours, backward_kernel=80) if backward else None
                    fl = sdpa_flops(b, h, s, d, causal, backward)
                    table.add(case=f"s{s} d{d}{' causal' if causal else ''} {'forward+backward' if backward else 'forward'}",
                              seqlen=s, head_dim=d, heads=h, batch=b, causal=causal,
                              passes="forward+backward" if backward else "forward",
                              seqfuse_ms=t_ours, torch_ms=t_peer,
                              seqfuse_tflops=fl / t_ours / 1e9, torch_tflops=fl / t_peer / 1e9,
                              ratio=t_peer / t_ours,
                              sm90_tflops=fl / t90 / 1e9 if t90 else None,
                              sm90_ratio=t_peer / t90 if t90 else None,
                              sm80backward_tflops=fl / t80b / 1e9 if t80b else None,
                              sm80backward_ratio=t_peer / t80b if t80b else None)
                del q, k, v, dout
                torch.cuda.empty_cache()


def dropout_rows(table, p=0.1):
    d, h = 64, 32
    for s in (1024, 4096):
        b = TOKENS // s
        q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        for backward in (False, True):
            ours, peer = bshd_pair(q, k, v, dout, backward, dict(dropout_p=p), dict(dropout_p=p))
            t_ours, t_peer = cuda_time_ms(ours), cuda_time_ms(peer)
            fl = sdpa_flops(b, h, s, d, False, backward)
            table.add(case=f"s{s} d{d} dropout {p} {'forward+backward' if backward else 'forward'}",
                      seqlen=s, head_dim=d, heads=h, batch=b, causal=False, dropout=p,
                      passes="forward+backward" if backward else "forward",
                      seqfuse_ms=t_ours, torch_ms=t_peer,
                      seqfuse_tflops=fl / t_ours / 1e9, torch_tflops=fl / t_peer / 1e9,
                      ratio=t_peer / t_ours)
        del q, k, v, dout
        torch.cuda.empty_cache()


def protein_lengths(rng):
    """Real UniProt lengths where available, else the lognormal fit."""
    path = os.path.join(ROOT, "recipes", "esm2", "data", "subset", "train.parquet")
    try:
        import pyarrow.parquet as pq

        seqs = pq.read_table(path, columns=["sequence"]).column("sequence").to_pylist()
        pool = [min(len(s) + 2, 1024) for s in seqs]
        source = f"UniProt ({os.path.relpath(path, ROOT)}, {len(pool)} proteins)"
    except Exception as e:  # pyarrow or the data missing: say so, use the fit
        mu, sigma = math.log(345), (math.log(872) - math.log(345)) / 1.2816
        pool = [min(max(int(rng.lognormvariate(mu, sigma)), 8), 1024) for _ in range(20000)]
        source = f"lognormal fit (median 345, p90 872, cap 1024; real data unavailable: {type(e).__name__})"
    lengths = []
    while sum(lengths) < TOKENS:
        n = rng.choice(pool)
        if sum(lengths) + n > TOKENS:
            break
        lengths.append(n)
    return lengths, source


def packed_rows(table):
    rng = random.Random(0)
    lengths, source = protein_lengths(rng)
    for model, d in (("650M", 64), ("150M", 32), ("35M", 24), ("8M", 16)):
        packed_model_rows(table, lengths, 20, d, f"ESM-2 {model}")
    total, b, smax = sum(lengths), len(lengths), max(lengths)
    padding = 1 - total / (b * smax)
    return {"protein_lengths_source": source, "protein_sequences": b, "protein_tokens": total,
            "protein_max_len": smax, "protein_padding_fraction_for_torch": padding}


def packed_model_rows(table, lengths, h, d, model):
    total, b, smax = sum(lengths), len(lengths), max(lengths)
    cu = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32, device="cuda")
    q, k, v, dout = (torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    # torch: the same sequences padded to the longest, key padding masked out
    def pad(x):
        out = x.new_zeros(b, smax, h, d)
        start = 0
        for i, n in enumerate(lengths):
            out[i, :n] = x[start:start + n]
            start += n
        return out.transpose(1, 2)
    qp, kp, vp, dp = (pad(x) for x in (q, k, v, dout))
    keep = torch.zeros(b, 1, 1, smax, dtype=torch.bool, device="cuda")
    for i, n in enumerate(lengths):
        keep[i, ..., :n] = True
    useful = 4.0 * h * d * sum(n * n for n in lengths)
    kw = dict(qkv_format="thd", attn_mask_type="padding", cu_seqlens_q=cu, cu_seqlens_kv=cu,
              max_seqlen_q=smax, max_seqlen_kv=smax)
    for backward in (False, True):
        ours, peer = sdpa_pair((q, k, v, dout), (qp, kp, vp, dp), backward, kw, dict(attn_mask=keep))
        t_ours, t_peer = cuda_time_ms(ours), cuda_time_ms(peer)
        fl = useful * (3.5 if backward else 1.0)
        table.add(case=f"proteins thd d{d} ({model}) {'forward+backward' if backward else 'forward'}",
                  seqlen=f"{b} seqs, max {smax}",
                  head_dim=d, heads=h, batch=b, causal=False, passes="forward+backward" if backward else "forward",
                  seqfuse_ms=t_ours, torch_ms=t_peer, seqfuse_tflops=fl / t_ours / 1e9,
                  torch_tflops=fl / t_peer / 1e9, ratio=t_peer / t_ours)
    del q, k, v, dout, qp, kp, vp, dp
    torch.cuda.empty_cache()


def main():
    if not (seqfuse.cuda_available() and torch.cuda.is_available()):
        print("bench_attn: needs a CUDA GPU and a CUDA build of seqfuse")
        return
    torch.manual_seed(0)
    # seqfuse's own kernels against torch: the default backend would send the
    # padded rows' autograd calls to cuDNN (the same kernels torch runs)
    seqfuse.ops.set_attention_backend("seqfuse")
    table = Table("attn", ["case", "seqfuse_tflops", "torch_tflops", "ratio", "seqfuse_ms", "torch_ms",
                           "sm90_tflops", "sm90_ratio", "sm80backward_tflops", "sm80backward_ratio"])
    if "--dropout" in sys.argv[1:]:
        table = Table("attn_dropout", ["case", "seqfuse_tflops", "torch_tflops", "ratio", "seqfuse_ms",
                                       "torch_ms"])
        dropout_rows(table)
        table.save({"note": "attention dropout p=0.1; torch = F.scaled_dot_product_attention(dropout_p=0.1)"})
        return
    padded_rows(table)
    extra = packed_rows(table)
    dropout_rows(table)
    extra["note"] = ("torch = F.scaled_dot_product_attention (backend of its choice); TFLOP/s counts "
                     "4*b*h*s^2*d per forward (half when causal), x3.5 with the backward; protein rows count "
                     "real tokens only")
    table.save(extra)
    labels = [r["case"] for r in table.rows]
    plot_bars(os.path.join(RESULTS, "attn.png"), "Fused attention, H200, bf16 (TFLOP/s)", labels,
              {"seqfuse": [r["seqfuse_tflops"] for r in table.rows],
               "torch sdpa": [r["torch_tflops"] for r in table.rows]}, "TFLOP/s")


if __name__ == "__main__":
    main()
