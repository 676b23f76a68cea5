"""Linear: Transformer Engine's Linear layer over seqfuse.ops.gemm.

y = x W^T + b with the three GEMMs of a training step (forward, input
gradient, weight gradient) each one cuBLASLt call:

    forward  y  = x  @ W^T  (+ bias in the epilogue)
    dgrad    dx = dy @ W
    wgrad    dW = dy^T @ x  (+ the bias gradient in the epilogue, "bgrad", where
                            dy's rows are 16-byte multiples; else a column sum)

Precision: the forward runs in the dtype of torch.autocast when it is on,
else in the parameters' dtype; bf16 and fp32 parameters are both fine.
Under seqfuse's FP8 autocast (seqfuse.pytorch.autocast / fp8_autocast) the
three GEMMs run in FP8 under the active recipe, with operands made by the
module's GemmQuantizers (seqfuse.quantization.gemm_quantizers, shared with
LayerNormLinear and LayerNormMLP; the GEMM steps are modules/_fp8.py):

  DelayedScaling        input and output-gradient scales from the module's
                        ScalingState (index 0 input, 2 output gradient;
                        E5M2 gradients under Format.HYBRID); forward with
                        fast accumulation, gradients with split accumulation.
                        The weight is scaled by its own amax when it is
                        cast (once per weight update), which is recorded in
                        state index 1.
  Float8CurrentScaling  scales from each tensor's own amax.
  Float8BlockScaling    1x128 blocks for the input and the output gradient,
                        128x128 for the weight (cuBLASLt's block-scaled FP8);
                        in/out features must be multiples of 128.  Each
                        input / output gradient is read once by a kernel
                        that writes both its row-wise and its column-wise
                        (transposed) 1x128 copies.
  MXFP8 / NVFP4         raise NotImplementedError (their GEMMs need compute
                        capability 10.x).

Any number of tokens: the quantizers pad the rows of the FP8 operands to a
multiple of 16 with zeros and the outputs are cut back to the real rows.
Hopper's FP8 GEMMs take both operands K-major, so each FP8 operand comes
with a transposed copy: the input's in the forward (for the weight
gradient), the output gradient's in the backward, and the weight's once per
weight update.  ``is_first_microbatch=True`` re-casts the weight, ``False``
reuses the cast (TE's gradient-accumulation contract), ``None`` re-casts
only when the weight changed (its version counter moved) or the recipe
changed, and always while a CUDA graph is being captured (so replays
re-cast).

Weight-gradient accumulation (TE's fuse_wgrad_accumulation): where the
weight parameter carries a float32 ``main_grad`` buffer, dW is accumulated
into it by the GEMM itself (beta = 1), and the weight's own gradient is
left None (``weight.grad_added_to_main_grad`` is set, as Megatron expects).
With fuse_wgrad_accumulation=True, TE's overwrite rule: on a call with
is_first_microbatch=True, or for a weight whose ``overwrite_main_grad`` is
True, the GEMM writes dW over main_grad (beta = 0) instead of adding it.

Works under torch.distributed.fsdp.fully_shard (parameters are read at
forward time, whatever FSDP put there) and under CUDA graph capture (no host
synchronization, workspaces cached per stream).
"""
import torch

from .. import ops
from .. import quantization as _q
from ..quantization import gemm_quantizers as _gq
from . import _fp8 as F8
from ._base import (compute_dtype, init_weight, main_grad_for, same_dtype, set_linear_options,
                    weight_and_bias_grads, wgrad_overwrite)
from ._input import check_input, check_residual, gemm_rows
from ._split import fused_params, install_split, parse_split, reset_split, weight_sources
from .te_compat import materialize, refuse_fp8_io, rng_fork, take_refused

__all__ = ["Linear", "LinearFunction", "Fp8LinearFunction"]


def _default_device():
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


class LinearFunction(torch.autograd.Function):
    """Autograd of y = x W^T + b in one compute dtype (bf16, fp16 or fp32).

    forward(x [tokens, in], weight [out, in], bias [out] or None, dtype,
    residual [tokens, out] in dtype or None: added in the GEMM's epilogue,
    wgrad_overwrite: dW written into the weight's main_grad, not added;
    _base.wgrad_overwrite)
    """

    @staticmethod
    def forward(ctx, x, weight, bias, dtype, residual=None, wgrad_overwrite=False):
        xc = x if x.dtype == dtype else x.to(dtype)
        wc = _gq.high_precision(weight)  # (an FP8-gathered weight outside FP8 autocast)
        wc = wc if wc.dtype == dtype else wc.to(dtype)
        bc = None if bias is None else (bias if bias.dtype == dtype else bias.to(dtype))
        y = ops.gemm(xc, wc, transb=True, bias=bc, addend=residual)
        ctx.save_for_backward(xc, wc)
        ctx.weight = weight  # for main_grad (the parameter object, not saved data)
        ctx.wgrad_overwrite = wgrad_overwrite
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
        weight = ctx.weight
        dw, db = weight_and_bias_grads(dy, xc, need_dw, ctx.has_bias and need_db,
                                       main_grad_for(weight, need_dw, ctx.wgrad_overwrite))
        if db is not None:
            db = db.to(ctx.bias_dtype)
        if dw is not None and dw.dtype != weight.dtype:
            dw = dw.to(weight.dtype)
        return dx, dw, db, None, (dy if ctx.needs_input_grad[4] else None), None


