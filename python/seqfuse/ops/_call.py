"""Helpers every op uses to call seqfuse._C.

Stream: with torch >= 2.10 the extension asks torch for the current stream
itself, through DLPack's C exchange API (no Python call).  Older torch has no
such API, so ops pass the current stream's handle explicitly.
"""
import torch

from .. import _C

#: True when torch publishes DLPack's C exchange API on its tensor type.
FAST_EXCHANGE = hasattr(torch.Tensor, "__dlpack_c_exchange_api__")


def stream_for(t):
    """The stream argument for a _C call on tensor ``t``: None where the
    extension can ask torch itself (or ``t`` is on the CPU), else the handle of
    torch's current stream on ``t``'s device."""
    if FAST_EXCHANGE or t.device.type != "cuda":
        return None
    return torch.cuda.current_stream(t.device).cuda_stream


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
