"""Positions that transformers derived itself need no packed-sequence test.

A transformers decoder called without ``position_ids`` makes them as an
arange after the cache's length: one contiguous run per row.  It then tests them for
packed sequences (several sequences laid end to end in one row), twice per
training forward: transformers' ``create_causal_mask`` calls
``masking_utils.find_packed_sequence_indices`` and seqfuse's attention
calls ``attention.is_packed_positions``.  Each test reads a device value
on the host.  That is a synchronization at the start of every forward: it
drains the GPU's queue, so the host's launches for the forward can no
longer hide behind the previous step's queued backward.  On the H200
(s17) skipping both took accelerate()'s FP8 Llama 1B step from 78.7 to
58.5 ms.

``accelerate()`` wraps the forward of a model whose decoder layers it
fused (Llama's family, whose missing positions are an arange) with
``wrap_positions``:
a call that passes no ``position_ids`` runs with ``derived_positions()``
true.  Both tests then answer "not packed" without reading the device.
That is the answer they compute for contiguous positions, so results do
not change.  ``install_mask_shortcut()`` makes transformers' test consult
the flag.  It replaces ``masking_utils.find_packed_sequence_indices`` once,
process-wide, by a function that calls the original whenever the flag is
false (every call outside an accelerated forward, and every call with
user-given positions).

Gradient checkpointing recomputes a layer in the backward, outside the
forward's context.  There the flag is false, and the attention's own test
runs (and synchronizes) as before.
"""
import contextlib
import contextvars
import logging

from .method_wrap import MethodWrapper, forward_signature, wrap_method

_log = logging.getLogger("seqfuse")

_derived = contextvars.ContextVar("seqfuse_derived_positions", default=False)


def derived_positions():
    """True inside an accelerated forward that was called without position_ids."""
    return _derived.get()


@contextlib.contextmanager
def _deriving(active):
    token = _derived.set(active)
    try:
        yield
    finally:
        _derived.reset(token)


def _positions_forward(inner):
    """The forward that marks transformers-derived positions (a module-level
    maker for seqfuse.hf.method_wrap, so copies of the model keep it)."""

    def forward(self, *args, **kwargs):
        if "position_ids" in kwargs:
            given = kwargs["position_ids"] is not None
        else:
            sig, _ = forward_signature(type(self))
            bound = sig.bind_partial(self, *args, **kwargs).arguments
            given = bound.get("position_ids") is not None
        with _deriving(not given):
            return inner(self, *args, **kwargs)

    return forward


def wrap_positions(model):
    """Wrap model.forward with the derived-positions mark when its forward
    takes position_ids (once: a second accelerate() keeps the first mark);
    returns whether the model's forward has the mark."""
    if "position_ids" not in forward_signature(type(model))[0].parameters:
        return False
    w = model.__dict__.get("forward")
    while isinstance(w, MethodWrapper):
        if w.make is _positions_forward:
            return True
        w = w.previous
    wrap_method(model, "forward", _positions_forward)
    return True


_shortcut = {}


def install_mask_shortcut():
    """Make transformers' packed-sequence test answer None (not packed)
    without a device read inside derived_positions(); once per process.
    Returns a line for accelerate()'s log."""
    if "line" in _shortcut:
        return _shortcut["line"]
    try:
        from transformers import masking_utils
    except ImportError:
        masking_utils = None
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:
        _shortcut["line"] = ("this transformers has no masking_utils.find_packed_sequence_indices: its "
                             "packed-sequence test (if any) still reads the device in each forward")
        _log.info("seqfuse.hf.accelerate: %s", _shortcut["line"])
        return _shortcut["line"]

    def find_packed_sequence_indices(position_ids):
        if _derived.get():
            return None  # contiguous positions: what the original returns, without its host read
        return original(position_ids)

    find_packed_sequence_indices.__wrapped__ = original
    find_packed_sequence_indices.__doc__ = original.__doc__
    masking_utils.find_packed_sequence_indices = find_packed_sequence_indices
    _shortcut["line"] = ("transformers' packed-sequence test answers 'not packed' without a device read inside "
                         "accelerated forwards called without position_ids")
    _log.info("seqfuse.hf.accelerate: %s", _shortcut["line"])
    return _shortcut["line"]
