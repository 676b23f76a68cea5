"""DotProductAttention: Transformer Engine's core-attention module over
seqfuse's fused attention (seqfuse.ops.attention: seqfuse's kernels, or on
Hopper cuDNN's fused attention for padding-free bshd/sbhd calls, as that
op's backend choice says).

It takes query, key and value already split into heads, in the layout named
by qkv_format (sbhd [s, b, h, d], bshd [b, s, h, d], thd [t, h, d] packed with
cu_seqlens), and returns the attention output with the heads flattened:
[s, b, h*d], [b, s, h*d] or [t, h*d], as TE does.  Padding masks in bshd/sbhd
come either as cu_seqlens (right padding: each row's length) or as TE's
boolean attention_mask: True = masked out (padding), a bool tensor
[b, 1, 1, s] (or [b, s]) for self-attention, or a (q_mask, kv_mask) pair of
such masks over s_q and s_kv.  Each row of a mask must be one run of tokens:
padding at the end (right), the start (left) or both; a row with a hole
(padding between tokens) is a ValueError naming the row and position.
Right padding runs in the kernel's padded layout; left or both-sided
padding runs as packed thd sequences with separate query and key extents
(seqfuse.ops.attn.padding_layout, shared with seqfuse.hf), exactly.  Causal
masks align within each row's tokens (top-left: first query, first key;
bottom-right: last, last), as TE's cu_seqlens do; for a single
self-attention mask that is the causal mask of the padded positions.
Outputs at padding positions are 0 and no gradient flows through them; a
row that is all padding is all 0 (torch's SDPA gives NaN there).
Reading a mask costs one host sync on CUDA, once per mask tensor (the
layout is kept while that tensor lives unmodified, so a model's layers,
which get the same mask, read it once); under CUDA graph capture nothing is
read (a row with a hole then comes out NaN).  An attention_mask with a
non-padding attn_mask_type, or with qkv_format thd, is a ValueError (it
would be ignored).

attention_dropout applies to the attention probabilities in training mode
only (eval: none), in every layout, inside the fused kernel (the mask is
regenerated in the backward from a Philox seed/offset drawn from torch's
generator, see seqfuse.ops.attn).  On CUDA, dropout runs in the sm80
kernels (on Hopper too, logged once: the wgmma kernels have no dropout yet).

Context parallelism (Transformer Engine's set_context_parallel_group, or the
cp_* constructor arguments): the sequence spread over the ranks of a process
group, each rank passing its load-balanced share of the tokens (chunks r and
2cp-1-r of 2*cp; seqfuse.distributed.split_batch_for_cp_rank picks them; for
thd, cu_seqlens and max_seqlen of the full batch), with cp_comm_type "p2p"
(ring) or "all_gather"; causal or no mask, bshd / sbhd / thd, GQA.  Not with
attention dropout in training, an attention_mask or a sliding window (each
raises).  seqfuse.distributed.context_parallel has the details.

Not supported (each raises NotImplementedError, never falls back silently):
attention biases (ALiBi, post-scale bias), the "arbitrary" mask, and
cu_seqlens_*_padded different from cu_seqlens_*.
"""
import logging
import math

import torch

from .. import ops
from ..quantization import attention as fp8_attn
from ..quantization.autocast import autocast_state
from ..ops.attn import MASKS, PerTensorCache, padding_layout
from ..ops import device_checks
from ..distributed.context_parallel import check_comm_type, context_parallel_attention, group_ranks
from ._base import size_arg
from ._input import check_input
from .te_compat import check_window


_log = logging.getLogger("seqfuse")
_fp8_refusals_logged = set()


def _check_mask(mask, name, batch, length, side, device):
    """TE's padding mask, checked: a bool [b, 1, 1, s] or [b, s] tensor on
    the inputs' device, True = masked out."""
    who = "DotProductAttention"
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{who}: {name} must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"{who}: {name} must be a bool tensor (True = masked out, Transformer Engine's "
                        f"convention), got dtype {mask.dtype}")
    shape = tuple(mask.shape)
    if not ((len(shape) == 4 and shape[1] == shape[2] == 1) or len(shape) == 2):
        extra = " (a [b, 1, s_q, s_kv] mask is TE's 'arbitrary' mask, which is not supported)" \
            if len(shape) == 4 else ""
        raise ValueError(f"{who}: {name} must be a padding mask [b, 1, 1, s] (or [b, s]), True = padding, got "
                         f"shape {shape}{extra}")
    if shape[0] != batch or shape[-1] != length:
        raise ValueError(f"{who}: {name} has shape {shape}: it must cover the batch ({batch}) and the "
                         f"{side} length ({length})")
    if mask.device != device:
        raise ValueError(f"{who}: {name} is on {mask.device}, the query on {device}: they must be on one device")
    device_checks.check_storage(who, name, mask)  # torch reads the mask (it never reaches C's checks)


