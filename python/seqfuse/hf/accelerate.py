"""``seqfuse.hf.accelerate(model, recipe=None)``: make a Hugging Face
PreTrainedModel (any nn.Module, really) run on seqfuse, in place, keeping
its weights, and report what was fused, what was swapped, what was left and
why.  In order:

1. attention switched to seqfuse's fused kernel (below, "Attention");
2. whole-layer fusion (``fuse_layers=True``): every decoder layer of the
   Llama family (Llama, Mistral, Qwen2, Qwen3, Gemma, Phi-3) becomes one
   fused layer (seqfuse.hf.fuse_layers: norm + QKV as one LayerNormLinear
   GEMM, fused RoPE, seqfuse attention, norm + gate/up + SwiGLU + down as
   one LayerNormMLP), and every BERT / RoBERTa encoder layer too
   (seqfuse.hf.fuse_encoder: fused QKV GEMM, seqfuse attention, the
   post-attention norm + MLP as one LayerNormMLP); the state_dict keeps
   transformers' keys.  A layer that cannot be fused is listed with the
   reason and goes through step 4;
3. mixture-of-experts experts (``fuse_experts=True``): transformers' stacked
   experts of Mixtral, Qwen2-MoE and Qwen3-MoE (MixtralExperts, ...) become
   seqfuse.hf.fuse_experts.SeqfuseExperts (permutation, grouped GEMMs,
   scaled SwiGLU), keeping their Parameters and the block's router;
4. module by module, for everything not fused: nn.Linear and nn.LayerNorm
   and the model's RMSNorm classes (described below);
5. fused loss (``fused_loss=True``): those families' causal LMs compute the
   LM head and cross-entropy of a labels call as seqfuse's chunked linear
   cross-entropy (seqfuse.hf.fused_loss; logits are then None).

Module by module (step 4):

Weights are kept by moving the very Parameter objects into the new modules,
so tied weights stay tied (e.g. an LM head tied to the word embeddings), an
optimizer built before the swap still holds the live parameters, and dtype
and device are unchanged.  Whole-layer fusion (step 2) is different: its
fused QKV and gate/up weights are new Parameters (listed in
``report.new_parameters`` and logged): build the optimizer after
accelerate().  A module is swapped only when seqfuse computes
the same function; everything else is left as it was and listed in the
report with the reason (never a silent fallback):

- a subclass of nn.Linear / nn.LayerNorm (its forward may differ), modules
  with hooks or parametrizations (weight norm, LoRA wrappers),
- dtypes other than float32 / float16 / bfloat16, meta or sparse weights,
- nn.LayerNorm without elementwise affine, without bias, or over more than
  the last dimension,
- under an FP8 recipe, a Linear whose in/out features are not multiples of
  16 (the FP8 GEMM's alignment),
- modules that hold parameters but have no seqfuse counterpart
  (transformers' Conv1D, which stores its weight transposed; embeddings;
  bare parameters such as an LM head bias).

A model's own RMSNorm classes (LlamaRMSNorm, GemmaRMSNorm's 1 + weight,
T5LayerNorm, ...: a "*Norm" class holding one 1-D weight and an eps) become
seqfuse.pytorch.RMSNorm, with or without zero-centred gamma, only when the
two compute the same thing: the module's forward takes the input alone (a
gated norm's ``forward(hidden_states, gate=None)`` is left), and both are
run on probe inputs (in the module's dtype and device, with its weights and
with random ones, on a copy) and must agree within the dtype's rounding;
otherwise the module is left, saying so.

With a ``recipe``, the model's forward is wrapped to run under
``seqfuse.pytorch.autocast(enabled=True, recipe=recipe)``.  A second
accelerate() of the model keeps the first call's recipe, None included
(recipe=None or an equal one), or is refused (another recipe): what the
first call swapped and wrapped was made for its recipe, and a second call
undoes nothing.

transformers' gradient checkpointing (``gradient_checkpointing_enable``,
before or after the swap) is routed through seqfuse.pytorch.checkpoint,
which recomputes with the forward's FP8 settings and scales (torch's own
recomputes outside autocast, and torch then raises), and with the forward's
derived-positions mark (seqfuse.hf.positions.marked_checkpoint: no host read
for the packed-sequence test in the recompute either).  It is non-reentrant;
a use_reentrant=True request is replaced, and the log says so.

Attention (``attention=True``): a transformers model whose attention layers
go through transformers' AttentionInterface is switched to seqfuse's fused
attention (seqfuse.hf.attention) with ``set_attn_implementation("seqfuse")``;
reported under the name "config._attn_implementation".  It is left, with the
reason, when the model does not use the interface, when its attention
modules carry attention sinks (a ``sinks`` tensor, as gpt-oss's do), or
when the kernel cannot take the model's head dim on the model's device
(asked of the kernel itself).  Attention dropout (while training) and
sliding windows are applied in the kernel, as the model's layers ask.
"""
import copy
import functools
import inspect
import logging
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from ..pytorch import LayerNorm, Linear, RMSNorm, autocast
from .method_wrap import wrap_method, wrap_method_once, wrapped_with

_log = logging.getLogger("seqfuse")

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP8_ALIGN = 16


@dataclass
class Swapped:
    name: str
    original: str
    replacement: str


