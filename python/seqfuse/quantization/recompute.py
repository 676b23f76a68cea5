"""recompute: seqfuse's checkpoint, activation recomputation that keeps FP8 numerics.

``torch.utils.checkpoint`` drops a region's activations and runs its forward
again during the backward.  Under seqfuse autocast that second forward would
run after the region has exited: FP8 off, so it computes something else than
the forward did (torch notices the different saved tensors and raises), and
with delayed scaling the scales have moved on (the step's update runs at the
autocast exit) and the recompute would record its amaxes into the next step.

``checkpoint(function, *args, **kwargs)`` is torch's non-reentrant
checkpoint with two contexts (torch's ``context_fn``):

- the original forward notes, for every delayed-scaling scale it reads
  (``ScalingState.scale_of``: input casts, the norm's and activation's FP8
  outputs), a copy of it;
- the recompute re-enters the forward's autocast settings (enabled, recipe,
  reduction group, calibrating) without an exit update, reads those copies
  instead of the states' current scales, and records its amaxes
  (``ScalingState.amax_of``) into scratch tensors, not into the step's
  history.  A recompute that reads a scale the forward did not raises
  RuntimeError.

Current and block scaling derive scales from the tensors themselves, so the
recompute only needs the autocast settings back.  Dropout draws from torch's
generator, whose state torch's checkpoint restores (preserve_rng_state).
"""
import contextlib
import threading
import warnings

import torch

from ._autocast_state import autocast_state

_local = threading.local()
#: How many recording / replaying contexts are open in any thread: scale_of
#: and amax_of run for every FP8 cast, and with none open they return at once
#: (no thread-local lookup, no call into this module, on the hot path).
#: Read it; only this module changes it.
open_contexts = 0
_open_lock = threading.Lock()


def _stack(name):
    s = getattr(_local, name, None)
    if s is None:
        s = []
        setattr(_local, name, s)
    return s


def _top(name):
    s = getattr(_local, name, None)
    return s[-1] if s else None


def _opened(delta):
    global open_contexts
    with _open_lock:
        open_contexts += delta


def _noted(key, value, what, copy=False):
    """``value`` as the forward saw it: noted (a copy when ``copy``) inside a
    checkpointed forward under ``key``, the noted value returned inside its
    recompute (a key the forward never noted raises, naming ``what``)."""
    replay = _top("replays")
    if replay is not None:
        try:
            return replay[key]
        except KeyError:
            raise RuntimeError(f"seqfuse checkpoint: the recompute {what} the forward did not (a forward that "
                               "depends on more than its inputs?)") from None
    record = _top("records")
    if record is not None and key not in record:
        record[key] = value.detach().clone() if copy else value
    return value


def scale_for(state, index, scale):
    """What ``state.scale_of(index)`` returns: ``scale`` (the live one),
    noted inside a checkpointed forward, replaced by the noted copy inside
    its recompute."""
    if not open_contexts:
        return scale
    return _noted((id(state), index), scale, "read an FP8 scale", copy=True)


def choice_for(key, value):
    """A host decision the forward made (``value``: whether a producer kernel
    writes its FP8 output itself), the same in its recompute: noted inside a
    checkpointed forward under ``key``, read back inside the recompute (which
    runs after the step's update, when the decision's inputs have moved)."""
    if not open_contexts:
        return value
    return _noted(key, value, f"made a choice ({key[0]})")


def replaying():
    """True inside a checkpoint's recompute on this thread."""
    return bool(open_contexts) and _top("replays") is not None


def amax_for(amax):
    """What ``state.amax_of(index)`` returns: the step's slot, or a scratch
    tensor inside a recompute (its amaxes were recorded by the forward)."""
    return torch.zeros_like(amax) if replaying() else amax


@contextlib.contextmanager
def _recording(casts):
    records = _stack("records")
    records.append(casts)
    _opened(1)
    try:
        yield
    finally:
        records.pop()
        _opened(-1)


@contextlib.contextmanager
def _replaying(settings, casts):
    s = autocast_state()
    before = s.settings()
    s.restore(settings)
    s.recomputing += 1
    replays = _stack("replays")
    replays.append(casts)
    _opened(1)
    try:
        yield
    finally:
        replays.pop()
        _opened(-1)
        s.recomputing -= 1
        s.restore(before)


def _none_or_group(x):
    if x is None:
        return True
    dist = getattr(torch, "distributed", None)
    group = getattr(dist, "ProcessGroup", None) if dist is not None and dist.is_available() else None
    return group is not None and isinstance(x, group)


def checkpoint(function, *args, use_reentrant=False, distribute_saved_activations=False,
               get_rng_state_tracker=None, tp_group=None, **kwargs):
    """Run ``function(*args, **kwargs)`` without keeping its activations;
    recompute them in the backward with the forward's FP8 settings and
    scales.  Transformer Engine's signature; only the non-reentrant form (no
    tensor parallelism: the remaining arguments must keep their defaults).

    TE's deprecated positional form, checkpoint(function,
    distribute_saved_activations, get_rng_state_tracker, tp_group, *args)
    (older Megatron-LM), is recognised as TE recognises it (a bool, a
    callable, then None or a process group, before the tensors) and its
    three values taken as those keywords, with TE's DeprecationWarning."""
    if len(args) > 3 and isinstance(args[0], bool) and callable(args[1]) and _none_or_group(args[2]):
        warnings.warn("checkpoint: passing distribute_saved_activations, get_rng_state_tracker and tp_group "
                      "positionally is deprecated (as in Transformer Engine); pass them as keywords",
                      DeprecationWarning, stacklevel=2)
        distribute_saved_activations, get_rng_state_tracker, tp_group = args[:3]
        args = args[3:]
    if use_reentrant:
        raise NotImplementedError("checkpoint: use_reentrant=True is not supported; seqfuse's checkpoint is "
                                  "torch's non-reentrant one (use_reentrant=False)")
    if distribute_saved_activations or get_rng_state_tracker is not None or tp_group is not None:
        raise NotImplementedError("checkpoint: distribute_saved_activations, get_rng_state_tracker and "
                                  "tp_group (tensor parallelism) are not supported")
    s = autocast_state()
    settings = s.settings()
    casts = {}  # (id(state), index) -> the scale the forward used; (name, id(state), index) -> a choice_for

    def context_fn():
        return _recording(casts), _replaying(settings, casts)

    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, context_fn=context_fn,
                                             **kwargs)
