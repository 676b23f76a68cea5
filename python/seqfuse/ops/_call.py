"""Helpers every op uses to call seqfuse._C.

Stream: with torch >= 2.10 the extension asks torch for the current stream
itself, through DLPack's C exchange API (no Python call).  Older torch has no
such API, so ops pass the current stream's handle explicitly.
"""
import math
import numbers
import operator

import torch

from .. import _C
from .buffers import transient, transient_stream

#: True when torch publishes DLPack's C exchange API on its tensor type.
FAST_EXCHANGE = hasattr(torch.Tensor, "__dlpack_c_exchange_api__")


_capabilities = {}  # CUDA device index -> (major, minor), asked of torch once per device


def capability_of(device):
    """(major, minor) of a CUDA ``device`` (a torch.device), asked of torch
    once per device (routes choose by it at every call); None off CUDA."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    cap = _capabilities.get(index)
    if cap is None:
        cap = _capabilities[index] = tuple(torch.cuda.get_device_capability(index))
    return cap


def stream_for(t):
    """The stream argument for a _C call on tensor ``t``: None where the
    extension can ask torch itself (or ``t`` is on the CPU), else the handle of
    torch's current stream on ``t``'s device.  The FP8 hot entries of
    ops/quant.py and ops/gemm.py write its first test inline (``None if
    FAST_EXCHANGE else stream_for(t)``, a call saved per launch): a change
    of this rule is a change there too."""
    if FAST_EXCHANGE or t.device.type != "cuda":
        return None
    return torch.cuda.current_stream(t.device).cuda_stream


def cached_workspace(t, cache, query):
    """The float32 workspace of a backward over ``t`` seen as [rows, hidden]
    (None on the CPU, which needs none, or where the size is 0).  The size
    depends on the GPU and the shape only, so ``query(t)`` (a
    ``_C.*_workspace_numel``) is asked once per (device, rows, hidden) and
    kept in the op's ``cache`` dict (emptied past 1024 shapes).  Read by the
    op's own launches alone: a transient buffer (purpose: ``query``)."""
    if t.get_device() < 0:  # (a CPU tensor; get_device is cheaper than building t.device)
        return None
    hidden = t.shape[-1]
    key = (t.get_device(), t.numel() // hidden, hidden)
    n = cache.get(key)
    if n is None:
        if len(cache) > 1024:
            cache.clear()
        n = cache[key] = query(t)
    return transient((transient_stream(t), query), torch.float32, n) if n else None


def empty(shape, dtype, device):
    """``torch.empty(shape, dtype=dtype, device=device)`` with the sizes
    passed as separate ints: torch parses a torch.Size or tuple argument
    about a microsecond slower, which the ops on the FP8 modules' hot path
    pay several times per layer.  A 0-d ``shape`` (``()``) works too."""
    if shape:
        return torch.empty(*shape, dtype=dtype, device=device)
    return torch.empty((), dtype=dtype, device=device)


def exchange_api_in_use():
    """True when tensors cross into C through the C exchange API."""
    return FAST_EXCHANGE and _C.exchange_api_enabled()


def _fp8_exports_through_dlpack():
    try:
        torch.zeros(1, dtype=torch.float8_e4m3fn).__dlpack__()
        return True
    except (RuntimeError, BufferError, TypeError, AttributeError):
        return False


#: True when this torch can hand float8 tensors to DLPack (torch 2.6 cannot).
FP8_DLPACK = _fp8_exports_through_dlpack()


def require_fp8_dlpack(op):
    """Raise a clear error where this torch cannot pass float8 tensors to C."""
    if not FP8_DLPACK:
        raise NotImplementedError(
            f"{op}: this torch ({torch.__version__}) cannot export float8 tensors through "
            "DLPack; seqfuse's FP8 ops need a torch release that can (2.11 and later are tested)")


def dense(t):
    """``t`` contiguous, with row-major strides even when it has no elements
    (torch calls an empty tensor of any strides contiguous, e.g. the expanded
    gradient of a sum over nothing; seqfuse's C checks look at the strides)."""
    if t.numel() == 0:
        return t.new_empty(t.shape)
    return t.contiguous()


def detached(t):
    """``t`` without autograd history (the ops run inside autograd Functions
    and DLPack refuses tensors that require grad).  Anything that is not a
    tensor passes through unchanged, so that C's argument check names it."""
    return t.detach() if isinstance(t, torch.Tensor) and t.requires_grad else t


def given_out(op, out, name="out"):
    """An ``out=`` tensor the op will write, as torch's own ``out=``
    functions take one: refused while grad mode is on when it requires grad
    (the write bypasses autograd, which would go on using the values it had);
    anything that is not a tensor passes through for the C check to name.
    After the write, :func:`mark_written` marks it changed."""
    if isinstance(out, torch.Tensor) and out.requires_grad:
        if torch.is_grad_enabled():
            raise ValueError(f"{op}: argument '{name}' requires grad; seqfuse.ops write out= tensors outside "
                             "autograd (as torch's out= functions refuse to), so pass one that does not "
                             "require grad or call under torch.no_grad()")
        return out.detach()
    return out


def _version_bump():
    """torch's version-counter increment over a tuple of tensors (its C call
    where it takes one, else the Python wrapper per tensor): what an in-place
    write through DLPack must do so that autograd sees the change, as it sees
    torch's own in-place and out= writes."""
    bump = getattr(torch._C, "_increment_version", None)
    try:
        bump((torch.empty(1, device="cpu"),))  # (explicitly on the CPU: never initialise CUDA at import)
        return bump
    except Exception:  # noqa: BLE001 - an older signature, one tensor a call
        return lambda tensors: [torch.autograd.graph.increment_version(t) for t in tensors]


#: increment_versions((t, ...)): bump each tensor's version counter (see _version_bump)
increment_versions = _version_bump()


def mark_written(*outs):
    """Bump the version counters of the given ``out=`` tensors after a C
    write (other DLPack producers, which C also takes, keep no counter)."""
    try:  # (all tensors, the modules' case: torch's one C call over the tuple as given)
        increment_versions(outs)
    except (RuntimeError, TypeError):  # a DLPack producer among them (a counter bumped twice still moved)
        increment_versions(tuple(t for t in outs if isinstance(t, torch.Tensor)))


_INT64 = (-(2 ** 63), 2 ** 63 - 1)


def _real_rule(finite, minimum, above, maximum):
    """The words of ``as_float``'s rule: "a finite number > 0", "in (0, 1]"..."""
    if maximum is not None and (minimum is not None or above is not None):
        bound = f"in [{minimum}, {maximum}]" if above is None else f"in ({above}, {maximum}]"
    elif minimum is not None or above is not None:
        bound = f">= {minimum}" if above is None else f"> {above}"
    else:
        bound = "" if maximum is None else f"<= {maximum}"
    return " ".join(w for w in ("a finite number" if finite else "", bound) if w)


def as_float(op, name, value, *, finite=False, minimum=None, above=None, maximum=None, why=None):
    """``value`` as a Python float, or a TypeError / ValueError naming the op
    and the argument: seqfuse's one reader of real-number arguments.

    TypeError where it is not a real number: a string (although float()
    would parse it), a bool (Python's, numpy's, a bool tensor: True is not
    1.0 of anything), a complex number, a tensor or array of more than one
    element.  A real number of any kind is read: int, float, numpy's
    scalars, a Fraction, a one-element non-bool tensor (``float(t)``, as
    ``t.item()``).

    ValueError where it breaks the rule asked for: ``finite`` (NaN and
    infinities refused), ``minimum`` (value >= minimum) or ``above`` (value >
    above, the open bound; give one of the two), ``maximum`` (value <=
    maximum).  A bound refuses NaN (it is in no range) even without
    ``finite``; with no rule at all NaN and infinities pass, as float()
    reads them.  ``why``: words appended to the ValueError's rule, e.g.
    "(inf: no clipping)"."""
    v = value if type(value) is float else _read_real(op, name, value)  # (a plain float: the hot path)
    if ((finite and not math.isfinite(v)) or (minimum is not None and not v >= minimum)
            or (above is not None and not v > above) or (maximum is not None and not v <= maximum)):
        rule = _real_rule(finite, minimum, above, maximum)
        raise ValueError(f"{op}: argument '{name}' must be {rule}{' ' + why if why else ''}, got {v}")
    return v


def _read_real(op, name, value):
    """as_float's reading of anything but a plain Python float (its rules'
    TypeErrors and the double range's ValueError)."""
    dtype = str(getattr(value, "dtype", ""))
    if isinstance(value, (str, bytes, bytearray)):
        raise TypeError(f"{op}: argument '{name}' must be a real number, got {value!r}")
    if isinstance(value, bool) or dtype in ("bool", "torch.bool"):
        raise TypeError(f"{op}: argument '{name}' must be a real number, got the bool {value!r}")
    if "complex" in dtype or (isinstance(value, numbers.Complex) and not isinstance(value, numbers.Real)):
        raise TypeError(f"{op}: argument '{name}' must be a real number, got the complex number {value!r}")
    try:
        v = float(value)
    except OverflowError:  # (an int past the double range: a real number, but none C can take)
        raise ValueError(f"{op}: argument '{name}' must fit a double, got {value!r}") from None
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"{op}: argument '{name}' must be a real number, got {value!r}") from None
    return v


