"""Activations with their gradients, and bias + dropout + residual (csrc/act/).

Activations: ``gelu`` (tanh approximation, Transformer Engine's "gelu"),
``gelu_erf`` (exact), ``silu``, ``relu``, and the gated ``geglu``,
``geglu_erf``, ``swiglu``, ``reglu``.  A gated activation takes x with a last
dimension of 2n and returns n columns, TE's convention: the FIRST half goes
through the activation, the SECOND half is the linear gate,
``y = act(x[..., :n]) * x[..., n:]``.

FP8 output: ``out_dtype=torch.float8_e4m3fn / float8_e5m2`` with ``scale`` (a
float32 tensor of one element, read on the device) gives ``fp8(scale * v)``;
``amax`` accumulates ``max |v|`` (``amax[0] = max(amax[0], max |v|)``, the
quant casts' rule), ``scale_inv`` receives ``1 / scale``.  The
backward takes the same arguments for its dx.

Dropout stores no mask: keep decisions come from Philox-4x32-10 keyed by a
seed at counter ``offset + i // 4`` (i the flat element index), so the
backward regenerates exactly the forward's decisions from ``(p, seed,
offset)``.  The seed defaults to a draw from torch's default CPU generator, so
``torch.manual_seed`` makes runs repeatable.
"""
import torch

from .. import _C
from ._call import as_float, as_int, cached_workspace, detached, empty, given_out, mark_written, stream_for

ACTIVATIONS = {"gelu": 0, "gelu_erf": 1, "silu": 2, "relu": 3, "geglu": 4, "geglu_erf": 5,
               "swiglu": 6, "reglu": 7}
GATED = frozenset(("geglu", "geglu_erf", "swiglu", "reglu"))
_FLOAT_INPUTS = (torch.float32, torch.float16, torch.bfloat16)
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _code(op, activation):
    try:
        return ACTIVATIONS[activation]
    except (KeyError, TypeError):
        raise ValueError(f"{op}: argument 'activation' must be one of {', '.join(ACTIVATIONS)}, "
                         f"got {activation!r}") from None


def _check_x(op, name, x):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: argument '{name}' must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_INPUTS:
        raise TypeError(f"{op}: argument '{name}' must have dtype float32, float16 or bfloat16, got {x.dtype}")


def _out_dtype(op, x, out_dtype):
    if out_dtype is None or out_dtype == x.dtype:
        return x.dtype
    if out_dtype not in _FP8:
        raise TypeError(f"{op}: argument 'out_dtype' must be None (the input's dtype), "
                        f"torch.float8_e4m3fn or torch.float8_e5m2, got {out_dtype}")
    return out_dtype


def _act_out(op, out, out_dtype):
    """``out`` as given, refused where ``out_dtype`` names another dtype
    (the C entry takes out's own dtype)."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{op}: argument 'out' must be a torch.Tensor or None, got {type(out).__name__}")
    if out_dtype is not None and out.dtype != out_dtype:
        raise TypeError(f"{op}: argument 'out' has dtype {out.dtype} but out_dtype is {out_dtype}")
    return given_out(op, out)


def act_forward(x, activation, out_dtype=None, scale=None, amax=None, scale_inv=None, out=None):
    """y = activation(x); last dimension halved for the gated ones.  ``out``:
    y written there (that shape, ``out_dtype``; the C entry checks) instead
    of a new tensor."""
    op = "act_forward"
    code = _code(op, activation)
    _check_x(op, "x", x)
    x = detached(x).contiguous()
    if out is not None:
        y = _act_out(op, out, out_dtype)
    else:
        shape = list(x.shape)
        if activation in GATED and x.dim() >= 1:
            shape[-1] //= 2
        y = empty(shape, _out_dtype(op, x, out_dtype), x.device)
    _C.act_forward(code, x, y, scale, amax, scale_inv, stream_for(x))
    if out is not None:
        mark_written(y)
        return out
    return y


def act_backward(dy, x, activation, out_dtype=None, scale=None, amax=None, scale_inv=None, out=None):
    """dx of the activation, given dy and the forward's input x.  ``out``: dx
    written there (x's shape, ``out_dtype``; the C entry checks) instead of a
    new tensor."""
    op = "act_backward"
    code = _code(op, activation)
    _check_x(op, "x", x)
    _check_x(op, "dy", dy)
    x = detached(x).contiguous()
    dy = detached(dy).contiguous()
    dx = _act_out(op, out, out_dtype) if out is not None else empty(x.shape, _out_dtype(op, x, out_dtype),
                                                                         x.device)
    _C.act_backward(code, dy, x, dx, scale, amax, scale_inv, stream_for(x))
    if out is not None:
        mark_written(dx)
        return out
    return dx


def new_seed():
    """A dropout seed from torch's default CPU generator (no GPU sync)."""
    return int(torch.randint(0, 2**62, (), dtype=torch.int64).item())


def bias_dropout_add(x, bias, residual, p, seed=None, offset=0):
    """out = residual + dropout(x + bias, p).  Returns ``(out, seed, offset)``:
    hand seed and offset to :func:`dropout_backward`."""
    op = "bias_dropout_add"
    _check_x(op, "x", x)
    _check_x(op, "residual", residual)
    x = detached(x).contiguous()
    residual = detached(residual).contiguous()
    if seed is None:
        seed = new_seed()
    out = torch.empty_like(x)
    _C.bias_dropout_add(x, detached(bias), residual, as_float(op, "p", p), as_int(op, "seed", seed),
                        as_int(op, "offset", offset, 0), out,
                        stream_for(x))
    return out, seed, offset


_workspace_numel = {}


def _workspace(dy):
    if dy.numel() == 0:
        return None
    return cached_workspace(dy, _workspace_numel, _C.dropout_backward_workspace_numel)


def dropout_backward(dy, p, seed, offset=0, dbias_dtype=None):
    """Gradient through dropout(x + bias): returns ``(dx, dbias)``; dbias (the
    column sums of dx, float32-accumulated, deterministic) only when
    ``dbias_dtype`` is given, else None.  The residual's gradient is dy."""
    op = "dropout_backward"
    _check_x(op, "dy", dy)
    dy = detached(dy).contiguous()
    dx = torch.empty_like(dy)
    dbias = ws = None
    if dbias_dtype is not None:
        if not isinstance(dbias_dtype, torch.dtype):
            raise TypeError(f"{op}: argument 'dbias_dtype' must be a torch.dtype or None, got {dbias_dtype!r}")
        if dy.dim() < 1:
            raise ValueError(f"{op}: argument 'dy' must have at least 1 dimension when dbias_dtype is given "
                             f"(dbias is [dy.shape[-1]], the column sums), got a 0-d tensor")
        dbias = torch.empty(dy.shape[-1], dtype=dbias_dtype, device=dy.device)
        ws = _workspace(dy)
    _C.dropout_backward(dy, as_float(op, "p", p), as_int(op, "seed", seed), as_int(op, "offset", offset, 0),
                   dx, dbias, ws, stream_for(dy))
    return dx, dbias
