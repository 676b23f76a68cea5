"""Mixtral in seqfuse layers: a transformers PreTrainedModel family
(SeqfuseMixtralModel, SeqfuseMixtralForCausalLM) built from seqfuse's
attention block and its mixture-of-experts modules.

The model computes what transformers' MixtralForCausalLM computes: token
embeddings, then per layer

    x += attention(RMSNorm(x))      seqfuse's MultiheadAttention: the norm fused into
                                    the QKV GEMM, RoPE (the config's rope_theta),
                                    grouped-query causal attention, output projection
    x += moe(RMSNorm(x))            router logits = RMSNorm(x) @ W_gate^T; top-k of
                                    their softmax renormalised to sum 1 (Mixtral's
                                    routing; the fused router kernel); tokens permuted
                                    into expert order; each expert's SwiGLU MLP as two
                                    grouped GEMMs (gate-up, down) over all experts at
                                    once; SwiGLU scaled by the routing weight; tokens
                                    un-permuted and summed over their experts

then the final RMSNorm and the LM head (tied or not).  The MoE block is
seqfuse.modules.GroupedMLP (router, moe_permute, GroupedLinear x2,
scaled SwiGLU, moe_unpermute); its routing weight multiplies the SwiGLU
output rather than the expert's output, the same number without biases
(Mixtral has none).  Under seqfuse's FP8 autocast the attention GEMMs and
the experts' grouped GEMMs run in FP8 (per-tensor delayed or current
scaling, or block scaling, through the quantization layer); the router, the
norms and the LM head stay in the activation dtype.

Inputs, positions, labels and the loss are the Llama family's (llama.py's
module note): padded bshd batches with attention_mask, or packed thd with
cu_seqlens / restarting position_ids; labels unshifted, -100 ignored.

Load-balancing loss, as transformers computes it: when
``output_router_logits`` (forward's argument, default the config's), every
layer's router logits (float32 [tokens, experts]) are returned and the
auxiliary loss of all layers' tokens together is

    aux = E * sum_e f_e * P_e,   f_e = (tokens routed to e, over their top-k slots) / N
                                 P_e = (sum of softmax probability of e) / N

N the number of (layer, real token) rows (padding excluded with an
attention_mask).  It is computed with seqfuse's fused kernels
(fused_compute_score_for_moe_aux_loss, fused_moe_aux_loss, whose TE formula
divides by top-k: the coefficient top-k undoes it), returned as
``aux_loss`` and, with labels, added to the loss times
``router_aux_loss_coef``.

Generation with a key/value cache is the Llama family's
(seqfuse.hf.generation: the layer's ``self_attention`` and its
``feed_forward``).
"""
import torch
from torch import nn
from transformers import AutoModel, AutoModelForCausalLM
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast

from ..modules.multihead_attention import MultiheadAttention
from ..modules.norm import RMSNorm
from ..modules.moe import GroupedMLP
from ..ops.moe import fused_compute_score_for_moe_aux_loss, fused_moe_aux_loss
from .generation import CachedGenerate
from .llama import (DecoderPreTrainedModel, DecoderStack, batch_layout, check_lm_arguments, check_unsupported,
                    lm_logits_and_loss, run_layers)
from .mixtral_config import SeqfuseMixtralConfig
from .pretrained import TiedCausalLM, default_device, register_auto

NAME = "SeqfuseMixtral"


