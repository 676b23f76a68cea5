"""A plain-torch FP8 training emulation of transformers' LlamaForCausalLM,
the yardstick for seqfuse's FP8 path (issue 16's FP8 question).

Why: when seqfuse's FP8 training drifts from bf16, the question is whether
FP8 rounding itself causes that (any FP8 training would drift the same way)
or seqfuse's FP8 path does something it should not.  This module answers it
with an independent implementation of the same arithmetic in ordinary torch
ops: every GEMM of the decoder layers (QKV, attention output, gate/up, down)
quantizes and dequantizes its operands and multiplies the dequantized values
in float32; everything else (embeddings, RMSNorm, RoPE, attention, SwiGLU,
LM head, loss) is transformers' own code in the model's dtype.

  forward     y    = Q_forward(x) @ Q_forward(W)^T          (E4M3)
  input grad  dx   = Q_backward(dy) @ Q_forward(W)
  weight grad dW   = Q_backward(dy)^T @ Q_forward(x)

with the recipes' default formats: Q_backward in E5M2 for per-tensor scaling
(Format.HYBRID, DelayedScaling's and Float8CurrentScaling's default), in
E4M3 for block scaling (Float8BlockScaling's default, as in Transformer
Engine).  Two scalings, mirroring seqfuse's recipes:
  * "current": one scale per tensor from its own amax now,
    scale = fp8_max / amax (the first step of DelayedScaling, and
    Float8CurrentScaling); the GEMM computes (q * (1 / scale)).
  * "block": Float8BlockScaling's layout: activations and gradients in 1x128
    blocks along the GEMM's reduction dimension (so x and dy are quantized
    once row-wise for the forward / input gradient and once column-wise, in
    blocks of 128 tokens, for the weight gradient), weights in 128x128 blocks.

seqfuse fuses Q, K and V into one GEMM (interleaved per key/value group,
seqfuse.hf.qkv) and gate/up into another, so an amax (and a 128x128 block)
spans the fused weight and output gradient.  The emulation fuses the same
way: the first projection of a group computes the fused GEMM on the layer's
input and hands the other projections their slices of it, so amaxes and
blocks cover exactly what seqfuse's do.  With the model in float32 the
emulation and seqfuse's current scaling then make the same roundings up to
float32 summation order: their gradients agree far more closely than
either agrees with the unquantized model (bench_llama3_convergence.py
compares them).
"""
import torch

from seqfuse.hf.qkv import fuse_qkv, split_qkv

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
FORWARD_FORMAT = torch.float8_e4m3fn
#: the output gradients' format per kind (the recipes' default fp8_format: HYBRID, E4M3)
GRAD_FORMAT = {"current": torch.float8_e5m2, "block": torch.float8_e4m3fn}
BLOCK = 128
KINDS = tuple(GRAD_FORMAT)


def _scale(amax, fp8_dtype):
    """fp8_max / amax per entry, 1 where amax is 0 or not finite (seqfuse's rule)."""
    amax = amax.float()
    ok = torch.isfinite(amax) & (amax > 0)
    s = FP8_MAX[fp8_dtype] / torch.where(ok, amax, torch.ones_like(amax))
    s = torch.where(ok, s, torch.ones_like(s))
    return torch.where(torch.isfinite(s), s, torch.full_like(s, torch.finfo(torch.float32).max))


def _qdq(x, scale, fp8_dtype):
    """Round x * scale to the FP8 format (saturating) and scale back, in float32."""
    m = FP8_MAX[fp8_dtype]
    q = (x.float() * scale).clamp(-m, m).to(fp8_dtype)
    return q.float() * (1.0 / scale)


def qdq_tensor(x, fp8_dtype):
    """Per-tensor current scaling of x (any shape), dequantized to float32."""
    return _qdq(x, _scale(x.detach().abs().amax(), fp8_dtype), fp8_dtype)


