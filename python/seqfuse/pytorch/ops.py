"""te.ops: Transformer Engine's fusible operations (``te.ops.Sequential`` of
basic operations), run on seqfuse's modules.

Each basic operation holds its parameters under TE's names (BasicLinear
``weight``, Bias ``bias``, Linear ``weight`` and ``bias``, LayerNorm
``weight`` and ``bias``, RMSNorm ``weight``) and initialises them as TE
does (linear weights Kaiming-uniform with a = sqrt(5), biases 0, norm
weights 1, or 0 with zero_centered_gamma).

``Sequential(*ops)`` groups adjacent operations, at construction, where one
of seqfuse's fused modules computes the group, left to right:

  norm, linear, activation, linear     LayerNormMLP (norm kernel, FC1, the
                                       activation, FC2; both linears with a
                                       bias or both without)
  norm, linear                         LayerNormLinear
  BasicLinear, Bias                    Linear (bias in the GEMM epilogue)

where "norm" is LayerNorm or RMSNorm, "linear" is Linear or BasicLinear
(followed by a Bias, which then joins it), and "activation" one of GELU
(tanh), ReLU, SiLU, GEGLU, ReGLU, SwiGLU.  Every other operation runs on
its own (seqfuse's norm, activation and linear functions; a Bias is an add;
any torch.nn.Module in the list is called as is).  The construction logs
one line saying which groups are fused and which operations run one by one.

A fused group runs a seqfuse module built once on the meta device (no
memory) whose parameters are set, at every call, to the operations' own
parameter objects: the gradients land on the operations' parameters, and a
parameter swapped by FSDP2's fully_shard is the one read.  Under FP8
autocast these modules keep their FP8 scaling state themselves (it is not in
the Sequential's state_dict).

Quantize: outside FP8 autocast the identity (as in TE); under FP8 autocast
it raises NotImplementedError (seqfuse's GEMMs quantize their own inputs:
drop the Quantize operation).  Identity, ConstantScale (x * scale), Dropout
(torch's, training mode only) and Reshape (x.reshape(shape)) are torch
operations, and so are the activations seqfuse has no kernel for: GLU
(sigmoid(a) * b), QGELU (x * sigmoid(1.702 x)), QGEGLU, SReLU (relu(x)^2),
SReGLU, ClampedSwiGLU (GPT-OSS's), SiTUGLU (Kimi K3's soft-capped
SiLU GLU); they always run op by op.
L2Normalization (x / sqrt(sum x^2 + eps), TE's QK-norm op) runs on
seqfuse's RMSNorm kernel (MultiheadAttention's L2Normalization).

Extra inputs and outputs, as TE's: ``Sequential.forward(input,
*extra_inputs)`` hands the extra inputs, in order, to the operations that
take them (num_extra_inputs: GroupedLinear's split sizes, and its bias
scales with scale_bias=True, on seqfuse's grouped GEMM; ScaledSwiGLU's row
scales, on seqfuse's scaled_swiglu kernel; ScaledSiTUGLU's,
ScaledClampedQGeGLU's and ScaledSReLU's, in torch; AddExtraInput's addend),
and returns (output, *extra_outputs) when an operation makes one
(MakeExtraOutput); these operations run on their own.  FusibleOperation
is the operations' base class (isinstance checks);
is_op_fuser_grouped_tensor_path_supported answers False (GroupedLinear keeps
one parameter per group).  Not here (names TE has that seqfuse.pytorch.ops
lacks): the communication operations, FusedOperation and the fusion
registration functions (fused groups are planned inside Sequential).
"""
import logging
import math

import torch

from ..modules import LayerNormLinear, LayerNormMLP, Linear as _LinearModule, activation, layer_norm, rms_norm
from ..modules.grouped_linear import GroupedLinear as _GroupedLinearModule
from ..modules.multihead_attention import L2Normalization as _L2Normalization
from ..modules.te_compat import materialize, materialize_device, rng_fork
from ..ops import moe as moe_ops
from ..ops.args import as_float
from ..quantization import is_fp8_enabled

__all__ = ["FusibleOperation", "BasicOperation", "is_op_fuser_grouped_tensor_path_supported", "BasicLinear", "Bias", "Linear", "GroupedLinear", "LayerNorm", "RMSNorm", "GELU", "ReLU", "SiLU",
           "GEGLU", "ReGLU", "SwiGLU", "GLU", "QGELU", "QGEGLU", "SReLU", "SReGLU", "ClampedSwiGLU", "SiTUGLU", "ScaledSwiGLU", "ScaledSiTUGLU",
           "ScaledClampedQGeGLU", "ScaledSReLU", "AddExtraInput",
           "MakeExtraOutput", "L2Normalization", "Quantize",
           "Identity", "ConstantScale", "Dropout", "Reshape", "Sequential"]

_log = logging.getLogger("seqfuse")


def _refuse(cls, name, value, why):
    raise NotImplementedError(f"te.ops.{cls}: argument '{name}'={value!r} is not supported: {why}")


_TP = "tensor parallelism is not implemented; shard with FSDP2 (torch.distributed.fsdp.fully_shard)"


def _check_parallel(cls, tensor_parallel_mode=None, tensor_parallel_group=None, sequence_parallel=False,
                    userbuffers_options=None):
    for name, value, off in (("tensor_parallel_mode", tensor_parallel_mode, None),
                             ("tensor_parallel_group", tensor_parallel_group, None),
                             ("userbuffers_options", userbuffers_options, None)):
        if value is not off:
            _refuse(cls, name, value, _TP)
    if sequence_parallel:
        _refuse(cls, "sequence_parallel", sequence_parallel, _TP)


