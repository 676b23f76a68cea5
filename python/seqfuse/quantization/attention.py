"""FP8 attention under delayed scaling (Transformer Engine's ``fp8_dpa``):
the autograd function and the scales it feeds the kernel calls of
seqfuse/ops/attn/_fp8.py.

A call casts Q, K and V to FP8 (E4M3) with its ScalingState, runs the FP8
attention, and dequantizes the FP8 output; its backward casts dO (the
recipe's backward format, E5M2 under HYBRID), runs the FP8 backward and
dequantizes dQ, dK and dV.  The caller sees tensors in its own dtype, as
with the bf16 attention.  Every scale lives in the state, which sits in the
same GPU-resident pool as the GEMM modules' states, so the step's one
delayed-scaling update (quantization/autocast.py) covers it.

The state holds nine tensors (``ATTENTION_TENSORS``): the inputs Q, K, V;
the output O; and in the backward dO, dP (the probability gradient the
kernel casts), dQ, dK, dV.  Scales:

- Q, K, V, dO: cast by seqfuse (quantize_with_state): delayed scaling from
  their amax history, and the first step from their own amax.
- P (the probabilities): scale = fp8_max exactly, not a state tensor: P is
  exp(S - rowmax), in [0, 1] by construction, so that scale is the largest
  that never saturates.
- O, dP, dQ, dK, dV: cast inside cuDNN's kernels, which report each amax
  after the fact; their delayed scale comes from those amaxes.  Before a
  tensor has a history (the first step) its scale comes from an upper
  bound of its amax computed on the device from the inputs' amaxes, so the
  first step neither saturates nor needs a host sync:
    |O|  <= max|V|                      (each row of P sums to 1; x 1.125 for
                                         P's own rounding)
    |dS| = |P (dP - D)| softmax_scale <= 2 d max|dO| max|V| softmax_scale
                                        (dP = dO V^T; the "dP" tensor's scale
                                         casts dS, and its amax is max|dS|)
    |dQ| <= 2 d max|dO| max|V| softmax_scale max|K|   (rows of P sum to 1)
    |dK| <= s_q g |dS| max|Q|,  |dV| <= s_q g max|dO|  (columns of P sum to
                                         at most s_q; g query heads per key head)
  These are worst cases: on random data the dS and dQ bounds sit about 10
  binades above the true amax and dK / dV's up to log2(s_q) more.  FP8
  keeps its relative precision below the bound only while values stay in
  the format's normal range (E5M2 spans about 30 binades, E4M3 about 17),
  so under HYBRID the first backward loses a few per cent of dK/dV's
  smallest values, and an all-E4M3 format (Format.E4M3) loses more;
  from the second step on the scales come from the measured amaxes.
"""
import logging

import torch

from ..common.recipe import DelayedScaling
from ..ops import attn as attn_ops
from ..ops import quant as qops
from ..ops import device_checks
from . import recompute
from .quantize import delayed_scale, quantize_with_state
from .state import ScalingState

_log = logging.getLogger("seqfuse")

Q, K, V, O, DO, DP, DQ, DK, DV = range(9)
ATTENTION_TENSORS = ("q", "k", "v", "o", "do", "dp", "dq", "dk", "dv")
BACKWARD_INDICES = (DO, DP, DQ, DK, DV)

#: Masks the FP8 kernels take (top-left causal; bottom-right is the same
#: diagonal when s_q == s_kv).
MASKS = ("no_mask", "causal", "causal_bottom_right")


def attention_state(recipe, device=None):
    """A ScalingState for one attention's nine FP8 tensors."""
    return ScalingState(len(ATTENTION_TENSORS), recipe, backward_indices=BACKWARD_INDICES, device=device)


#: Head dim cuDNN's FP8 attention backward takes on Hopper (cuDNN 9.19), and
#: the head dims its forward is tested at (tests/test_fp8_attention_cuda.py)
CUDA_BACKWARD_HEAD_DIM = 128
CUDA_FORWARD_HEAD_DIMS = (32, 64, 128)
#: Sequence lengths cuDNN's FP8 backward is trusted at: multiples of this.
#: At 200 tokens (causal, H100 and H200, cuDNN 9.19) its dQ error against the
#: exact attention is 1.5x the reference route's (0.112-0.115 against 0.075);
#: at 256 and 384 tokens they agree to the third digit.
CUDA_BACKWARD_SEQ_MULTIPLE = 128


