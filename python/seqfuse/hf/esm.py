"""ESM-2 in seqfuse layers: a transformers PreTrainedModel family
(SeqfuseEsmModel, SeqfuseEsmForMaskedLM) built on seqfuse's TransformerLayer.

The model computes what transformers' EsmForMaskedLM computes for ESM-2
configs: word embeddings with ESM's token-dropout rescaling, padded
positions zeroed, rotary embeddings (half-split pairs, positions 0..L-1 per
sequence), pre-LayerNorm layers (the norms fused into the QKV and FC1 GEMMs),
GELU MLP, the final LayerNorm (emb_layer_norm_after) and the LM head
(dense -> GELU -> LayerNorm -> decoder tied to the word embeddings + bias).
One deliberate difference, small and stated: attention scales the logits by
1/sqrt(d) after RoPE; HF scales the query before RoPE.  RoPE is linear, so
these are equal up to rounding.  The MLP runs ``config.mlp_activation``
inside LayerNormMLP: "gelu_erf" (default) is ESM's erf-GELU; TE's "gelu" is
the tanh approximation (|difference| < 5e-4 per element), selectable for
speed.  The LM head's GELU is erf-GELU, as in ESM.

Inputs: padded ``input_ids`` [b, s] with ``attention_mask`` [b, s] (bshd;
right, left or both-sided padding, each row one run of tokens, computed
exactly: a row with a hole is a ValueError; logits at padding positions
are not defined), or
packed ``input_ids`` [t] / [1, t] with ``cu_seqlens`` (int32 [n+1]) and
``max_seqlen`` (thd: no padding anywhere).  Under seqfuse autocast with an
FP8 recipe the layers' GEMMs run in FP8; the vocabulary projection (33 rows,
not FP8-aligned) stays in the model's dtype.

Graphed layers: each encoder layer's forward and backward can be captured
as CUDA graphs (seqfuse.pytorch.make_graphed_callables), which removes the
layers' host work from the step, either for training at one fixed unpadded
batch shape (b, s) (``graph_layers``) or for packed training batches within
bounds on their tokens, sequences and longest sequence
(``graph_packed_layers``: each batch is padded to the bounds on the device,
layer_graphs.PackedLayout).  Calls the graphs do not serve (another shape,
masked calls, packed calls beyond the bounds, eval) run the layers eagerly
(logged once per reason).

Contact prediction needs attention probabilities, which the fused attention
never forms: ``predict_contacts`` raises and says to convert to HF.
"""
import logging

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModel, AutoModelForMaskedLM
from transformers import initialization as init
from transformers.modeling_outputs import BaseModelOutput, MaskedLMOutput

from ..modules.attention import padding_mask_layout
from ..modules.linear import Linear
from ..modules.norm import LayerNorm
from ..modules.rope import RotaryPositionEmbedding
from ..quantization.graphs import make_graphed_callables
from ..quantization.recompute import checkpoint
from ..modules.transformer_layer import TransformerLayer
from ..ops import device_checks
from .esm_config import SeqfuseEsmConfig
from .layer_graphs import LayerGraphs, PackedLayout, check_graphable, eager_reason
from .pretrained import SeqfusePreTrainedModel, default_device, init_by_name, register_auto

logger = logging.getLogger(__name__)

#: ESM's token-dropout training mask ratio (15 % selected x 80 % replaced by <mask>).
MASK_RATIO_TRAIN = 0.15 * 0.8


def erf_gelu(x):
    """GELU with erf, as ESM (and transformers' EsmLMHead) computes it."""
    return x * 0.5 * (1.0 + torch.erf(x / 2.0 ** 0.5))


class SeqfuseEsmEmbeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size,
                                            padding_idx=config.pad_token_id, device=default_device())
        if config.emb_layer_norm_before:
            self.layer_norm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps, device=default_device())
        else:
            self.layer_norm = None
        self.token_dropout = config.token_dropout
        self.mask_token_id = config.mask_token_id

    def forward(self, input_ids, attention_mask=None, cu_seqlens=None):
        """Padded [b, s] input_ids with attention_mask, or packed [t] with
        cu_seqlens, which must end at exactly t (SeqfuseEsmModel checks it;
        a direct call must hold to it: with token dropout the per-sequence
        mask ratio is spread over the tokens without reading the lengths'
        total to the host)."""
        emb = self.word_embeddings(input_ids)
        if self.token_dropout:
            is_mask = input_ids == self.mask_token_id
            emb = emb.masked_fill(is_mask.unsqueeze(-1), 0.0)
            if cu_seqlens is None:
                src_lengths = attention_mask.sum(-1) if attention_mask is not None else input_ids.shape[-1]
                observed = is_mask.sum(-1).float() / src_lengths
                denom = (1 - observed)[..., None, None]
            else:
                # Packed: the same per-sequence ratio, spread to each token of the sequence.
                lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
                # (output_size: no host read; SeqfuseEsmModel checked that the sequences cover every token)
                seq_of_token = torch.repeat_interleave(torch.arange(lengths.numel(), device=emb.device), lengths,
                                                       output_size=input_ids.numel())
                n_mask = torch.zeros(lengths.numel(), device=emb.device).index_add_(
                    0, seq_of_token, is_mask.reshape(-1).float())
                observed = n_mask / lengths
                denom = (1 - observed)[seq_of_token].view(*emb.shape[:-1], 1)
            # The operation order of transformers' EsmEmbeddings, for identical rounding.
            emb = (emb * (1 - MASK_RATIO_TRAIN) / denom).to(emb.dtype)
        if self.layer_norm is not None:
            emb = self.layer_norm(emb)
        if attention_mask is not None:
            emb = (emb * attention_mask.unsqueeze(-1)).to(emb.dtype)
        return emb


class SeqfuseEsmEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList([
            TransformerLayer(
                config.hidden_size, config.intermediate_size, config.num_attention_heads,
                layernorm_epsilon=config.layer_norm_eps, hidden_dropout=config.hidden_dropout_prob,
                attention_dropout=config.attention_probs_dropout_prob, layer_number=i + 1,
                self_attn_mask_type="padding", layer_type="encoder", normalization="LayerNorm",
                activation=config.mlp_activation, attn_input_format=config.attn_input_format,
                fuse_qkv_params=True, qkv_weight_interleaved=True, bias=True, device=default_device())
            for i in range(config.num_hidden_layers)])
        for layer in self.layers:
            layer.layernorm_mlp.recompute_activation = config.mlp_recompute_activation
        self.emb_layer_norm_after = LayerNorm(config.hidden_size, eps=config.layer_norm_eps, device=default_device())


class _UnmaskedLayer(nn.Module):
    """One encoder layer called on an unmasked bshd batch with its inputs
    positional (hidden states, rotary frequencies): the form CUDA graph
    capture takes.  Holds the layer; the model does not register it, so
    state_dict keys are unchanged."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x, freqs):
        return self.layer(x, rotary_pos_emb=freqs, self_attn_mask_type="no_mask", qkv_format="bshd")


class _PackedLayer(nn.Module):
    """One encoder layer called on a packed thd batch with its inputs
    positional (hidden states [t, hidden], rotary frequencies, cu_seqlens)
    and ``max_seqlen`` fixed: a bound, not the batch's longest sequence (the
    form graph_packed_layers captures).  Not registered, as _UnmaskedLayer."""

    def __init__(self, layer, max_seqlen):
        super().__init__()
        self.layer, self.max_seqlen = layer, max_seqlen

    def forward(self, x, freqs, cu_seqlens):
        m = self.max_seqlen
        return self.layer(x, rotary_pos_emb=freqs, cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                          max_seqlen_q=m, max_seqlen_kv=m, qkv_format="thd", self_attn_mask_type="padding")


class SeqfuseEsmContactPredictionHead(nn.Module):
    """Holds ESM's contact-regression weights so conversion keeps them; the
    computation needs attention maps seqfuse's fused attention never forms."""

    def __init__(self, in_features):
        super().__init__()
        self.regression = nn.Linear(in_features, 1, device=default_device())


