"""Linear: Transformer Engine's Linear layer over seqfuse.ops.gemm.

y = x W^T + b with the three GEMMs of a training step (forward, input
gradient, weight gradient) each one cuBLASLt call:

    forward  y  = x  @ W^T  (+ bias in the epilogue)
    dgrad    dx = dy @ W
    wgrad    dW = dy^T @ x  (+ the bias gradient in the epilogue, "bgrad")

Precision: the forward runs in the dtype of torch.autocast when it is on,
else in the parameters' dtype; bf16 and fp32 parameters are both fine.
Under seqfuse's FP8 autocast (seqfuse.pytorch.autocast / fp8_autocast) the
three GEMMs run in FP8 under the active recipe:

  DelayedScaling        input and output-gradient scales from the module's
                        ScalingState (index 0 input, 2 output gradient;
                        E5M2 gradients under Format.HYBRID); forward with
                        fast accumulation, gradients with split accumulation.
                        The weight is scaled by its own amax when it is
                        quantized (once per weight update, see below), which
                        is recorded in state index 1.
  Float8CurrentScaling  scales from each tensor's own amax.
  Float8BlockScaling    1x128 blocks for the input and the output gradient,
                        128x128 for the weight (cuBLASLt's block-scaled FP8);
                        in/out features must be multiples of 128, the token
                        count of 16.  Each input / output gradient is read
                        once by a kernel that writes both its row-wise and
                        its column-wise (transposed) 1x128 copies; the code
                        is shared with LayerNormLinear / LayerNormMLP
                        (block_forward / block_backward below).
  MXFP8 / NVFP4         raise NotImplementedError (their GEMMs need compute
                        capability 10.x).

Hopper's FP8 GEMMs take both operands K-major, so each FP8 operand comes
with a transposed copy made by a fused cast-transpose kernel: the input's
in the forward (for the weight gradient), the output gradient's in the
backward, and the weight's once per weight update.  The quantized weight is
cached: ``is_first_microbatch=True`` re-quantizes, ``False`` reuses the
cache (TE's gradient-accumulation contract), ``None`` re-quantizes only when
the weight changed (its version counter moved) or the recipe changed, and
always while a CUDA graph is being captured (so replays re-quantize).

Weight-gradient accumulation (TE's fuse_wgrad_accumulation): where the
weight parameter carries a float32 ``main_grad`` buffer, dW is accumulated
into it by the GEMM itself (beta = 1), and the weight's own gradient is
left None (``weight.grad_added_to_main_grad`` is set, as Megatron expects).

Works under torch.distributed.fsdp.fully_shard (parameters are read at
forward time, whatever FSDP put there) and under CUDA graph capture (no host
synchronization, workspaces cached per stream).
"""
import logging

import torch

from .. import ops
from .. import quantization as _q
from ..ops import quant as _qops
from ._input import check_input
from ._split import fused_params, install_split, parse_split, reset_split

__all__ = ["Linear", "LinearFunction", "Fp8LinearFunction"]


def _default_device():
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _compute_dtype(x, weight):
    """The dtype the GEMMs run in: torch.autocast's where it is on for x's
    device type, else the weight's."""
    dev = x.device.type
    if dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return weight.dtype


#: TE arguments accepted with only their default value (parallelism, overlap).
_TE_DEFAULTS = {"sequence_parallel": False, "tp_group": None, "tp_size": 1, "parallel_mode": None,
                "ub_overlap_ag": False, "ub_overlap_rs": False,
                "ub_overlap_rs_dgrad": False, "ub_bulk_dgrad": False, "ub_bulk_wgrad": False,
                "ub_name": None, "symmetric_ar_type": None, "delay_wgrad_compute": False,
                "save_original_input": False}
#: TE arguments that change nothing here (names, RNG trackers for TP init).
_TE_IGNORED = ("name", "get_rng_state_tracker", "rng_tracker_name")


