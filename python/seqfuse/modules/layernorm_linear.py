"""LayerNormLinear: normalization fused in front of a linear layer
(Transformer Engine's name, arguments and parameter names), and the pieces
LayerNormMLP shares with it.

    LayerNormLinear(in_features, out_features, eps=1e-5, bias=True,
                    normalization="LayerNorm", zero_centered_gamma=False,
                    return_layernorm_output=False, params_dtype=None, device=None,
                    init_method=None)

Parameters: ``layer_norm_weight``, ``layer_norm_bias`` (LayerNorm only),
``weight`` [out, in], ``bias`` [out].

Without FP8: seqfuse's norm kernel, then one GEMM (seqfuse.ops.gemm) with the
bias in its epilogue; the backward's weight GEMM also produces the bias
gradient (cuBLASLt's bgrad epilogue).  Parameters in another dtype than the
input (float32 master weights with bf16 activations) are cast for the GEMMs;
their gradients come back in the parameters' dtype.

Under ``seqfuse.quantization.autocast`` the GEMM runs in FP8 with operands
made by the module's GemmQuantizers (as Linear's; any token count, the
weight cast once per weight update): with DelayedScaling the norm kernel
writes its output directly in FP8 (scale and amax of the module's
ScalingState, index 0; its transposed copy for the weight gradient is a
byte transpose), the output gradient is cast and transposed (index 2,
E5M2 under Format.HYBRID) with the bias gradient summed in the same pass.
Float8CurrentScaling and Float8BlockScaling make the norm output in high
precision and cast it (block scaling: row-wise and column-wise 1x128 copies
in one pass; features multiples of 128).  MXFP8 and NVFP4 recipes raise
NotImplementedError (their GEMMs need compute capability 10.x).

Unsupported TE arguments (tensor/sequence parallelism, return_bias,
fuse_wgrad_accumulation, userbuffers) raise
NotImplementedError when set to anything but their default.
"""
import torch

from .. import ops
from .. import quantization as _q
from ..quantization import gemm_quantizers as _gq
from . import _fp8 as F8
from ._input import check_input
from ._split import fused_params, install_split, parse_split, reset_split, weight_sources
from .norm import _hidden, default_device

def _check_normalization(normalization):
    if normalization not in ("LayerNorm", "RMSNorm"):
        raise ValueError(f"argument 'normalization' must be 'LayerNorm' or 'RMSNorm', got {normalization!r}")


def _reject_unsupported(cls, kwargs, defaults):
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


# ---- pieces shared with LayerNormMLP -------------------------------------------

def norm_forward(x2, weight, bias, eps, rms, zc, out_dtype=None, scale=None, amax=None,
                 scale_inv=None):
    """(y, mean, rstd) of the module's normalization; mean is None for RMSNorm."""
    if rms:
        y, rstd = ops.rmsnorm_fwd(x2, weight, eps, zc, out_dtype, scale, amax, scale_inv)
        return y, None, rstd
    return ops.layernorm_fwd(x2, weight, bias, eps, zc, out_dtype, scale, amax, scale_inv)


def norm_backward(dy2, x2, mean, rstd, weight, rms, zc, has_bias):
    """(dx, dgamma, dbeta or None)."""
    if rms:
        dx, dg = ops.rmsnorm_bwd(dy2, x2, rstd, weight, zc)
        return dx, dg, None
    return ops.layernorm_bwd(dy2, x2, mean, rstd, weight, zc, has_bias)


def norm_param(p, x):
    """The norm kernels take weights in the input's dtype or float32."""
    if p is None or p.dtype == x.dtype or p.dtype == torch.float32:
        return p
    return p.float()


def as_dtype(t, dtype):
    return None if t is None else (t if t.dtype == dtype else t.to(dtype))


def fp8_quantizers(module, x):
    """The module's GemmQuantizers under the active FP8 autocast recipe, or
    None outside FP8 autocast (recipes it cannot run raise, naming it)."""
    if not _q.is_fp8_enabled():
        return None
    return _gq.quantizers_for(module, _q.get_recipe(), x.device)


