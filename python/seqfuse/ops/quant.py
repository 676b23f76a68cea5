"""Quantization statistics and casts (csrc/quant/)."""
import torch

from .. import _C
from ._call import stream_for

_FLOAT_INPUTS = (torch.float32, torch.float16, torch.bfloat16)


def amax(x, out=None):
    """max |x| over every element, as a 0-d float32 tensor on x's device.

    NaN in ``x`` gives NaN; an empty ``x`` gives 0.  ``out`` (optional) is a
    float32 tensor of one element to write into.  Runs on the current CUDA
    stream without synchronizing the host.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"amax: argument 'x' must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_INPUTS:
        raise TypeError(f"amax: argument 'x' must have dtype float32, float16 or bfloat16, got {x.dtype}")
    if out is None:
        out = torch.empty((), dtype=torch.float32, device=x.device)
    if x.requires_grad:
        x = x.detach()
    _C.amax(x, out, stream_for(x))
    return out