def refusal(recipe, q, k, qkv_format, attn_mask_type, window_size, dropout_p, padded, needs_grad):
    """Why this call cannot run as FP8 attention (a sentence), or None.
    ``padded``: the call has a padding attn_mask_type, an attention_mask or
    packed thd input; ``needs_grad``: the call will be differentiated."""
    if not isinstance(recipe, DelayedScaling):
        return (f"fp8_dpa needs DelayedScaling: cuDNN's FP8 attention on Hopper writes O and dQ/dK/dV in FP8, "
                f"which needs their scales before the kernel (the recipe is {type(recipe).__name__})")
    if qkv_format not in attn_ops.FP8_LAYOUTS:
        return f"FP8 attention takes qkv_format bshd or sbhd, not {qkv_format!r}"
    if padded:
        return ("FP8 attention takes no padding (a padding attn_mask_type, an attention_mask, cu_seqlens with "
                "padding, or packed thd)")
    if attn_mask_type not in MASKS:
        return f"FP8 attention takes no mask or a causal mask, not {attn_mask_type!r}"
    if attn_mask_type == "causal_bottom_right" and _seq(q, qkv_format) != _seq(k, qkv_format):
        return "FP8 attention's causal mask is top-left; causal_bottom_right needs s_q == s_kv"
    window = None if window_size is None else tuple(window_size)
    if window not in (None, (-1, -1)) and not (window == (-1, 0) and attn_mask_type != "no_mask"):
        return f"FP8 attention takes no sliding window, got window_size {window}"
    if dropout_p > 0.0:
        return f"FP8 attention has no attention dropout (dropout_p = {dropout_p}; eval mode or 0 runs FP8)"
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"FP8 attention takes float32, float16 or bfloat16 q/k/v, not {q.dtype}"
    d = q.shape[-1]
    if q.is_cuda and needs_grad and d != CUDA_BACKWARD_HEAD_DIM:
        return (f"cuDNN's FP8 attention backward takes head dim {CUDA_BACKWARD_HEAD_DIM} only, got {d} "
                f"(no-grad calls run FP8 at head dims {CUDA_FORWARD_HEAD_DIMS})")
    m = CUDA_BACKWARD_SEQ_MULTIPLE
    if q.is_cuda and needs_grad and (_seq(q, qkv_format) % m or _seq(k, qkv_format) % m):
        return (f"cuDNN's FP8 attention backward is used at sequence lengths that are multiples of {m} only "
                f"(at other lengths its dQ error is 1.5x the reference's), got s_q {_seq(q, qkv_format)}, "
                f"s_kv {_seq(k, qkv_format)}")
    if q.is_cuda and d not in CUDA_FORWARD_HEAD_DIMS:
        return f"FP8 attention on CUDA takes head dims {CUDA_FORWARD_HEAD_DIMS} (the ones tested), got {d}"
    if d % 16:
        return f"FP8 attention needs a head dim that is a multiple of 16, got {d}"
    return attn_ops.fp8_attention_unavailable(q.device)


def _fold(state, index, amax):
    """Fold a kernel's amax into tensor ``index``'s amax for this step."""
    slot = state.amax_of(index)
    torch.maximum(slot, amax, out=slot)


_P_SCALES = {}


def _p_scale(dtype, device):
    """(scale, descale) of the probabilities: fp8_max and its inverse, made
    at the first call on a device (not under CUDA graph capture, where the
    fill would only be recorded)."""
    key = (dtype, device)
    t = _P_SCALES.get(key)
    if t is None:
        if device_checks.capturing(device):
            raise RuntimeError("fp8_attention: the first FP8 attention call on a device cannot be made under CUDA "
                               "graph capture (its constants and cuDNN graphs are made then); run one call eagerly "
                               "first (make_graphed_callables' warm-up does)")
        m = qops.FP8_MAX[dtype]
        t = _P_SCALES[key] = (torch.full((1,), m, device=device), torch.full((1,), 1.0 / m, device=device))
    return t


def _seq(x, layout):
    return x.shape[1] if layout == "bshd" else x.shape[0]


