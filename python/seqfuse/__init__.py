"""seqfuse: fused kernels, FP8 training and packed sequences for transformer
training in plain PyTorch.

The engine is C/CUDA (``seqfuse._C``); ``seqfuse.ops`` is the functional API
over it, and the modules and recipes are built on ``ops``.
"""
from . import _C
from ._runtime import build_info, cuda_available, device_info
from . import ops
from .ops import check_pending_errors
from . import common, quantization
from . import optim

__version__ = "0.1.0"

__all__ = ["build_info", "cuda_available", "device_info", "check_pending_errors", "ops", "common", "quantization", "optim", "__version__"]
