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
from ...modules.attention import DotProductAttention as _DotProductAttention
from ...modules.te_compat import rng_fork, take_refused
from . import rope
from .rope import apply_fused_qkv_rotary_pos_emb

__all__ = ["DotProductAttention", "apply_fused_qkv_rotary_pos_emb", "rope"]


class DotProductAttention(_DotProductAttention):
    __doc__ = _DotProductAttention.__doc__

    def __init__(self, num_attention_heads, kv_channels, num_gqa_groups=None, attention_dropout=0.0,
                 qkv_format="sbhd", attn_mask_type="causal", window_size=None, layer_number=None,
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
        RNG tracker's fork where one was given (TE)."""
        if self.get_rng_state_tracker is not None and self.training and self.attention_dropout:
            with rng_fork(self.get_rng_state_tracker):
                return super().forward(*args, **kwargs)
        return super().forward(*args, **kwargs)
