"""TransformerLayer: Transformer Engine's pre-LayerNorm transformer block over
seqfuse's MultiheadAttention and LayerNormMLP.

    x = x + dropout(self_attention(x))              # norm fused into the QKV GEMM
    x = x + dropout(inter_attention(x, encoder))    # layer_type "decoder" only
    x = x + dropout(layernorm_mlp(x))               # norm fused into FC1

Submodule and parameter names are TE's (self_attention.layernorm_qkv,
self_attention.proj, inter_attention.*, layernorm_mlp.*), so checkpoints and
code written for TE's layer map one to one.  ``layer_type="decoder"`` adds
TE's cross-attention over ``encoder_output`` (causality is the
``self_attn_mask_type``, "causal" by default as in TE).  Inputs are
[s, b, h] ("sbhd", TE's default), [b, s, h] ("bshd") or packed [t, h]
("thd", with cu_seqlens_q/kv and max_seqlen_q/kv).

QK-norm (``qk_norm_type``, ``qk_norm_eps``, ``qk_norm_before_rope``) is
MultiheadAttention's, applied in self- and cross-attention as in TE; so is
``rotary_pos_emb`` (one table for queries and keys, or a (q, k) pair; in
cross-attention the queries turn by the decoder's positions and the keys by
the encoder's, so a single table must cover the longer of the two).
``seq_length`` and ``micro_batch_size`` only size buffers in TE and change
nothing here.  ``device="meta"`` defers initialisation to
reset_parameters() (MultiheadAttention's note).

TE's layer variants, as TE computes them:
``apply_residual_connection_post_layernorm`` (the residual of each block is
its norm's output, not its input), ``output_layernorm`` (no norm in front of
self-attention, a norm after the MLP's residual: BERT's post-LN layer),
``parallel_attention_mlp`` (x + dropout(attention(x) + mlp(x)); not with
the two post-LN flags, as in TE, nor with layer_type "decoder"), and
``drop_path_rate`` (stochastic depth on the self-attention and MLP branches
in training: each slice along the input's first dimension kept with
probability 1 - rate and scaled by 1 / (1 - rate), TE's DropPath).

Differences from TE, each raising NotImplementedError naming the argument
(seqfuse.modules.te_compat.REFUSED): tensor/sequence/context parallelism,
interleaved RoPE, non-vanilla softmax, fused weight-gradient accumulation,
activation parameters, KV caches.  ``fuse_qkv_params=False`` (TE's default) gives
separate query/key/value parameters, still one QKV GEMM (see
MultiheadAttention).  Unlike TE, ``device``
defaults to the GPU only where seqfuse can use one (else the CPU).
"""
import torch

from .layernorm_mlp import LayerNormMLP
from .multihead_attention import MultiheadAttention, given
from .norm import LayerNorm, RMSNorm
from ._base import compute_dtype, residual_fusable, size_arg
from .te_compat import take_refused