class SeqfuseMixtralSparseMoE(GroupedMLP):
    """seqfuse's GroupedMLP (router, permutation, grouped SwiGLU experts)
    that also hands its layer the router logits of the last forward, for the
    model's load-balancing loss (its own auxiliary loss stays off:
    transformers' loss is over all layers' tokens together, not a sum of
    per-layer losses)."""

    def __init__(self, config, device=None):
        super().__init__(config.hidden_size, config.intermediate_size, config.num_local_experts,
                         config.num_experts_per_tok, score_function="softmax", use_pre_softmax=False,
                         bias=False, device=device)
        self.router_logits = None

    def route(self, x):
        probs, routing_map, logits = super().route(x)
        self.router_logits = logits
        return probs, routing_map, logits

    def forward_every_expert(self, hidden_states, is_first_microbatch=None):
        """The block's output without a host read, for a decode step captured
        in a CUDA graph (seqfuse.hf.generation): every expert takes every
        token, with routing weight 0 where the router did not pick it, so
        the grouped GEMMs' row counts are fixed ([tokens] * experts) and no
        tokens-per-expert count is read.  The picked experts' terms are the
        routed forward's (same router, same SwiGLU scaling, float32 sum of
        the picked experts' outputs); the others add exact zeros.  The cost
        is reading every expert's weights at every step (at batch 1 with
        top-2 of 8 experts, four times the routed bytes).  No biases (with
        an fc2 bias an unpicked expert would add it).  is_first_microbatch
        goes to both GroupedLinears, as in forward."""
        if self.fc1.use_bias or self.fc2.use_bias:
            raise NotImplementedError("forward_every_expert: experts with biases are not supported (an unpicked "
                                      "expert would add its fc2 bias)")
        lead = hidden_states.shape[:-1]
        x = hidden_states.reshape(-1, self.hidden_size)
        t, e = x.shape[0], self.num_experts
        probs, _, _ = GroupedMLP.route(self, x)  # (not kept in router_logits: no load-balancing loss here)
        splits = [t] * e
        xp = x.repeat(e, 1)  # expert-major: rows [g * t, (g + 1) * t) are expert g's copy of the tokens
        h = self.fc1(xp, splits, is_first_microbatch)
        y = self.fc2(h, splits, is_first_microbatch, swiglu_probs=probs.t().contiguous().reshape(-1))
        y = y.view(e, t, self.hidden_size)
        return y.sum(0, dtype=torch.float32).to(y.dtype).view(*lead, self.hidden_size)


class SeqfuseMixtralDecoderLayer(nn.Module):
    """One Mixtral decoder layer: seqfuse's attention block (RMSNorm fused
    into the QKV GEMM, RoPE, grouped-query causal attention, no biases),
    then RMSNorm and the mixture of experts, each with its residual.
    forward returns (hidden states, router logits float32 [tokens, experts]);
    the logits are those ``self.mlp`` left in its ``router_logits`` during
    the call (what SeqfuseMixtralSparseMoE does: a replacement MoE block,
    e.g. an expert-parallel one, must do the same, and take
    is_first_microbatch as its forward's second argument)."""

    def __init__(self, config, layer_number):
        super().__init__()
        device = default_device()
        self.layer_number = layer_number
        self.self_attention = MultiheadAttention(
            config.hidden_size, config.num_attention_heads, kv_channels=config.head_dim,
            attention_dropout=float(config.attention_dropout or 0.0), layernorm_epsilon=config.rms_norm_eps,
            layer_number=layer_number, attn_mask_type="causal", num_gqa_groups=config.num_key_value_heads,
            input_layernorm=True, attention_type="self", fuse_qkv_params=True, qkv_weight_interleaved=True,
            bias=False, normalization="RMSNorm", qkv_format=config.attn_input_format, device=device)
        self.pre_mlp_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, device=device)
        self.mlp = SeqfuseMixtralSparseMoE(config, device=device)

    def forward(self, hidden_states, attention_mask=None, self_attn_mask_type=None, rotary_pos_emb=None,
                cu_seqlens_q=None, cu_seqlens_kv=None, max_seqlen_q=None, max_seqlen_kv=None, qkv_format=None,
                is_first_microbatch=None):
        """The keyword arguments are TransformerLayer's (the Llama family's
        Layout.layer_kw); is_first_microbatch (Transformer Engine's
        gradient-accumulation argument: under FP8, True casts the weights
        and keeps the casts, False reuses them, None casts a weight when it
        changed) goes to the attention block and to the experts."""
        x = self.attention_block(
            hidden_states, attention_mask=attention_mask, self_attn_mask_type=self_attn_mask_type,
            rotary_pos_emb=rotary_pos_emb, cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv,
            max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv, qkv_format=qkv_format,
            is_first_microbatch=is_first_microbatch)
        return self.after_attention(x, is_first_microbatch)

    def attention_block(self, hidden_states, self_attn_mask_type=None, is_first_microbatch=None, **kw):
        """hidden_states + attention(hidden_states): the layer's first half,
        which DecoderStack.graph_layers captures alone when the experts
        cannot be captured; ``kw`` are forward's attention arguments.  The
        residual is added in the output projection's GEMM epilogue and its
        gradient in the QKV norm's backward pass (MultiheadAttention's
        ``residual``): no add of its own either way."""
        return self.self_attention(hidden_states, attn_mask_type=self_attn_mask_type,
                                   is_first_microbatch=is_first_microbatch, residual=hidden_states, **kw)

    def after_attention(self, x, is_first_microbatch=None):
        """The layer's second half on the attention block's output ``x``:
        (x + moe(RMSNorm(x)), the router logits)."""
        x = self.feed_forward(x, is_first_microbatch=is_first_microbatch)
        logits, self.mlp.router_logits = self.mlp.router_logits, None
        return x, logits

    def feed_forward(self, x, capture_safe=False, is_first_microbatch=None):
        """x + moe(RMSNorm(x)) (also the cached generation's step).
        ``capture_safe``: the experts without a host read
        (SeqfuseMixtralSparseMoE.forward_every_expert), as generation's
        decode step runs them while it is captured into a CUDA graph.
        ``is_first_microbatch``: forward's, for the experts' GEMMs."""
        if capture_safe:
            return x + self.mlp.forward_every_expert(self.pre_mlp_layernorm(x), is_first_microbatch)
        norm = self.pre_mlp_layernorm
        if torch.is_grad_enabled() and x.requires_grad and type(norm) is RMSNorm and not (
                norm._forward_hooks or norm._forward_pre_hooks):
            # the residual's gradient added in the norm's backward pass (RMSNorm's input alias), not by an add
            # (a replaced or hooked norm is called as a plain one: its hooks see a tensor, not the pair)
            n, x = norm(x, return_input_alias=True)
        else:
            n = norm(x)
        return x + self.mlp(n, is_first_microbatch)


