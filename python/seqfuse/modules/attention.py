"""DotProductAttention: Transformer Engine's core-attention module over
seqfuse's fused attention (seqfuse.ops.attention: seqfuse's kernels, or on
Hopper cuDNN's fused attention for padding-free bshd/sbhd calls, as that
op's backend choice says).

It takes query, key and value already split into heads, in the layout named
by qkv_format (sbhd [s, b, h, d], bshd [b, s, h, d], thd [t, h, d] packed with
cu_seqlens), and returns the attention output with the heads flattened:
[s, b, h*d], [b, s, h*d] or [t, h*d], as TE does.  Padding masks in bshd/sbhd
come either as cu_seqlens or as TE's boolean attention_mask (True = masked
out, [b, 1, 1, s_kv] for self-attention or a (q_mask, kv_mask) pair with
masks [b, 1, 1, s]); padding must be at the end of each row.

attention_dropout applies to the attention probabilities in training mode
only (eval: none), in every layout, inside the fused kernel (the mask is
regenerated in the backward from a Philox seed/offset drawn from torch's
generator, see seqfuse.ops.attn).  On CUDA, dropout runs in the sm80
kernels (on Hopper too, logged once: the wgmma kernels have no dropout yet).

Not supported (each raises NotImplementedError, never falls back silently):
attention biases (ALiBi, post-scale bias), the "arbitrary" mask, and
cu_seqlens_*_padded different from cu_seqlens_*.
"""
import math

import torch

from .. import ops
from ._input import check_input


def _mask_to_cu_seqlens(mask):
    """TE's padding mask [b, 1, 1, s] (True = padding) -> int32 cu_seqlens."""
    lengths = (~mask.reshape(mask.shape[0], -1)).sum(dim=1, dtype=torch.int32)
    cu = torch.zeros(mask.shape[0] + 1, dtype=torch.int32, device=mask.device)
    torch.cumsum(lengths, 0, out=cu[1:])
    return cu


