"""Weight conversion between transformers' LlamaForCausalLM and seqfuse's
SeqfuseLlamaForCausalLM, both ways, and the export of a seqfuse Llama as a
directory transformers' own LlamaForCausalLM (and AutoModelForCausalLM)
loads.

Mapping (per layer i; seqfuse names follow Transformer Engine's TransformerLayer):

  HF  model.layers.i.                    seqfuse  model.layers.i.
    input_layernorm.weight                 self_attention.layernorm_qkv.layer_norm_weight
    self_attn.{q,k,v}_proj.weight          self_attention.layernorm_qkv.weight
                                             (fused, TE's order: per key/value group its query
                                             heads, its key head, its value head; see qkv.py)
    self_attn.o_proj.weight                self_attention.proj.weight
    post_attention_layernorm.weight        layernorm_mlp.layer_norm_weight
    mlp.gate_proj.weight, mlp.up_proj      layernorm_mlp.fc1_weight  ([gate; up]: TE's SwiGLU
                                             puts the activated half first)
    mlp.down_proj.weight                   layernorm_mlp.fc2_weight

model.embed_tokens.weight, model.norm.weight and lm_head.weight keep their
names; lm_head.weight may be absent when config.tie_word_embeddings (it is
the embedding then).  The rotary inv_freq is in neither state dict (both
compute it from the config).  Only tensors are moved, never recomputed, so
HF -> seqfuse -> HF is bit-identical.  Missing keys raise KeyError naming
them, unexpected keys and wrong shapes ValueError naming them.
"""
import os

import torch

from .qkv import fuse_qkv, split_qkv
from .state_dict import build_and_load, check_keys, check_shapes, load_hf_checkpoint, strip_extra_state

LAYER = "model.layers.{}."
#: seqfuse's fused QKV follows TE's default (interleaved per key/value group).
QKV_INTERLEAVED = True

# (HF suffix, seqfuse suffix) inside one layer, besides the fused QKV and FC1.
_LAYER_RENAMES = (
    ("input_layernorm.weight", "self_attention.layernorm_qkv.layer_norm_weight"),
    ("self_attn.o_proj.weight", "self_attention.proj.weight"),
    ("post_attention_layernorm.weight", "layernorm_mlp.layer_norm_weight"),
    ("mlp.down_proj.weight", "layernorm_mlp.fc2_weight"),
)
_QKV = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
_SF_QKV = "self_attention.layernorm_qkv.weight"
_GATE_UP = ("mlp.gate_proj.weight", "mlp.up_proj.weight")
_SF_FC1 = "layernorm_mlp.fc1_weight"

_LM_HEAD = "lm_head.weight"
_EMBED = "model.embed_tokens.weight"


def _shared_keys(config):
    keys = [_EMBED, "model.norm.weight"]
    if not config.tie_word_embeddings:
        keys.append(_LM_HEAD)
    return keys


def hf_keys(config):
    """Every key a transformers LlamaForCausalLM state dict must hold for
    ``config`` (lm_head.weight may be absent when tied)."""
    keys = _shared_keys(config)
    for i in range(config.num_hidden_layers):
        p = LAYER.format(i)
        keys += [p + h for h, _ in _LAYER_RENAMES] + [p + k for k in _QKV + _GATE_UP]
    return keys


def seqfuse_keys(config):
    """Every key a SeqfuseLlamaForCausalLM state dict holds for ``config``
    (lm_head.weight may be absent when tied)."""
    keys = _shared_keys(config)
    for i in range(config.num_hidden_layers):
        p = LAYER.format(i)
        keys += [p + s for _, s in _LAYER_RENAMES] + [p + _SF_QKV, p + _SF_FC1]
    return keys


def _check_shapes(sd, config, side):
    h, f, v, d = config.hidden_size, config.intermediate_size, config.vocab_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    want = {_EMBED: (v, h), "model.norm.weight": (h,)}
    if _LM_HEAD in sd:
        want[_LM_HEAD] = (v, h)
    for i in range(config.num_hidden_layers):
        p = LAYER.format(i)
        want[p + "input_layernorm.weight" if side == "transformers" else p + _LAYER_RENAMES[0][1]] = (h,)
        if side == "transformers":
            want.update({p + _QKV[0]: (q, h), p + _QKV[1]: (kv, h), p + _QKV[2]: (kv, h),
                         p + _GATE_UP[0]: (f, h), p + _GATE_UP[1]: (f, h), p + "self_attn.o_proj.weight": (h, q),
                         p + "post_attention_layernorm.weight": (h,), p + "mlp.down_proj.weight": (h, f)})
        else:
            want.update({p + _SF_QKV: (q + 2 * kv, h), p + _SF_FC1: (2 * f, h),
                         p + "self_attention.proj.weight": (h, q), p + "layernorm_mlp.layer_norm_weight": (h,),
                         p + "layernorm_mlp.fc2_weight": (h, f)})
    check_shapes(sd, want, side)