class TransformerLayer(torch.nn.Module):
    """TE's TransformerLayer (names and arguments); see the module note."""

    def __init__(self, hidden_size, ffn_hidden_size, num_attention_heads, num_gqa_groups=None,
                 layernorm_epsilon=1e-5, hidden_dropout=0.1, attention_dropout=0.1, init_method=None,
                 output_layer_init_method=None, layer_number=None, kv_channels=None,
                 self_attn_mask_type="causal", window_size=None, *, enc_dec_attn_mask_type="no_mask",
                 enc_dec_window_size=None, params_dtype=None, get_rng_state_tracker=None, seq_length=None,
                 micro_batch_size=None, layer_type="encoder", fuse_qkv_params=False, zero_centered_gamma=False,
                 qkv_weight_interleaved=True, bias=True, activation="gelu", normalization="LayerNorm",
                 device=None, attn_input_format="sbhd", name=None, softmax_scale=None, qk_norm_type=None,
                 qk_norm_eps=1e-6, qk_norm_before_rope=False, ub_overlap_ag=True, ub_overlap_rs=True,
                 ub_overlap_rs_dgrad=False, ub_bulk_dgrad=True, ub_bulk_wgrad=True,
                 apply_residual_connection_post_layernorm=False, output_layernorm=False,
                 parallel_attention_mlp=False, drop_path_rate=0.0, fuse_wgrad_accumulation=False, **te_refused):
        super().__init__()
        # the ub_* flags: TE reads them only with ub_tp_comm_overlap=True (refused), so any value is taken
        take_refused("TransformerLayer", te_refused, unknown=NotImplementedError)
        self.seq_length, self.micro_batch_size = seq_length, micro_batch_size
        self.apply_residual_connection_post_layernorm = post_ln = bool(apply_residual_connection_post_layernorm)
        self.output_layernorm = bool(output_layernorm)
        self.parallel_attention_mlp = bool(parallel_attention_mlp)
        if self.parallel_attention_mlp and (post_ln or self.output_layernorm or layer_type == "decoder"):
            raise NotImplementedError("TransformerLayer: parallel_attention_mlp=True is not supported together "
                                      "with apply_residual_connection_post_layernorm, output_layernorm or "
                                      "layer_type 'decoder' (TE refuses the first two as well)")
        if not 0.0 <= drop_path_rate < 1.0:
            raise ValueError(f"TransformerLayer: drop_path_rate must be in [0, 1), got {drop_path_rate}")
        self.drop_path_rate = float(drop_path_rate)
        if layer_type not in ("encoder", "decoder"):
            raise ValueError(f"TransformerLayer: layer_type must be 'encoder' or 'decoder', got {layer_type!r}")
        if attn_input_format not in ("sbhd", "bshd", "thd"):
            raise ValueError(f"TransformerLayer: attn_input_format must be 'sbhd', 'bshd' or 'thd', "
                             f"got {attn_input_format!r}")
        if not 0.0 <= hidden_dropout < 1.0:
            raise ValueError(f"TransformerLayer: hidden_dropout must be in [0, 1), got {hidden_dropout}")
        if layer_type == "decoder" and attn_input_format == "thd":
            raise NotImplementedError("TransformerLayer: layer_type 'decoder' with packed 'thd' input is not supported")
        cls = "TransformerLayer"
        self.hidden_size = size_arg(cls, "hidden_size", hidden_size)
        size_arg(cls, "ffn_hidden_size", ffn_hidden_size)
        size_arg(cls, "num_attention_heads", num_attention_heads)
        self.layer_type = layer_type
        self.attn_input_format = attn_input_format
        self.self_attn_mask_type = self_attn_mask_type
        self.window_size = window_size
        self.hidden_dropout = float(hidden_dropout)
        self.layer_number = layer_number
        self.name = name
        common = dict(kv_channels=kv_channels, attention_dropout=attention_dropout,
                      layernorm_epsilon=layernorm_epsilon, init_method=init_method,
                      return_layernorm_output=post_ln, fuse_wgrad_accumulation=fuse_wgrad_accumulation,
                      output_layer_init_method=output_layer_init_method, layer_number=layer_number,
                      num_gqa_groups=num_gqa_groups, params_dtype=params_dtype,
                      get_rng_state_tracker=get_rng_state_tracker,
                      fuse_qkv_params=fuse_qkv_params, zero_centered_gamma=zero_centered_gamma,
                      qkv_weight_interleaved=qkv_weight_interleaved, bias=bias,
                      normalization=normalization, device=device, qkv_format=attn_input_format,
                      softmax_scale=softmax_scale, qk_norm_type=qk_norm_type, qk_norm_eps=qk_norm_eps,
                      qk_norm_before_rope=qk_norm_before_rope, seq_length=seq_length,
                      micro_batch_size=micro_batch_size)
        self.self_attention = MultiheadAttention(
            hidden_size, num_attention_heads, attn_mask_type=self_attn_mask_type, window_size=window_size,
            attention_type="self", input_layernorm=not self.output_layernorm, **common)
        if layer_type == "decoder":
            self.inter_attention = MultiheadAttention(
                hidden_size, num_attention_heads, attn_mask_type=enc_dec_attn_mask_type,
                window_size=enc_dec_window_size, attention_type="cross", input_layernorm=True, **common)
        mlp_kw = dict(eps=layernorm_epsilon, bias=bias, normalization=normalization, activation=activation,
                      zero_centered_gamma=zero_centered_gamma, device=device, seq_length=seq_length,
                      micro_batch_size=micro_batch_size, return_layernorm_output=post_ln,
                      fuse_wgrad_accumulation=fuse_wgrad_accumulation,
                      **given(params_dtype=params_dtype, init_method=init_method,
                              output_layer_init_method=output_layer_init_method,
                              get_rng_state_tracker=get_rng_state_tracker))
        self.layernorm_mlp = LayerNormMLP(hidden_size, ffn_hidden_size, **mlp_kw)
        if self.output_layernorm:  # BERT's post-LN: a norm after the MLP's residual
            norm = LayerNorm if normalization == "LayerNorm" else RMSNorm
            self.layernorm = norm(hidden_size, eps=layernorm_epsilon, zero_centered_gamma=zero_centered_gamma,
                                  **given(params_dtype=params_dtype, device=device))

    def reset_parameters(self):
        """Initialise every submodule in construction order (deferred
        initialisation from device="meta"; see MultiheadAttention)."""
        for module in self.children():
            module.reset_parameters()

    def _residual(self, residual, x, drop_path=False):
        """residual + dropout(x), x's slices along dim 0 also dropped with
        drop_path_rate (training only) where ``drop_path`` (TE's DropPath)."""
        out = torch.nn.functional.dropout(x, p=self.hidden_dropout, training=self.training)
        if drop_path and self.drop_path_rate > 0.0 and self.training:
            keep = 1.0 - self.drop_path_rate
            mask = (keep + torch.rand((out.shape[0],) + (1,) * (out.dim() - 1), dtype=out.dtype,
                                      device=out.device)).floor_()
            out = out.div(keep) * mask
        return residual + out

    def _residual_fusable(self, residual, out_dtype):
        """Whether a residual branch is added in its last GEMM's epilogue
        (the attention's output projection, the MLP's FC2): the layout
        allows it (not post-LN, not parallel attention + MLP), no hidden
        dropout or drop path now, the residual in the branch output's dtype
        (residual_fusable logs each reason once)."""
        why_not = None
        if self.apply_residual_connection_post_layernorm:
            why_not = "the residual is the norm's output (apply_residual_connection_post_layernorm)"
        elif self.parallel_attention_mlp:
            why_not = "attention and MLP add to one residual (parallel_attention_mlp)"
        elif self.training and (self.hidden_dropout > 0.0 or self.drop_path_rate > 0.0):
            why_not = "hidden dropout / drop path on the branches in training"
        return residual_fusable("TransformerLayer", residual, out_dtype, why_not)

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream, cp_comm_type="p2p"):
        """TE's call: context parallelism for every attention block of the
        layer (MultiheadAttention.set_context_parallel_group)."""
        for child in self.children():
            if hasattr(child, "set_context_parallel_group"):
                child.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)

    def forward(self, hidden_states, attention_mask=None, self_attn_mask_type=None, window_size=None,
                *, encoder_output=None, enc_dec_attn_mask=None, enc_dec_attn_mask_type=None,
                enc_dec_window_size=None, is_first_microbatch=None, checkpoint_core_attention=False,
                inference_params=None, rotary_pos_emb=None, core_attention_bias_type="no_bias",
                core_attention_bias=None, alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_kv=None,
                max_seqlen_q=None, max_seqlen_kv=None, fast_zero_fill=True, qkv_format=None,
                bottom_right_diagonal=None, enc_dec_bottom_right_diagonal=None, cu_seqlens_q_padded=None,
                cu_seqlens_kv_padded=None, pad_between_seqs=None):
        """One layer.  ``attention_mask``: TE's boolean padding mask [b, 1, 1, s]
        (True = padding) for bshd/sbhd "padding" masks; thd uses cu_seqlens.
        seqfuse extension: ``qkv_format`` overrides attn_input_format for this
        call.  checkpoint_core_attention, fast_zero_fill, the *_padded
        cu_seqlens, bottom_right_diagonal and pad_between_seqs as
        MultiheadAttention's forward takes them.  As in TE, the
        self-attention reads cu_seqlens_q (and max_seqlen_q,
        cu_seqlens_q_padded) for its keys too, and a decoder's
        cross-attention gets cu_seqlens_q / cu_seqlens_kv (the encoder's
        lengths) and their max_seqlen and *_padded twins."""
        if enc_dec_bottom_right_diagonal is not None:
            raise NotImplementedError(f"TransformerLayer: argument 'enc_dec_bottom_right_diagonal'="
                                      f"{enc_dec_bottom_right_diagonal!r} is not supported: the "
                                      "enc_dec_attn_mask_type sets the sliding-window diagonal")
        if inference_params is not None:
            raise NotImplementedError("TransformerLayer: inference_params (KV cache) is not supported")
        post_ln = self.apply_residual_connection_post_layernorm
        # residual + branch goes into the branch GEMM's epilogue where the layout and dtypes allow
        fuse_attn = isinstance(hidden_states, torch.Tensor) and self._residual_fusable(
            hidden_states, compute_dtype(hidden_states, self.self_attention.proj.weight))
        attn_out = self.self_attention(
            hidden_states, attention_mask=attention_mask,
            attn_mask_type=self_attn_mask_type or self.self_attn_mask_type,
            window_size=window_size if window_size is not None else self.window_size,
            rotary_pos_emb=rotary_pos_emb, core_attention_bias_type=core_attention_bias_type,
            core_attention_bias=core_attention_bias, alibi_slopes=alibi_slopes,
            # (self-attention: the keys are the queries' tokens, so the query's lengths serve both, as in TE)
            cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_q, max_seqlen_q=max_seqlen_q,
            max_seqlen_kv=max_seqlen_q, qkv_format=qkv_format, is_first_microbatch=is_first_microbatch,
            checkpoint_core_attention=checkpoint_core_attention, bottom_right_diagonal=bottom_right_diagonal,
            cu_seqlens_q_padded=cu_seqlens_q_padded, cu_seqlens_kv_padded=cu_seqlens_q_padded,
            pad_between_seqs=pad_between_seqs, residual=hidden_states if fuse_attn else None)
        if post_ln and not self.output_layernorm:  # the residual is the norm's output
            attn_out, residual = attn_out
        else:
            residual = hidden_states
        if self.parallel_attention_mlp:  # attention and MLP both read the layer's input
            mlp_out = self.layernorm_mlp(hidden_states, is_first_microbatch=is_first_microbatch)
            return self._residual(hidden_states, attn_out + mlp_out, drop_path=True)
        x = attn_out if fuse_attn else self._residual(residual, attn_out, drop_path=True)
        if self.layer_type == "decoder":
            if encoder_output is None:
                raise ValueError("TransformerLayer: layer_type 'decoder' needs encoder_output")
            if (qkv_format or self.attn_input_format) == "thd":
                raise NotImplementedError("TransformerLayer: layer_type 'decoder' with packed 'thd' "
                                          "input is not supported")
            cross = self.inter_attention(
                x, attention_mask=enc_dec_attn_mask, encoder_output=encoder_output,
                attn_mask_type=enc_dec_attn_mask_type, window_size=enc_dec_window_size,
                qkv_format=qkv_format, is_first_microbatch=is_first_microbatch,
                checkpoint_core_attention=checkpoint_core_attention, rotary_pos_emb=rotary_pos_emb,
                cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv, max_seqlen_q=max_seqlen_q,
                max_seqlen_kv=max_seqlen_kv, cu_seqlens_q_padded=cu_seqlens_q_padded,
                cu_seqlens_kv_padded=cu_seqlens_kv_padded, pad_between_seqs=pad_between_seqs)
            cross, residual = cross if post_ln else (cross, x)
            x = self._residual(residual, cross)
        if fuse_attn:  # the same layout and dropout rules; LayerNormMLP computes in x's dtype
            out = self.layernorm_mlp(x, is_first_microbatch=is_first_microbatch, residual=x)
        else:
            mlp_out = self.layernorm_mlp(x, is_first_microbatch=is_first_microbatch)
            mlp_out, residual = mlp_out if post_ln else (mlp_out, x)
            out = self._residual(residual, mlp_out, drop_path=True)
        return self.layernorm(out) if self.output_layernorm else out

    def extra_repr(self):
        return (f"hidden_size={self.hidden_size}, layer_type={self.layer_type}, "
                f"attn_input_format={self.attn_input_format}, self_attn_mask_type={self.self_attn_mask_type}")
