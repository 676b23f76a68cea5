"""seqfuse's fused kernels beside Liger-Kernel's (Triton) and beside torch,
eager and under torch.compile, forward + backward through autograd, in one
process on the same inputs and weights:

  rmsnorm    seqfuse.pytorch.RMSNorm | LigerRMSNorm      | nn.RMSNorm
  layernorm  seqfuse.pytorch.LayerNorm | LigerLayerNorm  | nn.LayerNorm
  swiglu     seqfuse activation(x, "swiglu") on the fused [T, 2F] fc1 output
             | LigerSiLUMulFunction(a, b) on its two [T, F] halves as separate
             contiguous tensors (its input in Liger's MLP: two projections)
             | F.silu(a) * b on the halves of x
  rope       seqfuse apply_rotary_pos_emb on q and k (bshd) | Liger's
             liger_rotary_pos_emb(q, k, cos, sin) on the [b, h, s, d] views
             Hugging Face hands it | Hugging Face's rotate-half code
  flce       seqfuse.pytorch.linear_cross_entropy | Liger's
             LigerFusedLinearCrossEntropyLoss | F.cross_entropy(h @ W^T);
             also seqfuse_fp8: linear_cross_entropy(fp8_recipe=
             DelayedScaling()), its chunk GEMMs in FP8 (no FP8 peer: the
             others run bf16, so its ratio is a precision trade, reported
             beside, not as, seqfuse's)

"torch" is the plain torch code, "torch_compile" the same code through
torch.compile.  Every row is timed over a queue of --iters back-to-back
forward+backward calls (peers/timing.interleaved_ms), so a compiled call's fixed host
cost does not decide a row unless the host really is the bottleneck.
Liger's RMSNorm runs with in_place=False (its default True writes dx into the
caller's dy, which the timing loop reuses).  Liger's RoPE rotates q and k in
place (harmless in a model, where they are fresh projections; here each
timed call rotates the same tensors again, which keeps their magnitude), so
every output is compared before any timing.

Shapes (llama_1b-like; ESM-2 650M for LayerNorm): 8192 tokens, hidden 2048
(LayerNorm 1280), SwiGLU FFN 8192, RoPE 2 x 4096 with 32 query / 8 KV heads
of 64, linear cross-entropy over Llama 3's 128,256-entry vocabulary; tiny:
a CPU smoke size.  Reported per op: ms of each implementation, peak memory,
rel_diff of each output against torch eager, and seqfuse_vs_<peer> = peer ms
/ seqfuse ms (> 1: seqfuse faster), with the fastest peer named.

Liger rows are skipped with the reason where liger_kernel does not import or
no GPU is present.  JSON: benchmarks/results/liger.json.
"""
import os
import sys

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, BENCH)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import peers  # noqa: E402,F401  (seqfuse from a source checkout)
from peers.meta import skip_reason  # noqa: E402
from peers.timing import (Results, error_text, interleaved_ms, parse_run_args, peak_gib, rel_diff,  # noqa: E402
                          release_cached_memory)

OPS = ("rmsnorm", "layernorm", "swiglu", "rope", "flce")
IMPLS = ("seqfuse", "seqfuse_fp8", "liger", "torch", "torch_compile")
SIZES = {
    "h200": dict(tokens=8192, hidden=2048, ln_hidden=1280, ffn=8192, batch=2, seq=4096, q_heads=32, kv_heads=8,
                 head_dim=64, vocab=128256),
    "tiny": dict(tokens=64, hidden=128, ln_hidden=64, ffn=128, batch=2, seq=32, q_heads=4, kv_heads=2, head_dim=16,
                 vocab=512),
}
EPS = 1e-5


def rotate_half(t):
    d = t.shape[-1] // 2
    return torch.cat((-t[..., d:], t[..., :d]), dim=-1)


def hf_rope(q, k, cos, sin):
    """Hugging Face's apply_rotary_pos_emb: q, k [b, h, s, d], cos / sin [1, s, d]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def torch_swiglu(x):
    a, b = x.chunk(2, dim=-1)
    return F.silu(a) * b


def torch_flce(h, w, y):
    return F.cross_entropy((h @ w.t()).float(), y)


class Op:
    """One implementation of one op: ``run()`` returns its outputs, ``leaves``
    get gradients, ``grads`` are the output gradients; ``same_as_torch(out)``
    maps the outputs to torch's layout for the comparison."""

    def __init__(self, run, leaves, grads, layout=lambda out: out):
        self.run, self.leaves, self.grads, self.layout = run, leaves, grads, layout

    def step(self):
        outs = self.run()
        outs = outs if isinstance(outs, tuple) else (outs,)
        torch.autograd.backward(outs, self.grads)
        for t in self.leaves:
            t.grad = None


