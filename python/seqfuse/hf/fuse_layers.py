"""Whole-layer fusion for Llama-family decoder layers, used by
``seqfuse.hf.accelerate``.

transformers' Llama, Mistral, Qwen2, Qwen3 and Gemma (1) decoder layers compute

    x = x + o_proj(attention(rope(q_proj(n1(x))), rope(k_proj(n1(x))), v_proj(n1(x))))
    x = x + down_proj(act(gate_proj(n2(x))) * up_proj(n2(x)))

with RMSNorms n1, n2 (Gemma's with 1 + weight: zero-centred gamma; Qwen3
also normalises each query and key head: q_norm, k_norm) and act silu
(Gemma: tanh-approximated GELU).  Swapping these modules one by one leaves nine kernels per layer
and their intermediates in memory, and two GEMMs where one would do.  Here
each such layer is replaced by a ``SeqfuseDecoderLayer`` that runs

- n1 + Q/K/V as one seqfuse LayerNormLinear (the norm fused into one GEMM
  over a fused [Q; K; V] weight, Qwen2's biases in its epilogue; under FP8
  the norm writes the FP8 input),
- RoPE in seqfuse's fused kernel (angles from the model's own rotary
  inv_freq and the call's position ids, so per-row positions of a padded
  generate batch work too); rope types whose cos/sin are not
  cos(position * inv_freq) (dynamic, yarn, longrope: a scaling factor or
  frequencies that change per call) rotate with the model's cos/sin in torch
  instead, as the report says,
- attention through seqfuse's transformers attention function
  (seqfuse.hf.attention: padding, packed sequences, sliding windows, key
  caches), the o_proj as seqfuse's Linear,
- n2 + gate/up + SwiGLU (GeGLU) + down as one LayerNormMLP (gate and up
  as one GEMM over a fused [gate; up] weight).

Gemma 2 and 3 (norms after attention and MLP, logit soft-capping) are not
matched here: their layers are reported and swapped module by module.
BERT and RoBERTa encoder layers are fused by seqfuse.hf.fuse_encoder (it
shares this module's state-dict hooks through FusedLayer); ESM models have
their own seqfuse family (seqfuse.hf.convert).

The new layer is an instance of a subclass of the original layer class, so
transformers' isinstance checks (hidden-state capture, gradient
checkpointing through GradientCheckpointingLayer) keep working; its forward
takes the original's call signature (hidden_states, attention_mask,
position_ids, past_key_values / cache, use_cache, position_embeddings and
transformers' keyword arguments).  output_attentions is refused (the fused
attention never forms attention probabilities).  Under torch.compile the
fused layer runs uncompiled (torch.compiler.disable: its kernels are C calls
dynamo cannot trace); the code around it compiles as usual.

Parameters: the norm weights and o_proj / down_proj weights (and biases) are
the original Parameter objects, moved; the fused QKV and gate/up weights are
new Parameters (an optimizer built before accelerate() must be rebuilt).
``state_dict()`` gives transformers' own keys (the fused weights split back,
as copies), so ``save_pretrained`` writes a checkpoint plain transformers
loads; ``load_state_dict`` takes transformers' keys and fuses them.

``layer_fusion_plan(layer, ...)`` says whether a layer can be fused (or why
not); ``fuse_layer`` builds the replacement.
"""
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..modules import compute_dtype, residual_fusable
from ..modules.rope import apply_rotary_pos_emb, split_qkv_rope
from ..ops.attn import PerTensorCache
from ..ops import device_checks
from ..pytorch import LayerNormLinear, LayerNormMLP, Linear, RMSNorm
from .attention import seqfuse_attention_forward
from .positions import derived_positions


def _gated_activations():
    """{activation module class: LayerNormMLP's gated activation}: act(gate) * up
    with act silu (transformers' "silu" and "swish") or tanh-approximated GELU
    (Gemma's "gelu_pytorch_tanh", which is TE's and seqfuse's "geglu")."""
    out = {nn.SiLU: "swiglu"}
    try:
        from transformers import activations
    except ImportError:
        return out
    for name, act in (("SiLUActivation", "swiglu"), ("GELUTanh", "geglu"), ("PytorchGELUTanh", "geglu")):
        cls = getattr(activations, name, None)
        if isinstance(cls, type):
            out[cls] = act
    return out


_GATED = _gated_activations()

#: decoder-layer class name -> where its sliding window comes from, whether it has QK norms, and its
#: projections' layout: "split" (q/k/v_proj, gate/up_proj) or "fused" (Phi-3's qkv_proj, gate_up_proj)
FAMILIES = {
    "LlamaDecoderLayer": dict(window="none", qk_norm=False, layout="split"),
    "MistralDecoderLayer": dict(window="config", qk_norm=False, layout="split"),
    "Qwen2DecoderLayer": dict(window="attention", qk_norm=False, layout="split"),
    "Qwen3DecoderLayer": dict(window="attention", qk_norm=True, layout="split"),
    "GemmaDecoderLayer": dict(window="none", qk_norm=False, layout="split"),
    "Phi3DecoderLayer": dict(window="config", qk_norm=False, layout="fused"),
}

