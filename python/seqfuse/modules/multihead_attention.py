"""MultiheadAttention: Transformer Engine's attention block (norm + fused QKV
projection, rotary embeddings, fused core attention, output projection) over
seqfuse's LayerNormLinear, Linear, RoPE and DotProductAttention.

Self-attention: with ``input_layernorm`` the input goes through
``layernorm_qkv`` (LayerNormLinear, one GEMM producing Q, K and V for all
heads), else through ``qkv`` (Linear).  Cross-attention
(``attention_type="cross"``): queries from ``layernorm_query`` / ``query_layer``
over the hidden states, keys and values from ``key_value`` over
``encoder_output``.  The fused weight's row order is TE's: with
``qkv_weight_interleaved`` (default) per key/value group [its query heads,
its key head, its value head], else [all Q; all K; all V] (see
seqfuse.hf.qkv for the reshuffle).  Q and K are rotated by
``rotary_pos_emb`` (RotaryPositionEmbedding's freqs, or a (q, k) pair of
them); thd rotates per packed sequence.  Rotated q and k are new tensors,
so in training the block hands attention a copy of v (one [tokens, kv
heads, head dim] copy): v as a view would keep the projection's whole output
(q and k before rotation included) alive until attention's backward.  The
output projection is ``proj``.

``fuse_qkv_params=False`` (TE's default) keeps the projection's rows as
separate parameters, as TE does: ``query_weight``, ``key_weight``,
``value_weight`` (and ``*_bias``) in ``layernorm_qkv`` / ``qkv``, or
``key_weight`` / ``value_weight`` in ``key_value`` for cross-attention;
the layout is then [all Q; all K; all V] (qkv_weight_interleaved is set to
False, as in TE).  The projection is still one GEMM over the concatenated
pieces (seqfuse.modules._split).

QK-norm (``qk_norm_type``, TE's): "RMSNorm" or "LayerNorm" modules
``q_norm`` and ``k_norm`` over each head's channels (eps ``qk_norm_eps``),
or parameter-free "L2Normalization" (x / sqrt(sum x^2 + eps), run as an
RMSNorm with eps / d and weight 1 / sqrt(d)); applied after RoPE, or before
it with ``qk_norm_before_rope=True``.  ``seq_length`` and
``micro_batch_size`` only size buffers in TE and change nothing here.
``get_rng_state_tracker`` (TE's model-parallel RNG tracker): the weights are
initialised, and the attention dropout draws its seed, inside its fork.
``device="meta"`` defers initialisation: reset_parameters() materialises
the submodules in construction order, with the initialisation (and random
draws) of direct construction.

Differences from TE, each raising NotImplementedError naming the argument
rather than doing something else (seqfuse.modules.te_compat.REFUSED):
tensor/sequence/context parallelism and userbuffers,
interleaved RoPE, non-vanilla softmax, KV caches (``inference_params``).
"""
import contextlib
import math

import torch
import torch.distributed as dist

from ._base import compute_dtype, residual_fusable, size_arg
from .attention import DotProductAttention
from .layernorm_linear import LayerNormLinear
from .linear import Linear
from .norm import LayerNorm, RMSNorm, rms_norm
from .rope import apply_rotary_pos_emb
from .te_compat import rng_fork, take_refused
from ..quantization import checkpoint as recompute

QK_NORM_TYPES = ("RMSNorm", "LayerNorm", "L2Normalization")


class L2Normalization(torch.nn.Module):
    """y = x / sqrt(sum(x^2) + eps) over the last dimension (TE's
    parameter-free QK-norm): RMSNorm's kernel with eps / d and a constant
    weight 1 / sqrt(d), which is the same function."""

    def __init__(self, size, eps=1e-6):
        super().__init__()
        self.size, self.eps = int(size), float(eps)

    def forward(self, x):
        scale = torch.full((self.size,), 1.0 / math.sqrt(self.size), dtype=x.dtype, device=x.device)
        return rms_norm(x, scale, self.eps / self.size)


def given(**kw):
    """The keyword arguments that are not None (the callee's own defaults
    apply to the others)."""
    return {k: v for k, v in kw.items() if v is not None}


def _kw(init_method, params_dtype, device):
    return given(init_method=init_method, params_dtype=params_dtype, device=device)


