"""seqfuse's fused attention as a transformers attention implementation.

transformers (>= 5) lets a model's attention layers call any function
registered in its AttentionInterface.  ``register()`` adds "seqfuse": the
fused kernel (seqfuse.ops.attention) behind transformers' attention-function
signature, with the mask given as flash-attention implementations get it (a
2-D [batch, kv_len] keep-mask, or None when nothing is padded).  Models whose
attention follows that interface (``_supports_attention_backend``: BERT,
Llama, GPT-2, ESM, ...) switch with ``model.set_attn_implementation("seqfuse")``;
``seqfuse.hf.accelerate`` does it and reports it.

What it computes: softmax(scaling * Q K^T + mask) V with key padding taken
from the mask (padding must be at the end of each row: right padding) and the
module's own causality; grouped-query attention as the shapes say; attention
dropout with the probability the layer passes, while the module is training
(inside the kernel: the mask is drawn from torch's generator as a Philox
seed/offset and regenerated in the backward, see seqfuse.ops.attn; in eval
mode none); sliding-window attention as transformers' flash-attention path
defines it (``sliding_window`` W: each query sees the W keys up to and
including its own position when causal, W - 1 either side when not), inside
the kernel's window_size.  What it refuses (NotImplementedError naming it;
never another computation): logit soft-capping, left padding or holes in the
mask, padded queries against a KV cache, and transformers' padding-free
packed batches (position_ids / cu_seq_lens).
"""
import torch

from .. import ops

NAME = "seqfuse"


def _lengths_of_right_padded(mask):
    """int32 cu_seqlens of a [b, s] keep-mask, which must be ones then zeros per row."""
    mask = mask.bool()
    lengths = mask.sum(-1, dtype=torch.int32)
    ar = torch.arange(mask.shape[-1], device=mask.device)
    if not torch.equal(mask, ar[None, :] < lengths[:, None]):
        raise NotImplementedError("seqfuse attention: the attention mask must be right padding (ones then zeros "
                                  "per row); left padding or holes are not supported")
    cu = torch.zeros(mask.shape[0] + 1, dtype=torch.int32, device=mask.device)
    torch.cumsum(lengths, 0, out=cu[1:])
    return cu


def seqfuse_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                              sliding_window=None, softcap=None, **kwargs):
    """transformers' attention-function signature: query [b, h, s_q, d], key and
    value [b, g, s_kv, d]; returns (output [b, s_q, h, d], None).  ``dropout``
    applies only while ``module.training`` (layers pass 0 in eval anyway)."""
    if softcap:
        raise NotImplementedError("seqfuse attention: logit soft-capping is not supported")
    if any(kwargs.get(k) is not None for k in ("cu_seq_lens_q", "cu_seq_lens_k", "cu_seqlens_q")):
        raise NotImplementedError("seqfuse attention: transformers' padding-free packed batches are not "
                                  "supported; use seqfuse's own models for packed (thd) input")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise NotImplementedError(f"seqfuse attention: a {attention_mask.dim()}-D attention mask (custom mask) "
                                  "is not supported; only key padding")
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", False)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # bshd views
    s_q, s_kv = q.shape[1], k.shape[1]
    cu_q = cu_kv = None
    if attention_mask is not None:
        if s_q != s_kv:
            raise NotImplementedError("seqfuse attention: padded queries against a longer key cache "
                                      f"(q_len {s_q}, kv_len {s_kv}) are not supported")
        cu_q = cu_kv = _lengths_of_right_padded(attention_mask)
        mask_type = "padding_causal" if is_causal else "padding"
    elif is_causal:
        mask_type = "causal" if s_q == s_kv else "causal_bottom_right"
    else:
        mask_type = "no_mask"
    window = None
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
            raise ValueError(f"seqfuse attention: sliding_window must be a positive int (keys per window), "
                             f"got {sliding_window!r}")
        window = (sliding_window - 1, 0 if is_causal else sliding_window - 1)
    out = ops.attention(q, k, v, qkv_format="bshd", attn_mask_type=mask_type, cu_seqlens_q=cu_q,
                        cu_seqlens_kv=cu_kv, softmax_scale=scaling, window_size=window,
                        dropout_p=dropout if module.training else 0.0)
    return out, None


def register():
    """Register "seqfuse" with transformers' attention and attention-mask interfaces."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    AttentionInterface.register(NAME, seqfuse_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, flash_attention_mask)
