"""Whole-layer fusion for BERT-family encoder layers (BERT, RoBERTa), used by
``seqfuse.hf.accelerate``.

transformers' BertLayer and RobertaLayer compute, with the norms after the
residual adds (post-LN):

    a = LN1(x + dropout(dense(attention(query(x), key(x), value(x)))))
    y = LN2(a + dropout(output(act(intermediate(a)))))

Swapped module by module that is nine separate kernels and three GEMMs where
one does.  Here each such layer becomes a ``SeqfuseEncoderLayer`` running

- Q/K/V as one seqfuse Linear over a fused [query; key; value] weight (the
  biases in its epilogue),
- attention through seqfuse's transformers attention function
  (seqfuse.hf.attention: key padding, dropout), the output dense as Linear,
- LN1 + intermediate + activation + output as one LayerNormMLP over
  ``x + dense(...)`` that also returns LN1's output (the residual of the
  second add; ``return_layernorm_output``): the norm fused into the first
  GEMM, GELU in the GEMM's epilogue where it is the tanh form.  Under FP8
  the norm kernel writes the GEMM's FP8 input and LayerNormMLP runs the
  norm once more in high precision for the returned output (one more pass
  over [tokens, hidden] a layer),
- LN2 as seqfuse's LayerNorm.

Not fused (reported, swapped module by module): decoders and cross-attention
layers (``is_decoder``, ``add_cross_attention``), relative position
embeddings, activations other than GELU (erf or tanh), ReLU and SiLU, norms
other than affine nn.LayerNorm, hooks, parametrizations, mixed dtypes.

Parameters are the layer's own Parameter objects except the fused QKV
weight and bias (new Parameters: build the optimizer after accelerate()).
``state_dict()`` gives transformers' keys (the fused ones split back), so
``save_pretrained`` writes a checkpoint plain transformers loads, and
``load_state_dict`` takes transformers' keys (fuse_layers' state-dict hooks,
shared with the decoder layers).
"""
import torch
import torch.nn.functional as F
from torch import nn

from ..pytorch import LayerNorm, LayerNormMLP, Linear
from .attention import seqfuse_attention_forward
from .fuse_layers import (FusedLayer, FusionRefused, check_fusable_modules, fused_class_by_name, fused_param,
                          fused_subclass, refusal, register_hf_key_hooks)

#: encoder-layer class names fused here (the same module layout in both families)
ENCODER_FAMILIES = ("BertLayer", "RobertaLayer")

#: transformers activation class -> LayerNormMLP activation (the same function)
_ACTIVATIONS = {"GELUActivation": "gelu_erf", "NewGELUActivation": "gelu", "PytorchGELUTanh": "gelu",
                "GELUTanh": "gelu", "ReLU": "relu", "SiLU": "silu", "SiLUActivation": "silu"}

_NORMS = ("attention.output.LayerNorm", "output.LayerNorm")


def _sub(layer, path):
    try:
        return layer.get_submodule(path)
    except AttributeError:
        raise FusionRefused(f"the layer has no {path}") from None


def _activation(layer):
    act = _sub(layer, "intermediate").intermediate_act_fn
    name = _ACTIVATIONS.get(type(act).__name__)
    if name == "gelu_erf" and getattr(act, "act", F.gelu) is not F.gelu:  # GELUActivation(use_gelu_python=True)
        name = None
    if name is None:
        raise FusionRefused(f"activation {type(act).__name__}; the fused MLP computes GELU (erf or tanh), ReLU "
                            "or SiLU")
    return name


def encoder_fusion_plan(layer, align):
    """None when ``layer`` can be fused, else the reason (a string);
    ``align``: the multiple GEMM features must be under the recipe (None: any)."""
    return refusal(_check, layer, align)


