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
from the mask and the module's own causality (right padding runs in the
kernel's padded layout; left or both-sided padding, each row one run of
tokens, as packed thd sequences with separate query and key extents: the
tokens see only the tokens, and a padding position sees no key, so its
output is 0 (outputs at padding positions are not defined in transformers;
seqfuse.ops.attn.padding_layout, which DotProductAttention shares));
grouped-query attention as the shapes say; attention
dropout with the probability the layer passes, while the module is training
(inside the kernel: the mask is drawn from torch's generator as a Philox
seed/offset and regenerated in the backward, see seqfuse.ops.attn; in eval
mode none); a static key cache (transformers' StaticCache: keys past the mask's
length are unfilled slots and are left out, as its flash-attention path
does); sliding-window attention as transformers' flash-attention path
defines it (``sliding_window`` W: each query sees the W keys up to and
including its own position when causal, W - 1 either side when not), inside
the kernel's window_size; transformers' padding-free packed batches (batch
1, sequences concatenated: ``cu_seq_lens_q`` / ``cu_seq_lens_k`` from
DataCollatorWithFlattening, or position ids that restart) as the kernel's
packed thd layout, so no token attends across a sequence boundary.  What it
refuses (NotImplementedError naming it; never another computation): logit
soft-capping, holes in the mask (a row of more than one run of tokens),
packed batches with a padding mask or a KV cache, position ids
that restart but do not then count up by one, and attention sinks
(``s_aux`` / ``sinks``, as gpt-oss passes them).

Reading a mask's padding costs one host sync, the sequence starts of packed
position ids a few; transformers hands every layer the same mask and position
ids tensors, so the result is kept for the tensor it came from (while it
lives and is not modified in place: its version counter; the last few
tensors' results are kept) and the other layers reuse it.  Under CUDA
graph capture a padding mask is not read (nor cached): a row with a hole
then comes out NaN instead of being refused.
"""
import torch

from .. import ops
from ..ops.attn import PerTensorCache, padding_layout
from ..ops import device_checks
from .positions import derived_positions


NAME = "seqfuse"


def _padding_layout(mask, s_q):
    """(format, cu_seqlens_q, longest q, cu_seqlens_kv, longest kv) of a
    [b, s_kv] keep-mask over the keys, whose last s_q positions are the
    queries (s_q < s_kv: a key cache during generation): seqfuse.ops.attn's
    padding_layout, which DotProductAttention uses too.  Every row right
    padded: "bshd", the kernel's padded layout.  Otherwise (left or
    both-sided padding, each row one run of tokens) "thd" over the rows laid
    end to end, tokens seeing only tokens.  A row with a hole is refused
    (under CUDA graph capture, where nothing is read, it comes out NaN)."""
    return padding_layout(mask.bool(), None, s_q, who="seqfuse attention", names=("attention mask",) * 2,
                          hole_error=NotImplementedError)


def is_packed_positions(position_ids, batch):
    """transformers' test: one row whose positions are not min, min + 1, ..."""
    if position_ids is None or batch != 1 or position_ids.shape[-1] == 1:
        return False
    pos = position_ids.reshape(-1)
    return not torch.equal(pos, pos.min() + torch.arange(pos.numel(), device=pos.device))


def cu_seqlens_of_positions(position_ids):
    """(int32 cu_seqlens, max length) of a packed row: a sequence starts wherever
    the position is the row's minimum (0, or padding_idx + 1 for RoBERTa-like
    models) and must count up by one from there."""
    pos = position_ids.reshape(-1)
    first = pos.min()
    is_start = pos == first
    starts = is_start.nonzero().view(-1)
    seq_of = torch.cumsum(is_start, 0) - 1  # which sequence each token is in
    expected = first + torch.arange(pos.numel(), device=pos.device) - starts[seq_of]
    if not torch.equal(pos, expected):
        raise NotImplementedError("seqfuse attention: packed position ids must restart at their minimum and "
                                  "count up by one within each sequence")
    cu = torch.cat((starts.to(torch.int32), torch.tensor([pos.numel()], dtype=torch.int32, device=pos.device)))
    return cu, int(cu.diff().max())


def _packed_thd(attention_mask, s_q, s_kv, kwargs):
    """(cu_q, cu_kv, max_q, max_kv) of a padding-free packed call."""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise NotImplementedError("seqfuse attention: a packed batch (cu_seq_lens / restarting position ids) "
                                  "with a padding mask is not supported")
    if s_q != s_kv:
        raise NotImplementedError(f"seqfuse attention: a packed batch against a key cache (q_len {s_q}, "
                                  f"kv_len {s_kv}) is not supported")
    cu_q, cu_kv = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None and cu_kv is None:
        cu, longest = _cu_seqlens_of_positions_cached(kwargs["position_ids"])
        return cu, cu, longest, longest
    if cu_q is None or cu_kv is None:
        raise ValueError("seqfuse attention: cu_seq_lens_q and cu_seq_lens_k come together")
    max_q, max_kv = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    return (cu_q.to(torch.int32), cu_kv.to(torch.int32), None if max_q is None else int(max_q),
            None if max_kv is None else int(max_kv))


