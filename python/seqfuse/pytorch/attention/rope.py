"""transformer_engine.pytorch.attention.rope's functions under the same path
(``seqfuse.pytorch.attention.rope``): RotaryPositionEmbedding and
apply_rotary_pos_emb are seqfuse.modules.rope's; apply_fused_qkv_rotary_pos_emb
is written here on top of apply_rotary_pos_emb.

apply_fused_qkv_rotary_pos_emb(qkv, q_freqs, k_freqs, qkv_split_arg_list, ...)
takes Q, K and V concatenated along the last dimension of one [s, b, g, *]
('sbhd') or [b, s, g, *] ('bshd') tensor, g key/value groups, split
[q_size, k_size, v_size] per group, and returns (q, k, v) as TE does:
q [s, b, g * q_size / k_size, k_size] and k [s, b, g, k_size] rotated by
q_freqs / k_freqs, v [s, b, g, v_size] as given.  Here it is a split
(views), a reshape of Q (a copy when several query heads share a group) and
seqfuse's RoPE kernel on Q and K, not TE's single fused kernel; gradients
flow back into qkv through autograd.  cp_size > 1 raises NotImplementedError
(apply_rotary_pos_emb's rule), 'thd' raises ValueError (as in TE).
"""
from ...modules.rope import RotaryPositionEmbedding, apply_rotary_pos_emb

__all__ = ["RotaryPositionEmbedding", "apply_rotary_pos_emb", "apply_fused_qkv_rotary_pos_emb"]


def apply_fused_qkv_rotary_pos_emb(qkv, q_freqs, k_freqs, qkv_split_arg_list, tensor_format="sbhd",
                                   start_positions=None, interleaved=False, cu_seqlens=None, cp_size=1,
                                   cp_rank=0):
    """(q, k, v) from one QKV tensor, Q and K rotated; see the module note."""
    who = "apply_fused_qkv_rotary_pos_emb"
    if tensor_format not in ("sbhd", "bshd"):
        raise ValueError(f"{who}: argument 'tensor_format' must be 'sbhd' or 'bshd', got {tensor_format!r}")
    if qkv.dim() != 4:
        raise ValueError(f"{who}: argument 'qkv' must be 4-D [s, b, g, q+k+v] or [b, s, g, q+k+v], got shape "
                         f"{tuple(qkv.shape)}")
    split = [int(n) for n in qkv_split_arg_list]
    if len(split) != 3 or sum(split) != qkv.shape[-1] or min(split) <= 0:
        raise ValueError(f"{who}: argument 'qkv_split_arg_list' must be three positive sizes adding up to "
                         f"qkv's last dimension {qkv.shape[-1]}, got {list(qkv_split_arg_list)}")
    q_size, k_size, _ = split
    if q_size % k_size:
        raise ValueError(f"{who}: the query size per group ({q_size}) must be a multiple of the key size "
                         f"({k_size}): Q holds whole heads of the key's head dim")
    q, k, v = qkv.split(split, dim=-1)
    lead = qkv.shape[:2]
    q = q.reshape(*lead, qkv.shape[2] * (q_size // k_size), k_size)
    q = apply_rotary_pos_emb(q, q_freqs, tensor_format, start_positions=start_positions, interleaved=interleaved,
                             cp_size=cp_size, cp_rank=cp_rank)
    k = apply_rotary_pos_emb(k, k_freqs, tensor_format, start_positions=start_positions, interleaved=interleaved,
                             cp_size=cp_size, cp_rank=cp_rank)
    return q, k, v
