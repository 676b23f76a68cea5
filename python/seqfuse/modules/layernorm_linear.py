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

Under ``seqfuse.quantization.autocast`` with a DelayedScaling recipe, the
norm kernel writes its output directly in FP8 (scale and amax of the
module's ScalingState, index 0), the weight is cast and transposed once per
forward (index 1), the output gradient is cast and transposed (index 2, E5M2
under Format.HYBRID), and all three GEMMs run in FP8 (forward with fast
accumulation).  The wgrad GEMM needs the FP8 norm output transposed: that is
a byte transpose done by torch in the backward.  The bias gradient is a
float32 column sum by torch.  Float8CurrentScaling: the same GEMMs, each
operand scaled from its own amax just before its cast (the norm output is
made in high precision, then cast and transposed).  Float8BlockScaling:
Linear's block path (seqfuse.modules.linear.block_forward / block_backward):
the norm output is made in high precision and read once by the kernel that
writes its row-wise (forward) and column-wise (weight gradient) 1x128 FP8
copies; the weight in 128x128 blocks is cached until it changes (as
Linear's); the output gradient gets the same two-copy cast.  Features must
be multiples of 128 and tokens of 16.  MXFP8 and NVFP4 recipes raise
NotImplementedError (their GEMMs need compute capability 10.x).

Unsupported TE arguments (tensor/sequence parallelism, return_bias,
fuse_wgrad_accumulation, userbuffers) raise
NotImplementedError when set to anything but their default.
"""
import torch

from .. import ops
from .. import quantization as _q
from ..ops import act as A
from .linear import (_check_fp8_shapes, _quantize_weight, _recipe_kind, block_backward, block_forward,
                     quantize_grad, scaling_state)
from ._input import check_input
from ._split import fused_params, install_split, parse_split, reset_split
from .norm import _hidden, default_device

_SUPPORTED_RECIPES = ("DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling")


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


def active_fp8_recipe(cls):
    """The autocast recipe when FP8 is on, else None; recipes this module
    cannot run raise NotImplementedError."""
    if not _q.is_fp8_enabled():
        return None
    recipe = _q.get_recipe()
    if type(recipe).__name__ not in _SUPPORTED_RECIPES:
        raise NotImplementedError(f"{cls}: FP8 recipe {type(recipe).__name__} is not supported yet "
                                  f"(supported: {', '.join(_SUPPORTED_RECIPES)})")
    if is_block(recipe):
        _recipe_kind(recipe)  # Linear's rule on the block dimensions
    return recipe


def is_block(recipe):
    return recipe is not None and type(recipe).__name__ == "Float8BlockScaling"


def check_block_shapes(cls, tokens, *features):
    """Block scaling's shape rules (Linear's): features in whole 128-wide
    blocks, tokens a multiple of 16.  features: (in, out) per GEMM."""
    for in_f, out_f in features:
        _check_fp8_shapes("block", tokens, in_f, out_f, cls)


def fp8_norm(x2, ln_w, ln_b, eps, rms, zc, state, index):
    """Norm with FP8 output under tensor `index` of `state`:
    (y_fp8, mean, rstd, scale_inv)."""
    scale_inv = torch.empty(1, dtype=torch.float32, device=x2.device)
    y, mean, rstd = norm_forward(x2, ln_w, ln_b, eps, rms, zc, state.fp8_dtype(index),
                                 state.scale_of(index), state.amax_of(index), scale_inv)
    return y, mean, rstd, scale_inv


class Quantizers:
    """The FP8 casts of one module's tensors for one forward/backward under
    a per-tensor recipe.  Index convention: 3 per GEMM (input, weight, output
    gradient); ``backward_indices`` name the gradients.

    DelayedScaling: the module's ScalingState gives scale, amax slot and
    format; the norm and activation kernels write FP8 directly (their
    transposed copies are made in the backward).  Weights (index 3g + 1) are
    scaled from their own amax at the cast, which also goes to their slot.  Float8CurrentScaling: the
    scale comes from the tensor's own amax just before the cast, so the norm
    and activation outputs are made in high precision and cast+transposed.
    """

    def __init__(self, module, num_tensors, backward_indices, recipe, device):
        self.recipe = recipe
        self.delayed = recipe.delayed()
        self.backward = frozenset(backward_indices)
        self.state = (scaling_state(module, "fp8_state", num_tensors, backward_indices, recipe, device)
                      if self.delayed else None)

    def dtype(self, index):
        if self.delayed:
            return self.state.fp8_dtype(index)
        fmt = self.recipe.fp8_format
        return fmt.bwd_dtype if index in self.backward else fmt.fwd_dtype

    def quantize(self, x, index, transpose=True, dbias=False):
        """x -> Float8Tensor (with the transposed copy when asked; ``dbias``:
        and x's float32 column sums, as ``(Float8Tensor, dbias)``, for
        gradients)."""
        if self.delayed and index % 3 == 1:
            # weights: scaled from their own amax when cast (as seqfuse's
            # Linear does), so a first step or a frozen weight never runs on a
            # stale scale; the amax still lands in the state's weight slot
            return _q.quantize_current(x, self.dtype(index), margin=int(self.recipe.margin),
                                       transpose=transpose, amax=self.state.amax_of(index))
        if self.delayed:
            return _q.quantize_with_state(x, self.state, index, transpose=transpose, dbias=dbias)
        return _q.quantize_current(x, self.dtype(index), margin=int(self.recipe.margin), transpose=transpose,
                                   amax_reduction_group=_q.get_amax_reduction_group(), dbias=dbias)

    def grad(self, dy, index, bias_dtype):
        """(Float8Tensor of the output gradient with its transposed copy, its
        bias gradient in ``bias_dtype`` or None), the sums from the same pass
        where the kernel takes dy (see linear.quantize_grad)."""
        return quantize_grad(lambda t, dbias: self.quantize(t, index, True, dbias), dy, bias_dtype)

    def norm(self, x2, lnw, lnb, eps, rms, zc, index):
        """(data, data_t or None, scale_inv, mean, rstd) of the FP8 norm output."""
        if self.delayed:
            y, mean, rstd, si = fp8_norm(x2, lnw, lnb, eps, rms, zc, self.state, index)
            return y, None, si, mean, rstd
        y, mean, rstd = norm_forward(x2, lnw, lnb, eps, rms, zc)
        q = self.quantize(y, index)
        return q.data, q.data_t, q.scale_inv, mean, rstd

    def act(self, h, activation, index):
        """(data, data_t or None, scale_inv) of the FP8 activation output."""
        if self.delayed:
            si = torch.empty(1, dtype=torch.float32, device=h.device)
            y = A.act_fwd(h, activation, self.state.fp8_dtype(index), self.state.scale_of(index),
                          self.state.amax_of(index), si)
            return y, None, si
        q = self.quantize(A.act_fwd(h, activation), index)
        return q.data, q.data_t, q.scale_inv


def fp8_gemm(a, a_si, b, b_si, out_dtype, bias=None, fast=False):
    """a [m, k] @ b[n, k]^T in FP8 (both K-major).  cuBLASLt's FP8 kernels
    take the bias in bfloat16 (float16 with a float16 output)."""
    if bias is not None:
        bias = as_dtype(bias, torch.float16 if out_dtype == torch.float16 else torch.bfloat16)
    return ops.gemm(a, b, transb=True, a_scale_inv=a_si, b_scale_inv=b_si, out_dtype=out_dtype,
                    bias=bias, fast_accum=fast)


def _wgrad_dtype(w_dtype):
    """The FP8 weight-gradient GEMM's output dtype: the weight's where
    cuBLASLt writes it, else float32 (then cast)."""
    return w_dtype if w_dtype in (torch.float32, torch.bfloat16) else torch.float32


def init_weight(w, init_method):
    if init_method is not None:
        init_method(w)
    else:
        torch.nn.init.normal_(w, mean=0.0, std=0.02)


class _LayerNormLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ln_w, ln_b, weight, bias, eps, rms, zc, ret_ln, module, recipe):
        in_features = x.shape[-1]
        x2 = x.reshape(-1, in_features)
        lnw, lnb = norm_param(ln_w, x2), norm_param(ln_b, x2)
        ctx.fp8 = recipe is not None
        ctx.block = is_block(recipe)
        if ctx.block:
            ln_out, mean, rstd = norm_forward(x2, lnw, lnb, eps, rms, zc)
            w_fwd, w_bwd = _quantize_weight(module, weight, recipe, "block", None, None)
            out, ln_t = block_forward(ln_out, w_fwd, recipe, x.dtype, as_dtype(bias, x.dtype),
                                      ctx.needs_input_grad[3])
            ctx.save_for_backward(x2, lnw, mean, rstd, *ln_t, w_bwd.data, w_bwd.scale_inv)
            ctx.recipe = recipe
            if not ret_ln:
                ln_out = None
        elif ctx.fp8:
            q = Quantizers(module, 3, (2,), recipe, x.device)
            if ret_ln:  # the norm output is returned: make it in x's dtype, then cast
                ln_out, mean, rstd = norm_forward(x2, lnw, lnb, eps, rms, zc)
                ln_q = q.quantize(ln_out, 0)
                ln8, ln8_t, ln_si = ln_q.data, ln_q.data_t, ln_q.scale_inv
            else:
                ln_out = None
                ln8, ln8_t, ln_si, mean, rstd = q.norm(x2, lnw, lnb, eps, rms, zc, 0)
            w_q = q.quantize(weight.detach(), 1)
            out = fp8_gemm(ln8, ln_si, w_q.data, w_q.scale_inv, x.dtype, as_dtype(bias, x.dtype),
                           fast=True)
            ctx.save_for_backward(x2, lnw, mean, rstd, ln8, ln8_t, ln_si, w_q.data_t, w_q.scale_inv)
            ctx.quantizers = q
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
        if ctx.block:
            x2, lnw, mean, rstd, ln_t, ln_t_si, w_t, w_si = ctx.saved_tensors
            dln, dweight, dbias = block_backward(
                dout2, (ln_t, ln_t_si), (w_t, w_si), ctx.recipe, x2.dtype, True,
                ctx.needs_input_grad[3], _wgrad_dtype(w_dtype), need_dbias=has_bias)
            dweight, dbias = as_dtype(dweight, w_dtype), as_dtype(dbias, b_dtype)
        elif ctx.fp8:
            x2, lnw, mean, rstd, ln8, ln8_t, ln_si, w_t, w_si = ctx.saved_tensors
            g, dbias = ctx.quantizers.grad(dout2, 2, b_dtype if has_bias else None)
            dln = fp8_gemm(g.data, g.scale_inv, w_t, w_si, x2.dtype)
            if ln8_t is None:
                ln8_t = ops.transpose_fp8(ln8)
            dweight = fp8_gemm(g.data_t, g.scale_inv, ln8_t, ln_si, _wgrad_dtype(w_dtype)).to(w_dtype)
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
        recipe = active_fp8_recipe("LayerNormLinear")
        if is_block(recipe):
            check_block_shapes("LayerNormLinear", x.numel() // self.in_features,
                               (self.in_features, self.out_features))
        weight, bias = fused_params(self, "LayerNormLinear")
        return _LayerNormLinearFn.apply(x, self.layer_norm_weight, self.layer_norm_bias, weight,
                                        bias, self.eps, self.normalization == "RMSNorm",
                                        self.zero_centered_gamma, self.return_layernorm_output, self,
                                        recipe)

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"normalization={self.normalization}, bias={self.use_bias}")


__all__ = ["LayerNormLinear"]
