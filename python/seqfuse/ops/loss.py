"""Fused cross-entropy (csrc/loss/): per-row loss and log-sum-exp in one read
of the logits (online softmax, nothing materialized), and the gradient in
one more read + write, optionally over the logits buffer itself.

Plain functional ops without autograd; seqfuse.modules.cross_entropy builds
the autograd Functions (cross_entropy, parallel_cross_entropy,
linear_cross_entropy) on them.
"""
import torch

from .. import _C
from ._call import as_float, as_int, given_out, mark_written, stream_for
from . import device_checks as _checks
from . import pending_errors as _pending

_FLOAT_INPUTS = (torch.float32, torch.float16, torch.bfloat16)


def _check(logits, labels, op):
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"{op}: argument 'logits' must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dtype not in _FLOAT_INPUTS:
        raise TypeError(f"{op}: argument 'logits' must have dtype float32, float16 or bfloat16, got {logits.dtype}")
    if not isinstance(labels, torch.Tensor) or labels.dtype != torch.int64:
        got = labels.dtype if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise TypeError(f"{op}: argument 'labels' must be an int64 torch.Tensor, got {got}")
    if logits.dim() != 2:
        raise ValueError(f"{op}: argument 'logits' must be 2-D [N, V], got shape {tuple(logits.shape)}")
    if labels.shape != logits.shape[:1]:
        raise ValueError(f"{op}: argument 'labels' must have shape [N] = [{logits.shape[0]}], got {tuple(labels.shape)}")


def _labels_in_range(op, logits, labels, ignore_index, check_labels):
    """The synchronous label check (device_checks.check_labels)."""
    if check_labels and labels.device == logits.device:
        _checks.check_labels(op, labels, logits.shape[1], as_int(op, "ignore_index", ignore_index))


def _label_record(op, logits, labels, ignore_index, check_labels, labels_of):
    """Check the labels as the mode says; return the (claim, record) pair the
    kernel records a bad label into (deferred), or (None, None) when the
    check happened here or is not wanted."""
    if not check_labels:
        return None, None
    if labels.is_cuda:  # (is_cuda and get_device are cheaper than building torch.device objects)
        same_device = logits.is_cuda and labels.get_device() == logits.get_device()
    else:
        same_device = labels.device == logits.device
    if not same_device:
        return None, None  # the C entry refuses them
    origin_op, name, rows = labels_of if labels_of is not None else (op, "labels", labels)
    if not _checks.defers_label_check(labels):
        if rows is labels:  # checked here, named as the caller's argument
            _checks.check_labels(origin_op, labels, logits.shape[1], as_int(op, "ignore_index", ignore_index), name)
        else:  # a slice of the caller's tensor: the caller checks the whole tensor
            _labels_in_range(op, logits, labels, ignore_index, True)
        return None, None
    _pending.raise_pending()  # what earlier calls recorded, now that the host passes by
    sink = _pending.sink_for(op, labels)
    if sink is None:
        return None, None
    _pending.note_labels(origin_op, name, rows)
    return sink.claim, sink.record


def cross_entropy_forward(logits, labels, ignore_index=-100, label_smoothing=0.0, check_labels=True, *,
                          labels_of=None):
    """Per-row cross-entropy of ``logits`` [N, V] (fp32/fp16/bf16, unit stride
    along V) against int64 ``labels`` [N].  Returns ``(loss, lse)``, both
    float32 [N]: the loss of each row (0 where the label is ``ignore_index``)
    and log-sum-exp of each row (what :func:`cross_entropy_backward` needs).

    A label outside [0, V) that is not ``ignore_index`` is a ValueError
    naming its row, and its loss is NaN (never a finite number).  On the CPU
    the call raises it.  On CUDA ``check_labels`` follows the label-check
    mode (device_checks): "deferred" (default) raises it later without a
    host wait (at the backward, the next loss call, or
    ``check_pending_errors()``), "sync" at the call with one host
    synchronization, "off" never.  ``check_labels=False`` skips it for
    labels already checked.  ``labels_of=(op, name, tensor)``: ``labels``
    are rows of ``tensor``, argument ``name`` of ``op`` (a deferred error
    names those, e.g. linear_cross_entropy's chunks)."""
    _check(logits, labels, "cross_entropy_forward")
    op = "cross_entropy_forward"
    claim, record = _label_record(op, logits, labels, ignore_index, check_labels, labels_of)
    loss = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(loss)
    _C.cross_entropy_forward(logits.detach(), labels, as_int(op, "ignore_index", ignore_index),
                             as_float(op, "label_smoothing", label_smoothing), loss, lse, claim, record,
                             stream_for(logits))
    return loss, lse


def cross_entropy_backward(logits, labels, lse, grad_scale, ignore_index=-100, label_smoothing=0.0, out=None,
                           check_labels=True):
    """d loss / d logits times ``grad_scale`` (float32 tensor with 1 or N
    elements, kept on the device: e.g. grad_output / number of non-ignored
    rows for a mean).  Written into ``out`` (default: a new tensor); ``out=logits``
    overwrites the logits with their gradient.  A row with a bad label gets
    NaN gradients.  ``check_labels=True`` raises what earlier forward calls
    recorded, then checks these labels at the call (this kernel records
    nothing: "sync" whatever the mode, but "off"); the autograd Functions
    pass False, their forward having checked."""
    _check(logits, labels, "cross_entropy_backward")
    if check_labels:
        _pending.raise_pending()
    _labels_in_range("cross_entropy_backward", logits, labels, ignore_index, check_labels)
    user_out = out
    if out is None:
        out = torch.empty_like(logits, memory_format=torch.contiguous_format)
    else:
        out = given_out("cross_entropy_backward", out)
    if not isinstance(grad_scale, torch.Tensor):
        grad_scale = torch.tensor([as_float("cross_entropy_backward", "grad_scale", grad_scale)],
                                  device=logits.device)
    _C.cross_entropy_backward(logits.detach(), labels, lse, grad_scale.detach().float().reshape(-1),
                              as_int("cross_entropy_backward", "ignore_index", ignore_index),
                              as_float("cross_entropy_backward", "label_smoothing", label_smoothing), out,
                              stream_for(logits))
    if user_out is not None:
        mark_written(out)
        return user_out
    return out
