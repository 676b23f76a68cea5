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

from .llama_convert import EMBED, HF_QKV, LAYER, LM_HEAD, QKV_INTERLEAVED, SF_QKV, causal_lm_family, shared_keys
from .qkv import fuse_qkv, split_qkv
from .state_dict import check_keys, check_shapes

# Llama's layout (llama_convert) gives the layer prefix, the fused QKV, the
# embeddings, final norm and LM head; (HF suffix, seqfuse suffix) inside one
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
    keys = shared_keys(config)
    for i in range(config.num_hidden_layers):
        p = LAYER.format(i)
        keys += [p + h for h, _ in _LAYER_RENAMES] + [p + k for k in HF_QKV + (_GATE_UP, _DOWN)]
    return keys


def seqfuse_keys(config):
    """Every key a SeqfuseMixtralForCausalLM state dict holds for ``config``
    (lm_head.weight may be absent when tied)."""
    keys = shared_keys(config)
    for i in range(config.num_hidden_layers):
        p = LAYER.format(i)
        keys += [p + s for _, s in _LAYER_RENAMES] + [p + SF_QKV]
        keys += [p + _SF_FC1.format(e) for e in range(config.num_local_experts)]
        keys += [p + _SF_FC2.format(e) for e in range(config.num_local_experts)]
    return keys


def _check_shapes(sd, config, side):
    h, f, v, d = config.hidden_size, config.intermediate_size, config.vocab_size, config.head_dim
    n = config.num_local_experts
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    want = {EMBED: (v, h), "model.norm.weight": (h,)}
    if LM_HEAD in sd:
        want[LM_HEAD] = (v, h)
    for i in range(config.num_hidden_layers):
        p = LAYER.format(i)
        if side == "transformers":
            want.update({p + "input_layernorm.weight": (h,), p + HF_QKV[0]: (q, h), p + HF_QKV[1]: (kv, h),
                         p + HF_QKV[2]: (kv, h), p + "self_attn.o_proj.weight": (h, q),
                         p + "post_attention_layernorm.weight": (h,), p + "mlp.gate.weight": (n, h),
                         p + _GATE_UP: (n, 2 * f, h), p + _DOWN: (n, h, f)})
        else:
            want.update({p + _LAYER_RENAMES[0][1]: (h,), p + SF_QKV: (q + 2 * kv, h),
                         p + "self_attention.proj.weight": (h, q), p + "pre_mlp_layernorm.weight": (h,),
                         p + "mlp.router_weight": (n, h)})
            want.update({p + _SF_FC1.format(e): (2 * f, h) for e in range(n)})
            want.update({p + _SF_FC2.format(e): (h, f) for e in range(n)})
    check_shapes(sd, want, side)


def hf_to_seqfuse_state_dict(hf_sd, config):
    """seqfuse state dict from a transformers MixtralForCausalLM state dict
    (``config``: the SeqfuseMixtralConfig).  The experts' tensors are views
    of the stacked ones (build_and_load copies them)."""
    check_keys(hf_sd, hf_keys(config), "transformers", optional=(LM_HEAD,))
    _check_shapes(hf_sd, config, "transformers")
    out = {k: hf_sd[k] for k in shared_keys(config)}
    for i in range(config.num_hidden_layers):
        p = LAYER.format(i)
        for h, s in _LAYER_RENAMES:
            out[p + s] = hf_sd[p + h]
        q, k, v = (hf_sd[p + n] for n in HF_QKV)
        out[p + SF_QKV] = fuse_qkv(q, k, v, config.num_attention_heads, config.num_key_value_heads,
                                    interleaved=QKV_INTERLEAVED)
        for e in range(config.num_local_experts):
            out[p + _SF_FC1.format(e)] = hf_sd[p + _GATE_UP][e]
            out[p + _SF_FC2.format(e)] = hf_sd[p + _DOWN][e]
    if config.tie_word_embeddings and LM_HEAD in hf_sd:
        out[LM_HEAD] = out[EMBED]
    return out


def seqfuse_to_hf_state_dict(sf_sd, config):
    """transformers MixtralForCausalLM state dict from a seqfuse one."""
    check_keys(sf_sd, seqfuse_keys(config), "seqfuse", optional=(LM_HEAD,))
    _check_shapes(sf_sd, config, "seqfuse")
    out = {k: sf_sd[k] for k in shared_keys(config)}
    experts = range(config.num_local_experts)
    for i in range(config.num_hidden_layers):
        p = LAYER.format(i)
        for h, s in _LAYER_RENAMES:
            out[p + h] = sf_sd[p + s]
        q, k, v = split_qkv(sf_sd[p + SF_QKV], config.num_attention_heads, config.num_key_value_heads,
                            interleaved=QKV_INTERLEAVED)
        for n, t in zip(HF_QKV, (q, k, v)):
            out[p + n] = t
        out[p + _GATE_UP] = torch.stack([sf_sd[p + _SF_FC1.format(e)] for e in experts])
        out[p + _DOWN] = torch.stack([sf_sd[p + _SF_FC2.format(e)] for e in experts])
    if config.tie_word_embeddings:
        out[LM_HEAD] = out[EMBED]
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


def from_hf_model(hf_model):
    """SeqfuseMixtralForCausalLM holding copies of the weights of transformers'
    MixtralForCausalLM, each tensor in its dtype, on the same device.  The
    config must be representable (see seqfuse.hf.mixtral_config.from_hf_config)."""
    return family().from_hf_model(hf_model)


def to_hf_model(model):
    """transformers' MixtralForCausalLM holding copies of the weights of a
    SeqfuseMixtralForCausalLM."""
    return family().to_hf_model(model)


def export_hf(model, path, **save_kwargs):
    """Write ``model`` (a SeqfuseMixtralForCausalLM) to directory ``path`` as a
    transformers MixtralForCausalLM checkpoint (config.json with model_type
    "mixtral", safetensors weights in the model's dtype), which
    ``transformers.MixtralForCausalLM.from_pretrained`` and
    ``AutoModelForCausalLM.from_pretrained`` load with no seqfuse installed.
    ``save_kwargs`` go to transformers' save_pretrained.  Returns ``path``."""
    return family().export_hf(model, path, **save_kwargs)


def from_hf_pretrained(path, dtype=None, device=None):
    """SeqfuseMixtralForCausalLM from a local transformers MixtralForCausalLM
    checkpoint directory (transformers converts per-expert checkpoints to its stacked experts when it reads them).  Unlike transformers, a weight missing from
    the checkpoint raises KeyError naming it instead of being initialised at
    random, and the config is checked (from_hf_config) before any weight is
    read."""
    return family().from_hf_pretrained(path, dtype, device)