def exact_int(value):
    """``value`` as a Python int where it is an integer of any kind (int,
    numpy's, a one-element integer torch tensor: ``operator.index``), else
    None: a bool, a float (even a whole one), a string.  The strict reading
    of counts, seeds and sizes that callers name in their own messages
    (``as_int`` below also takes whole floats)."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def as_max_norm(op, max_norm):
    """A gradient-clipping ``max_norm`` as a float >= 0 (inf: no clipping; a
    one-element tensor is read), or a TypeError / ValueError naming it: a
    negative one would flip every gradient's sign, NaN would make them NaN
    (torch.nn.utils.clip_grad_norm_ does both silently)."""
    return as_float(op, "max_norm", max_norm, minimum=0, why="(inf: no clipping)")


def as_int(op, name, value, minimum=None, what=None):
    """``value`` as a Python int for C, or a TypeError / ValueError naming the
    argument: not a number, not whole, outside int64, or below ``minimum``.
    Integers of any kind (numpy's, a one-element integer tensor) are taken
    as they are; a real number of any kind (float, numpy's float32, a
    one-element float tensor, a Fraction) only when it is whole, so nothing
    is truncated.  A string is not a number, although int() would parse it,
    and a bool (Python's, numpy's, a bool tensor) is not a count, although
    operator.index reads it as 0 / 1.  ``what``: the phrase that names the value in messages where it is not an
    argument of its own (an element of a list argument); default
    "argument '<name>'"."""
    what = what or f"argument '{name}'"
    if type(value) is not int:
        if isinstance(value, (str, bytes, bytearray)):
            raise TypeError(f"{op}: {what} must be an integer, got {value!r}")
        if isinstance(value, bool) or str(getattr(value, "dtype", "")) in ("bool", "torch.bool"):
            raise TypeError(f"{op}: {what} must be an integer, got the bool {value!r}")
        try:
            value = operator.index(value)  # an integer of any kind, exactly
        except TypeError:
            try:
                real = float(value)
            except (TypeError, ValueError, RuntimeError, OverflowError):
                raise TypeError(f"{op}: {what} must be an integer, got {value!r}") from None
            if not real.is_integer() or real != value:
                raise ValueError(f"{op}: {what} must be a whole number, got {value!r}") from None
            value = int(real)
    low = _INT64[0] if minimum is None else minimum
    if not low <= value <= _INT64[1]:
        raise ValueError(f"{op}: {what} must be in [{low}, 2**63 - 1], got {value}")
    return value
