"""One transformer layer, forward + backward: seqfuse's TransformerLayer (bf16,
and FP8 under DelayedScaling / Float8CurrentScaling / Float8BlockScaling)
against the same layer written in plain torch (nn.functional linear and
norms, torch's scaled_dot_product_attention, RoPE as cos/sin arithmetic) in
bf16 eager, on the same inputs and weights, in one process.

Shapes (16k tokens per step):
  esm2_650m  hidden 1280, FFN 5120, 20 heads of 64, LayerNorm, GELU,
             bidirectional with padding mask, bshd 16 x 1024
  llama_like hidden 4096, FFN 14336, 32 heads of 128, 8 KV groups, RMSNorm,
             SwiGLU, causal, bshd 4 x 4096
Before timing, the seqfuse layer's bf16 output is checked against the torch
layer (relative error printed and stored).  TFLOP/s counts the GEMMs and the
attention (4 b h s^2 d, halved when causal) x3 for forward + backward; MFU is
against the measured bf16 GEMM ceiling (harness.H200_BF16_TFLOPS), also for
FP8 rows (the ceiling of the FP8 GEMM is given next to it).
"""
import os

import torch
import torch.nn.functional as F

import seqfuse
from harness import H200_BF16_TFLOPS, H200_FP8_TFLOPS, RESULTS, Table, cuda_time_ms, plot_bars

SHAPES = {
    "esm2_650m": dict(hidden=1280, ffn=5120, heads=20, groups=20, norm="LayerNorm", act="gelu",
                      mask="padding", batch=16, seq=1024),
    "llama_like": dict(hidden=4096, ffn=14336, heads=32, groups=8, norm="RMSNorm", act="swiglu",
                       mask="causal", batch=4, seq=4096),
}