def _device(device):
    """TE's default device: the current CUDA device (seqfuse: the CPU where no
    CUDA device is usable)."""
    return materialize_device() if device is None else torch.device(device)


class FusibleOperation(torch.nn.Module):
    """TE's base class of the operations Sequential takes (for isinstance
    checks).  num_extra_inputs / num_extra_outputs: how many extra tensors
    an operation takes from / gives to Sequential (TE's attributes);
    is_fused_op: False for a basic operation (seqfuse's fused groups are
    planned inside Sequential, not exposed as operations)."""
    num_extra_inputs = 0
    num_extra_outputs = 0

    @property
    def is_fused_op(self):
        return False


class BasicOperation(FusibleOperation):
    """A fusible operation: ``forward(x, *extra_inputs)`` runs it on its own
    and returns its output, or (output, *extra_outputs) when it makes extra
    outputs."""


def is_op_fuser_grouped_tensor_path_supported(recipe, dtype):
    """TE's query: whether GroupedLinear can run its grouped-tensor path
    (single grouped weight / bias parameters) for this recipe and dtype.
    Always False in seqfuse: its GroupedLinear keeps one parameter per group
    and refuses single_grouped_weight / single_grouped_bias (TE's rule for a
    False answer: callers must not ask for single grouped parameters)."""
    from ..common.recipe import Recipe
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(f"is_op_fuser_grouped_tensor_path_supported: argument 'recipe' must be a Recipe or None, "
                        f"got {type(recipe).__name__}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"is_op_fuser_grouped_tensor_path_supported: argument 'dtype' must be a torch.dtype, "
                        f"got {type(dtype).__name__}")
    return False


def _draw_weight(op, weight):
    """The linear operations' weight initialisation (BasicLinear, Linear,
    GroupedLinear; torch's nn.Linear rule, Kaiming uniform with a=sqrt(5)),
    drawn under ``op``'s rng_state_tracker_function."""
    with rng_fork(op._rng_state_tracker_function):
        torch.nn.init.kaiming_uniform_(weight, a=math.sqrt(5))


class _LinearOperation(BasicOperation):
    """What BasicLinear and Linear share: the feature sizes, the main_grad
    flag, the RNG tracker, an [out, in] ``weight`` (and Linear's ``bias``)
    drawn as TE draws them unless on the meta device, and the forward through
    seqfuse's Linear.  ``bias``: None for BasicLinear, which has no bias
    attribute (as in TE), else whether Linear's ``bias`` is a Parameter
    (zeros) or None."""

    def __init__(self, in_features, out_features, bias, accumulate_into_main_grad, rng_state_tracker_function,
                 dtype, device):
        super().__init__()
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.accumulate_into_main_grad = bool(accumulate_into_main_grad)
        self._rng_state_tracker_function = rng_state_tracker_function
        kw = dict(dtype=dtype or torch.get_default_dtype(), device=_device(device))
        self.weight = torch.nn.Parameter(torch.empty(self.out_features, self.in_features, **kw))
        if bias is not None:
            self.bias = torch.nn.Parameter(torch.empty(self.out_features, **kw)) if bias else None
        if self.weight.device.type != "meta":
            self.reset_parameters()

    def _bias(self):
        return getattr(self, "bias", None)  # BasicLinear has no bias attribute

    @torch.no_grad()
    def reset_parameters(self):
        materialize(self)
        _draw_weight(self, self.weight)
        if self._bias() is not None:
            self.bias.zero_()

    def forward(self, x):
        bias = self._bias()
        return _run(_linear_runner(self, bias is not None), x, weight=self.weight, bias=bias)


class BasicLinear(_LinearOperation):
    """y = x W^T (no bias).  accumulate_into_main_grad: the weight gradient
    goes into ``weight.main_grad`` where the weight carries one (seqfuse's
    Linear does so whenever it is there)."""

    def __init__(self, in_features, out_features, *, device=None, dtype=None, tensor_parallel_mode=None,
                 tensor_parallel_group=None, sequence_parallel=False, rng_state_tracker_function=None,
                 accumulate_into_main_grad=False, userbuffers_options=None):
        _check_parallel(type(self).__name__, tensor_parallel_mode, tensor_parallel_group, sequence_parallel,
                        userbuffers_options)
        super().__init__(in_features, out_features, None, accumulate_into_main_grad, rng_state_tracker_function,
                         dtype, device)


class Bias(BasicOperation):
    """y = x + b."""

    def __init__(self, size, *, device=None, dtype=None, tensor_parallel=False, tensor_parallel_group=None):
        super().__init__()
        if tensor_parallel:
            _refuse("Bias", "tensor_parallel", tensor_parallel, _TP)
        if tensor_parallel_group is not None:
            _refuse("Bias", "tensor_parallel_group", tensor_parallel_group, _TP)
        self.bias = torch.nn.Parameter(torch.zeros(int(size), dtype=dtype or torch.get_default_dtype(),
                                                   device=_device(device)))

    @torch.no_grad()
    def reset_parameters(self):
        materialize(self)
        self.bias.zero_()

    def forward(self, x):
        return x + self.bias.to(x.dtype)


class Linear(_LinearOperation):
    """y = x W^T + b: BasicLinear and Bias in one operation."""

    def __init__(self, in_features, out_features, *, bias=True, device=None, dtype=None,
                 tensor_parallel_mode=None, tensor_parallel_group=None, sequence_parallel=False,
                 rng_state_tracker_function=None, accumulate_into_main_grad=False):
        _check_parallel("Linear", tensor_parallel_mode, tensor_parallel_group, sequence_parallel)
        super().__init__(in_features, out_features, bool(bias), accumulate_into_main_grad,
                         rng_state_tracker_function, dtype, device)


