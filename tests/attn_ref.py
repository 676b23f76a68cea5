"""An independent attention reference in plain torch (float64 by default,
autograd-capable) and the random problems the attention tests share.

The mask rule is written out again here from its specification rather than
taken from the C code: query r of a sequence with sq queries and sk keys sees
key c when c <= r + off + right (right >= 0) and c >= r + off - left
(left >= 0), with right = 0 for causal masks and off = 0 for the top-left
masks ("causal", "padding_causal"), off = sk - sq otherwise.
"""
import torch

from attn_philox import drop_multiplier

TOP_LEFT = {"causal", "padding_causal"}
CAUSAL = {"causal", "padding_causal", "causal_bottom_right", "padding_causal_bottom_right"}
PADDING = {"padding", "padding_causal", "padding_causal_bottom_right"}


def allowed_matrix(sq, sk, mask, window, device="cpu"):
    left, right = window if window is not None else (-1, -1)
    if mask in CAUSAL:
        right = 0
    off = 0 if mask in TOP_LEFT else sk - sq
    r = torch.arange(sq, device=device)[:, None]
    c = torch.arange(sk, device=device)[None, :]
    ok = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if right >= 0:
        ok &= c <= r + off + right
    if left >= 0:
        ok &= c >= r + off - left
    return ok


def attend(q, k, v, mask, window, scale, drop=None):
    """One sequence: q [sq, h, d], k/v [sk, hk, d] -> out [sq, h, d];
    drop: None or the dropout multiplier [h, sq, sk] applied to softmax(S)."""
    sq, h, _ = q.shape
    sk, hk, _ = k.shape
    g = h // hk
    kx = k.repeat_interleave(g, dim=1)
    vx = v.repeat_interleave(g, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, kx) * scale
    ok = allowed_matrix(sq, sk, mask, window, q.device)
    p = torch.softmax(s.masked_fill(~ok, -1e30), dim=-1) * ok  # rows seeing nothing -> 0
    if drop is not None:
        p = p * drop.to(device=p.device, dtype=p.dtype)
    return torch.einsum("hqk,khd->qhd", p, vx)


def _drop(dropout, i, heads, sq, sk):
    """The dropout multiplier of sequence i: dropout = (p, seed, offset) or None."""
    if dropout is None or dropout[0] == 0.0:
        return None
    p, seed, offset = dropout
    return drop_multiplier(seed, offset, i, heads, sq, sk, p)


def reference(q, k, v, *, qkv_format, attn_mask_type="no_mask", seqlens_q=None, seqlens_kv=None,
              window_size=None, softmax_scale=None, dtype=torch.float64, dropout=None):
    """Attention of (padded or packed) q, k, v in `dtype`; padded rows and
    the thd tail are 0.  seqlens_* are python lists of real lengths.
    dropout: None or (p, seed, offset), the mask of tests/attn_philox.py."""
    q, k, v = (x.to(dtype) for x in (q, k, v))
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    if qkv_format == "sbhd":
        out = reference(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), qkv_format="bshd",
                        attn_mask_type=attn_mask_type, seqlens_q=seqlens_q, seqlens_kv=seqlens_kv,
                        window_size=window_size, softmax_scale=scale, dtype=dtype, dropout=dropout)
        return out.transpose(0, 1)
    pieces = []
    if qkv_format == "bshd":
        b, s = q.shape[:2]
        for i in range(b):
            lq = seqlens_q[i] if seqlens_q is not None else s
            lk = seqlens_kv[i] if seqlens_kv is not None else k.shape[1]
            o = attend(q[i, :lq], k[i, :lk], v[i, :lk], attn_mask_type, window_size, scale,
                       _drop(dropout, i, q.shape[2], lq, lk))
            pad = q.new_zeros((s - lq,) + q.shape[2:])
            pieces.append(torch.cat([o, pad]))
        return torch.stack(pieces)
    # thd
    cq = [0]
    ck = [0]
    for a, b_ in zip(seqlens_q, seqlens_kv):
        cq.append(cq[-1] + a)
        ck.append(ck[-1] + b_)
    for i in range(len(seqlens_q)):
        pieces.append(attend(q[cq[i]:cq[i + 1]], k[ck[i]:ck[i + 1]], v[ck[i]:ck[i + 1]],
                             attn_mask_type, window_size, scale,
                             _drop(dropout, i, q.shape[1], seqlens_q[i], seqlens_kv[i])))
    pieces.append(q.new_zeros((q.shape[0] - cq[-1],) + q.shape[1:]))
    return torch.cat(pieces)


def cu_seqlens(lengths, device="cpu"):
    c = [0]
    for n in lengths:
        c.append(c[-1] + n)
    return torch.tensor(c, dtype=torch.int32, device=device)


def check_route_cu_seqlens(cu_q, cu_k, max_q, max_k):
    """What a packed attention route hands a kernel stand-in: int32
    cu_seqlens of queries and keys for the same number of sequences, each
    sequence within the max lengths passed with them.  Returns both as lists."""
    assert cu_q.dtype == torch.int32 and cu_k.dtype == torch.int32 and cu_q.numel() == cu_k.numel()
    bq, bk = cu_q.tolist(), cu_k.tolist()
    assert all(0 <= b - a <= max_q for a, b in zip(bq, bq[1:])), (bq, max_q)
    assert all(0 <= b - a <= max_k for a, b in zip(bk, bk[1:])), (bk, max_k)
    return bq, bk


def thd_case(lengths_q, lengths_k=None, h=4, hk=4, d=16, dtype=torch.bfloat16, tail=(0, 0), same=True):
    """A random packed (thd) problem: q, k, v with ``tail`` extra rows past
    the last sequence, and ops.attention's thd keywords.  ``same`` shares one
    cu_seqlens tensor between queries and keys when their lengths agree."""
    lengths_k = lengths_q if lengths_k is None else lengths_k
    q = torch.randn(sum(lengths_q) + tail[0], h, d).to(dtype)
    k = torch.randn(sum(lengths_k) + tail[1], hk, d).to(dtype)
    v = torch.randn(k.shape).to(dtype)
    cu_q = cu_seqlens(lengths_q)
    cu_k = cu_q if same and lengths_k == lengths_q else cu_seqlens(lengths_k)
    return q, k, v, dict(qkv_format="thd", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k, max_seqlen_q=max(lengths_q),
                         max_seqlen_kv=max(lengths_k))


def pack(x_padded, lengths):
    """[b, s, h, d] padded -> [sum(lengths), h, d] packed."""
    return torch.cat([x_padded[i, :n] for i, n in enumerate(lengths)])


def unpack(x_packed, lengths, s):
    """[t, h, d] packed -> [b, s, h, d] padded with zeros."""
    out = x_packed.new_zeros((len(lengths), s) + x_packed.shape[1:])
    start = 0
    for i, n in enumerate(lengths):
        out[i, :n] = x_packed[start:start + n]
        start += n
    return out