class SeqfuseEsmPreTrainedModel(SeqfusePreTrainedModel):
    """ESM-2's base: strict from_pretrained and activation checkpointing
    come from SeqfusePreTrainedModel (seqfuse.hf.pretrained), the
    initialisation is ESM's (N(0, initializer_range), biases 0, norm weights
    1, the rotary frequencies from rope_theta)."""
    config_class = SeqfuseEsmConfig
    config: SeqfuseEsmConfig
    base_model_prefix = "esm"
    main_input_name = "input_ids"
    _no_split_modules = ["TransformerLayer", "SeqfuseEsmEmbeddings"]

    @torch.no_grad()
    def _init_weights(self, module):
        init_by_name(module, self.config.initializer_range)
        if isinstance(module, RotaryPositionEmbedding):
            d = module.inv_freq.numel() * 2
            init.copy_(module.inv_freq, 1.0 / (self.config.rope_theta ** (
                torch.arange(0, d, 2, dtype=torch.float32, device=module.inv_freq.device) / d)))


def _check_inputs(input_ids, attention_mask, cu_seqlens, output_attentions):
    if output_attentions:
        raise NotImplementedError("SeqfuseEsm: output_attentions=True is not supported; the fused attention "
                                  "never forms attention probabilities (convert to transformers' EsmModel)")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError("SeqfuseEsm: input_ids must be an int64 or int32 torch.Tensor")
    if cu_seqlens is not None:
        if attention_mask is not None:
            raise ValueError("SeqfuseEsm: packed input (cu_seqlens) takes no attention_mask: every token is real")
        if input_ids.dim() == 2 and input_ids.shape[0] != 1:
            raise ValueError(f"SeqfuseEsm: packed input_ids must be [t] or [1, t], got {tuple(input_ids.shape)}")
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
            raise TypeError("SeqfuseEsm: cu_seqlens must be a 1-D int32 torch.Tensor")
    elif input_ids.dim() != 2:
        raise ValueError(f"SeqfuseEsm: padded input_ids must be [batch, seq], got {tuple(input_ids.shape)} "
                         "(packed input needs cu_seqlens)")
    elif attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(f"SeqfuseEsm: attention_mask {tuple(attention_mask.shape)} must match "
                         f"input_ids {tuple(input_ids.shape)}")


def _check_packed_extent(cu_seqlens, tokens, max_seqlen):
    """Packed input's cu_seqlens by the attention's rules (start at 0,
    non-decreasing, no sequence longer than max_seqlen) and ending at
    exactly ``tokens``: packed ESM input has no padding.  Returns
    (max_seqlen, or the longest sequence where it was not given; the
    longest sequence, max_seqlen under capture).  On CUDA this
    is the batch's one host read of a new cu_seqlens tensor, which the
    layers' attention and RoPE checks then reuse (ops.device_checks).  Under
    CUDA graph capture nothing is read (a max_seqlen must then be given)."""
    given = None if max_seqlen is None else int(max_seqlen)
    device_checks.check_cu_seqlens("SeqfuseEsm", "cu_seqlens", cu_seqlens, extent=tokens, max_len=given)
    if device_checks.capturing(cu_seqlens):
        if given is None:
            raise ValueError("SeqfuseEsm: packed input needs max_seqlen under CUDA graph capture (the longest "
                             "sequence cannot be read from cu_seqlens there)")
        return given, given
    facts = device_checks.sequence_facts(cu_seqlens, given)
    if facts is None:  # (on CUDA check_cu_seqlens has said which rule; CPU values are read here)
        raise ValueError("SeqfuseEsm: argument 'cu_seqlens' must start at 0, be non-decreasing"
                         + (f" and hold no sequence longer than max_seqlen {given}" if given is not None else "")
                         + f", got {cu_seqlens.tolist()}")
    if facts[0] != tokens:
        raise ValueError(f"SeqfuseEsm: cu_seqlens ends at {facts[0]} but input_ids holds {tokens} tokens "
                         "(packed input has no padding: the last sequence ends at the last token)")
    return (facts[2] if given is None else given), facts[2]


