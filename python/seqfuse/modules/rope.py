"""Rotary position embeddings as Transformer Engine spells them:
``RotaryPositionEmbedding(dim, ...)`` makes the angle table ``freqs``
([max_seq_len, 1, 1, dim], float32) and ``apply_rotary_pos_emb(t, freqs,
tensor_format, ...)`` rotates q or k with it through seqfuse's fused kernel
(forward and backward, all three formats, packed thd with cu_seqlens).

Differences from TE, stated rather than hidden: ``fused`` is accepted and
ignored (the fused kernel is always used); context parallelism (``cp_size`` >
1) raises NotImplementedError.
"""
import logging
from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from ..ops import rope as _rope
from ..ops.tensor_cache import PerTensorCache
from ..distributed.split_batch import freqs_for_cp_rank

_log = logging.getLogger("seqfuse")


class FusedRoPEFunc(torch.autograd.Function):
    """Autograd Function over seqfuse.ops.rope_forward / rope_backward."""

    @staticmethod
    def forward(ctx, t, freqs, start_positions, tensor_format, interleaved, cu_seqlens):
        if freqs.dtype != torch.float32:
            freqs = freqs.float()
        out = _rope.rope_forward(t, freqs, tensor_format, interleaved, cu_seqlens, start_positions)
        ctx.save_for_backward(freqs, cu_seqlens, start_positions)
        ctx.tensor_format = tensor_format
        ctx.interleaved = interleaved
        return out

    @staticmethod
    def backward(ctx, grad_out):
        freqs, cu_seqlens, start_positions = ctx.saved_tensors
        grad = _rope.rope_backward(grad_out, freqs, ctx.tensor_format, ctx.interleaved,
                                   cu_seqlens, start_positions)
        return grad, None, None, None, None, None


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, tensor_format: str = "sbhd",
                         start_positions: Optional[torch.Tensor] = None, interleaved: bool = False,
                         fused: bool = True, cu_seqlens: Optional[torch.Tensor] = None,
                         cp_size: int = 1, cp_rank: int = 0) -> torch.Tensor:
    """Apply rotary position embedding ``freqs`` ([s2, 1, 1, rot_dim] float32)
    to ``t`` ([s, b, h, d] for 'sbhd', [b, s, h, d] for 'bshd', [T, h, d] for
    'thd' with ``cu_seqlens`` int32 [batch + 1]).  Elements past rot_dim pass
    through.  Same signature as transformer_engine.pytorch's."""
    for name, x in (("t", t), ("freqs", freqs)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"apply_rotary_pos_emb: argument '{name}' must be a torch.Tensor, "
                            f"got {type(x).__name__}")
    if cp_size != 1 or cp_rank != 0:
        # context parallelism: ``freqs`` covers the full sequence and ``t`` holds this rank's chunks
        # (seqfuse.distributed's load-balanced split); each local token turns by its full-sequence position
        if start_positions is not None:
            raise NotImplementedError("apply_rotary_pos_emb: start_positions with context parallelism "
                                      "(cp_size > 1) is not supported")
        if tensor_format == "thd":  # one angle row per local packed token: rotate [t, 1, h, d] as sbhd
            # the rows follow from cu_seqlens read on the host: kept per (freqs, cu_seqlens) tensor pair,
            # so a model's layers (q and k of each) read them once per batch
            local = _thd_cp_rows((freqs, cu_seqlens), cp_size, cp_rank)
            return FusedRoPEFunc.apply(t.unsqueeze(1), local, None, "sbhd", interleaved, None).squeeze(1)
        seq = t.shape[1 if tensor_format == "bshd" else 0] * cp_size
        local = freqs_for_cp_rank(freqs, cp_size, cp_rank, seq_len=seq)
        return FusedRoPEFunc.apply(t, local, None, tensor_format, interleaved, None)
    return FusedRoPEFunc.apply(t, freqs, start_positions, tensor_format, interleaved, cu_seqlens)


_thd_cp_rows = PerTensorCache(lambda ts, cp_size, cp_rank: freqs_for_cp_rank(ts[0], cp_size, cp_rank, ts[1]))


def _as_words(t):
    """``t``'s bytes as int64 words along its last dimension, or None where
    its layout does not allow it (that dimension not contiguous, or a
    stride, the offset, the row's length or the address not a whole number
    of words)."""
    if t.data_ptr() % 8:
        return None
    try:
        return t.view(torch.int64)
    except RuntimeError:
        return None