class LinearFunction(torch.autograd.Function):
    """Autograd of y = x W^T + b in one compute dtype (bf16, fp16 or fp32).

    forward(x [tokens, in], weight [out, in], bias [out] or None, dtype)
    """

    @staticmethod
    def forward(ctx, x, weight, bias, dtype):
        xc = x if x.dtype == dtype else x.to(dtype)
        wc = weight if weight.dtype == dtype else weight.to(dtype)
        bc = None if bias is None else (bias if bias.dtype == dtype else bias.to(dtype))
        y = ops.gemm(xc, wc, transb=True, bias=bc)
        ctx.save_for_backward(xc, wc)
        ctx.weight = weight  # for main_grad (the parameter object, not saved data)
        ctx.has_bias = bias is not None
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.dtype = dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        xc, wc = ctx.saved_tensors
        dtype = ctx.dtype
        dy = (dy if dy.dtype == dtype else dy.to(dtype)).contiguous()
        need_dx, need_dw, need_db = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        dx = ops.gemm(dy, wc) if need_dx else None
        dw = db = None
        if need_dw or (ctx.has_bias and need_db):
            weight = ctx.weight
            main_grad = getattr(weight, "main_grad", None) if need_dw else None
            epilogue = "bgrad" if (ctx.has_bias and need_db) else "none"
            if main_grad is not None:
                res = ops.gemm(dy, xc, transa=True, out=main_grad, accumulate=True, epilogue=epilogue)
                if hasattr(weight, "grad_added_to_main_grad"):
                    weight.grad_added_to_main_grad = True
            else:
                res = ops.gemm(dy, xc, transa=True, epilogue=epilogue)
            if epilogue == "bgrad":
                res, db = res
                db = db.to(ctx.bias_dtype)
            if need_dw and main_grad is None:
                dw = res if res.dtype == weight.dtype else res.to(weight.dtype)
        return dx, dw, db, None


class Linear(torch.nn.Module):
    """y = x W^T + b, TE's ``transformer_engine.pytorch.Linear``.

    in_features, out_features: sizes; bias: learn an additive bias;
    params_dtype: dtype of the parameters (default torch's default dtype);
    device: where to make them ("cuda" where available by default; "meta"
    defers initialization, e.g. for FSDP2 — call reset_parameters());
    init_method: callable(weight) that initializes the weight in place
    (default normal with std 0.023, TE's default); the bias starts at zero.
    return_bias: return (y, bias) and leave the bias add to the caller (TE).
    fuse_wgrad_accumulation: accepted for TE compatibility; accumulation into
    ``weight.main_grad`` happens whenever the weight carries one.
    parameters_split: TE's split of the weight's rows into several
    parameters (see seqfuse.modules._split); still one GEMM.
    """

    def __init__(self, in_features, out_features, bias=True, params_dtype=None, device=None,
                 init_method=None, return_bias=False, fuse_wgrad_accumulation=False, parameters_split=None,
                 **unsupported):
        super().__init__()
        for name, value in unsupported.items():
            if name in _TE_IGNORED:
                continue
            if name not in _TE_DEFAULTS:
                raise TypeError(f"Linear: unexpected argument {name!r}")
            if value != _TE_DEFAULTS[name]:
                raise NotImplementedError(f"Linear: argument '{name}'={value!r} is not supported "
                                          "(no tensor/sequence parallelism or comm overlap here)")
        if in_features <= 0 or out_features <= 0:
            raise ValueError(f"Linear: in_features and out_features must be positive, got "
                             f"{in_features} and {out_features}")
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.use_bias = bool(bias)
        self.return_bias = bool(return_bias)
        self.fuse_wgrad_accumulation = bool(fuse_wgrad_accumulation)
        self.init_method = init_method
        dtype = params_dtype or torch.get_default_dtype()
        device = torch.device(device) if device is not None else _default_device()
        self.weight = torch.nn.Parameter(torch.empty(self.out_features, self.in_features,
                                                     dtype=dtype, device=device))
        if self.use_bias:
            self.bias = torch.nn.Parameter(torch.empty(self.out_features, dtype=dtype, device=device))
        else:
            self.register_parameter("bias", None)
        split = parse_split("Linear", parameters_split, self.out_features)
        if split:
            install_split(self, split)
        if device.type != "meta":
            self.reset_parameters()

    def _init_weight(self, weight):
        if self.init_method is not None:
            self.init_method(weight)
        else:
            weight.normal_(0.0, 0.023)

    @torch.no_grad()
    def reset_parameters(self):
        if getattr(self, "parameters_split", None):
            reset_split(self, self._init_weight)
            return
        self._init_weight(self.weight)
        if self.bias is not None:
            self.bias.zero_()

    def extra_repr(self):
        split = getattr(self, "parameters_split", None)
        dtype = next(self.parameters()).dtype
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.use_bias}, params_dtype={dtype}"
                + (f", parameters_split={[name for name, _ in split]}" if split else ""))

    def forward(self, inp, is_first_microbatch=None):
        """y for inp [..., in_features].  is_first_microbatch (TE): under
        FP8, True re-quantizes the weight, False reuses the quantized weight
        of the previous call (gradient-accumulation micro-batches), None
        re-quantizes only when the weight changed."""
        check_input("Linear", inp, self.in_features, "in_features")
        weight, bias = fused_params(self, "Linear")
        lead = inp.shape[:-1]
        x = inp.reshape(-1, self.in_features)
        dtype = _compute_dtype(inp, weight)
        use_bias = None if self.return_bias else bias
        recipe = _active_fp8_recipe()
        if recipe is not None:
            kind = _recipe_kind(recipe)
            _check_fp8_shapes(kind, x.shape[0], self.in_features, self.out_features)
            y = Fp8LinearFunction.apply(x, weight, use_bias, self, recipe, kind, dtype,
                                        is_first_microbatch)
        else:
            y = LinearFunction.apply(x, weight, use_bias, dtype)
        if inp.dim() != 2:  # a 2-D input gets the Function's output itself, not a view of it
            y = y.view(*lead, self.out_features)
        if self.return_bias:
            return y, bias
        return y



