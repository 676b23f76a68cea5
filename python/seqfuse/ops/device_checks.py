"""Checks of index values that live in GPU memory: cu_seqlens (attention,
RoPE) and cross-entropy labels.

On the CPU the C entries read these values and refuse bad ones.  On CUDA the
host cannot read them without a synchronization, and the kernels would clamp
a bad cu_seqlens or skip a bad label: a silent wrong answer.  So the ops
check them here, with torch on the tensor's device: a few element-wise
kernels over the (short) index vector and ONE host read of a small result
(one synchronization of the current stream).  The rules are the C entry's,
in its order, and for attention and cross-entropy so are the words, so a CPU
and a CUDA call of the same bad input say the same thing.

Cost, and how it is kept down:
- cu_seqlens: a model's layers pass the very same cu_seqlens tensors, so a
  tensor whose check passed is remembered (by identity and torch's version
  counter, ``PerTensorCache``) and not checked again: one synchronization
  per new cu_seqlens tensor, i.e. per batch, not per layer.
- labels: one check per loss call (the chunked linear cross-entropy checks
  the whole label tensor once, then its chunks skip it).  That is one
  synchronization per training step's loss; a loop that must not wait there
  turns it off with ``set_label_checks(False)`` or SEQFUSE_CHECK_LABELS=0 in
  the environment (logged once), leaving the kernels' NaN loss and gradients
  for a bad label as the guard.
Estimated at 20-60 us of host time per check plus the wait for the work
already queued on the stream (not yet measured on a GPU;
benchmarks/bisect_corpus_cuda.py part 5 times it).

The attention router also reads these cached facts (``uniform_length``: a
packed batch whose sequences all have one length runs as the padded batch it
is; ``sequence_facts``: where the last sequence ends and the longest length,
for the opt-in cudnn_ragged route).  The cache knows a tensor by identity and torch's version counter, which
every torch in-place op moves; a write that bypasses it (another framework
writing the memory through DLPack, a ``.data`` swap) is not seen, and a
cu_seqlens tensor so rewritten must be passed as a new tensor (or
``PerTensorCache`` emptied) -- otherwise the router could take the old
lengths.

Under CUDA graph capture no host read is allowed, so the check is skipped and
logger "seqfuse" says so once per op and argument (WARNING).  What still
guards a captured call: the cross-entropy kernels write NaN loss and NaN
gradients for a row whose label is out of range and not ignore_index.  A
bad cu_seqlens in a replay is clamped by the kernels, as it always was:
check the lengths before capture (the warning says so).
"""
import logging
import os

import torch

from .tensor_cache import PerTensorCache

_log = logging.getLogger("seqfuse")
_skips_logged = set()
# device types whose index values the C entries read and check themselves
# (tests empty it to run the device path on CPU tensors)
HOST_READ = ("cpu", "meta")


def _readable(t):
    """Whether torch may read t's values as they are: not a negative- or
    conjugate-bit view (read resolved, a check would judge other values)
    and a storage that holds every element the view reaches (a shrunk or
    freed storage would be read out of bounds).  Anything else is left to
    the C entry, which refuses it with its own rule."""
    if t.is_neg() or t.is_conj():
        return False
    if t.numel() == 0:
        return True
    reach = t.storage_offset() + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride())) + 1
    return t.untyped_storage().nbytes() >= reach * t.element_size()


def _capturing(t):
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _skip_under_capture(op, name):
    """The one-time log line of a check skipped under capture."""
    key = (op, name)
    if key not in _skips_logged:
        _skips_logged.add(key)
        _log.warning("seqfuse %s: argument '%s' is on the GPU and the stream is being captured into a CUDA "
                     "graph, so its values are not checked in this call (a host read is not allowed "
                     "during capture); check them before capture", op, name)


def _cu_problem(cu, max_len):
    """The facts the C entry's cu_seqlens rules look at (csrc/attn/attn.c
    check_cu_seqlens, csrc/rope/rope.c), as Python ints read in one host
    transfer: the first element; the first i where sequence i is negative
    (a decrease) or longer than ``max_len`` (-1 if none) and its length; the
    last element; and, read in the same transfer for the attention router
    (``uniform_length``), the shortest and the longest sequence."""
    c = cu.to(torch.int64)
    d = c[1:] - c[:-1]
    bad = d < 0 if max_len is None else (d < 0) | (d > max_len)
    i = torch.where(bad.any(), bad.to(torch.int8).argmax(), torch.full_like(d[0], -1))
    vals = torch.stack((c[0], i, d[i.clamp(min=0)], c[-1], d.min(), d.max()))
    return tuple(int(x) for x in vals.tolist())  # the one synchronization


def _cu_message(op, name, cu, facts, extent, max_len, max_what):
    """The C entry's message for the first rule the facts break (C's order:
    the start, then sequence by sequence a decrease or a length, then the
    end), or None."""
    first, i, length, last = facts[:4]
    if first != 0:
        return f"{op}: argument '{name}' must start at 0, got {first}"
    if i >= 0 and length < 0:
        a, b = cu[i].item(), cu[i + 1].item()
        return (f"{op}: argument '{name}' must be non-decreasing, but element {i + 1} ({b}) < "
                f"element {i} ({a})")
    if i >= 0:
        return (f"{op}: argument '{name}' holds a sequence of length {length}, longer than "
                + (max_what or f"the max_seqlen {max_len}"))
    if extent is not None and last > extent:
        return f"{op}: argument '{name}' ends at {last}, beyond the {extent} tokens of the tensor"
    return None


