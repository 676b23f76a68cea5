"""Rotary position embeddings (csrc/rope/): forward and backward on bshd, sbhd
and packed thd, half-split (GPT-NeoX / Llama / ESM) or interleaved (GPT-J)
pairs, with a rotary width that may be less than the head dimension.

``rope_parts`` takes the tensor in up to three parts along the heads (a
fused QKV projection's q, k and v) and turns only the leading heads.

These are the plain functional ops (no autograd); seqfuse.modules.rope wraps
them in an autograd Function and in Transformer Engine's
``apply_rotary_pos_emb`` / ``RotaryPositionEmbedding``.
"""
import torch

from .. import _C
from ._call import given_out, mark_written, stream_for
from .device_checks import check_cu_seqlens

_FORMATS = {"sbhd": 0, "bshd": 1, "thd": 2}
_FLOAT_INPUTS = (torch.float32, torch.float16, torch.bfloat16)


def _check(t, freqs, tensor_format, cu_seqlens, start_positions, op, name="t"):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: argument '{name}' must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOAT_INPUTS:
        raise TypeError(f"{op}: argument '{name}' must have dtype float32, float16 or bfloat16, got {t.dtype}")
    if not isinstance(freqs, torch.Tensor):
        raise TypeError(f"{op}: argument 'freqs' must be a torch.Tensor, got {type(freqs).__name__}")
    if tensor_format not in _FORMATS:
        raise ValueError(f"{op}: argument 'tensor_format' must be 'sbhd', 'bshd' or 'thd', got {tensor_format!r}")
    if tensor_format == "thd" and cu_seqlens is None:
        raise ValueError(f"{op}: argument 'cu_seqlens' is required for tensor_format 'thd'")
    if tensor_format != "thd" and cu_seqlens is not None:
        raise ValueError(f"{op}: argument 'cu_seqlens' is only valid for tensor_format 'thd'")
    for name, v in (("cu_seqlens", cu_seqlens), ("start_positions", start_positions)):
        if v is not None and (not isinstance(v, torch.Tensor) or v.dtype != torch.int32):
            got = v.dtype if isinstance(v, torch.Tensor) else type(v).__name__
            raise TypeError(f"{op}: argument '{name}' must be an int32 torch.Tensor, got {got}")


def _check_thd_lengths(op, t, freqs, tensor_format, cu_seqlens, start_positions):
    """A thd call's CUDA cu_seqlens values by C's CPU rules (start 0,
    non-decreasing, within ``t``'s tokens and freqs' positions): one host read
    per new cu_seqlens tensor, none under graph capture (ops/device_checks.py).
    Anything misshapen is left for C's error."""
    if tensor_format == "thd" and t.dim() == 3 and freqs.dim() == 4 and freqs.shape[0] > 0 and \
            cu_seqlens.device == t.device:
        limit = freqs.shape[0] if start_positions is None else None
        check_cu_seqlens(op, "cu_seqlens", cu_seqlens, extent=t.shape[0], max_len=limit,
                         max_what=f"the {limit} positions 'freqs' covers")


def _run(t, freqs, tensor_format, interleaved, cu_seqlens, start_positions, backward, out):
    op = "rope_backward" if backward else "rope"
    _check(t, freqs, tensor_format, cu_seqlens, start_positions, op)
    _check_thd_lengths(op, t, freqs, tensor_format, cu_seqlens, start_positions)
    if out is None:
        out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
        _C.rope(t.detach(), freqs.detach(), cu_seqlens, start_positions, _FORMATS[tensor_format],
                bool(interleaved), bool(backward), out, stream_for(t))
        return out
    y = given_out(op, out)
    _C.rope(t.detach(), freqs.detach(), cu_seqlens, start_positions, _FORMATS[tensor_format],
            bool(interleaved), bool(backward), y, stream_for(t))
    mark_written(y)
    return out


def rope_forward(t, freqs, tensor_format="sbhd", interleaved=False, cu_seqlens=None,
                 start_positions=None, out=None):
    """RoPE of ``t`` ([s, b, h, d] sbhd, [b, s, h, d] bshd or [T, h, d] thd)
    with angles ``freqs`` (float32 [s2, 1, 1, rot_dim], radians).  For thd,
    positions restart at each ``cu_seqlens`` (int32 [batch + 1]) boundary;
    ``start_positions`` (int32 [batch]) offsets each sequence.  ``t`` may have
    any strides (e.g. q/k views of a packed qkv); the result is a new
    contiguous tensor unless ``out`` is given (``out=t`` rotates in place)."""
    return _run(t, freqs, tensor_format, interleaved, cu_seqlens, start_positions, False, out)


def rope_backward(grad_out, freqs, tensor_format="sbhd", interleaved=False, cu_seqlens=None,
                  start_positions=None, out=None):
    """Gradient of :func:`rope_forward` with respect to ``t``, given the
    gradient of its output (same arguments)."""
    return _run(grad_out, freqs, tensor_format, interleaved, cu_seqlens, start_positions, True, out)


def rope_parts(parts, freqs, rotate_heads, out, tensor_format="bshd", interleaved=False, cu_seqlens=None,
               start_positions=None, backward=False):
    """RoPE (``backward``: its gradient) of a tensor given as one to three
    ``parts`` along the head dimension, written into ``out`` in one launch:
    out's heads are the parts' heads in order, its first ``rotate_heads``
    turned and the others copied unchanged.  Each part has out's dtype,
    token dimensions and head dim, with any strides; ``out`` meets no part
    (it may be the only part itself).  Messages name the parts 't', 't1'
    and 't2', as the C entry does.  What a fused QKV projection's RoPE
    needs: forward, its output [b, s, h + 2 kv, d] as the one part with
    ``rotate_heads`` h + kv (v copied into a tensor of its own); backward,
    dq, dk and dv written into the projection's output gradient.  Other
    arguments as :func:`rope_forward`'s, but ``tensor_format`` defaults to
    "bshd" here (the fused layers' layout).  Returns ``out``."""
    op = "rope_backward" if backward else "rope"
    if not isinstance(parts, (tuple, list)):
        raise TypeError(f"{op}: argument 'parts' must be a tuple of tensors, got {type(parts).__name__}")
    if not 1 <= len(parts) <= 3:
        raise ValueError(f"{op}: argument 'parts' must hold 1 to 3 tensors, got {len(parts)}")
    for name, t in zip(("t", "t1", "t2"), parts):
        _check(t, freqs, tensor_format, cu_seqlens, start_positions, op, name)
    if isinstance(rotate_heads, bool) or not isinstance(rotate_heads, int):
        raise TypeError(f"{op}: argument 'rotate_heads' must be an int, got {type(rotate_heads).__name__}")
    if isinstance(out, torch.Tensor):
        _check_thd_lengths(op, out, freqs, tensor_format, cu_seqlens, start_positions)
    y = given_out(op, out)
    t0, t1, t2 = (tuple(t.detach() for t in parts) + (None, None))[:3]
    _C.rope_parts(t0, t1, t2, rotate_heads, freqs.detach(), cu_seqlens, start_positions, _FORMATS[tensor_format],
                  bool(interleaved), bool(backward), y, stream_for(t0))
    mark_written(y)
    return out