# ---- FP8 ---------------------------------------------------------------------

_KINDS = {"DelayedScaling": "delayed", "Float8CurrentScaling": "current",
          "Float8BlockScaling": "block"}


def _active_fp8_recipe():
    """The recipe of the enclosing FP8 autocast, or None outside one."""
    if not _q.is_fp8_enabled():
        return None
    return _q.get_recipe()


def _recipe_kind(recipe):
    name = type(recipe).__name__
    kind = _KINDS.get(name)
    if kind is None:
        raise NotImplementedError(
            f"Linear: FP8 recipe {name} is not supported: its GEMMs need compute capability 10.x "
            f"(Blackwell) in cuBLASLt; on Hopper use DelayedScaling, Float8CurrentScaling or "
            f"Float8BlockScaling")
    if kind == "block" and (recipe.x_block_scaling_dim, recipe.w_block_scaling_dim,
                            recipe.grad_block_scaling_dim) != (1, 2, 1):
        raise NotImplementedError(
            "Linear: Float8BlockScaling is supported with x_block_scaling_dim=1, "
            "w_block_scaling_dim=2, grad_block_scaling_dim=1 (cuBLASLt takes no 128x128 x 128x128 "
            "product)")
    return kind


def _check_fp8_shapes(kind, tokens, in_f, out_f, cls="Linear"):
    """FP8 GEMMs take m, n, k multiples of 16; block scaling also needs the
    features to be whole 128-wide blocks (the token count stays a multiple of
    16: the column-wise copies are zero-padded to 128 tokens)."""
    block = kind == "block"
    what = "block-scaled FP8 (1x128 / 128x128 blocks)" if block else "FP8 GEMMs"
    for name, v, mult in (("the number of tokens (input rows)", tokens, 16),
                          ("in_features", in_f, 128 if block else 16),
                          ("out_features", out_f, 128 if block else 16)):
        if v % mult:
            raise ValueError(f"{cls}: {what} need {name} to be a multiple of {mult}, got {v} "
                             f"(pad the batch, e.g. with seqfuse.data's collators, or run this layer "
                             f"outside FP8 autocast)")


def _fp8_bias(bias, out_dtype):
    """cuBLASLt's FP8 kernels take the bias in bfloat16 (float16 for a float16 output)."""
    if bias is None:
        return None
    want = torch.float16 if out_dtype == torch.float16 else torch.bfloat16
    return bias if bias.dtype == want else bias.to(want)


