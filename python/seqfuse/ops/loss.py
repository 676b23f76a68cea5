"""Fused cross-entropy (csrc/loss/): per-row loss and log-sum-exp in one read
of the logits (online softmax, nothing materialized), and the gradient in
one more read + write, optionally over the logits buffer itself.

Plain functional ops without autograd; seqfuse.modules.cross_entropy builds
the autograd Functions (cross_entropy, parallel_cross_entropy,
linear_cross_entropy) on them.
"""
import torch

from .. import _C
from ._call import as_float, as_int, stream_for
from .device_checks import check_labels as _check_label_values

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
    if check_labels and labels.device == logits.device:
        _check_label_values(op, labels, logits.shape[1], as_int(op, "ignore_index", ignore_index))


def cross_entropy_forward(logits, labels, ignore_index=-100, label_smoothing=0.0, check_labels=True):
    """Per-row cross-entropy of ``logits`` [N, V] (fp32/fp16/bf16, unit stride
    along V) against int64 ``labels`` [N].  Returns ``(loss, lse)``, both
    float32 [N]: the loss of each row (0 where the label is ``ignore_index``)
    and log-sum-exp of each row (what :func:`cross_entropy_backward` needs).

    A label outside [0, V) that is not ``ignore_index`` is a ValueError
    naming its row.  On CUDA that check (``check_labels``) costs one
    reduction and one host synchronization per call; it is skipped, with a
    one-time log line, under CUDA graph capture, and ``check_labels=False``
    skips it for labels already checked.  Unchecked, the kernel writes NaN
    loss for such a row (never a finite number)."""
    _check(logits, labels, "cross_entropy_forward")
    op = "cross_entropy_forward"
    _labels_in_range(op, logits, labels, ignore_index, check_labels)
    loss = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(loss)
    _C.cross_entropy_forward(logits.detach(), labels, as_int(op, "ignore_index", ignore_index),
                             as_float(op, "label_smoothing", label_smoothing), loss, lse,
                             stream_for(logits))
    return loss, lse


def cross_entropy_backward(logits, labels, lse, grad_scale, ignore_index=-100, label_smoothing=0.0, out=None,
                           check_labels=True):
    """d loss / d logits times ``grad_scale`` (float32 tensor with 1 or N
    elements, kept on the device: e.g. grad_output / number of non-ignored
    rows for a mean).  Written into ``out`` (default: a new tensor); ``out=logits``
    overwrites the logits with their gradient.  Labels are checked as in
    :func:`cross_entropy_forward` (``check_labels``); unchecked, a row with a
    bad label gets NaN gradients."""
    _check(logits, labels, "cross_entropy_backward")
    _labels_in_range("cross_entropy_backward", logits, labels, ignore_index, check_labels)
    if out is None:
        out = torch.empty_like(logits, memory_format=torch.contiguous_format)
    if not isinstance(grad_scale, torch.Tensor):
        grad_scale = torch.tensor([as_float("cross_entropy_backward", "grad_scale", grad_scale)],
                                  device=logits.device)
    _C.cross_entropy_backward(logits.detach(), labels, lse, grad_scale.detach().float().reshape(-1),
                              as_int("cross_entropy_backward", "ignore_index", ignore_index),
                              as_float("cross_entropy_backward", "label_smoothing", label_smoothing), out,
                              stream_for(logits))
    return out