#: rope types whose cos/sin are exactly cos/sin(position * inv_freq) with inv_freq fixed at build time
_PLAIN_ROPE = ("default", "linear", "llama3")


class _Parts(NamedTuple):
    """A layer's projections under their transformers names (relative to the
    layer): qkv and fc1 as lists of (name, nn.Linear) whose rows are
    concatenated into the fused weight (one entry: already fused), o and fc2
    as (name, nn.Linear); act the MLP's activation module; modules the
    names every module of the layer must be among; heads, groups, head_dim."""
    qkv: list
    o: tuple
    fc1: list
    fc2: tuple
    act: object
    modules: set
    heads: int
    groups: int
    head_dim: int


def _parts(layer, spec):
    attn = layer.self_attn
    modules = {"", "self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
    if spec["qk_norm"]:
        modules |= {"self_attn.q_norm", "self_attn.k_norm"}
    head_dim = int(getattr(attn, "head_dim", 0) or 0)
    if head_dim <= 0:
        raise FusionRefused("the attention module has no head_dim")
    if spec["layout"] == "split":
        names = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
        fc1 = ["mlp.gate_proj", "mlp.up_proj"]
        act_name = "mlp.act_fn"
    else:
        names, fc1, act_name = ["self_attn.qkv_proj"], ["mlp.gate_up_proj"], "mlp.activation_fn"
        modules |= {"resid_attn_dropout", "resid_mlp_dropout"}
    modules |= set(names) | set(fc1) | {"self_attn.o_proj", "mlp.down_proj", act_name}
    got = dict(layer.named_modules())
    extra, missing = sorted(set(got) - modules), sorted(modules - set(got))
    if extra or missing:
        raise FusionRefused(f"the layer's modules differ from {type(layer).__name__}'s (extra {extra}, missing "
                            f"{missing}): adapters or a modified layer; the fused layer would drop what they add")
    qkv = [(n, got[n]) for n in names]
    for n, m in qkv + [(n, got[n]) for n in fc1 + ["self_attn.o_proj", "mlp.down_proj"]]:
        _check_linear(m, n)
    if spec["layout"] == "split":
        q, k = qkv[0][1], qkv[1][1]
        if q.out_features % head_dim or k.out_features % head_dim or k.out_features != qkv[2][1].out_features:
            raise FusionRefused(f"projection shapes q {q.out_features}, k {k.out_features}, v "
                                f"{qkv[2][1].out_features} do not split into heads of {head_dim}")
        heads, groups = q.out_features // head_dim, k.out_features // head_dim
    else:
        heads = int(attn.config.num_attention_heads)
        groups = int(getattr(attn, "num_key_value_heads", attn.config.num_key_value_heads))
        if qkv[0][1].out_features != (heads + 2 * groups) * head_dim:
            raise FusionRefused(f"qkv_proj has {qkv[0][1].out_features} rows, not ({heads} + 2 x {groups}) x "
                                f"{head_dim}")
    if heads % groups:
        raise FusionRefused(f"{heads} query heads do not group over {groups} key/value heads")
    return _Parts(qkv, ("self_attn.o_proj", got["self_attn.o_proj"]), [(n, got[n]) for n in fc1],
                  ("mlp.down_proj", got["mlp.down_proj"]), got[act_name], modules, heads, groups, head_dim)


class FusionRefused(Exception):
    """A layer that cannot be fused, with the reason (becomes a report entry)."""


def _hooks(module):
    return bool(module._forward_hooks or module._forward_pre_hooks or getattr(module, "_backward_hooks", None)
                or module._state_dict_hooks or module._load_state_dict_pre_hooks)


def _check_linear(mod, name):
    if type(mod) is not nn.Linear:
        raise FusionRefused(f"{name} is a {type(mod).__name__}, not a plain nn.Linear (an adapter or a "
                            "quantized layer?); the fused weight would drop what it adds")


def _sliding_window(layer, spec):
    if spec["window"] == "config":
        return getattr(layer.self_attn.config, "sliding_window", None)
    if spec["window"] == "attention":
        return getattr(layer.self_attn, "sliding_window", None)
    return None


def rope_mode(rotary, head_dim):
    """("fused", None) when the model's rotary embedding is cos/sin of
    position * inv_freq over the head or its first part (seqfuse's kernel
    computes it);
    else ("torch", why): the layer rotates with the model's cos/sin."""
    if rotary is None:
        return "torch", "the model has no rotary_emb module to read inv_freq from"
    rope_type = getattr(rotary, "rope_type", "default")
    inv = getattr(rotary, "inv_freq", None)
    if rope_type not in _PLAIN_ROPE:
        return "torch", f"rope_type {rope_type!r} (frequencies or scaling beyond cos(position * inv_freq))"
    if float(getattr(rotary, "attention_scaling", 1.0)) != 1.0:
        return "torch", f"rotary attention_scaling {rotary.attention_scaling} != 1"
    if not isinstance(inv, torch.Tensor) or inv.dim() != 1 or 2 * inv.numel() > head_dim:
        return "torch", "inv_freq is not one frequency per pair of at most the head dim"
    return "fused", None  # a partial rotary (2 x frequencies < head dim) leaves the rest of the head as it is


def refusal(check, *args):
    """None when ``check(*args)`` passes, else the reason its FusionRefused gives."""
    try:
        check(*args)
    except FusionRefused as e:
        return str(e)
    return None


def layer_fusion_plan(layer, rmsnorm_match, align):
    """None when ``layer`` can be fused, else the reason (a string).
    ``rmsnorm_match(module)`` -> ((eps, zero_centered), None) or (None, why);
    ``align``: the multiple the GEMM features must be under the recipe (None: any)."""
    return refusal(_check_layer, layer, rmsnorm_match, align)


def check_fusable_modules(layer):
    """What every whole-layer fusion needs of ``layer``'s modules and
    parameters (FusionRefused naming the first miss): no hooks or
    parametrizations (the fused layer would not carry them), one dtype
    (float32, float16 or bfloat16) and one device, materialised, dense."""
    for name, m in layer.named_modules():
        if _hooks(m):
            raise FusionRefused(f"module {name or '<layer>'} has hooks, which the fused layer would not carry")
        if hasattr(m, "parametrizations"):
            raise FusionRefused(f"module {name or '<layer>'} has parametrizations")
    params = list(layer.parameters())
    dtypes, devices = {p.dtype for p in params}, {p.device for p in params}
    if len(dtypes) != 1 or len(devices) != 1:
        raise FusionRefused(f"the layer's parameters mix dtypes {sorted(map(str, dtypes))} or devices "
                            f"{sorted(map(str, devices))}")
    dtype = params[0].dtype
    if dtype not in (torch.float32, torch.float16, torch.bfloat16) or params[0].is_meta:
        raise FusionRefused(f"parameters are {dtype} on {params[0].device}; fusion takes materialised float32, "
                            "float16 or bfloat16 weights")
    if any(p.layout != torch.strided for p in params):
        raise FusionRefused("a parameter is not a dense tensor")


def _check_layer(layer, rmsnorm_match, align):
    cls = type(layer)
    spec = FAMILIES.get(cls.__name__)
    if spec is None or not cls.__module__.startswith("transformers.models."):
        raise FusionRefused(f"{cls.__name__} is not a known decoder-layer family ({', '.join(FAMILIES)})")
    if getattr(layer, "self_attn", None) is None or getattr(layer, "mlp", None) is None:
        raise FusionRefused("the layer has no self_attn / mlp")
    parts = _parts(layer, spec)
    check_fusable_modules(layer)
    if type(parts.act) not in _GATED:
        raise FusionRefused(f"MLP activation {type(parts.act).__name__}; the fused MLP computes SwiGLU (silu) or "
                            "GeGLU (tanh-approximated GELU)")
    qkv = [m for _, m in parts.qkv]
    fc1 = [m for _, m in parts.fc1]
    o, fc2 = parts.o[1], parts.fc2[1]
    if len({m.bias is None for m in qkv}) != 1:
        raise FusionRefused("q/k/v projections mix biased and unbiased; the fused QKV has one bias or none")
    if len({m.bias is None for m in fc1 + [fc2]}) != 1:
        raise FusionRefused("gate/up/down projections mix biased and unbiased; LayerNormMLP has biases on both "
                            "GEMMs or neither")
    for group in (qkv, fc1):
        if len({m.weight.requires_grad for m in group}) != 1:
            raise FusionRefused("some of the weights to fuse are frozen and others not (requires_grad differs)")
    for norm_name in ("input_layernorm", "post_attention_layernorm"):
        _, why = rmsnorm_match(getattr(layer, norm_name))
        if why is not None:
            raise FusionRefused(f"{norm_name}: {why}")
    hidden, q_rows = qkv[0].in_features, parts.heads * parts.head_dim
    ffn = sum(m.out_features for m in fc1) // 2
    if 2 * ffn != sum(m.out_features for m in fc1) or fc2.in_features != ffn or fc2.out_features != hidden:
        raise FusionRefused(f"MLP shapes gate/up {[m.out_features for m in fc1]}, down {fc2.in_features}->"
                            f"{fc2.out_features} are not a gated MLP of hidden {hidden}")
    if o.in_features != q_rows or o.out_features != hidden:
        raise FusionRefused(f"o_proj {o.in_features}->{o.out_features} does not invert the query projection")
    if align:
        feats = {"hidden": hidden, "q rows": q_rows, "qkv rows": (parts.heads + 2 * parts.groups) * parts.head_dim,
                 "ffn": ffn}
        bad = {n: f for n, f in feats.items() if f % align}
        if bad:
            raise FusionRefused(f"the recipe's GEMMs need features divisible by {align}, got {bad}")


def fused_param(tensors, requires_grad):
    """A new Parameter holding ``tensors``' rows, one after another (a fused weight or bias)."""
    with torch.no_grad():
        return nn.Parameter(torch.cat([t.detach() for t in tensors], dim=0), requires_grad=requires_grad)


_FUSED_CLASSES = {}


def fused_subclass(mixin, orig_cls, cache, namespace):
    """``Seqfuse<orig_cls name>``, the subclass of (``mixin``, ``orig_cls``)
    (made once per class, kept in ``cache``), also set in ``namespace`` (the
    defining module's globals) so pickle finds it by name."""
    cls = cache.get(orig_cls)
    if cls is None:
        name = f"Seqfuse{orig_cls.__name__}"
        cls = type(name, (mixin, orig_cls), {"__module__": namespace["__name__"], "__qualname__": name})
        cache[orig_cls] = cls
        namespace[name] = cls
    return cls


def fused_class_by_name(name, module_name, families, suffix, make):
    """The fused class named ``name`` (``Seqfuse`` + one of ``families``),
    made on first use by ``make(transformers class)``: what unpickling a fused
    model in a new process looks up (a module's ``__getattr__``)."""
    base = name[len("Seqfuse"):] if name.startswith("Seqfuse") else None
    if base not in families:
        raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
    import importlib

    family = base[:-len(suffix)].lower()
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    return make(getattr(modeling, base))


def fused_class(orig_cls):
    """SeqfuseDecoderLayer's subclass of ``orig_cls`` (fused_subclass)."""
    return fused_subclass(SeqfuseDecoderLayer, orig_cls, _FUSED_CLASSES, globals())


def __getattr__(name):
    """The fused class named ``name`` (e.g. SeqfuseLlamaDecoderLayer), made on first use."""
    return fused_class_by_name(name, __name__, FAMILIES, "DecoderLayer", fused_class)


def _fused_or_own(pieces, part):
    """The Parameter for a fused weight (``part`` "weight" or "bias") of
    ``pieces`` [(name, Linear)]: the very Parameter when there is one piece
    (Phi-3's qkv_proj, gate_up_proj), else a new one holding their rows."""
    tensors = [getattr(m, part) for _, m in pieces]
    if len(tensors) == 1:
        return tensors[0]
    return fused_param(tensors, tensors[0].requires_grad)


def fuse_layer(layer, rmsnorm_match, rotary, recompute_activation=False):
    """A SeqfuseDecoderLayer computing what ``layer`` computes (checked by
    ``layer_fusion_plan`` first), and a list of notes for the report.
    ``recompute_activation``: its LayerNormMLP's (the gated activation made
    again in the backward instead of kept)."""
    attn = layer.self_attn
    spec = FAMILIES[type(layer).__name__]
    parts = _parts(layer, spec)
    first = parts.qkv[0][1]
    o, fc2 = parts.o[1], parts.fc2[1]
    w = first.weight
    d, heads, groups = parts.head_dim, parts.heads, parts.groups
    hidden, ffn = first.in_features, fc2.in_features
    has_qkv_bias, has_mlp_bias = first.bias is not None, fc2.bias is not None
    kw = dict(params_dtype=w.dtype, device=w.device)
    (eps1, zc1), _ = rmsnorm_match(layer.input_layernorm)
    (eps2, zc2), _ = rmsnorm_match(layer.post_attention_layernorm)
    new = fused_class(type(layer)).__new__(fused_class(type(layer)))
    nn.Module.__init__(new)
    new.train(layer.training)
    for attr in ("hidden_size", "attention_type", "layer_idx", "layer_type"):  # what the model reads off its layers
        if attr in layer.__dict__:
            setattr(new, attr, layer.__dict__[attr])
    for attr in ("gradient_checkpointing", "_gradient_checkpointing_func"):
        if attr in layer.__dict__:
            setattr(new, attr, layer.__dict__[attr])
    new.config = attn.config
    new.layer_idx = attn.layer_idx
    new.head_dim, new.num_heads, new.num_groups = d, heads, groups
    new.scaling = float(attn.scaling)
    new.attention_dropout = float(getattr(attn, "attention_dropout", 0.0) or 0.0)
    new.is_causal = bool(getattr(attn, "is_causal", True))
    new.sliding_window = _sliding_window(layer, spec)
    # Phi-3's dropout on each branch before its residual add (0 in eval)
    new.resid_dropout = (float(layer.resid_attn_dropout.p), float(layer.resid_mlp_dropout.p)) \
        if spec["layout"] == "fused" else (0.0, 0.0)
    notes = []
    with torch.no_grad():
        new.qkv = LayerNormLinear(hidden, (heads + 2 * groups) * d, eps=eps1, bias=has_qkv_bias,
                                  normalization="RMSNorm", zero_centered_gamma=zc1, **kw)
        new.qkv.layer_norm_weight = layer.input_layernorm.weight
        new.qkv.weight = _fused_or_own(parts.qkv, "weight")
        if has_qkv_bias:
            new.qkv.bias = _fused_or_own(parts.qkv, "bias")
        # the attention keeps its output for its own backward: under FP8 the projection keeps that tensor,
        # not an FP8 transposed copy of it (made again for its weight gradient: Linear's save_original_input)
        new.proj = Linear(o.in_features, o.out_features, bias=o.bias is not None, save_original_input=True, **kw)
        new.proj.weight = o.weight
        if o.bias is not None:
            new.proj.bias = o.bias
        new.mlp_fused = LayerNormMLP(hidden, ffn, eps=eps2, bias=has_mlp_bias, normalization="RMSNorm",
                                     activation=_GATED[type(parts.act)], zero_centered_gamma=zc2,
                                     recompute_activation=recompute_activation, **kw)
        new.mlp_fused.layer_norm_weight = layer.post_attention_layernorm.weight
        # TE's gated layout: the activated (gate) half first, then the up half (Phi-3's gate_up_proj already is)
        new.mlp_fused.fc1_weight = _fused_or_own(parts.fc1, "weight")
        new.mlp_fused.fc2_weight = fc2.weight
        if has_mlp_bias:
            new.mlp_fused.fc1_bias = _fused_or_own(parts.fc1, "bias")
            new.mlp_fused.fc2_bias = fc2.bias
    if spec["qk_norm"]:
        for name in ("q_norm", "k_norm"):
            m = getattr(attn, name)
            match, why = rmsnorm_match(m)
            if match is None:
                setattr(new, name, m)
                notes.append(f"{name} kept as {type(m).__name__} ({why})")
            else:
                eps, zc = match
                rms = RMSNorm(m.weight.shape[0], eps=eps, zero_centered_gamma=zc, **kw)
                rms.weight = m.weight
                setattr(new, name, rms)
    mode, why = rope_mode(rotary, d)
    new._rotary = (rotary,)  # not a submodule: the model owns it
    new.rope_fused = mode == "fused"
    if not new.rope_fused:
        notes.append(f"RoPE rotates with transformers' cos/sin in torch: {why}")
    if recompute_activation:
        notes.append("the gated activation made again in the backward, not kept (recompute_activation; under "
                     "FP8 its FP8 copy for FC2's weight gradient, made again with the forward's scale)")
    if len(parts.qkv) == 1 and len(parts.fc1) == 1:
        notes.append("the layer's own Parameter objects throughout (its QKV and gate/up weights were fused already)")
    new._split_sizes = (heads * d, groups * d, groups * d)
    new._hf_keys = list(layer.state_dict().keys())
    new._qkv_names = [n for n, _ in parts.qkv]
    new._fc1_names = [n for n, _ in parts.fc1]
    new._has_qkv_bias, new._has_mlp_bias = has_qkv_bias, has_mlp_bias
    register_hf_key_hooks(new)
    return new, notes


def _angles(tensors):
    """float32 [rows, s, d] angles position * inv_freq (each frequency for
    both halves) of ``tensors`` = (position_ids [..., s], inv_freq [d / 2])."""
    position_ids, inv_freq = tensors
    pos = position_ids.reshape(-1, position_ids.shape[-1]).to(torch.float32)
    ang = pos[..., None] * inv_freq.to(torch.float32)
    return torch.cat((ang, ang), dim=-1)


_angles_cached = PerTensorCache(_angles)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class FusedLayer(nn.Module):
    """What every whole-layer fusion (this module's decoder layers,
    fuse_encoder's encoder layers) gives: ``_key_map()``, its (fused local
    key, [transformers local keys]) pairs, and ``_split_sizes_of(fused key)``,
    the row counts a fused weight splits back into; the state-dict hooks
    (register_hf_key_hooks) and hf_named_tensors read them.  Also what both
    forwards share: the output_attentions refusal and training dropout."""

    def _refuse_output_attentions(self, kwargs):
        if kwargs.get("output_attentions", getattr(self.config, "output_attentions", False)):
            raise NotImplementedError(f"seqfuse {type(self).__name__}: output_attentions=True is not supported "
                                      "(the fused attention never forms attention probabilities); accelerate the "
                                      "model with fuse_layers=False and attention=False to get them")

    def _dropout(self, x, p):
        return F.dropout(x, p, training=True) if p > 0.0 and self.training else x


def register_hf_key_hooks(module):
    """Give a FusedLayer transformers' state-dict keys: state_dict() splits
    its fused entries back, load_state_dict() fuses transformers' ones."""
    module._register_state_dict_hook(_to_hf_state_dict)
    module._register_load_state_dict_pre_hook(_from_hf_state_dict, with_module=True)


class SeqfuseDecoderLayer(FusedLayer):
    """The fused decoder layer (a mix-in placed before the original layer
    class by ``fused_class``); see the module note."""

    # -- state dict: transformers' keys ---------------------------------
    def _key_map(self):
        """(fused local key, [transformers local keys]) pairs; one key means a rename."""
        qkv, fc1 = self._qkv_names, self._fc1_names
        pairs = [("qkv.layer_norm_weight", ["input_layernorm.weight"]),
                 ("qkv.weight", [f"{n}.weight" for n in qkv]),
                 ("proj.weight", ["self_attn.o_proj.weight"]),
                 ("mlp_fused.layer_norm_weight", ["post_attention_layernorm.weight"]),
                 ("mlp_fused.fc1_weight", [f"{n}.weight" for n in fc1]),
                 ("mlp_fused.fc2_weight", ["mlp.down_proj.weight"])]
        if self._has_qkv_bias:
            pairs.append(("qkv.bias", [f"{n}.bias" for n in qkv]))
        if self.proj.bias is not None:
            pairs.append(("proj.bias", ["self_attn.o_proj.bias"]))
        if self._has_mlp_bias:
            pairs += [("mlp_fused.fc1_bias", [f"{n}.bias" for n in fc1]),
                      ("mlp_fused.fc2_bias", ["mlp.down_proj.bias"])]
        for name in ("q_norm", "k_norm"):
            if name in self._modules:
                pairs.append((f"{name}.weight", [f"self_attn.{name}.weight"]))
        return pairs

    def _split_sizes_of(self, fused_key):
        if fused_key.startswith("qkv."):
            return list(self._split_sizes)
        half = self.mlp_fused.ffn_hidden_size
        return [half, half]

    # -- forward -----------------------------------------------------------
    def _angles(self, x, position_ids, b, s):
        """The fused RoPE's angles [1 or b, s, rot] for ``position_ids``."""
        rotary = self._rotary[0]
        # every layer gets the same position_ids tensor: the angles are made once per forward
        # (not cached under capture: a replay brings new positions)
        ang = (_angles if device_checks.capturing(x) else _angles_cached)((position_ids, rotary.inv_freq))
        if ang.shape[0] not in (1, b) or ang.shape[1] != s:
            raise ValueError(f"seqfuse fused layer: position_ids {tuple(position_ids.shape)} must be [1, {s}] "
                             f"or [{b}, {s}]")
        return ang

    def _rope(self, q, k, ang, position_embeddings):
        """q and k turned by the fused kernel at ``ang`` (_angles'), else (None)
        by transformers' ``position_embeddings``."""
        if ang is not None:
            b, s = q.shape[:2]
            if ang.shape[0] == 1:  # one row of positions for the whole batch (training, no padding)
                freqs = ang[0][:, None, None, :]
                return (apply_rotary_pos_emb(q, freqs, "bshd"), apply_rotary_pos_emb(k, freqs, "bshd"))
            # per-row positions (a left-padded generate batch): the rows laid end to end as one sequence,
            # each token with its own angle
            freqs = ang.reshape(b * s, 1, 1, -1)
            return tuple(apply_rotary_pos_emb(t.reshape(1, b * s, *t.shape[2:]), freqs, "bshd").view(t.shape)
                         for t in (q, k))
        if position_embeddings is None:
            raise ValueError("seqfuse fused layer: needs position_ids (fused RoPE) or position_embeddings (cos, sin)")
        cos, sin = position_embeddings  # [b or 1, s, rot] in the activations' dtype, as transformers rotates
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
        rot = cos.shape[-1]  # partial rotary: the head's first rot features turn, the rest pass

        def turn(t):
            r = t[..., :rot]
            r = r * cos + _rotate_half(r) * sin
            return r if rot == t.shape[-1] else torch.cat((r, t[..., rot:]), dim=-1)

        return turn(q), turn(k)

    # torch.compile (transformers' generate() compiles the decoding step on a GPU with a static cache) runs
    # this layer as it is, uncompiled: its work is seqfuse's C kernels, which dynamo cannot trace, and it
    # keeps per-tensor caches (RoPE angles, mask layouts) that tracing would turn into a guard per step
    @torch.compiler.disable
    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache=False, position_embeddings=None, cache=None, **kwargs):
        """transformers' decoder-layer call (either cache keyword: past_key_values
        before transformers 5.2x, cache after); returns the hidden states."""
        self._refuse_output_attentions(kwargs)
        cache = cache if cache is not None else past_key_values
        graphs = self.__dict__.get("_layer_graphs")  # set_graphs (seqfuse.hf.graph_layers)
        if graphs is not None:
            graphed = graphs.graphs.for_call(self.training, hidden_states.shape[:2],
                                             _graph_reason(graphs, hidden_states, attention_mask, position_ids,
                                                           cache, kwargs))
            if graphed is not None:
                return graphed[graphs.index](hidden_states)
        return self.forward_eager(hidden_states, attention_mask, position_ids, cache, position_embeddings, **kwargs)

    def set_graphs(self, graphs, index, dtype):
        """Replay ``graphs.graphed[index]`` (a LayerGraphs captured by
        seqfuse.hf.graph_layers for hidden states of ``dtype``) where a call
        fits; None: always eager."""
        self.__dict__["_layer_graphs"] = None if graphs is None else _LayerGraphSlot(graphs, index, dtype)

    @property
    def rotary_embedding(self):
        """The model's rotary-embedding module this layer reads its angles from."""
        return self._rotary[0]

    def __getstate__(self):
        # captured graphs hold this layer's parameters and buffers: a copy (deepcopy, pickle) runs eagerly
        state = self.__dict__.copy()
        state.pop("_layer_graphs", None)
        return state

    def forward_eager(self, hidden_states, attention_mask=None, position_ids=None, cache=None,
                      position_embeddings=None, **kwargs):
        """The layer's computation, never replayed (what forward runs when no graph applies)."""
        b, s, _ = hidden_states.shape
        d = self.head_dim
        if torch.is_grad_enabled() and hidden_states.requires_grad:
            # the residual reaches o_proj's epilogue through an alias whose gradient the norm backward adds
            # to dx in its own pass (LayerNormLinear's return_input_alias): no separate add in the backward
            mixed, alias = self.qkv(hidden_states, return_input_alias=True)
        else:
            mixed, alias = self.qkv(hidden_states), hidden_states
        ang = self._angles(mixed, position_ids, b, s) if self.rope_fused and position_ids is not None else None
        if ang is not None and ang.shape[0] == 1 and "q_norm" not in self._modules:
            # one row of positions for the batch (training, a prompt): q and k turned in one launch,
            # their gradients written into mixed's
            q, k, v = split_qkv_rope(mixed, ang[0][:, None, None, :], self._split_sizes[0] // d,
                                     self._split_sizes[1] // d, d)
        else:
            q, k, v = torch.split(mixed, self._split_sizes, dim=-1)
            q, k, v = q.view(b, s, -1, d), k.view(b, s, -1, d), v.view(b, s, -1, d)
            if mixed.requires_grad:  # what the attention keeps of v then holds none of mixed (split_qkv_rope)
                v = v.contiguous()
            if "q_norm" in self._modules:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self._rope(q, k, ang, position_embeddings)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # transformers' [b, heads, s, d]
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
            if attention_mask is None and k.shape[2] > s:
                k, v = _filled_static_keys(cache, self.layer_idx, k, v)
        out, _ = seqfuse_attention_forward(
            self, q, k, v, attention_mask, dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.scaling, sliding_window=self.sliding_window, position_ids=position_ids, **kwargs)
        o = out.reshape(b, s, -1)
        if self._residual_fusable(hidden_states, compute_dtype(o, self.proj.weight), 0):  # in the GEMMs' epilogues
            x = self.proj(o, residual=alias)
        else:
            x = hidden_states + self._dropout(self.proj(o), self.resid_dropout[0])
        if self._residual_fusable(x, x.dtype, 1):  # (LayerNormMLP computes in x's dtype)
            return self.mlp_fused(x, residual=x)
        return x + self._dropout(self.mlp_fused(x), self.resid_dropout[1])

    def _residual_fusable(self, residual, out_dtype, which):
        """Whether residual branch ``which`` (0 attention, 1 MLP) is added in
        its last GEMM's epilogue: no dropout on the branch now and the
        residual in the branch output's dtype (residual_fusable logs each
        reason once; hidden states kept in float32 under a bfloat16 autocast
        are added after the GEMM, as transformers adds them)."""
        why_not = "residual dropout in training" if self.resid_dropout[which] > 0.0 and self.training else None
        return residual_fusable("seqfuse fused decoder layer", residual, out_dtype, why_not)


class _LayerGraphSlot(NamedTuple):
    graphs: object  # the model's LayerGraphs
    index: int  # this layer's callable in graphs.graphed
    dtype: torch.dtype  # the hidden states' dtype at capture


def _graph_reason(slot, hidden_states, attention_mask, position_ids, cache, kwargs):
    """Why a decoder-layer call cannot replay the graphed layers (found
    without a host read), or None: the graphs hold an unpadded causal batch
    of the captured dtype at the positions transformers derives (0, 1, ...
    per row), no key cache (LayerGraphs.for_call checks the rest: training,
    shape, autocast, recipe)."""
    if hidden_states.dtype != slot.dtype:
        return (f"hidden states {hidden_states.dtype} with torch autocast "
                f"{'on' if torch.is_autocast_enabled('cuda') else 'off'}, graphed for {slot.dtype} with "
                f"autocast {'on' if slot.graphs.autocast else 'off'}")
    if any(kwargs.get(k) is not None for k in ("cu_seq_lens_q", "cu_seq_lens_k")):
        return "packed (thd) call"
    if attention_mask is not None:
        return "an attention mask (a padded call)"
    if cache is not None:
        return "a key cache (pass use_cache=False in training)"
    if position_ids is not None and not derived_positions():
        return "position_ids given by the caller (the graphs hold 0, 1, ... per row)"
    return None


def _filled_static_keys(cache, layer_idx, k, v):
    """The filled part of a static cache layer's keys and values when no
    mask says it (transformers' mask covers only the filled keys when there
    is one): its cumulative length, read on the host."""
    layers = getattr(cache, "layers", None)
    layer = layers[layer_idx] if layers is not None and layer_idx < len(layers) else None
    if layer is None or getattr(layer, "max_cache_len", None) != k.shape[2] or getattr(layer, "is_sliding", False):
        return k, v  # a dynamic cache: every key is filled
    filled = int(layer.get_seq_length())
    return k[:, :, :filled], v[:, :, :filled]


def _to_hf_state_dict(module, state_dict, prefix, local_metadata):
    """state_dict hook: the fused entries become transformers' keys (split
    copies), in the original layer's key order.  FP8 scaling state (the
    modules' ``fp8_state.*`` buffers, present once an FP8 recipe has run)
    has no transformers name: it stays under seqfuse's names after them, so
    a checkpoint resumes with its scales (plain transformers reports those
    keys as unexpected and ignores them)."""
    mine, scaling = {}, {}
    for key in [k for k in state_dict if k.startswith(prefix)]:
        local = key[len(prefix):]
        (scaling if ".fp8_state." in "." + local else mine)[local] = state_dict.pop(key)
    out = {}
    for fused, hf in module._key_map():
        t = mine.pop(fused)
        if len(hf) == 1:
            out[hf[0]] = t
        else:
            parts = torch.split(t.detach(), module._split_sizes_of(fused), dim=0)
            out.update({name: part.clone() for name, part in zip(hf, parts)})
    if mine:
        raise RuntimeError(f"seqfuse fused layer {prefix!r}: state dict entries {sorted(mine)} have no "
                           "transformers name")
    order = [k for k in module._hf_keys if k in out] + [k for k in out if k not in module._hf_keys]
    for key in order:
        state_dict[prefix + key] = out[key]
    for key, t in scaling.items():
        state_dict[prefix + key] = t
    return state_dict


def _from_hf_state_dict(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                        error_msgs):
    """load_state_dict pre-hook: transformers' keys are fused (or renamed)
    into the fused layer's; a state dict already in fused keys passes."""
    for fused, hf in module._key_map():
        names = [prefix + n for n in hf]
        if not all(n in state_dict for n in names):
            continue  # absent (or partly: the missing ones are reported by load_state_dict as missing)
        parts = [state_dict.pop(n) for n in names]
        state_dict[prefix + fused] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def hf_named_tensors(model, what="grad"):
    """{transformers parameter name: tensor} of an accelerated model, the
    fused weights split back: ``what`` "grad" (each parameter's .grad, None
    where it has none) or "data" (the values).  What a test or a gradient
    check compares against the plain model's named_parameters()."""
    if what not in ("grad", "data"):
        raise ValueError(f"hf_named_tensors: argument 'what' must be 'grad' or 'data', got {what!r}")
    fused = {name: m for name, m in model.named_modules() if isinstance(m, FusedLayer)}
    out = {}
    for name, p in model.named_parameters():
        t = p.grad if what == "grad" else p.detach()
        owner = next((n for n in fused if name.startswith(n + ".")), None)
        if owner is None:
            out[name] = t
            continue
        layer, local = fused[owner], name[len(owner) + 1:]
        hf = dict(layer._key_map())[local]
        if len(hf) == 1:
            out[f"{owner}.{hf[0]}"] = t
        else:
            parts = [None] * len(hf) if t is None else torch.split(t, layer._split_sizes_of(local), dim=0)
            out.update({f"{owner}.{n}": part for n, part in zip(hf, parts)})
    return out