_logged_element_copy = []


def _copy_rows(dst, src):
    """``dst.copy_(src)`` (one shape and dtype, rows along the last
    dimension) moving 8-byte words where both layouts allow: the same bytes.
    Torch's copy between strided 2-byte tensors loads two bytes at a time,
    a third of the copy rate (8.2 us a call for the 4 MB of Llama 1B's value
    heads at 4,096 tokens on an H100); otherwise element by element, said
    once in the log.  split_qkv_rope's path where ONE_LAUNCH is off, or a
    backward that gets fewer than three gradients.  Returns ``dst``."""
    same = dst.dtype == src.dtype and dst.shape == src.shape
    wd, ws = (_as_words(dst), _as_words(src)) if same else (None, None)
    if wd is not None and ws is not None:
        wd.copy_(ws)
        return dst
    if not _logged_element_copy:
        _logged_element_copy.append(True)
        _log.info("seqfuse split_qkv_rope: the value heads are copied element by element (a layout without "
                  "whole 8-byte words: strides %s and %s)", tuple(dst.stride()), tuple(src.stride()))
    return dst.copy_(src)


#: split_qkv_rope where a backward follows: q and k turned and v copied into one new tensor in one launch,
#: and the three gradients written into mixed's in one (ops.rope.rope_parts); False: q and k turned in one
#: launch and v copied in another, the gradients in three (benchmarks/hf/fusion_ab.py --switch qkv_one_launch).
ONE_LAUNCH = True


class _SplitQkvRoPE(torch.autograd.Function):
    """split_qkv_rope's autograd: q and k turned (and v copied) in one
    launch, the three gradients written into one [b, s, width] tensor."""

    @staticmethod
    def forward(ctx, mixed, freqs, heads, kv_heads, head_dim, copy_v):
        ctx.set_materialize_grads(False)  # an output without a gradient arrives as None: no rotation of zeros
        b, s, width = mixed.shape
        qk_heads = heads + kv_heads
        if freqs.dtype != torch.float32:
            freqs = freqs.float()
        ctx.save_for_backward(freqs)
        ctx.dims = (b, s, heads, kv_heads, head_dim)
        if copy_v and ONE_LAUNCH:  # q and k turned, v copied, into one new tensor: one launch
            qkv = torch.empty(b, s, qk_heads + kv_heads, head_dim, dtype=mixed.dtype, device=mixed.device)
            _rope.rope_parts((mixed.view(b, s, qk_heads + kv_heads, head_dim),), freqs, qk_heads, qkv)
            return qkv[:, :, :heads], qkv[:, :, heads:qk_heads], qkv[:, :, qk_heads:]
        # q and k are neighbours in each token's row: one strided view, one launch
        qk = _rope.rope_forward(mixed[..., :qk_heads * head_dim].view(b, s, qk_heads, head_dim), freqs, "bshd")
        v = mixed[..., qk_heads * head_dim:].view(b, s, kv_heads, head_dim)
        if copy_v:  # (what the attention saves of v then keeps none of mixed: split_qkv_rope)
            v = _copy_rows(torch.empty(v.shape, dtype=v.dtype, device=v.device), v)
        return qk[:, :, :heads], qk[:, :, heads:], v

    @staticmethod
    @once_differentiable
    def backward(ctx, dq, dk, dv):
        (freqs,) = ctx.saved_tensors
        b, s, heads, kv_heads, head_dim = ctx.dims
        parts = ((dq, heads), (dk, kv_heads), (dv, kv_heads))
        like = next(g for g, _ in parts if g is not None)
        dmixed = torch.empty(b, s, (heads + 2 * kv_heads) * head_dim, dtype=like.dtype, device=like.device)
        if ONE_LAUNCH and all(g is not None and g.dtype == like.dtype for g, _ in parts):
            _rope.rope_parts((dq, dk, dv), freqs, heads + kv_heads, dmixed.view(b, s, -1, head_dim), backward=True)
            return dmixed, None, None, None, None, None
        col = 0
        for i, (g, n) in enumerate(parts):
            dst = dmixed[..., col:col + n * head_dim].view(b, s, n, head_dim)
            col += n * head_dim
            if g is None:
                dst.zero_()
            elif i < 2:  # the rotation's transpose, written where mixed's q / k columns are
                _rope.rope_backward(g, freqs, "bshd", out=dst)
            else:
                _copy_rows(dst, g)
        return dmixed, None, None, None, None, None


