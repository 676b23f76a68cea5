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
import functools

import torch

from .qkv import fuse_qkv, split_qkv
from .state_dict import ModelFamily, check_keys, check_shapes, check_tied, family_functions

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
HF_QKV = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
SF_QKV = "self_attention.layernorm_qkv.weight"
_GATE_UP = ("mlp.gate_proj.weight", "mlp.up_proj.weight")
_SF_FC1 = "layernorm_mlp.fc1_weight"

LM_HEAD = "lm_head.weight"
EMBED = "model.embed_tokens.weight"


def shared_keys(config):
    """The keys named the same on both sides (Llama's layout, Mixtral's too)."""
    keys = [EMBED, "model.norm.weight"]
    if not config.tie_word_embeddings:
        keys.append(LM_HEAD)
    return keys


def layer_keys(config, suffixes):
    """shared_keys(config), then for every layer its prefix joined to each of ``suffixes``."""
    keys = shared_keys(config)
    for i in range(config.num_hidden_layers):
        keys += [LAYER.format(i) + s for s in suffixes]
    return keys


def hf_keys(config):
    """Every key a transformers LlamaForCausalLM state dict must hold for
    ``config`` (lm_head.weight may be absent when tied)."""
    return layer_keys(config, [h for h, _ in _LAYER_RENAMES] + list(HF_QKV + _GATE_UP))


def seqfuse_keys(config):
    """Every key a SeqfuseLlamaForCausalLM state dict holds for ``config``
    (lm_head.weight may be absent when tied)."""
    return layer_keys(config, [s for _, s in _LAYER_RENAMES] + [SF_QKV, _SF_FC1])


def outer_shapes(sd, config):
    """{key: shape} of the keys outside the layers (embeddings, final norm,
    and the LM head when ``sd`` holds it), the same on both sides."""
    h, v = config.hidden_size, config.vocab_size
    want = {EMBED: (v, h), "model.norm.weight": (h,)}
    if LM_HEAD in sd:
        want[LM_HEAD] = (v, h)
    return want


def attention_shapes(p, config, side):
    """{key: shape} of the attention half of the layer with key prefix ``p``
    (its input norm, QKV and output projection) on ``side`` ("transformers"
    or "seqfuse"), in Llama's layout (Mixtral's too)."""
    h, d = config.hidden_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    if side == "transformers":
        return {p + "input_layernorm.weight": (h,), p + HF_QKV[0]: (q, h), p + HF_QKV[1]: (kv, h),
                p + HF_QKV[2]: (kv, h), p + "self_attn.o_proj.weight": (h, q)}
    return {p + "self_attention.layernorm_qkv.layer_norm_weight": (h,), p + SF_QKV: (q + 2 * kv, h),
            p + "self_attention.proj.weight": (h, q)}


def _check_shapes(sd, config, side):
    h, f = config.hidden_size, config.intermediate_size
    want = outer_shapes(sd, config)
    for i in range(config.num_hidden_layers):
        p = LAYER.format(i)
        want.update(attention_shapes(p, config, side))
        if side == "transformers":
            want.update({p + "post_attention_layernorm.weight": (h,), p + _GATE_UP[0]: (f, h),
                         p + _GATE_UP[1]: (f, h), p + "mlp.down_proj.weight": (h, f)})
        else:
            want.update({p + "layernorm_mlp.layer_norm_weight": (h,), p + _SF_FC1: (2 * f, h),
                         p + "layernorm_mlp.fc2_weight": (h, f)})
    check_shapes(sd, want, side)


def attention_to_seqfuse(hf_sd, config, renames):
    """The part of a seqfuse state dict that Llama's layout shares with
    Mixtral's, from a transformers state dict whose keys and shapes are
    checked already: the keys outside the layers, per layer the keys renamed
    one to one (``renames``: (HF suffix, seqfuse suffix) pairs) and the QKV
    fused in TE's order, and the LM head tied to the embedding when the
    config ties them and ``hf_sd`` holds it (the same tensor: check_tied).
    The family adds its MLP."""
    check_tied(hf_sd, LM_HEAD, EMBED, config, "transformers")
    out = {k: hf_sd[k] for k in shared_keys(config)}
    for i in range(config.num_hidden_layers):
        p = LAYER.format(i)
        for h, s in renames:
            out[p + s] = hf_sd[p + h]
        q, k, v = (hf_sd[p + n] for n in HF_QKV)
        out[p + SF_QKV] = fuse_qkv(q, k, v, config.num_attention_heads, config.num_key_value_heads,
                                    interleaved=QKV_INTERLEAVED)
    if config.tie_word_embeddings and LM_HEAD in hf_sd:
        out[LM_HEAD] = out[EMBED]
    return out


