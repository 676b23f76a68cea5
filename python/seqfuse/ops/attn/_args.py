"""Argument checks shared by the attention calls and the backend choice,
and the config tuple the C entries take (csrc/python/attn_py.c).

``FORMATS`` and ``MASKS`` map Transformer Engine's spellings to the C codes;
``config`` checks one call's layout, mask, window, lengths, scale and dropout
and returns them as the C config.  Errors name the argument, as the C checks do.
"""
import math

import torch

from .._call import as_float, as_int
from ..device_checks import check_cu_seqlens
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


def check_cu_kind(op, name, cu):
    """The rules of a given cu_seqlens the Python side needs before it
    reads one (its max length, the routes' checks): a torch.Tensor
    (TypeError), 1-D (ValueError, C's wording) and not on the meta device,
    which holds no values to read (ValueError).  Its dtype, length, device
    and values are the C entry's and check_cu_values' (None passes: the
    callers say when one is needed)."""
    if cu is None:
        return
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{op}: argument '{name}' must be an int32 torch.Tensor [b+1] (cumulative sequence "
                        f"lengths), got {type(cu).__name__}")
    if cu.dim() != 1:
        raise ValueError(f"{op}: argument '{name}' must be 1-D [b+1], got {cu.dim()} dimensions")
    if cu.device.type == "meta":
        raise ValueError(f"{op}: argument '{name}' is on the meta device, which holds no values (the sequence "
                         "lengths are read); pass it on q's device")


def max_seqlen(cu, given, name):
    if given is not None:
        return as_int("attention", name, given, 0)
    if cu.numel() < 2:
        return 0
    return int((cu[1:] - cu[:-1]).max().item())  # one host sync, as TE does



def check_cu_values(op, q, k, qkv_format, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q=None, max_seqlen_kv=None):
    """The values of CUDA cu_seqlens, by the C entry's rules (which read them
    only on the CPU): start at 0, non-decreasing, no sequence longer than the
    max length, and in thd no end past the tokens of q / k.  One host read
    per new cu_seqlens tensor, none under CUDA graph capture (ops/device_checks.py)."""
    thd = qkv_format == "thd"
    s_dim = 1 if qkv_format == "bshd" else 0
    for name, cu, x, given in (("cu_seqlens_q", cu_seqlens_q, q, max_seqlen_q),
                               ("cu_seqlens_kv", cu_seqlens_kv, k, max_seqlen_kv)):
        if not isinstance(x, torch.Tensor) or x.dim() != (3 if thd else 4) or not isinstance(cu, torch.Tensor) or \
                cu.device != x.device:
            continue  # C reports a missing, misshapen or misplaced tensor first
        if thd:  # a max_seqlen that is not a plain int is left to max_seqlen()'s check
            extent, max_len = x.shape[0], given if isinstance(given, int) and not isinstance(given, bool) else None
        else:
            extent, max_len = None, x.shape[s_dim]
        check_cu_seqlens(op, name, cu, extent, max_len)


def kernel_layout(x):
    """x as the fused attention kernels read it, or a contiguous copy of it
    (made once, here, and differentiable): unit stride in the head dim and,
    on CUDA, a 16-byte aligned start and every other stride a multiple of 8
    elements (16-byte rows in 16-bit types).  seqfuse's kernels load 16-byte
    vectors (C refuses anything else), and so do torch's cuDNN and
    FlashAttention kernels that the torch routes run.  Issue 23's corpus on
    an H200 (torch 2.11) got wrong values (max error 2), not an error, for q
    or k at a 2-byte storage offset or with 19-element rows on calls the
    cuDNN route takes, which handed them to SDPA as they were; seqfuse's
    route already copied them.  Every route takes its q, k, v through here."""
    if x.stride(-1) != 1 and x.shape[-1] > 1:
        return x.contiguous()
    if x.is_cuda and (x.data_ptr() % 16 or any(st % 8 for st, n in zip(x.stride()[:-1], x.shape[:-1]) if n > 1)):
        # a fresh allocation: contiguous() returns a contiguous view as it is, misaligned start included
        # (the H200 run that found this: torch's kernels faulted with a misaligned address)
        return x.clone(memory_format=torch.contiguous_format)
    return x


def refusal(rule, why):
    """A route's answer to a call that breaks one of its rules: (rule, "rule: why").
    Every route's eligibility check answers ("", "") when the call may run."""
    return rule, f"{rule}: {why}"


