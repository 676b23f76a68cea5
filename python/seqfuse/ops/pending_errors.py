"""Errors the GPU finds and the host reports later: bad cross-entropy labels.

Why: checking CUDA labels on the host means reading GPU memory, one
synchronization per loss; in a host-bound training step that wait costs
more than the loss itself (11 % of an FP8 Llama 1B step on the H200).  The
cross-entropy forward kernel reads every label anyway, so it checks them
itself, and the host learns the result without ever waiting for it.

How (the "deferred" label check, SEQFUSE_CHECK_LABELS's default):
- Each CUDA device gets one *sink* the first time a loss runs there: a claim
  word in GPU memory (int32, 0 while free) and a record of six int64 in
  page-locked host memory that the GPU writes directly (torch pinned memory
  is mapped into the GPU's address space).  Layout and protocol are
  csrc/include/seqfuse_loss.h's: the first bad row to get there (in time:
  not always the lowest row, which the "sync" mode names) claims the word,
  writes row, value, V, ignore_index and the label's address into the
  record, then STATE = 1 after a system-wide fence.  Its loss row is NaN
  regardless, so nothing downstream is silently wrong before the error
  surfaces.  No copy and no event: the kernel writes host memory itself, so
  a loss call adds nothing to the stream, and STATE == 1 already says the
  fields have arrived.
- The host reads STATE, a plain memory read, at the next points that cost
  nothing: the start of every cross-entropy call and of its backward.  If the
  kernel has finished by then, the error is raised there; otherwise at the
  next such point, and at the latest at :func:`check_pending_errors`, which
  waits for the devices first (training loops call it at their logging step,
  where they synchronize already).  What this costs: the steps run between
  a bad label and its error have trained on its NaN gradients (up to one
  logging window in a training loop), so a loop checks before it saves a
  checkpoint; SEQFUSE_CHECK_LABELS=sync raises before the loss returns.
- The first loss call on a device may wait for the GPU once: it loads the
  kernel and allocates the sink's pinned memory, and CUDA may synchronize for
  either.  "No wait" holds from the second call on.
- One stream per device: the sink's claim is cleared on the current stream,
  so losses launched on a side stream concurrently with that clear could
  claim it twice.
- The error is the ValueError a synchronous check gives ("<op>: argument
  'labels' holds <value> at row <row>, outside [0, V) and not ignore_index
  <i>"), followed by where it was found.  Op and row are the caller's: each
  call notes which label tensor (and which op) its rows belong to, and the
  recorded address is looked up among the latest 64 such notes; the chunks
  of linear_cross_entropy name the whole label tensor and its row.
- A record still unread when the process exits (a loop that never called
  ``check_pending_errors`` after its last loss) is logged at ERROR level by
  an exit handler, which waits for the devices first: the error is never
  dropped without a word.
- After an error is raised the sink is cleared (STATE on the host, the claim
  by a zero kernel on the current stream) and records again.  Bad labels in
  calls that were already queued when the first one claimed the word are not
  recorded a second time (their rows are NaN all the same).
- CUDA graphs: the kernel writes the same claim and record on every replay,
  and the host reads them outside the capture; nothing is read or cleared
  while a capture is under way.  A sink must exist before the capture
  starts (any eager loss call on the device makes it; a capture's warm-up
  does): a capture on a device without one runs with the kernel's NaN as
  its only guard, and logger "seqfuse" says so once.
"""
import atexit
import collections
import ctypes
import logging
import os
import threading

import torch

from . import device_checks

_log = logging.getLogger("seqfuse")

# the record's fields (csrc/include/seqfuse_loss.h, enum SF_LABEL_*)
STATE, ROW, VALUE, CLASSES, IGNORE, ADDRESS = range(6)
RECORD_LEN = 6

# A lock taken between reading STATE and the fields: its acquire is a memory
# barrier, so on a weakly ordered host (Arm) the fields are not read before
# STATE.  Only the error path takes it.
_barrier = threading.Lock()


class Sink:
    """One device's claim word (GPU) and record (pinned host memory).  The
    record is read through a ctypes view of its memory: a fresh load on
    every access, no torch call."""

    def __init__(self, device, claim, record):
        self.device = device
        self.claim = claim
        self.record = record
        self.view = (ctypes.c_int64 * RECORD_LEN).from_address(record.data_ptr())

    def pending(self):
        return self.view[STATE] != 0

    def take(self):
        """The recorded fields as a tuple, the sink cleared for the next bad
        label.  Called only when ``pending()`` and not under capture."""
        with _barrier:
            fields = tuple(self.view[i] for i in range(RECORD_LEN))
        self.view[STATE] = 0
        self.claim.zero_()  # on the current stream: calls launched after this record again
        return fields