@dataclass
class Left:
    name: str
    module_type: str
    reason: str


@dataclass
class Fused:
    """A whole layer replaced by a fused one: its name, class, and notes
    (what inside it is not fused, e.g. RoPE in torch, and why)."""
    name: str
    original: str
    replacement: str
    notes: list = field(default_factory=list)


@dataclass
class AccelerateReport:
    """What ``accelerate`` did: ``fused`` (whole layers), ``swapped`` and
    ``left`` lists (module by module), the loss path, and the recipe."""

    swapped: list = field(default_factory=list)
    left: list = field(default_factory=list)
    recipe: object = None
    fused: list = field(default_factory=list)
    loss: str = "transformers' own LM head and loss"
    #: names of Parameters the fusion created (fused QKV, gate/up): an optimizer must be built after accelerate()
    new_parameters: list = field(default_factory=list)

    def fused_names(self):
        return [f.name for f in self.fused]

    def swapped_names(self):
        return [s.name for s in self.swapped]

    def left_names(self):
        return [entry.name for entry in self.left]

    def reason(self, name):
        """Why module ``name`` was left (KeyError if it was not)."""
        for entry in self.left:
            if entry.name == name:
                return entry.reason
        raise KeyError(f"AccelerateReport: module {name!r} was not left")

    def counts(self):
        out = {}
        for s in self.swapped:
            key = f"{s.original} -> {s.replacement}"
            out[key] = out.get(key, 0) + 1
        return out

    def __str__(self):
        lines = [f"seqfuse.hf.accelerate: fused {len(self.fused)} layer(s), swapped {len(self.swapped)} module(s), "
                 f"left {len(self.left)}"]
        for f in self.fused:
            extra = f" ({'; '.join(f.notes)})" if f.notes else ""
            lines.append(f"  fused {f.name} ({f.original} -> {f.replacement}){extra}")
        lines.append(f"  loss with labels: {self.loss}")
        if self.new_parameters:
            lines.append(f"  new Parameters (build the optimizer after accelerate()): {len(self.new_parameters)}, "
                         f"e.g. {self.new_parameters[0]}")
        if self.recipe is not None:
            lines.append(f"  forward runs under seqfuse autocast with recipe {self.recipe!r}")
        for k, n in self.counts().items():
            lines.append(f"  swapped {n} x {k}")
        for entry in self.left:
            lines.append(f"  left {entry.name or '<root>'} ({entry.module_type}): {entry.reason}")
        return "\n".join(lines)


def _seqfuse_modules():
    """The classes a swap puts in: (Linear, LayerNorm).  A function so the
    tests can run the walk with plain-torch modules in their place."""
    return Linear, LayerNorm


def _seqfuse_rmsnorm():
    """The RMSNorm class a swap puts in (a function for the same reason)."""
    return RMSNorm