def kernel_refusal(kernel, deterministic, deterministic_algorithms, dtype, heads_q, heads_kv, head_dim, *,
                   dtypes, max_head_dim, deterministic_why, algorithms_why="", grouped_query_why=None):
    """The rules the fused-attention libraries behind the torch routes (cuDNN,
    FlashAttention: ``kernel`` names it in the reasons) share, checked in this
    order: ``deterministic`` (``deterministic_why`` says why the route refuses
    it), ``deterministic`` again for torch.use_deterministic_algorithms(True)
    (``algorithms_why``: what torch does then, if anything), ``dtype`` (one of
    ``dtypes``), ``gqa`` (q heads a multiple of the k/v heads; and where
    ``grouped_query_why`` is given, why this kernel refuses grouped-query
    attention, equal head counts only) and ``head_dim`` (a multiple of 8, at
    most ``max_head_dim``).  The first broken rule's ``refusal``, or None
    when all hold."""
    if deterministic:
        return refusal("deterministic", f"deterministic=True ({deterministic_why})")
    if deterministic_algorithms:
        note = f" ({algorithms_why})" if algorithms_why else ""
        return refusal("deterministic", f"torch.use_deterministic_algorithms(True){note}")
    if dtype not in dtypes:
        return refusal("dtype", f"dtype {dtype} ({kernel} takes float16 and bfloat16)")
    if heads_kv < 1 or heads_q % heads_kv:
        return refusal("gqa", f"{heads_q} q heads are not a multiple of {heads_kv} k/v heads")
    if grouped_query_why and heads_q != heads_kv:
        return refusal("gqa", grouped_query_why)
    if head_dim % 8 or not 0 < head_dim <= max_head_dim:
        return refusal("head_dim", f"head dim {head_dim} ({kernel}: a multiple of 8, at most {max_head_dim})")
    return None


def capability_refusal(capability, wanted, why):
    """The ``capability`` rule of a route that auto-selection takes only on one
    GPU generation: its refusal (``why`` ends the reason) when ``capability``
    ((major, minor) or None: unknown) is not ``wanted``, else None."""
    if tuple(capability or ()) == wanted:
        return None
    cap = "unknown" if capability is None else "%d.%d" % tuple(capability)
    return refusal("capability", f"compute capability {cap} ({why})")


def check_tensor(name, x):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"attention: argument '{name}' must be a torch.Tensor, got {type(x).__name__}")
    if name != "lse" and x.dim() < 3:  # (lse is [h, t] in thd; C checks its shape)
        raise ValueError(f"attention: argument '{name}' must be 3-D (thd) or 4-D (bshd, sbhd), got "
                         f"shape {tuple(x.shape)}")


def check_head_dim(op, q, k):
    """q's and k's head dimension (the last) must be at least 1: the default
    softmax scale is 1 / sqrt of it, and no kernel takes an empty head."""
    for name, x in (("q", q), ("k", k)):
        if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[-1] < 1:
            raise ValueError(f"{op}: argument '{name}' has head dim {x.shape[-1]} (its last dimension); the head "
                             "dim must be at least 1")


def config(q, k, qkv_format, attn_mask_type, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q,
           max_seqlen_kv, window_size, softmax_scale, deterministic, dropout_p=0.0, rng_state=None,
           op="attention"):
    if qkv_format not in FORMATS:
        raise ValueError(f"attention: qkv_format must be 'bshd', 'sbhd' or 'thd', got {qkv_format!r}")
    mask = mask_code(attn_mask_type, qkv_format)
    left, right = window_pair(window_size)
    check_head_dim(op, q, k)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    if qkv_format == "thd" or mask in PADDING:
        check_cu_kind(op, "cu_seqlens_q", cu_seqlens_q)
        check_cu_kind(op, "cu_seqlens_kv", cu_seqlens_kv)
    if qkv_format == "thd":
        if cu_seqlens_q is None or cu_seqlens_kv is None:
            raise ValueError("attention: qkv_format 'thd' needs cu_seqlens_q and cu_seqlens_kv")
        for name, given in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_kv", max_seqlen_kv)):
            if given is not None:  # its own rule first: the cu_seqlens check below measures against it
                as_int("attention", name, given, 0)
        check_cu_values(op, q, k, qkv_format, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv)
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
        else:
            check_cu_values(op, q, k, qkv_format, cu_seqlens_q, cu_seqlens_kv)
    cfg = (FORMATS[qkv_format], mask, left, right, as_float("attention", "softmax_scale", softmax_scale), msq, msk,
           int(bool(deterministic))) + rng_cfg(dropout_p, rng_state)
    return cfg, cu_seqlens_q, cu_seqlens_kv
