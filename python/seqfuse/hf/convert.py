"""Weight conversion between transformers' EsmForMaskedLM and seqfuse's
SeqfuseEsmForMaskedLM, both ways, and the export of a seqfuse ESM-2 as a
directory transformers' own EsmForMaskedLM loads.

The state-dict functions are the definition of the mapping; the model-level
functions build the other side's model around them.  Mapping (per layer i;
seqfuse names follow Transformer Engine's TransformerLayer):

  HF  esm.encoder.layer.i.                      seqfuse  esm.encoder.layers.i.
    attention.LayerNorm.{weight,bias}             self_attention.layernorm_qkv.layer_norm_{weight,bias}
    attention.self.{query,key,value}.weight       self_attention.layernorm_qkv.weight   (fused, see qkv.py)
    attention.self.{query,key,value}.bias         self_attention.layernorm_qkv.bias     (fused)
    attention.output.dense.{weight,bias}          self_attention.proj.{weight,bias}
    LayerNorm.{weight,bias}                       layernorm_mlp.layer_norm_{weight,bias}
    intermediate.dense.{weight,bias}              layernorm_mlp.fc1_{weight,bias}
    output.dense.{weight,bias}                    layernorm_mlp.fc2_{weight,bias}

Everything else keeps its name (embeddings, rotary inv_freq, the final
emb_layer_norm_after, the LM head).  The LM head decoder is tied to the word
embeddings when config.tie_word_embeddings (ESM-2's case); its key may be
present or absent on either side.  The contact-prediction head
(esm.contact_head.regression) is KEPT: seqfuse's model carries its weights so
the round trip is exact and a converted-back model can still predict
contacts, although seqfuse itself cannot (its fused attention does not
return attention probabilities).

Only tensors are moved, never recomputed, so HF -> seqfuse -> HF is
bit-identical.  Missing keys raise KeyError naming them, unexpected keys and
wrong shapes raise ValueError naming them.
"""
import functools

from .qkv import fuse_qkv, split_qkv
from .state_dict import ModelFamily, check_keys, check_shapes, check_tied, family_functions

HF_LAYER = "esm.encoder.layer.{}."
SF_LAYER = "esm.encoder.layers.{}."

#: seqfuse's fused QKV follows TE's default (interleaved per head).
QKV_INTERLEAVED = True

# (HF suffix, seqfuse suffix) inside one layer, besides the fused QKV.
_LAYER_RENAMES = (
    ("attention.LayerNorm.weight", "self_attention.layernorm_qkv.layer_norm_weight"),
    ("attention.LayerNorm.bias", "self_attention.layernorm_qkv.layer_norm_bias"),
    ("attention.output.dense.weight", "self_attention.proj.weight"),
    ("attention.output.dense.bias", "self_attention.proj.bias"),
    ("LayerNorm.weight", "layernorm_mlp.layer_norm_weight"),
    ("LayerNorm.bias", "layernorm_mlp.layer_norm_bias"),
    ("intermediate.dense.weight", "layernorm_mlp.fc1_weight"),
    ("intermediate.dense.bias", "layernorm_mlp.fc1_bias"),
    ("output.dense.weight", "layernorm_mlp.fc2_weight"),
    ("output.dense.bias", "layernorm_mlp.fc2_bias"),
)
_QKV = ("query", "key", "value")
_SF_QKV = ("self_attention.layernorm_qkv.weight", "self_attention.layernorm_qkv.bias")

_TIED_DECODER = "lm_head.decoder.weight"
_WORD_EMB = "esm.embeddings.word_embeddings.weight"


def _shared_keys(config, lm_head):
    """Keys named the same on both sides."""
    keys = [_WORD_EMB, "esm.rotary_embeddings.inv_freq",
            "esm.encoder.emb_layer_norm_after.weight", "esm.encoder.emb_layer_norm_after.bias",
            "esm.contact_head.regression.weight", "esm.contact_head.regression.bias"]
    if config.emb_layer_norm_before:
        keys += ["esm.embeddings.layer_norm.weight", "esm.embeddings.layer_norm.bias"]
    if lm_head:
        keys += ["lm_head.dense.weight", "lm_head.dense.bias", "lm_head.layer_norm.weight",
                 "lm_head.layer_norm.bias", "lm_head.bias"]
        if not config.tie_word_embeddings:
            keys.append(_TIED_DECODER)
    return keys


def hf_keys(config, lm_head=True):
    """Every key a transformers EsmForMaskedLM state dict must hold for ``config``
    (the tied decoder key excepted: it may or may not be present)."""
    keys = _shared_keys(config, lm_head)
    for i in range(config.num_hidden_layers):
        p = HF_LAYER.format(i)
        keys += [p + h for h, _ in _LAYER_RENAMES]
        keys += [f"{p}attention.self.{n}.{w}" for n in _QKV for w in ("weight", "bias")]
    return keys


