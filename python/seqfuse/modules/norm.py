"""LayerNorm and RMSNorm modules (Transformer Engine's names and arguments)
and the autograd functions under them, over seqfuse.ops.norm.

    LayerNorm(normalized_shape, eps=1e-5, sequence_parallel=None, params_dtype=None,
              zero_centered_gamma=False, hidden_size=None, device=None, dtype=None,
              sm_margin=0)
    RMSNorm(...the same arguments)

``hidden_size`` is TE's deprecated name of ``normalized_shape`` and
``params_dtype`` its deprecated name of ``dtype``: one of each pair may be
given.  ``sequence_parallel`` (TE's legacy Megatron flag) is set as an
attribute on the parameters.  ``sm_margin`` other than 0 raises
NotImplementedError (seqfuse.modules.te_compat.REFUSED).  ``device="meta"``
defers initialisation to reset_parameters(), which materialises the
parameters on the current CUDA device (CPU without one).

The output has the input's dtype.  Parameters are ``weight`` (and ``bias`` for
LayerNorm) in ``params_dtype`` (default: torch's default dtype); with
``zero_centered_gamma`` the weight starts at 0 and ``1 + weight`` is applied.
A float32 weight on bf16/fp16 input is read as is by the kernels; any other
mismatch is resolved by reading the weight as float32.
"""
import torch

from .. import ops
from ..ops.args import as_float
from ._base import default_device, hidden_dim, norm_param, params_dtype_of
from ._input import check_input
from .te_compat import materialize, refuse

# The autograd functions call seqfuse.ops' norm functions (the kernels'
# only path from Python); x is made contiguous here once, so that the tensor
# saved for the backward is the one the forward read.


def _alias_outputs(ctx, y, x, alias):
    """The norm functions' outputs: y, and with ``alias`` also x itself as a
    second output (its gradient, a residual connection's, is added to dx in
    the norm's backward pass: no add kernel of autograd's).  An output no
    gradient reaches then gets None in the backward, not zeros: where only
    the alias's does, dx is that gradient and the parameters get none, as
    without the alias."""
    if not alias:
        return y
    ctx.set_materialize_grads(False)
    return y, x.view_as(x)


class _LayerNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, zero_centered_gamma, alias=False):
        x = x.contiguous()
        y, mean, rstd = ops.layernorm_forward(x, weight, bias, eps, zero_centered_gamma)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.zero_centered_gamma = zero_centered_gamma
        ctx.has_bias = bias is not None
        return _alias_outputs(ctx, y, x, alias)

    @staticmethod
    def backward(ctx, dy, dres=None):
        if dy is None:  # only the input alias reached the loss (_alias_outputs)
            return dres, None, None, None, None, None
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dgamma, dbeta = ops.layernorm_backward(dy, x, mean, rstd, weight, ctx.zero_centered_gamma,
                                                   ctx.has_bias, dres=dres)
        return dx, dgamma, dbeta, None, None, None


class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, zero_centered_gamma, alias=False):
        x = x.contiguous()
        y, rstd = ops.rmsnorm_forward(x, weight, eps, zero_centered_gamma)
        ctx.save_for_backward(x, weight, rstd)
        ctx.zero_centered_gamma = zero_centered_gamma
        return _alias_outputs(ctx, y, x, alias)

    @staticmethod
    def backward(ctx, dy, dres=None):
        if dy is None:  # only the input alias reached the loss (_alias_outputs)
            return dres, None, None, None, None
        x, weight, rstd = ctx.saved_tensors
        dx, dgamma = ops.rmsnorm_backward(dy, x, rstd, weight, ctx.zero_centered_gamma, dres=dres)
        return dx, dgamma, None, None, None


def layer_norm(x, weight, bias=None, eps=1e-5, zero_centered_gamma=False, return_input_alias=False):
    """Differentiable LayerNorm over the last dimension of x; with
    ``return_input_alias`` (y, alias of x): see RMSNorm.forward."""
    check_input("LayerNorm", x)
    return _LayerNormFn.apply(x, norm_param(weight, x), norm_param(bias, x), float(eps),
                              bool(zero_centered_gamma), bool(return_input_alias))