def load_balancing_loss(router_logits, num_experts, topk, attention_mask=None):
    """transformers' load_balancing_loss_func (Switch Transformer's loss over
    every layer's tokens together) from the layers' router logits (float32
    [tokens, experts] each), with seqfuse's fused router kernels.
    ``attention_mask`` [b, s] (1 = token) excludes padding rows; the logits
    then hold b * s rows per layer."""
    logits = torch.cat([t.reshape(-1, num_experts) for t in router_logits], 0)
    if attention_mask is not None:
        keep = attention_mask.reshape(-1).bool().repeat(len(router_logits))
        if keep.numel() != logits.shape[0]:
            raise ValueError(f"load_balancing_loss: attention_mask has {attention_mask.numel()} entries, the "
                             f"router logits {logits.shape[0] // len(router_logits)} rows per layer")
        logits = logits[keep]
    routing_map, scores = fused_compute_score_for_moe_aux_loss(logits, topk, "softmax")
    # TE's formula is coeff * E / (topk * N^2) * sum_e P_e c_e; transformers' has no 1 / topk
    return fused_moe_aux_loss(scores, routing_map.sum(0), logits.shape[0], num_experts, topk, float(topk))


class SeqfuseMixtralPreTrainedModel(DecoderPreTrainedModel):
    """transformers' Mixtral initialisation is Llama's (llama.DecoderPreTrainedModel:
    the router and the experts' matrices N(0, initializer_range) too)."""
    config_class = SeqfuseMixtralConfig
    config: SeqfuseMixtralConfig
    _no_split_modules = ["SeqfuseMixtralDecoderLayer"]


