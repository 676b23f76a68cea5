"""Transformer Engine constructor arguments that seqfuse's modules refuse,
with the reason and what to use instead, in one table; and the helpers the
modules share to honour TE's remaining bookkeeping arguments (the RNG
tracker used for initialisation, deferred initialisation on the meta
device).

Every TE 2.20 constructor argument of the eight core modules is either taken
by the module's signature and works, or listed in REFUSED below: the module
raises NotImplementedError naming it (``refuse``) when it is given anything
but the value that means "off".  REFUSED is also what the compatibility
table (benchmarks/te_compat/compat_table.py) reads for the "refused"
column, and tests/test_te_api_table.py passes each entry's ``probe`` value
to the module to check that it really raises, naming the argument.
"""
import contextlib
import logging

import torch

from .._runtime import cuda_available

_log = logging.getLogger("seqfuse")

_TP = "tensor/sequence parallelism is not implemented; shard with FSDP2 (torch.distributed.fsdp.fully_shard)"
_UB = "userbuffers communication overlap belongs to tensor parallelism, which is not implemented"


def _entry(probe, off, why):
    """An argument refused unless it equals ``off`` (its TE default: the
    feature switched off); ``probe`` is a value that switches it on."""
    return {"probe": probe, "off": off, "why": why}


def _parallel(extra=()):
    table = {
        "sequence_parallel": _entry(True, (False, None), _TP),
        "tp_group": _entry("group", (None,), _TP),
        "tp_size": _entry(2, (1,), _TP),
    }
    for name in extra:
        table[name] = _entry(True, (False, None), _UB)
    return table


_UB_ARGS = ("ub_overlap_ag", "ub_overlap_rs", "ub_overlap_rs_dgrad", "ub_bulk_dgrad", "ub_bulk_wgrad")
_GEMM_COMMON = {
    "parallel_mode": _entry("column", (None,), _TP),
    "ub_name": _entry("qkv", (None,), _UB),
    "delay_wgrad_compute": _entry(True, (False,), "deferred weight-gradient GEMMs (pipeline-parallel "
                                  "schedules) are not implemented; the weight gradient is computed in "
                                  "the backward"),
    "symmetric_ar_type": _entry("one_shot", (None,), "symmetric-memory all-reduce belongs to tensor "
                                "parallelism, which is not implemented"),
}
_GATHERED = _entry(True, (False,), "return_layernorm_output_gathered gathers over a tensor-parallel group, "
                   "which is not implemented; use return_layernorm_output")
_SOFTMAX = _entry("off-by-one", ("vanilla",), "only the standard softmax ('vanilla') is implemented in "
                  "seqfuse's attention kernels")
_BOTTOM_RIGHT = _entry(True, (None,), "choosing the sliding-window diagonal apart from attn_mask_type is not "
                       "implemented; the mask type sets it (pass 'causal_bottom_right' or "
                       "'padding_causal_bottom_right' for bottom-right alignment)")
_ACT_PARAMS = _entry({"limit": 7.0}, (None,), "activation parameters (clamped SwiGLU) are not implemented; "
                     "activations take no parameters here")
_INTERLEAVED_ROPE = _entry(True, (False,), "interleaved rotary embeddings (rotating adjacent pairs) are not "
                           "implemented; use the default non-interleaved RoPE layout")

REFUSED = {
    "Linear": {**_parallel(_UB_ARGS), **_GEMM_COMMON},
    "LayerNormLinear": {**_parallel(_UB_ARGS), **_GEMM_COMMON, "return_layernorm_output_gathered": _GATHERED},
    "LayerNormMLP": {**_parallel(_UB_ARGS),
                     **{k: v for k, v in _GEMM_COMMON.items() if k not in ("ub_name", "parallel_mode")},
                     "return_layernorm_output_gathered": _GATHERED,
                     "set_parallel_mode": _entry(True, (False,), _TP),
                     "activation_params": _ACT_PARAMS},
    "LayerNorm": {"sm_margin": _entry(8, (0,), "SM reservation for overlapping communication kernels is "
                                      "not implemented; the norm kernels use the whole GPU")},
    "RMSNorm": {"sm_margin": _entry(8, (0,), "SM reservation for overlapping communication kernels is "
                                    "not implemented; the norm kernels use the whole GPU")},
    "DotProductAttention": {
        "sequence_parallel": _entry(True, (False,), _TP), "tp_size": _entry(2, (1,), _TP),
        "tp_group": _entry("group", (None,), _TP),
        "bottom_right_diagonal": _BOTTOM_RIGHT, "softmax_type": _SOFTMAX,
        "return_max_logit": _entry(True, (False,), "the attention kernels do not return the maximum logit"),
    },
    "MultiheadAttention": {
        **_parallel(_UB_ARGS), "set_parallel_mode": _entry(True, (False,), _TP),
        "bottom_right_diagonal": _BOTTOM_RIGHT, "softmax_type": _SOFTMAX,
        "rotary_pos_interleaved": _INTERLEAVED_ROPE,
    },
    "TransformerLayer": {
        **_parallel(), "set_parallel_mode": _entry(True, (False,), _TP),
        "ub_tp_comm_overlap": _entry(True, (False,), _UB),
        "bottom_right_diagonal": _BOTTOM_RIGHT, "enc_dec_bottom_right_diagonal": _BOTTOM_RIGHT,
        "softmax_type": _SOFTMAX, "rotary_pos_interleaved": _INTERLEAVED_ROPE,
        "activation_params": _ACT_PARAMS,
    },
}