def hf_to_seqfuse_state_dict(hf_sd, config):
    """seqfuse state dict from a transformers LlamaForCausalLM state dict
    (``config``: the SeqfuseLlamaConfig)."""
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
        out[p + _SF_FC1] = torch.cat([hf_sd[p + n] for n in _GATE_UP], dim=0)
    if config.tie_word_embeddings and _LM_HEAD in hf_sd:
        out[_LM_HEAD] = out[_EMBED]
    return out


def seqfuse_to_hf_state_dict(sf_sd, config):
    """transformers LlamaForCausalLM state dict from a seqfuse one."""
    check_keys(sf_sd, seqfuse_keys(config), "seqfuse", optional=(_LM_HEAD,))
    _check_shapes(sf_sd, config, "seqfuse")
    out = {k: sf_sd[k] for k in _shared_keys(config)}
    for i in range(config.num_hidden_layers):
        p = LAYER.format(i)
        for h, s in _LAYER_RENAMES:
            out[p + h] = sf_sd[p + s]
        q, k, v = split_qkv(sf_sd[p + _SF_QKV], config.num_attention_heads, config.num_key_value_heads,
                            interleaved=QKV_INTERLEAVED)
        for n, t in zip(_QKV, (q, k, v)):
            out[p + n] = t
        gate, up = sf_sd[p + _SF_FC1].chunk(2, dim=0)
        out[p + _GATE_UP[0]], out[p + _GATE_UP[1]] = gate.clone(), up.clone()
    if config.tie_word_embeddings:
        out[_LM_HEAD] = out[_EMBED]
    return out


# ------------------------------------------------------------ model level
def from_hf_model(hf_model):
    """SeqfuseLlamaForCausalLM holding copies of the weights of transformers'
    LlamaForCausalLM, each tensor in its dtype, on the same device.  The
    config must be representable (see seqfuse.hf.llama_config.from_hf_config)."""
    from transformers import LlamaForCausalLM

    from .llama import SeqfuseLlamaForCausalLM
    from .llama_config import from_hf_config

    if not isinstance(hf_model, LlamaForCausalLM):
        raise TypeError(f"from_hf_model: expected transformers.LlamaForCausalLM, got {type(hf_model).__name__}")
    config = from_hf_config(hf_model.config)
    sd = hf_to_seqfuse_state_dict(hf_model.state_dict(), config)
    return build_and_load(SeqfuseLlamaForCausalLM, config, sd, hf_model)


def to_hf_model(model):
    """transformers' LlamaForCausalLM holding copies of the weights of a
    SeqfuseLlamaForCausalLM."""
    from transformers import LlamaForCausalLM

    from .llama import SeqfuseLlamaForCausalLM
    from .llama_config import to_hf_config

    if not isinstance(model, SeqfuseLlamaForCausalLM):
        raise TypeError(f"to_hf_model: expected SeqfuseLlamaForCausalLM, got {type(model).__name__}")
    sd = seqfuse_to_hf_state_dict(strip_extra_state(model.state_dict()), model.config)
    return build_and_load(LlamaForCausalLM, to_hf_config(model.config), sd, model)


def export_hf(model, path, **save_kwargs):
    """Write ``model`` (a SeqfuseLlamaForCausalLM) to directory ``path`` as a
    transformers LlamaForCausalLM checkpoint (config.json with model_type
    "llama", safetensors weights in the model's dtype), which
    ``transformers.LlamaForCausalLM.from_pretrained`` and
    ``AutoModelForCausalLM.from_pretrained`` load with no seqfuse installed.
    ``save_kwargs`` go to transformers' save_pretrained.  Returns ``path``."""
    hf = to_hf_model(model)
    hf.save_pretrained(path, **save_kwargs)
    return path


def from_hf_pretrained(path, dtype=None, device=None):
    """SeqfuseLlamaForCausalLM from a local transformers LlamaForCausalLM
    checkpoint directory.  transformers reads the files; unlike
    transformers, a weight missing from the checkpoint raises KeyError naming
    it instead of being initialised at random, and the config is checked
    (from_hf_config) before any weight is read."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from .llama_config import from_hf_config

    if not os.path.isdir(path):
        raise FileNotFoundError(f"from_hf_pretrained: {path!r} is not a local directory")
    config = from_hf_config(LlamaConfig.from_pretrained(path))  # refuses unrepresentable configs up front
    # older transformers saved each layer's rotary inv_freq, which is computed from the config
    optional = (_LM_HEAD,) if config.tie_word_embeddings else ()
    hf = load_hf_checkpoint(LlamaForCausalLM, path, dtype, optional=optional,
                            ignore_unexpected=lambda k: k.endswith("rotary_emb.inv_freq"))
    model = from_hf_model(hf)
    return model if device is None else model.to(device)
