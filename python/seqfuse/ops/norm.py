"""LayerNorm and RMSNorm, forward and backward (csrc/norm/).

The normalized dimension is the last one.  Statistics are float32, one per
row (every leading dimension flattened): LayerNorm saves ``mean`` and
``rstd = 1 / sqrt(var + eps)``, RMSNorm saves ``rstd = 1 / sqrt(mean(x^2) +
eps)``.  With ``zero_centered_gamma`` the weight applied is ``1 + weight``.

``weight``/``bias`` have the input's dtype or float32.  The output has the
input's dtype, or, with ``out_dtype=torch.float8_e4m3fn / float8_e5m2``, is
``fp8(scale * y)`` for the GEMM that follows (``scale``: float32 tensor of one
element, read on the device; ``amax`` accumulates: ``amax[0] = max(amax[0],
max |y|)``, like every quant cast; ``scale_inv`` receives ``1 / scale``).  Nothing synchronizes the host.

The backward reduces dgamma/dbeta in float32, deterministically, through a
workspace allocated here with torch.
"""
import warnings

import torch

from .. import _C
from ._call import as_float, cached_workspace, detached, given_out, mark_written, stream_for

_FLOAT_INPUTS = (torch.float32, torch.float16, torch.bfloat16)
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_warned_scalar = set()


def _check_x(op, x):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: argument 'x' must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_INPUTS:
        raise TypeError(f"{op}: argument 'x' must have dtype float32, float16 or bfloat16, got {x.dtype}")
    if x.dim() < 1:
        raise ValueError(f"{op}: argument 'x' must have at least one dimension")


def _warn_if_scalar_path(op, x, stacklevel=3):
    """The CUDA kernels read 16-byte vectors; a row whose byte length is not a
    multiple of 16 runs the element-wide variant (slower).  Say so once, at the
    caller ``stacklevel - 1`` frames above the one calling this."""
    if x.device.type != "cuda":
        return
    hidden = x.shape[-1]
    if (hidden * x.element_size()) % 16 and (op, hidden, x.dtype) not in _warned_scalar:
        _warned_scalar.add((op, hidden, x.dtype))
        warnings.warn(f"{op}: hidden size {hidden} of {x.dtype} rows is not a multiple of 16 bytes; "
                      "the element-wide kernel runs (slower than the vectorized one)", stacklevel=stacklevel)


def _out(x, out_dtype):
    if out_dtype is None or out_dtype == x.dtype:
        return torch.empty_like(x)
    if out_dtype not in _FP8:
        raise TypeError(f"norm: argument 'out_dtype' must be None (the input's dtype), "
                        f"torch.float8_e4m3fn or torch.float8_e5m2, got {out_dtype}")
    return torch.empty(*x.shape, dtype=out_dtype, device=x.device)


def _forward_args(op, x, out_dtype, out=None):
    """What both forwards start from: x (checked, contiguous, detached), the
    output to fill (``out`` where the caller gives one: the C entry checks
    its shape and dtype) and the number of rows."""
    _check_x(op, x)
    x = detached(x).contiguous()
    _warn_if_scalar_path(op, x, stacklevel=4)  # the caller of layernorm_forward / rmsnorm_forward
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return x, (_out(x, out_dtype) if out is None else given_out(op, out)), rows


def layernorm_forward(x, weight, bias=None, eps=1e-5, zero_centered_gamma=False, out_dtype=None,
                  scale=None, amax=None, scale_inv=None, save_stats=True, out=None):
    """LayerNorm forward: returns ``(y, mean, rstd)`` (``mean``/``rstd`` are
    float32 ``[rows]``, or None with ``save_stats=False``).  ``out``: y
    written there (x's shape, ``out_dtype``) instead of a new tensor."""
    op = "layernorm_forward"
    x, y, rows = _forward_args(op, x, out_dtype, out)
    mean = rstd = None
    if save_stats:
        mean = torch.empty(rows, dtype=torch.float32, device=x.device)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    _C.layernorm_forward(x, detached(weight), detached(bias), as_float(op, "eps", eps), bool(zero_centered_gamma), y,
                     mean, rstd, scale, amax, scale_inv, stream_for(x))
    if out is not None:
        mark_written(y)
        y = out
    return y, mean, rstd


def rmsnorm_forward(x, weight, eps=1e-5, zero_centered_gamma=False, out_dtype=None, scale=None,
                amax=None, scale_inv=None, save_stats=True, out=None):
    """RMSNorm forward: returns ``(y, rstd)``; ``out`` as layernorm_forward's."""
    op = "rmsnorm_forward"
    x, y, rows = _forward_args(op, x, out_dtype, out)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device) if save_stats else None
    _C.rmsnorm_forward(x, detached(weight), as_float(op, "eps", eps), bool(zero_centered_gamma), y, rstd, scale,
                   amax, scale_inv, stream_for(x))
    if out is not None:
        mark_written(y)
        y = out
    return y, rstd


_workspace_numel = {}  # (device index, rows, hidden) -> float32 elements


def _workspace(x):
    """The backward's float32 workspace (None on the CPU, which needs none)."""
    return cached_workspace(x, _workspace_numel, _C.norm_backward_workspace_numel)


def _backward_args(op, dy, x, weight):
    """What both backwards start from: dy, x (contiguous, detached) and the
    weight, then dx and dgamma to fill."""
    _check_x(op, x)
    for name, t in (("dy", dy), ("weight", weight)):
        if not isinstance(t, torch.Tensor):  # (.contiguous / empty_like below need one)
            raise TypeError(f"{op}: argument '{name}' must be a torch.Tensor, got {type(t).__name__}")
    x = detached(x).contiguous()
    dy = detached(dy).contiguous()
    weight = detached(weight)
    return dy, x, weight, torch.empty_like(x), torch.empty_like(weight)


def layernorm_backward(dy, x, mean, rstd, weight, zero_centered_gamma=False, has_bias=True, dres=None):
    """LayerNorm backward: returns ``(dx, dgamma, dbeta)`` (dbeta None without
    a bias); dgamma/dbeta have the weight's dtype.  ``dres`` (x's shape and
    dtype): added to dx in the same pass (a residual connection's gradient
    to the norm's input)."""
    dy, x, weight, dx, dgamma = _backward_args("layernorm_backward", dy, x, weight)
    dbeta = torch.empty_like(weight) if has_bias else None
    _C.layernorm_backward(dy, x, mean, rstd, weight, bool(zero_centered_gamma), dx, dgamma, dbeta,
                          _workspace(x), _dres(dres), stream_for(x))
    return dx, dgamma, dbeta


def rmsnorm_backward(dy, x, rstd, weight, zero_centered_gamma=False, dres=None):
    """RMSNorm backward: returns ``(dx, dgamma)``; ``dres`` as layernorm_backward's."""
    dy, x, weight, dx, dgamma = _backward_args("rmsnorm_backward", dy, x, weight)
    _C.rmsnorm_backward(dy, x, rstd, weight, bool(zero_centered_gamma), dx, dgamma, _workspace(x),
                        _dres(dres), stream_for(x))
    return dx, dgamma


def _dres(dres):
    """The residual gradient as the C entry takes it (contiguous; it checks the rest)."""
    if dres is None:
        return None
    if not isinstance(dres, torch.Tensor):
        raise TypeError(f"norm backward: argument 'dres' must be a torch.Tensor or None, got {type(dres).__name__}")
    return detached(dres).contiguous()
