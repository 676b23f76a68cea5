"""Capability and version queries under Transformer Engine's names and return
conventions (transformer_engine.pytorch's is_fp8_available and siblings).

TE scripts call these at import time to decide whether to turn FP8 or bf16
on, so they must be cheap: they read the device's compute capability
through seqfuse._runtime (seqfuse._C's driver attribute queries: no CUDA
context, no torch CUDA initialisation unless torch has already initialised
it, in which case torch's current device is the one asked about) and cache
nothing that can change (the current device can).

Conventions, as TE 2.20's source has them:
- ``is_*_available(return_reason=False)`` returns a bool; with
  ``return_reason=True`` a (bool, reason) pair whose reason is "" when the
  answer is True.
- ``get_device_compute_capability()`` returns (major, minor) of the current
  CUDA device.
- ``get_cudnn_version()`` returns (major, minor, patch) of the loaded cuDNN.
- ``get_default_recipe()`` returns the recipe TE would pick for the device.

The answers are about what seqfuse can run, which is not always what TE
can: seqfuse's MXFP8 and NVFP4 GEMMs are not implemented on any device yet,
so those queries say False with that reason even on Blackwell, and the
default recipe is DelayedScaling everywhere (TE picks MXFP8 on Blackwell).
Also here: TE's interleave_glu_tensor / deinterleave_glu_tensor, which move
a gated FC1 weight (or bias) between the contiguous [gated half; linear
half] row order and the block-interleaved order [W rows 0:k, V rows 0:k,
W rows k:2k, ...] along dimension 0.

Without a usable CUDA device the FP8 queries say False (seqfuse's CPU
backend runs FP8 recipes as a slow reference, not as a speed-up);
is_bf16_available says True there, because the CPU backend and torch compute
in bf16.
"""
from typing import Tuple, Union

import torch

from .. import _runtime

__all__ = ["deinterleave_glu_tensor", "interleave_glu_tensor",
           "get_device_compute_capability", "get_cudnn_version", "is_bf16_available",
           "is_fp8_available", "is_fp8_block_scaling_available", "is_mxfp8_available",
           "is_nvfp4_available", "get_default_recipe"]


def _cuda_compiled():
    return bool(_runtime.build_info()["cuda"])


def _current_index():
    """torch's current CUDA device where torch has initialised CUDA (so
    torch.cuda.set_device is honoured), else device 0, without initialising
    anything."""
    if torch.cuda.is_initialized():
        return torch.cuda.current_device()
    return 0


def _capability_or_reason():
    """((major, minor), "") of the current device, or (None, why there is none)."""
    if not _cuda_compiled():
        return None, "seqfuse was built without its CUDA backend (CPU-only build)"
    devices = _runtime.device_info()
    if not devices:
        return None, "no CUDA device is visible"
    major, minor = devices[_current_index()]["capability"].split(".")
    return (int(major), int(minor)), ""


def get_device_compute_capability() -> Tuple[int, int]:
    """(major, minor) compute capability of the current CUDA device."""
    cap, why = _capability_or_reason()
    if cap is None:
        raise RuntimeError(f"get_device_compute_capability: {why}")
    return cap


def get_cudnn_version() -> Tuple[int, int, int]:
    """(major, minor, patch) of the cuDNN torch has loaded (seqfuse's cuDNN
    attention route runs on torch's cuDNN)."""
    version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if version is None:
        raise RuntimeError("get_cudnn_version: no cuDNN is loaded (torch.backends.cudnn.is_available() "
                           "is False)")
    # cuDNN 9 encodes major * 10000 + minor * 100 + patch; cuDNN 8 major * 1000 + minor * 100 + patch
    major = version // 10000 if version >= 90000 else version // 1000
    rest = version % 10000 if version >= 90000 else version % 1000
    return major, rest // 100, rest % 100


def _answer(available, reason, return_reason):
    return (available, "" if available else reason) if return_reason else available


def is_bf16_available(return_reason: bool = False) -> Union[bool, Tuple[bool, str]]:
    """bf16 computation on the current device: compute capability 8.0 or
    higher on CUDA; True on the CPU backend (no CUDA device)."""
    cap, _ = _capability_or_reason()
    if cap is None:
        return _answer(True, "", return_reason)
    return _answer(cap >= (8, 0), f"bf16 needs compute capability 8.0 or higher; the current device has "
                                  f"{cap[0]}.{cap[1]}", return_reason)