#: the keyword arguments under which transformers' layers hand over attention sinks
_SINK_KWARGS = ("s_aux", "sinks")

_padding_layout_cached = PerTensorCache(_padding_layout)
_is_packed_cached = PerTensorCache(is_packed_positions)
_cu_seqlens_of_positions_cached = PerTensorCache(cu_seqlens_of_positions)


def seqfuse_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                              sliding_window=None, softcap=None, **kwargs):
    """transformers' attention-function signature: query [b, h, s_q, d], key and
    value [b, g, s_kv, d]; returns (output [b, s_q, h, d], None).  ``dropout``
    applies only while ``module.training`` (layers pass 0 in eval anyway)."""
    if softcap:
        raise NotImplementedError("seqfuse attention: logit soft-capping is not supported")
    # Attention sinks (gpt-oss and others pass s_aux=self.sinks, some sinks=):
    # an extra logit per head in the softmax's denominator, which the kernel
    # does not have.  Ignoring it would silently compute other attention.
    for name in _SINK_KWARGS:
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"seqfuse attention: attention sinks ({name}=...) are not supported; "
                                      "the fused kernel's softmax has no sink logit")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise NotImplementedError(f"seqfuse attention: a {attention_mask.dim()}-D attention mask (custom mask) "
                                  "is not supported; only key padding")
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", False)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # bshd views
    s_q, s_kv = q.shape[1], k.shape[1]
    cu_q = cu_kv = max_q = max_kv = poison = None
    fmt = "bshd"
    pos = kwargs.get("position_ids")
    if (kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None
            or (pos is not None and not derived_positions() and _is_packed_cached(pos, q.shape[0]))):
        if q.shape[0] != 1:
            raise NotImplementedError(f"seqfuse attention: packed batches (cu_seq_lens) come as one row, got "
                                      f"batch {q.shape[0]}")
        cu_q, cu_kv, max_q, max_kv = _packed_thd(attention_mask, s_q, s_kv, kwargs)
        q, k, v = q[0], k[0], v[0]  # [total, heads, dim]
        fmt = "thd"
        mask_type = "padding_causal" if is_causal else "padding"
    elif attention_mask is not None:
        if s_q <= attention_mask.shape[-1] < s_kv and not torch.is_grad_enabled():
            # a static cache in generation (no grad): the keys past the mask are unfilled slots
            # (transformers' mask covers the filled ones, the queries last), so they are left out; with
            # gradients on (training) a short mask is an error below
            k, v = k[:, :attention_mask.shape[-1]], v[:, :attention_mask.shape[-1]]
            s_kv = k.shape[1]
        if attention_mask.shape[-1] != s_kv or s_q > s_kv:
            raise ValueError(f"seqfuse attention: the attention mask covers {attention_mask.shape[-1]} keys; "
                             f"the call has {s_kv} keys and {s_q} queries")
        # under capture a replay reads new mask contents: not cached
        fmt, cu_q, max_q, cu_kv, max_kv, poison, _ = (
            _padding_layout if device_checks.capturing(q) else _padding_layout_cached)(attention_mask, s_q)
        if fmt == "thd":  # the rows end to end: [b * s, heads, dim]
            q, k, v = (t.reshape(-1, t.shape[2], t.shape[3]) for t in (q, k, v))
        # queries sit at the end of their key run (a cache), so causality aligns bottom-right
        mask_type = ("padding_causal" if s_q == s_kv else "padding_causal_bottom_right") if is_causal \
            else "padding"
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
    out = ops.attention(q, k, v, qkv_format=fmt, attn_mask_type=mask_type, cu_seqlens_q=cu_q,
                        cu_seqlens_kv=cu_kv, max_seqlen_q=max_q, max_seqlen_kv=max_kv, softmax_scale=scaling,
                        window_size=window, dropout_p=dropout if module.training else 0.0)
    if fmt == "thd":  # back to [b, s_q, heads, dim]: one row when packed, the padded rows otherwise
        out = out.view(query.shape[0], s_q, *out.shape[1:])
    if poison is not None:  # CUDA graph capture: a row with a hole comes out NaN
        out = out + poison.to(out.dtype)[:, None, None, None]
    return out, None


def register():
    """Register "seqfuse" with transformers' attention and attention-mask interfaces."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    AttentionInterface.register(NAME, seqfuse_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, flash_attention_mask)