def fp8_norm(q, x2, lnw, lnb, eps, rms, zc, need_col):
    """(quantized norm output, mean, rstd) as GEMM 0's input.  Delayed
    scaling: the norm kernel writes FP8 itself (scale and amax of the
    state); other recipes: the norm in x's dtype, then the recipe's cast."""
    iq = q.inputs[0]
    if q.kind == "delayed":
        scale, amax, fp8_dtype = iq.scale
        si = torch.empty(1, dtype=torch.float32, device=x2.device)
        y, mean, rstd = norm_forward(x2, lnw, lnb, eps, rms, zc, fp8_dtype, scale, amax, si)
        return iq.fp8_output(y, si, x2.dtype), mean, rstd
    y, mean, rstd = norm_forward(x2, lnw, lnb, eps, rms, zc)
    return iq.quantize(y, transpose=need_col), mean, rstd


def init_weight(w, init_method):
    if init_method is not None:
        init_method(w)
    else:
        torch.nn.init.normal_(w, mean=0.0, std=0.02)


class _LayerNormLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ln_w, ln_b, weight, bias, eps, rms, zc, ret_ln, q, sources):
        in_features = x.shape[-1]
        x2 = x.reshape(-1, in_features)
        lnw, lnb = norm_param(ln_w, x2), norm_param(ln_b, x2)
        ctx.fp8 = q is not None
        if ctx.fp8:
            kind, rows, need_w = q.kind, x2.shape[0], ctx.needs_input_grad[3]
            if ret_ln:  # the norm output is returned: make it in x's dtype, then cast
                ln_out, mean, rstd = norm_forward(x2, lnw, lnb, eps, rms, zc)
                lnq = q.inputs[0].quantize(ln_out, transpose=need_w)
            else:
                ln_out = None
                lnq, mean, rstd = fp8_norm(q, x2, lnw, lnb, eps, rms, zc, need_w)
            pair = q.weights[0].get(weight, sources=sources)
            out = F8.forward(lnq, pair, kind, x.dtype, as_dtype(bias, x.dtype), rows)
            ln_col = F8.saved(F8.columnwise(lnq, kind)) if need_w else (None, None)
            ctx.save_for_backward(x2, lnw, mean, rstd, *ln_col, *F8.saved(F8.weight_dgrad(pair, kind)))
            ctx.q, ctx.kind = q, kind
        else:
            ln_out, mean, rstd = norm_forward(x2, lnw, lnb, eps, rms, zc)
            w = as_dtype(weight, x.dtype)
            out = ops.gemm(ln_out, w, transb=True, bias=as_dtype(bias, x.dtype))
            ctx.save_for_backward(x2, lnw, mean, rstd, ln_out, w)
        ctx.meta = (x.shape, eps, rms, zc, ln_b is not None, bias is not None, weight.dtype,
                    None if bias is None else bias.dtype, ln_w.dtype)
        out = out.view(*x.shape[:-1], out.shape[-1])
        if ret_ln:
            return out, ln_out.view(x.shape)
        return out

    @staticmethod
    def backward(ctx, dout, dln_extra=None):
        x_shape, eps, rms, zc, has_ln_bias, has_bias, w_dtype, b_dtype, lnw_dtype = ctx.meta
        dout2 = dout.reshape(-1, dout.shape[-1]).contiguous()
        dbias = None
        if ctx.fp8:
            x2, lnw, mean, rstd, ln_t, ln_si, w_t, w_si = ctx.saved_tensors
            kind, need_dw = ctx.kind, ctx.needs_input_grad[3]
            g, dbias = ctx.q.grads[0].quantize_grad(dout2, b_dtype if has_bias else None,
                                                   need_wgrad=need_dw)
            dln, dweight = F8.backward(g, F8.restore(ln_t, ln_si, kind),
                                       F8.restore(w_t, w_si, kind, weight=True), kind, x2.dtype,
                                       x2.shape[0], True, need_dw, w_dtype)
        else:
            x2, lnw, mean, rstd, ln_out, w = ctx.saved_tensors
            dln = ops.gemm(dout2, w)
            if has_bias:
                dweight, dbias = ops.gemm(dout2, ln_out, transa=True, epilogue="bgrad")
                dbias = as_dtype(dbias, b_dtype)
            else:
                dweight = ops.gemm(dout2, ln_out, transa=True)
            dweight = as_dtype(dweight, w_dtype)
        if dln_extra is not None:
            dln = dln + dln_extra.reshape(dln.shape)
        dx, dg, db = norm_backward(dln, x2, mean, rstd, lnw, rms, zc, has_ln_bias)
        return (dx.view(x_shape), as_dtype(dg, lnw_dtype), as_dtype(db, lnw_dtype), dweight, dbias,
                None, None, None, None, None, None)