def leaf(t):
    return t.detach().clone().requires_grad_()


def make_op(op, impl, s, device, dtype):
    """The Op of ``impl`` for ``op`` at size ``s`` (same seeded inputs for every impl)."""
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    compiled = impl == "torch_compile"
    if op in ("rmsnorm", "layernorm"):
        h = s["hidden"] if op == "rmsnorm" else s["ln_hidden"]
        x, dy, w, b = rnd(s["tokens"], h), rnd(s["tokens"], h), rnd(h, scale=0.1) + 1, rnd(h, scale=0.1)
        if impl == "seqfuse":
            import seqfuse.pytorch as sf

            mod = (sf.RMSNorm(h, eps=EPS, params_dtype=dtype, device=device) if op == "rmsnorm" else
                   sf.LayerNorm(h, eps=EPS, params_dtype=dtype, device=device))
        elif impl == "liger":
            from liger_kernel.transformers import LigerLayerNorm, LigerRMSNorm

            mod = (LigerRMSNorm(h, eps=EPS, in_place=False) if op == "rmsnorm" else
                   LigerLayerNorm(h, eps=EPS, bias=True)).to(device=device, dtype=dtype)
        else:
            mod = (nn.RMSNorm(h, eps=EPS) if op == "rmsnorm" else nn.LayerNorm(h, eps=EPS)).to(device=device,
                                                                                              dtype=dtype)
        with torch.no_grad():
            mod.weight.copy_(w)
            if op == "layernorm":
                mod.bias.copy_(b)
        x = leaf(x)
        call = torch.compile(mod) if compiled else mod
        return Op(lambda: call(x), [x] + list(mod.parameters()), (dy,))
    if op == "swiglu":
        x, dy = rnd(s["tokens"], 2 * s["ffn"]), rnd(s["tokens"], s["ffn"])
        if impl == "seqfuse":
            from seqfuse.modules.activation import activation

            x = leaf(x)
            return Op(lambda: activation(x, "swiglu"), [x], (dy,))
        if impl == "liger":
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction

            a, b = (leaf(t.contiguous()) for t in x.chunk(2, dim=-1))
            return Op(lambda: LigerSiLUMulFunction.apply(a, b), [a, b], (dy,))
        x = leaf(x)
        fn = torch.compile(torch_swiglu) if compiled else torch_swiglu
        return Op(lambda: fn(x), [x], (dy,))
    if op == "rope":
        b_, sq, d = s["batch"], s["seq"], s["head_dim"]
        q, k = rnd(b_, sq, s["q_heads"], d), rnd(b_, sq, s["kv_heads"], d)  # bshd, contiguous
        dq, dk = rnd(b_, sq, s["q_heads"], d), rnd(b_, sq, s["kv_heads"], d)
        import seqfuse.pytorch as sf

        freqs = sf.RotaryPositionEmbedding(d, device=device)(sq)  # [s, 1, 1, d] float32, halves duplicated
        cos, sin = (f(freqs[:, 0, 0, :])[None].to(dtype) for f in (torch.cos, torch.sin))  # [1, s, d]
        q, k = leaf(q), leaf(k)
        to_bhsd = (dq.transpose(1, 2), dk.transpose(1, 2))
        if impl == "seqfuse":
            return Op(lambda: (sf.apply_rotary_pos_emb(q, freqs, "bshd"), sf.apply_rotary_pos_emb(k, freqs, "bshd")),
                      [q, k], (dq, dk), layout=lambda out: tuple(t.transpose(1, 2) for t in out))
        if impl == "liger":
            from liger_kernel.transformers.rope import liger_rotary_pos_emb

            return Op(lambda: liger_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin), [q, k], to_bhsd)
        fn = torch.compile(hf_rope) if compiled else hf_rope
        return Op(lambda: fn(q.transpose(1, 2), k.transpose(1, 2), cos, sin), [q, k], to_bhsd)
    if op == "flce":
        h, w = leaf(rnd(s["tokens"], s["hidden"], scale=0.5)), leaf(rnd(s["vocab"], s["hidden"], scale=0.02))
        y = torch.randint(0, s["vocab"], (s["tokens"],), generator=g).to(device)
        one = torch.ones((), device=device)
        if impl in ("seqfuse", "seqfuse_fp8"):
            import seqfuse.pytorch as sf
            from seqfuse.common.recipe import DelayedScaling

            recipe = DelayedScaling() if impl == "seqfuse_fp8" else None
            return Op(lambda: sf.linear_cross_entropy(h, w, y, fp8_recipe=recipe), [h, w], (one,))
        if impl == "liger":
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

            loss = LigerFusedLinearCrossEntropyLoss()
            return Op(lambda: loss(w, h, y), [h, w], (one,))
        fn = torch.compile(torch_flce) if compiled else torch_flce
        return Op(lambda: fn(h, w, y), [h, w], (one,))
    raise ValueError(f"--ops: unknown op {op!r}; choose from {', '.join(OPS)}")


