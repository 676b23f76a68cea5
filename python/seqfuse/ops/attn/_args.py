"""Argument checks shared by the attention calls and the backend choice,
and the config tuple the C entries take (csrc/python/attn_py.c).

``FORMATS`` and ``MASKS`` map Transformer Engine's spellings to the C codes;
``config`` checks one call's layout, mask, window, lengths, scale and dropout
and returns them as the C config.  Errors name the argument, as the C checks do.
"""
import math

import torch

from .._call import as_float, as_int
from ._dropout import rng_cfg

FORMATS = {"bshd": 0, "sbhd": 1, "thd": 2}
MASKS = {
    "no_mask": 0,
    "padding": 1,
    "causal": 2,
    "padding_causal": 3,
    "padding,causal": 3,
    "causal,padding": 3,
    "causal_bottom_right": 4,
    "padding_causal_bottom_right": 5,
}
PADDING = {1, 3, 5}


def mask_code(attn_mask_type, qkv_format):
    if attn_mask_type not in MASKS:
        raise ValueError(f"attention: attn_mask_type must be one of {sorted(MASKS)}, got {attn_mask_type!r}")
    code = MASKS[attn_mask_type]
    if qkv_format == "thd" and code not in PADDING:
        code = {0: 1, 2: 3, 4: 5}[code]  # packed sequences are always delimited
    return code


def window_pair(window_size):
    if window_size is None:
        return -1, -1
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise ValueError(f"attention: window_size must be (left, right), got {window_size!r}")
    left, right = (as_int("attention", "window_size", w) for w in window_size)
    if left < -1 or right < -1:
        raise ValueError(f"attention: window_size entries must be -1 or >= 0, got {window_size!r}")
    return left, right


def max_seqlen(cu, given, name):
    if given is not None:
        return as_int("attention", name, given, 0)
    if cu.numel() < 2:
        return 0
    return int((cu[1:] - cu[:-1]).max().item())  # one host sync, as TE does



def check_tensor(name, x):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"attention: argument '{name}' must be a torch.Tensor, got {type(x).__name__}")
    if name != "lse" and x.dim() < 3:  # (lse is [h, t] in thd; C checks its shape)
        raise ValueError(f"attention: argument '{name}' must be 3-D (thd) or 4-D (bshd, sbhd), got "
                         f"shape {tuple(x.shape)}")


def config(q, k, qkv_format, attn_mask_type, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q,
           max_seqlen_kv, window_size, softmax_scale, deterministic, dropout_p=0.0, rng_state=None):
    if qkv_format not in FORMATS:
        raise ValueError(f"attention: qkv_format must be 'bshd', 'sbhd' or 'thd', got {qkv_format!r}")
    mask = mask_code(attn_mask_type, qkv_format)
    left, right = window_pair(window_size)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    if qkv_format == "thd":
        if cu_seqlens_q is None or cu_seqlens_kv is None:
            raise ValueError("attention: qkv_format 'thd' needs cu_seqlens_q and cu_seqlens_kv")
        msq = max_seqlen(cu_seqlens_q, max_seqlen_q, "max_seqlen_q")
        msk = max_seqlen(cu_seqlens_kv, max_seqlen_kv, "max_seqlen_kv")
    else:
        s_dim = 1 if qkv_format == "bshd" else 0
        msq, msk = q.shape[s_dim], k.shape[s_dim]
        if mask not in PADDING:
            cu_seqlens_q = cu_seqlens_kv = None  # full rows: lengths not needed
        elif cu_seqlens_q is None or cu_seqlens_kv is None:
            raise ValueError(f"attention: attn_mask_type {attn_mask_type!r} in {qkv_format} needs "
                             "cu_seqlens_q and cu_seqlens_kv (or an attention_mask in the module)")
    cfg = (FORMATS[qkv_format], mask, left, right, as_float("attention", "softmax_scale", softmax_scale), msq, msk,
           int(bool(deterministic))) + rng_cfg(dropout_p, rng_state)
    return cfg, cu_seqlens_q, cu_seqlens_kv