class MultiheadAttention(torch.nn.Module):
    """TE's MultiheadAttention (names and arguments); see the module note."""

    def __init__(self, hidden_size, num_attention_heads, kv_channels=None, attention_dropout=0.1,
                 layernorm_epsilon=1e-5, init_method=None, output_layer_init_method=None,
                 layer_number=None, attn_mask_type="causal", window_size=None,
                 *, num_gqa_groups=None, get_rng_state_tracker=None, params_dtype=None,
                 return_layernorm_output=False, input_layernorm=False, attention_type="self",
                 fuse_qkv_params=False, zero_centered_gamma=False,
                 qkv_weight_interleaved=True, bias=True, normalization="LayerNorm", device=None,
                 qkv_format="sbhd", softmax_scale=None, name=None, qk_norm_type=None, qk_norm_eps=1e-6,
                 qk_norm_before_rope=False, seq_length=None, micro_batch_size=None, return_bias=False,
                 fuse_wgrad_accumulation=False, **te_refused):
        super().__init__()
        take_refused("MultiheadAttention", te_refused, unknown=NotImplementedError)
        if qk_norm_type is not None and qk_norm_type not in QK_NORM_TYPES:
            raise ValueError(f"MultiheadAttention: qk_norm_type must be None or one of {', '.join(QK_NORM_TYPES)}, "
                             f"got {qk_norm_type!r}")
        self.name, self.seq_length, self.micro_batch_size = name, seq_length, micro_batch_size
        self.return_bias = bool(return_bias)  # the projection's bias returned, not added (TE)
        self.qk_norm_type, self.qk_norm_eps = qk_norm_type, float(qk_norm_eps)
        self.qk_norm_before_rope = bool(qk_norm_before_rope)
        if attention_type not in ("self", "cross"):
            raise ValueError(f"MultiheadAttention: attention_type must be 'self' or 'cross', got {attention_type!r}")
        if normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"MultiheadAttention: normalization must be 'LayerNorm' or 'RMSNorm', "
                             f"got {normalization!r}")
        if qkv_format not in ("sbhd", "bshd", "thd"):
            raise ValueError(f"MultiheadAttention: qkv_format must be 'sbhd', 'bshd' or 'thd', got {qkv_format!r}")
        cls = "MultiheadAttention"
        self.hidden_size = size_arg(cls, "hidden_size", hidden_size)
        self.num_attention_heads = size_arg(cls, "num_attention_heads", num_attention_heads)
        self.num_gqa_groups = size_arg(cls, "num_gqa_groups", self.num_attention_heads if num_gqa_groups is None
                                       else num_gqa_groups)
        if self.num_attention_heads % self.num_gqa_groups:
            raise ValueError(f"MultiheadAttention: num_attention_heads ({num_attention_heads}) must be a "
                             f"multiple of num_gqa_groups ({num_gqa_groups})")
        if kv_channels is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"MultiheadAttention: hidden_size ({hidden_size}) must be a multiple of "
                                 f"num_attention_heads ({num_attention_heads}) unless kv_channels is given")
            kv_channels = self.hidden_size // self.num_attention_heads
        self.hidden_size_per_attention_head = self.kv_channels = size_arg(cls, "kv_channels", kv_channels)
        self.attention_type = attention_type
        self.input_layernorm = bool(input_layernorm)
        self.return_layernorm_output = bool(return_layernorm_output)
        self.fuse_qkv_params = bool(fuse_qkv_params)
        # separate Q/K/V parameters are concatenated [Q; K; V] (TE: the same)
        self.qkv_weight_interleaved = bool(qkv_weight_interleaved) and self.fuse_qkv_params
        self.qkv_format = qkv_format
        self.attn_mask_type = attn_mask_type
        self.window_size = window_size
        self.layer_number = layer_number

        hn, np_, ng = self.kv_channels, self.num_attention_heads, self.num_gqa_groups
        kw = _kw(init_method, params_dtype, device)
        kw.update(given(get_rng_state_tracker=get_rng_state_tracker))
        self.get_rng_state_tracker = get_rng_state_tracker  # weights' init and attention dropout (TE)
        # every projection accumulates into a weight's main_grad where there is one (needs fuse_qkv_params=True
        # for the QKV weight: split parameters refuse main_grad, naming it)
        kw["fuse_wgrad_accumulation"] = self.fuse_wgrad_accumulation = bool(fuse_wgrad_accumulation)
        ln_kw = dict(eps=layernorm_epsilon, bias=bias, normalization=normalization,
                     zero_centered_gamma=zero_centered_gamma,
                     return_layernorm_output=self.return_layernorm_output, **kw)
        q_rows, kv_rows = np_ * hn, ng * hn
        if attention_type == "self":
            qkv_out = q_rows + 2 * kv_rows
            split = None if self.fuse_qkv_params else {"query": q_rows, "key": kv_rows, "value": kv_rows}
            if self.input_layernorm:
                self.layernorm_qkv = LayerNormLinear(self.hidden_size, qkv_out, parameters_split=split, **ln_kw)
            else:
                self.qkv = Linear(self.hidden_size, qkv_out, bias=bias, parameters_split=split, **kw)
        else:
            if self.input_layernorm:
                self.layernorm_query = LayerNormLinear(self.hidden_size, np_ * hn, **ln_kw)
            else:
                self.query_layer = Linear(self.hidden_size, np_ * hn, bias=bias, **kw)
            split = None if self.fuse_qkv_params else {"key": kv_rows, "value": kv_rows}
            self.key_value = Linear(self.hidden_size, 2 * kv_rows, bias=bias, parameters_split=split, **kw)
        self.core_attention = DotProductAttention(
            np_, hn, num_gqa_groups=ng, attention_dropout=attention_dropout, qkv_format=qkv_format,
            attn_mask_type=attn_mask_type, window_size=window_size, layer_number=layer_number,
            attention_type=attention_type, softmax_scale=softmax_scale)
        self.proj = Linear(np_ * hn, self.hidden_size, bias=bias, return_bias=self.return_bias,
                           **_kw(output_layer_init_method, params_dtype, device),
                           fuse_wgrad_accumulation=self.fuse_wgrad_accumulation,
                           **given(get_rng_state_tracker=get_rng_state_tracker))
        if qk_norm_type == "L2Normalization":  # parameter-free: one module serves both, as in TE
            self.q_norm = self.k_norm = L2Normalization(hn, qk_norm_eps)
        elif qk_norm_type is not None:
            norm = RMSNorm if qk_norm_type == "RMSNorm" else LayerNorm
            self.q_norm = norm(hn, eps=qk_norm_eps, **given(params_dtype=params_dtype, device=device))
            self.k_norm = norm(hn, eps=qk_norm_eps, **given(params_dtype=params_dtype, device=device))
        else:
            self.q_norm = self.k_norm = None

    def reset_parameters(self):
        """Initialise every submodule in construction order (deferred
        initialisation: a module built with device="meta" is materialised on
        the current CUDA device, the CPU without one, with the values direct
        construction gives under the same seed)."""
        for module in self.children():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()

    # -- projections -------------------------------------------------------
    # The splits below are torch.split / unbind on purpose: their backward
    # writes the fused gradient once (one cat or stack of the parts' gradients),
    # where slicing and indexing views (grouped[..., per, :]) each allocate a
    # zero-filled fused-size gradient, copy their part in, and autograd then
    # adds the three: eleven passes over the fused QKV gradient per layer
    # instead of two (in the bf16 ESM-2 650M step, 16k tokens, the profile
    # in results/esm2_fsdp2_profile shows 3 fills of 16k x 3840 and 3 copies
    # per layer: 3.7 + 5.4 ms of the step's 186 ms of kernels, adds aside).
    # The interleaved splits run on 4-D views, tokens flattened: torch's CUDA
    # cat kernel takes at most 4 dimensions, and on the 5-D bshd view it fell
    # back to one strided copy per part (3 x 53 us per layer at ESM-2 650M's
    # 16 x 1024 tokens on an H200, against one 66 us cat in thd).
    def _split_qkv(self, mixed):
        """[..., (np + 2 ng) hn] -> q [..., np, hn], k and v [..., ng, hn] (views;
        q a copy when several query heads share a group)."""
        hn, np_, ng = self.kv_channels, self.num_attention_heads, self.num_gqa_groups
        lead = mixed.shape[:-1]
        if self.qkv_weight_interleaved:
            per = np_ // ng
            grouped = mixed.reshape(-1, ng, per + 2, hn)  # a view unless mixed's lead dims are strided
            q, k, v = torch.split(grouped, [per, 1, 1], dim=-2)
            return q.reshape(*lead, np_, hn), k.view(*lead, ng, hn), v.view(*lead, ng, hn)
        q, k, v = torch.split(mixed, [np_ * hn, ng * hn, ng * hn], dim=-1)
        return q.view(*lead, np_, hn), k.view(*lead, ng, hn), v.view(*lead, ng, hn)

    def _split_kv(self, mixed):
        hn, ng = self.kv_channels, self.num_gqa_groups
        lead = mixed.shape[:-1]
        if self.qkv_weight_interleaved:
            k, v = torch.unbind(mixed.reshape(-1, ng, 2, hn), dim=-2)
            return k.view(*lead, ng, hn), v.view(*lead, ng, hn)
        k, v = torch.split(mixed, [ng * hn, ng * hn], dim=-1)
        return k.view(*lead, ng, hn), v.view(*lead, ng, hn)

    def _norm_proj(self, module, x, is_first_microbatch=None):
        out = module(x, is_first_microbatch=is_first_microbatch)
        if self.return_layernorm_output and self.input_layernorm:
            return out[0], out[1]
        return out, None

    # -- forward -----------------------------------------------------------
    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream, cp_comm_type="p2p"):
        """TE's call: context parallelism for this block's core attention
        (DotProductAttention.set_context_parallel_group); rotary embeddings
        then take the full-sequence table and turn each local token by its
        full-sequence position."""
        self.core_attention.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)

    def forward(self, hidden_states, attention_mask=None, encoder_output=None, attn_mask_type=None,
                window_size=None, *, is_first_microbatch=None, checkpoint_core_attention=False,
                inference_params=None, rotary_pos_emb=None, core_attention_bias_type="no_bias",
                core_attention_bias=None, alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_kv=None,
                max_seqlen_q=None, max_seqlen_kv=None, fast_zero_fill=True, qkv_format=None,
                bottom_right_diagonal=None, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None,
                pad_between_seqs=None, residual=None):
        """TE's forward.  seqfuse extensions: ``qkv_format`` overrides the
        layout given at construction for this call (one model can take padded
        bshd and packed thd batches); ``residual`` (the output's shape and
        dtype) is added in the output projection's GEMM epilogue
        (Linear's residual; in another dtype, e.g. float32 hidden states
        under a bfloat16 torch.autocast, it is added after the GEMM, as torch
        would, said once in a log line); when it is ``hidden_states`` itself (a pre-norm
        block) its gradient is added to the input's in the QKV norm's
        backward pass (LayerNormLinear's ``return_input_alias``).  ``checkpoint_core_attention=True``
        recomputes the core attention in the backward
        (seqfuse.quantization.checkpoint: FP8 settings kept, dropout's random
        state restored).  ``fast_zero_fill`` is a speed hint of TE's (how its
        outputs are zeroed); seqfuse's kernels write every output element, so
        it changes nothing.  ``cu_seqlens_*_padded`` go to
        DotProductAttention (which takes them equal to cu_seqlens_*);
        ``bottom_right_diagonal`` and ``pad_between_seqs=True`` raise
        NotImplementedError."""
        if bottom_right_diagonal is not None:
            raise NotImplementedError(f"MultiheadAttention: argument 'bottom_right_diagonal'="
                                      f"{bottom_right_diagonal!r} is not supported: the attn_mask_type sets "
                                      "the sliding-window diagonal ('causal_bottom_right' for bottom-right)")
        if pad_between_seqs:
            raise NotImplementedError("MultiheadAttention: argument 'pad_between_seqs'=True is not supported: "
                                      "packed sequences must be contiguous (cu_seqlens_*_padded equal to "
                                      "cu_seqlens_*)")
        if inference_params is not None:
            raise NotImplementedError("MultiheadAttention: inference_params (KV cache) is not supported")
        fmt = qkv_format or self.qkv_format
        if fmt not in ("sbhd", "bshd", "thd"):
            raise ValueError(f"MultiheadAttention: qkv_format must be 'sbhd', 'bshd' or 'thd', got {fmt!r}")
        if not isinstance(hidden_states, torch.Tensor):
            raise TypeError(f"MultiheadAttention: hidden_states must be a torch.Tensor, "
                            f"got {type(hidden_states).__name__}")
        want_dim = 2 if fmt == "thd" else 3
        if hidden_states.dim() != want_dim or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(f"MultiheadAttention: hidden_states must be {want_dim}-D with last dim "
                             f"{self.hidden_size} for qkv_format {fmt!r}, got {tuple(hidden_states.shape)}")
        if fmt == "thd" and cu_seqlens_q is None:
            raise ValueError("MultiheadAttention: qkv_format 'thd' needs cu_seqlens_q")
        added_after = None  # a residual the output projection's epilogue cannot add (another dtype): added after
        if isinstance(residual, torch.Tensor) and not residual_fusable(
                "MultiheadAttention", residual, compute_dtype(hidden_states, self.proj.weight)):
            added_after, residual = residual, None
        ln_out = None
        if self.attention_type == "self":
            if self.input_layernorm and residual is hidden_states and torch.is_grad_enabled() and \
                    hidden_states.requires_grad and not self.return_layernorm_output:
                # a pre-norm block's residual is the norm's input: the projection's epilogue adds it through
                # an alias whose gradient the norm backward adds to dx in its own pass (no add of its own)
                mixed, residual = self.layernorm_qkv(hidden_states, is_first_microbatch=is_first_microbatch,
                                                     return_input_alias=True)
            elif self.input_layernorm:
                mixed, ln_out = self._norm_proj(self.layernorm_qkv, hidden_states, is_first_microbatch)
            else:
                mixed = self.qkv(hidden_states, is_first_microbatch=is_first_microbatch)
            q, k, v = self._split_qkv(mixed)
        else:
            if encoder_output is None:
                raise ValueError("MultiheadAttention: attention_type 'cross' needs encoder_output")
            if self.input_layernorm:
                mixed_q, ln_out = self._norm_proj(self.layernorm_query, hidden_states, is_first_microbatch)
            else:
                mixed_q = self.query_layer(hidden_states, is_first_microbatch=is_first_microbatch)
            q = mixed_q.view(*mixed_q.shape[:-1], self.num_attention_heads, self.kv_channels)
            k, v = self._split_kv(self.key_value(encoder_output, is_first_microbatch=is_first_microbatch))

        if self.q_norm is not None and self.qk_norm_before_rope:
            q, k = self.q_norm(q), self.k_norm(k)
        if rotary_pos_emb is not None:
            q_freqs, k_freqs = (rotary_pos_emb if isinstance(rotary_pos_emb, (tuple, list))
                                else (rotary_pos_emb, rotary_pos_emb))
            thd = fmt == "thd"
            cp = self.core_attention.cp_group  # under context parallelism: turn by full-sequence positions
            cp_kw = dict(cp_size=dist.get_world_size(cp), cp_rank=dist.get_rank(cp)) if cp is not None else {}
            q = apply_rotary_pos_emb(q, q_freqs, fmt, cu_seqlens=cu_seqlens_q if thd else None, **cp_kw)
            kv_cu = (cu_seqlens_kv if cu_seqlens_kv is not None else cu_seqlens_q) if thd else None
            k = apply_rotary_pos_emb(k, k_freqs, fmt, cu_seqlens=kv_cu, **cp_kw)
            if torch.is_grad_enabled() and v._base is not None:
                # q and k are new tensors now; v, still a view of the projection's output, would keep
                # all of that output (q and k before rotation included) alive until attention's
                # backward: attention saves a copy of v instead, which frees the rest
                v = v.contiguous()
        if self.q_norm is not None and not self.qk_norm_before_rope:
            q, k = self.q_norm(q), self.k_norm(k)

        attn_kw = dict(attention_mask=attention_mask, qkv_format=fmt, attn_mask_type=attn_mask_type,
                       window_size=window_size, cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv,
                       cu_seqlens_q_padded=cu_seqlens_q_padded, cu_seqlens_kv_padded=cu_seqlens_kv_padded,
                       max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv,
                       core_attention_bias_type=core_attention_bias_type,
                       core_attention_bias=core_attention_bias, alibi_slopes=alibi_slopes)
        # attention dropout draws its seed inside the RNG tracker's fork where one is given (TE)
        dropping = self.training and self.core_attention.attention_dropout > 0
        dropout_rng = rng_fork(self.get_rng_state_tracker) if dropping else contextlib.nullcontext()
        with dropout_rng:
            if checkpoint_core_attention and torch.is_grad_enabled():
                context = recompute(self.core_attention, q, k, v, **attn_kw)
            else:
                context = self.core_attention(q, k, v, **attn_kw)
        # (output, bias) with return_bias
        out = self.proj(context, is_first_microbatch=is_first_microbatch, residual=residual)
        outputs = list(out) if self.return_bias else [out]
        if added_after is not None:
            outputs[0] = outputs[0] + added_after
        if self.return_layernorm_output and self.input_layernorm:
            outputs.append(ln_out)  # TE's order: output, bias, norm output
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def extra_repr(self):
        return (f"hidden_size={self.hidden_size}, heads={self.num_attention_heads}, "
                f"gqa_groups={self.num_gqa_groups}, head_dim={self.kv_channels}, "
                f"attention_type={self.attention_type}, qkv_format={self.qkv_format}, "
                f"interleaved={self.qkv_weight_interleaved}")