def attention_to_hf(sf_sd, config, renames):
    """attention_to_seqfuse's way back: the part of a transformers state
    dict that Llama's layout shares with Mixtral's, from a checked seqfuse
    state dict (the QKV split back into q, k and v; the LM head always
    written, as the embedding, when the config ties them).  The family adds
    its MLP."""
    check_tied(sf_sd, LM_HEAD, EMBED, config, "seqfuse")
    out = {k: sf_sd[k] for k in shared_keys(config)}
    for i in range(config.num_hidden_layers):
        p = LAYER.format(i)
        for h, s in renames:
            out[p + h] = sf_sd[p + s]
        q, k, v = split_qkv(sf_sd[p + SF_QKV], config.num_attention_heads, config.num_key_value_heads,
                            interleaved=QKV_INTERLEAVED)
        for n, t in zip(HF_QKV, (q, k, v)):
            out[p + n] = t
    if config.tie_word_embeddings:
        out[LM_HEAD] = out[EMBED]
    return out


def hf_to_seqfuse_state_dict(hf_sd, config):
    """seqfuse state dict from a transformers LlamaForCausalLM state dict
    (``config``: the SeqfuseLlamaConfig)."""
    check_keys(hf_sd, hf_keys(config), "transformers", optional=(LM_HEAD,))
    _check_shapes(hf_sd, config, "transformers")
    out = attention_to_seqfuse(hf_sd, config, _LAYER_RENAMES)
    for i in range(config.num_hidden_layers):
        p = LAYER.format(i)
        out[p + _SF_FC1] = torch.cat([hf_sd[p + n] for n in _GATE_UP], dim=0)
    return out


def seqfuse_to_hf_state_dict(sf_sd, config):
    """transformers LlamaForCausalLM state dict from a seqfuse one."""
    check_keys(sf_sd, seqfuse_keys(config), "seqfuse", optional=(LM_HEAD,))
    _check_shapes(sf_sd, config, "seqfuse")
    out = attention_to_hf(sf_sd, config, _LAYER_RENAMES)
    for i in range(config.num_hidden_layers):
        p = LAYER.format(i)
        gate, up = sf_sd[p + _SF_FC1].chunk(2, dim=0)
        out[p + _GATE_UP[0]], out[p + _GATE_UP[1]] = gate.clone(), up.clone()
    return out


# ------------------------------------------------------------ model level
def _ignore_rotary_inv_freq(key):
    """Older transformers saved each layer's rotary inv_freq, which is computed from the config."""
    return key.endswith("rotary_emb.inv_freq")


def causal_lm_family(hf_model, hf_config, seqfuse_model, config_from_hf, config_to_hf, to_seqfuse, to_hf):
    """A ModelFamily (state_dict.py) with the checkpoint rules of Llama's
    layout, which Mixtral shares: lm_head.weight may be absent when tied, and
    a stored rotary inv_freq is ignored."""
    return ModelFamily(hf_model=hf_model, hf_config=hf_config, seqfuse_model=seqfuse_model,
                       config_from_hf=config_from_hf, config_to_hf=config_to_hf, to_seqfuse=to_seqfuse, to_hf=to_hf,
                       checkpoint_optional=lambda config: (LM_HEAD,) if config.tie_word_embeddings else (),
                       ignore_unexpected=_ignore_rotary_inv_freq)


@functools.cache
def family():
    """The Llama ModelFamily: transformers' LlamaForCausalLM and
    SeqfuseLlamaForCausalLM, with this module's mappings."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from .llama import SeqfuseLlamaForCausalLM
    from .llama_config import from_hf_config, to_hf_config

    return causal_lm_family(LlamaForCausalLM, LlamaConfig, SeqfuseLlamaForCausalLM, from_hf_config, to_hf_config,
                            hf_to_seqfuse_state_dict, seqfuse_to_hf_state_dict)


from_hf_model, to_hf_model, export_hf, from_hf_pretrained = family_functions(
    family, seqfuse_model="SeqfuseLlamaForCausalLM", hf_model="LlamaForCausalLM")