def _layout_of(masks, s_q):
    """ops.attn.padding_layout of TE masks (True = padding): one mask for
    self-attention, or a (q_mask, kv_mask) pair."""
    who = "DotProductAttention"
    if isinstance(masks, tuple):
        keep_q, keep_kv = (~m.reshape(m.shape[0], m.shape[-1]) for m in masks)
        return padding_layout(keep_kv, keep_q, who=who, names=("attention_mask[0]", "attention_mask[1]"))
    return padding_layout(~masks.reshape(masks.shape[0], masks.shape[-1]), None, s_q, who=who)


_layout_cached = PerTensorCache(_layout_of)


def _mask_layout(attention_mask, q, k, qkv_format, attn_mask_type):
    """The checked attention_mask's PaddingLayout (cached per mask tensor)."""
    s_dim = 1 if qkv_format == "bshd" else 0
    batch, s_q, s_kv = q.shape[1 - s_dim], q.shape[s_dim], k.shape[s_dim]
    if isinstance(attention_mask, (tuple, list)):
        if len(attention_mask) != 2:
            raise ValueError(f"DotProductAttention: attention_mask must be one mask or a (q_mask, kv_mask) pair, "
                             f"got {len(attention_mask)} masks")
        _check_mask(attention_mask[0], "attention_mask[0]", batch, s_q, "query", q.device)
        _check_mask(attention_mask[1], "attention_mask[1]", batch, s_kv, "key", q.device)
        masks = tuple(attention_mask) if attention_mask[0] is not attention_mask[1] else attention_mask[0]
    else:
        masks = attention_mask
        _check_mask(masks, "attention_mask", batch, s_kv, "key", q.device)
        if s_q != s_kv:
            raise ValueError(f"DotProductAttention: one attention_mask is a self-attention mask, but the query "
                             f"length {s_q} differs from the key length {s_kv}: pass a (q_mask, kv_mask) pair")
    return _cached_layout(masks, s_q)


def _cached_layout(masks, s_q):
    first = masks[0] if isinstance(masks, tuple) else masks
    if device_checks.capturing(first):
        return _layout_of(masks, s_q)  # a replay reads new mask contents: nothing cached
    return _layout_cached(masks, s_q)


def padding_mask_layout(attention_mask):
    """The PaddingLayout (seqfuse.ops.attn.padding_layout) of a self-attention
    TE mask [b, 1, 1, s] (True = padding), as DotProductAttention computes
    and keeps it for that tensor: a model that asks first (``.padded``: is
    anything padded? None under CUDA graph capture) pays the one host read
    that its layers then reuse."""
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() < 2:
        _check_mask(attention_mask, "attention_mask", 0, 0, "key", None)  # raises, naming the rule
    _check_mask(attention_mask, "attention_mask", attention_mask.shape[0], attention_mask.shape[-1], "key",
                attention_mask.device)
    return _cached_layout(attention_mask, attention_mask.shape[-1])


def check_mask_type(cls, attn_mask_type):
    """``attn_mask_type`` when it is a string, else a TypeError naming it and
    the mask names (ops.attn's MASKS); an unknown name is refused where the
    mask is read (ops.attention)."""
    if not isinstance(attn_mask_type, str):
        allowed = ", ".join(repr(m) for m in MASKS)
        raise TypeError(f"{cls}: argument 'attn_mask_type' must be one of {allowed}, got {attn_mask_type!r}")
    return attn_mask_type