def scaling_state(module, attr, num_tensors, backward_indices, recipe, device):
    """``module.<attr>``, its ScalingState (3 tensors per GEMM: input, weight,
    output gradient; ``backward_indices`` name the gradients), made at the
    first delayed-scaling forward and kept in step with the autocast recipe.
    Shared by Linear, LayerNormLinear and LayerNormMLP; per forward, so the
    recipe is compared by identity before by value."""
    state = getattr(module, attr, None)
    if state is None:
        state = _q.ScalingState(num_tensors, recipe, backward_indices=backward_indices, device=device)
        module.add_module(attr, state)
    elif state.recipe is not recipe and state.recipe != recipe:
        state.set_recipe(recipe)
    state.ensure_pooled()
    return state


def _scaling_state(module, recipe, device):
    """Linear's state: input, weight, output gradient."""
    return scaling_state(module, "fp8_state", 3, (_q.GRAD_OUTPUT,), recipe, device)


def _quantize_weight(module, weight, recipe, kind, state, is_first_microbatch, slot="weight"):
    """The weight in FP8 with its transposed copy, cached across calls (see the
    module note for when it is re-made).  Returns (forward operand, dgrad
    operand): Float8Tensors (data / data_t) or, for block scaling, two
    Float8BlockTensors (W and W^T, both 128x128).  ``slot`` names the cache
    entry, for modules with several weights (LayerNormMLP: "fc1", "fc2")."""
    w = weight.detach()
    fmt = getattr(recipe, "fp8_format", None)
    key = (kind, fmt, w.data_ptr(), w._version, tuple(w.shape), w.dtype)
    caches = module.__dict__.setdefault("_fp8_weight_cache", {})
    cache = caches.get(slot)
    capturing = w.is_cuda and torch.cuda.is_current_stream_capturing()
    if cache is not None and cache[0][0] == kind and cache[0][1] == fmt:
        if is_first_microbatch is False or (is_first_microbatch is None and not capturing
                                            and cache[0] == key and cache[1] is weight):
            return cache[2]
    if kind in ("delayed", "current"):
        # The weight's scale comes from its own amax, taken when it is quantized
        # (once per weight update): a cached copy is never stuck with a stale
        # delayed scale (e.g. a frozen weight first quantized at scale 1).  Under
        # delayed scaling the amax also lands in the state's weight slot.
        q = _q.quantize_current(w, recipe.fp8_format.fwd_dtype, margin=int(getattr(recipe, "margin", 0)),
                                transpose=True,
                                amax=state.amax_of(_q.WEIGHT) if state is not None else None)
        pair = (q, q)
    else:
        q = _q.quantize_block(w, 128, recipe.fp8_format.fwd_dtype)
        pair = (q, block_weight_transposed(q))
    caches[slot] = (key, weight, pair)
    module._fp8_weight_quantizations = getattr(module, "_fp8_weight_quantizations", 0) + 1
    return pair


def _quantize_act(x, kind, recipe, state, index, transpose, backward, dbias=False):
    """An activation (index 0) or output gradient (index 2) for the per-tensor
    recipes: a Float8Tensor with data [M, K] and, if asked, data_t [K, M]
    (``dbias``: and x's column sums, as ``(Float8Tensor, dbias)``)."""
    if kind == "delayed":
        return _q.quantize_with_state(x, state, index, transpose=transpose, dbias=dbias)
    fmt = recipe.fp8_format
    return _q.quantize_current(x, fmt.bwd_dtype if backward else fmt.fwd_dtype,
                               margin=int(getattr(recipe, "margin", 0)), transpose=transpose,
                               dbias=dbias)


_log = logging.getLogger("seqfuse")
_dbias_fallback_logged = []


def quantize_grad(quantize, dy, bias_dtype):
    """An output gradient's FP8 cast with its transposed copy, and the bias
    gradient (dy's column sums in float32, cast to ``bias_dtype``; None when
    ``bias_dtype`` is None).  ``quantize(dy, dbias)`` is the recipe's cast
    (transpose on).  The sums come out of the cast's own read of dy where its
    kernel takes dy (``ops.quant.dbias_fusable``); otherwise a second pass
    over dy makes them, logged once."""
    if bias_dtype is None:
        return quantize(dy, False), None
    if _qops.dbias_fusable(dy):
        g, db = quantize(dy, True)
    else:
        if not _dbias_fallback_logged:
            _dbias_fallback_logged.append(True)
            _log.warning("seqfuse FP8: a bias gradient is summed in a separate pass over the output gradient "
                      "(shape %s, contiguous %s, 16-byte aligned %s: the fused cast takes [M, K] with "
                      "K %% 8 == 0, M %% 16 == 0, contiguous and aligned)", tuple(dy.shape),
                      dy.is_contiguous(), dy.data_ptr() % 16 == 0)
        g, db = quantize(dy, False), dy.sum(0, dtype=torch.float32)
    return g, db.to(bias_dtype)