class SeqfuseMixtralModel(DecoderStack, SeqfuseMixtralPreTrainedModel):
    """The Mixtral decoder stack: embeddings, decoder layers, final RMSNorm."""

    def __init__(self, config: SeqfuseMixtralConfig):
        super().__init__(config)
        self.build_stack(config, SeqfuseMixtralDecoderLayer)
        self.post_init()

    def layout(self, input_ids, attention_mask=None, position_ids=None, cu_seqlens=None, max_seqlen=None):
        """How a batch runs through the layers (the Llama family's Layout), its arguments checked."""
        return batch_layout(input_ids, attention_mask, position_ids, cu_seqlens, max_seqlen, NAME)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cu_seqlens=None, max_seqlen=None,
                output_hidden_states=None, output_router_logits=None, output_attentions=None, use_cache=None,
                return_dict=None, **unused):
        """Padded: input_ids [b, s], attention_mask [b, s] (1 = token, 0 = pad).
        Packed: input_ids [t] or [1, t] with cu_seqlens int32 [n+1] (and
        max_seqlen) or restarting position_ids.  router_logits are returned
        when ``output_router_logits`` (default the config's)."""
        check_unsupported(unused, output_attentions, use_cache, NAME)
        layout = self.layout(input_ids, attention_mask, position_ids, cu_seqlens, max_seqlen)
        out = self.run(input_ids, layout, output_hidden_states)
        if not (self.config.output_router_logits if output_router_logits is None else output_router_logits):
            out = MoeModelOutputWithPast(last_hidden_state=out.last_hidden_state, hidden_states=out.hidden_states)
        return out if return_dict is not False else out.to_tuple()

    def run(self, input_ids, layout, output_hidden_states=False):
        """The layers over ``input_ids`` laid out as ``layout`` says:
        MoeModelOutputWithPast with every layer's router logits."""
        x, hidden, router = run_layers(self, input_ids, layout, output_hidden_states, layer_extras=True)
        return MoeModelOutputWithPast(last_hidden_state=x, router_logits=tuple(router), hidden_states=hidden)


class SeqfuseMixtralForCausalLM(CachedGenerate, TiedCausalLM, SeqfuseMixtralPreTrainedModel):
    """Mixtral causal language model on seqfuse layers (``model`` and the
    tied ``lm_head``: pretrained.TiedCausalLM)."""

    base_model_class = SeqfuseMixtralModel

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None, cu_seqlens=None,
                max_seqlen=None, num_items_in_batch=None, logits_to_keep=0, output_hidden_states=None,
                output_router_logits=None, output_attentions=None, use_cache=None, return_dict=None, **unused):
        """As MixtralForCausalLM (labels unshifted, -100 ignored); packed input
        via cu_seqlens / max_seqlen or restarting position_ids.  With
        ``output_router_logits`` (default the config's) the result carries
        router_logits and aux_loss, and the loss (with labels) includes
        router_aux_loss_coef * aux_loss, as transformers'."""
        name = NAME + "ForCausalLM"
        check_unsupported(unused, output_attentions, use_cache, name)
        check_lm_arguments(input_ids, labels, logits_to_keep, name)
        want_router = self.config.output_router_logits if output_router_logits is None else output_router_logits
        layout = self.model.layout(input_ids, attention_mask, position_ids, cu_seqlens, max_seqlen)
        out = self.model.run(input_ids, layout, output_hidden_states)
        logits, loss = lm_logits_and_loss(self.lm_head, out.last_hidden_state, labels, layout.cu_seqlens,
                                          num_items_in_batch, logits_to_keep)
        aux_loss = None
        if want_router:
            aux_loss = load_balancing_loss(out.router_logits, self.config.num_local_experts,
                                           self.config.num_experts_per_tok,
                                           None if layout.packed else attention_mask)
            if loss is not None:
                loss = loss + self.config.router_aux_loss_coef * aux_loss
        result = MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux_loss, logits=logits,
                                           hidden_states=out.hidden_states,
                                           router_logits=out.router_logits if want_router else None)
        return result if return_dict is not False else result.to_tuple()


register_auto(SeqfuseMixtralConfig, (AutoModel, SeqfuseMixtralModel),
              (AutoModelForCausalLM, SeqfuseMixtralForCausalLM))
