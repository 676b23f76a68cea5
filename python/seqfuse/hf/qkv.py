"""Fusing and splitting query/key/value projection weights.

seqfuse's MultiheadAttention (like Transformer Engine's) computes Q, K and V
with one GEMM over a fused weight of (num_heads + 2 * num_gqa_groups) *
head_dim rows.  Its row order is either

- interleaved (``qkv_weight_interleaved=True``, TE's default): for each of
  the ``num_gqa_groups`` groups, that group's query heads, then its key head,
  then its value head; or
- concatenated: all query rows, then all key rows, then all value rows.

These functions are pure tensor reshuffles (no arithmetic), so a fuse
followed by a split gives back bit-identical tensors.  They work on weights
[rows, in_features] and on biases [rows] alike.
"""
import torch


def _check(num_heads, num_gqa_groups):
    if num_heads % num_gqa_groups:
        raise ValueError(f"qkv: num_heads ({num_heads}) must be a multiple of num_gqa_groups ({num_gqa_groups})")


def fuse_qkv(q, k, v, num_heads, num_gqa_groups=None, interleaved=True):
    """One fused tensor from query [h*d, ...], key [g*d, ...], value [g*d, ...]."""
    g = num_heads if num_gqa_groups is None else num_gqa_groups
    _check(num_heads, g)
    if q.shape[0] % num_heads:
        raise ValueError(f"fuse_qkv: query rows ({q.shape[0]}) must be a multiple of num_heads ({num_heads})")
    d = q.shape[0] // num_heads
    if k.shape != v.shape or k.shape[0] != g * d or k.shape[1:] != q.shape[1:]:
        raise ValueError(
            f"fuse_qkv: key {tuple(k.shape)} and value {tuple(v.shape)} must both have {g * d} rows "
            f"(num_gqa_groups {g} x head dim {d}) and the query's trailing shape {tuple(q.shape[1:])}")
    if not interleaved:
        return torch.cat([q, k, v], dim=0)
    rest = q.shape[1:]
    hpg = num_heads // g
    parts = [q.reshape(g, hpg * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)]
    return torch.cat(parts, dim=1).reshape(g * (hpg + 2) * d, *rest)


def split_qkv(qkv, num_heads, num_gqa_groups=None, interleaved=True):
    """(query, key, value) from a fused tensor made by ``fuse_qkv``."""
    g = num_heads if num_gqa_groups is None else num_gqa_groups
    _check(num_heads, g)
    hpg = num_heads // g
    rows = qkv.shape[0]
    if rows % (g * (hpg + 2)):
        raise ValueError(
            f"split_qkv: fused rows ({rows}) must be a multiple of num_heads + 2 * num_gqa_groups "
            f"({num_heads} + 2 * {g})")
    d = rows // (g * (hpg + 2))
    rest = qkv.shape[1:]
    if not interleaved:
        q, k, v = torch.split(qkv, [num_heads * d, g * d, g * d], dim=0)
        return q.clone(), k.clone(), v.clone()
    grouped = qkv.reshape(g, (hpg + 2) * d, *rest)
    q, k, v = torch.split(grouped, [hpg * d, d, d], dim=1)
    return (q.reshape(num_heads * d, *rest).clone(), k.reshape(g * d, *rest).clone(),
            v.reshape(g * d, *rest).clone())
