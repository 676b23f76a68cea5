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
