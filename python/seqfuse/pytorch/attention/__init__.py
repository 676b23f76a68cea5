"""te.DotProductAttention with every constructor argument of Transformer
Engine 2.20's: seqfuse.modules.DotProductAttention (context parallelism
included: cp_group, cp_global_ranks, cp_stream, cp_comm_type), plus TE's
arguments that module does not take or does not use, each refused by name (NotImplementedError with the
reason and what to use instead, from seqfuse.modules.te_compat.REFUSED)
unless given the value that switches it off; ``name`` (TE's debug name) is
kept as an attribute.  The refusal happens here, before the module is built,
so the message names the argument (the module itself takes
sequence_parallel and tp_group without using them).  get_rng_state_tracker:
the attention dropout draws its seed inside the tracker's fork (TE's use of
it).

MultiheadAttention builds seqfuse.modules.DotProductAttention directly: the
arguments it passes are the ones that module takes.

``seqfuse.pytorch.attention.rope`` has TE's rope functions under TE's path,
apply_fused_qkv_rotary_pos_emb among them.
"""
import torch

from ...modules.attention import DotProductAttention as _DotProductAttention
from ...modules.te_compat import rng_fork, take_refused
from . import rope
from .rope import apply_fused_qkv_rotary_pos_emb

__all__ = ["DotProductAttention", "apply_fused_qkv_rotary_pos_emb", "rope"]


#: TE 2.20 forward arguments seqfuse.modules.DotProductAttention does not take: their off values
_TE_FORWARD_OFF = {"bottom_right_diagonal": None, "pad_between_seqs": None, "fp8_output": False,
                   "bf16_backward": False, "num_splits": 1, "score_mod": None, "score_mod_bprop": None,
                   "score_mod_tensors": None, "score_mod_bprop_tensors": None, "qkv_layer": None,
                   "kv_layer": None, "qkv_interleave_dim": -3}
_SCORE_MOD = "custom score modifiers (FlexAttention-style) are not implemented"
#: why each of _TE_FORWARD_OFF is refused when switched on (also the compatibility table's reasons)
FORWARD_REFUSED_WHY = {
    "bottom_right_diagonal": "the attn_mask_type sets the sliding-window diagonal ('causal_bottom_right' for "
                             "bottom-right)",
    "pad_between_seqs": "packed sequences must be contiguous (cu_seqlens_*_padded equal to cu_seqlens_*)",
    "fp8_output": "the attention output is in the inputs' dtype (FP8 attention is not implemented)",
    "bf16_backward": "FP8 attention is not implemented",
    "num_splits": "split-KV decoding is not implemented",
    "score_mod": _SCORE_MOD, "score_mod_bprop": _SCORE_MOD, "score_mod_tensors": _SCORE_MOD,
    "score_mod_bprop_tensors": _SCORE_MOD,
    "qkv_layer": "pass query_layer, key_layer and value_layer (a packed QKV tensor is not taken)",
    "kv_layer": "pass key_layer and value_layer (a packed KV tensor is not taken)",
    "qkv_interleave_dim": "pass query_layer, key_layer and value_layer (a packed QKV tensor is not taken)",
}


class DotProductAttention(_DotProductAttention):
    __doc__ = _DotProductAttention.__doc__

    def __init__(self, num_attention_heads, kv_channels, num_gqa_groups=None, attention_dropout=0.0,
                 qkv_format="sbhd", attn_mask_type="causal", window_size=None, *, layer_number=None,
                 attention_type="self", cp_group=None, cp_global_ranks=None, cp_stream=None,
                 cp_comm_type="p2p", softmax_scale=None, deterministic=False, name=None,
                 get_rng_state_tracker=None, **te_refused):
        take_refused("DotProductAttention", te_refused)
        super().__init__(num_attention_heads, kv_channels, num_gqa_groups=num_gqa_groups,
                         attention_dropout=attention_dropout, qkv_format=qkv_format,
                         attn_mask_type=attn_mask_type, window_size=window_size, layer_number=layer_number,
                         attention_type=attention_type, cp_group=cp_group, cp_global_ranks=cp_global_ranks,
                         cp_stream=cp_stream, cp_comm_type=cp_comm_type, softmax_scale=softmax_scale,
                         deterministic=deterministic)
        self.name = name
        self.get_rng_state_tracker = get_rng_state_tracker

    def forward(self, *args, **kwargs):
        """The module's forward; attention dropout draws its seed inside the
        RNG tracker's fork where one was given (TE).  TE's forward arguments
        the module does not take are accepted at their defaults and refused
        by name otherwise (_TE_FORWARD_OFF)."""
        for name, off in _TE_FORWARD_OFF.items():
            if name in kwargs:
                value = kwargs.pop(name)
                # (False is off for pad_between_seqs; for bottom_right_diagonal it is TE's top-left
                # diagonal, which seqfuse's windows do not take)
                if not (value is off or (name == "pad_between_seqs" and value is False)
                        or (type(value) is type(off) and value == off)):
                    shown = "a tensor" if isinstance(value, torch.Tensor) else repr(value)
                    raise NotImplementedError(f"DotProductAttention: argument '{name}'={shown} is not "
                                              f"supported: {FORWARD_REFUSED_WHY[name]}")
        if self.get_rng_state_tracker is not None and self.training and self.attention_dropout:
            with rng_fork(self.get_rng_state_tracker):
                return super().forward(*args, **kwargs)
        return super().forward(*args, **kwargs)