def _make_sink(device):
    """A new sink for a CUDA device (tests replace this to build one on the CPU)."""
    claim = torch.zeros(1, dtype=torch.int32, device=device)
    record = torch.zeros(RECORD_LEN, dtype=torch.int64, pin_memory=True)
    return Sink(device, claim, record)


_sinks = {}  # device index (Tensor.get_device(): -1 for the CPU tests' stand-in) -> Sink
_no_sink_logged = set()
# (first byte, last byte + 1, op, argument) of recent calls' label tensors, newest last
_origins = collections.deque(maxlen=64)


def sink_for(op, labels):
    """The sink of ``labels``' device, made on first use; None (logged once
    per device) when none exists yet and the stream is being captured."""
    index = labels.get_device()
    sink = _sinks.get(index)
    if sink is None:
        device = labels.device
        if device_checks.capturing():
            if device not in _no_sink_logged:
                _no_sink_logged.add(device)
                _log.warning("seqfuse %s: the labels on %s are not recorded in this CUDA graph capture (no "
                             "label record exists on the device yet; run one loss call before capturing): a "
                             "label outside [0, classes) shows only as NaN loss and gradients of its row",
                             op, device)
            return None
        if not _sinks:
            atexit.register(_report_at_exit, os.getpid())
        sink = _sinks[index] = _make_sink(device)
    return sink


def note_labels(op, name, labels):
    """Remember that the rows of ``labels`` (contiguous int64) are argument
    ``name`` of ``op``, so a later error names them; a repeat of the newest
    note is not stored again."""
    start = labels.data_ptr()
    entry = (start, start + 8 * labels.numel(), op, name)
    if not _origins or _origins[-1] != entry:
        _origins.append(entry)


def _message(fields):
    _, row, value, classes, ignore, address = fields
    for start, end, op, name in reversed(_origins):
        if start <= address < end:
            where = f"{op}: argument '{name}' holds {value} at row {(address - start) // 8}"
            break
    else:  # a call older than the notes kept: its own row count
        where = f"cross_entropy_forward: argument 'labels' holds {value} at row {row} of its call"
    return (f"{where}, outside [0, {classes}) and not ignore_index {ignore} (found by the deferred label "
            "check after the call returned; its loss row is NaN. SEQFUSE_CHECK_LABELS=sync checks at the "
            "call, with one host synchronization per loss)")


def raise_pending():
    """Raise the ValueError of a bad label any finished loss kernel
    recorded; a memory read per device, no CUDA call, no wait.  Nothing is
    read during a capture."""
    for sink in _sinks.values():
        if sink.pending() and not device_checks.capturing():
            raise ValueError(_message(sink.take()))


def check_pending_errors(wait=True):
    """Raise the ValueError of any bad label that a CUDA cross-entropy call
    has recorded so far (see the module docstring).  ``wait=True`` first
    synchronizes every device that ran a checked loss, so each call made
    before this one has been judged; ``wait=False`` only reads what has
    arrived (a loop that has just synchronized passes it).  Not allowed
    during CUDA graph capture (RuntimeError)."""
    if not isinstance(wait, bool):
        raise TypeError(f"check_pending_errors: argument 'wait' must be a bool, got {type(wait).__name__}")
    if device_checks.capturing():
        raise RuntimeError("check_pending_errors: the current stream is being captured into a CUDA graph; "
                           "call it after the capture (a capture cannot wait for results)")
    if wait:
        for sink in list(_sinks.values()):
            if sink.device.type == "cuda":
                torch.cuda.synchronize(sink.device)
    raise_pending()


def _report_at_exit(pid=None):
    """At interpreter exit: log (ERROR) a bad label no one has read yet.
    Only in the process that made the sinks (``pid``): a forked child that
    exits normally inherits the handler but not the CUDA context."""
    if pid is not None and pid != os.getpid():
        return
    try:
        check_pending_errors()
    except ValueError as e:
        _log.error("seqfuse: a cross-entropy label error was pending at exit: %s", e)
    except Exception as e:  # noqa: BLE001 - a torn-down CUDA context at exit: say so, do not raise
        _log.error("seqfuse: could not read the pending cross-entropy label errors at exit: %s", e)
