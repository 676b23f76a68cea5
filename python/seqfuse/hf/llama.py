"""Llama (Llama 3 included) in seqfuse layers: a transformers PreTrainedModel
family (SeqfuseLlamaModel, SeqfuseLlamaForCausalLM) on seqfuse's
TransformerLayer.

The model computes what transformers' LlamaForCausalLM computes: token
embeddings, then per layer x += attention(RMSNorm(x)) and x += MLP(RMSNorm(x))
(the norms fused into the QKV and FC1 GEMMs: layernorm_qkv, layernorm_mlp),
grouped-query causal attention (num_key_value_heads key/value heads) with
rotary embeddings (half-split pairs; inverse frequencies with Llama 3's
scaling when rope_type is "llama3", see llama_config.rope_inv_freq), SwiGLU
MLP (fc1 = [gate; up], TE's layout: silu on the first half), the final
RMSNorm and the LM head, tied to the token embeddings or not
(config.tie_word_embeddings).  No biases, as in Llama.  Differences, small
and stated: attention scales the logits by 1/sqrt(d) inside the kernel and
RoPE rotates in float32 before rounding once (transformers rounds cos/sin
to the activation dtype first); RMSNorm multiplies by its weight before
rounding (transformers rounds, then multiplies).  In float32 these agree to
rounding; in bf16 to bf16 rounding.

Inputs:
- padded (bshd): ``input_ids`` [b, s] with ``attention_mask`` [b, s] (1 =
  token); right padding (the collators' layout) runs in the kernel's padded
  layout; left or both-sided padding, each row one run of tokens, is computed
  exactly too (a row with a hole is a ValueError).  Positions are the column
  index 0..s-1, as transformers' forward without position_ids; a
  ``position_ids`` argument must say the same (checked), other positions
  raise NotImplementedError.  Logits at padding positions are not defined.
- packed (thd): ``input_ids`` [t] or [1, t] with ``cu_seqlens`` (int32
  [n + 1]) and optionally ``max_seqlen``; or with ``position_ids`` that
  restart at 0 for each sequence (transformers' padding-free layout), from
  which cu_seqlens is derived.  When both are given they must agree
  (checked: one host read).  No token attends across a sequence boundary and
  positions restart per sequence.

Loss: ``labels`` as in transformers (the same shape as input_ids, -100
ignored): token i predicts labels[i + 1]; the last token of every sequence
(of each row when padded, of each packed sequence when packed) predicts
nothing, so a packed batch gives the loss of the same sequences padded.
Mean over the predicted tokens, or the sum divided by
``num_items_in_batch`` when given (transformers' gradient-accumulation
rule).  The cross-entropy is seqfuse's fused kernel
(seqfuse.modules.cross_entropy), float32 whatever the logits' dtype.

Under seqfuse autocast with an FP8 recipe the layers' GEMMs run in FP8; the
LM head (plain torch, so it can be tied to the embedding) stays in the
model's dtype.

The Mixtral family (mixtral.py) reuses this module's pieces rather than
copies of them: the batch layout and its checks (``batch_layout``,
``check_unsupported``, messages named after the family), the LM head and
its loss (``check_lm_arguments``, ``lm_logits_and_loss``), the run through
the decoder stack (``DecoderStack``, ``run_layers``), the rotary embedding
and the initialisation (``DecoderPreTrainedModel``).
"""

import logging

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModel, AutoModelForCausalLM
from transformers import initialization as init
from transformers.modeling_outputs import BaseModelOutput, CausalLMOutput

from ..modules.attention import padding_mask_layout
from ..modules.cross_entropy import cross_entropy
from ..modules.moe import GroupedMLP, RoutedExperts
from ..modules.norm import RMSNorm
from ..modules.rope import RotaryPositionEmbedding
from ..modules.transformer_layer import TransformerLayer
from ..quantization.graphs import make_graphed_callables
from ..quantization.recompute import checkpoint
from .attention import cu_seqlens_of_positions, is_packed_positions
from .generation import CachedGenerate
from .layer_graphs import LayerGraphs, check_graphable, eager_reason
from .llama_config import SeqfuseLlamaConfig, rope_inv_freq
from .lm_layout import IGNORE_INDEX, Layout
from .pretrained import SeqfusePreTrainedModel, TiedCausalLM, default_device, init_by_name, register_auto