def _check(layer, align):
    cls = type(layer)
    if cls.__name__ not in ENCODER_FAMILIES or not cls.__module__.startswith("transformers.models."):
        raise FusionRefused(f"{cls.__name__} is not a known encoder-layer family ({', '.join(ENCODER_FAMILIES)})")
    if getattr(layer, "is_decoder", False) or getattr(layer, "add_cross_attention", False):
        raise FusionRefused("a decoder / cross-attention layer; the fused encoder layer is bidirectional "
                            "self-attention only")
    attn = _sub(layer, "attention.self")
    if getattr(attn, "position_embedding_type", "absolute") != "absolute":
        raise FusionRefused(f"position_embedding_type {attn.position_embedding_type!r} (relative positions "
                            "inside attention)")
    linears = {n: _sub(layer, n) for n in ("attention.self.query", "attention.self.key", "attention.self.value",
                                           "attention.output.dense", "intermediate.dense", "output.dense")}
    for n, m in linears.items():
        if type(m) is not nn.Linear or m.bias is None:
            raise FusionRefused(f"{n} is {type(m).__name__}{'' if m.bias is not None else ' without bias'}; the "
                                "fused layer takes biased nn.Linear projections")
    hidden = linears["attention.self.query"].in_features
    for n in _NORMS:
        m = _sub(layer, n)
        if type(m) is not nn.LayerNorm or not m.elementwise_affine or m.bias is None \
                or tuple(m.normalized_shape) != (hidden,):
            raise FusionRefused(f"{n} is not an affine nn.LayerNorm over the hidden size")
    check_fusable_modules(layer)
    qkv = [linears[f"attention.self.{n}"] for n in ("query", "key", "value")]
    if len({m.weight.requires_grad for m in qkv}) != 1 or len({m.bias.requires_grad for m in qkv}) != 1:
        raise FusionRefused("some of query/key/value are frozen and others not (requires_grad differs)")
    heads, d = attn.num_attention_heads, attn.attention_head_size
    o, fc1, fc2 = linears["attention.output.dense"], linears["intermediate.dense"], linears["output.dense"]
    if any(m.in_features != hidden or m.out_features != heads * d for m in qkv) or o.in_features != heads * d \
            or o.out_features != hidden or fc1.in_features != hidden or fc2.in_features != fc1.out_features \
            or fc2.out_features != hidden:
        raise FusionRefused("projection shapes do not chain hidden -> heads x head_dim -> hidden -> ffn -> hidden")
    _activation(layer)
    if align:
        bad = {n: f for n, f in (("hidden", hidden), ("heads x head_dim", heads * d), ("ffn", fc1.out_features))
               if f % align}
        if bad:
            raise FusionRefused(f"the recipe's GEMMs need features divisible by {align}, got {bad}")


_FUSED_CLASSES = {}


def encoder_fused_class(orig_cls):
    """SeqfuseEncoderLayer's subclass of ``orig_cls`` (fuse_layers.fused_subclass)."""
    return fused_subclass(SeqfuseEncoderLayer, orig_cls, _FUSED_CLASSES, globals())


def __getattr__(name):
    """The fused class named ``name`` (SeqfuseBertLayer, SeqfuseRobertaLayer), made on first use."""
    return fused_class_by_name(name, __name__, ENCODER_FAMILIES, "Layer", encoder_fused_class)


def fuse_encoder_layer(layer):
    """A SeqfuseEncoderLayer computing what ``layer`` computes (checked by
    ``encoder_fusion_plan`` first), and a list of notes for the report."""
    attn = layer.attention.self
    q, k, v = attn.query, attn.key, attn.value
    o, fc1, fc2 = layer.attention.output.dense, layer.intermediate.dense, layer.output.dense
    ln1, ln2 = layer.attention.output.LayerNorm, layer.output.LayerNorm
    hidden, inner, ffn = q.in_features, q.out_features, fc1.out_features  # (inner: heads x head_dim)
    kw = dict(params_dtype=q.weight.dtype, device=q.weight.device)
    cls = encoder_fused_class(type(layer))
    new = cls.__new__(cls)
    nn.Module.__init__(new)
    new.train(layer.training)
    for attr in ("gradient_checkpointing", "_gradient_checkpointing_func", "chunk_size_feed_forward",
                 "seq_len_dim", "is_decoder", "add_cross_attention"):
        if attr in layer.__dict__:
            setattr(new, attr, layer.__dict__[attr])
    new.config = attn.config
    new.layer_idx = getattr(attn, "layer_idx", None)
    new.num_heads, new.head_dim = attn.num_attention_heads, attn.attention_head_size
    new.scaling = float(getattr(attn, "scaling", attn.attention_head_size ** -0.5))
    new.attention_dropout = float(attn.dropout.p)
    new.hidden_dropout = (float(layer.attention.output.dropout.p), float(layer.output.dropout.p))
    new.is_causal = False
    with torch.no_grad():
        new.qkv = Linear(hidden, 3 * inner, bias=True, **kw)
        new.qkv.weight = fused_param([q.weight, k.weight, v.weight], q.weight.requires_grad)
        new.qkv.bias = fused_param([q.bias, k.bias, v.bias], q.bias.requires_grad)
        new.proj = Linear(inner, hidden, bias=True, **kw)
        new.proj.weight, new.proj.bias = o.weight, o.bias
        new.mlp_fused = LayerNormMLP(hidden, ffn, eps=ln1.eps, bias=True, normalization="LayerNorm",
                                     activation=_activation(layer), return_layernorm_output=True, **kw)
        new.mlp_fused.layer_norm_weight, new.mlp_fused.layer_norm_bias = ln1.weight, ln1.bias
        new.mlp_fused.fc1_weight, new.mlp_fused.fc1_bias = fc1.weight, fc1.bias
        new.mlp_fused.fc2_weight, new.mlp_fused.fc2_bias = fc2.weight, fc2.bias
        new.norm = LayerNorm(hidden, eps=ln2.eps, **kw)
        new.norm.weight, new.norm.bias = ln2.weight, ln2.bias
    new._split_sizes = (inner, inner, inner)
    new._hf_keys = list(layer.state_dict().keys())
    register_hf_key_hooks(new)
    notes = [f"post-LN: LN1 fused with the MLP's first GEMM, LN2 a seqfuse LayerNorm ({new.mlp_fused.activation})"]
    if getattr(layer, "chunk_size_feed_forward", 0):
        notes.append(f"chunk_size_feed_forward={layer.chunk_size_feed_forward} not applied: the MLP runs over all "
                     "tokens at once (the same result, more activation memory)")
    return new, notes