_cu_facts = None  # PerTensorCache of _cu_problem: the cu_seqlens tensors seen last (a model's layers share them)


def _facts(cu, max_len):
    global _cu_facts
    if _cu_facts is None:  # made on first use; tests set it back to None to forget
        _cu_facts = PerTensorCache(_cu_problem)
    return _cu_facts(cu, max_len)


def uniform_length(cu, extent, max_len=None):
    """L when the valid int32 cu_seqlens ``cu`` splits exactly ``extent``
    tokens into sequences all of length L (starts at 0, ends at ``extent``,
    every length L >= 1), else None.  On CUDA it reuses the facts
    ``check_cu_seqlens`` read for the same tensor and ``max_len`` (no second
    synchronization; ``attention`` checks before it routes) and answers None
    under CUDA graph capture (a replay may hold other lengths); CPU tensors
    are read directly.  The attention router runs such a packed batch as the
    padding-free [b, L] batch it is."""
    if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 2:
        return None
    if _capturing(cu) or not _readable(cu):
        return None
    facts = _cu_problem(cu, max_len) if cu.device.type in HOST_READ else _facts(cu, max_len)
    first, i, _, last, shortest, longest = facts
    if first != 0 or i >= 0 or last != extent or shortest != longest or shortest < 1:
        return None
    return shortest


def sequence_facts(cu, max_len=None):
    """(end, shortest, longest) of the valid int32 cu_seqlens ``cu``: where
    its last sequence ends and its shortest and longest sequence lengths,
    else None (not a valid cu_seqlens, under CUDA graph capture, or not
    readable).  Like ``uniform_length`` it reuses on CUDA the facts
    ``check_cu_seqlens`` read for the same tensor and ``max_len`` (no
    second synchronization) and reads CPU tensors directly.  The attention
    router's cudnn_ragged route needs every token inside a sequence (cuDNN
    leaves the others unwritten) and the longest length (no host read)."""
    if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 2:
        return None
    if _capturing(cu) or not _readable(cu):
        return None
    facts = _cu_problem(cu, max_len) if cu.device.type in HOST_READ else _facts(cu, max_len)
    first, i, _, last, shortest, longest = facts
    if first != 0 or i >= 0 or shortest < 0:
        return None
    return last, shortest, longest


def check_cu_seqlens(op, name, cu, extent=None, max_len=None, max_what=None):
    """Raise ValueError naming ``name`` when the values of ``cu`` (an int32
    1-D tensor of at least 2 elements; anything else is left to the C
    checks) break the rule: start at 0, non-decreasing, no sequence longer
    than ``max_len`` (when given), end at most at ``extent`` tokens (when
    given; ``max_what`` words the limit in the message, default "the
    max_seqlen <max_len>").  CPU tensors are left to C, which reads them itself; on CUDA one
    host read per new tensor (see the module docstring), none under capture."""
    if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 2:
        return
    if cu.device.type in HOST_READ or not _readable(cu):
        return
    if _capturing(cu):
        _skip_under_capture(op, name)
        return
    facts = _facts(cu, max_len)
    msg = _cu_message(op, name, cu, facts, extent, max_len, max_what)
    if msg is not None:
        raise ValueError(msg)


def label_problem(labels, num_classes, ignore_index):
    """(row, value) of the first label outside [0, num_classes) that is not
    ``ignore_index``, or None: one reduction and one host read when all are
    good (two more reads to describe a bad one).  Works on any device."""
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= num_classes))
    if not bool(bad.any()):  # the one synchronization
        return None
    row = int(bad.to(torch.int8).argmax())
    return row, int(labels[row])


_label_checks = os.environ.get("SEQFUSE_CHECK_LABELS", "1") != "0"
_label_checks_off_logged = False


def set_label_checks(enabled):
    """Turn the host check of CUDA cross-entropy labels on (the default) or
    off; returns the previous setting.  Off: no synchronization in the loss,
    and a bad label shows only as NaN loss and gradients of its row."""
    global _label_checks
    if not isinstance(enabled, bool):
        raise TypeError(f"set_label_checks: argument 'enabled' must be a bool, got {type(enabled).__name__}")
    previous, _label_checks = _label_checks, enabled
    return previous


def check_labels(op, labels, num_classes, ignore_index, name="labels"):
    """Raise ValueError (the C entry's message) when a CUDA ``labels`` holds
    a class outside [0, num_classes) that is not ``ignore_index``.  CPU
    labels are checked by C; under CUDA graph capture the check is skipped
    (logged once) and the kernels' NaN marks the bad rows."""
    if not isinstance(labels, torch.Tensor) or labels.dtype != torch.int64 or labels.device.type in HOST_READ or \
            not _readable(labels):
        return
    if _capturing(labels):
        _skip_under_capture(op, name)
        return
    if not _label_checks:
        global _label_checks_off_logged
        if not _label_checks_off_logged:
            _label_checks_off_logged = True
            _log.warning("seqfuse: CUDA cross-entropy labels are not checked (set_label_checks(False) or "
                         "SEQFUSE_CHECK_LABELS=0): a label outside [0, classes) shows only as NaN loss and "
                         "gradients of its row")
        return
    found = label_problem(labels, num_classes, ignore_index)
    if found is not None:
        row, value = found
        raise ValueError(f"{op}: argument '{name}' holds {value} at row {row}, outside [0, {num_classes}) and "
                         f"not ignore_index {ignore_index}")
