"""Weight conversion between transformers' MixtralForCausalLM and seqfuse's
SeqfuseMixtralForCausalLM, both ways, and the export of a seqfuse Mixtral as
a directory transformers' own MixtralForCausalLM (and
AutoModelForCausalLM) loads.

Mapping (per layer i; E experts):

  HF  model.layers.i.                    seqfuse  model.layers.i.
    input_layernorm.weight                 self_attention.layernorm_qkv.layer_norm_weight
    self_attn.{q,k,v}_proj.weight          self_attention.layernorm_qkv.weight  (fused, TE's
                                             interleaved order: see qkv.py)
    self_attn.o_proj.weight                self_attention.proj.weight
    post_attention_layernorm.weight        pre_mlp_layernorm.weight
    mlp.gate.weight [E, h]                 mlp.router_weight
    mlp.experts.gate_up_proj [E, 2f, h]    mlp.fc1.weight{e} [2f, h]  (one per expert; rows
                                             [0, f) the gate, as TE's SwiGLU and transformers'
                                             chunk both read them)
    mlp.experts.down_proj [E, h, f]        mlp.fc2.weight{e} [h, f]

transformers 5 holds the experts stacked (its checkpoints on disk may use
the older per-expert w1/w2/w3 names; transformers converts those when it
loads, so the in-memory state dict above is what this module reads and
writes).  The embeddings, final norm and LM head keep their names, and
lm_head.weight may be absent when tied.  Only tensors are moved (split
along the expert dimension, or stacked), never recomputed, so HF ->
seqfuse -> HF is bit-identical.  Missing keys raise KeyError naming them,
unexpected keys and wrong shapes ValueError naming them.
"""
import functools

import torch

from .llama_convert import (HF_QKV, LAYER, LM_HEAD, SF_QKV, attention_shapes, attention_to_hf, attention_to_seqfuse,
                            causal_lm_family, layer_keys, outer_shapes)
from .state_dict import check_keys, check_shapes, family_functions

# Llama's layout (llama_convert) gives the layer prefix, the fused QKV, the
# embeddings, final norm and LM head, and converts them (attention_to_seqfuse,
# attention_to_hf); (HF suffix, seqfuse suffix) inside one
# layer, besides the fused QKV and the experts:
_LAYER_RENAMES = (
    ("input_layernorm.weight", "self_attention.layernorm_qkv.layer_norm_weight"),
    ("self_attn.o_proj.weight", "self_attention.proj.weight"),
    ("post_attention_layernorm.weight", "pre_mlp_layernorm.weight"),
    ("mlp.gate.weight", "mlp.router_weight"),
)
_GATE_UP = "mlp.experts.gate_up_proj"
_DOWN = "mlp.experts.down_proj"
_SF_FC1 = "mlp.fc1.weight{}"
_SF_FC2 = "mlp.fc2.weight{}"


def hf_keys(config):
    """Every key a transformers MixtralForCausalLM state dict must hold for
    ``config`` (lm_head.weight may be absent when tied)."""
    return layer_keys(config, [h for h, _ in _LAYER_RENAMES] + list(HF_QKV + (_GATE_UP, _DOWN)))


def seqfuse_keys(config):
    """Every key a SeqfuseMixtralForCausalLM state dict holds for ``config``
    (lm_head.weight may be absent when tied)."""
    experts = range(config.num_local_experts)
    return layer_keys(config, [s for _, s in _LAYER_RENAMES] + [SF_QKV] + [_SF_FC1.format(e) for e in experts]
                      + [_SF_FC2.format(e) for e in experts])


def _check_shapes(sd, config, side):
    h, f, n = config.hidden_size, config.intermediate_size, config.num_local_experts
    want = outer_shapes(sd, config)
    for i in range(config.num_hidden_layers):
        p = LAYER.format(i)
        want.update(attention_shapes(p, config, side))
        if side == "transformers":
            want.update({p + "post_attention_layernorm.weight": (h,), p + "mlp.gate.weight": (n, h),
                         p + _GATE_UP: (n, 2 * f, h), p + _DOWN: (n, h, f)})
        else:
            want.update({p + "pre_mlp_layernorm.weight": (h,), p + "mlp.router_weight": (n, h)})
            want.update({p + _SF_FC1.format(e): (2 * f, h) for e in range(n)})
            want.update({p + _SF_FC2.format(e): (h, f) for e in range(n)})
    check_shapes(sd, want, side)


def hf_to_seqfuse_state_dict(hf_sd, config):
    """seqfuse state dict from a transformers MixtralForCausalLM state dict
    (``config``: the SeqfuseMixtralConfig).  The experts' tensors are views
    of the stacked ones (build_and_load copies them)."""
    check_keys(hf_sd, hf_keys(config), "transformers", optional=(LM_HEAD,))
    _check_shapes(hf_sd, config, "transformers")
    out = attention_to_seqfuse(hf_sd, config, _LAYER_RENAMES)
    for i in range(config.num_hidden_layers):
        p = LAYER.format(i)
        for e in range(config.num_local_experts):
            out[p + _SF_FC1.format(e)] = hf_sd[p + _GATE_UP][e]
            out[p + _SF_FC2.format(e)] = hf_sd[p + _DOWN][e]
    return out


def seqfuse_to_hf_state_dict(sf_sd, config):
    """transformers MixtralForCausalLM state dict from a seqfuse one."""
    check_keys(sf_sd, seqfuse_keys(config), "seqfuse", optional=(LM_HEAD,))
    _check_shapes(sf_sd, config, "seqfuse")
    out = attention_to_hf(sf_sd, config, _LAYER_RENAMES)
    experts = range(config.num_local_experts)
    for i in range(config.num_hidden_layers):
        p = LAYER.format(i)
        out[p + _GATE_UP] = torch.stack([sf_sd[p + _SF_FC1.format(e)] for e in experts])
        out[p + _DOWN] = torch.stack([sf_sd[p + _SF_FC2.format(e)] for e in experts])
    return out


# ------------------------------------------------------------ model level
@functools.cache
def family():
    """The Mixtral ModelFamily (state_dict.py), with Llama's checkpoint rules:
    transformers' MixtralForCausalLM and SeqfuseMixtralForCausalLM, with this
    module's mappings."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from .mixtral import SeqfuseMixtralForCausalLM
    from .mixtral_config import from_hf_config, to_hf_config

    return causal_lm_family(MixtralForCausalLM, MixtralConfig, SeqfuseMixtralForCausalLM, from_hf_config,
                            to_hf_config, hf_to_seqfuse_state_dict, seqfuse_to_hf_state_dict)


from_hf_model, to_hf_model, export_hf, from_hf_pretrained = family_functions(
    family, seqfuse_model="SeqfuseMixtralForCausalLM", hf_model="MixtralForCausalLM")