def rms_norm(x, weight, eps=1e-5, zero_centered_gamma=False, return_input_alias=False):
    """Differentiable RMSNorm over the last dimension of x; with
    ``return_input_alias`` (y, alias of x): see RMSNorm.forward."""
    check_input("RMSNorm", x)
    return _RMSNormFn.apply(x, norm_param(weight, x), float(eps), bool(zero_centered_gamma),
                            bool(return_input_alias))


def _one_of(cls, new, new_value, old, old_value):
    """TE's argument ``new`` or its deprecated name ``old``, not both."""
    if new_value is not None and old_value is not None:
        raise ValueError(f"{cls}: give '{new}' or its deprecated name '{old}', not both")
    return new_value if new_value is not None else old_value


class _Norm(torch.nn.Module):
    """LayerNorm's and RMSNorm's common part: TE's constructor (one signature
    for both), the parameters and their initialisation.  A subclass names
    itself in ``_name`` (for messages) and says in ``_has_bias`` whether it
    has a bias."""
    _name = None
    _has_bias = None

    def __init__(self, normalized_shape=None, eps=1e-5, sequence_parallel=None, params_dtype=None,
                 zero_centered_gamma=False, hidden_size=None, device=None, dtype=None, sm_margin=0):
        super().__init__()
        cls = self._name
        refuse(cls, {"sm_margin": sm_margin})
        normalized_shape = _one_of(cls, "normalized_shape", normalized_shape, "hidden_size", hidden_size)
        if normalized_shape is None:
            raise TypeError(f"{cls}: argument 'normalized_shape' (or 'hidden_size') is required")
        params_dtype = _one_of(cls, "dtype", dtype, "params_dtype", params_dtype)
        self.hidden_size = hidden_dim(normalized_shape, cls, "normalized_shape")
        if self.hidden_size < 1:
            raise ValueError(f"argument 'hidden_size' must be >= 1, got {self.hidden_size}")
        self.eps = as_float(cls, "eps", eps)
        self.zero_centered_gamma = bool(zero_centered_gamma)
        self.sequence_parallel = sequence_parallel
        dtype = params_dtype_of(cls, params_dtype)
        device = default_device(device)
        self.weight = torch.nn.Parameter(torch.empty(self.hidden_size, dtype=dtype, device=device))
        if self._has_bias:
            self.bias = torch.nn.Parameter(torch.empty(self.hidden_size, dtype=dtype, device=device))
        else:
            self.register_parameter("bias", None)
        if device.type != "meta":  # meta: deferred to reset_parameters()
            self.reset_parameters()

    def reset_parameters(self):
        """(Re)initialise; materialises meta parameters first (module note)."""
        materialize(self)
        for p in self.parameters(recurse=False):
            if self.sequence_parallel is not None:  # TE's legacy Megatron flag
                p.sequence_parallel = bool(self.sequence_parallel)
        with torch.no_grad():
            if self.zero_centered_gamma:
                self.weight.zero_()
            else:
                self.weight.fill_(1.0)
            if self.bias is not None:
                self.bias.zero_()

    def extra_repr(self):
        return f"{self.hidden_size}, eps={self.eps}, zero_centered_gamma={self.zero_centered_gamma}"


class LayerNorm(_Norm):
    """y = (x - mean) / sqrt(var + eps) * weight + bias over the last dimension."""
    _name, _has_bias = "LayerNorm", True

    def forward(self, input, return_input_alias=False):
        """As RMSNorm.forward."""
        check_input(self._name, input, self.hidden_size, "normalized_shape")  # (not the weight's length)
        return layer_norm(input, self.weight, self.bias, self.eps, self.zero_centered_gamma, return_input_alias)


class RMSNorm(_Norm):
    """y = x / sqrt(mean(x^2) + eps) * weight over the last dimension."""
    _name, _has_bias = "RMSNorm", False

    def forward(self, input, return_input_alias=False):
        """The normalised input; with ``return_input_alias`` (seqfuse's) the
        pair (output, alias of input) for a pre-norm residual block
        ``alias + f(output)``: the residual's gradient is then added to the
        input's in the norm's backward pass instead of by autograd's add
        kernel (the alias holds input's values; use it in place of input)."""
        check_input(self._name, input, self.hidden_size, "normalized_shape")  # (not the weight's length)
        return rms_norm(input, self.weight, self.eps, self.zero_centered_gamma, return_input_alias)
