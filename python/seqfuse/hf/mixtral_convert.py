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
import os

import torch

from .qkv import fuse_qkv, split_qkv
from .state_dict import build_and_load, check_keys, check_shapes, load_hf_checkpoint, strip_extra_state

LAYER = "model.layers.{}."
#: seqfuse's fused QKV follows TE's default (interleaved per key/value group).
QKV_INTERLEAVED = True

# (HF suffix, seqfuse suffix) inside one layer, besides the fused QKV and the experts.
_LAYER_RENAMES = (
    ("input_layernorm.weight", "self_attention.layernorm_qkv.layer_norm_weight"),
    ("self_attn.o_proj.weight", "self_attention.proj.weight"),
    ("post_attention_layernorm.weight", "pre_mlp_layernorm.weight"),
    ("mlp.gate.weight", "mlp.router_weight"),
)
_QKV = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
_SF_QKV = "self_attention.layernorm_qkv.weight"
_GATE_UP = "mlp.experts.gate_up_proj"
_DOWN = "mlp.experts.down_proj"
_SF_FC1 = "mlp.fc1.weight{}"
_SF_FC2 = "mlp.fc2.weight{}"

_LM_HEAD = "lm_head.weight"
_EMBED = "model.embed_tokens.weight"


def _shared_keys(config):
    keys = [_EMBED, "model.norm.weight"]
    if not config.tie_word_embeddings:
        keys.append(_LM_HEAD)
    return keys


def hf_keys(config):
    """Every key a transformers MixtralForCausalLM state dict must hold for
    ``config`` (lm_head.weight may be absent when tied)."""
    keys = _shared_keys(config)
    for i in range(config.num_hidden_layers):
        p = LAYER.format(i)
        keys += [p + h for h, _ in _LAYER_RENAMES] + [p + k for k in _QKV + (_GATE_UP, _DOWN)]
    return keys


def seqfuse_keys(config):
    """Every key a SeqfuseMixtralForCausalLM state dict holds for ``config``
    (lm_head.weight may be absent when tied)."""
    keys = _shared_keys(config)
    for i in range(config.num_hidden_layers):
        p = LAYER.format(i)
        keys += [p + s for _, s in _LAYER_RENAMES] + [p + _SF_QKV]
        keys += [p + _SF_FC1.format(e) for e in range(config.num_local_experts)]
        keys += [p + _SF_FC2.format(e) for e in range(config.num_local_experts)]
    return keys


def _check_shapes(sd, config, side):
    h, f, v, d = config.hidden_size, config.intermediate_size, config.vocab_size, config.head_dim
    n = config.num_local_experts
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    want = {_EMBED: (v, h), "model.norm.weight": (h,)}
    if _LM_HEAD in sd:
        want[_LM_HEAD] = (v, h)
    for i in range(config.num_hidden_layers):
        p = LAYER.format(i)
        if side == "transformers":
            want.update({p + "input_layernorm.weight": (h,), p + _QKV[0]: (q, h), p + _QKV[1]: (kv, h),
                         p + _QKV[2]: (kv, h), p + "self_attn.o_proj.weight": (h, q),
                         p + "post_attention_layernorm.weight": (h,), p + "mlp.gate.weight": (n, h),
                         p + _GATE_UP: (n, 2 * f, h), p + _DOWN: (n, h, f)})
        else:
            want.update({p + _LAYER_RENAMES[0][1]: (h,), p + _SF_QKV: (q + 2 * kv, h),
                         p + "self_attention.proj.weight": (h, q), p + "pre_mlp_layernorm.weight": (h,),
                         p + "mlp.router_weight": (n, h)})
            want.update({p + _SF_FC1.format(e): (2 * f, h) for e in range(n)})
            want.update({p + _SF_FC2.format(e): (h, f) for e in range(n)})
    check_shapes(sd, want, side)


def hf_to_seqfuse_state_dict(hf_sd, config):
    """seqfuse state dict from a transformers MixtralForCausalLM state dict
    (``config``: the SeqfuseMixtralConfig).  The experts' tensors are views
    of the stacked ones (build_and_load copies them)."""
    check_keys(hf_sd, hf_keys(config), "transformers", optional=(_LM_HEAD,))
    _check_shapes(hf_sd, config, "transformers")
    out = {k: hf_sd[k] for k in _shared_keys(config)}
    for i in range(config.num_hidden_layers):
        p = LAYER.format(i)
        for h, s in _LAYER_RENAMES:
            out[p + s] = hf_sd[p + h]
        q, k, v = (hf_sd[p + n] for n in _QKV)
        out[p + _SF_QKV] = fuse_qkv(q, k, v, config.num_attention_heads, config.num_key_value_heads,
                                    interleaved=QKV_INTERLEAVED)
        for e in range(config.num_local_experts):
            out[p + _SF_FC1.format(e)] = hf_sd[p + _GATE_UP][e]
            out[p + _SF_FC2.format(e)] = hf_sd[p + _DOWN][e]
    if config.tie_word_embeddings and _LM_HEAD in hf_sd:
        out[_LM_HEAD] = out[_EMBED]
    return out


