"""What the normalization-fused modules (LayerNormLinear, LayerNormMLP) and
the norm modules share: TE argument handling, parameter creation and
initialisation, the norm forward/backward over seqfuse.ops, and the FP8 norm
output.  A private helper of seqfuse.modules: its siblings import it; code
outside the package uses the modules."""
import logging
import numbers
from typing import NamedTuple

import torch

from .. import ops
from ..ops.args import as_float, as_int
from ..common.notes import note_once
from .. import quantization
from .._runtime import cuda_available
from ..quantization import gemm_quantizers
from .te_compat import take_refused


def _autocast_dtype(x):
    """torch.autocast's dtype where it is on for x's device type, else None."""
    dev = x.device.type
    if dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return None


def compute_dtype(x, weight):
    """The dtype a module's GEMMs run in: torch.autocast's where it is on for
    x's device type, else the weight's."""
    return _autocast_dtype(x) or weight.dtype


def autocast_input(x, *norm_params):
    """(x, *norm_params) as a normalization-fused module computes with them:
    under torch.autocast on x's device type, cast to the autocast dtype
    (Transformer Engine's activation dtype: its LayerNormLinear and
    LayerNormMLP cast the input, the norm weight and bias, then the GEMM
    weights, to it; the gradients flow back through the casts to the
    parameters' dtype), else unchanged.  None stays None."""
    dt = _autocast_dtype(x)
    if dt is None:
        return (x, *norm_params)
    return tuple(t if t is None or t.dtype == dt else t.to(dt) for t in (x, *norm_params))


def same_dtype(t, dtype):
    """``t`` in ``dtype`` (itself when it is already, None for None): a
    returned bias in the output's dtype, as TE's cast_if_needed."""
    return t if t is None or t.dtype == dtype else t.to(dtype)


def mark_main_grad(weight):
    """Megatron's flag that dW went into ``weight.main_grad`` (set where the
    weight carries the attribute)."""
    if hasattr(weight, "grad_added_to_main_grad"):
        weight.grad_added_to_main_grad = True


class MainGrad(NamedTuple):
    """Where a weight-gradient GEMM puts dW: the weight's float32
    ``main_grad`` ``tensor``, added to it (``accumulate``, beta = 1) or
    written over it (beta = 0: TE's overwrite rule, wgrad_overwrite)."""
    tensor: torch.Tensor
    accumulate: bool


def main_grad_for(weight, needed, overwrite=False):
    """A MainGrad for the weight's float32 ``main_grad`` where it has one
    and its gradient is needed (TE's fuse_wgrad_accumulation: the GEMM puts
    dW there, the weight's own gradient stays None; the flag is set), else
    None.  ``overwrite`` (wgrad_overwrite): the GEMM writes dW over it."""
    main_grad = getattr(weight, "main_grad", None) if needed else None
    if main_grad is None:
        return None
    mark_main_grad(weight)
    return MainGrad(main_grad, not overwrite)


def wgrad_overwrite(module, weight, is_first_microbatch):
    """Whether ``weight``'s gradient GEMM writes its ``main_grad`` rather than
    adding to it, by Transformer Engine's rule: with the module's
    fuse_wgrad_accumulation on, when is_first_microbatch is True (the first
    micro-batch of a step: nothing to add to) or the weight's
    ``overwrite_main_grad`` attribute is True (read at the forward, as TE
    reads it).  Without fuse_wgrad_accumulation a main_grad the weight
    carries is always added to (seqfuse's own use of it; TE leaves it alone
    then)."""
    if not module.fuse_wgrad_accumulation:
        return False
    return bool(is_first_microbatch) or bool(getattr(weight, "overwrite_main_grad", False))


def default_device(device):
    """TE places parameters on the GPU by default; so do we where one is
    usable by seqfuse, else on the CPU."""
    if device is not None:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() and cuda_available() else "cpu")


