"""LayerNorm and RMSNorm modules (Transformer Engine's names and arguments)
and the autograd functions under them, over seqfuse.ops.norm.

    LayerNorm(hidden_size, eps=1e-5, sequence_parallel=None, params_dtype=None,
              zero_centered_gamma=False, device=None)
    RMSNorm(hidden_size, eps=1e-5, sequence_parallel=None, params_dtype=None,
            zero_centered_gamma=False, device=None)

The output has the input's dtype.  Parameters are ``weight`` (and ``bias`` for
LayerNorm) in ``params_dtype`` (default: torch's default dtype); with
``zero_centered_gamma`` the weight starts at 0 and ``1 + weight`` is applied.
A float32 weight on bf16/fp16 input is read as is by the kernels; any other
mismatch is resolved by reading the weight as float32.
"""
import torch

from .. import ops
from ._base import default_device, hidden_dim, norm_param
from ._input import check_input

# The autograd functions call seqfuse.ops' norm functions (the kernels'
# only path from Python); x is made contiguous here once, so that the tensor
# saved for the backward is the one the forward read.


class _LayerNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, zero_centered_gamma):
        x = x.contiguous()
        y, mean, rstd = ops.layernorm_fwd(x, weight, bias, eps, zero_centered_gamma)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.zero_centered_gamma = zero_centered_gamma
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dgamma, dbeta = ops.layernorm_bwd(dy, x, mean, rstd, weight, ctx.zero_centered_gamma,
                                              ctx.has_bias)
        return dx, dgamma, dbeta, None, None


class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, zero_centered_gamma):
        x = x.contiguous()
        y, rstd = ops.rmsnorm_fwd(x, weight, eps, zero_centered_gamma)
        ctx.save_for_backward(x, weight, rstd)
        ctx.zero_centered_gamma = zero_centered_gamma
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dgamma = ops.rmsnorm_bwd(dy, x, rstd, weight, ctx.zero_centered_gamma)
        return dx, dgamma, None, None


def layer_norm(x, weight, bias=None, eps=1e-5, zero_centered_gamma=False):
    """Differentiable LayerNorm over the last dimension of x."""
    check_input("LayerNorm", x)
    return _LayerNormFn.apply(x, norm_param(weight, x), norm_param(bias, x), float(eps),
                              bool(zero_centered_gamma))


def rms_norm(x, weight, eps=1e-5, zero_centered_gamma=False):
    """Differentiable RMSNorm over the last dimension of x."""
    check_input("RMSNorm", x)
    return _RMSNormFn.apply(x, norm_param(weight, x), float(eps), bool(zero_centered_gamma))


class _Norm(torch.nn.Module):
    def __init__(self, hidden_size, eps, sequence_parallel, params_dtype, zero_centered_gamma,
                 device, has_bias):
        super().__init__()
        self.hidden_size = hidden_dim(hidden_size)
        if self.hidden_size < 1:
            raise ValueError(f"argument 'hidden_size' must be >= 1, got {self.hidden_size}")
        self.eps = float(eps)
        self.zero_centered_gamma = bool(zero_centered_gamma)
        self.sequence_parallel = bool(sequence_parallel)
        dtype = params_dtype if params_dtype is not None else torch.get_default_dtype()
        device = default_device(device)
        self.weight = torch.nn.Parameter(torch.empty(self.hidden_size, dtype=dtype, device=device))
        if has_bias:
            self.bias = torch.nn.Parameter(torch.empty(self.hidden_size, dtype=dtype, device=device))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self):
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

    def __init__(self, hidden_size, eps=1e-5, sequence_parallel=None, params_dtype=None,
                 zero_centered_gamma=False, device=None):
        super().__init__(hidden_size, eps, sequence_parallel, params_dtype, zero_centered_gamma,
                         device, has_bias=True)

    def forward(self, x):
        return layer_norm(x, self.weight, self.bias, self.eps, self.zero_centered_gamma)


class RMSNorm(_Norm):
    """y = x / sqrt(mean(x^2) + eps) * weight over the last dimension."""

    def __init__(self, hidden_size, eps=1e-5, sequence_parallel=None, params_dtype=None,
                 zero_centered_gamma=False, device=None):
        super().__init__(hidden_size, eps, sequence_parallel, params_dtype, zero_centered_gamma,
                         device, has_bias=False)

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps, self.zero_centered_gamma)
