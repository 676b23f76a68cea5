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
import numbers

import torch

from .. import _C
from ..ops import norm as N
from ..ops._call import FAST_EXCHANGE, stream_for
from ._input import check_input


def _plain(t):
    """Tensors cross into C as they are where torch offers DLPack's C exchange
    API; the capsule path needs them detached."""
    return t if (FAST_EXCHANGE or t is None or not t.requires_grad) else t.detach()


def _weight_for(x, w):
    """The kernels take a weight in the input's dtype or float32."""
    if w is None or w.dtype == x.dtype or w.dtype == torch.float32:
        return w
    return w.float()


# The autograd functions call seqfuse._C directly: a norm's kernels take tens
# of microseconds, so the Python around them is kept to what must happen
# (contiguity, output allocation, the workspace); _C validates everything.

def _prep(x):
    if not x.is_contiguous():
        x = x.contiguous()
    if x.is_cuda:
        N._warn_if_scalar_path("norm", x)
    return x if FAST_EXCHANGE else x.detach()


def _stats(x):
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return torch.empty(rows, dtype=torch.float32, device=x.device)


class _LayerNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, zero_centered_gamma):
        x = _prep(x)
        y = torch.empty_like(x)
        mean, rstd = _stats(x), _stats(x)
        _C.layernorm_fwd(x, _plain(weight), _plain(bias), eps, zero_centered_gamma, y, mean, rstd,
                         None, None, None, stream_for(x))
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.zero_centered_gamma = zero_centered_gamma
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        dy = _prep(dy)
        dx = torch.empty_like(x)
        dgamma = torch.empty_like(weight)
        dbeta = torch.empty_like(weight) if ctx.has_bias else None
        _C.layernorm_bwd(dy, _plain(x), mean, rstd, _plain(weight), ctx.zero_centered_gamma, dx,
                         dgamma, dbeta, N._workspace(x), stream_for(x))
        return dx, dgamma, dbeta, None, None


class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, zero_centered_gamma):
        x = _prep(x)
        y = torch.empty_like(x)
        rstd = _stats(x)
        _C.rmsnorm_fwd(x, _plain(weight), eps, zero_centered_gamma, y, rstd, None, None, None,
                       stream_for(x))
        ctx.save_for_backward(x, weight, rstd)
        ctx.zero_centered_gamma = zero_centered_gamma
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dy = _prep(dy)
        dx = torch.empty_like(x)
        dgamma = torch.empty_like(weight)
        _C.rmsnorm_bwd(dy, _plain(x), rstd, _plain(weight), ctx.zero_centered_gamma, dx, dgamma,
                       N._workspace(x), stream_for(x))
        return dx, dgamma, None, None


def layer_norm(x, weight, bias=None, eps=1e-5, zero_centered_gamma=False):
    """Differentiable LayerNorm over the last dimension of x."""
    check_input("LayerNorm", x)
    return _LayerNormFn.apply(x, _weight_for(x, weight), _weight_for(x, bias), float(eps),
                              bool(zero_centered_gamma))


def rms_norm(x, weight, eps=1e-5, zero_centered_gamma=False):
    """Differentiable RMSNorm over the last dimension of x."""
    check_input("RMSNorm", x)
    return _RMSNormFn.apply(x, _weight_for(x, weight), float(eps), bool(zero_centered_gamma))


def default_device(device):
    """TE places parameters on the GPU by default; so do we where one is
    usable by seqfuse, else on the CPU."""
    if device is not None:
        return torch.device(device)
    import seqfuse

    return torch.device("cuda" if torch.cuda.is_available() and seqfuse.cuda_available() else "cpu")


def _hidden(hidden_size):
    if isinstance(hidden_size, numbers.Integral):
        return int(hidden_size)
    shape = tuple(hidden_size)
    if len(shape) != 1:
        raise NotImplementedError(f"normalization over the last dimension only; got normalized shape {shape}")
    return int(shape[0])


class _Norm(torch.nn.Module):
    def __init__(self, hidden_size, eps, sequence_parallel, params_dtype, zero_centered_gamma,
                 device, has_bias):
        super().__init__()
        self.hidden_size = _hidden(hidden_size)
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