def check_window(cls, attn_mask_type, window_size):
    """The window a call runs with: ``window_size`` itself, except (-1, 0)
    with a mask type that is not causal, which Transformer Engine reads as
    "no window" for such a mask (full attention; its check_set_window_size
    warns and sets (-1, -1)).  seqfuse's kernels would read (-1, 0) as a
    window ending at the diagonal, a causal mask, so the pair is read as TE
    reads it (None) and the reading is logged once per (module, mask)."""
    if window_size is None or "causal" in attn_mask_type:
        return window_size
    if isinstance(window_size, (tuple, list)) and len(window_size) == 2 and \
            window_size[0] == -1 and window_size[1] == 0:
        if (cls, attn_mask_type) not in _window_read_logged:
            _window_read_logged.add((cls, attn_mask_type))
            _log.warning("%s: window_size=(-1, 0) with attn_mask_type=%r is read as no window (full attention), "
                         "as Transformer Engine reads it; pass a causal attn_mask_type for causal attention",
                         cls, attn_mask_type)
        return None
    return window_size


_window_read_logged = set()


def refuse_fp8_io(cls, fp8_output, fp8_grad):
    """TE's forward flags fp8_output / fp8_grad (an FP8 output, an FP8 input
    gradient for the next FP8 module): refused when set."""
    for name, value in (("fp8_output", fp8_output), ("fp8_grad", fp8_grad)):
        if value:
            raise NotImplementedError(f"{cls}: argument '{name}'={value!r} is not supported: outputs and input "
                                      "gradients are in the input's dtype (the next module quantizes its own "
                                      "operands under FP8 autocast)")


def refuse(cls, values):
    """Raise NotImplementedError for the first argument in ``values`` (name ->
    value) that REFUSED[cls] lists and that is not switched off."""
    table = REFUSED[cls]
    for name, value in values.items():
        entry = table.get(name)
        if entry is None:
            continue
        if not any(value is off or (type(value) is type(off) and value == off) for off in entry["off"]):
            raise NotImplementedError(f"{cls}: argument '{name}'={value!r} is not supported: {entry['why']}")


def refused_defaults(cls):
    """{name: TE default} of REFUSED[cls]: the keyword arguments a module
    signature takes as ``**te_refused`` without a parameter of its own."""
    return {name: entry["off"][0] for name, entry in REFUSED[cls].items()}


def take_refused(cls, kwargs, unknown=TypeError):
    """Check ``kwargs`` (a module's catch-all keyword arguments): names
    REFUSED[cls] lists are refused unless off; any other name raises
    ``unknown`` (TypeError, as Python gives for an unknown keyword;
    MultiheadAttention and TransformerLayer have always raised
    NotImplementedError there and keep doing so)."""
    for name in kwargs:
        if name not in REFUSED[cls]:
            raise unknown(f"{cls}: unexpected argument {name!r} (not an argument of Transformer Engine's "
                          f"{cls} either)")
    refuse(cls, kwargs)


@contextlib.contextmanager
def rng_fork(get_rng_state_tracker, rng_tracker_name=None):
    """TE's initialisation under a model-parallel RNG tracker: the weights
    are drawn inside ``get_rng_state_tracker().fork(name)`` when a tracker is
    given (Megatron's CudaRNGStatesTracker), else from torch's generator."""
    if get_rng_state_tracker is None:
        yield
        return
    tracker = get_rng_state_tracker()
    fork = tracker.fork(rng_tracker_name) if rng_tracker_name is not None else tracker.fork()
    with fork:
        yield


def materialize_device():
    """Where deferred (meta) parameters are materialised by reset_parameters():
    the current CUDA device where seqfuse can use one, else the CPU (TE:
    the current CUDA device)."""
    if torch.cuda.is_available() and cuda_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def materialize(module):
    """Replace the module's own meta parameters by uninitialised ones on
    materialize_device() (same shape, dtype and requires_grad); the caller
    then initialises them.  Parameters already on a real device are kept."""
    device = None
    for name, p in list(module._parameters.items()):
        if p is not None and p.is_meta:
            device = device or materialize_device()
            module._parameters[name] = torch.nn.Parameter(torch.empty_like(p, device=device),
                                                          requires_grad=p.requires_grad)