class GroupedLinear(BasicOperation):
    """TE's te.ops.GroupedLinear: num_groups linear layers over consecutive
    blocks of the input's first dimension, y_i = x_i W_i^T + b_i, the blocks
    sized by the extra input ``split_sizes`` (num_groups integers, a tensor
    as TE passes it, or a sequence of ints).  Equivalent to torch.split along
    dim 0, one torch.nn.Linear per block, torch.cat.

    forward(x, split_sizes) or, with scale_bias=True, forward(x, split_sizes,
    scales): the bias of group i is added scaled row by row, b_i *
    scales[row] (scales: one value per row of x's first dimension).

    Parameters under TE's names weight0 .. weight{G-1}, bias0 .. bias{G-1},
    initialised as TE does (Kaiming-uniform with a = sqrt(5), biases 0).  The
    GEMMs run on seqfuse's grouped GEMM through seqfuse's GroupedLinear
    module (three grouped GEMMs a step; FP8 under fp8_autocast with the
    module's recipes), built once on the meta device and run on this
    operation's own parameter objects.  seqfuse's grouped GEMM sizes its
    groups on the host: split sizes on a CUDA device are read back (one
    device synchronisation per call, logged once), as TE's own split-quantize
    path does.

    accumulate_into_main_grad: the weight gradient goes into each weight's
    ``main_grad`` (which must then be set, as TE requires); seqfuse also does
    so whenever every weight carries one.  Refused when switched on
    (NotImplementedError naming the argument): single_grouped_weight and
    single_grouped_bias (seqfuse keeps one parameter per group, see
    seqfuse.modules.grouped_linear) and delay_wgrad_compute."""
    num_extra_inputs = 1

    def __init__(self, num_groups, in_features, out_features, *, bias=True, device=None, dtype=None,
                 rng_state_tracker_function=None, accumulate_into_main_grad=False, single_grouped_weight=False,
                 single_grouped_bias=False, delay_wgrad_compute=False, scale_bias=False):
        super().__init__()
        for name, value, why in (
                ("single_grouped_weight", single_grouped_weight, "seqfuse keeps one weight parameter per group "
                 "(weight0 .. weight{G-1}) and its grouped GEMM takes them as a list"),
                ("single_grouped_bias", single_grouped_bias, "seqfuse keeps one bias parameter per group "
                 "(bias0 .. bias{G-1})"),
                ("delay_wgrad_compute", delay_wgrad_compute, "deferred weight-gradient GEMMs are not "
                 "implemented; the weight gradient is computed in the backward")):
            if value:
                _refuse("GroupedLinear", name, value, why)
        for name, value in (("num_groups", num_groups), ("in_features", in_features),
                            ("out_features", out_features)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"te.ops.GroupedLinear: argument '{name}' must be a positive int, got {value!r}")
        dtype = dtype or torch.get_default_dtype()
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"te.ops.GroupedLinear: argument 'dtype' must be float32, float16 or bfloat16, "
                             f"got {dtype}")
        self.num_groups, self.in_features, self.out_features = num_groups, in_features, out_features
        self.use_bias = bool(bias)
        self._scale_bias = bool(scale_bias) and self.use_bias
        if self._scale_bias:
            self.num_extra_inputs = 2  # split sizes and the bias scales (TE's count)
        self.accumulate_into_main_grad = bool(accumulate_into_main_grad)
        self._rng_state_tracker_function = rng_state_tracker_function
        kw = dict(dtype=dtype, device=_device(device))
        for g in range(num_groups):
            self.register_parameter(f"weight{g}", torch.nn.Parameter(torch.empty(out_features, in_features, **kw)))
            self.register_parameter(f"bias{g}", torch.nn.Parameter(torch.empty(out_features, **kw))
                                    if self.use_bias else None)
        if self.weight0.device.type != "meta":
            self.reset_parameters()

    @property
    def has_bias(self):
        """Whether an additive bias is applied (TE's property)."""
        return self.use_bias

    @torch.no_grad()
    def reset_parameters(self):
        materialize(self)
        for g in range(self.num_groups):
            _draw_weight(self, getattr(self, f"weight{g}"))
            if self.use_bias:
                getattr(self, f"bias{g}").zero_()

    def _runner(self):
        """seqfuse's GroupedLinear module for this operation, made on the meta
        device at the first call and kept outside the module tree (it holds
        FP8 scaling state only).  Its bias is fused in the GEMM unless the
        bias is scaled, which is added here."""
        runner = self.__dict__.get("_grouped_runner")
        if runner is None:
            runner = self.__dict__["_grouped_runner"] = _GroupedLinearModule(
                self.num_groups, self.in_features, self.out_features, bias=self.use_bias and not self._scale_bias,
                device="meta")
        return runner

    def _splits(self, split_sizes, rows):
        who, arg = "te.ops.GroupedLinear", "extra input 'split_sizes'"
        if isinstance(split_sizes, torch.Tensor) and split_sizes.device.type != "cpu":
            if not _logged_host_splits:
                _logged_host_splits.append(True)
                _log.info("%s: split sizes on %s are read to the host (one device synchronisation per "
                          "call): seqfuse's grouped GEMM sizes its groups on the host", who, split_sizes.device)
            split_sizes = split_sizes.cpu()
        splits = moe_ops.host_splits(who, split_sizes, arg)
        if len(splits) != self.num_groups:
            raise ValueError(f"{who}: {arg} must hold num_groups = {self.num_groups} sizes, got {len(splits)}")
        if sum(splits) != rows:
            raise ValueError(f"{who}: extra input 'split_sizes' adds up to {sum(splits)}, but the input's first "
                             f"dimension is {rows}")
        return splits

    def forward(self, x, split_sizes, scales=None):
        who = "te.ops.GroupedLinear"
        if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[-1] != self.in_features:
            raise ValueError(f"{who}: the input must be a tensor of at least 2 dimensions whose last is "
                             f"in_features = {self.in_features}, got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        if (scales is not None) != self._scale_bias:
            raise ValueError(f"{who}: the extra input 'scales' is taken exactly when scale_bias=True and "
                             f"bias=True (got scale_bias={self._scale_bias}, scales "
                             f"{'given' if scales is not None else 'missing'})")
        if self.accumulate_into_main_grad:
            for g in range(self.num_groups):
                if getattr(getattr(self, f"weight{g}"), "main_grad", None) is None:
                    raise RuntimeError(f"{who}: accumulate_into_main_grad=True but weight{g} has no main_grad "
                                       "(set it before the forward, as for TE)")
        splits = self._splits(split_sizes, x.shape[0])
        per_row = math.prod(x.shape[1:-1])  # rows of the flattened input per index of the first dimension
        runner = self._runner()
        params = {f"weight{g}": getattr(self, f"weight{g}") for g in range(self.num_groups)}
        if self.use_bias and not self._scale_bias:
            params.update({f"bias{g}": getattr(self, f"bias{g}") for g in range(self.num_groups)})
        for name, p in params.items():
            runner._parameters[name] = p
        y = runner(x.reshape(-1, self.in_features), [s * per_row for s in splits])
        if self._scale_bias:
            if not isinstance(scales, torch.Tensor) or scales.numel() != x.shape[0] * per_row:
                raise ValueError(f"{who}: extra input 'scales' must be a tensor with one value per row "
                                 f"({x.shape[0] * per_row}), got "
                                 f"{tuple(scales.shape) if isinstance(scales, torch.Tensor) else type(scales).__name__}")
            bias = torch.stack([getattr(self, f"bias{g}") for g in range(self.num_groups)])
            index = torch.repeat_interleave(torch.arange(self.num_groups, device=y.device),
                                            torch.tensor([s * per_row for s in splits], device=y.device))
            # In float32, as torch's per-group bias add reduces its gradient: the index's backward
            # sums each group's rows, and a bf16 sum over hundreds of rows loses ~1 % (test_cuda_grouped_linear).
            y = y + (bias.float()[index] * scales.reshape(-1, 1).float()).to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)