class Linear(torch.nn.Module):
    """y = x W^T + b, TE's ``transformer_engine.pytorch.Linear``.

    in_features, out_features: sizes; bias: learn an additive bias;
    params_dtype: dtype of the parameters (default torch's default dtype);
    device: where to make them ("cuda" where available by default; "meta"
    defers initialization, e.g. for FSDP2 — call reset_parameters());
    init_method: callable(weight) that initializes the weight in place
    (default normal with std 0.023, TE's default); the bias starts at zero.
    return_bias: return (y, bias) and leave the bias add to the caller (TE;
    the bias in y's dtype, as TE casts it to the activation dtype).
    fuse_wgrad_accumulation: dW goes into ``weight.main_grad`` whenever the
    weight carries one (with it off too: seqfuse's own use); with it on, TE's
    overwrite rule holds: is_first_microbatch=True, or the weight's
    ``overwrite_main_grad`` set, writes dW there instead of adding it.
    parameters_split: TE's split of the weight's rows into several
    parameters (see seqfuse.modules._split); still one GEMM.
    save_original_input (TE's): under FP8 the backward keeps the input in
    its own precision, not its FP8 transposed copy, and makes that copy again
    for the weight gradient (the same bytes: under delayed scaling with the
    forward's scale, which TE refuses); less memory where the input is kept
    by another module anyway (seqfuse.hf's fused layers set it on the
    attention output's projection), more where it is not.  Without FP8 the
    input is what the backward keeps either way.
    get_rng_state_tracker, rng_tracker_name: the weight is drawn inside
    ``get_rng_state_tracker().fork(rng_tracker_name)`` (TE's model-parallel
    RNG tracker), else from torch's generator.  name: kept as ``self.name``
    (TE's debug name).  TE's parallelism and overlap arguments raise
    NotImplementedError unless off (seqfuse.modules.te_compat.REFUSED).
    """

    def __init__(self, in_features, out_features, *, bias=True, params_dtype=None, device=None,
                 init_method=None, return_bias=False, fuse_wgrad_accumulation=False, parameters_split=None,
                 get_rng_state_tracker=None, rng_tracker_name=None, name=None, save_original_input=False,
                 **te_refused):
        super().__init__()
        take_refused("Linear", te_refused)
        self.save_original_input = bool(save_original_input)
        self.get_rng_state_tracker, self.rng_tracker_name, self.name = (get_rng_state_tracker,
                                                                        rng_tracker_name, name)
        dtype = set_linear_options(self, "Linear", in_features, out_features, bias, return_bias,
                                   fuse_wgrad_accumulation, init_method, params_dtype)
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

    fp8_num_gemms = 1
    save_original_input = False  # (the constructor's argument; a module pickled before it existed reads this)

    def fp8_features(self):
        """(name, size) of the FP8 GEMMs' feature dimensions (checked per recipe)."""
        return (("in_features", self.in_features), ("out_features", self.out_features))

    def _init_weight(self, weight):
        init_weight(weight, self.init_method)

    @torch.no_grad()
    def reset_parameters(self):
        """(Re)initialise the parameters; on a module built with
        device="meta", first materialise them on the current CUDA device
        (the CPU without one), with the initialisation of direct
        construction."""
        materialize(self)
        with rng_fork(self.get_rng_state_tracker, self.rng_tracker_name):
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

    def forward(self, inp, is_first_microbatch=None, fp8_output=False, fp8_grad=False, residual=None):
        """y for inp [..., in_features].  is_first_microbatch (TE): under
        FP8, True re-quantizes the weight, False reuses the quantized weight
        of the previous call (gradient-accumulation micro-batches), None
        re-quantizes only when the weight changed.  fp8_output / fp8_grad
        (TE): refused when set.  residual (seqfuse's, what TE's operation
        fuser calls an extra input added after a linear): a tensor of the
        output's shape and dtype added to y in the GEMM's epilogue,
        ``y = x W^T + b + residual`` with no pass of its own; its gradient
        is y's."""
        refuse_fp8_io("Linear", fp8_output, fp8_grad)
        check_input("Linear", inp, self.in_features, "in_features")
        weight, bias = fused_params(self, "Linear")
        lead = inp.shape[:-1]
        x = gemm_rows(inp.reshape(-1, self.in_features))
        dtype = compute_dtype(inp, weight)
        use_bias = None if self.return_bias else bias
        if residual is not None:
            residual = check_residual("Linear", residual, (*lead, self.out_features), dtype, inp.device)
        recipe = _active_fp8_recipe()
        overwrite = wgrad_overwrite(self, weight, is_first_microbatch)
        if recipe is not None:
            q = _gq.quantizers_for(self, recipe, x.device)
            y = Fp8LinearFunction.apply(x, weight, use_bias, q, dtype,
                                        (is_first_microbatch, weight_sources(self), torch.is_grad_enabled()),
                                        residual, overwrite, self.save_original_input)
        else:
            y = LinearFunction.apply(x, weight, use_bias, dtype, residual, overwrite)
        if inp.dim() != 2:  # a 2-D input gets the Function's output itself, not a view of it
            y = y.view(*lead, self.out_features)
        if self.return_bias:
            return y, same_dtype(bias, y.dtype)  # (TE: cast to the activation dtype)
        return y