def seqfuse_to_hf_state_dict(sf_sd, config):
    """transformers MixtralForCausalLM state dict from a seqfuse one."""
    check_keys(sf_sd, seqfuse_keys(config), "seqfuse", optional=(_LM_HEAD,))
    _check_shapes(sf_sd, config, "seqfuse")
    out = {k: sf_sd[k] for k in _shared_keys(config)}
    experts = range(config.num_local_experts)
    for i in range(config.num_hidden_layers):
        p = LAYER.format(i)
        for h, s in _LAYER_RENAMES:
            out[p + h] = sf_sd[p + s]
        q, k, v = split_qkv(sf_sd[p + _SF_QKV], config.num_attention_heads, config.num_key_value_heads,
                            interleaved=QKV_INTERLEAVED)
        for n, t in zip(_QKV, (q, k, v)):
            out[p + n] = t
        out[p + _GATE_UP] = torch.stack([sf_sd[p + _SF_FC1.format(e)] for e in experts])
        out[p + _DOWN] = torch.stack([sf_sd[p + _SF_FC2.format(e)] for e in experts])
    if config.tie_word_embeddings:
        out[_LM_HEAD] = out[_EMBED]
    return out


# ------------------------------------------------------------ model level
def from_hf_model(hf_model):
    """SeqfuseMixtralForCausalLM holding copies of the weights of transformers'
    MixtralForCausalLM, each tensor in its dtype, on the same device.  The
    config must be representable (see seqfuse.hf.mixtral_config.from_hf_config)."""
    from transformers import MixtralForCausalLM

    from .mixtral import SeqfuseMixtralForCausalLM
    from .mixtral_config import from_hf_config

    if not isinstance(hf_model, MixtralForCausalLM):
        raise TypeError(f"from_hf_model: expected transformers.MixtralForCausalLM, got {type(hf_model).__name__}")
    config = from_hf_config(hf_model.config)
    sd = hf_to_seqfuse_state_dict(hf_model.state_dict(), config)
    return build_and_load(SeqfuseMixtralForCausalLM, config, sd, hf_model)


def to_hf_model(model):
    """transformers' MixtralForCausalLM holding copies of the weights of a
    SeqfuseMixtralForCausalLM."""
    from transformers import MixtralForCausalLM

    from .mixtral import SeqfuseMixtralForCausalLM
    from .mixtral_config import to_hf_config

    if not isinstance(model, SeqfuseMixtralForCausalLM):
        raise TypeError(f"to_hf_model: expected SeqfuseMixtralForCausalLM, got {type(model).__name__}")
    sd = seqfuse_to_hf_state_dict(strip_extra_state(model.state_dict()), model.config)
    return build_and_load(MixtralForCausalLM, to_hf_config(model.config), sd, model)


def export_hf(model, path, **save_kwargs):
    """Write ``model`` (a SeqfuseMixtralForCausalLM) to directory ``path`` as
    a transformers MixtralForCausalLM checkpoint (config.json with
    model_type "mixtral", safetensors weights in the model's dtype), which
    ``transformers.MixtralForCausalLM.from_pretrained`` and
    ``AutoModelForCausalLM.from_pretrained`` load with no seqfuse installed.
    ``save_kwargs`` go to transformers' save_pretrained.  Returns ``path``."""
    hf = to_hf_model(model)
    hf.save_pretrained(path, **save_kwargs)
    return path


def from_hf_pretrained(path, dtype=None, device=None):
    """SeqfuseMixtralForCausalLM from a local transformers MixtralForCausalLM
    checkpoint directory.  transformers reads the files (and converts
    per-expert checkpoints to its stacked experts); unlike transformers, a
    weight missing from the checkpoint raises KeyError naming it instead of
    being initialised at random, and the config is checked (from_hf_config)
    before any weight is read."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from .mixtral_config import from_hf_config

    if not os.path.isdir(path):
        raise FileNotFoundError(f"from_hf_pretrained: {path!r} is not a local directory")
    config = from_hf_config(MixtralConfig.from_pretrained(path))  # refuses unrepresentable configs up front
    optional = (_LM_HEAD,) if config.tie_word_embeddings else ()
    hf = load_hf_checkpoint(MixtralForCausalLM, path, dtype, optional=optional,
                            ignore_unexpected=lambda k: k.endswith("rotary_emb.inv_freq"))
    model = from_hf_model(hf)
    return model if device is None else model.to(device)
