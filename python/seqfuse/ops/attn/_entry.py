"""The attention calls: ``attention`` (autograd-aware, routed by the
backend choice in _routing.py) and its two halves ``attention_forward`` and
``attention_backward``, which always run seqfuse's kernels and pass the forward's
log-sum-exp to the backward.  Each checks its tensors, builds the C config
(_args.py), draws the dropout state when needed (_dropout.py) and calls
seqfuse._C with destination tensors allocated by torch.
"""
import torch

from ... import _C
from .._call import given_out, mark_written, stream_for
from ._args import (MASKS, PADDING, check_cu_kind, check_cu_values, check_head_dim, check_tensor, config,
                    kernel_layout, max_seqlen)
from ._dropout import dropout_rng_state, wants_rng
from ._routing import note_backward_kernel, note_forward_kernel, routed_attention_or_none


def _lse_shape(q, qkv_format, cfg):
    if qkv_format == "thd":
        return (q.shape[1], q.shape[0])
    b = q.shape[0] if qkv_format == "bshd" else q.shape[1]
    return (b, q.shape[-2], cfg[5])


def attention_forward(q, k, v, *, qkv_format="bshd", attn_mask_type="no_mask", cu_seqlens_q=None,
                  cu_seqlens_kv=None, max_seqlen_q=None, max_seqlen_kv=None, window_size=None,
                  softmax_scale=None, dropout_p=0.0, rng_state=None, out=None, lse=None):
    """Forward only: returns (out, lse).  out has q's shape and dtype; lse is
    float32 [b, h, s_q] (bshd/sbhd) or [h, t] (thd), +inf on rows that see
    no key (the undropped log-sum-exp).  With ``dropout_p`` > 0 the mask comes
    from ``rng_state`` = (seed, offset), drawn by :func:`dropout_rng_state`
    when None (pass the same pair to :func:`attention_backward`).
    ``out``/``lse`` may be given to write into.  Always seqfuse's kernels
    (the backend choice applies to ``attention`` only)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, x)
    q, k, v = (kernel_layout(x.detach()) for x in (q, k, v))
    if rng_state is None and wants_rng(dropout_p):
        rng_state = dropout_rng_state(q, qkv_format, cu_seqlens_q)
    cfg, cu_q, cu_k = config(q, k, qkv_format, attn_mask_type, cu_seqlens_q, cu_seqlens_kv,
                              max_seqlen_q, max_seqlen_kv, window_size, softmax_scale, False,
                              dropout_p, rng_state, op="attention_forward")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty(_lse_shape(q, qkv_format, cfg), dtype=torch.float32, device=q.device)
    if q.is_cuda:
        note_forward_kernel(q, cfg[8] > 0.0)
    _C.attn_forward(q, k, v, cu_q, cu_k, out, lse, cfg, stream_for(q))
    return out, lse


def attention_backward(dout, q, k, v, out, lse, *, qkv_format="bshd", attn_mask_type="no_mask",
                  cu_seqlens_q=None, cu_seqlens_kv=None, max_seqlen_q=None, max_seqlen_kv=None,
                  window_size=None, softmax_scale=None, deterministic=False, dropout_p=0.0,
                  rng_state=None, dq=None, dk=None, dv=None):
    """Backward: returns (dq, dk, dv) in the shapes of q, k, v (given
    tensors are written into).  With ``deterministic`` the CUDA kernel
    computes dQ without atomics (bitwise reproducible, about 40 % more
    backward math).  With ``dropout_p`` > 0, ``rng_state`` must be the
    forward's (seed, offset).  Always seqfuse's kernels (the backend choice
    applies to ``attention`` only)."""
    op = "attention_backward"
    for name, x in (("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse)):
        check_tensor(name, x)
    if rng_state is None and wants_rng(dropout_p):
        raise ValueError("attention_backward: dropout_p > 0 needs the forward's rng_state (seed, offset)")
    dout, q, k, v, out = (kernel_layout(x.detach()) for x in (dout, q, k, v, out))
    cfg, cu_q, cu_k = config(q, k, qkv_format, attn_mask_type, cu_seqlens_q, cu_seqlens_kv,
                              max_seqlen_q, max_seqlen_kv, window_size, softmax_scale, deterministic,
                              dropout_p, rng_state, op="attention_backward")
    given = (dq, dk, dv)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device) if dq is None else given_out(op, dq, "dq")
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device) if dk is None else given_out(op, dk, "dk")
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device) if dv is None else given_out(op, dv, "dv")
    dq_accum = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    delta = torch.empty(lse.shape, dtype=torch.float32, device=q.device)
    if q.is_cuda:
        note_backward_kernel(q, deterministic, cfg[8] > 0.0)
    _C.attn_backward(q, k, v, out, dout, lse, cu_q, cu_k, dq, dk, dv, dq_accum, delta, cfg, stream_for(q))
    if given != (None, None, None):  # the caller's tensors, marked written (ops._call.given_out)
        mark_written(*(t for t, g in zip((dq, dk, dv), given) if g is not None))
        return tuple(t if g is None else g for t, g in zip((dq, dk, dv), given))
    return dq, dk, dv



class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_kv, opts, deterministic):
        # opts carries dropout_p and the call's rng_state (drawn by attention()),
        # so the backward regenerates the forward's mask
        out, lse = attention_forward(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv, **opts)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_kv)
        ctx.opts, ctx.deterministic = opts, deterministic
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        dq, dk, dv = attention_backward(dout, q, k, v, out, lse, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k,
                                   deterministic=ctx.deterministic, **ctx.opts)
        return dq, dk, dv, None, None, None, None


def attention(q, k, v, *, qkv_format="bshd", attn_mask_type="no_mask", cu_seqlens_q=None,
              cu_seqlens_kv=None, max_seqlen_q=None, max_seqlen_kv=None, window_size=None,
              softmax_scale=None, deterministic=False, dropout_p=0.0, rng_state=None):
    """Fused attention with autograd: returns out (q's shape and dtype).
    ``dropout_p``: attention dropout (the caller decides training vs eval);
    ``rng_state``: its (seed, offset), drawn from torch's generator when None.
    Runs seqfuse's kernels or one of torch's fused kernels (cuDNN through
    SDPA, FlashAttention-2, or SDPA in float32 on CUDA), as the backend
    choice says (_routing.py, ``attention_backend``).  On a torch route
    dropout draws torch's mask, not seqfuse's Philox mask (_torch_routes.py);
    an explicit ``rng_state`` keeps the call on seqfuse's kernels."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, x)
    check_head_dim("attention", q, k)
    if qkv_format == "thd" or (isinstance(attn_mask_type, str) and MASKS.get(attn_mask_type) in PADDING):
        check_cu_kind("attention", "cu_seqlens_q", cu_seqlens_q)
        check_cu_kind("attention", "cu_seqlens_kv", cu_seqlens_kv)
        # before any route: the torch routes would clamp bad CUDA cu_seqlens as silently as the kernels
        check_cu_values("attention", q, k, qkv_format, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv)
    out = routed_attention_or_none(q, k, v, qkv_format, attn_mask_type, window_size, dropout_p, deterministic,
                                   cu_seqlens_q, cu_seqlens_kv, softmax_scale, max_seqlen_q, max_seqlen_kv,
                                   rng_state)
    if out is not None:
        return out
    if rng_state is None and wants_rng(dropout_p):
        rng_state = dropout_rng_state(q, qkv_format, cu_seqlens_q)
    if qkv_format == "thd" and cu_seqlens_q is not None and cu_seqlens_kv is not None:
        # resolve the max lengths once so forward and backward agree without a second sync
        max_seqlen_q = max_seqlen(cu_seqlens_q, max_seqlen_q, "max_seqlen_q")
        max_seqlen_kv = max_seqlen(cu_seqlens_kv, max_seqlen_kv, "max_seqlen_kv")
    opts = dict(qkv_format=qkv_format, attn_mask_type=attn_mask_type, max_seqlen_q=max_seqlen_q,
                max_seqlen_kv=max_seqlen_kv, window_size=window_size, softmax_scale=softmax_scale,
                dropout_p=dropout_p, rng_state=rng_state)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _Attention.apply(q, k, v, cu_seqlens_q, cu_seqlens_kv, opts, bool(deterministic))
    return attention_forward(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv, **opts)[0]