class SeqfuseEsmModel(SeqfuseEsmPreTrainedModel):
    """The ESM-2 encoder: embeddings, TransformerLayers, final LayerNorm."""

    _headless_ignores = ("lm_head.",)  # the encoder alone, from a masked-LM checkpoint

    def __init__(self, config: SeqfuseEsmConfig, add_pooling_layer=False):
        super().__init__(config)
        if add_pooling_layer:
            raise NotImplementedError("SeqfuseEsmModel: the pooling layer is not implemented (ESM-2 MLM has none)")
        self.embeddings = SeqfuseEsmEmbeddings(config)
        self.rotary_embeddings = RotaryPositionEmbedding(config.head_dim, rotary_base=config.rope_theta,
                                                         device=default_device())
        self.encoder = SeqfuseEsmEncoder(config)
        self.contact_head = SeqfuseEsmContactPredictionHead(config.num_hidden_layers * config.num_attention_heads)
        self.activation_checkpointing = False  # set_activation_checkpointing
        self._layer_graphs = LayerGraphs("SeqfuseEsmModel", logger)  # graph_layers
        self.post_init()

    def graph_layers(self, batch_size, seq_len, fp8_recipe=None, num_warmup_iters=3):
        """Capture every encoder layer's forward and backward as CUDA graphs
        for unpadded bshd batches of exactly [batch_size, seq_len] in
        training mode, with FP8 under ``fp8_recipe`` (None: the model's
        dtype).  Afterwards such calls replay the graphs; run them under
        ``seqfuse.pytorch.autocast`` with the same recipe (checked).
        Needs CUDA, no dropout, no activation checkpointing, parameters on
        one device (not FSDP-sharded).  The layers' weights stay the same
        Parameters: optimizer steps are seen by the next replay."""
        cfg = self.config
        check_graphable("SeqfuseEsmModel", self.embeddings.word_embeddings.weight.device.type == "cuda",
                        self._dropout_settings(),
                        self.activation_checkpointing, self.training, batch_size=batch_size, seq_len=seq_len)
        w = self.embeddings.word_embeddings.weight
        x = torch.randn(batch_size, seq_len, cfg.hidden_size, device=w.device, dtype=w.dtype, requires_grad=True)
        freqs = self.rotary_embeddings(seq_len)
        layers = tuple(_UnmaskedLayer(layer) for layer in self.encoder.layers)
        sample = tuple((x.detach().clone().requires_grad_(True), freqs) for _ in layers)
        graphed = make_graphed_callables(layers, sample, num_warmup_iters=num_warmup_iters,
                                         fp8_enabled=fp8_recipe is not None, fp8_recipe=fp8_recipe)
        self._layer_graphs.set((batch_size, seq_len), fp8_recipe, graphed)
        return self

    def _dropout_settings(self):
        """The config's non-zero dropout settings as text, or None."""
        cfg = self.config
        if not (cfg.hidden_dropout_prob or cfg.attention_probs_dropout_prob):
            return None
        return (f"hidden_dropout_prob={cfg.hidden_dropout_prob}, "
                f"attention_probs_dropout_prob={cfg.attention_probs_dropout_prob}")

    def graph_packed_layers(self, tokens, max_sequences, max_seqlen, fp8_recipe=None, num_warmup_iters=3):
        """Capture every encoder layer's forward and backward as CUDA graphs
        for packed (thd) training batches of at most ``tokens`` tokens in at
        most ``max_sequences`` sequences, none longer than ``max_seqlen``.
        Each such call is padded on the device to exactly these bounds
        (zero rows in padding sequences, counted in ``max_sequences``: of
        128 tokens where the bound leaves room, else longer; then
        zero-length sequences; layer_graphs.PackedLayout) and replays the
        graphs; the loss and gradients are the unpadded call's.  The
        recipe's token budget is ``tokens``; a ``max_sequences`` a little
        above the most sequences a batch holds keeps the attention grid
        small.  Calls beyond a bound (more tokens, a longer sequence, or
        more sequences than leave room for the padding in sequences of
        ``max_seqlen``) run eagerly (logged once).  Needs what graph_layers
        needs; FP8 as there."""
        check_graphable("SeqfuseEsmModel", self.embeddings.word_embeddings.weight.device.type == "cuda",
                        self._dropout_settings(), self.activation_checkpointing, self.training,
                        method="graph_packed_layers")  # (the sizes: PackedLayout checks them)
        layout = PackedLayout("SeqfuseEsmModel.graph_packed_layers", tokens, max_sequences, max_seqlen)
        w = self.embeddings.word_embeddings.weight
        x = torch.randn(tokens, self.config.hidden_size, device=w.device, dtype=w.dtype)
        freqs = self.rotary_embeddings(max_seqlen)
        cu = layout.sample_cu_seqlens(w.device)
        layers = tuple(_PackedLayer(layer, max_seqlen) for layer in self.encoder.layers)
        sample = tuple((x.clone().requires_grad_(True), freqs, cu) for _ in layers)
        graphed = make_graphed_callables(layers, sample, num_warmup_iters=num_warmup_iters,
                                         fp8_enabled=fp8_recipe is not None, fp8_recipe=fp8_recipe)
        self._layer_graphs.set(layout.key(), fp8_recipe, graphed, packed=layout)
        return self

    def _graphs_for(self, input_ids, padded, packed, output_hidden_states, cu_seqlens=None, longest=None):
        """The graphed layers when this call may replay them, else None (the
        reason logged once); ``padded``: the forward's mask read found zeros.
        Packed graphs serve packed calls within their layout's bounds
        (``longest``: the batch's longest sequence)."""
        graphs = self._layer_graphs
        if packed and graphs.packed is not None:
            reason = (eager_reason(hidden_states=output_hidden_states)
                      or graphs.packed.misfit(input_ids.numel(), cu_seqlens.numel() - 1, longest))
            return graphs.for_call(self.training, graphs.shape, reason)
        return graphs.for_call(self.training, input_ids.shape, eager_reason(packed, padded, output_hidden_states))

    def get_input_embeddings(self):
        return self.embeddings.word_embeddings

    def set_input_embeddings(self, value):
        self.embeddings.word_embeddings = value

    def forward(self, input_ids=None, attention_mask=None, cu_seqlens=None, max_seqlen=None,
                output_hidden_states=None, output_attentions=None, return_dict=None, **unused):
        """Padded: input_ids [b, s], attention_mask [b, s] (1 = token, 0 = pad).
        Packed: input_ids [t] or [1, t], cu_seqlens int32 [n+1], max_seqlen."""
        bad = sorted(k for k, v in unused.items() if v is not None)
        if bad:
            raise NotImplementedError(f"SeqfuseEsmModel: arguments {bad} are not supported")
        _check_inputs(input_ids, attention_mask, cu_seqlens, output_attentions)
        packed = cu_seqlens is not None
        if packed:
            shape = input_ids.shape
            ids = input_ids.reshape(-1)
            max_seqlen, longest = _check_packed_extent(cu_seqlens, ids.shape[0], max_seqlen)
            x = self.embeddings(ids, cu_seqlens=cu_seqlens)
            rope_len = max_seqlen
            layer_kw = dict(cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens, max_seqlen_q=max_seqlen,
                            max_seqlen_kv=max_seqlen, qkv_format="thd", self_attn_mask_type="padding")
        else:
            x = self.embeddings(input_ids, attention_mask=attention_mask)
            rope_len, longest = input_ids.shape[1], None
            te_mask = None if attention_mask is None else ~attention_mask.bool()[:, None, None, :]
            # One host read of the mask: whether anything is padded, and the layout the layers then reuse
            # (right padding: the padded layout; left or both-sided: packed runs; a hole: ValueError)
            if te_mask is not None and padding_mask_layout(te_mask).padded is not False:
                layer_kw = dict(attention_mask=te_mask, self_attn_mask_type="padding", qkv_format="bshd")
            else:
                layer_kw = dict(self_attn_mask_type="no_mask", qkv_format="bshd")
        hidden = [] if output_hidden_states else None
        graphed = self._graphs_for(input_ids, "attention_mask" in layer_kw, packed, output_hidden_states,
                                   cu_seqlens, longest)
        if graphed is not None and packed:
            layout = self._layer_graphs.packed
            t = x.shape[0]
            x, cu = layout.pad(x, cu_seqlens)
            freqs = self.rotary_embeddings(layout.max_seqlen)
            for layer in graphed:
                x = layer(x, freqs, cu)
            return self._finish(x[:t], hidden, packed, shape, return_dict)
        freqs = self.rotary_embeddings(rope_len)
        if graphed is not None:
            for layer in graphed:
                x = layer(x, freqs)
            return self._finish(x, hidden, packed, None, return_dict)
        recompute = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        for layer in self.encoder.layers:
            if hidden is not None:
                hidden.append(x)
            if recompute:
                x = checkpoint(layer, x, rotary_pos_emb=freqs, **layer_kw)
            else:
                x = layer(x, rotary_pos_emb=freqs, **layer_kw)
        return self._finish(x, hidden, packed, shape if packed else None, return_dict)

    def _finish(self, x, hidden, packed, shape, return_dict):
        x = self.encoder.emb_layer_norm_after(x)
        if hidden is not None:
            hidden.append(x)
        if packed:
            x = x.view(*shape, -1)
            if hidden is not None:
                hidden = [h.view(*shape, -1) for h in hidden]
        out = BaseModelOutput(last_hidden_state=x, hidden_states=tuple(hidden) if hidden is not None else None)
        return out if return_dict is not False else out.to_tuple()

    def predict_contacts(self, tokens, attention_mask=None):
        raise NotImplementedError(
            "SeqfuseEsmModel.predict_contacts needs attention probabilities, which seqfuse's fused attention "
            "never forms; convert with seqfuse.hf.convert.to_hf_model(model) and predict there")


