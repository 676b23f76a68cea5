"""The first check of every module's forward: the input is a tensor with
enough dimensions and the right last dimension, or a TypeError / ValueError
that names the module, the argument and the rule (torch.nn's modules raise
TypeError for a non-tensor input too; without this check a list or None
would surface as an AttributeError from deep inside the forward)."""
import torch

from ..ops import device_checks


def check_input(cls, x, features=None, what=None, name="input", min_dim=1):
    """Raise unless ``x`` is a floating-point tensor of at least ``min_dim``
    dimensions whose last dimension is ``features`` (the module's ``what``,
    e.g. in_features; not checked when None)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{cls}: {name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{cls}: {name} must be a floating-point tensor (float32, bfloat16, float16), got "
                        f"{x.dtype}")
    if x.dim() < min_dim:
        raise ValueError(f"{cls}: {name} must have at least {min_dim} dimension(s), got shape {tuple(x.shape)}")
    if features is not None and x.shape[-1] != features:
        raise ValueError(f"{cls}: {name}'s last dimension must be {what} = {features}, got shape "
                         f"{tuple(x.shape)}")


def check_residual(cls, residual, out_shape, dtype, device):
    """``residual`` as the 2-D [rows, features] addend of a module's last GEMM
    (added in its epilogue), or a TypeError / ValueError naming the rule: a
    tensor of the output's shape, dtype and device.  Any strides: a view
    the GEMM cannot read as one row-major matrix of the output's row
    stride (padded rows, a transposed or strided view) is copied."""
    if not isinstance(residual, torch.Tensor):
        raise TypeError(f"{cls}: residual must be a torch.Tensor or None, got {type(residual).__name__}")
    if tuple(residual.shape) != tuple(out_shape):
        raise ValueError(f"{cls}: residual must have the output's shape {tuple(out_shape)}, got "
                         f"{tuple(residual.shape)}")
    if residual.dtype != dtype:
        raise TypeError(f"{cls}: residual must have the output's dtype {dtype} (the GEMM adds it in its "
                        f"epilogue, in the output's dtype), got {residual.dtype}")
    if residual.device != device:
        raise ValueError(f"{cls}: residual must be on the input's device {device}, got {residual.device}")
    device_checks.check_storage(cls, "residual", residual)
    r = residual.reshape(-1, out_shape[-1])
    return r if r.is_contiguous() else r.contiguous()


def gemm_rows(x):
    """``x`` [rows, K] as a GEMM operand: itself where the GEMM reads its
    layout (row-major with any row stride, or column-major), else a
    row-major copy (an expanded or otherwise strided view, which torch's
    modules accept; the GEMM would refuse it naming its own argument)."""
    if x.is_contiguous():  # (the common case: one query on the hot path)
        return x
    rows, k = x.shape
    s0, s1 = x.stride()
    if (s1 == 1 or k <= 1) and (s0 >= k or rows <= 1):
        return x
    if (s0 == 1 or rows <= 1) and s1 >= rows:
        return x
    return x.contiguous()