_logged_host_splits = []


class _Norm(BasicOperation):
    rms = False

    def __init__(self, normalized_shape, *, eps=1e-5, device=None, dtype=None, zero_centered_gamma=False,
                 sm_margin=0):
        super().__init__()
        cls = type(self).__name__
        if sm_margin != 0:
            _refuse(cls, "sm_margin", sm_margin, "SM reservation for communication kernels is not implemented")
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        if len(shape) != 1:
            raise NotImplementedError(f"te.ops.{cls}: normalization over the last dimension only; got "
                                      f"normalized_shape {shape}")
        self.normalized_shape, self.eps = shape, float(eps)
        self.zero_centered_gamma = bool(zero_centered_gamma)
        kw = dict(dtype=dtype or torch.get_default_dtype(), device=_device(device))
        self.weight = torch.nn.Parameter(torch.empty(shape, **kw))
        self.bias = None if self.rms else torch.nn.Parameter(torch.empty(shape, **kw))
        if self.weight.device.type != "meta":
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        materialize(self)
        self.weight.fill_(0.0 if self.zero_centered_gamma else 1.0)
        if self.bias is not None:
            self.bias.zero_()

    def forward(self, x):
        if self.rms:
            return rms_norm(x, self.weight, self.eps, self.zero_centered_gamma)
        return layer_norm(x, self.weight, self.bias, self.eps, self.zero_centered_gamma)


class LayerNorm(_Norm):
    """(x - mean) / sqrt(var + eps) * weight + bias over the last dimension."""
    rms = False