def is_fp8_available(return_reason: bool = False) -> Union[bool, Tuple[bool, str]]:
    """FP8 with DelayedScaling and Float8CurrentScaling: a CUDA device of
    compute capability 8.9 or higher (cuBLASLt's FP8 GEMMs)."""
    cap, why = _capability_or_reason()
    if cap is None:
        return _answer(False, f"FP8 needs a CUDA device: {why} (the CPU backend runs FP8 recipes as a "
                              "reference only)", return_reason)
    return _answer(cap >= (8, 9), f"FP8 needs compute capability 8.9 or higher; the current device has "
                                  f"{cap[0]}.{cap[1]}", return_reason)


def is_fp8_block_scaling_available(return_reason: bool = False) -> Union[bool, Tuple[bool, str]]:
    """Float8BlockScaling: cuBLASLt's 128x128 block-scaled FP8 GEMMs, which
    seqfuse runs on compute capability 9.x with cuBLASLt 12.9 or newer."""
    cap, why = _capability_or_reason()
    if cap is None:
        return _answer(False, f"FP8 block scaling needs a CUDA device: {why}", return_reason)
    cublaslt = _runtime.build_info()["cublaslt"]
    if cublaslt < 120900:
        return _answer(False, f"FP8 block scaling needs cuBLASLt 12.9 or newer; seqfuse was built "
                              f"against {cublaslt}", return_reason)
    return _answer(cap[0] == 9, f"seqfuse runs FP8 block scaling on compute capability 9.x (cuBLASLt's "
                                f"128x128 block-scaled GEMM on Hopper); the current device has "
                                f"{cap[0]}.{cap[1]}", return_reason)


_NOT_YET = ("seqfuse has no {} GEMM on any device yet (seqfuse.quantization refuses the recipe); use "
            "DelayedScaling, Float8CurrentScaling or Float8BlockScaling")


def is_mxfp8_available(return_reason: bool = False) -> Union[bool, Tuple[bool, str]]:
    """MXFP8BlockScaling: False on every device for now (see the module note)."""
    return _answer(False, _NOT_YET.format("MXFP8"), return_reason)


def is_nvfp4_available(return_reason: bool = False) -> Union[bool, Tuple[bool, str]]:
    """NVFP4BlockScaling: False on every device for now (see the module note)."""
    return _answer(False, _NOT_YET.format("NVFP4"), return_reason)


def get_default_recipe():
    """The FP8 recipe used when autocast is given none: DelayedScaling with
    its defaults (seqfuse has no MXFP8 GEMM, TE's default on Blackwell)."""
    from ..common.recipe import DelayedScaling
    return DelayedScaling()


def _check_glu(tensor, interleave_size, who):
    if not isinstance(interleave_size, int) or isinstance(interleave_size, bool) or interleave_size <= 0:
        raise ValueError(f"{who}: argument 'interleave_size' must be a positive int, got {interleave_size!r}")
    if tensor.dim() < 1 or tensor.shape[0] % (2 * interleave_size):
        raise ValueError(f"{who}: dimension 0 of 'tensor' ({tuple(tensor.shape)}) must be a multiple of "
                         f"2 * interleave_size = {2 * interleave_size}")


def interleave_glu_tensor(tensor: torch.Tensor, interleave_size: int) -> torch.Tensor:
    """[W_all; V_all] along dimension 0 -> [W 0:k; V 0:k; W k:2k; ...] (a
    new tensor of the same shape), k = interleave_size."""
    _check_glu(tensor, interleave_size, "interleave_glu_tensor")
    halves = tensor.reshape(2, -1, interleave_size, *tensor.shape[1:])  # [half, block, k, ...]
    return halves.transpose(0, 1).reshape(tensor.shape)


def deinterleave_glu_tensor(tensor: torch.Tensor, interleave_size: int) -> torch.Tensor:
    """The inverse of interleave_glu_tensor: block-interleaved rows back to
    [W_all; V_all]."""
    _check_glu(tensor, interleave_size, "deinterleave_glu_tensor")
    blocks = tensor.reshape(-1, 2, interleave_size, *tensor.shape[1:])  # [block, half, k, ...]
    return blocks.transpose(0, 1).reshape(tensor.shape)