def set_linear_options(module, cls_name, in_features, out_features, bias, return_bias, fuse_wgrad_accumulation,
                       init_method, params_dtype):
    """The checks and attributes Linear and GroupedLinear share: positive
    ``in_features`` / ``out_features`` (ValueError naming ``cls_name``
    otherwise), then ``module``'s in_features, out_features, use_bias,
    return_bias, fuse_wgrad_accumulation and init_method.  Returns the
    parameters' dtype: ``params_dtype``, or torch's default dtype."""
    in_features = as_int(cls_name, "in_features", in_features)
    out_features = as_int(cls_name, "out_features", out_features)
    if in_features <= 0 or out_features <= 0:
        raise ValueError(f"{cls_name}: in_features and out_features must be positive, got "
                         f"{in_features} and {out_features}")
    module.in_features, module.out_features = in_features, out_features
    module.use_bias = bool(bias)
    module.return_bias = bool(return_bias)
    module.fuse_wgrad_accumulation = bool(fuse_wgrad_accumulation)
    module.init_method = init_method
    return params_dtype_of(cls_name, params_dtype)


def params_dtype_of(cls_name, params_dtype):
    """A module's parameter dtype: ``params_dtype``, a floating-point
    torch.dtype (TypeError naming it otherwise: integer parameters cannot
    hold gradients), or torch's default dtype for None."""
    if params_dtype is None:
        return torch.get_default_dtype()
    if not isinstance(params_dtype, torch.dtype) or not params_dtype.is_floating_point:
        raise TypeError(f"{cls_name}: argument 'params_dtype' must be a floating-point torch.dtype (float32, "
                        f"bfloat16, float16), got {params_dtype!r}")
    return params_dtype


def size_arg(cls_name, name, value, minimum=1):
    """A module's size argument (heads, head dim, features) as an int: a
    whole number (an integral float is fine; 16.9 is a ValueError, not 16),
    at least ``minimum``; TypeError / ValueError naming ``cls_name`` and the
    argument otherwise."""
    value = as_int(cls_name, name, value)
    if value < minimum:
        raise ValueError(f"{cls_name}: argument '{name}' must be >= {minimum}, got {value}")
    return value


def weight_and_bias_grads(dy, inp, want_dw, want_db, main_grad=None):
    """(dW = dy^T @ inp or None, the bias gradient = dy's column sums or
    None) of a high-precision GEMM module's backward; with ``main_grad`` (a
    MainGrad) dW goes there (and None is returned).  The bias gradient comes
    out of the weight GEMM's bgrad epilogue where that GEMM runs anyway and
    dy's rows are 16-byte multiples; otherwise it is a column sum of its own
    (float32 accumulation): for other widths (a 30,522-word MLM head)
    cuBLASLt's bgrad epilogue left the aligned kernels for a generic one, 6.9
    ms against the plain GEMM's 1.0 ms at 4,096 x 1,024 -> 30,522 on an H200."""
    fuse = want_db and want_dw and dy.shape[-1] * dy.element_size() % 16 == 0
    dw = db = None
    if want_dw:
        epilogue = "bgrad" if fuse else "none"
        if main_grad is not None:
            res = ops.gemm(dy, inp, transa=True, out=main_grad.tensor, accumulate=main_grad.accumulate,
                           epilogue=epilogue)
        else:
            res = ops.gemm(dy, inp, transa=True, epilogue=epilogue)
        if fuse:
            res, db = res
        dw = None if main_grad is not None else res
    if want_db and not fuse:
        db = dy.sum(0, dtype=torch.float32)
    return dw, db


def hidden_dim(hidden_size, cls_name="", name="hidden_size"):
    """The normalized size: a whole number, or a 1-element shape
    (normalization over the last dimension only); ``cls_name`` and ``name``
    name the module and its argument in errors (a fractional size is a
    ValueError, not truncated)."""
    op = cls_name or "normalization"
    if isinstance(hidden_size, (numbers.Number, str, bytes)):
        return as_int(op, name, hidden_size)
    try:
        shape = tuple(hidden_size)
    except TypeError:
        raise TypeError(f"{op}: argument '{name}' must be an int or a 1-element shape, got "
                        f"{type(hidden_size).__name__}") from None
    if len(shape) != 1:
        raise NotImplementedError(f"normalization over the last dimension only; got normalized shape {shape}")
    return as_int(op, name, shape[0])