def split_qkv_rope(mixed: torch.Tensor, freqs: torch.Tensor, heads: int, kv_heads: int,
                   head_dim: int):
    """(q, k, v) of a fused QKV projection's output ``mixed`` [b, s,
    (heads + 2 kv_heads) head_dim] (q's heads, then k's, then v's, as
    accelerate()'s fused layers and transformers' q/k/v concatenation lay
    them out), q and k turned by ``freqs`` ([s, 1, 1, rot_dim] float32, bshd
    positions 0..s-1 as apply_rotary_pos_emb takes them).  What
    torch.split + apply_rotary_pos_emb on q and on k compute, in one RoPE
    launch forward (q and k are neighbours in each token's row) and with the
    gradients written straight into mixed's gradient (no concatenation).
    Where a backward follows (grad mode on, ``mixed`` requiring grad) q, k
    and v are views of one new [b, s, heads + 2 kv_heads, head_dim] tensor,
    v a copy of mixed's v columns made by the same launch, so what the
    attention keeps for its backward holds none of ``mixed``, which is freed
    after the forward (a view would keep all of it: at the Llama 1B shape
    and 4,096 tokens 20 MiB of q and k columns a layer beside the rotated
    ones), and the backward writes the three gradients into mixed's in one
    launch; else q and k are views of one [b, s, heads + kv_heads, head_dim]
    tensor and v a view of ``mixed`` (no copy).  Autograd refuses
    in-place changes to the outputs that are views made inside the Function
    (q, k, and v too where a backward follows), and a cache that keeps k
    keeps the whole tensor it views (with the backward, q and v too).  The
    backward is not differentiable again (create_graph)."""
    if mixed.dim() != 3 or mixed.shape[-1] != (heads + 2 * kv_heads) * head_dim:
        raise ValueError(f"split_qkv_rope: argument 'mixed' must be [b, s, (heads + 2 * kv_heads) * head_dim] = "
                         f"[b, s, {(heads + 2 * kv_heads) * head_dim}], got {tuple(mixed.shape)}")
    copy_v = torch.is_grad_enabled() and mixed.requires_grad
    return _SplitQkvRoPE.apply(mixed, freqs, heads, kv_heads, head_dim, copy_v)


class RotaryPositionEmbedding(torch.nn.Module):
    """The angle table of rotary position embeddings (https://arxiv.org/abs/2104.09864),
    as Transformer Engine's module of the same name makes it.

    ``forward(max_seq_len, offset=0)`` returns float32 [max_seq_len, 1, 1, dim']
    with dim' = int(dim * rotary_percent): position p times inv_freq, each
    frequency repeated for both members of its pair (halves concatenated, or
    neighbours when ``interleaved``)."""

    def __init__(self, dim: int, rotary_percent: float = 1.0,
                 seq_len_interpolation_factor: Optional[int] = None,
                 pretrained_max_position_embeddings: Optional[int] = None,
                 rotary_base: float = 10000.0, interleaved: bool = False, device=None):
        super().__init__()
        if rotary_percent < 1.0:
            dim = int(dim * rotary_percent)
        if dim <= 0 or dim % 2:
            raise ValueError(f"RotaryPositionEmbedding: rotary dim must be even and positive, got {dim}")
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        self.pretrained_max_position_embeddings = pretrained_max_position_embeddings
        self.rotary_base = rotary_base
        self.interleaved = interleaved
        if device is None:
            device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        inv_freq = 1.0 / (rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
        self.register_buffer("inv_freq", inv_freq)

    def forward(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        seq = torch.arange(max_seq_len, device=self.inv_freq.device, dtype=self.inv_freq.dtype) + offset
        if self.pretrained_max_position_embeddings is not None and self.seq_len_interpolation_factor is not None:
            if max_seq_len > self.pretrained_max_position_embeddings * self.seq_len_interpolation_factor:
                seq *= 1 / (max_seq_len / self.pretrained_max_position_embeddings)
            else:
                seq *= 1 / self.seq_len_interpolation_factor
        freqs = torch.outer(seq, self.inv_freq)
        if self.interleaved:
            emb = freqs.repeat_interleave(2, dim=-1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb.reshape(emb.size(0), 1, 1, emb.size(1))
