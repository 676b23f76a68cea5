"""Checks of index values that live in GPU memory: cu_seqlens (attention,
RoPE) and cross-entropy labels.

On the CPU the C entries read these values and refuse bad ones.  On CUDA the
host cannot read them without a synchronization; the kernels would clamp a
bad cu_seqlens (a silent wrong answer) and give a bad label's row a NaN loss
(no error).  So the ops check them here, with torch on the tensor's device:
a few element-wise kernels over the (short) index vector and ONE host read
of a small result (one synchronization of the current stream) -- or, for
labels by default, let the loss kernel record them (below).  The rules are
the C entry's, in its order, and for attention and cross-entropy so are the
words, so a CPU and a CUDA call of the same bad input say the same thing.

Cost, and how it is kept down:
- cu_seqlens: a model's layers pass the very same cu_seqlens tensors, so a
  tensor whose check passed is remembered (by identity and torch's version
  counter, ``PerTensorCache``) and not checked again: one synchronization
  per new cu_seqlens tensor, i.e. per batch, not per layer, whatever
  max_seqlen each op checks it against.
- labels: three modes (SEQFUSE_CHECK_LABELS in the environment, or
  ``set_label_checks``):
  "deferred" (the default; also "1"): no host read in the call.  The CUDA
    forward kernel records a bad label in pinned host memory and the error
    is raised at the next point the host can read it without waiting (the
    backward, the next loss call, ``seqfuse.ops.check_pending_errors()``):
    pending_errors.py.
  "sync": the check here, at the call: one synchronization per loss (the
    chunked linear cross-entropy checks the whole label tensor once, then
    its chunks skip it).  It cost an FP8 Llama 1B step 11 % on the H200.
  "off" (also "0"): nothing recorded or read (logged once); the kernels'
    NaN loss and gradients of a bad row are the only guard.
  A value of SEQFUSE_CHECK_LABELS outside these is a ValueError at the first
  loss call.  The backward op called alone (``cross_entropy_backward`` with
  ``check_labels=True``) has no recording kernel: it checks here, as "sync".

The attention router also reads these cached facts (``uniform_length``: a
packed batch whose sequences all have one length runs as the padded batch it
is; ``sequence_facts``: where the last sequence ends and the longest length,
for the opt-in cudnn_ragged route).  The cache knows a tensor by identity and torch's version counter, which
every torch in-place op moves; a write that bypasses it (another framework
writing the memory through DLPack, a ``.data`` swap) is not seen, and a
cu_seqlens tensor so rewritten must be passed as a new tensor (or
``PerTensorCache`` emptied) -- otherwise the router could take the old
lengths.

Under CUDA graph capture no host read is allowed.  Labels are then recorded
by the kernel (deferred, whatever the mode but "off") and judged after the
capture.  A cu_seqlens check is skipped and logger "seqfuse" says so once
per op and argument (WARNING): a bad cu_seqlens in a replay is clamped by
the kernels; check the lengths before capture (the
warning says so).
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
# device types whose loss kernel records bad labels (tests add "cpu", with a
# stand-in kernel, to run the deferred path on CPU tensors)
DEFERRED_DEVICES = ("cuda",)


def storage_shortfall(t):
    """(bytes t's shape, strides and storage offset reach, bytes its storage
    holds) when the storage is too short for the view (shrunk or freed
    under it with ``untyped_storage().resize_()``), else None."""
    if t.numel() == 0:
        return None
    reach = t.storage_offset() + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride())) + 1
    need, have = reach * t.element_size(), t.untyped_storage().nbytes()
    return (need, have) if need > have else None


def check_storage(op, arg, t):
    """Raise ValueError unless the storage of ``t`` (a tensor torch is about
    to read on the host, before any C entry's own extent check) holds every
    element its view reaches.  ``arg`` names it as the message's subject
    (e.g. "argument 'm_splits'")."""
    short = storage_shortfall(t)
    if short is not None:
        raise ValueError(f"{op}: {arg} needs {short[0]} bytes of storage (its shape, strides and offset) but "
                         f"its storage holds {short[1]}; was the storage resized (untyped_storage().resize_()) "
                         "or freed after the tensor was made?")


def _readable(t):
    """Whether torch may read t's values as they are: not a negative- or
    conjugate-bit view (read resolved, a check would judge other values)
    and a storage that holds every element the view reaches (a shrunk or
    freed storage would be read out of bounds).  Anything else is left to
    the C entry, which refuses it with its own rule."""
    if t.is_neg() or t.is_conj():
        return False
    return storage_shortfall(t) is None


def capturing(where=None):
    """Whether the current CUDA stream is being captured into a CUDA graph:
    the one test every op that must not read the device (or must not cache
    what a replay would change) asks.  ``where`` (a tensor or a device), when
    given, must be on CUDA for the answer to be True.  It never initialises
    CUDA: no capture can run before CUDA is initialised."""
    if where is not None:
        if isinstance(where, torch.Tensor):
            # a CUDA tensor exists, so CUDA is initialised: torch's own query, without its two Python
            # wrappers (the FP8 modules ask several times a layer; ~1 us a call on an H200's host)
            return where.is_cuda and _stream_capturing()
        # a torch.device read as it is (building one costs ~1 us), else a name or index
        if (where if isinstance(where, torch.device) else torch.device(where)).type != "cuda":
            return False
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


#: (a torch built without CUDA has no CUDA tensor to ask about)
_stream_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: False)


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
    # (the length at i by gather: a 0-d tensor used as an index would be read to the host itself)
    vals = torch.stack((c[0], i, d.gather(0, i.clamp(min=0).view(1))[0], c[-1], d.min(), d.max()))
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
    """_cu_problem's facts of ``cu`` under ``max_len``, from one remembered
    host read per tensor whatever the limit: the read is made without one,
    and a tensor with no decrease and no sequence longer than ``max_len``
    (its longest, read with it) has the same facts under that limit.  A
    tensor that breaks a rule is read again for the first break."""
    global _cu_facts
    if _cu_facts is None:  # made on first use; tests set it back to None to forget
        _cu_facts = PerTensorCache(_cu_problem)
    facts = _cu_facts(cu, None)
    if max_len is not None and (facts[1] >= 0 or facts[5] > max_len):
        return _cu_problem(cu, max_len)
    return facts


def uniform_length(cu, extent, max_len=None):
    """L when the valid int32 cu_seqlens ``cu`` splits exactly ``extent``
    tokens into sequences all of length L (starts at 0, ends at ``extent``,
    every length L >= 1), else None.  On CUDA it reuses the facts
    ``check_cu_seqlens`` read for the same tensor and ``max_len`` (no second
    synchronization; ``attention`` checks before it routes) and answers None
    under CUDA graph capture (a replay may hold other lengths); CPU tensors
    are read directly.  The attention router runs such a packed batch as the
    padding-free [b, L] batch it is."""
    facts = sequence_facts(cu, max_len)
    if facts is None:
        return None
    last, shortest, longest = facts
    if last != extent or shortest != longest or shortest < 1:
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
    if capturing(cu) or not _readable(cu):
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
    if capturing(cu):
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


LABEL_MODES = ("deferred", "sync", "off")
_MODE_SPELLINGS = {"deferred": "deferred", "1": "deferred", "sync": "sync", "off": "off", "0": "off"}


def _mode_from_env():
    """(mode, None) from SEQFUSE_CHECK_LABELS, or (None, the error's text)."""
    raw = os.environ.get("SEQFUSE_CHECK_LABELS", "deferred")
    mode = _MODE_SPELLINGS.get(raw.strip().lower())
    if mode is None:
        return None, (f"seqfuse: environment variable SEQFUSE_CHECK_LABELS must be one of 'deferred' (or 1), "
                      f"'sync' or 'off' (or 0), got {raw!r}")
    return mode, None


_label_mode, _label_mode_error = _mode_from_env()
_label_checks_off_logged = False


def label_mode():
    """The label-check mode now in force: "deferred", "sync" or "off"
    (module docstring); a bad SEQFUSE_CHECK_LABELS is a ValueError here."""
    if _label_mode is None:
        raise ValueError(_label_mode_error)
    return _label_mode


def set_label_checks(mode):
    """Set how CUDA cross-entropy labels are checked: "deferred" (the
    default; True means it), "sync" (a host synchronization per loss) or
    "off" (False means it; a bad label shows only as NaN loss and gradients
    of its row).  Returns the previous mode (a string this function takes)."""
    global _label_mode, _label_mode_error
    if mode is True or mode is False:
        mode = "deferred" if mode else "off"
    if not isinstance(mode, str):
        raise TypeError(f"set_label_checks: argument 'mode' must be one of {LABEL_MODES} or a bool, got "
                        f"{type(mode).__name__}")
    if mode not in LABEL_MODES:
        raise ValueError(f"set_label_checks: argument 'mode' must be one of {LABEL_MODES} or a bool, got {mode!r}")
    previous = _label_mode if _label_mode is not None else "deferred"
    _label_mode, _label_mode_error = mode, None
    return previous


def _log_off_once():
    global _label_checks_off_logged
    if not _label_checks_off_logged:
        _label_checks_off_logged = True
        _log.warning("seqfuse: CUDA cross-entropy labels are not checked (set_label_checks('off') or "
                     "SEQFUSE_CHECK_LABELS=0): a label outside [0, classes) shows only as NaN loss and "
                     "gradients of its row")


def defers_label_check(labels):
    """Whether the loss kernel itself checks ``labels`` (recording a bad one
    for later, pending_errors.py) rather than the host at the call: CUDA
    int64 labels in "deferred" mode, and in "sync" mode too while the stream
    is being captured (no host read is allowed then).  Cheap on purpose (it
    runs on every loss call): no torch op reads the labels on this path, so
    a view C would refuse (negative bit, short storage) is left to C."""
    if not isinstance(labels, torch.Tensor):
        return False
    if not labels.is_cuda:
        kind = labels.device.type
        if kind not in DEFERRED_DEVICES or kind in HOST_READ:
            return False
    if labels.dtype != torch.int64:
        return False
    mode = _label_mode if _label_mode is not None else label_mode()
    return mode == "deferred" or (mode == "sync" and capturing(labels))


def check_labels(op, labels, num_classes, ignore_index, name="labels"):
    """The synchronous check: raise ValueError (the C entry's message) when
    a CUDA ``labels`` holds a class outside [0, num_classes) that is not
    ``ignore_index``, with one host read.  CPU labels are checked by C; in
    "off" mode nothing is read (logged once); under CUDA graph capture the
    check is skipped (logged once: callers that can, record instead,
    ``defers_label_check``)."""
    if not isinstance(labels, torch.Tensor) or labels.dtype != torch.int64 or labels.device.type in HOST_READ or \
            not _readable(labels):
        return
    if label_mode() == "off":
        _log_off_once()
        return
    if capturing(labels):
        _skip_under_capture(op, name)
        return
    found = label_problem(labels, num_classes, ignore_index)
    if found is not None:
        row, value = found
        raise ValueError(f"{op}: argument '{name}' holds {value} at row {row}, outside [0, {num_classes}) and "
                         f"not ignore_index {ignore_index}")
