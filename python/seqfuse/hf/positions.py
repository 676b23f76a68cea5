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

``accelerate()`` wraps the forward of each transformers base decoder
(``LlamaModel`` and its kin: the module holding the layers and the rotary
embedding) whose layers it fused, with ``wrap_positions``: a call of that
decoder that passes no ``position_ids`` runs with ``derived_positions()``
true.  The decoder's own arguments decide, so a caller above it that builds
packed positions and passes them down keeps both tests.  Both tests then answer "not packed" without reading the device.
That is the answer they compute for contiguous positions, so results do
not change.  ``install_mask_shortcut()`` makes transformers' test consult
the flag.  It replaces ``masking_utils.find_packed_sequence_indices`` once,
process-wide, by a function that calls the original whenever the flag is
false (every call outside an accelerated forward, and every call with
user-given positions).

Gradient checkpointing recomputes a layer in the backward, outside the
forward's context.  ``marked_checkpoint`` (what accelerate() routes
transformers' checkpointing to) runs the recompute under the flag its
forward ran under, so the recompute makes the forward's choice without the
device read too.
"""
import contextvars
import functools
import logging

from torch import nn

from ..quantization import recompute
from .method_wrap import forward_signature, wrap_function, wrap_method_once, wrapped_with

_log = logging.getLogger("seqfuse")

_derived = contextvars.ContextVar("seqfuse_derived_positions", default=False)


def derived_positions():
    """True inside an accelerated forward that was called without position_ids."""
    return _derived.get()


@functools.lru_cache(maxsize=None)
def _position_index(cls):
    """Where position_ids stands among cls.forward's positional arguments
    after self, or None (keyword-only or absent): read once per class."""
    names = [p.name for p in forward_signature(cls)[0].parameters.values()
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return names.index("position_ids") - 1 if "position_ids" in names else None


def _positions_forward(inner):
    """The forward that marks transformers-derived positions (a module-level
    maker for seqfuse.hf.method_wrap, so copies of the model keep it).  It
    runs at every decoder forward: the flag is set and reset inline."""

    def forward(self, *args, **kwargs):
        if "position_ids" in kwargs:
            given = kwargs["position_ids"] is not None
        else:
            i = _position_index(type(self))
            given = i is not None and len(args) > i and args[i] is not None
        token = _derived.set(not given)
        try:
            return inner(self, *args, **kwargs)
        finally:
            _derived.reset(token)

    return forward


def _marked(mark, function, *args, **kwargs):
    """``function(*args, **kwargs)`` with derived_positions() equal to ``mark``."""
    token = _derived.set(mark)
    try:
        return function(*args, **kwargs)
    finally:
        _derived.reset(token)


def with_derived_positions(function, *args, **kwargs):
    """``function(*args, **kwargs)`` run as inside an accelerated forward
    called without position_ids (derived_positions() true): for a caller
    that holds such positions itself (graph_layers' capture)."""
    return _marked(True, function, *args, **kwargs)


def marked_checkpoint(function, *args, **kwargs):
    """seqfuse's checkpoint (seqfuse.quantization.recompute.checkpoint, same
    arguments) whose recompute in the backward runs under the
    derived-positions flag of the forward that called it (the backward runs
    outside that forward's context, where the flag is false)."""
    return recompute.checkpoint(functools.partial(_marked, _derived.get(), function), *args, **kwargs)


def _decoders(model, fused_layer_type):
    """transformers' base decoders inside ``model`` (the modules holding the
    ``layers`` list, beside ``rotary_emb``) with a fused layer among them and
    ``position_ids`` in their forward: the modules that derive the positions."""
    for m in model.modules():
        layers = getattr(m, "layers", None)
        if not (isinstance(layers, nn.ModuleList) and isinstance(getattr(m, "rotary_emb", None), nn.Module)):
            continue
        if not type(m).__module__.startswith("transformers.models."):
            continue
        if any(isinstance(layer, fused_layer_type) for layer in layers) and \
                "position_ids" in forward_signature(type(m))[0].parameters:
            yield m


def wrap_positions(model, fused_layer_type):
    """Wrap the forward of each base decoder of ``model`` whose layers
    accelerate() fused (instances of ``fused_layer_type``) with the
    derived-positions mark: its own call decides, so a caller that builds
    packed positions and passes them down keeps both tests.  Once per
    decoder (a second accelerate() keeps the first mark).  Returns how many
    decoders carry the mark."""
    count = 0
    for m in _decoders(model, fused_layer_type):
        wrap_method_once(m, "forward", _positions_forward)
        count += 1
    return count


def _mask_shortcut(original):
    """transformers' packed-sequence test answering None inside
    derived_positions() (a maker for seqfuse.hf.method_wrap.wrap_function)."""

    def find_packed_sequence_indices(*args, **kwargs):
        if _derived.get():
            return None  # contiguous positions: what the original returns, without its host read
        return original(*args, **kwargs)

    return find_packed_sequence_indices


_NO_TEST = ("this transformers has no masking_utils.find_packed_sequence_indices: its packed-sequence test (if any) "
            "still reads the device in each forward")
_INSTALLED = ("transformers' packed-sequence test answers 'not packed' without a device read inside accelerated "
              "forwards called without position_ids")
_said = set()  # the lines logged already: each is said once per process


def _say(line):
    if line not in _said:
        _said.add(line)
        _log.info("seqfuse.hf.accelerate: %s", line)
    return line


def install_mask_shortcut():
    """Make transformers' packed-sequence test answer None (not packed)
    without a device read inside derived_positions(); once per process (a
    test already wrapped is left as it is).  Returns a line for accelerate()'s log."""
    try:
        from transformers import masking_utils
    except ImportError:
        masking_utils = None
    current = getattr(masking_utils, "find_packed_sequence_indices", None)
    if current is None:
        return _say(_NO_TEST)
    if not wrapped_with(current, _mask_shortcut):
        masking_utils.find_packed_sequence_indices = wrap_function(current, _mask_shortcut)
    return _say(_INSTALLED)