class DotProductAttention(torch.nn.Module):
    """softmax(Q K^T / sqrt(d) + mask) V, fused, for padded and packed batches.

    Arguments (TE's names): num_attention_heads, kv_channels (head dim, or a
    (k, v) pair of equal dims), num_gqa_groups (key/value heads, default all),
    attention_dropout (probability, applied in training mode only), qkv_format ("sbhd", "bshd",
    "thd"), attn_mask_type ("no_mask", "padding", "causal", "padding_causal",
    "causal_bottom_right", "padding_causal_bottom_right"), window_size
    ((left, right), -1 unbounded; (-1, 0) with a mask type that is not
    causal is a ValueError: Transformer Engine reads it as no window there,
    the kernels would read it as causal), softmax_scale (default
    1/sqrt(d)).
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
        if tp_size != 1:
            raise NotImplementedError("DotProductAttention: tensor parallelism (tp_size > 1) is not supported")
        cls = "DotProductAttention"
        self.num_attention_heads = size_arg(cls, "num_attention_heads", num_attention_heads)
        self.num_gqa_groups = size_arg(cls, "num_gqa_groups", self.num_attention_heads if num_gqa_groups is None
                                       else num_gqa_groups)
        if self.num_attention_heads % self.num_gqa_groups != 0:
            raise ValueError(f"DotProductAttention: num_attention_heads ({num_attention_heads}) must be a "
                             f"multiple of num_gqa_groups ({num_gqa_groups})")
        self.hidden_size_per_attention_head = self.kv_channels = size_arg(cls, "kv_channels", kv_channels)
        self.attention_dropout = float(attention_dropout)
        self.qkv_format = qkv_format
        self.attn_mask_type = check_mask_type(cls, attn_mask_type)
        self.window_size = window_size
        self.attention_type = attention_type
        self.layer_number = layer_number
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.kv_channels)
        self.deterministic = deterministic
        self.cp_group = None
        self.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream, cp_comm_type="p2p"):
        """Transformer Engine's call: run this module's attention with context
        parallelism over ``cp_group`` (a torch.distributed ProcessGroup; None,
        or a group of one rank, turns it off).  ``cp_global_ranks``: the
        group's global ranks in group order (checked against the group; None
        reads them from it).  ``cp_stream``: a CUDA stream the ring's
        transfers are issued from (None: the current stream).
        ``cp_comm_type``: "p2p" (ring exchange of K/V, overlapped with the
        attention of the block in hand) or "all_gather" (one all-gather of
        K/V).  Each rank then passes its share of the tokens (the
        load-balanced split of seqfuse.distributed.split_batch_for_cp_rank; for
        thd, cu_seqlens and max_seqlen of the full batch).  See
        seqfuse.distributed.context_parallel for the layout and its rules."""
        check_comm_type(cp_comm_type, "DotProductAttention")
        if isinstance(cp_group, (list, tuple)):
            raise NotImplementedError("DotProductAttention: a list of CP groups (cp_comm_type 'a2a+p2p') is not "
                                      "supported; pass one ProcessGroup")
        if cp_group is not None:
            group_ranks(cp_group, cp_global_ranks, "DotProductAttention")  # checks the group and the ranks
        self.cp_group, self.cp_global_ranks = cp_group, cp_global_ranks
        self.cp_stream, self.cp_comm_type = cp_stream, cp_comm_type

    def _cp_size(self):
        return 1 if self.cp_group is None else torch.distributed.get_world_size(self.cp_group)

    def extra_repr(self):
        return (f"heads={self.num_attention_heads}, gqa_groups={self.num_gqa_groups}, "
                f"head_dim={self.kv_channels}, qkv_format={self.qkv_format}, "
                f"attn_mask_type={self.attn_mask_type}, window_size={self.window_size}")

    def forward(self, query_layer, key_layer, value_layer, attention_mask=None, qkv_format=None,
                cu_seqlens_q=None, cu_seqlens_kv=None, cu_seqlens_q_padded=None,
                cu_seqlens_kv_padded=None, max_seqlen_q=None, max_seqlen_kv=None,
                attn_mask_type=None, window_size=None, *, checkpoint_core_attention=False,
                core_attention_bias_type="no_bias", core_attention_bias=None, alibi_slopes=None,
                fast_zero_fill=True, inference_params=None):
        qkv_format = qkv_format or self.qkv_format
        attn_mask_type = check_mask_type("DotProductAttention", attn_mask_type or self.attn_mask_type)
        window_size = window_size if window_size is not None else self.window_size
        window_size = check_window("DotProductAttention", attn_mask_type, window_size)
        for name, value, off in (("core_attention_bias_type", core_attention_bias_type, "no_bias"),
                                 ("core_attention_bias", core_attention_bias, None),
                                 ("alibi_slopes", alibi_slopes, None)):
            if not (value is off or (isinstance(value, str) and value == off)):
                shown = "a tensor" if isinstance(value, torch.Tensor) else repr(value)
                raise NotImplementedError(f"DotProductAttention: argument '{name}'={shown} is not supported: "
                                          "attention biases (ALiBi, pre/post-scale bias) are not implemented")
        if inference_params is not None:
            raise NotImplementedError("DotProductAttention: inference_params (KV cache) is not supported")
        if checkpoint_core_attention and torch.is_grad_enabled():
            # recompute this call in the backward instead of keeping its saved tensors (TE's meaning);
            # seqfuse.quantization.checkpoint keeps the FP8 settings and restores dropout's random state
            from ..quantization import checkpoint as recompute
            return recompute(self.forward, query_layer, key_layer, value_layer, attention_mask=attention_mask,
                             qkv_format=qkv_format, cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv,
                             cu_seqlens_q_padded=cu_seqlens_q_padded, cu_seqlens_kv_padded=cu_seqlens_kv_padded,
                             max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv,
                             attn_mask_type=attn_mask_type, window_size=window_size)
        for name, padded, plain in (("cu_seqlens_q_padded", cu_seqlens_q_padded, cu_seqlens_q),
                                    ("cu_seqlens_kv_padded", cu_seqlens_kv_padded, cu_seqlens_kv)):
            if padded is not None and not (padded is plain or torch.equal(padded, plain)):
                raise NotImplementedError(f"DotProductAttention: {name} different from the unpadded "
                                          "cu_seqlens (padding between packed sequences) is not supported")
        for name, x in (("query_layer", query_layer), ("key_layer", key_layer), ("value_layer", value_layer)):
            check_input("DotProductAttention", x, name=name, min_dim=3)  # [t, h, d] or [b, s, h, d]
            rank = 3 if qkv_format == "thd" else 4
            if x.dim() != rank:
                raise ValueError(f"DotProductAttention: {name} must have {rank} dimensions for qkv_format "
                                 f"{qkv_format!r}, got shape {tuple(x.shape)}")
        heads, dim = query_layer.shape[-2], query_layer.shape[-1]
        if heads != self.num_attention_heads or dim != self.kv_channels:
            raise ValueError(f"DotProductAttention: query_layer has {heads} heads of dim {dim}; the module "
                             f"was built for {self.num_attention_heads} heads of dim {self.kv_channels}")
        if key_layer.shape[-2] != self.num_gqa_groups:
            raise ValueError(f"DotProductAttention: key_layer has {key_layer.shape[-2]} heads; the module "
                             f"was built for num_gqa_groups={self.num_gqa_groups}")
        if attention_mask is not None and (qkv_format == "thd" or not isinstance(attn_mask_type, str)
                                           or "padding" not in attn_mask_type):
            raise ValueError(f"DotProductAttention: attention_mask is taken only with a padding attn_mask_type "
                             f"in bshd/sbhd (it would be ignored); got attn_mask_type {attn_mask_type!r}, "
                             f"qkv_format {qkv_format!r}")
        # (the high-precision path, too, ignores cu_seqlens under a non-padding mask in bshd / sbhd)
        padded = (attention_mask is not None or qkv_format == "thd"
                  or (isinstance(attn_mask_type, str) and "padding" in attn_mask_type))
        state = self._fp8_attention_state(query_layer, key_layer, value_layer, qkv_format, attn_mask_type,
                                          window_size, padded)
        if state is not None:
            out = fp8_attn.fp8_attention(query_layer, key_layer, value_layer, state, qkv_format=qkv_format,
                                         attn_mask_type=attn_mask_type, softmax_scale=self.softmax_scale,
                                         deterministic=self.deterministic)
            return out.reshape(out.shape[:-2] + (heads * dim,))
        if self._cp_size() > 1:
            return self._context_parallel(query_layer, key_layer, value_layer, attention_mask, qkv_format,
                                          attn_mask_type, window_size, cu_seqlens_q, cu_seqlens_kv,
                                          max_seqlen_q, max_seqlen_kv)
        if "padding" in attn_mask_type and qkv_format != "thd" and cu_seqlens_q is None:
            if attention_mask is None:
                raise ValueError(f"DotProductAttention: attn_mask_type {attn_mask_type!r} needs an "
                                 "attention_mask or cu_seqlens_q/cu_seqlens_kv")
            if qkv_format not in ("bshd", "sbhd"):
                raise ValueError(f"DotProductAttention: qkv_format must be 'bshd', 'sbhd' or 'thd', "
                                 f"got {qkv_format!r}")
            layout = _mask_layout(attention_mask, query_layer, key_layer, qkv_format, attn_mask_type)
            if layout.qkv_format == "thd":
                return self._packed_rows(query_layer, key_layer, value_layer, qkv_format, attn_mask_type,
                                         window_size, layout)
            cu_seqlens_q, cu_seqlens_kv = layout.cu_seqlens_q, layout.cu_seqlens_kv
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

    def _fp8_attention_state(self, q, k, v, qkv_format, attn_mask_type, window_size, padded):
        """This call's FP8 attention state under an autocast whose recipe has
        fp8_dpa=True (made at the first such call, kept as child "fp8_state"),
        or None: FP8 off, or the call is one FP8 attention cannot take (logged
        as a WARNING naming the rule, once per rule; the call then runs the
        attention in q's dtype, as Transformer Engine falls back)."""
        st = autocast_state()
        if not st.enabled or not getattr(st.recipe, "fp8_dpa", False):
            return None
        recipe = st.recipe
        needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
        why = fp8_attn.refusal(recipe, q, k, qkv_format, attn_mask_type, window_size,
                               self.attention_dropout if self.training else 0.0, padded, needs_grad)
        if why is None and self._cp_size() > 1:
            why = "FP8 attention does not run under context parallelism"
        if why is not None:
            if why not in _fp8_refusals_logged:
                _fp8_refusals_logged.add(why)
                _log.warning("seqfuse DotProductAttention: fp8_dpa=True, but this call runs the attention in %s: "
                             "%s", str(q.dtype).replace("torch.", ""), why)
            return None
        return self.init_fp8_attention_state(recipe, q.device)

    def init_fp8_attention_state(self, recipe, device=None):
        """The module's FP8 attention state under ``recipe`` (child
        "fp8_state", nine tensors: seqfuse.quantization.attention), made now
        if it does not exist, so a checkpoint with one loads before the first
        forward (seqfuse.quantization.init_fp8_state calls this)."""
        state = self._modules.get("fp8_state")
        if state is None:
            state = fp8_attn.attention_state(recipe, device)
            self.add_module("fp8_state", state)
        elif state.recipe is not recipe and state.recipe != recipe:
            state.set_recipe(recipe)
        if device is not None and state.amax_history.device != torch.device(device):
            state.to(device)
        return state

    def _context_parallel(self, q, k, v, attention_mask, qkv_format, attn_mask_type, window_size,
                          cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv):
        """This rank's share of the attention under context parallelism
        (seqfuse.distributed.context_parallel_attention), heads flattened."""
        who = "DotProductAttention"
        if self.training and self.attention_dropout > 0:
            raise NotImplementedError(f"{who}: attention_dropout ({self.attention_dropout}) with context "
                                      "parallelism is not supported (set it to 0, or run in eval mode)")
        if attention_mask is not None:
            raise NotImplementedError(f"{who}: attention_mask with context parallelism is not supported (pack "
                                      "the sequences as thd with cu_seqlens instead)")
        if qkv_format == "thd" and cu_seqlens_kv is None:
            cu_seqlens_kv = cu_seqlens_q
        out = context_parallel_attention(
            q, k, v, cp_group=self.cp_group, cp_global_ranks=self.cp_global_ranks, cp_stream=self.cp_stream,
            cp_comm_type=self.cp_comm_type, qkv_format=qkv_format, attn_mask_type=attn_mask_type,
            cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv, max_seqlen_q=max_seqlen_q,
            max_seqlen_kv=max_seqlen_kv, window_size=window_size, softmax_scale=self.softmax_scale,
            deterministic=self.deterministic)
        return out.reshape(out.shape[:-2] + (out.shape[-2] * out.shape[-1],))

    def _packed_rows(self, q, k, v, qkv_format, attn_mask_type, window_size, layout):
        """Left or both-sided padding: the rows end to end as thd sequences
        (padding_layout); back to the caller's layout, heads flattened."""
        if qkv_format == "sbhd":  # [s, b, h, d] -> [b, s, h, d] (a copy: thd needs each row's tokens together)
            q, k, v = (x.transpose(0, 1) for x in (q, k, v))
        b, s_q, heads, dim = q.shape
        q, k, v = (x.reshape(-1, x.shape[2], x.shape[3]) for x in (q, k, v))
        out = ops.attention(q, k, v, qkv_format="thd", attn_mask_type=attn_mask_type,
                            cu_seqlens_q=layout.cu_seqlens_q, cu_seqlens_kv=layout.cu_seqlens_kv,
                            max_seqlen_q=layout.max_seqlen_q, max_seqlen_kv=layout.max_seqlen_kv,
                            window_size=window_size, softmax_scale=self.softmax_scale,
                            deterministic=self.deterministic,
                            dropout_p=self.attention_dropout if self.training else 0.0)
        out = out.view(b, s_q, heads * dim)
        if layout.poison is not None:  # CUDA graph capture: a row with a hole comes out NaN
            out = out + layout.poison.to(out.dtype)[:, None, None]
        return out.transpose(0, 1).contiguous() if qkv_format == "sbhd" else out