def qdq_rows(x, fp8_dtype):
    """x [M, K] in 1x128 blocks along K (K a multiple of 128)."""
    m, k = x.shape
    xb = x.float().reshape(m, k // BLOCK, BLOCK)
    s = _scale(xb.abs().amax(-1, keepdim=True), fp8_dtype)
    return _qdq(xb, s, fp8_dtype).reshape(m, k)


def qdq_cols(x, fp8_dtype):
    """x [M, K] in blocks of 128 along M (each column's 128-token runs; M
    padded with zeros to a multiple of 128 for the amax, as seqfuse's
    column-wise copy is)."""
    m, k = x.shape
    mp = -(-m // BLOCK) * BLOCK
    xp = torch.zeros(mp, k, dtype=torch.float32, device=x.device)
    xp[:m] = x.float()
    xb = xp.reshape(mp // BLOCK, BLOCK, k)
    s = _scale(xb.abs().amax(1, keepdim=True), fp8_dtype)
    return _qdq(xb, s, fp8_dtype).reshape(mp, k)[:m]


def qdq_tiles(w, fp8_dtype):
    """w [N, K] in 128x128 blocks (N and K multiples of 128)."""
    n, k = w.shape
    wb = w.float().reshape(n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    s = _scale(wb.abs().amax(dim=(1, 3), keepdim=True), fp8_dtype)
    return _qdq(wb, s, fp8_dtype).reshape(n, k)


class _Fp8Gemm(torch.autograd.Function):
    """y = x @ w^T with FP8 operands (see the module note); x [M, K], w [N, K]."""

    @staticmethod
    def forward(ctx, x, w, kind):
        if kind == "block":
            xq, wq = qdq_rows(x, FORWARD_FORMAT), qdq_tiles(w, FORWARD_FORMAT)
        else:
            xq, wq = qdq_tensor(x, FORWARD_FORMAT), qdq_tensor(w, FORWARD_FORMAT)
        ctx.kind, ctx.dtypes = kind, (x.dtype, w.dtype)
        # the weight gradient's copy of x: block scaling quantizes it again column-wise
        ctx.save_for_backward(qdq_cols(x, FORWARD_FORMAT) if kind == "block" else xq, wq)
        return (xq @ wq.t()).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x_w, wq = ctx.saved_tensors
        fmt = GRAD_FORMAT[ctx.kind]
        if ctx.kind == "block":
            dy_d, dy_w = qdq_rows(dy, fmt), qdq_cols(dy, fmt)
        else:
            dy_d = dy_w = qdq_tensor(dy, fmt)
        dx = (dy_d @ wq).to(ctx.dtypes[0])
        dw = (dy_w.t() @ x_w).to(ctx.dtypes[1])
        return dx, dw, None


def fp8_linear(x, w, kind):
    """F.linear(x, w) (no bias) with FP8 operands, x of any leading shape."""
    lead = x.shape[:-1]
    return _Fp8Gemm.apply(x.reshape(-1, x.shape[-1]), w, kind).reshape(*lead, w.shape[0])


class _Group:
    """Projections that seqfuse runs as one GEMM on the same input: the first
    call computes the fused product, the others take their slices."""

    def __init__(self, linears, fuse, split, kind):
        self.linears, self.fuse, self.split, self.kind = linears, fuse, split, kind
        self.pending = None  # (input, {index: output})

    def output(self, i, x):
        if self.pending is None or self.pending[0] is not x:
            w = self.fuse([lin.weight for lin in self.linears])
            y = fp8_linear(x, w, self.kind)
            self.pending = (x, dict(enumerate(self.split(y))))
        out = self.pending[1].pop(i)
        if not self.pending[1]:
            self.pending = None
        return out


class _Member(torch.nn.Module):
    """Stands in for one nn.Linear (no bias) of a group; keeps its weight."""

    def __init__(self, linear, group, index):
        super().__init__()
        if linear.bias is not None:
            raise ValueError("fp8_reference: Llama projections have no bias")
        self.weight = linear.weight
        self.group, self.index = group, index

    def forward(self, x):
        return self.group.output(self.index, x)


def emulate_fp8(model, kind):
    """Make transformers' LlamaForCausalLM ``model`` (in place) train with
    the emulated FP8 GEMMs of ``kind`` ("current" or "block") in every
    decoder layer; the embeddings and LM head stay unquantized, as in
    seqfuse's Llama.  Returns the model.  Parameters keep their names and
    objects, so its optimizer and state dict are unchanged."""
    if kind not in KINDS:
        raise ValueError(f"emulate_fp8: kind must be one of {KINDS}, got {kind!r}")
    cfg = model.config
    heads, groups = cfg.num_attention_heads, cfg.num_key_value_heads

    def fuse_attn(ws):
        return fuse_qkv(ws[0], ws[1], ws[2], heads, groups)

    def split_attn(y):
        lead = y.shape[:-1]
        q, k, v = split_qkv(y.reshape(-1, y.shape[-1]).t(), heads, groups)
        return [t.t().reshape(*lead, -1) for t in (q, k, v)]

    def cat(ws):
        return torch.cat(ws, 0)

    def halves(y):
        return list(y.chunk(2, dim=-1))

    def one(y):
        return [y]

    for layer in model.model.layers:
        att, mlp = layer.self_attn, layer.mlp
        for parent, names, fuse, split in ((att, ("q_proj", "k_proj", "v_proj"), fuse_attn, split_attn),
                                           (att, ("o_proj",), cat, one),
                                           (mlp, ("gate_proj", "up_proj"), cat, halves),
                                           (mlp, ("down_proj",), cat, one)):
            group = _Group([getattr(parent, n) for n in names], fuse, split, kind)
            for i, n in enumerate(names):
                setattr(parent, n, _Member(getattr(parent, n), group, i))
    return model