def check_normalization(normalization):
    if normalization not in ("LayerNorm", "RMSNorm"):
        raise ValueError(f"argument 'normalization' must be 'LayerNorm' or 'RMSNorm', got {normalization!r}")


def reject_unsupported(cls, kwargs, defaults):
    for name, value in kwargs.items():
        if name not in defaults:
            raise TypeError(f"{cls}: unexpected argument {name!r}")
        if value != defaults[name]:
            raise NotImplementedError(f"{cls}: argument {name}={value!r} is not supported "
                                      f"(only {defaults[name]!r})")


#: TE arguments accepted for compatibility, with the only value supported.
TE_DEFAULTS = {"sequence_parallel": False, "fuse_wgrad_accumulation": False, "tp_group": None,
               "tp_size": 1, "get_rng_state_tracker": None, "return_bias": False,
               "parallel_mode": None, "return_layernorm_output_gathered": False,
               "ub_overlap_ag": False, "ub_overlap_rs": False,
               "ub_overlap_rs_dgrad": False, "ub_bulk_wgrad": False, "ub_bulk_dgrad": False,
               "ub_name": None, "name": None, "set_parallel_mode": False, "ub_overlap_ag_fprop": False,
               "ub_overlap_rs_fprop": False}


def norm_forward(x2, weight, bias, eps, rms, zc, out_dtype=None, scale=None, amax=None,
                 scale_inv=None, out=None):
    """(y, mean, rstd) of the module's normalization; mean is None for RMSNorm;
    y written into ``out`` where given."""
    if rms:
        y, rstd = ops.rmsnorm_forward(x2, weight, eps, zc, out_dtype, scale, amax, scale_inv, out=out)
        return y, None, rstd
    return ops.layernorm_forward(x2, weight, bias, eps, zc, out_dtype, scale, amax, scale_inv, out=out)


def norm_output(saved, x2, weight, bias, eps, rms, zc):
    """The norm output a high-precision backward reads for its weight
    gradient: ``saved`` where the forward kept it (it was returned, so it
    lived anyway), else made again from the saved input by the forward's own
    kernel (the same inputs: the same bits), which spares keeping a
    [tokens, hidden] tensor from the forward to the backward."""
    if saved is not None:
        return saved
    return norm_forward(x2, weight, bias, eps, rms, zc)[0]


def norm_backward(dy2, x2, mean, rstd, weight, rms, zc, has_bias, dres=None):
    """(dx, dgamma, dbeta or None); ``dres`` is added to dx in the same pass."""
    if rms:
        dx, dg = ops.rmsnorm_backward(dy2, x2, rstd, weight, zc, dres=dres)
        return dx, dg, None
    return ops.layernorm_backward(dy2, x2, mean, rstd, weight, zc, has_bias, dres=dres)


def norm_param(p, x):
    """The norm kernels take weights in the input's dtype or float32."""
    if p is None or p.dtype == x.dtype or p.dtype == torch.float32:
        return p
    return p.float()


def as_dtype(t, dtype):
    if t is not None and hasattr(type(t), "sf_fp8_pair"):  # an FP8-gathered weight off the FP8 path
        t = t.dequantized()
    return None if t is None else (t if t.dtype == dtype else t.to(dtype))


def fp8_quantizers(module, x):
    """The module's GemmQuantizers under the active FP8 autocast recipe, or
    None outside FP8 autocast (recipes it cannot run raise, naming it)."""
    if not quantization.is_fp8_enabled():
        return None
    return gemm_quantizers.quantizers_for(module, quantization.get_recipe(), x.device)


