"""FP8 attention (TE's fp8_dpa) against bf16 attention on the GPU, in one
process on the same inputs: issue 19's goal is FP8 at least 1.3x bf16
attention forward+backward at head dim 128, sequence 8,192.

Rows per shape (b x s tokens, h heads of d, causal or not, bf16 inputs):
- seqfuse_fp8: seqfuse.quantization.fp8_attention under a DelayedScaling
  state after two warm-up steps with their updates (the steady state of
  training: delayed scales), end to end as a layer sees it: the Q/K/V casts,
  cuDNN's FP8 graphs, the dequantization of O and of dQ/dK/dV;
- seqfuse_fp8_kernels: cuDNN's FP8 forward and backward graphs alone on
  pre-cast FP8 tensors (what the casts cost is the difference);
  (head dims other than 128: forward only, cuDNN's FP8 backward on Hopper
  takes 128 only)
- seqfuse_bf16: seqfuse.ops.attention in bf16 (auto route: cuDNN through
  torch SDPA on Hopper for these padding-free calls);
- torch_sdpa_cudnn: torch's scaled_dot_product_attention pinned to its cuDNN
  backend, bf16 (the strongest bf16 peer on Hopper: README, "Attention routes over the grid");
- te_bf16, te_fp8_dpa: Transformer Engine's DotProductAttention, bf16 and
  under DelayedScaling(fp8_dpa=True), where transformer_engine imports (a
  line says why where it does not; te_fp8_dpa at head dim 128 only, as
  seqfuse's FP8 rows).
Timing: harness.cuda_time_ms (CUDA events, median, L2 flushed) after warm-up
on the same shapes; forward and forward+backward separately.  ms: per call
of CALLS calls issued back to back (as a training step issues its layers:
the host runs ahead of the GPU, so a route's host work hides behind the GPU
work queued before it, as long as it is shorter); ms_isolated: one call per
timed sample (the host work before the first kernel shows).  TFLOP/s =
4 b h s^2 d (halved when causal), x3.5 with the backward.  fp8_vs_bf16 =
the best bf16 row's time (seqfuse, torch or TE) / the FP8 row's.

    python3 benchmarks/attn/bench_fp8_attention.py [--quick] [--profile]
Writes benchmarks/results/fp8_attention.json (commit, versions, command).
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from harness import RESULTS, Table, cuda_time_ms, plot_bars  # noqa: E402

import seqfuse  # noqa: E402
from seqfuse.common.recipe import DelayedScaling  # noqa: E402
from seqfuse.ops import attn as attn_ops  # noqa: E402
from seqfuse.quantization import attention as fp8a  # noqa: E402
from seqfuse.quantization import reduce_and_update  # noqa: E402

CALLS = 10
PROFILE = False

SHAPES = [  # b, s, h, d, causal
    (1, 8192, 16, 128, False),
    (1, 8192, 16, 128, True),
    (2, 4096, 16, 128, True),
    (2, 8192, 32, 64, True),  # forward only: cuDNN's FP8 backward on Hopper takes head dim 128 only
]


def flops(b, s, h, d, causal, backward):
    f = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)
    return f * (3.5 if backward else 1.0)


def te_rows(q, k, v, dout, h, d, mask, case, train):
    """Transformer Engine's DotProductAttention on the same tensors, bf16 and
    under DelayedScaling(fp8_dpa=True) (TE's FP8 attention, its own casts
    included), where transformer_engine imports; a line says why where it
    does not (the GPU machine has no package index: TE comes as carried
    wheels, ../shared/peers/prepare_te.py)."""
    try:
        import transformer_engine.pytorch as tep
        from transformer_engine.common import recipe as te_recipe
    except Exception as e:  # ImportError, or a broken install
        print(f"[fp8_attention] {case}: no Transformer Engine rows: {type(e).__name__}: {e}", flush=True)
        return {}
    dpa = tep.DotProductAttention(h, d, qkv_format="bshd", attn_mask_type=mask, attention_dropout=0.0)
    fp8_recipe = te_recipe.DelayedScaling(fp8_dpa=True)
    dflat = dout.reshape(dout.shape[0], dout.shape[1], h * d)

    def run(fp8, backward):
        def fn():
            with torch.set_grad_enabled(backward), tep.fp8_autocast(enabled=fp8, fp8_recipe=fp8_recipe):
                out = dpa(q, k, v)
            if backward:
                torch.autograd.grad(out, (q, k, v), dflat)
        return fn

    rows = {"te_bf16": (run(False, False), run(False, True))}
    if train:
        rows["te_fp8_dpa"] = (run(True, False), run(True, True))
    return rows


def bench_shape(table, b, s, h, d, causal, repeats):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, generator=g, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn(b, s, h, d, generator=g, device="cuda", dtype=torch.bfloat16) * 1e-3
    mask = "causal" if causal else "no_mask"
    recipe = DelayedScaling()
    state = fp8a.attention_state(recipe, "cuda")

    def fp8_forward():
        with torch.no_grad():
            return fp8a.fp8_attention(q, k, v, state, attn_mask_type=mask)

    def fp8_forward_backward():
        out = fp8a.fp8_attention(q, k, v, state, attn_mask_type=mask)
        torch.autograd.grad(out, (q, k, v), dout)

    train = d == fp8a.CUDA_BACKWARD_HEAD_DIM  # cuDNN's FP8 backward on Hopper: head dim 128 only
    for _ in range(2):  # two steps with updates: delayed scales from here on
        fp8_forward_backward() if train else fp8_forward()
        reduce_and_update(recipe)

    # the kernels alone, on tensors cast once
    q8, k8, v8 = (x.detach().to(torch.float8_e4m3fn) for x in (q, k, v))
    do8 = (dout * 1e3).to(torch.float8_e5m2)
    one = torch.ones(1, device="cuda")
    ss, dss = torch.full((1,), 448.0, device="cuda"), torch.full((1,), 1 / 448.0, device="cuda")
    o8 = torch.empty_like(q8)
    stats = torch.empty(b, h, s, 1, device="cuda")
    am = torch.empty(6, device="cuda")
    g8 = [torch.empty(x.shape, dtype=torch.float8_e5m2, device="cuda") for x in (q8, k8, v8)]

    def k_forward():
        attn_ops.fp8_attention_forward(q8, k8, v8, one, one, one, ss, dss, one, o=o8, stats=stats,
                                       amax_s=am[0:1], amax_o=am[1:2], causal=causal)

    def k_forward_backward():
        k_forward()
        attn_ops.fp8_attention_backward(q8, k8, v8, o8, do8, stats, one, one, one, one, one, dss, one, ss, one,
                                        one, one, one, dq=g8[0], dk=g8[1], dv=g8[2], amax_dq=am[2:3],
                                        amax_dk=am[3:4], amax_dv=am[4:5], amax_dp=am[5:6], causal=causal)

    def sf_forward():
        with torch.no_grad():
            return seqfuse.ops.attention(q, k, v, attn_mask_type=mask)

    def sf_forward_backward():
        out = seqfuse.ops.attention(q, k, v, attn_mask_type=mask)
        torch.autograd.grad(out, (q, k, v), dout)

    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
    dt = dout.transpose(1, 2)

    def sdpa_forward():
        with torch.no_grad(), sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    def sdpa_forward_backward():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        torch.autograd.grad(out, (qt, kt, vt), dt)

    if PROFILE and train:
        from torch.profiler import ProfilerActivity, profile
        for _ in range(3):
            fp8_forward_backward()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fp8_forward_backward()
            torch.cuda.synchronize()
        print(f"== profile of 5 seqfuse_fp8 forward+backward calls, b{b} s{s} h{h} d{d} causal={causal}")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))

    rows = {"seqfuse_fp8": (fp8_forward, fp8_forward_backward), "seqfuse_fp8_kernels": (k_forward, k_forward_backward),
            "seqfuse_bf16": (sf_forward, sf_forward_backward), "torch_sdpa_cudnn": (sdpa_forward, sdpa_forward_backward)}
    case = f"b{b} s{s} h{h} d{d} {'causal' if causal else 'full'}"
    rows.update(te_rows(q, k, v, dout, h, d, mask, case, train))
    for pass_name, idx, backward in (("forward", 0, False), ("forward+backward", 1, True))[:2 if train else 1]:
        ms, ms1 = {}, {}
        for name, fns in rows.items():
            fn = fns[idx]

            def many(fn=fn):
                for _ in range(CALLS):
                    fn()
            try:
                ms1[name] = cuda_time_ms(fn, warmup=3, repeats=repeats)
                ms[name] = cuda_time_ms(many, warmup=1, repeats=max(3, repeats // 3)) / CALLS
            except Exception as e:  # a row that cannot run says why
                print(f"[fp8_attention] {case} {pass_name} {name}: {type(e).__name__}: {e}", flush=True)
        bf16 = [n for n in ("seqfuse_bf16", "torch_sdpa_cudnn", "te_bf16") if n in ms]
        best, best1 = min(ms[n] for n in bf16), min(ms1[n] for n in bf16)
        for name, t in ms.items():
            fp8 = name.startswith("seqfuse_fp8") or name == "te_fp8_dpa"
            table.add(case=case, pass_=pass_name, row=name, ms=round(t, 3),
                      tflops=round(flops(b, s, h, d, causal, backward) / t / 1e9, 1),
                      fp8_vs_bf16=round(best / t, 3) if fp8 else "", ms_isolated=round(ms1[name], 3),
                      fp8_vs_bf16_isolated=round(best1 / ms1[name], 3) if fp8 else "")


def plot(json_path, png_path):
    """A bar chart of a result file: TFLOP/s per row, back-to-back calls,
    one group per case and pass."""
    import json
    with open(json_path) as f:
        doc = json.load(f)
    rows = doc["rows"]
    labels = list(dict.fromkeys(f"{r['case']} {r['pass_']}" for r in rows))
    names = list(dict.fromkeys(r["row"] for r in rows))
    series = {n: [next((r["tflops"] for r in rows if r["row"] == n and f"{r['case']} {r['pass_']}" == lab), 0.0)
                  for lab in labels] for n in names}
    plot_bars(png_path, f"FP8 attention vs bf16 attention, {doc['environment'].get('gpu', '')}", labels, series,
              "TFLOP/s (back-to-back calls)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the first shape only, fewer repeats")
    ap.add_argument("--profile", action="store_true", help="print a torch.profiler table of the FP8 route")
    ap.add_argument("--plot-only", metavar="JSON", help="only draw JSON's rows as JSON with .png (no GPU run)")
    args = ap.parse_args()
    if args.plot_only:
        plot(args.plot_only, os.path.splitext(args.plot_only)[0] + ".png")
        return
    global PROFILE
    PROFILE = args.profile
    table = Table("fp8_attention", ["case", "pass_", "row", "ms", "tflops", "fp8_vs_bf16", "ms_isolated",
                                    "fp8_vs_bf16_isolated"])
    for shape in SHAPES[:1] if args.quick else SHAPES:
        bench_shape(table, *shape, repeats=5 if args.quick else 15)
    table.save()
    plot(os.path.join(RESULTS, "fp8_attention.json"), os.path.join(RESULTS, "fp8_attention.png"))


if __name__ == "__main__":
    main()
