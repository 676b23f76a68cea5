"""Padding masks for the fused kernel: ``padding_layout`` turns a bool
keep-mask [b, s] (True = token) into cu_seqlens and a qkv_format the kernel
runs exactly; callers keep the result per mask tensor with
seqfuse.ops.tensor_cache.PerTensorCache so a model's layers compute it once.
Shared by seqfuse.modules' DotProductAttention and seqfuse.hf's attention.
"""
from typing import NamedTuple

import torch

from .. import device_checks


class PaddingLayout(NamedTuple):
    """How a padded batch runs in the kernel (see ``padding_layout``)."""
    qkv_format: str       # "bshd": every row right-padded, the kernel's padded layout; "thd": rows end to end
    cu_seqlens_q: torch.Tensor
    max_seqlen_q: int
    cu_seqlens_kv: torch.Tensor
    max_seqlen_kv: int
    poison: object        # None, or float32 [b]: 0, NaN for a row that breaks the rule (CUDA graph capture)
    padded: object        # whether any position is padding (None: not read, under CUDA graph capture)


def _runs(keep):
    """(first, length, bad) of a bool [b, s] keep-mask: each row's first
    token (0 when it has none), its number of tokens, and where the row
    differs from the one run [first, first + length) (bool [b, s])."""
    length = keep.sum(1, dtype=torch.int32)
    first = torch.where(length > 0, keep.to(torch.int32).argmax(1).to(torch.int32), 0)
    ar = torch.arange(keep.shape[1], device=keep.device, dtype=torch.int32)
    run = (ar >= first[:, None]) & (ar < (first + length)[:, None])
    return first, length, run != keep


def padding_layout(keep_kv, keep_q=None, s_q=None, *, who="attention", names=("attention_mask",) * 2,
                   hole_error=ValueError):
    """The layout of a key-padded batch for the fused kernel, exact for any
    padding where each row is ONE run of tokens: right padding (tokens
    then padding), left padding (padding then tokens), or both.

    ``keep_kv``: bool [b, s_kv], True = token (a real key).  ``keep_q``: bool
    [b, s_q] for the queries, or None: the queries are the last ``s_q``
    (default s_kv) key positions (self-attention; s_q < s_kv is a key cache).
    Causal masks align within each row's runs of tokens (top-left: first
    query with first key; bottom-right: last with last), as for cu_seqlens.

    Every row right-padded: "bshd" with the rows' lengths as cu_seqlens (the
    kernel's padded layout).  Otherwise "thd" over the rows laid end to end
    (the caller views q [b, s_q, h, d] as [b * s_q, h, d], k and v alike):
    each row becomes five sequences with separate q and kv extents, (leading
    query padding, no keys), (no queries, leading key padding), (query
    tokens, key tokens), (trailing query padding, no keys), (no queries,
    trailing key padding), so tokens see only tokens and a padding position
    sees no key: its output (and every gradient through it) is 0, as the
    padded layout's padding rows, and a row without tokens is all 0 (torch's
    SDPA gives NaN there).

    A row that is not one run (a hole) raises ``hole_error`` naming
    ``names`` (q's, kv's), the row and the position.  Cost: the lengths,
    offsets and the check run on the mask's device; their few numbers come
    back in ONE host read (a sync on CUDA; on an H200, 16 x 1024 mask: about
    0.45 ms of host time, small kernels and the read; a cache hit in
    DotProductAttention about 5 us).  Callers cache the result per mask
    tensor (``PerTensorCache``) so a model's layers read it once.
    Under CUDA graph capture nothing is read: the layout is "thd" with the
    padded lengths as the max lengths (exact for every one-run row) and
    ``poison`` is NaN for rows with a hole (the caller adds it to the
    output: such a row comes out NaN, never silently wrong)."""
    b, s_kv = keep_kv.shape
    dev = keep_kv.device
    first_k, len_k, bad_k = _runs(keep_kv)
    s_q = s_kv if keep_q is None and s_q is None else s_q
    same = keep_q is None and s_q == s_kv  # self-attention: the queries' runs are the keys'
    if same:
        first_q, len_q, bad_q = first_k, len_k, None
    elif keep_q is None:
        shift = s_kv - s_q
        first_q = (first_k - shift).clamp(0, s_q)
        len_q = (first_k + len_k - shift).clamp(0, s_q) - first_q
        bad_q = None
    else:
        s_q = keep_q.shape[1]
        first_q, len_q, bad_q = _runs(keep_q)
    row = torch.arange(b, device=dev, dtype=torch.int32)[:, None]
    end_q, end_k = first_q + len_q, first_k + len_k
    fq, fk = first_q[:, None], first_k[:, None]
    zero = torch.zeros(1, dtype=torch.int32, device=dev)
    k_ends = torch.cat((torch.zeros_like(fk), fk, end_k[:, None], end_k[:, None], torch.full_like(fk, s_kv)), 1)
    cu_k = torch.cat((zero, (k_ends + row * s_kv).flatten()))
    q_ends = torch.cat((fq, fq, end_q[:, None], torch.full_like(fq, s_q), torch.full_like(fq, s_q)), 1)
    cu_q = torch.cat((zero, (q_ends + row * s_q).flatten()))
    bads = [x for x in (bad_q, bad_k) if x is not None]
    if device_checks.capturing(dev):
        poison = torch.zeros(b, dtype=torch.float32, device=dev)
        for bad in bads:
            poison = poison.masked_fill(bad.any(1), float("nan"))
        return PaddingLayout("thd", cu_q, s_q, cu_k, s_kv, poison, None)
    if b == 0 or s_q == 0 or s_kv == 0:
        return PaddingLayout("thd", cu_q, 0, cu_k, 0, None, False)
    # the numbers the host needs, int32 on the device, then one read
    stats = [first_k.max(), (cu_k.diff().max()), (len_k != s_kv).any().to(torch.int32)]
    if not same:
        stats += [first_q.max(), cu_q.diff().max(), (len_q != s_q).any().to(torch.int32)]
    for bad in (bad_q, bad_k):
        if bad is not None:
            stats += list(bad.flatten().to(torch.int32).max(0))  # (any, first index: max's first maximum)
    vals = torch.stack([x.to(torch.int32) for x in stats]).tolist()  # the one host read
    if same:
        left, max_k, padded = vals[:3]
        max_q, rest = max_k, vals[3:]
    else:
        left, max_k, padded = vals[0] or vals[3], vals[1], vals[2] or vals[5]
        max_q, rest = vals[4], vals[6:]
    holes = []
    for bad in (bad_q, bad_k):
        holes.append(rest[:2] if bad is not None else (0, 0))
        rest = rest[2:] if bad is not None else rest
    for i, (any_bad, at) in enumerate(holes):
        if any_bad:
            width = s_q if i == 0 else s_kv
            raise hole_error(f"{who}: {names[i]}: each row's padding must be one contiguous run at the end (right "
                             "padding) or the start (left padding) of the row, or both, around one run of "
                             f"tokens; row {at // width} has a hole at position {at % width} (padding between "
                             "tokens; holes are not supported)")
    if not left:
        cu_k = torch.zeros(b + 1, dtype=torch.int32, device=dev)
        torch.cumsum(len_k, 0, out=cu_k[1:])
        if same:
            cu_q = cu_k
        else:
            cu_q = torch.zeros(b + 1, dtype=torch.int32, device=dev)
            torch.cumsum(len_q, 0, out=cu_q[1:])
        return PaddingLayout("bshd", cu_q, s_q, cu_k, s_kv, None, bool(padded))
    return PaddingLayout("thd", cu_q, max_q, cu_k, max_k, None, True)