def seqfuse_keys(config, lm_head=True):
    """Every key a SeqfuseEsmForMaskedLM state dict holds for ``config``
    (the tied decoder key excepted)."""
    keys = _shared_keys(config, lm_head)
    for i in range(config.num_hidden_layers):
        p = SF_LAYER.format(i)
        keys += [p + s for _, s in _LAYER_RENAMES]
        keys += [p + s for s in _SF_QKV]
    return keys


def _check_shapes(sd, config, side, layer_fmt, lm_head):
    h, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    want = {_WORD_EMB: (v, h), "esm.rotary_embeddings.inv_freq": (config.head_dim // 2,),
            "esm.contact_head.regression.weight": (1, config.num_hidden_layers * config.num_attention_heads)}
    if lm_head:
        want.update({"lm_head.dense.weight": (h, h), "lm_head.bias": (v,)})
        if _TIED_DECODER in sd:
            want[_TIED_DECODER] = (v, h)
    for i in range(config.num_hidden_layers):
        p = layer_fmt.format(i)
        if side == "transformers":
            for n in _QKV:
                want[f"{p}attention.self.{n}.weight"] = (h, h)
            want[p + "intermediate.dense.weight"] = (f, h)
            want[p + "output.dense.weight"] = (h, f)
        else:
            want[p + _SF_QKV[0]] = (3 * h, h)
            want[p + "layernorm_mlp.fc1_weight"] = (f, h)
            want[p + "layernorm_mlp.fc2_weight"] = (h, f)
    check_shapes(sd, want, side)


def hf_to_seqfuse_state_dict(hf_sd, config, lm_head=True):
    """seqfuse state dict from a transformers EsmForMaskedLM state dict.

    ``config`` is the SeqfuseEsmConfig; ``lm_head=False`` converts the encoder
    of an EsmModel whose keys carry the "esm." prefix.
    """
    check_keys(hf_sd, hf_keys(config, lm_head), "transformers", optional=(_TIED_DECODER,))
    _check_shapes(hf_sd, config, "transformers", HF_LAYER, lm_head)
    check_tied(hf_sd, _TIED_DECODER, _WORD_EMB, config, "transformers")
    out = {k: hf_sd[k] for k in _shared_keys(config, lm_head)}
    for i in range(config.num_hidden_layers):
        hp, sp = HF_LAYER.format(i), SF_LAYER.format(i)
        for h, s in _LAYER_RENAMES:
            out[sp + s] = hf_sd[hp + h]
        for w, s in zip(("weight", "bias"), _SF_QKV):
            q, k, v = (hf_sd[f"{hp}attention.self.{n}.{w}"] for n in _QKV)
            out[sp + s] = fuse_qkv(q, k, v, config.num_attention_heads, interleaved=QKV_INTERLEAVED)
    if lm_head and config.tie_word_embeddings and _TIED_DECODER in hf_sd:
        out[_TIED_DECODER] = out[_WORD_EMB]
    return out


def seqfuse_to_hf_state_dict(sf_sd, config, lm_head=True):
    """transformers EsmForMaskedLM state dict from a seqfuse one."""
    check_keys(sf_sd, seqfuse_keys(config, lm_head), "seqfuse", optional=(_TIED_DECODER,))
    _check_shapes(sf_sd, config, "seqfuse", SF_LAYER, lm_head)
    check_tied(sf_sd, _TIED_DECODER, _WORD_EMB, config, "seqfuse")
    out = {k: sf_sd[k] for k in _shared_keys(config, lm_head)}
    for i in range(config.num_hidden_layers):
        hp, sp = HF_LAYER.format(i), SF_LAYER.format(i)
        for h, s in _LAYER_RENAMES:
            out[hp + h] = sf_sd[sp + s]
        for w, s in zip(("weight", "bias"), _SF_QKV):
            q, k, v = split_qkv(sf_sd[sp + s], config.num_attention_heads, interleaved=QKV_INTERLEAVED)
            for n, t in zip(_QKV, (q, k, v)):
                out[f"{hp}attention.self.{n}.{w}"] = t
    if lm_head and config.tie_word_embeddings:
        out[_TIED_DECODER] = out[_WORD_EMB]
    return out


# ------------------------------------------------------------ model level
@functools.cache
def family():
    """The ESM-2 ModelFamily (state_dict.py): transformers' EsmForMaskedLM and
    SeqfuseEsmForMaskedLM, with this module's mappings.  A checkpoint may
    lack the tied decoder weight."""
    from transformers import EsmConfig, EsmForMaskedLM

    from .esm import SeqfuseEsmForMaskedLM
    from .esm_config import from_hf_config, to_hf_config

    return ModelFamily(hf_model=EsmForMaskedLM, hf_config=EsmConfig, seqfuse_model=SeqfuseEsmForMaskedLM,
                       config_from_hf=from_hf_config, config_to_hf=to_hf_config,
                       to_seqfuse=hf_to_seqfuse_state_dict, to_hf=seqfuse_to_hf_state_dict,
                       checkpoint_optional=lambda config: (_TIED_DECODER,))


from_hf_model, to_hf_model, export_hf, from_hf_pretrained = family_functions(
    family, seqfuse_model="SeqfuseEsmForMaskedLM", hf_model="EsmForMaskedLM")