class Fp8LinearFunction(torch.autograd.Function):
    """Autograd of y = x W^T + b with FP8 GEMMs (see the module note).

    forward(x [tokens, in], weight, bias, module, recipe, kind, dtype,
    is_first_microbatch): dtype is the output (activation) dtype."""

    @staticmethod
    def forward(ctx, x, weight, bias, module, recipe, kind, dtype, is_first_microbatch):
        need_w = ctx.needs_input_grad[1]  # False under no_grad: no transposed input copy
        state = _scaling_state(module, recipe, x.device) if kind == "delayed" else None
        w_fwd, w_bwd = _quantize_weight(module, weight, recipe, kind, state, is_first_microbatch)
        xin = x.detach()
        if kind == "block":
            y, x_t = block_forward(xin, w_fwd, recipe, dtype, bias, need_w)
            ctx.save_for_backward(*x_t, w_bwd.data, w_bwd.scale_inv)
        else:
            xq = _quantize_act(xin, kind, recipe, state, _q.INPUT, need_w, False)
            y = ops.gemm(xq.data, w_fwd.data, transb=True, a_scale_inv=xq.scale_inv,
                         b_scale_inv=w_fwd.scale_inv, out_dtype=dtype, bias=_fp8_bias(bias, dtype),
                         fast_accum=True)
            ctx.save_for_backward(xq.data_t, xq.scale_inv, w_bwd.data_t, w_bwd.scale_inv)
        ctx.kind, ctx.recipe, ctx.state, ctx.dtype = kind, recipe, state, dtype
        ctx.weight = weight
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        x_t, x_si, w_t, w_si = ctx.saved_tensors
        kind, recipe, state, dtype = ctx.kind, ctx.recipe, ctx.state, ctx.dtype
        need_dx, need_dw, need_db = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        dy = dy.contiguous()
        weight = ctx.weight
        main_grad = getattr(weight, "main_grad", None) if need_dw else None
        dx = dw = db = None
        if kind == "block":
            dx, dw, db = block_backward(dy, (x_t, x_si), (w_t, w_si), recipe, dtype, need_dx,
                                        need_dw, weight.dtype, main_grad,
                                        need_dbias=need_db and ctx.bias_dtype is not None)
        else:
            if need_dw:  # the transposed copy's pass also sums the bias gradient
                g, db = quantize_grad(
                    lambda t, dbias: _quantize_act(t, kind, recipe, state, _q.GRAD_OUTPUT, True, True, dbias),
                    dy, ctx.bias_dtype if need_db else None)
            else:
                g = _quantize_act(dy, kind, recipe, state, _q.GRAD_OUTPUT, False, True)
            if need_dx:
                dx = ops.gemm(g.data, w_t, transb=True, a_scale_inv=g.scale_inv, b_scale_inv=w_si,
                              out_dtype=dtype)
            if need_dw:
                kw = dict(transb=True, a_scale_inv=g.scale_inv, b_scale_inv=x_si)
                if main_grad is not None:
                    ops.gemm(g.data_t, x_t, out=main_grad, accumulate=True, **kw)
                else:
                    dw = ops.gemm(g.data_t, x_t, out_dtype=weight.dtype, **kw)
        if main_grad is not None and hasattr(weight, "grad_added_to_main_grad"):
            weight.grad_added_to_main_grad = True
        if need_db and ctx.bias_dtype is not None:
            if db is None:
                db = dy.sum(0, dtype=torch.float32)  # no float32 copy of dy
            if db.dtype != ctx.bias_dtype:  # (quantize_grad's is cast already)
                db = db.to(ctx.bias_dtype)
        return dx, dw, db, None, None, None, None, None