class DotProductAttention(torch.nn.Module):
    """softmax(Q K^T / sqrt(d) + mask) V, fused, for padded and packed batches.

    Arguments (TE's names): num_attention_heads, kv_channels (head dim, or a
    (k, v) pair of equal dims), num_gqa_groups (key/value heads, default all),
    attention_dropout (probability, applied in training mode only), qkv_format ("sbhd", "bshd",
    "thd"), attn_mask_type ("no_mask", "padding", "causal", "padding_causal",
    "causal_bottom_right", "padding_causal_bottom_right"), window_size
    ((left, right), -1 unbounded), softmax_scale (default 1/sqrt(d)).
    ``deterministic=True`` selects the atomics-free backward.
    """

    def __init__(self, num_attention_heads, kv_channels, num_gqa_groups=None, attention_dropout=0.0,
                 qkv_format="sbhd", attn_mask_type="causal", window_size=None, sequence_parallel=False,
                 tp_size=1, get_rng_state_tracker=None, tp_group=None, layer_number=None,
                 attention_type="self", cp_group=None, cp_global_ranks=None, cp_stream=None,
                 cp_comm_type="p2p", softmax_scale=None, deterministic=False):
        super().__init__()
        if isinstance(kv_channels, (tuple, list)):
            if kv_channels[0] != kv_channels[1]:
                raise NotImplementedError("DotProductAttention: different key and value head dims "
                                          f"{tuple(kv_channels)} are not supported")
            kv_channels = kv_channels[0]
        if tp_size != 1 or cp_group is not None:
            raise NotImplementedError("DotProductAttention: tensor and context parallelism are not supported")
        self.num_attention_heads = int(num_attention_heads)
        self.num_gqa_groups = int(num_gqa_groups or num_attention_heads)
        if self.num_attention_heads % self.num_gqa_groups != 0:
            raise ValueError(f"DotProductAttention: num_attention_heads ({num_attention_heads}) must be a "
                             f"multiple of num_gqa_groups ({num_gqa_groups})")
        self.hidden_size_per_attention_head = self.kv_channels = int(kv_channels)
        self.attention_dropout = float(attention_dropout)
        self.qkv_format = qkv_format
        self.attn_mask_type = attn_mask_type
        self.window_size = window_size
        self.attention_type = attention_type
        self.layer_number = layer_number
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.kv_channels)
        self.deterministic = deterministic

    def extra_repr(self):
        return (f"heads={self.num_attention_heads}, gqa_groups={self.num_gqa_groups}, "
                f"head_dim={self.kv_channels}, qkv_format={self.qkv_format}, "
                f"attn_mask_type={self.attn_mask_type}, window_size={self.window_size}")

    def forward(self, query_layer, key_layer, value_layer, attention_mask=None, qkv_format=None,
                cu_seqlens_q=None, cu_seqlens_kv=None, cu_seqlens_q_padded=None,
                cu_seqlens_kv_padded=None, max_seqlen_q=None, max_seqlen_kv=None,
                attn_mask_type=None, window_size=None, checkpoint_core_attention=False,
                core_attention_bias_type="no_bias", core_attention_bias=None, alibi_slopes=None,
                fast_zero_fill=True, inference_params=None):
        qkv_format = qkv_format or self.qkv_format
        attn_mask_type = attn_mask_type or self.attn_mask_type
        window_size = window_size if window_size is not None else self.window_size
        if core_attention_bias_type != "no_bias" or core_attention_bias is not None or alibi_slopes is not None:
            raise NotImplementedError("DotProductAttention: attention biases (ALiBi, post-scale bias) are not supported")
        if inference_params is not None:
            raise NotImplementedError("DotProductAttention: inference_params (KV cache) is not supported")
        for name, padded, plain in (("cu_seqlens_q_padded", cu_seqlens_q_padded, cu_seqlens_q),
                                    ("cu_seqlens_kv_padded", cu_seqlens_kv_padded, cu_seqlens_kv)):
            if padded is not None and not (padded is plain or torch.equal(padded, plain)):
                raise NotImplementedError(f"DotProductAttention: {name} different from the unpadded "
                                          "cu_seqlens (padding between packed sequences) is not supported")
        for name, x in (("query_layer", query_layer), ("key_layer", key_layer), ("value_layer", value_layer)):
            check_input("DotProductAttention", x, name=name, min_dim=3)  # [t, h, d] or [b, s, h, d]
        heads, dim = query_layer.shape[-2], query_layer.shape[-1]
        if heads != self.num_attention_heads or dim != self.kv_channels:
            raise ValueError(f"DotProductAttention: query_layer has {heads} heads of dim {dim}; the module "
                             f"was built for {self.num_attention_heads} heads of dim {self.kv_channels}")
        if key_layer.shape[-2] != self.num_gqa_groups:
            raise ValueError(f"DotProductAttention: key_layer has {key_layer.shape[-2]} heads; the module "
                             f"was built for num_gqa_groups={self.num_gqa_groups}")
        if "padding" in attn_mask_type and qkv_format != "thd" and cu_seqlens_q is None:
            if attention_mask is None:
                raise ValueError(f"DotProductAttention: attn_mask_type {attn_mask_type!r} needs an "
                                 "attention_mask or cu_seqlens_q/cu_seqlens_kv")
            if isinstance(attention_mask, (tuple, list)):
                cu_seqlens_q = _mask_to_cu_seqlens(attention_mask[0])
                cu_seqlens_kv = _mask_to_cu_seqlens(attention_mask[1])
            else:
                cu_seqlens_q = cu_seqlens_kv = _mask_to_cu_seqlens(attention_mask)
        elif "padding" not in attn_mask_type and qkv_format != "thd":
            cu_seqlens_q = cu_seqlens_kv = None
        if qkv_format == "thd" and cu_seqlens_kv is None:
            cu_seqlens_kv = cu_seqlens_q
        if qkv_format == "thd" and max_seqlen_kv is None and cu_seqlens_kv is cu_seqlens_q:
            max_seqlen_kv = max_seqlen_q
        out = ops.attention(query_layer, key_layer, value_layer, qkv_format=qkv_format,
                            attn_mask_type=attn_mask_type, cu_seqlens_q=cu_seqlens_q,
                            cu_seqlens_kv=cu_seqlens_kv, max_seqlen_q=max_seqlen_q,
                            max_seqlen_kv=max_seqlen_kv, window_size=window_size,
                            softmax_scale=self.softmax_scale, deterministic=self.deterministic,
                            dropout_p=self.attention_dropout if self.training else 0.0)
        return out.reshape(out.shape[:-2] + (heads * dim,))