# ---- FP8 ---------------------------------------------------------------------

def _active_fp8_recipe():
    """The recipe of the enclosing FP8 autocast, or None outside one."""
    if not _q.is_fp8_enabled():
        return None
    return _q.get_recipe()


class Fp8LinearFunction(torch.autograd.Function):
    """Autograd of y = x W^T + b with FP8 GEMMs (see the module note; the
    operands come from the module's GemmQuantizers, the GEMM steps from
    seqfuse.modules._fp8).

    forward(x [tokens, in], weight, bias, quantizers, dtype,
    (is_first_microbatch, weight sources, grad), residual or None,
    wgrad_overwrite, save_original): dtype is the output
    (activation) dtype; the first two are WeightQuantizer.get's arguments,
    ``grad`` whether autograd was on at the call (inside forward it is
    always off): without it no backward follows and the weight's
    transposed FP8 copy is not made (gemm_quantizers.wants_weight_transpose);
    wgrad_overwrite as LinearFunction's; save_original: Linear's
    save_original_input (the backward keeps x and makes its FP8 transposed
    copy again: InputQuantizer.columnwise_again)."""

    @staticmethod
    def forward(ctx, x, weight, bias, q, dtype, weight_args, residual=None, wgrad_overwrite=False,
                save_original=False):
        need_w = ctx.needs_input_grad[1]  # False under no_grad: no transposed input copy
        ctx.save_original = save_original = save_original and need_w
        kind = q.kind
        first_mb, sources, grad = weight_args
        # (x, weight, bias: the residual's gradient needs no weight transpose)
        want_t = _gq.wants_weight_transpose(grad and any(ctx.needs_input_grad[:3]), q.weights[0])
        pair = q.weights[0].get(weight, first_mb, sources, transposed=want_t, release_rowwise=True)
        if save_original:  # (x and the scale of its cast kept; its transposed copy made again in the backward)
            xq, x_scale = q.inputs[0].quantize_source_kept(x.detach())
            x_col = (x, x_scale)
        else:
            xq = q.inputs[0].quantize(x.detach(), transpose=need_w, transient=True)  # (read by the GEMM alone)
            x_col = F8.saved(F8.columnwise(xq, kind)) if need_w else (None, None)
        y = F8.forward(xq, pair, kind, dtype, bias, x.shape[0], residual)
        w_data, w_si = F8.weight_kept(pair, kind, want_t)
        ctx.want_t = want_t
        ctx.save_for_backward(*x_col, w_data, w_si)
        ctx.q, ctx.kind, ctx.dtype, ctx.rows = q, kind, dtype, x.shape[0]
        ctx.weight, ctx.wgrad_overwrite = weight, wgrad_overwrite
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        x_t, x_si, w_t, w_si = ctx.saved_tensors
        kind = ctx.kind
        need_dx, need_dw, need_db = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        need_db = need_db and ctx.bias_dtype is not None
        dy = dy.contiguous()
        weight = ctx.weight
        main_grad = main_grad_for(weight, need_dw, ctx.wgrad_overwrite)
        dx = dw = db = None
        if need_dx or need_dw:
            g, db = ctx.q.grads[0].quantize_grad(dy, ctx.bias_dtype if need_db else None,
                                                 need_dgrad=need_dx, need_wgrad=need_dw, transient=True)
            w_dg = F8.weight_dgrad_kept(w_t, w_si, kind, ctx.want_t) if need_dx else None
            if ctx.save_original:  # x_t, x_si: x itself and its cast's scale (quantize_source_kept)
                x_col = F8.columnwise(ctx.q.inputs[0].columnwise_again(x_t, x_si), kind) if need_dw else None
            else:
                x_col = F8.restore(x_t, x_si, kind)
            dx, dw = F8.backward(g, x_col, w_dg,
                                 kind, ctx.dtype, ctx.rows, need_dx, need_dw, weight.dtype, main_grad)
        elif need_db:
            db = dy.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        return dx, dw, db, None, None, None, (dy if ctx.needs_input_grad[6] else None), None, None