#: relative difference (per row, the worst) allowed between a model's RMSNorm and
#: seqfuse's on the probe: their rounding differs (upcast / scale / downcast order),
#: nothing else
_RMS_PROBE_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _rmsnorm_eps(module):
    for attr in ("variance_epsilon", "eps", "epsilon"):
        v = getattr(module, attr, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return None


def _make_rmsnorm(RMSNorm, eps, zero_centered, m):
    w = m.weight
    new = RMSNorm(w.shape[0], eps=eps, zero_centered_gamma=zero_centered, params_dtype=w.dtype, device=w.device)
    _move_params(m, new, ("weight",))
    return new


def _forward_extra_inputs(module):
    """The parameters of ``type(module).forward`` besides self and the input
    (a list of names, *args / **kwargs included); [] when its signature
    cannot be read (the probe then decides)."""
    try:
        params = list(inspect.signature(type(module).forward).parameters.values())
    except (TypeError, ValueError):
        return []
    return [("*" if p.kind is p.VAR_POSITIONAL else "**" if p.kind is p.VAR_KEYWORD else "") + p.name
            for p in params[2:]]


def _rmsnorm_match(RMSNorm, module):
    """((eps, zero_centered), None) when ``module`` (a model's own norm class)
    computes what seqfuse's RMSNorm computes, with or without zero-centred
    gamma; else (None, reason).  Decided by running both on probe inputs,
    with the module's weights and with random ones (on a copy of the module)."""
    cls = type(module).__name__
    names = [n for n, _ in module.named_parameters(recurse=False)]
    if names != ["weight"] or module.weight.dim() != 1:
        return None, f"{cls} holds parameter(s) {names}; seqfuse's RMSNorm takes one 1-D weight"
    why = _common_refusal(module)
    if why is not None:
        return None, why
    extra = _forward_extra_inputs(module)
    if extra:
        # e.g. gated norms, forward(hidden_states, gate=None): the model calls
        # them with the gate, which seqfuse's RMSNorm does not take, and a
        # one-argument probe would not see what the gate does.
        return None, (f"{cls}.forward takes {extra} besides the input; seqfuse's RMSNorm takes the input "
                      "alone; left as it is")
    eps = _rmsnorm_eps(module)
    if eps is None:
        return None, f"{cls} has no eps (variance_epsilon / eps) to carry over to seqfuse's RMSNorm"
    w = module.weight
    n = w.shape[0]
    g = torch.Generator().manual_seed(0)
    # rows at several magnitudes, down to where eps dominates the mean square
    scale = torch.tensor([1e-3, 3e-2, 1.0, 30.0])[:, None, None]
    x = (scale * torch.randn(4, 6, n, generator=g)).to(device=w.device, dtype=w.dtype)
    weights = (w.detach(), torch.randn(n, generator=g).to(device=w.device, dtype=w.dtype))
    probe = copy.deepcopy(module)
    with torch.no_grad():
        for zero_centered in (False, True):
            cand = RMSNorm(n, eps=eps, zero_centered_gamma=zero_centered, params_dtype=w.dtype, device=w.device)
            same = True
            for weight in weights:
                probe.weight.copy_(weight)
                cand.weight.copy_(weight)
                try:
                    want, got = probe(x), cand(x)
                except Exception as e:  # noqa: BLE001 - whatever the module raises, it is left (a refusal)
                    return None, f"{cls}: probing it against seqfuse's RMSNorm failed ({type(e).__name__}: {e})"
                if (not isinstance(want, torch.Tensor) or want.shape != got.shape or want.dtype != got.dtype
                        or not torch.isfinite(want).all()):
                    same = False
                    break
                rows = want.double().norm(dim=-1).clamp_min(1e-30)
                diff = ((got.double() - want.double()).norm(dim=-1) / rows).max()  # the worst row
                if diff > _RMS_PROBE_TOL[w.dtype]:
                    same = False
                    break
            if same:
                return (eps, zero_centered), None
    return None, (f"{cls} does not compute what seqfuse's RMSNorm computes (with or without zero-centred "
                  "gamma) on probe inputs; left as it is")


def _rmsnorm_plan(RMSNorm, module):
    """(factory, None) when ``module`` can become seqfuse's RMSNorm
    (``_rmsnorm_match``), else (None, reason)."""
    match, why = _rmsnorm_match(RMSNorm, module)
    if match is None:
        return None, why
    return functools.partial(_make_rmsnorm, RMSNorm, *match), None


def _common_refusal(module):
    """Why a module cannot be swapped whatever its type, or None."""
    if module._forward_hooks or module._forward_pre_hooks or getattr(module, "_backward_hooks", None):
        return "has forward/backward hooks, which the replacement would not carry"
    if hasattr(module, "parametrizations"):
        return "has parametrizations (e.g. weight norm), which the replacement would not carry"
    for name, p in module.named_parameters(recurse=False):
        if p.is_meta:
            return f"parameter {name!r} is on the meta device (not materialised)"
        if p.layout != torch.strided:
            return f"parameter {name!r} has layout {p.layout}; seqfuse takes dense tensors"
        if p.dtype not in _DTYPES:
            return f"parameter {name!r} has dtype {p.dtype}; seqfuse's kernels take float32, float16, bfloat16"
    return None


def _plain_refusal(module, torch_cls):
    """Why ``module`` cannot stand in for a plain ``torch_cls`` (nn.Linear,
    nn.LayerNorm): a subclass with its own behaviour, or _common_refusal's
    reasons; None when it can."""
    if type(module) is not torch_cls:
        name = torch_cls.__name__
        return (f"{type(module).__name__} subclasses nn.{name} with its own behaviour; "
                f"only plain nn.{name} is swapped")
    return _common_refusal(module)


def _linear_refusal(module, align):
    why = _plain_refusal(module, nn.Linear)
    if why:
        return why
    if align and (module.in_features % align or module.out_features % align):
        return (f"low-precision GEMMs need in_features and out_features divisible by {align}, got "
                f"({module.in_features}, {module.out_features}); left in torch (higher precision)")
    return None


def _layernorm_refusal(module):
    why = _plain_refusal(module, nn.LayerNorm)
    if why:
        return why
    if len(module.normalized_shape) != 1:
        return (f"normalizes over the last {len(module.normalized_shape)} dimensions "
                f"{tuple(module.normalized_shape)}; seqfuse's LayerNorm normalizes the last one")
    if not module.elementwise_affine:
        return "elementwise_affine=False (no weight); seqfuse's LayerNorm has a weight and a bias"
    if module.bias is None:
        return "bias=False; seqfuse's LayerNorm has a bias"
    return None


def _other_reason(module):
    """Why a module holding its own parameters is left, for types accelerate does not swap."""
    cls = type(module).__name__
    if cls == "Conv1D" and type(module).__module__.startswith("transformers"):
        return ("transformers Conv1D stores its weight as [in, out] (transposed) and is not an "
                "nn.Linear; swapping it would change the weight layout of the checkpoint")
    if isinstance(module, nn.Embedding):
        return "embedding lookup: not a GEMM or norm, no seqfuse replacement"
    names = [n for n, _ in module.named_parameters(recurse=False)]
    return f"holds parameter(s) {names} used by {cls}'s own forward; no seqfuse replacement"


def _move_params(old, new, names):
    """Hand ``old``'s Parameter objects to ``new`` (same identity, so ties hold)."""
    for n in names:
        p = getattr(old, n, None)
        if p is None:
            continue
        cur = getattr(new, n, None)
        if not isinstance(cur, torch.Tensor) or tuple(cur.shape) != tuple(p.shape):
            raise RuntimeError(
                f"accelerate: {type(new).__name__}.{n} has shape "
                f"{None if cur is None else tuple(cur.shape)}, the original has {tuple(p.shape)}")
        setattr(new, n, p)


def _make_linear(Linear, m):
    w = m.weight
    new = Linear(m.in_features, m.out_features, bias=m.bias is not None,
                 params_dtype=w.dtype, device=w.device)
    _move_params(m, new, ("weight", "bias"))
    return new


def _make_layernorm(LayerNorm, m):
    w = m.weight
    new = LayerNorm(m.normalized_shape[0], eps=m.eps, params_dtype=w.dtype, device=w.device)
    _move_params(m, new, ("weight", "bias"))
    return new


def _autocast_forward(inner, recipe):
    def forward(self, *args, **kwargs):
        with autocast(enabled=True, recipe=recipe):
            return inner(self, *args, **kwargs)

    return forward


def _wrap_forward(model, recipe):
    """Once: a second accelerate() with an equal recipe keeps the one
    autocast wrapper (autocast reads only the recipe's settings, so an equal
    one changes nothing); a different one never gets here (_call_recipe)."""
    wrap_method_once(model, "forward", _autocast_forward, recipe)


#: The model's instance-dict key holding (the first accelerate()'s recipe,).
_RECIPE_MARK = "_seqfuse_accelerate_recipe"


def _call_recipe(model, recipe):
    """The recipe this accelerate() works under: ``recipe``, or the one the
    first accelerate() of the model worked under (None included), which a
    second call with recipe=None or an equal recipe keeps (its sizes decide what is
    swapped, and it stays the forward's).  A different recipe is refused:
    the earlier call's autocast wrapper, fused layers and swapped modules
    were made for its recipe, and a second call undoes none of them."""
    earlier = model.__dict__.get(_RECIPE_MARK)
    if earlier is None:  # the first call: its recipe (None included) is the model's from now on
        model.__dict__[_RECIPE_MARK] = (recipe,)
        return recipe
    first = earlier[0]
    if recipe is None or recipe == first:
        return first
    if first is None:
        raise ValueError(f"accelerate: argument 'recipe' is {recipe!r}, but an earlier accelerate() of this model "
                         "had none: its modules were swapped without FP8's size rules, which a second call does "
                         "not undo; accelerate a fresh copy of the model with the recipe")
    raise ValueError(f"accelerate: argument 'recipe' is {recipe!r}, but an earlier accelerate() of this model "
                     f"set {first!r}: the model's forward runs under seqfuse autocast with it and its modules were "
                     "swapped for its GEMM sizes, which a second call does not undo; pass recipe=None (or an "
                     "equal recipe) to keep it, or accelerate a fresh copy of the model with the new recipe")


def _gemm_alignment(recipe):
    """The multiple that in/out features must be under ``recipe``: 16 for
    per-tensor FP8 (delayed, current), 128 for Float8BlockScaling (its
    1x128 / 128x128 blocks: the modules refuse other sizes when they run),
    32 for the 32-element block formats (MXFP8, NVFP4); None without a
    recipe (bf16/fp32 GEMMs take any shape)."""
    if recipe is None:
        return None
    if recipe.float8_block_scaling():
        return 128
    return 32 if (recipe.mxfp8() or recipe.nvfp4()) else FP8_ALIGN


ATTN_SLOT = "config._attn_implementation"


def _attention_refusal(model):
    """Why the model's attention cannot be switched to seqfuse's, or None."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        return "not a transformers PreTrainedModel: no attention interface to switch"
    if not getattr(model, "_supports_attention_backend", False):
        return (f"{type(model).__name__} does not route attention through transformers' AttentionInterface "
                "(_supports_attention_backend is False)")
    # Attention sinks (gpt-oss, MiMo's sliding-window layers, ...): the layers
    # hand their ``sinks`` tensor to the attention function, whose fused
    # kernel has no sink logit and would refuse every call; leave such
    # models' attention to torch and say why.
    with_sinks = [name for name, m in model.named_modules()
                  if isinstance(getattr(m, "sinks", None), torch.Tensor)]
    if with_sinks:
        shown = ", ".join(with_sinks[:3]) + (", ..." if len(with_sinks) > 3 else "")
        return (f"attention module(s) {shown} carry attention sinks (a 'sinks' tensor), which seqfuse's fused "
                "attention does not compute; attention left in torch")
    cfg = model.config
    heads = getattr(cfg, "num_attention_heads", None)
    head_dim = getattr(cfg, "head_dim", None) or (cfg.hidden_size // heads if heads else None)
    if head_dim is None:
        return "cannot tell the model's head dim from its config"
    p = next(model.parameters(), None)
    if p is not None:
        from .. import ops

        dtype = p.dtype  # what the layers will hand the kernel (no autocast assumed)
        probe = torch.zeros(1, 1, 1, head_dim, device=p.device, dtype=dtype)
        try:
            ops.attention(probe, probe, probe, qkv_format="bshd")
        except (NotImplementedError, TypeError, ValueError) as e:
            return f"the fused attention kernel refuses head dim {head_dim} on {p.device} ({dtype}): {e}"
    return None


def _switch_attention(model, report):
    current = getattr(getattr(model, "config", None), "_attn_implementation", None)
    why = _attention_refusal(model)
    if why is not None:
        report.left.append(Left(ATTN_SLOT, str(current), why))
        return
    from .attention import NAME, register

    register()
    model.set_attn_implementation(NAME)
    if model.config._attn_implementation != NAME:
        report.left.append(Left(ATTN_SLOT, str(current), "transformers refused set_attn_implementation"))
        return
    report.swapped.append(Swapped(ATTN_SLOT, str(current), NAME))


def _layer_rotaries(model):
    """{id(decoder layer): the rotary_emb module of the model that holds it}."""
    out = {}
    for m in model.modules():
        layers, rotary = getattr(m, "layers", None), getattr(m, "rotary_emb", None)
        if isinstance(layers, nn.ModuleList) and isinstance(rotary, nn.Module):
            for layer in layers:
                out[id(layer)] = rotary
    return out


def _fuse_layers(model, recipe, report, recompute_activation=False):
    """Replace every decoder layer of a known family (seqfuse.hf.fuse_layers)
    by its fused layer; the others are reported and left to the module walk.
    Returns the names of the fused layers.

    A replaced layer's modules and weights are freed before the next layer
    is fused: nothing here keeps a reference to them (the walk looks each
    module up by name, ``slots`` is narrowed to the layers' own, the
    parameters from before are known by weak reference), so the
    conversion's peak is the model plus one layer's fused weights, not one
    more copy of every layer's QKV and gate/up weights (1.2 GiB at Llama 3.2
    1B, where a prefill's whole step needs 2.7)."""
    from . import fuse_encoder as FE
    from . import fuse_layers as FL

    RMSNorm = _seqfuse_rmsnorm()
    match = functools.partial(_rmsnorm_match, RMSNorm)
    align = _gemm_alignment(recipe)
    rotaries = _layer_rotaries(model)
    before = {id(p): weakref.ref(p) for p in model.parameters()}
    # the layers' own slots only: the others' parents would keep the replaced layers' submodules alive
    families = set(FL.FAMILIES) | set(FE.ENCODER_FAMILIES)
    all_slots = _module_slots(model)
    slots = {id(m): all_slots[id(m)] for _, m in model.named_modules() if type(m).__name__ in families}
    del all_slots
    done = []
    for name in [name for name, _ in model.named_modules()]:
        try:
            module = model.get_submodule(name)
        except AttributeError:  # inside a layer fused earlier in this walk: gone with it
            continue
        kind = type(module).__name__
        if isinstance(module, FL.FusedLayer):
            continue
        if kind in FE.ENCODER_FAMILIES:
            why = FE.encoder_fusion_plan(module, align)
            fuse = functools.partial(FE.fuse_encoder_layer, module)
        elif kind in FL.FAMILIES:
            why = FL.layer_fusion_plan(module, match, align)
            if why is None and id(module) not in rotaries:
                why = "not found in a model's `layers` list beside its rotary_emb"
            fuse = functools.partial(FL.fuse_layer, module, match, rotaries.get(id(module)), recompute_activation)
        else:
            continue
        if why is not None:
            report.left.append(Left(name, type(module).__name__, f"whole-layer fusion: {why}; its modules are "
                                                                  "swapped one by one where exact"))
            _log.info("seqfuse.hf.accelerate: layer %s not fused: %s", name, why)
            continue
        new, notes = fuse()
        for parent, child_name in slots[id(module)]:
            setattr(parent, child_name, new)
        report.fused.append(Fused(name, type(module).__name__, type(new).__name__, notes))
        done.append(name)
        del module, fuse, new
    report.new_parameters = [n for n, p in model.named_parameters()
                             if id(p) not in before or before[id(p)]() is not p]
    if report.new_parameters:
        _log.warning("seqfuse.hf.accelerate: whole-layer fusion made %d new Parameters (fused QKV and gate/up "
                     "weights, e.g. %s): build the optimizer after accelerate(); one built before keeps the "
                     "unfused weights, which no longer receive gradients", len(report.new_parameters),
                     report.new_parameters[0])
    return done


def _module_slots(model):
    """Every (parent, attribute) slot holding each module, by id: a module
    shared by two parents is replaced in both."""
    slots = {}
    for _, parent in model.named_modules(remove_duplicate=False):
        for child_name, child in parent.named_children():
            slots.setdefault(id(child), []).append((parent, child_name))
    return slots


def accelerate(model, recipe=None, attention=True, fuse_layers=True, fused_loss=True, fuse_experts=True,
               recompute_activation=None, fp8_lm_head=False):
    """Accelerate a transformers model in place; return an AccelerateReport.

    - ``fuse_layers``: decoder layers of the Llama family (Llama, Mistral,
      Qwen2, Qwen3, Gemma, Phi-3) and BERT / RoBERTa encoder layers become
      whole fused layers (new Parameters for fused weights: build the
      optimizer after this call) (seqfuse.hf.fuse_layers, fuse_encoder:
      QKV in one GEMM, seqfuse attention, a norm fused into the MLP's first
      GEMM; the decoders' fused RoPE and SwiGLU); needs the attention
      switched (``attention``).
    - ``fuse_experts``: transformers' stacked MoE experts (Mixtral,
      Qwen2-MoE, Qwen3-MoE) -> seqfuse.hf.fuse_experts.SeqfuseExperts, the
      same Parameters, the router left as it is.
    - Every other nn.Linear -> seqfuse.pytorch.Linear, nn.LayerNorm ->
      seqfuse.pytorch.LayerNorm, the model's own RMSNorm classes (where a
      probe shows the same function) -> seqfuse.pytorch.RMSNorm.
    - ``recompute_activation``: the fused decoder layers' MLPs (not the
      encoder layers': their GELU has no gate) keep FC1's output but
      not the gated activation, and make it again in the backward
      (LayerNormMLP's option: one [tokens, ffn] tensor less a layer from
      the forward to the backward -- two bytes an element in bf16, the FP8
      copy's one under FP8 -- for one elementwise pass more; what
      Liger-Kernel's SwiGLU does).  None (the default): on for the layers
      this call fuses, with or without an FP8 recipe (measured at the
      Llama 1B shape: in bf16 on the H200 at 4,096 tokens 1.0 GiB less
      peak for 1.5-2.7 % of the step; under FP8 delayed scaling on an H100
      0.63 GiB less for 1.4 % at 4,096 tokens and 1.1 GiB for 0.8 % at
      8,192, which puts the FP8 peak under Liger-Kernel's there, 0.98x;
      1.02x at 4,096); False: off
      for them (the faster step); True: on for them and for layers an
      earlier call fused (said when no layer is fused).
    - ``fused_loss``: a causal LM of those families called with ``labels``
      computes its LM head and cross-entropy as seqfuse's chunked
      linear_cross_entropy (no full logits; ``logits`` is then None in the
      output, as with Liger-Kernel's fused loss).
    - ``fp8_lm_head``: under a recipe the LM head (the model's output
      embeddings) stays in high precision by default, as Megatron-Core's and
      DeepSeek-V3's FP8 training keep it (its logits feed a softmax over the
      whole vocabulary); True puts it in FP8 too: swapped like the other
      Linears, and the fused loss's GEMMs in FP8 (a per-tensor recipe).
      Like every swap, a later call does not undo it (False then changes
      nothing); a checkpoint saved with the head in FP8 carries the head's
      FP8 scaling state, which a model accelerated without it does not
      take strictly.

    ``recipe`` (a seqfuse.common.recipe recipe, e.g. DelayedScaling()) makes
    the model's forward run under seqfuse autocast with it, and leaves the
    Linears (and layers) whose shapes its GEMMs cannot take (listed in the
    report).  ``attention`` switches a transformers model's attention to
    seqfuse's fused kernel where it can (see the module note).

    A second accelerate() of the same model adds what the first did not do
    and undoes nothing: recipe=None (or an equal recipe) keeps the first
    call's recipe, for the forward and for which shapes are swapped; a
    different recipe is refused (ValueError naming 'recipe').
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"accelerate: model must be a torch.nn.Module, got {type(model).__name__}")
    for name, flag in (("attention", attention), ("fuse_layers", fuse_layers), ("fused_loss", fused_loss),
                       ("fuse_experts", fuse_experts), ("fp8_lm_head", fp8_lm_head)):
        if not isinstance(flag, bool):
            raise TypeError(f"accelerate: argument '{name}' must be a bool, got {type(flag).__name__}")
    if recompute_activation is not None and not isinstance(recompute_activation, bool):
        raise TypeError(f"accelerate: argument 'recompute_activation' must be a bool or None, got "
                        f"{type(recompute_activation).__name__}")
    from seqfuse.common.recipe import Recipe

    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(f"accelerate: argument 'recipe' must be a seqfuse.common.recipe recipe (e.g. "
                        f"DelayedScaling()), got {type(recipe).__name__}")
    in_force = recipe if recipe is not None else model.__dict__.get(_RECIPE_MARK, (None,))[0]
    if fp8_lm_head and in_force is not None and not in_force.float8_per_tensor_scaling():
        raise ValueError(f"accelerate: fp8_lm_head=True needs a per-tensor recipe (DelayedScaling or "
                         f"Float8CurrentScaling) for the fused loss's FP8 GEMMs, got {type(in_force).__name__}")
    recipe = _call_recipe(model, recipe)
    Linear, LayerNorm = _seqfuse_modules()
    RMSNorm = _seqfuse_rmsnorm()
    align = _gemm_alignment(recipe)
    report = AccelerateReport(recipe=recipe)
    if attention:
        _switch_attention(model, report)
    fused = []
    if fuse_layers:
        from .attention import NAME

        if getattr(getattr(model, "config", None), "_attn_implementation", None) == NAME:
            fused = _fuse_layers(model, recipe, report,
                                 recompute_activation is not False)
        else:
            _log.info("seqfuse.hf.accelerate: no whole-layer fusion: the model's attention is not seqfuse's")
    from .fuse_experts import SeqfuseExperts, swap_experts
    from .fuse_layers import FusedLayer, SeqfuseDecoderLayer

    if fuse_experts:
        swap_experts(model, report, recipe, _module_slots(model), Swapped, Left)

    # the walk leaves fused layers alone: this call's and an earlier call's
    fused = [n for n, m in model.named_modules() if isinstance(m, FusedLayer)]
    if recompute_activation is True:  # an earlier call's fused layers too (a second call undoes nothing)
        if not any(isinstance(m, SeqfuseDecoderLayer) for m in model.modules()):
            _log.warning("seqfuse.hf.accelerate: recompute_activation=True changes nothing: no decoder layer is "
                         "fused (it applies to the fused layers' MLPs)")
        for m in model.modules():
            if isinstance(m, SeqfuseDecoderLayer) and not m.mlp_fused.recompute_activation:
                m.mlp_fused.recompute_activation = True
                _log.info("seqfuse.hf.accelerate: %s keeps no MLP activation (recompute_activation)",
                          type(m).__name__)
    head = _lm_head(model, recipe, fp8_lm_head, align)
    inside_fused = tuple(n + "." for n in fused)
    plan = []  # (full name, module, new-module factory)
    for name, module in model.named_modules():
        if name in fused or name.startswith(inside_fused):
            continue
        if isinstance(module, (Linear, LayerNorm, RMSNorm, SeqfuseExperts)):
            continue
        if isinstance(module, nn.Linear):
            why = _linear_refusal(module, align)
            if why is None and module is head and not fp8_lm_head:
                why = ("the LM head stays in high precision under an FP8 recipe, as in Megatron-Core's and "
                       "DeepSeek-V3's FP8 training (fp8_lm_head=True puts it and the fused loss in FP8)")
            if why is None:
                plan.append((name, module, functools.partial(_make_linear, Linear)))
            else:
                report.left.append(Left(name, type(module).__name__, why))
        elif isinstance(module, nn.LayerNorm):
            why = _layernorm_refusal(module)
            if why is None:
                plan.append((name, module, functools.partial(_make_layernorm, LayerNorm)))
            else:
                report.left.append(Left(name, type(module).__name__, why))
        elif next(module.parameters(recurse=False), None) is not None:  # holds parameters of its own
            if "norm" in type(module).__name__.lower():  # a model's own norm class: RMSNorm if the probe agrees
                make, why = _rmsnorm_plan(RMSNorm, module)
            else:
                make, why = None, _other_reason(module)
            if make is not None:
                plan.append((name, module, make))
            else:
                report.left.append(Left(name, type(module).__name__, why))
    slots = _module_slots(model)
    for name, module, make in plan:
        if not name:
            raise ValueError("accelerate: the model itself is an nn.Linear/nn.LayerNorm; "
                             "swap it by constructing the seqfuse module directly")
        new = make(module)
        new.train(module.training)
        for parent, child_name in slots[id(module)]:
            setattr(parent, child_name, new)
        report.swapped.append(Swapped(name, type(module).__name__, type(new).__name__))
    if fused_loss:
        from .fused_loss import wrap_causal_lm_loss

        report.loss = wrap_causal_lm_loss(model)
    if recipe is not None:
        _wrap_forward(model, recipe)
    from .positions import install_mask_shortcut, wrap_positions

    # transformers' decoders with fused layers (Llama's family) derive missing positions as one contiguous
    # run per row: their packed-sequence tests need no host sync then
    if wrap_positions(model, SeqfuseDecoderLayer):
        install_mask_shortcut()
    _route_checkpointing(model)
    return report


class _GraphedLayerCall(nn.Module):
    """One fused decoder layer as CUDA graph capture takes it: the hidden
    states in, the positions transformers derives for an unpadded
    [batch, seq] call held (position ids 0, 1, ... and the model's rotary
    cos / sin of them).  Not registered in the model: its state dict keys
    stay the same."""

    def __init__(self, layer, position_ids, position_embeddings):
        super().__init__()
        self.layer = layer
        self.position_ids, self.position_embeddings = position_ids, position_embeddings

    def forward(self, x):
        from .positions import with_derived_positions

        # the positions are transformers' derived arange: no packed-sequence test (a host read) in the capture
        return with_derived_positions(self.layer.forward_eager, x, position_ids=self.position_ids,
                                      position_embeddings=self.position_embeddings)


def graph_layers(model, batch_size, seq_len, num_warmup_iters=3):
    """Capture the forward and backward of every decoder layer that
    ``accelerate()`` fused as CUDA graphs for unpadded training calls of
    exactly [batch_size, seq_len] tokens (seqfuse.hf.layer_graphs; FP8 under
    the recipe accelerate() was given); later such calls replay them, so
    the host issues two graph launches a layer instead of each kernel: what
    a step whose host work outruns its GPU work needs (FP8 at 1B scale).
    Calls that differ (another shape, an attention mask, a key cache:
    pass use_cache=False in training, as transformers otherwise builds one
    in every call; position ids of the caller's, packed sequences, another
    dtype or torch autocast setting than at this call, eval or no-grad) run
    eagerly, the reason logged once.  Needs CUDA, training mode, no dropout
    in the layers, no gradient checkpointing.  The weights stay the same
    Parameters (the optimizer's steps reach the next replay); a copy of the
    model (deepcopy, pickle) runs eagerly.  Call it under the autocast the
    training calls run under.  Returns the model."""
    from .fuse_layers import SeqfuseDecoderLayer
    from .layer_graphs import LayerGraphs, check_graphable
    from ..quantization import make_graphed_callables

    owner = "seqfuse.hf"
    layers = [m for m in model.modules() if isinstance(m, SeqfuseDecoderLayer)]
    if not layers:
        raise ValueError(f"{owner}.graph_layers: the model has no fused decoder layer: call "
                         "seqfuse.hf.accelerate(model) first (whole-layer fusion)")
    p = next(layers[0].parameters())
    dropout = "; ".join(sorted({f"attention {m.attention_dropout}, residual {m.resid_dropout}"
                                for m in layers if m.attention_dropout or any(m.resid_dropout)}))
    check_graphable(owner, p.device.type == "cuda", dropout or None,
                    getattr(model, "is_gradient_checkpointing", False), model.training,
                    batch_size=batch_size, seq_len=seq_len)
    recipe = model.__dict__.get(_RECIPE_MARK, (None,))[0]
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else p.dtype
    x = torch.randn(batch_size, seq_len, layers[0].config.hidden_size, device=p.device, dtype=dtype)
    positions = torch.arange(seq_len, device=p.device)[None].expand(batch_size, -1)
    rotary = layers[0].rotary_embedding
    with torch.no_grad():
        position_embeddings = tuple(t.detach() for t in rotary(x, positions))
    calls = tuple(_GraphedLayerCall(m, positions, position_embeddings) for m in layers)
    sample = tuple((x.clone().requires_grad_(True),) for _ in layers)
    graphed = make_graphed_callables(calls, sample, num_warmup_iters=num_warmup_iters,
                                     fp8_enabled=recipe is not None, fp8_recipe=recipe)
    graphs = LayerGraphs(type(model).__name__, _log)
    graphs.set((batch_size, seq_len), recipe, graphed)
    for i, m in enumerate(layers):
        m.set_graphs(graphs, i, dtype)
    _log.info("seqfuse.hf.graph_layers: %d decoder layers graphed for [%d, %d] training calls%s", len(layers),
              batch_size, seq_len, "" if recipe is None else f" under {recipe!r}")
    return model


def _lm_head(model, recipe, fp8_lm_head, align):
    """The model's LM head (its output embeddings, an nn.Linear) under a
    recipe, else None; with ``fp8_lm_head`` the fused loss is told to run
    the head's GEMMs in FP8 where the swap takes the head."""
    if recipe is None:
        if fp8_lm_head:
            _log.warning("seqfuse.hf.accelerate: fp8_lm_head=True changes nothing without an FP8 recipe")
        return None
    get = getattr(model, "get_output_embeddings", None)
    try:
        head = get() if callable(get) else None
    except (AttributeError, NotImplementedError):
        head = None
    if not isinstance(head, nn.Linear):
        return None
    if fp8_lm_head and _linear_refusal(head, align) is None:  # (the recipe's rule: checked by accelerate())
        from .fused_loss import set_fp8_head

        set_fp8_head(model, recipe)
    return head


def _seqfuse_checkpoint_like(func):
    """seqfuse's checkpoint in place of torch's (as transformers passes it: a
    partial with keyword arguments) or seqfuse.pytorch.checkpoint: the one
    whose recompute keeps the derived-positions mark too
    (seqfuse.hf.positions.marked_checkpoint); any other function is kept,
    with a warning."""
    from ..quantization.recompute import checkpoint
    from .positions import marked_checkpoint

    torch_ck = torch.utils.checkpoint.checkpoint
    if func is torch_ck or func is checkpoint:
        return marked_checkpoint
    partial_of = func.func if isinstance(func, functools.partial) else None
    if partial_of in (torch_ck, checkpoint) and not func.args:
        kw = dict(func.keywords)
        if partial_of is torch_ck and kw.pop("use_reentrant", False):
            _log.warning("seqfuse.hf.accelerate: gradient checkpointing runs non-reentrant "
                         "(seqfuse.pytorch.checkpoint, which keeps FP8 numerics); use_reentrant=True is not taken")
        return functools.partial(marked_checkpoint, **kw)
    if func is marked_checkpoint or partial_of in (marked_checkpoint, checkpoint):
        return func
    _log.warning("seqfuse.hf.accelerate: the gradient checkpointing function %r is not torch's checkpoint and is "
                 "kept; under an FP8 recipe its recompute runs outside seqfuse autocast", func)
    return func


def _checkpointing_setter(inner):
    def _set_gradient_checkpointing(self, enable=True, gradient_checkpointing_func=None, **kwargs):
        if gradient_checkpointing_func is None:
            return inner(self, enable=enable, **kwargs)
        return inner(self, enable=enable,
                     gradient_checkpointing_func=_seqfuse_checkpoint_like(gradient_checkpointing_func), **kwargs)

    return _set_gradient_checkpointing


def _route_checkpointing(model):
    """Make transformers' gradient checkpointing use seqfuse's checkpoint: the
    model's _set_gradient_checkpointing (what every transformers version's
    enable calls) swaps the function it is handed; layers that already hold
    one are switched now."""
    setter = getattr(model, "_set_gradient_checkpointing", None)
    if setter is None or wrapped_with(model.__dict__.get("_set_gradient_checkpointing"), _checkpointing_setter):
        return
    if "value" in inspect.signature(setter).parameters:  # transformers' pre-4.35 format: not routed
        return

    wrap_method(model, "_set_gradient_checkpointing", _checkpointing_setter)
    for m in model.modules():
        f = m.__dict__.get("_gradient_checkpointing_func")
        if f is not None:
            m._gradient_checkpointing_func = _seqfuse_checkpoint_like(f)