# ---- block-scaled FP8, shared with LayerNormLinear and LayerNormMLP -----------
#
# One GEMM's worth of Float8BlockScaling (1x128 activations and gradients,
# 128x128 weights).  Each high-precision tensor is read once by
# quantize_block_fp8_rowcol, which writes the row-wise copy (1x128 along K,
# the forward / dgrad operand) and the column-wise copy (the transpose in
# 1x128 blocks along the tokens, the wgrad operand) with their scales already
# in cuBLASLt's layout: nothing is transposed or re-laid-out per call.  In the
# backward the same pass also sums dy's columns per 128-row block, so the
# bias gradient needs no further read of dy.  The
# column-wise copy is zero-padded to a multiple of 128 tokens, so the token
# count only has to be a multiple of 16 (the FP8 GEMMs' rule).

def block_weight_transposed(q):
    """W^T in 128x128 blocks from W's: the blocks are the same sets of values,
    so the bytes are W's transposed and the scales W's scale matrix
    transposed (re-padded to 4 blocks per row) -- bit for bit what quantizing
    W.t() gives, for a byte transpose instead of a 16-bit transpose and a
    second quantization.  Made once per weight update."""
    out_f, in_f = q.data.shape
    data_t = q.data.view(torch.uint8).t().contiguous().view(q.data.dtype)
    rb, cb = out_f // 128, in_f // 128
    si_t = q.scale_inv.new_zeros((cb, (rb + 3) // 4 * 4))
    si_t[:, :rb] = q.scale_inv[:rb, :cb].t()
    return _q.Float8BlockTensor(data_t, si_t, 128, dtype=q.dtype)


def block_forward(x, w_fwd, recipe, out_dtype, bias, need_wgrad):
    """y = x W^T (+ bias) with x [M, K] in high precision and w_fwd W's
    128x128 Float8BlockTensor.  Returns (y, (x_t, x_t_scale_inv)): x's
    column-wise copy for the weight gradient, (None, None) when not needed."""
    xq = _q.quantize_block(x, 1, recipe.fp8_format.fwd_dtype, columnwise=need_wgrad)
    y = ops.gemm(xq.data, w_fwd.data, transb=True, a_scale_inv=xq.scale_inv,
                 b_scale_inv=w_fwd.scale_inv, a_scaling="block_1x128", b_scaling="block_128x128",
                 out_dtype=out_dtype, bias=_fp8_bias(bias, out_dtype))
    return y, (xq.data_t, xq.scale_inv_t)


def block_backward(dy, x_t, w_bwd, recipe, out_dtype, need_dx, need_dw, wgrad_dtype,
                   main_grad=None, need_dbias=False):
    """(dx, dW, dbias) from dy [M, N] (high precision), x_t = (x's
    column-wise data, scales) from block_forward and w_bwd = (W^T data,
    scales) in 128x128 blocks.  dx is [M, K] in out_dtype; dW is [N, K] in
    wgrad_dtype, or accumulated into main_grad (then returned as None);
    dbias (need_dbias) is dy's float32 column sum, taken from the
    quantization pass's per-block column sums when the weight gradient makes
    that pass read dy anyway."""
    dx = dw = db = None
    fmt = recipe.fp8_format.bwd_dtype
    if need_dw:
        g, g_si, g_t, g_t_si, *sums = ops.quantize_block_fp8_rowcol(
            dy, fmt, rowwise=need_dx, col_sums=need_dbias)
        if need_dbias:
            db = sums[0].sum(0)
    elif need_dx:
        g, g_si = ops.quantize_block_fp8(dy, 1, fmt)
    if need_dbias and db is None:
        db = dy.sum(0, dtype=torch.float32)
    if need_dx:
        dx = ops.gemm(g, w_bwd[0], transb=True, a_scale_inv=g_si, b_scale_inv=w_bwd[1],
                      a_scaling="block_1x128", b_scaling="block_128x128", out_dtype=out_dtype)
    if need_dw:
        kw = dict(transb=True, a_scale_inv=g_t_si, b_scale_inv=x_t[1],
                  a_scaling="block_1x128", b_scaling="block_1x128")
        if main_grad is not None:
            ops.gemm(g_t, x_t[0], out=main_grad, accumulate=True, **kw)
        else:
            dw = ops.gemm(g_t, x_t[0], out_dtype=wgrad_dtype, **kw)
    return dx, dw, db
