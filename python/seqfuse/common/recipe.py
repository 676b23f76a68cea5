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
import math
import numbers
from dataclasses import dataclass
from enum import Enum

import torch


class _FormatSpec:
    def __init__(self, forward, backward):
        self.forward_dtype, self.backward_dtype = forward, backward
        #: (forward, backward) dtypes, indexed by "is a backward tensor": what the casts read
        #: (``fmt._value_.dtypes``: a plain attribute, where ``fmt.value`` and a dict keyed by
        #: the member go through Enum's Python-level property and hash)
        self.dtypes = (forward, backward)
        self.max_fwd = _MAX[forward]
        self.max_bwd = _MAX[backward]

    def __repr__(self):
        return f"(forward={self.forward_dtype}, backward={self.backward_dtype})"


_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
#: the smallest normal value of each format (2**-6, 2**-14)
_TINY = {torch.float8_e4m3fn: 2.0 ** -6, torch.float8_e5m2: 2.0 ** -14}


def _spec_field(name):
    """A read-only Format attribute: the field ``name`` of the member's _FormatSpec."""
    return property(lambda self: getattr(self.value, name))


class Format(Enum):
    """The FP8 formats of forward tensors (inputs, weights) and backward
    tensors (output gradients).  HYBRID: E4M3 forward, E5M2 backward."""

    E4M3 = _FormatSpec(torch.float8_e4m3fn, torch.float8_e4m3fn)
    E5M2 = _FormatSpec(torch.float8_e5m2, torch.float8_e5m2)
    HYBRID = _FormatSpec(torch.float8_e4m3fn, torch.float8_e5m2)

    def __reduce_ex__(self, protocol):
        # by name: the default pickles the value, which compares by identity
        # and so matched no member when unpickled (a recipe could not cross
        # into a spawned process or a pickled config)
        return getattr, (type(self), self.name)

    forward_dtype = _spec_field("forward_dtype")
    backward_dtype = _spec_field("backward_dtype")
    max_fwd = _spec_field("max_fwd")
    max_bwd = _spec_field("max_bwd")


class Recipe:
    """Base class; the predicates say which family a recipe belongs to.

    A recipe checks its fields when it is made and again whenever one is
    assigned afterwards (``recipe.amax_history_len = 0`` raises, naming the
    field, and leaves the recipe as it was): the scaling state is built from
    these values later, far from the line that set them."""

    def __setattr__(self, name, value):
        if not self.__dict__.get("_checked", False):
            object.__setattr__(self, name, value)  # being constructed: __post_init__ checks
            return
        missing = object()
        previous = self.__dict__.get(name, missing)
        object.__setattr__(self, name, value)
        try:
            self._check()
        except Exception:
            if previous is missing:
                object.__delattr__(self, name)
            else:
                object.__setattr__(self, name, previous)
            raise

    def __post_init__(self):
        self._check()
        object.__setattr__(self, "_checked", True)

    def _check(self):
        """Raise TypeError / ValueError naming the first field that breaks its rule."""

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


def _check_format(fmt, name="fp8_format"):
    if not isinstance(fmt, Format):
        raise TypeError(f"{name} must be a seqfuse.common.recipe.Format, got {fmt!r}")


def _whole(recipe, name, low, high=None):
    """Field ``name`` of ``recipe`` as an int: a whole, finite real number in
    [low, high] (a whole float such as 2.0 is fine; a bool, 0.5 or nan is
    not: the state keeps ints, and int() would truncate or fail far away)."""
    cls = type(recipe).__name__
    value = getattr(recipe, name)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{cls}: {name} must be an integer, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{cls}: {name} must be finite, got {value!r}")
    if value != int(value):
        raise ValueError(f"{cls}: {name} must be a whole number, got {value!r}")
    value = int(value)
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{cls}: {name} must be {bound}, got {value}")
    return value