class _FP8Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, state, layout, causal, softmax_scale, deterministic):
        state.ensure_pooled()
        dtype = q.dtype
        q8, k8, v8 = (quantize_with_state(x, state, i) for x, i in ((q, Q), (k, K), (v, V)))
        # this call's input amaxes (at least), copied while a tensor cuDNN casts has no history: the first
        # step's bounds, in the backward too, which runs after the step's update has cleared the amax row.
        # Kept on ctx, not saved: a checkpoint's recompute (whose amax slots are scratch, and whose ctx the
        # backward never sees) then saves the same tensors as its forward and computes nothing here
        amax_qkv = None
        if not recompute.replaying() and not all(state.has_history(i) for i in (O, DP, DQ, DK, DV)):
            amax_qkv = torch.cat([state.amax_of(Q), state.amax_of(K), state.amax_of(V)])
        ctx.amax_qkv = amax_qkv
        scale_o = delayed_scale(state, O, lambda: amax_qkv[2:3] * 1.125, q.device)
        descale_o = torch.reciprocal(scale_o)
        scale_s, descale_s = _p_scale(q8.data.dtype, q.device)
        o8 = torch.empty(q.shape, dtype=state.fp8_dtype(O), device=q.device)
        b, s_q, h_q = (q.shape[0], q.shape[1], q.shape[2]) if layout == "bshd" else (q.shape[1], q.shape[0],
                                                                                     q.shape[2])
        stats = torch.empty((b, h_q, s_q, 1), dtype=torch.float32, device=q.device)
        amax_s = torch.empty(1, device=q.device)
        amax_o = torch.empty(1, device=q.device)
        attn_ops.fp8_attention_forward(q8.data, k8.data, v8.data, q8.scale_inv, k8.scale_inv, v8.scale_inv, scale_s,
                                      descale_s, scale_o, o=o8, stats=stats, amax_s=amax_s, amax_o=amax_o,
                                      layout=layout, causal=causal, softmax_scale=softmax_scale)
        _fold(state, O, amax_o)
        out = qops.dequantize_fp8(o8, descale_o, dtype)
        ctx.save_for_backward(q8.data, k8.data, v8.data, q8.scale_inv, k8.scale_inv, v8.scale_inv, o8, descale_o,
                              stats)
        ctx.state, ctx.layout, ctx.causal = state, layout, causal
        ctx.softmax_scale, ctx.deterministic = softmax_scale, deterministic
        ctx.dtypes = (q.dtype, k.dtype, v.dtype)
        return out

    @staticmethod
    def backward(ctx, dout):
        q8, k8, v8, dq_s, dk_s, dv_s, o8, descale_o, stats = ctx.saved_tensors
        state, layout, amax_qkv = ctx.state, ctx.layout, ctx.amax_qkv  # (None once every tensor has a history:
        # has_history only grows, so the bounds below are then never asked for)
        state.ensure_pooled()
        do8 = quantize_with_state(dout.contiguous(), state, DO)
        d = q8.shape[-1]
        groups = q8.shape[2] // k8.shape[2]
        s_q = _seq(q8, layout)
        amax_do = state.amax_of(DO)

        def ds_bound():
            return 2.0 * d * ctx.softmax_scale * amax_do * amax_qkv[2:3]

        dev = q8.device
        scale_dp = delayed_scale(state, DP, ds_bound, dev)
        scale_dq = delayed_scale(state, DQ, lambda: ds_bound() * amax_qkv[1:2], dev)
        scale_dk = delayed_scale(state, DK, lambda: s_q * groups * ds_bound() * amax_qkv[0:1], dev)
        scale_dv = delayed_scale(state, DV, lambda: s_q * groups * amax_do, dev)
        # the live inverses go with the scales just read (both written by the same update or
        # first-step kernel); inside a checkpoint's recompute scale_of reads a copy, so invert that
        live = not recompute.open_contexts
        descale_dp, *descales = (state.scale_inv_of(i) if live else torch.reciprocal(sc)
                                 for i, sc in ((DP, scale_dp), (DQ, scale_dq), (DK, scale_dk), (DV, scale_dv)))
        scale_s, descale_s = _p_scale(q8.dtype, q8.device)
        gdt = state.fp8_dtype(DQ)
        dq8, dk8, dv8 = (torch.empty(x.shape, dtype=gdt, device=x.device) for x in (q8, k8, v8))
        amaxes = torch.empty(4, device=q8.device)  # dP, dQ, dK, dV: the state's order
        attn_ops.fp8_attention_backward(
            q8, k8, v8, o8, do8.data, stats, dq_s, dk_s, dv_s, descale_o, do8.scale_inv, descale_s, descale_dp,
            scale_s, scale_dp, scale_dq, scale_dk, scale_dv, dq=dq8, dk=dk8, dv=dv8, amax_dq=amaxes[1:2],
            amax_dk=amaxes[2:3], amax_dv=amaxes[3:4], amax_dp=amaxes[0:1], layout=layout, causal=ctx.causal,
            softmax_scale=ctx.softmax_scale, deterministic=ctx.deterministic)
        if live:  # one fold for the four (adjacent columns of the state's amax row)
            row = state.amax[DP:DV + 1]
            torch.maximum(row, amaxes, out=row)
        else:
            for index in (DP, DQ, DK, DV):
                _fold(state, index, amaxes[index - DP:index - DP + 1])
        grads = [qops.dequantize_fp8(x8, s, dt) for x8, s, dt in zip((dq8, dk8, dv8), descales, ctx.dtypes)]
        return (*grads, None, None, None, None, None)