class SeqfuseEncoderLayer(FusedLayer):
    """The fused encoder layer (a mix-in placed before the original layer
    class by ``encoder_fused_class``); see the module note."""

    _KEYS = (("qkv.weight", ["attention.self.query.weight", "attention.self.key.weight",
                             "attention.self.value.weight"]),
             ("qkv.bias", ["attention.self.query.bias", "attention.self.key.bias", "attention.self.value.bias"]),
             ("proj.weight", ["attention.output.dense.weight"]), ("proj.bias", ["attention.output.dense.bias"]),
             ("mlp_fused.layer_norm_weight", ["attention.output.LayerNorm.weight"]),
             ("mlp_fused.layer_norm_bias", ["attention.output.LayerNorm.bias"]),
             ("mlp_fused.fc1_weight", ["intermediate.dense.weight"]),
             ("mlp_fused.fc1_bias", ["intermediate.dense.bias"]),
             ("mlp_fused.fc2_weight", ["output.dense.weight"]), ("mlp_fused.fc2_bias", ["output.dense.bias"]),
             ("norm.weight", ["output.LayerNorm.weight"]), ("norm.bias", ["output.LayerNorm.bias"]))

    def _key_map(self):
        """(fused local key, [transformers local keys]) pairs; one key means a rename."""
        return [(k, list(v)) for k, v in self._KEYS]

    def _split_sizes_of(self, fused_key):
        return list(self._split_sizes)

    # (uncompiled under torch.compile, as the fused decoder layer: its kernels are C calls dynamo cannot trace)
    @torch.compiler.disable
    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None,
                past_key_values=None, cache=None, **kwargs):
        """transformers' encoder-layer call; returns the hidden states."""
        if encoder_hidden_states is not None or past_key_values is not None or cache is not None:
            raise NotImplementedError("seqfuse fused encoder layer: cross-attention inputs and key caches are not "
                                      "supported (an encoder layer attends to its own tokens)")
        self._refuse_output_attentions(kwargs)
        b, s, _ = hidden_states.shape
        d = self.head_dim
        q, k, v = torch.split(self.qkv(hidden_states), self._split_sizes, dim=-1)
        q, k, v = (t.view(b, s, -1, d).transpose(1, 2) for t in (q, k, v))  # transformers' [b, heads, s, d]
        out, _ = seqfuse_attention_forward(self, q, k, v, attention_mask,
                                           dropout=self.attention_dropout if self.training else 0.0,
                                           scaling=self.scaling, **kwargs)
        x = hidden_states + self._dropout(self.proj(out.reshape(b, s, -1)), self.hidden_dropout[0])
        mlp, a = self.mlp_fused(x)  # a = LN1(x): the second residual
        return self.norm(a + self._dropout(mlp, self.hidden_dropout[1]))
