"""Transient buffers: the same tensor for every call that needs one for a moment.

Some buffers die inside the call that makes them: an FP8 module's forward
reads the row-wise FP8 copy of its GEMM input only in that GEMM and in the
transposed copy it keeps; its backward casts its output gradient and reads
the FP8 copies (and the dbias pass's block sums) only in kernels that same
call enqueues; a norm's backward reads its workspace only in its own
launches.  A stream runs its kernels in order,
so every such call on one stream can write the same buffers, kept here per
(purpose, dtype, device, stream, thread, shape), instead of a torch.empty
per buffer per call (about 3 us of host time each on an H200's host, 1.3 us on a
development machine's CPU).  A caller names a purpose for each buffer it
holds at one time, so two buffers of one call are never the same tensor,
and hands no transient buffer out of the call.  Kept: buffers up to
TRANSIENT_MAX_BYTES (host time counts where buffers are small; a large
buffer's kernels hide its allocation), TRANSIENT_POOL_BYTES in all (past
that the kept ones are let go, to the caching allocator, and kept anew).
Never under CUDA graph capture: a captured kernel's buffers belong to the
graph, so a capture gets buffers of its own.  The key holds the calling
thread: two threads on one stream (every thread starts on the default
stream) interleave their launches, so they never share a buffer.  Past
the total the whole pool is let go at once (packed batches of changing
token counts fill it with shapes a step no longer uses), and every layer
after that keeps its buffers again.
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
_transient = {}
_transient_bytes = [0]
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
    its caller enqueues on that stream before it returns: the same tensor
    for every call with the same arguments (see the module note), so its
    caller gives it to nothing that outlives the call."""
    key = (place, dtype, shape)
    buf = _transient.get(key)
    if buf is not None:
        return buf
    where = place[0]
    buf = torch.empty(*shape, dtype=dtype, device=where[0])
    if where[1] is not None:
        n = buf.numel() * buf.element_size()
        if n <= TRANSIENT_MAX_BYTES and n <= TRANSIENT_POOL_BYTES:
            if _transient_bytes[0] + n > TRANSIENT_POOL_BYTES:
                _transient.clear()
                _transient_bytes[0] = 0
            _transient[key] = buf
            _transient_bytes[0] += n
    return buf


def clear():
    """Let go of every kept transient buffer (to torch's caching allocator;
    torch.cuda.empty_cache() can then return the memory to the driver)."""
    _transient.clear()
    _transient_bytes[0] = 0


def new_or_transient(place, device, dtype, *shape):
    """torch.empty(*shape) on ``device`` where ``place`` is None, else the
    transient buffer at ``place``, a (transient_stream, purpose) pair: what
    callers that make a buffer either way take."""
    if place is None:
        return torch.empty(*shape, dtype=dtype, device=device)
    return transient(place, dtype, *shape)