class TorchLayer(torch.nn.Module):
    """The pre-LN layer in plain torch; parameters copied from a seqfuse layer."""

    def __init__(self, te_layer, cfg):
        super().__init__()
        self.cfg = cfg
        self.p = torch.nn.ParameterDict({n.replace(".", "__"): torch.nn.Parameter(p.detach().clone())
                                         for n, p in te_layer.named_parameters()})

    def w(self, name):
        return self.p[name.replace(".", "__")] if name.replace(".", "__") in self.p else None

    def norm(self, x, prefix):
        if self.cfg["norm"] == "RMSNorm":
            return F.rms_norm(x, (x.shape[-1],), self.w(prefix + "layer_norm_weight"), 1e-5)
        return F.layer_norm(x, (x.shape[-1],), self.w(prefix + "layer_norm_weight"),
                            self.w(prefix + "layer_norm_bias"), 1e-5)

    def forward(self, x, cos, sin, key_mask):
        c = self.cfg
        h, g = c["heads"], c["groups"]
        d = c["hidden"] // h
        b, s, _ = x.shape
        ln = self.norm(x, "self_attention.layernorm_qkv.")
        mixed = F.linear(ln, self.w("self_attention.layernorm_qkv.weight"), self.w("self_attention.layernorm_qkv.bias"))
        grouped = mixed.view(b, s, g, h // g + 2, d)
        q = grouped[..., : h // g, :].reshape(b, s, h, d)
        k, v = grouped[..., h // g, :], grouped[..., h // g + 1, :]

        def rope(t):
            rot = torch.cat([-t[..., d // 2:], t[..., : d // 2]], dim=-1)
            return (t.float() * cos + rot.float() * sin).to(t.dtype)

        q, k = rope(q).transpose(1, 2), rope(k).transpose(1, 2)
        v = v.transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, is_causal=c["mask"] == "causal",
                                           enable_gqa=g != h)
        a = a.transpose(1, 2).reshape(b, s, h * d)
        x = x + F.linear(a, self.w("self_attention.proj.weight"), self.w("self_attention.proj.bias"))
        ln = self.norm(x, "layernorm_mlp.")
        y = F.linear(ln, self.w("layernorm_mlp.fc1_weight"), self.w("layernorm_mlp.fc1_bias"))
        if c["act"] == "swiglu":
            a_, gate = y.chunk(2, dim=-1)
            y = F.silu(a_) * gate
        else:
            y = F.gelu(y, approximate="tanh")
        return x + F.linear(y, self.w("layernorm_mlp.fc2_weight"), self.w("layernorm_mlp.fc2_bias"))


def layer_flops(c, causal_fraction):
    b, s, hd, f, h, g = c["batch"], c["seq"], c["hidden"], c["ffn"], c["heads"], c["groups"]
    d = hd // h
    t = b * s
    gemm = 2 * t * hd * ((h + 2 * g) * d + hd + f * (2 if c["act"] == "swiglu" else 1) + f)
    attn = 4 * b * s * s * h * d * causal_fraction
    return 3.0 * (gemm + attn)


def run_shape(name, c, table, checks):
    import seqfuse.pytorch as te
    from seqfuse.common import recipe as recipes

    torch.manual_seed(0)
    layer = te.TransformerLayer(c["hidden"], c["ffn"], c["heads"], num_gqa_groups=c["groups"],
                                hidden_dropout=0.0, attention_dropout=0.0, self_attn_mask_type=c["mask"],
                                normalization=c["norm"], activation=c["act"], attn_input_format="bshd",
                                params_dtype=torch.bfloat16, device="cuda", fuse_qkv_params=True,
                                bias=c["norm"] == "LayerNorm")
    peer = TorchLayer(layer, c).cuda()
    b, s, d = c["batch"], c["seq"], c["hidden"] // c["heads"]
    x = torch.randn(b, s, c["hidden"], device="cuda", dtype=torch.bfloat16) * 0.5
    dout = torch.randn_like(x)
    freqs = te.RotaryPositionEmbedding(d, device="cuda")(s)
    cos, sin = freqs[:, 0, 0, :].cos()[None, :, None, :], freqs[:, 0, 0, :].sin()[None, :, None, :]
    if c["mask"] == "padding":
        # Real-looking padding: each row keeps 60..100 % of its length.
        lengths = [int(s * (0.6 + 0.4 * i / max(b - 1, 1))) for i in range(b)]
        te_mask = torch.stack([torch.arange(s, device="cuda") >= n for n in lengths])[:, None, None, :]
        key_mask = ~te_mask
        kw = dict(attention_mask=te_mask)
        causal_fraction = 1.0
    else:
        te_mask, key_mask, kw, causal_fraction = None, None, {}, 0.5
        lengths = [s] * b

    xs = x.detach().requires_grad_()
    xp = x.detach().requires_grad_()
    with torch.no_grad():
        out = layer(x, rotary_pos_emb=freqs, **kw)
        ref = peer(x, cos, sin, key_mask)
    valid = torch.stack([torch.arange(s, device="cuda") < n for n in lengths])
    err = ((out[valid].float() - ref[valid].float()).norm() / ref[valid].float().norm()).item()
    checks[name] = err
    print(f"{name}: seqfuse vs torch bf16 output rel. error {err:.2e}")

    def torch_step():
        peer(xp, cos, sin, key_mask).backward(dout)

    def seqfuse_step():
        layer(xs, rotary_pos_emb=freqs, **kw).backward(dout)

    flops = layer_flops(c, causal_fraction)
    t_peer = cuda_time_ms(torch_step, warmup=3, repeats=10)
    rows = [("torch bf16", t_peer, H200_BF16_TFLOPS)]
    rows.append(("seqfuse bf16", cuda_time_ms(seqfuse_step, warmup=3, repeats=10), H200_BF16_TFLOPS))
    for rname in ("DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling"):
        if not hasattr(recipes, rname):
            continue
        recipe = getattr(recipes, rname)()

        def fp8_step():
            with te.fp8_autocast(enabled=True, fp8_recipe=recipe):
                y = layer(xs, rotary_pos_emb=freqs, **kw)
            y.backward(dout)

        try:
            rows.append((f"seqfuse fp8 {rname}", cuda_time_ms(fp8_step, warmup=3, repeats=10), H200_FP8_TFLOPS))
        except (NotImplementedError, RuntimeError, ValueError) as e:
            print(f"{name}: {rname} failed: {type(e).__name__}: {e}")
            table.add(shape=name, impl=f"seqfuse fp8 {rname}", error=f"{type(e).__name__}: {e}"[:200])
    for impl, ms, ceiling in rows:
        tf = flops / ms / 1e9
        table.add(shape=name, impl=impl, ms=ms, tflops=tf, mfu_bf16=tf / H200_BF16_TFLOPS,
                  ceiling_tflops=ceiling, speedup_vs_torch=t_peer / ms, tokens=b * s)
    del layer, peer
    torch.cuda.empty_cache()


def main():
    if not (seqfuse.cuda_available() and torch.cuda.is_available()):
        print("bench_layer: needs a CUDA GPU and a CUDA build of seqfuse")
        return
    table = Table("layer", ["shape", "impl", "ms", "tflops", "mfu_bf16", "speedup_vs_torch"])
    checks = {}
    for name, c in SHAPES.items():
        run_shape(name, c, table, checks)
    table.save({"output_rel_error_vs_torch_bf16": checks,
                "note": "one layer forward+backward, same inputs and weights; torch = plain torch eager bf16 with "
                        "scaled_dot_product_attention; TFLOP/s = 3 x (GEMM + attention) FLOPs / time"})
    labels = sorted({r["shape"] for r in table.rows})
    impls = [i for i in dict.fromkeys(r["impl"] for r in table.rows)]
    series = {i: [next((r.get("tflops", 0.0) for r in table.rows if r["shape"] == sh and r["impl"] == i), 0.0)
                  for sh in labels] for i in impls}
    plot_bars(os.path.join(RESULTS, "layer.png"), "TransformerLayer forward+backward, H200 (TFLOP/s)", labels, series,
              "TFLOP/s")


if __name__ == "__main__":
    main()