def run_op(op, s, impls, args, device, results, liger_why):
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    row = dict(op=op, size=args.size)
    impls = [i for i in impls if i != "seqfuse_fp8" or op == "flce"]  # (FP8 only for the loss's GEMMs)
    ops, errors = {}, {}
    for impl in impls:
        if impl == "liger" and liger_why:
            row["liger_skipped"] = liger_why
            continue
        try:
            ops[impl] = make_op(op, impl, s, device, dtype)
        except Exception as e:  # noqa: BLE001 - reported in the row, the others run on
            errors[impl] = e
    # Outputs for the comparison first, on the fresh inputs (Liger's RoPE rotates q and k in place), with
    # autograd on: a compiled row then compiles here the training graph its timing uses, once.
    outs = {}
    for impl, o in ops.items():
        try:
            out = o.layout(o.run())
            outs[impl] = tuple(t.detach().clone() for t in (out if isinstance(out, tuple) else (out,)))
            del out
        except Exception as e:  # noqa: BLE001
            row[f"{impl}_check_error"] = error_text(e)
    times = interleaved_ms({k: o.step for k, o in ops.items()}, device, iters=args.iters, rounds=args.rounds,
                           warmup=args.warmup)
    for impl in impls:
        t = times.get(impl, errors.get(impl))
        if t is None:
            continue
        if isinstance(t, Exception):
            row[f"{impl}_error"] = error_text(t)
            continue
        row[f"{impl}_ms"] = t
        row[f"{impl}_peak_gib"] = peak_gib(ops[impl].step, device)
        if impl != "torch" and impl in outs and "torch" in outs:
            row[f"{impl}_rel_diff"] = max(rel_diff(a, b) for a, b in zip(outs[impl], outs["torch"]))
    if "seqfuse_ms" in row:
        peers_ms = {k: row[f"{k}_ms"] for k in ("liger", "torch", "torch_compile") if f"{k}_ms" in row}
        for k, v in peers_ms.items():
            row[f"seqfuse_vs_{k}"] = v / row["seqfuse_ms"]
        if peers_ms:
            best = min(peers_ms, key=peers_ms.get)
            row["best_peer"], row["seqfuse_vs_best_peer"] = best, peers_ms[best] / row["seqfuse_ms"]
            if "seqfuse_fp8_ms" in row:
                row["seqfuse_fp8_vs_best_peer"] = peers_ms[best] / row["seqfuse_fp8_ms"]
                row["seqfuse_fp8_vs_seqfuse"] = row["seqfuse_ms"] / row["seqfuse_fp8_ms"]
    results.add(**row)
    del ops
    release_cached_memory(device)


def main(argv=None):
    args = parse_run_args(argv, __doc__.splitlines()[0], "liger", [("--ops", ",".join(OPS), OPS)], iters=20,
                          compile_option=True,
                          more=lambda p: p.add_argument("--size", default="h200", choices=sorted(SIZES)))
    ops = args.ops
    device = torch.device(args.device)
    liger_why = (skip_reason("liger_kernel.transformers", need_cuda=True) if device.type == "cuda"
                 else "liger_kernel: Triton kernels, CUDA only (--device cpu)")
    if liger_why:
        print(f"[liger] Liger rows skipped: {liger_why}", flush=True)
    impls = [i for i in IMPLS if not (args.no_compile and i == "torch_compile")]
    if "torch_compile" in impls:
        from harness import allow_recompiles

        allow_recompiles()
    results = Results(args.out, __file__, extra={
        "peers": "Liger-Kernel, torch eager, torch.compile of the same torch code; same inputs and weights",
        "timing": f"forward+backward through autograd, median of {args.rounds} alternating rounds of {args.iters} "
                  f"back-to-back calls after {args.warmup} warm-up calls",
        "ratio": "seqfuse_vs_<peer> = peer ms / seqfuse ms (> 1: seqfuse faster)",
        "size": SIZES[args.size], "liger_skipped": liger_why})
    for op in ops:
        results.guard(run_op, op, SIZES[args.size], impls, args, device, results, liger_why, op=op, size=args.size)
    results.finish("seqfuse_vs_best_peer", lambda r: f"{r['op']} seqfuse >= 1.0x the fastest peer ({r['best_peer']})")

if __name__ == "__main__":
    main()