class SeqfuseEsmLMHead(nn.Module):
    """dense -> erf-GELU -> LayerNorm -> decoder (tied) + bias, as EsmLMHead."""

    def __init__(self, config):
        super().__init__()
        self.dense = Linear(config.hidden_size, config.hidden_size, bias=True, device=default_device())
        self.layer_norm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps, device=default_device())
        # Plain torch: the vocabulary (33) is not FP8-aligned, and tying needs nn.Linear's weight.
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size, bias=False, device=default_device())
        self.bias = nn.Parameter(torch.zeros(config.vocab_size, device=default_device()))

    def forward(self, x):
        x = self.layer_norm(erf_gelu(self.dense(x)))
        return F.linear(x, self.decoder.weight.to(x.dtype), self.bias.to(x.dtype))


class SeqfuseEsmForMaskedLM(SeqfuseEsmPreTrainedModel):
    """ESM-2 masked language model on seqfuse layers."""

    _tied_weights_keys = {"lm_head.decoder.weight": "esm.embeddings.word_embeddings.weight"}

    def __init__(self, config: SeqfuseEsmConfig):
        super().__init__(config)
        self.esm = SeqfuseEsmModel(config)
        self.lm_head = SeqfuseEsmLMHead(config)
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head.decoder

    def set_output_embeddings(self, new_embeddings):
        self.lm_head.decoder = new_embeddings

    def forward(self, input_ids=None, attention_mask=None, labels=None, cu_seqlens=None, max_seqlen=None,
                output_hidden_states=None, output_attentions=None, return_dict=None, **unused):
        """As EsmForMaskedLM; packed input via cu_seqlens/max_seqlen.  The
        loss is the mean cross entropy over labels != -100."""
        out = self.esm(input_ids, attention_mask=attention_mask, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                       output_hidden_states=output_hidden_states, output_attentions=output_attentions,
                       return_dict=True, **unused)
        logits = self.lm_head(out.last_hidden_state)
        loss = None
        if labels is not None:
            if labels.shape != input_ids.shape:
                raise ValueError(f"SeqfuseEsmForMaskedLM: labels {tuple(labels.shape)} must match "
                                 f"input_ids {tuple(input_ids.shape)}")
            loss = F.cross_entropy(logits.reshape(-1, self.config.vocab_size).float(), labels.reshape(-1),
                                   ignore_index=-100)
        result = MaskedLMOutput(loss=loss, logits=logits, hidden_states=out.hidden_states)
        return result if return_dict is not False else result.to_tuple()

    def predict_contacts(self, tokens, attention_mask=None):
        return self.esm.predict_contacts(tokens, attention_mask)


register_auto(SeqfuseEsmConfig, (AutoModel, SeqfuseEsmModel),
              (AutoModelForMaskedLM, SeqfuseEsmForMaskedLM))
