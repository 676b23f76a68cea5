"""Quantization recipes, named and parameterized as in Transformer Engine's
``transformer_engine.common.recipe`` so that

    from seqfuse.common.recipe import Format, DelayedScaling

ports code written for it by changing the import.

A recipe is a plain description; seqfuse.quantization turns it into scaling
state and kernels:

- ``DelayedScaling``: one scale per tensor from a history of amaxes (the
  previous steps'); the fused update kernel runs once per step.
- ``Float8CurrentScaling``: one scale per tensor from this tensor's own amax
  (an extra pass over the tensor, no history).
- ``Float8BlockScaling``: FP8 with fp32 scales per 1x128 (activations,
  gradients) or 128x128 (weights) block, cuBLASLt's block-scaled FP8 on Hopper.
- ``MXFP8BlockScaling``: FP8 with an E8M0 scale per 32 elements.
- ``NVFP4BlockScaling``: FP4 (E2M1) with an E4M3 scale per 16 elements and an
  fp32 scale per tensor.
MXFP8 and NVFP4 GEMMs need compute capability 10.x; on Hopper seqfuse
quantizes and dequantizes them exactly, and their GEMM is the GEMM layer's
business (it raises NotImplementedError or runs a named emulation).
"""
from dataclasses import dataclass
from enum import Enum

import torch


class _FormatSpec:
    def __init__(self, fwd, bwd):
        self.fwd_dtype, self.bwd_dtype = fwd, bwd
        self.max_fwd = _MAX[fwd]
        self.max_bwd = _MAX[bwd]

    def __repr__(self):
        return f"(fwd={self.fwd_dtype}, bwd={self.bwd_dtype})"


_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


class Format(Enum):
    """The FP8 formats of forward tensors (inputs, weights) and backward
    tensors (output gradients).  HYBRID: E4M3 forward, E5M2 backward."""

    E4M3 = _FormatSpec(torch.float8_e4m3fn, torch.float8_e4m3fn)
    E5M2 = _FormatSpec(torch.float8_e5m2, torch.float8_e5m2)
    HYBRID = _FormatSpec(torch.float8_e4m3fn, torch.float8_e5m2)

    @property
    def fwd_dtype(self):
        return self.value.fwd_dtype

    @property
    def bwd_dtype(self):
        return self.value.bwd_dtype

    @property
    def max_fwd(self):
        return self.value.max_fwd

    @property
    def max_bwd(self):
        return self.value.max_bwd


class Recipe:
    """Base class; the predicates say which family a recipe belongs to."""

    def delayed(self):
        return isinstance(self, DelayedScaling)

    def float8_current_scaling(self):
        return isinstance(self, Float8CurrentScaling)

    def float8_block_scaling(self):
        return isinstance(self, Float8BlockScaling)

    def mxfp8(self):
        return isinstance(self, MXFP8BlockScaling)

    def nvfp4(self):
        return isinstance(self, NVFP4BlockScaling)

    def float8_per_tensor_scaling(self):
        return self.delayed() or self.float8_current_scaling()


def _check_format(fmt):
    if not isinstance(fmt, Format):
        raise TypeError(f"fp8_format must be a seqfuse.common.recipe.Format, got {fmt!r}")


@dataclass
class DelayedScaling(Recipe):
    """Per-tensor scaling from the amax history of previous steps.

    margin: scale = fp8_max / amax / 2**margin.
    fp8_format: Format.HYBRID (default), E4M3 or E5M2.
    amax_history_len: steps of amax kept per tensor (the window).
    amax_compute_algo: "max" (max over the window) or "most_recent".
    reduce_amax: reduce the amaxes across the autocast's amax_reduction_group
    (one all-reduce per step) before the update.
    """

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    scaling_factor_compute_algo: object = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self):
        _check_format(self.fp8_format)
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError("DelayedScaling: amax_compute_algo must be 'max' or 'most_recent' "
                             f"(a callable is not supported), got {self.amax_compute_algo!r}")
        if self.scaling_factor_compute_algo is not None:
            raise NotImplementedError("DelayedScaling: a custom scaling_factor_compute_algo is not "
                                      "supported; the fused update computes fp8_max / amax / 2**margin")
        if int(self.amax_history_len) < 1:
            raise ValueError(f"DelayedScaling: amax_history_len must be >= 1, got {self.amax_history_len}")
        if not -64 <= int(self.margin) <= 64:
            raise ValueError(f"DelayedScaling: margin must be in [-64, 64], got {self.margin}")


@dataclass
class Float8CurrentScaling(Recipe):
    """Per-tensor scaling from the tensor's own amax, computed just before the cast."""

    fp8_format: Format = Format.HYBRID
    margin: int = 0
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self):
        _check_format(self.fp8_format)


@dataclass
class Float8BlockScaling(Recipe):
    """FP8 with fp32 block scales: 1x128 blocks for activations and gradients
    (x_block_scaling_dim=1, grad_block_scaling_dim=1), 128x128 for weights
    (w_block_scaling_dim=2).  E4M3 throughout by default."""

    fp8_format: Format = Format.E4M3
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self):
        _check_format(self.fp8_format)
        for name in ("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim"):
            if getattr(self, name) not in (1, 2):
                raise ValueError(f"Float8BlockScaling: {name} must be 1 (1x128) or 2 (128x128)")


@dataclass
class MXFP8BlockScaling(Recipe):
    """MXFP8: FP8 values with an E8M0 scale per 32 consecutive elements."""

    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self):
        _check_format(self.fp8_format)


@dataclass
class NVFP4BlockScaling(Recipe):
    """NVFP4: E2M1 values, an E4M3 scale per 16 elements, an fp32 scale per tensor."""

    fp4_format: str = "E2M1"
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self):
        if self.fp4_format != "E2M1":
            raise ValueError(f"NVFP4BlockScaling: fp4_format must be 'E2M1', got {self.fp4_format!r}")


__all__ = ["Format", "Recipe", "DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling",
           "MXFP8BlockScaling", "NVFP4BlockScaling"]
