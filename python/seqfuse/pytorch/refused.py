"""Transformer Engine public names that seqfuse does not serve, kept callable
so that TE code reaching them stops with a NotImplementedError that names
the function and says what to use instead, rather than an AttributeError
(or, worse, a stand-in that pretends to work).

Where TE's function has an "off" setting that does nothing (onnx_export
and get_cpu_offload_context with enabled=False), that setting is served
exactly as TE serves it and only the "on" setting is refused, the same
convention as the refused module arguments (seqfuse.modules.te_compat).

REFUSED_NAMES maps each name to the reason shown in the README's
compatibility table (benchmarks/te_compat/compat_table.py reads it) and a
probe call that must raise (tests/test_te_api_table.py makes it).
REFUSED_FORWARD does the same for the forward arguments of the eight core
modules that the modules refuse (the refusals themselves are raised by the
modules' forwards).
"""
import contextlib
from typing import Optional

import torch

__all__ = ["initialize_ub", "destroy_ub", "get_cpu_offload_context", "onnx_export", "REFUSED_NAMES", "REFUSED_FORWARD"]

_UB = ("seqfuse has no Userbuffers (communication overlapped with the tensor-parallel GEMMs); drop the call "
       "and leave the modules' ub_* arguments off")
_OFFLOAD = ("seqfuse has no activation CPU offloading; use torch.autograd.graph.save_on_cpu() around the "
            "forward, or activation recomputation (te.checkpoint, LayerNormMLP(checkpoint=True))")
_ONNX = ("seqfuse's kernels are not ONNX-exportable (they run through seqfuse._C, not registered torch "
         "ops); export the torch model the seqfuse modules replace")

#: name -> {"why": reason, "probe": (args, kwargs) that must raise NotImplementedError}
REFUSED_NAMES = {
    "initialize_ub": {"why": _UB, "probe": (([4096, 1024], 2), {})},
    "destroy_ub": {"why": _UB, "probe": ((), {})},
    "get_cpu_offload_context": {"why": _OFFLOAD + "; enabled=False (TE's default) is taken and returns TE's "
                                "no-op pair", "probe": ((), {"enabled": True})},
    "onnx_export": {"why": _ONNX + "; enabled=False (TE's default) is taken as a context that does nothing",
                    "probe": ((), {"enabled": True})},
}


def _refuse(name, what):
    raise NotImplementedError(f"{name}: {what} is not supported: {REFUSED_NAMES[name]['why']}")


def initialize_ub(shape: list, tp_size: int, use_fp8: bool = False, quantization_modes=None,
                  dtype: torch.dtype = torch.bfloat16, ub_cfgs=None, bootstrap_backend=None,
                  with_cublasmp: bool = False) -> None:
    """TE's Userbuffers set-up: refused (see REFUSED_NAMES)."""
    _refuse("initialize_ub", "initialising Userbuffers")


def destroy_ub() -> None:
    """TE's Userbuffers tear-down: refused (see REFUSED_NAMES)."""
    _refuse("destroy_ub", "tearing down Userbuffers")


def get_cpu_offload_context(enabled: bool = False, num_layers: Optional[int] = 1, model_layers: int = 1,
                            offload_activations: bool = True, offload_weights: bool = False,
                            double_buffering: bool = False, manual_synchronization: bool = False,
                            retain_pinned_cpu_buffers: bool = False, offload_stream=None):
    """TE's CPU offloading context.  enabled=False returns what TE returns
    then: (a null context, the identity sync function), plus None as the
    manual controller when manual_synchronization=True.  enabled=True is
    refused."""
    if not isinstance(enabled, bool):
        raise TypeError(f"get_cpu_offload_context: argument 'enabled' must be a bool, got {enabled!r}")
    if enabled:
        _refuse("get_cpu_offload_context", "enabled=True")
    if manual_synchronization:
        return contextlib.nullcontext(), (lambda x: x), None
    return contextlib.nullcontext(), (lambda x: x)


@contextlib.contextmanager
def onnx_export(enabled: bool = False):
    """TE's ONNX export mode.  enabled=False is a context that changes
    nothing (as TE's); enabled=True is refused."""
    if not isinstance(enabled, bool):
        raise TypeError(f"onnx_export: argument 'enabled' must be a bool, got {enabled!r}")
    if enabled:
        _refuse("onnx_export", "enabled=True")
    yield


# ---- forward arguments ------------------------------------------------------------------------------
# TE 2.20 forward arguments of the eight core modules that seqfuse's modules refuse: each raises
# NotImplementedError naming the argument when switched on and is taken at TE's default (off).  The
# compatibility table shows these reasons; tests/test_te_api_table.py switches each one on (its
# FORWARD_REFUSED probes, whose keys must be these) and checks the refusal.
def _forward_refusals():
    from .attention import FORWARD_REFUSED_WHY as dpa_why  # the facade's own messages
    fp8_io = ("outputs and input gradients are in the input's dtype (the next module quantizes its own "
              "operands under FP8 autocast)")
    bias = "attention biases (ALiBi, pre/post-scale bias) are not implemented"
    kv_cache = "KV caches (incremental decoding) are not implemented in the modules"
    attention = {"bottom_right_diagonal": dpa_why["bottom_right_diagonal"], "core_attention_bias_type": bias,
                 "core_attention_bias": bias, "alibi_slopes": bias, "inference_params": kv_cache,
                 "pad_between_seqs": dpa_why["pad_between_seqs"]}
    return {
        "Linear": {"fp8_output": fp8_io, "fp8_grad": fp8_io},
        "LayerNormLinear": {"fp8_output": fp8_io, "fp8_grad": fp8_io},
        "LayerNormMLP": {}, "LayerNorm": {}, "RMSNorm": {},
        "DotProductAttention": {**attention, **dpa_why},
        "MultiheadAttention": dict(attention),
        "TransformerLayer": {**attention, "enc_dec_bottom_right_diagonal": dpa_why["bottom_right_diagonal"]},
    }


#: class -> {forward argument: reason}
REFUSED_FORWARD = _forward_refusals()