_log = logging.getLogger(__name__)

class SeqfuseLlamaRotaryEmbedding(RotaryPositionEmbedding):
    """seqfuse's RotaryPositionEmbedding (its forward makes the angle table)
    with the config's inverse frequencies (Llama 3 scaling included).  Like
    transformers' LlamaRotaryEmbedding, inv_freq is computed from the config
    and not saved with the weights.  It stays float32 when the model is cast
    (model.to(torch.bfloat16) would otherwise round the frequencies, and the
    positions with them: transformers' own LlamaRotaryEmbedding has that
    problem after .to(), not after from_pretrained(dtype=...))."""

    def __init__(self, config, device=None):
        super().__init__(config.head_dim, rotary_base=config.rope_parameters["rope_theta"], device=device)
        self.register_buffer("inv_freq", rope_inv_freq(config, device=self.inv_freq.device), persistent=False)

    def _apply(self, fn, recurse=True):
        before = self.inv_freq
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float32:
            # a dtype cast: keep the float32 values, on the device the cast chose
            keep = before if not before.is_meta and not self.inv_freq.is_meta else self.inv_freq
            self.inv_freq = keep.to(device=self.inv_freq.device, dtype=torch.float32)
        return self


class _BshdLayer(nn.Module):
    """One decoder layer called on an unpadded bshd batch with its inputs
    positional (hidden states, rotary table): the form CUDA graph capture
    takes.  Holds the layer; the model does not register it, so state_dict
    keys are unchanged."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x, freqs):
        return self.layer(x, rotary_pos_emb=freqs, self_attn_mask_type="causal", qkv_format="bshd")


class _BshdAttentionBlock(nn.Module):
    """A mixture-of-experts decoder layer's attention block with its
    residual (``layer.attention_block``) on an unpadded bshd batch: what
    graph_layers captures of a layer whose experts cannot be captured.
    Only the layer's ``self_attention`` is registered: the capture takes
    the gradients of this module's parameters, which the rest of the layer
    would add unused."""

    def __init__(self, layer):
        super().__init__()
        self.self_attention = layer.self_attention
        self._block = layer.attention_block  # (a bound method: the layer itself stays unregistered here)

    def forward(self, x, freqs):
        return self._block(x, rotary_pos_emb=freqs, self_attn_mask_type="causal", qkv_format="bshd")


class _AttentionGraphedLayer:
    """A decoder layer called as a graphed layer is (x, freqs): its
    attention block replays ``attention`` (a graphed _BshdAttentionBlock),
    the rest of the layer (``layer.after_attention``: the experts, which
    read the routing counts on the host) runs eagerly."""

    def __init__(self, attention, layer):
        self.attention, self.layer = attention, layer

    def __call__(self, x, freqs):
        return self.layer.after_attention(self.attention(x, freqs))


def make_layer(config, layer_number):
    """One Llama decoder layer as seqfuse's TransformerLayer: RMSNorm fused
    into QKV and FC1, SwiGLU, grouped-query causal self-attention, no biases;
    the SwiGLU output kept or made again per config.mlp_recompute_activation."""
    layer = TransformerLayer(
        config.hidden_size, config.intermediate_size, config.num_attention_heads,
        num_gqa_groups=config.num_key_value_heads, kv_channels=config.head_dim,
        layernorm_epsilon=config.rms_norm_eps, hidden_dropout=0.0,
        attention_dropout=float(config.attention_dropout or 0.0), layer_number=layer_number,
        self_attn_mask_type="causal", layer_type="encoder", normalization="RMSNorm", activation="swiglu",
        attn_input_format=config.attn_input_format, fuse_qkv_params=True, qkv_weight_interleaved=True,
        bias=False, device=default_device())
    layer.layernorm_mlp.recompute_activation = config.mlp_recompute_activation
    return layer


class DecoderPreTrainedModel(SeqfusePreTrainedModel):
    """The PreTrainedModel base of the families in Llama's layout (Llama,
    Mixtral): the base model under ``model``, input_ids in, and
    transformers' Llama initialisation: matrices and embeddings (Mixtral's
    router and experts included) N(0, initializer_range), norm weights 1
    (by parameter name, so it covers the fused seqfuse modules), inv_freq
    from the config."""
    base_model_prefix = "model"
    main_input_name = "input_ids"

    @torch.no_grad()
    def _init_weights(self, module):
        init_by_name(module, self.config.initializer_range)
        if isinstance(module, SeqfuseLlamaRotaryEmbedding):
            init.copy_(module.inv_freq, rope_inv_freq(self.config, device=module.inv_freq.device))


class SeqfuseLlamaPreTrainedModel(DecoderPreTrainedModel):
    config_class = SeqfuseLlamaConfig
    config: SeqfuseLlamaConfig
    _no_split_modules = ["TransformerLayer"]


class DecoderStack:
    """The base model of the families in Llama's layout (SeqfuseLlamaModel,
    SeqfuseMixtralModel): token embeddings ``embed_tokens``, the decoder
    ``layers``, the final RMSNorm ``norm`` and the rotary table
    ``rotary_emb``, which ``run_layers`` runs.  Listed before the family's
    PreTrainedModel in the bases, so that its input-embedding accessors
    win."""

    _headless_ignores = ("lm_head.",)

    def graph_layers(self, batch_size, seq_len, fp8_recipe=None, num_warmup_iters=3, experts="auto"):
        """Capture every decoder layer's forward and backward as CUDA graphs
        for unpadded bshd batches of exactly [batch_size, seq_len] (no
        attention_mask, or one of all ones) in training mode, with FP8 under
        ``fp8_recipe`` (None: the model's dtype); afterwards such calls
        replay the graphs (layer_graphs.py): run them under
        ``seqfuse.pytorch.autocast`` with the same recipe (checked).  Needs
        CUDA, no attention dropout, no activation checkpointing or context
        parallelism, and parameters on one device (not FSDP-sharded).  The
        weights stay the same Parameters: optimizer steps are seen by the
        next replay (FP8 weight casts run inside the graphs).

        Under DelayedScaling, call it after two eager training steps: a
        fresh model's first two steps would otherwise run eagerly (no amax
        history yet: seqfuse.quantization.graphs' note) with their
        activations beside the graphs' memory pool, which sets the run's
        peak memory (Mixtral-small, 2 x 8,192 tokens: 12.96 GiB against
        11.27 for the graphed steps).

        A mixture-of-experts layer (Mixtral) whose experts read the routing
        counts on the host under this recipe, in the forward or the backward
        (GroupedMLP.capture_refusal: DelayedScaling's device-ends route
        reads them in the backward; the host-count route and expert
        parallelism in the forward), cannot be captured whole.  ``experts``
        says what then happens: "auto" (default) captures every layer's
        attention block with its residual and runs the rest of each layer
        (norm, router, experts) eagerly, and the log says so with the
        reason of the first such layer; "graphed" makes it a ValueError
        with the reason; "eager" captures only the attention blocks whatever
        the recipe.  A split needs layers with ``attention_block`` and
        ``after_attention`` (Mixtral's)."""
        owner = type(self).__name__
        if experts not in ("auto", "graphed", "eager"):
            raise ValueError(f"{owner}.graph_layers: argument 'experts' must be 'auto', 'graphed' or 'eager', "
                             f"got {experts!r}")
        moe = [m for m in self.modules() if isinstance(m, RoutedExperts)]
        if experts == "eager" and not moe:
            raise ValueError(f"{owner}.graph_layers: experts='eager' graphs the attention blocks of "
                             "mixture-of-experts layers; this model has none")
        cfg = self.config
        w = self.embed_tokens.weight
        dropout = f"attention_dropout={cfg.attention_dropout}" if cfg.attention_dropout else None
        check_graphable(owner, w.device.type == "cuda", dropout, self.activation_checkpointing, self.training,
                        batch_size=batch_size, seq_len=seq_len)
        if getattr(self, "cp_group", None) is not None:
            raise ValueError(f"{owner}.graph_layers: context parallelism is on; its layers exchange keys and "
                             "values per call, outside what the graphs hold")
        x = torch.randn(batch_size, seq_len, cfg.hidden_size, device=w.device, dtype=w.dtype, requires_grad=True)
        why = None
        if moe and experts != "eager":
            reasons = (m.capture_refusal(x, fp8_recipe) if isinstance(m, GroupedMLP)
                       else f"{type(m).__name__} sizes its token exchange on the host" for m in moe)
            why = next((r for r in reasons if r is not None), None)
            if why is not None and experts == "graphed":
                raise ValueError(f"{owner}.graph_layers: experts='graphed': the experts' routing counts would be "
                                 f"read to the host at every step, which a CUDA graph cannot hold: {why} "
                                 "(experts='auto' graphs the attention blocks and runs the experts eagerly)")
            if why is not None:
                _log.warning("%s.graph_layers: each layer's attention block is graphed and its experts run "
                             "eagerly: the routing counts are read to the host at every step, which a CUDA "
                             "graph cannot hold: %s", owner, why)
        split = bool(moe) and (experts == "eager" or why is not None)
        if split and not all(hasattr(layer, "attention_block") and hasattr(layer, "after_attention")
                             for layer in self.layers):
            raise ValueError(f"{owner}.graph_layers: experts={experts!r} graphs each layer's attention block "
                             "alone, which needs layers with attention_block and after_attention (Mixtral's "
                             f"decoder layer); these are {type(self.layers[0]).__name__}")
        freqs = self.rotary_emb(seq_len)
        parts = tuple((_BshdAttentionBlock if split else _BshdLayer)(layer) for layer in self.layers)
        sample = tuple((x.detach().clone().requires_grad_(True), freqs) for _ in parts)
        graphed = make_graphed_callables(parts, sample, num_warmup_iters=num_warmup_iters,
                                         fp8_enabled=fp8_recipe is not None, fp8_recipe=fp8_recipe)
        if split:
            graphed = tuple(_AttentionGraphedLayer(g, layer) for g, layer in zip(graphed, self.layers))
        self._layer_graphs.set((batch_size, seq_len), fp8_recipe, graphed)
        return self

    def build_stack(self, config, make_layer):
        """Make the modules for ``config``, in this order (the state dict's);
        ``make_layer(config, layer_number)`` builds one decoder layer
        (layer_number from 1)."""
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id,
                                         device=default_device())
        self.layers = nn.ModuleList([make_layer(config, i + 1) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, device=default_device())
        self.rotary_emb = SeqfuseLlamaRotaryEmbedding(config, device=default_device())
        self.activation_checkpointing = False  # set_activation_checkpointing
        self._layer_graphs = LayerGraphs(type(self).__name__, _log)  # graph_layers

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value


def _packed_layout(input_ids, position_ids, cu_seqlens, max_seqlen, name="SeqfuseLlama"):
    """(cu_seqlens, max_seqlen) of a packed call, checked."""
    if input_ids.dim() == 2 and input_ids.shape[0] != 1:
        raise ValueError(f"{name}: packed input_ids must be [t] or [1, t], got {tuple(input_ids.shape)}")
    t = input_ids.shape[-1]
    if cu_seqlens is None:
        cu_seqlens, longest = cu_seqlens_of_positions(position_ids)
        return cu_seqlens, longest if max_seqlen is None else int(max_seqlen)
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
        raise TypeError(f"{name}: cu_seqlens must be a 1-D int32 torch.Tensor")
    if position_ids is not None:
        if position_ids.numel() != t:
            raise ValueError(f"{name}: position_ids has {position_ids.numel()} entries, input_ids {t}")
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        expected = torch.arange(t, device=cu_seqlens.device) - torch.repeat_interleave(
            cu_seqlens[:-1].long(), lengths, output_size=t)
        if not torch.equal(position_ids.reshape(-1).to(expected.device), expected):
            raise ValueError(f"{name}: position_ids must count 0, 1, ... within each sequence of "
                             "cu_seqlens (positions restart per packed sequence)")
    if max_seqlen is None:
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item())
    return cu_seqlens, int(max_seqlen)


def check_unsupported(unused, output_attentions, use_cache, name="SeqfuseLlama"):
    bad = sorted(k for k, v in unused.items() if v is not None)
    if bad:
        raise NotImplementedError(f"{name}: arguments {bad} are not supported")
    if output_attentions:
        raise NotImplementedError(f"{name}: output_attentions=True is not supported; the fused attention "
                                  "never forms attention probabilities (convert to transformers' model)")
    if use_cache:
        raise NotImplementedError(f"{name}: use_cache=True (a key/value cache) is not supported by forward")


def batch_layout(input_ids, attention_mask=None, position_ids=None, cu_seqlens=None, max_seqlen=None,
                 name="SeqfuseLlama"):
    """How a batch runs through a decoder family's layers (a Layout), its
    arguments checked; ``name`` starts the error messages."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name}: input_ids must be an int64 or int32 torch.Tensor")
    if position_ids is not None and not isinstance(position_ids, torch.Tensor):
        raise TypeError(f"{name}: position_ids must be a torch.Tensor")
    # packed: cu_seqlens given, or 1-D input_ids, or one row whose positions restart
    packed = cu_seqlens is not None or input_ids.dim() == 1 or (
        position_ids is not None and input_ids.dim() == 2 and input_ids.shape[0] == 1
        and is_packed_positions(position_ids.reshape(1, -1), 1))
    if packed:
        if attention_mask is not None:
            raise ValueError(f"{name}: packed input (cu_seqlens / restarting position_ids) takes no "
                             "attention_mask: every token is real")
        if cu_seqlens is None and position_ids is None:
            raise ValueError(f"{name}: 1-D (packed) input_ids need cu_seqlens or position_ids")
        cu, longest = _packed_layout(input_ids, position_ids, cu_seqlens, max_seqlen, name)
        kw = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest,
                  qkv_format="thd", self_attn_mask_type="padding_causal")
        return Layout(True, kw, longest, cu)
    if input_ids.dim() != 2:
        raise ValueError(f"{name}: padded input_ids must be [batch, seq], got {tuple(input_ids.shape)}")
    s = input_ids.shape[1]
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(f"{name}: attention_mask {tuple(attention_mask.shape)} must match "
                         f"input_ids {tuple(input_ids.shape)}")
    if position_ids is not None:
        cols = torch.arange(s, device=position_ids.device)
        if position_ids.shape[-1] != s or not bool((position_ids == cols).all()):
            raise NotImplementedError(f"{name}: padded input takes positions 0..seq-1 of each row (the "
                                      "column index); other position_ids are not supported")
    te_mask = None if attention_mask is None else ~attention_mask.bool()[:, None, None, :]
    # One host read of the mask: whether anything is padded, and the layout the layers then reuse
    # (right padding: the padded layout; left or both-sided: packed runs; a hole: ValueError)
    if te_mask is not None and padding_mask_layout(te_mask).padded is not False:
        kw = dict(attention_mask=te_mask, self_attn_mask_type="padding_causal", qkv_format="bshd")
    else:
        kw = dict(self_attn_mask_type="causal", qkv_format="bshd")
    return Layout(False, kw, s, None)


class SeqfuseLlamaModel(DecoderStack, SeqfuseLlamaPreTrainedModel):
    """The Llama decoder stack: embeddings, TransformerLayers, final RMSNorm."""

    def __init__(self, config: SeqfuseLlamaConfig):
        super().__init__(config)
        self.build_stack(config, make_layer)
        self.cp_group = None  # set_context_parallel_group
        self.post_init()

    def set_context_parallel_group(self, cp_group, cp_global_ranks=None, cp_stream=None, cp_comm_type="p2p"):
        """Context parallelism over ``cp_group`` (None: off) for every layer
        (TransformerLayer.set_context_parallel_group, Transformer Engine's
        arguments; cp_comm_type "p2p" or "all_gather").  The model then takes
        a rank's share of each batch, with the full batch's cu_seqlens, and
        its loss is reduced over the group: seqfuse.hf.context_parallel."""
        for layer in self.layers:
            layer.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)
        self.cp_group = cp_group
        if cp_group is not None and self._layer_graphs.graphed is not None:
            # graphs captured without context parallelism would replay a rank's share as a whole batch
            _log.warning("SeqfuseLlamaModel: context parallelism set: the graphed layers are dropped (graph_layers "
                         "refuses context parallelism); the layers run eagerly")
            self._layer_graphs.clear()

    def layout(self, input_ids, attention_mask=None, position_ids=None, cu_seqlens=None, max_seqlen=None):
        """How a batch runs through the layers (a Layout), its arguments checked."""
        if self.cp_group is not None:
            from .context_parallel import cp_layout

            return cp_layout(input_ids, self.cp_group, attention_mask, position_ids, cu_seqlens, max_seqlen)
        return batch_layout(input_ids, attention_mask, position_ids, cu_seqlens, max_seqlen)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cu_seqlens=None, max_seqlen=None,
                output_hidden_states=None, output_attentions=None, use_cache=None, return_dict=None, **unused):
        """Padded: input_ids [b, s], attention_mask [b, s] (1 = token, 0 = pad).
        Packed: input_ids [t] or [1, t] with cu_seqlens int32 [n+1] (and
        max_seqlen) or restarting position_ids.  See the module note."""
        check_unsupported(unused, output_attentions, use_cache)
        layout = self.layout(input_ids, attention_mask, position_ids, cu_seqlens, max_seqlen)
        out = self.run(input_ids, layout, output_hidden_states)
        return out if return_dict is not False else out.to_tuple()

    def run(self, input_ids, layout, output_hidden_states=False):
        """The layers over ``input_ids`` laid out as ``layout`` says: BaseModelOutput."""
        x, hidden, _ = run_layers(self, input_ids, layout, output_hidden_states)
        return BaseModelOutput(last_hidden_state=x, hidden_states=hidden)


def run_layers(model, input_ids, layout, output_hidden_states=False, layer_extras=False):
    """A decoder family's stack over ``input_ids`` laid out as ``layout``
    says: ``model``'s embed_tokens, then its layers (each given the rotary
    table of rotary_emb and layout.layer_kw, recomputed in the backward when
    model.activation_checkpointing while training), then its final norm.
    Returns (last hidden state, the hidden states before every layer and
    after the norm as a tuple when ``output_hidden_states`` else None,
    extras): with ``layer_extras`` every layer returns (hidden states,
    extra) and extras lists the layers' extras (Mixtral's router logits),
    else extras is empty.  Packed outputs take input_ids' shape ([t] or
    [1, t]) back."""
    shape = input_ids.shape
    x = model.embed_tokens(input_ids.reshape(-1) if layout.packed else input_ids)
    freqs = model.rotary_emb(layout.rope_len)
    hidden = [] if output_hidden_states else None
    extras = []
    graphs = getattr(model, "_layer_graphs", None)  # (a model unpickled from before graph_layers has none)
    if graphs is not None and graphs.graphed is not None:
        graphed = graphs.for_call(model.training, shape, eager_reason(
            layout.packed, "attention_mask" in layout.layer_kw, hidden is not None))
        if graphed is not None:
            for layer in graphed:
                x = layer(x, freqs)
                if layer_extras:
                    x, extra = x
                    extras.append(extra)
            return model.norm(x), None, extras
    recompute = model.activation_checkpointing and model.training and torch.is_grad_enabled()
    for layer in model.layers:
        if hidden is not None:
            hidden.append(x)
        if recompute:
            x = checkpoint(layer, x, rotary_pos_emb=freqs, **layout.layer_kw)
        else:
            x = layer(x, rotary_pos_emb=freqs, **layout.layer_kw)
        if layer_extras:
            x, extra = x
            extras.append(extra)
    x = model.norm(x)
    if hidden is not None:
        hidden.append(x)
    if layout.packed:
        x = x.view(*shape, -1)
        if hidden is not None:
            hidden = [h.view(*shape, -1) for h in hidden]
    return x, tuple(hidden) if hidden is not None else None, extras


def shift_labels(labels, cu_seqlens=None):
    """The next-token targets of ``labels`` (transformers' convention: labels
    aligned with input_ids): out[..., i] = labels[..., i + 1], IGNORE_INDEX
    at the last position of each row, and, when packed (labels [t] or [1, t]
    with cu_seqlens), at the last token of every packed sequence."""
    out = F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)
    if cu_seqlens is not None:
        out = out.reshape(-1).index_fill(0, (cu_seqlens[1:].long() - 1).clamp_min(0), IGNORE_INDEX)
        out = out.view(labels.shape)
    return out


def check_lm_arguments(input_ids, labels, logits_to_keep, name="SeqfuseLlamaForCausalLM"):
    """ValueError naming the argument: ``logits_to_keep`` not an int >= 0, or
    given with labels; ``labels`` not of input_ids' shape."""
    if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int) or logits_to_keep < 0:
        raise ValueError(f"{name}: logits_to_keep must be an int >= 0, got {logits_to_keep!r}")
    if logits_to_keep and labels is not None:
        raise ValueError(f"{name}: labels need every position's logits (logits_to_keep 0)")
    if labels is not None and (not isinstance(labels, torch.Tensor) or labels.shape != input_ids.shape):
        raise ValueError(f"{name}: labels {tuple(getattr(labels, 'shape', ()))} must be a "
                         f"tensor of input_ids' shape {tuple(input_ids.shape)}")