class RMSNorm(_Norm):
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension."""
    rms = True


class _Activation(BasicOperation):
    name = None  # seqfuse.ops.act's name

    def __init__(self, *, cache_quantized_input=False):
        super().__init__()
        if cache_quantized_input:
            _refuse(type(self).__name__, "cache_quantized_input", cache_quantized_input,
                    "the activation keeps its input in high precision for the backward")

    def forward(self, x):
        return activation(x, self.name)


class GELU(_Activation):
    """GELU, tanh approximation (TE's)."""
    name = "gelu"


class ReLU(_Activation):
    name = "relu"


class SiLU(_Activation):
    name = "silu"


class GEGLU(_Activation):
    """gelu(x[..., :n]) * x[..., n:] (TE's order: the gated half first)."""
    name = "geglu"


class ReGLU(_Activation):
    """relu(x[..., :n]) * x[..., n:]."""
    name = "reglu"


class SwiGLU(_Activation):
    """silu(x[..., :n]) * x[..., n:].  glu_interleave_size=k: the input's
    last dimension is block-interleaved [a 0:k, b 0:k, a k:2k, ...] (TE's
    layout for fused GLU kernels); it is put back in [a; b] order (a copy)
    before seqfuse's kernel, so such a SwiGLU runs op by op, not fused."""
    name = "swiglu"

    def __init__(self, *, cache_quantized_input=False, glu_interleave_size=None):
        super().__init__(cache_quantized_input=cache_quantized_input)
        if glu_interleave_size is not None and (not isinstance(glu_interleave_size, int)
                                                or glu_interleave_size <= 0):
            raise ValueError(f"te.ops.SwiGLU: argument 'glu_interleave_size' must be a positive int or None, "
                             f"got {glu_interleave_size!r}")
        self.glu_interleave_size = glu_interleave_size

    def forward(self, x):
        k = self.glu_interleave_size
        if k is not None:
            n = x.shape[-1]
            if n % (2 * k):
                raise ValueError(f"te.ops.SwiGLU: the input's last dimension ({n}) must be a multiple of "
                                 f"2 * glu_interleave_size = {2 * k}")
            blocks = x.reshape(*x.shape[:-1], n // (2 * k), 2, k)
            x = blocks.transpose(-3, -2).reshape(x.shape)
        return activation(x, self.name)


class _TorchActivation(BasicOperation):
    """An activation seqfuse has no kernel for, written in torch (gated ones
    split the last dimension in halves: gate first, as TE's)."""
    gated = False

    def __init__(self, *, cache_quantized_input=False):
        super().__init__()
        if cache_quantized_input:
            _refuse(type(self).__name__, "cache_quantized_input", cache_quantized_input,
                    "the activation keeps its input in high precision for the backward")

    @staticmethod
    def fn(x):
        raise NotImplementedError

    def forward(self, x):
        if self.gated:
            a, b = x.chunk(2, dim=-1)
            return self.fn(a) * b
        return self.fn(x)


def _qgelu(x):
    return x * torch.sigmoid(1.702 * x)


def _srelu(x):
    return torch.relu(x).square()


class GLU(_TorchActivation):
    """sigmoid(a) * b."""
    gated, fn = True, staticmethod(torch.sigmoid)


class QGELU(_TorchActivation):
    """x * sigmoid(1.702 x)."""
    fn = staticmethod(_qgelu)


class QGEGLU(_TorchActivation):
    """QGELU(a) * b."""
    gated, fn = True, staticmethod(_qgelu)


class SReLU(_TorchActivation):
    """relu(x)^2."""
    fn = staticmethod(_srelu)


class SReGLU(_TorchActivation):
    """relu(a)^2 * b."""
    gated, fn = True, staticmethod(_srelu)


class ClampedSwiGLU(BasicOperation):
    """GPT-OSS's SwiGLU as TE computes it, in torch (seqfuse has no kernel
    for it): with a, b the two halves of the last dimension,
    min(a, limit) * sigmoid(alpha * min(a, limit)) * (clamp(b, -limit, limit)
    + glu_linear_offset).  glu_interleave_size=k: the input is
    block-interleaved as for SwiGLU and put back in [a; b] order first."""

    def __init__(self, *, limit=7.0, alpha=1.702, glu_linear_offset=1.0, cache_quantized_input=False,
                 glu_interleave_size=None):
        super().__init__()
        if cache_quantized_input:
            _refuse("ClampedSwiGLU", "cache_quantized_input", cache_quantized_input,
                    "the activation keeps its input in high precision for the backward")
        # (a NaN limit or alpha would make every output NaN; limit=inf, no clamp, is a valid choice)
        op = "te.ops.ClampedSwiGLU"
        self.limit = as_float(op, "limit", limit, above=0)
        self.alpha = as_float(op, "alpha", alpha, finite=True)
        self.glu_linear_offset = as_float(op, "glu_linear_offset", glu_linear_offset, finite=True)
        _interleave_arg("ClampedSwiGLU", glu_interleave_size)
        self.glu_interleave_size = glu_interleave_size

    def forward(self, x):
        x = _deinterleave("ClampedSwiGLU", x, self.glu_interleave_size)
        return _clamped_glu(x, self.limit, self.alpha, self.glu_linear_offset)


def _clamped_glu(x, limit, alpha, offset):
    a, b = x.chunk(2, dim=-1)
    a = a.clamp(max=limit)
    return a * torch.sigmoid(alpha * a) * (b.clamp(-limit, limit) + offset)


def _situ_glu(x, beta1, beta2):
    a, b = x.chunk(2, dim=-1)
    return beta1 * torch.tanh(a / beta1) * torch.sigmoid(a) * (beta2 * torch.tanh(b / beta2))


def _check_betas(who, beta1, beta2):
    return tuple(as_float(f"te.ops.{who}", name, v, finite=True, above=0)
                 for name, v in (("beta1", beta1), ("beta2", beta2)))


class SiTUGLU(BasicOperation):
    """Kimi K3's soft-capped SiLU GLU as TE computes it, in torch (op by
    op): beta1 tanh(a / beta1) sigmoid(a) * beta2 tanh(b / beta2) for the
    halves a, b of the last dimension.  glu_interleave_size as for SwiGLU."""

    def __init__(self, *, beta1=4.0, beta2=25.0, cache_quantized_input=False, glu_interleave_size=None):
        super().__init__()
        if cache_quantized_input:
            _refuse("SiTUGLU", "cache_quantized_input", cache_quantized_input,
                    "the activation keeps its input in high precision for the backward")
        self.beta1, self.beta2 = _check_betas("SiTUGLU", beta1, beta2)
        self.glu_interleave_size = _interleave_arg("SiTUGLU", glu_interleave_size)

    def forward(self, x):
        return _situ_glu(_deinterleave("SiTUGLU", x, self.glu_interleave_size), self.beta1, self.beta2)


def _interleave_arg(who, k):
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k <= 0):
        raise ValueError(f"te.ops.{who}: argument 'glu_interleave_size' must be a positive int or None, got {k!r}")
    return k


def _scales_for(who, x_rows_shape, scales):
    if not torch.is_tensor(scales) or tuple(scales.shape) != tuple(x_rows_shape):
        raise ValueError(f"te.ops.{who}: the extra input 'scales' must have the input's shape less its last "
                         f"dimension {tuple(x_rows_shape)}, got "
                         f"{tuple(scales.shape) if torch.is_tensor(scales) else type(scales).__name__}")


def _deinterleave(who, x, k):
    """[a 0:k, b 0:k, a k:2k, ...] -> [a; b] along the last dimension (TE's block-interleaved GLU layout)."""
    n = x.shape[-1]
    if n % (2 * (k or 1)):
        raise ValueError(f"te.ops.{who}: the input's last dimension ({n}) must be a multiple of {2 * (k or 1)}")
    if k is None:
        return x
    return x.reshape(*x.shape[:-1], n // (2 * k), 2, k).transpose(-3, -2).reshape(x.shape)


class ScaledSwiGLU(BasicOperation):
    """SwiGLU scaled row by row by an extra input: forward(x, scales) =
    silu(a) * b * scales[..., None] for x [..., 2F] (halves a, b) and
    scales of x's shape less its last dimension; seqfuse's scaled_swiglu
    kernel (the MoE experts' activation times the routing probability),
    differentiable in x and scales.  glu_interleave_size as for SwiGLU."""
    num_extra_inputs = 1

    def __init__(self, glu_interleave_size=None, *, activation_recompute_in_mlp=False):
        super().__init__()
        if glu_interleave_size is not None and (isinstance(glu_interleave_size, bool)
                                                or not isinstance(glu_interleave_size, int)
                                                or glu_interleave_size <= 0):
            raise ValueError("te.ops.ScaledSwiGLU: argument 'glu_interleave_size' must be a positive int or "
                             f"None, got {glu_interleave_size!r}")
        if activation_recompute_in_mlp:  # TE refuses it too (its fused grouped MLP only)
            _refuse("ScaledSwiGLU", "activation_recompute_in_mlp", activation_recompute_in_mlp,
                    "TE's fused grouped-MLP recomputation; recompute with te.checkpoint around the block")
        self.glu_interleave_size = glu_interleave_size
        self.activation_recompute_in_mlp = False

    def forward(self, x, scales):
        from ..ops.moe import scaled_swiglu
        x = _deinterleave("ScaledSwiGLU", x, self.glu_interleave_size)
        if not torch.is_tensor(scales) or tuple(scales.shape) != tuple(x.shape[:-1]):
            raise ValueError(f"te.ops.ScaledSwiGLU: the extra input 'scales' must have the input's shape less its "
                             f"last dimension {tuple(x.shape[:-1])}, got "
                             f"{tuple(scales.shape) if torch.is_tensor(scales) else type(scales).__name__}")
        out = scaled_swiglu(x.reshape(-1, x.shape[-1]), scales.reshape(-1).to(x.dtype))
        return out.reshape(*x.shape[:-1], x.shape[-1] // 2)


class _ScaledTorch(BasicOperation):
    """An activation times per-row scales (an extra input) in torch, op by op:
    forward(x, scales) = f(x) * scales[..., None], scales rounded to x's
    dtype (TE computes in the input's dtype)."""
    num_extra_inputs = 1
    gated = True

    def __init__(self, glu_interleave_size=None, activation_recompute_in_mlp=False):
        super().__init__()
        who = type(self).__name__
        if activation_recompute_in_mlp:  # TE refuses it too (its fused grouped MLP only)
            _refuse(who, "activation_recompute_in_mlp", activation_recompute_in_mlp,
                    "TE's fused grouped-MLP recomputation; recompute with te.checkpoint around the block")
        self.glu_interleave_size = _interleave_arg(who, glu_interleave_size)
        self.activation_recompute_in_mlp = False

    def fn(self, x):
        raise NotImplementedError

    def forward(self, x, scales):
        who = type(self).__name__
        if self.gated:
            x = _deinterleave(who, x, self.glu_interleave_size)
        _scales_for(who, x.shape[:-1], scales)
        return self.fn(x) * scales.to(x.dtype)[..., None]


class ScaledSiTUGLU(_ScaledTorch):
    """SiTUGLU times per-row scales (TE's ScaledSiTUGLU)."""

    def __init__(self, glu_interleave_size=None, *, activation_recompute_in_mlp=False, beta1=4.0, beta2=25.0):
        super().__init__(glu_interleave_size, activation_recompute_in_mlp)
        self.beta1, self.beta2 = _check_betas("ScaledSiTUGLU", beta1, beta2)

    def fn(self, x):
        return _situ_glu(x, self.beta1, self.beta2)


class ScaledClampedQGeGLU(_ScaledTorch):
    """ClampedSwiGLU's formula times per-row scales (TE's ScaledClampedQGeGLU)."""

    def __init__(self, glu_interleave_size=None, *, activation_recompute_in_mlp=False, limit=7.0, alpha=1.702,
                 glu_linear_offset=1.0):
        super().__init__(glu_interleave_size, activation_recompute_in_mlp)
        ref = ClampedSwiGLU(limit=limit, alpha=alpha, glu_linear_offset=glu_linear_offset)  # checks the numbers
        self.limit, self.alpha, self.glu_linear_offset = ref.limit, ref.alpha, ref.glu_linear_offset

    def fn(self, x):
        return _clamped_glu(x, self.limit, self.alpha, self.glu_linear_offset)


class ScaledSReLU(_ScaledTorch):
    """relu(x)^2 times per-row scales (TE's ScaledSReLU; not gated)."""
    gated = False

    def __init__(self, *, activation_recompute_in_mlp=False):
        super().__init__(None, activation_recompute_in_mlp)

    def fn(self, x):
        return _srelu(x)


class AddExtraInput(BasicOperation):
    """forward(x, extra) = extra + x; in_place=True adds x into extra (TE's
    advanced option: extra is modified and returned)."""
    num_extra_inputs = 1

    def __init__(self, *, in_place=False):
        super().__init__()
        self._in_place = bool(in_place)

    def forward(self, x, extra):
        if self._in_place:
            return extra.add_(x)
        return extra + x


class MakeExtraOutput(BasicOperation):
    """Passes x on and gives it to Sequential as an extra output: forward(x)
    = (x, x); the gradients of both sum in backward (autograd).  in_place
    only lets TE accumulate that sum into the extra output's gradient
    buffer; the gradient is the same."""
    num_extra_outputs = 1

    def __init__(self, *, in_place=False):
        super().__init__()
        self._in_place = bool(in_place)

    def forward(self, x):
        return x, x


class L2Normalization(BasicOperation):
    """x / sqrt(sum(x^2) + eps) over the last dimension (no parameters).
    seq_length and micro_batch_size only warm up TE's JIT; kept, unused."""

    def __init__(self, *, eps=1e-6, seq_length=None, micro_batch_size=None):
        super().__init__()
        self.eps, self.seq_length, self.micro_batch_size = float(eps), seq_length, micro_batch_size

    def forward(self, x):
        return _L2Normalization(x.shape[-1], self.eps)(x)


class Quantize(BasicOperation):
    """Identity outside FP8 autocast; refused inside (see the module note)."""

    def __init__(self, forward=True, backward=False):
        super().__init__()
        self.quantize_forward, self.quantize_backward = bool(forward), bool(backward)

    def forward(self, x):
        if is_fp8_enabled() and (self.quantize_forward or self.quantize_backward):
            raise NotImplementedError("te.ops.Quantize under FP8 autocast is not supported: seqfuse's GEMM "
                                      "operations quantize their own inputs and output gradients; drop the "
                                      "Quantize operation")
        return x


class Identity(BasicOperation):
    """y = x."""

    def forward(self, x):
        return x


class ConstantScale(BasicOperation):
    """y = scale * x."""

    def __init__(self, scale):
        super().__init__()
        self.scale = float(scale)

    def forward(self, x):
        return x * self.scale


class Dropout(BasicOperation):
    """torch's dropout with probability p, in training mode only."""

    def __init__(self, p):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"te.ops.Dropout: argument 'p' must be in [0, 1), got {p}")
        self.p = float(p)

    def forward(self, x):
        return torch.nn.functional.dropout(x, p=self.p, training=self.training)


class Reshape(BasicOperation):
    """y = x.reshape(shape)."""

    def __init__(self, shape):
        super().__init__()
        self.shape = tuple(shape)

    def forward(self, x):
        return x.reshape(self.shape)


# ---- fused groups -----------------------------------------------------------

_ACT_NAMES = {GELU: "gelu", ReLU: "relu", SiLU: "silu", GEGLU: "geglu", ReGLU: "reglu", SwiGLU: "swiglu"}
_GATED = ("geglu", "reglu", "swiglu")


def _linear_runner(op, bias):
    """The operation's own seqfuse Linear, made on the meta device at its
    first call and kept outside the module tree (it holds no parameters of
    its own, only FP8 scaling state under FP8 autocast)."""
    runner = op.__dict__.get("_runner")
    if runner is None:
        runner = op.__dict__["_runner"] = _LinearModule(op.in_features, op.out_features, bias=bias,
                                                        device="meta")
    return runner


def _run(runner, x, **params):
    """Run a seqfuse module on the operations' own parameters."""
    for name, p in params.items():
        runner._parameters[name] = p
    return runner(x)


def _linear_at(ops, i):
    """(weight op, bias op or None, in, out, consumed) of a linear starting at
    ops[i] (Linear, or BasicLinear with an optional following Bias), else None."""
    op = ops[i] if i < len(ops) else None
    if isinstance(op, Linear):
        return op, op if op.bias is not None else None, op.in_features, op.out_features, 1
    if isinstance(op, BasicLinear):
        nxt = ops[i + 1] if i + 1 < len(ops) else None
        if isinstance(nxt, Bias) and nxt.bias.shape[0] == op.out_features:
            return op, nxt, op.in_features, op.out_features, 2
        return op, None, op.in_features, op.out_features, 1
    return None


def _bias_of(bias_op):
    return None if bias_op is None else bias_op.bias


class _Step:
    """One step of a Sequential's plan: a fused group or a single operation."""

    def __init__(self, label, ops, run):
        self.label, self.ops, self.run = label, ops, run


def _plan(ops):
    steps, i = [], 0
    while i < len(ops):
        op = ops[i]
        if isinstance(op, _Norm):
            lin1 = _linear_at(ops, i + 1)
            if lin1 is not None and lin1[2] == op.normalized_shape[0]:
                j = i + 1 + lin1[4]
                act = ops[j] if j < len(ops) else None
                fusable = type(act) in _ACT_NAMES and getattr(act, "glu_interleave_size", None) is None
                lin2 = _linear_at(ops, j + 1) if fusable else None
                if lin2 is not None:
                    name = _ACT_NAMES[type(act)]
                    ffn = lin1[3] // 2 if name in _GATED else lin1[3]
                    same_bias = (lin1[1] is None) == (lin2[1] is None)
                    fc1_out = ffn * (2 if name in _GATED else 1)
                    if same_bias and lin2[2] == ffn and lin2[3] == lin1[2] and fc1_out == lin1[3]:
                        steps.append(_mlp_step(op, lin1, name, lin2, ffn, ops[i:j + 1 + lin2[4]]))
                        i = j + 1 + lin2[4]
                        continue
                steps.append(_norm_linear_step(op, lin1, ops[i:i + 1 + lin1[4]]))
                i += 1 + lin1[4]
                continue
        if isinstance(op, BasicLinear):
            lin = _linear_at(ops, i)
            if lin[1] is not None:
                runner = _LinearModule(lin[2], lin[3], bias=True, device="meta")
                w, b = lin[0], lin[1]
                steps.append(_Step("Linear", ops[i:i + 2],
                                   lambda x, r=runner, w=w, b=b: _run(r, x, weight=w.weight, bias=b.bias)))
                i += 2
                continue
        steps.append(_Step(None, [op], op))
        i += 1
    return steps


def _norm_linear_step(norm, lin, group):
    w, b, fin, fout, _ = lin
    runner = LayerNormLinear(fin, fout, eps=norm.eps, bias=b is not None,
                             normalization="RMSNorm" if norm.rms else "LayerNorm",
                             zero_centered_gamma=norm.zero_centered_gamma, device="meta")

    def run(x):
        return _run(runner, x, layer_norm_weight=norm.weight, layer_norm_bias=norm.bias, weight=w.weight,
                    bias=_bias_of(b))
    return _Step("LayerNormLinear", group, run)


def _mlp_step(norm, lin1, name, lin2, ffn, group):
    w1, b1, hidden = lin1[0], lin1[1], lin1[2]
    w2, b2 = lin2[0], lin2[1]
    runner = LayerNormMLP(hidden, ffn, eps=norm.eps, bias=b1 is not None, activation=name,
                          normalization="RMSNorm" if norm.rms else "LayerNorm",
                          zero_centered_gamma=norm.zero_centered_gamma, device="meta")

    def run(x):
        return _run(runner, x, layer_norm_weight=norm.weight, layer_norm_bias=norm.bias, fc1_weight=w1.weight,
                    fc1_bias=_bias_of(b1), fc2_weight=w2.weight, fc2_bias=_bias_of(b2))
    return _Step("LayerNormMLP", group, run)


class Sequential(torch.nn.Module):
    """TE's te.ops.Sequential: operations applied in order, adjacent ones
    fused where a seqfuse module computes them together (module note)."""

    def __init__(self, *args):
        super().__init__()
        ops = []
        for i, op in enumerate(args):
            if isinstance(op, Sequential):
                ops.extend(op._ops)
            elif isinstance(op, torch.nn.Module):
                ops.append(op)
            else:
                raise TypeError(f"te.ops.Sequential: argument {i} must be a torch.nn.Module (a te.ops "
                                f"operation), got {type(op).__name__}")
        self._ops = torch.nn.ModuleList(ops)
        self._steps = _plan(list(ops))
        fused = [f"{'+'.join(type(o).__name__ for o in s.ops)} as seqfuse {s.label}"
                 for s in self._steps if s.label]
        alone = [type(s.ops[0]).__name__ for s in self._steps if not s.label]
        _log.info("te.ops.Sequential: fused %s; op by op (no fused seqfuse kernel for them here): %s",
                  ", ".join(fused) or "nothing", ", ".join(alone) or "nothing")

    def __setstate__(self, state):
        # deepcopy and unpickling copy the operations but not the steps' closures, which would still
        # run on the original's parameters: plan again over the copied operations
        super().__setstate__(state)
        self._steps = _plan(list(self._ops))

    def plan(self):
        """[(fused module name or None, [operation class names])] of the steps."""
        return [(s.label, [type(o).__name__ for o in s.ops]) for s in self._steps]

    def __len__(self):
        return len(self._ops)

    def __getitem__(self, i):
        return self._ops[i]

    def forward(self, input, *extra_inputs, op_kwargs=None):
        """The operations in order: (output, *extra outputs) when an operation
        makes extra outputs, else output.  extra_inputs go to the operations
        that take them (num_extra_inputs), in order."""
        if op_kwargs:
            raise NotImplementedError("te.ops.Sequential: argument 'op_kwargs' is not supported: it passes "
                                      "caller-allocated output / grad-input buffers to TE's grouped linear and "
                                      "grouped MLP operations; seqfuse's GroupedLinear allocates its own "
                                      "(leave op_kwargs out)")
        need = sum(getattr(op, "num_extra_inputs", 0) for op in self._ops)
        if len(extra_inputs) != need:
            raise ValueError(f"te.ops.Sequential: {len(extra_inputs)} extra input(s) given, but its operations "
                             f"take {need}")
        x, rest, extra_outputs = input, list(extra_inputs), []
        for step in self._steps:
            op = step.ops[0]
            n_in = getattr(op, "num_extra_inputs", 0) if step.label is None else 0
            n_out = getattr(op, "num_extra_outputs", 0) if step.label is None else 0
            if n_in or n_out:
                args, rest = rest[:n_in], rest[n_in:]
                y = op(x, *args)
                if n_out:
                    x, ys = y[0], y[1:]
                    extra_outputs.extend(ys)
                else:
                    x = y
            else:
                x = step.run(x)
        return (x, *extra_outputs) if extra_outputs else x
