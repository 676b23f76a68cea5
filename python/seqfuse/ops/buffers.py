"""Transient buffers: the same memory for every call that needs a buffer for a moment.

Some buffers die inside the call that makes them: an FP8 module's forward
reads the row-wise FP8 copy of its GEMM input only in that GEMM and in the
transposed copy it keeps; its backward casts its output gradient and reads
the FP8 copies (and the dbias pass's block sums) only in kernels that same
call enqueues; a norm's backward reads its workspace only in its own
launches.  A stream runs its kernels in order, so every such call on one
stream can write the same memory, kept here per place -- (purpose, device,
stream, thread) -- instead of a torch.empty per buffer per call (about 3 us
of host time each on an H200's host, 1 us on a development machine's CPU).
A caller names a purpose for each buffer it holds at one time, so two
buffers of one call never share memory, and hands no transient buffer out
of the call.

Each place keeps one byte buffer, grown to the largest request it has
served, and the tensors asked of it are views of those bytes: a request of
a dtype and shape seen at that place before gets the very same tensor (a
dictionary lookup), a new one a view made once (one as_strided of the
place's bytes seen in that dtype: about 2.7 us of host time on a
development machine's CPU with the bookkeeping, against 1 us for an
allocation there and 3-3.5 us on an H200's host), so packed batches whose
token counts change every step reuse the memory instead of filling the
pool with shapes a step no longer asks for, and the memory kept is one
buffer per place (its views: the VIEWS_PER_PLACE most recent shapes).  Kept: buffers up to
TRANSIENT_MAX_BYTES (host time counts where buffers are small; a large
buffer's kernels hide its allocation), TRANSIENT_POOL_BYTES in all (past
that every kept buffer is let go, to the caching allocator, and kept anew).
Never under CUDA graph capture: a captured kernel's buffers belong to the
graph, so a capture gets buffers of its own.  The place holds the calling
thread: two threads on one stream (every thread starts on the default
stream) interleave their launches, so they never share a buffer.
"""
import threading

import torch

from .device_checks import capturing

try:
    raw_stream = torch._C._cuda_getCurrentRawStream  # (device index) -> the current stream's handle
except AttributeError:  # pragma: no cover - older torch
    def raw_stream(index):
        return torch.cuda.current_stream(index).cuda_stream

_current_device = getattr(torch._C, "_cuda_getDevice", lambda: -1)
_thread = threading.get_ident

TRANSIENT_MAX_BYTES = 32 << 20
TRANSIENT_POOL_BYTES = 128 << 20
_transient = {}        # (place, dtype, shape) -> the view kept for that request
_places = {}           # place -> (byte buffer, {dtype: its bytes seen in dtype}, keys of _transient viewing it)
_transient_bytes = [0]
#: keep_set's sets of views, by their caller's key; emptied whenever a kept view is let go
_sets = {}
#: Sets kept at most (past it all are let go and kept anew): one per distinct request of a stream
MAX_SETS = 64
#: Views kept per place: past it the oldest is let go (made again if asked for again).
VIEWS_PER_PLACE = 16


def transient_stream(t):
    """Where transient() buffers for work on ``t``'s device go: (device,
    stream, thread) -- on CUDA the device index and torch's current stream
    there, on the CPU ("cpu", 0) -- with the stream None under CUDA graph
    capture, or where ``t``'s device is not the current one (whose capture
    state is the one torch reports): then transient() makes new buffers and
    keeps none."""
    index = t.get_device()
    if index < 0:
        return ("cpu", 0, _thread())
    if index != _current_device() or capturing(t):
        return (index, None, None)
    return (index, raw_stream(index), _thread())


def transient(place, dtype, *shape):
    """An uninitialised tensor of ``shape`` and ``dtype`` at ``place``, a
    (transient_stream, purpose) pair, for a buffer read only by kernels that
    its caller enqueues on that stream before it returns: a view of the
    place's bytes, the same tensor for every call with the same arguments
    (see the module note), so its caller gives it to nothing that outlives
    the call."""
    key = (place, dtype, shape)
    buf = _transient.get(key)
    if buf is not None:
        return buf
    where = place[0]
    if where[1] is None:  # (under capture, or off the current device: nothing kept)
        return torch.empty(*shape, dtype=dtype, device=where[0])
    n = dtype.itemsize
    for size in shape:
        n *= size
    if n > TRANSIENT_MAX_BYTES or n > TRANSIENT_POOL_BYTES or TRANSIENT_POOL_BYTES <= 0:
        return torch.empty(*shape, dtype=dtype, device=where[0])
    held = _places.get(place)
    if held is None or held[0].numel() < n:
        if held is not None:
            _forget(place, held)
        grown = -(-n // 16) * 16  # (whole 16-byte units: the bytes seen in any dtype, 16-byte aligned)
        if _transient_bytes[0] + grown > TRANSIENT_POOL_BYTES:
            clear()
        held = _places[place] = (torch.empty(grown, dtype=torch.uint8, device=where[0]), {}, [])
        _transient_bytes[0] += grown
    flat = held[1].get(dtype)
    if flat is None:
        flat = held[1][dtype] = held[0].view(dtype)
    strides, step = [], 1
    for size in reversed(shape):  # torch's contiguous strides (a size-0 or size-1 dimension counts as 1)
        strides.append(step)
        step *= max(size, 1)
    buf = flat.as_strided(shape, tuple(reversed(strides)))
    keys = held[2]
    if len(keys) >= VIEWS_PER_PLACE:
        _transient.pop(keys.pop(0), None)
        _sets.clear()
    if _places.get(place) is held:  # (not let go meanwhile by another thread's clear())
        _transient[key] = buf
        keys.append(key)
    return buf


def _forget(place, held):
    """Let go of a place's bytes and the views kept over them (tolerant of a
    clear() another thread ran meanwhile: places are per thread, the pool is
    shared)."""
    _sets.clear()
    for k in held[2]:
        _transient.pop(k, None)
    if _places.pop(place, None) is held:
        _transient_bytes[0] -= held[0].numel()


def clear():
    """Let go of every kept transient buffer (to torch's caching allocator;
    torch.cuda.empty_cache() can then return the memory to the driver)."""
    _sets.clear()
    _transient.clear()
    _places.clear()
    _transient_bytes[0] = 0


def keep_set(key, views, requests):
    """Keep ``views`` under ``key`` (a hashable that says everything the views
    depend on: places, dtypes, shapes) when each is the view transient()
    keeps for its request, a (place, dtype, shape) of ``requests`` (None
    where the view is not a transient buffer): a caller that asks for the
    same buffers on every call (a module backward's gradient cast) then gets
    them from kept_set with one lookup.  A view transient() gave but does not
    keep (too large, under capture, pool off) is never kept here, and
    letting any kept view go (eviction, a place grown, clear()) lets every
    set go, so a set is always the views transient() would give again."""
    for view, request in zip(views, requests):
        if request is not None and _transient.get(request) is not view:
            return
    if len(_sets) >= MAX_SETS:
        _sets.clear()
    _sets[key] = views


def kept_set(key):
    """The views keep_set kept under ``key``, or None."""
    return _sets.get(key)


def new_or_transient(place, device, dtype, *shape):
    """torch.empty(*shape) on ``device`` where ``place`` is None, else the
    transient buffer at ``place``, a (transient_stream, purpose) pair: what
    callers that make a buffer either way take."""
    if place is None:
        return torch.empty(*shape, dtype=dtype, device=device)
    return transient(place, dtype, *shape)