def lm_logits_and_loss(lm_head, x, labels, cu_seqlens, num_items_in_batch, logits_to_keep):
    """(logits, loss) of a causal LM head over the final hidden states ``x``:
    logits of the last ``logits_to_keep`` positions (0: all); with labels,
    the next-token cross-entropy (fused kernel, float32), mean over the
    predicted tokens or the sum / ``num_items_in_batch``; loss None without."""
    if logits_to_keep:
        x = x[..., -logits_to_keep:, :]
    logits = F.linear(x, lm_head.weight.to(x.dtype))
    loss = None
    if labels is not None:
        target = shift_labels(labels, cu_seqlens).reshape(-1)
        flat = logits.reshape(-1, logits.shape[-1])
        if num_items_in_batch is None:
            loss = cross_entropy(flat, target, ignore_index=IGNORE_INDEX)
        else:
            loss = cross_entropy(flat, target, ignore_index=IGNORE_INDEX, reduction="sum") / num_items_in_batch
    return logits, loss


class SeqfuseLlamaForCausalLM(CachedGenerate, TiedCausalLM, SeqfuseLlamaPreTrainedModel):
    """Llama causal language model on seqfuse layers (``model`` and the tied
    ``lm_head``: pretrained.TiedCausalLM)."""

    base_model_class = SeqfuseLlamaModel

    def set_context_parallel_group(self, cp_group, cp_global_ranks=None, cp_stream=None, cp_comm_type="p2p"):
        """SeqfuseLlamaModel.set_context_parallel_group; under CP the loss
        takes ``shift_labels`` and is reduced over the group
        (seqfuse.hf.context_parallel)."""
        self.model.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None, cu_seqlens=None,
                max_seqlen=None, num_items_in_batch=None, logits_to_keep=0, output_hidden_states=None,
                output_attentions=None, use_cache=None, return_dict=None, shift_labels=None, **unused):
        """As LlamaForCausalLM (labels unshifted, -100 ignored); packed input
        via cu_seqlens / max_seqlen or restarting position_ids.
        ``logits_to_keep`` (int): logits of the last that many positions only
        (0: all), as in transformers; the loss needs all of them.
        ``shift_labels`` (instead of labels): targets already shifted, as in
        transformers (position i's target; -100 ignored); the only targets
        taken under context parallelism, where the loss is the whole
        sequences' on every CP rank (seqfuse.hf.context_parallel)."""
        check_unsupported(unused, output_attentions, use_cache)
        if shift_labels is not None and labels is not None:
            raise ValueError("SeqfuseLlamaForCausalLM: give labels or shift_labels, not both")
        cp = self.model.cp_group
        if cp is not None and labels is not None:
            raise ValueError("SeqfuseLlamaForCausalLM: under context parallelism pass shift_labels (the targets "
                             "shifted over the full sequences before the split: seqfuse.hf.llama.shift_labels), "
                             "not labels: a rank does not hold the token after its chunks")
        check_lm_arguments(input_ids, labels if shift_labels is None else shift_labels, logits_to_keep)
        layout = self.model.layout(input_ids, attention_mask, position_ids, cu_seqlens, max_seqlen)
        out = self.model.run(input_ids, layout, output_hidden_states)
        if shift_labels is None:
            logits, loss = lm_logits_and_loss(self.lm_head, out.last_hidden_state, labels, layout.cu_seqlens,
                                              num_items_in_batch, logits_to_keep)
        else:
            from .context_parallel import context_parallel_lm_loss

            logits, _ = lm_logits_and_loss(self.lm_head, out.last_hidden_state, None, None, None, 0)
            # (without CP: the plain mean, or the sum / num_items_in_batch)
            loss = context_parallel_lm_loss(logits, shift_labels, cp, num_items_in_batch)
        result = CausalLMOutput(loss=loss, logits=logits, hidden_states=out.hidden_states)
        return result if return_dict is not False else result.to_tuple()


register_auto(SeqfuseLlamaConfig, (AutoModel, SeqfuseLlamaModel),
              (AutoModelForCausalLM, SeqfuseLlamaForCausalLM))