def _margin(recipe):
    """The margin field: whole, and within the binades of the recipe's
    narrower format.  A scale ``fp8_max / amax / 2**margin`` maps a tensor's
    largest value to ``fp8_max / 2**margin``; past ``log2(fp8_max /
    smallest normal)`` binades (14 for E4M3, 29 for E5M2) that value is
    subnormal or rounds to zero, so every cast would return (nearly) all
    zeros, and a margin as negative saturates everything above amax * 2**margin."""
    bound = min(int(math.floor(math.log2(_MAX[dt] / _TINY[dt]))) for dt in recipe.fp8_format.value.dtypes)
    value = _whole(recipe, "margin", -64, 64)
    if abs(value) > bound:
        raise ValueError(f"{type(recipe).__name__}: margin must be in [-{bound}, {bound}] with "
                         f"fp8_format={recipe.fp8_format.name} (a tensor's largest value is cast to "
                         f"fp8_max / 2**margin, which past that range falls below the format's smallest "
                         f"normal value or saturates everything above amax * 2**margin), got {value}")


def _flag(recipe, name):
    value = getattr(recipe, name)
    if not isinstance(value, (bool, int)) or value not in (0, 1):
        raise TypeError(f"{type(recipe).__name__}: {name} must be a bool, got {value!r}")


def _attention_flags(recipe):
    """fp8_dpa (FP8 attention: DotProductAttention under DelayedScaling, see
    seqfuse.quantization.attention) and fp8_mha, which is refused: seqfuse's
    projections hand Q/K/V and the attention output to each other in high
    precision, so an FP8 multi-head-attention block has nothing to run."""
    for name in ("fp8_dpa", "fp8_mha"):
        _flag(recipe, name)
    if recipe.fp8_mha:
        raise NotImplementedError(f"{type(recipe).__name__}: fp8_mha=True is not supported (the projections "
                                  "around attention exchange high-precision tensors); fp8_dpa=True runs the "
                                  "attention itself in FP8")


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

    def _check(self):
        _check_format(self.fp8_format)
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError("DelayedScaling: amax_compute_algo must be 'max' or 'most_recent' "
                             f"(a callable is not supported), got {self.amax_compute_algo!r}")
        if self.scaling_factor_compute_algo is not None:
            raise NotImplementedError("DelayedScaling: a custom scaling_factor_compute_algo is not "
                                      "supported; the fused update computes fp8_max / amax / 2**margin")
        _whole(self, "amax_history_len", 1)
        _margin(self)
        _flag(self, "reduce_amax")
        _attention_flags(self)


@dataclass(kw_only=True)
class Float8CurrentScaling(Recipe):
    """Per-tensor scaling from the tensor's own amax, computed just before the cast."""

    fp8_format: Format = Format.HYBRID
    margin: int = 0
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def _check(self):
        _check_format(self.fp8_format)
        _margin(self)
        _attention_flags(self)


@dataclass(kw_only=True)
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

    def _check(self):
        _check_format(self.fp8_format)
        for name in ("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim"):
            if getattr(self, name) not in (1, 2):
                raise ValueError(f"Float8BlockScaling: {name} must be 1 (1x128) or 2 (128x128), "
                                 f"got {getattr(self, name)!r}")
        _attention_flags(self)


@dataclass(kw_only=True)
class MXFP8BlockScaling(Recipe):
    """MXFP8: FP8 values with an E8M0 scale per 32 consecutive elements."""

    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def _check(self):
        _check_format(self.fp8_format)
        _attention_flags(self)


@dataclass(kw_only=True)
class NVFP4BlockScaling(Recipe):
    """NVFP4: E2M1 values, an E4M3 scale per 16 elements, an fp32 scale per tensor."""

    fp4_format: str = "E2M1"
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def _check(self):
        if self.fp4_format != "E2M1":
            raise ValueError(f"NVFP4BlockScaling: fp4_format must be 'E2M1', got {self.fp4_format!r}")
        _attention_flags(self)


__all__ = ["Format", "Recipe", "DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling",
           "MXFP8BlockScaling", "NVFP4BlockScaling"]