def fp8_attention(q, k, v, state, *, qkv_format="bshd", attn_mask_type="no_mask", softmax_scale=None,
                  deterministic=False):
    """softmax(softmax_scale Q K^T + mask) V with Q, K, V, O and their
    gradients in FP8 under ``state`` (a ScalingState of nine tensors,
    :func:`attention_state`).  q, k, v: [b, s, h, d] ("bshd") or [s, b, h,
    d] ("sbhd"), float32 / float16 / bfloat16; k and v may have fewer heads
    (grouped-query).  ``attn_mask_type``: "no_mask" or "causal" (top-left).
    Returns the output in q's dtype and layout, [.., h, d]."""
    op = "fp8_attention"
    if not isinstance(state, ScalingState) or state.num_tensors != len(ATTENTION_TENSORS):
        raise TypeError(f"{op}: argument 'state' must be a ScalingState of {len(ATTENTION_TENSORS)} tensors "
                        f"(seqfuse.quantization.attention.attention_state), got {state!r}")
    if attn_mask_type not in MASKS:
        raise ValueError(f"{op}: argument 'attn_mask_type' must be one of {MASKS}, got {attn_mask_type!r}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f"{op}: argument '{name}' must be a 4-D tensor ({qkv_format}), got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"{op}: argument '{name}' must be float32, float16 or bfloat16, got {x.dtype}")
    if qkv_format not in attn_ops.FP8_LAYOUTS:
        raise ValueError(f"{op}: argument 'qkv_format' must be one of {attn_ops.FP8_LAYOUTS}, "
                         f"got {qkv_format!r}")
    if state.amax_history.device != q.device:
        raise ValueError(f"{op}: argument 'state' is on {state.amax_history.device}, q on {q.device} "
                         f"(make it with attention_state(recipe, device) or move it with .to())")
    causal = attn_mask_type != "no_mask"
    if attn_mask_type == "causal_bottom_right" and _seq(q, qkv_format) != _seq(k, qkv_format):
        raise ValueError(f"{op}: causal_bottom_right is taken only with s_q == s_kv (the kernels' diagonal "
                         f"is top-left), got s_q {_seq(q, qkv_format)}, s_kv {_seq(k, qkv_format)}")
    m = CUDA_BACKWARD_SEQ_MULTIPLE
    if (q.is_cuda and torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
            and (_seq(q, qkv_format) % m or _seq(k, qkv_format) % m)):
        raise ValueError(f"{op}: on CUDA a call that will be differentiated needs sequence lengths that are "
                         f"multiples of {m} (cuDNN's FP8 backward is less exact at others: see "
                         f"CUDA_BACKWARD_SEQ_MULTIPLE), got s_q {_seq(q, qkv_format)}, s_kv {_seq(k, qkv_format)}")
    scale = float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5
    return _FP8Attention.apply(q, k, v, state, qkv_format, causal, scale, bool(deterministic))