def fp8_norm(q, x2, lnw, lnb, eps, rms, zc, need_col):
    """(quantized norm output, mean, rstd) as GEMM 0's input.  Delayed
    scaling once the input has an amax history: the norm kernel writes FP8
    itself (scale and amax of the state); otherwise (other recipes, the
    first step) the norm in x's dtype, then the recipe's cast.  The
    row-wise FP8 copy is a transient buffer (InputQuantizer.input_place):
    the caller reads it only in its GEMM and in the transposed copy it
    keeps (F8.columnwise), both before it returns."""
    iq = q.inputs[0]
    if iq.fused_cast:
        scale, amax, fp8_dtype, si, buf, y = iq.fused_outputs(x2.shape[0], x2.shape[1], x2.device,
                                                              place=iq.input_place(x2))
        _, mean, rstd = norm_forward(x2, lnw, lnb, eps, rms, zc, fp8_dtype, scale, amax, si, out=y)
        return iq.fp8_output(buf, y.shape, si, x2.dtype), mean, rstd
    y, mean, rstd = norm_forward(x2, lnw, lnb, eps, rms, zc)
    return iq.quantize(y, transpose=need_col, transient=True), mean, rstd


#: Transformer Engine's default weight initialisation: N(0, 0.023) (its get_default_init_method)
DEFAULT_INIT_STD = 0.023


def init_weight(w, init_method):
    """Initialise weight ``w`` in place with the module's ``init_method``, else
    TE's default, N(0, DEFAULT_INIT_STD): every module's one rule."""
    if init_method is not None:
        init_method(w)
    else:
        w.normal_(0.0, DEFAULT_INIT_STD)


def take_norm_module_options(module, cls_name, te_refused, normalization, return_bias, fuse_wgrad_accumulation,
                             get_rng_state_tracker, name):
    """The first TE arguments LayerNormLinear and LayerNormMLP take alike, in
    this order: the catch-all ``te_refused`` (take_refused), then
    ``module``'s return_bias, fuse_wgrad_accumulation (main_grad is used
    wherever present, whatever it says), get_rng_state_tracker and name, then
    the ``normalization`` check."""
    take_refused(cls_name, te_refused)
    module.return_bias = bool(return_bias)
    module.fuse_wgrad_accumulation = bool(fuse_wgrad_accumulation)
    module.get_rng_state_tracker, module.name = get_rng_state_tracker, name
    check_normalization(normalization)


def make_norm_params(module, size, normalization, eps, zero_centered_gamma, params_dtype, device):
    """The fused norm's settings (``module``'s eps, normalization,
    zero_centered_gamma) and parameters, named as TE names them:
    layer_norm_weight, and layer_norm_bias for LayerNorm (registered as None
    for RMSNorm).  Returns the dtype and device keywords of the module's
    parameters: ``params_dtype`` (default: torch's) on ``device`` (default:
    ``default_device``)."""
    cls_name = type(module).__name__
    module.eps = as_float(cls_name, "eps", eps)
    module.normalization = normalization
    module.zero_centered_gamma = bool(zero_centered_gamma)
    dtype = params_dtype_of(cls_name, params_dtype)
    kw = dict(dtype=dtype, device=default_device(device))
    module.layer_norm_weight = torch.nn.Parameter(torch.empty(size, **kw))
    if normalization == "LayerNorm":
        module.layer_norm_bias = torch.nn.Parameter(torch.empty(size, **kw))
    else:
        module.register_parameter("layer_norm_bias", None)
    return kw


def reset_norm_params(module):
    """gamma = 1 (0 when zero-centered), beta = 0; call under no_grad."""
    module.layer_norm_weight.fill_(0.0 if module.zero_centered_gamma else 1.0)
    if module.layer_norm_bias is not None:
        module.layer_norm_bias.zero_()


_log = logging.getLogger("seqfuse")


def residual_fusable(who, residual, out_dtype, why_not=None):
    """Whether a residual branch ends in its last GEMM's epilogue (Linear's /
    LayerNormMLP's ``residual=``): not where ``why_not`` names a reason
    (hidden dropout in training, a post-LN layout, ...), nor where the
    residual's dtype is not the branch output's (float32 hidden states under
    a bfloat16 autocast).  Each reason is logged once per caller ``who``;
    the add then runs after the GEMM, as before."""
    if why_not is None and residual.dtype != out_dtype:
        why_not = f"the hidden states are {residual.dtype} and the branch computes in {out_dtype} (autocast)"
    if why_not is None:
        return True
    note_once(_log, "%s: residual adds run after the GEMMs, not in their epilogues: %s", who, why_not)
    return False