def _make_norm_params(module, size, normalization, kw):
    """The fused norm's parameters, named as TE names them: layer_norm_weight,
    and layer_norm_bias for LayerNorm (registered as None for RMSNorm)."""
    module.layer_norm_weight = torch.nn.Parameter(torch.empty(size, **kw))
    if normalization == "LayerNorm":
        module.layer_norm_bias = torch.nn.Parameter(torch.empty(size, **kw))
    else:
        module.register_parameter("layer_norm_bias", None)


def _reset_norm_params(module):
    """gamma = 1 (0 when zero-centered), beta = 0; call under no_grad."""
    module.layer_norm_weight.fill_(0.0 if module.zero_centered_gamma else 1.0)
    if module.layer_norm_bias is not None:
        module.layer_norm_bias.zero_()


class LayerNormLinear(torch.nn.Module):
    """Normalization + linear layer; see the module note."""

    def __init__(self, in_features, out_features, eps=1e-5, bias=True, normalization="LayerNorm",
                 zero_centered_gamma=False, return_layernorm_output=False, params_dtype=None,
                 device=None, init_method=None, parameters_split=None, **te_kwargs):
        super().__init__()
        _reject_unsupported("LayerNormLinear", te_kwargs, TE_DEFAULTS)
        _check_normalization(normalization)
        self.in_features = _hidden(in_features)
        self.out_features = int(out_features)
        self.eps = float(eps)
        self.normalization = normalization
        self.zero_centered_gamma = bool(zero_centered_gamma)
        self.return_layernorm_output = bool(return_layernorm_output)
        self.use_bias = bool(bias)
        dtype = params_dtype if params_dtype is not None else torch.get_default_dtype()
        device = default_device(device)
        kw = dict(dtype=dtype, device=device)
        _make_norm_params(self, self.in_features, normalization, kw)
        self.weight = torch.nn.Parameter(torch.empty(self.out_features, self.in_features, **kw))
        self.bias = torch.nn.Parameter(torch.empty(self.out_features, **kw)) if bias else None
        self.init_method = init_method
        split = parse_split("LayerNormLinear", parameters_split, self.out_features)
        if split:  # TE's split of the weight rows into parameters; still one GEMM
            install_split(self, split)
        self.reset_parameters()

    def reset_parameters(self):
        with torch.no_grad():
            _reset_norm_params(self)
            if getattr(self, "parameters_split", None):
                reset_split(self, lambda w: init_weight(w, self.init_method))
                return
            init_weight(self.weight, self.init_method)
            if self.bias is not None:
                self.bias.zero_()

    def forward(self, x):
        check_input("LayerNormLinear", x, self.in_features, "in_features")
        q = fp8_quantizers(self, x)
        weight, bias = fused_params(self, "LayerNormLinear")
        return _LayerNormLinearFn.apply(x, self.layer_norm_weight, self.layer_norm_bias, weight,
                                        bias, self.eps, self.normalization == "RMSNorm",
                                        self.zero_centered_gamma, self.return_layernorm_output, q,
                                        weight_sources(self) if q is not None else None)

    fp8_num_gemms = 1

    def fp8_features(self):
        """(name, size) of the FP8 GEMM's feature dimensions (checked per recipe)."""
        return (("in_features", self.in_features), ("out_features", self.out_features))

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"normalization={self.normalization}, bias={self.use_bias}")


__all__ = ["LayerNormLinear"]
