"""CUDA graphs of a model's layers for one unpadded [batch, seq] shape: what
SeqfuseEsmModel.graph_layers and the decoder families' graph_layers (Llama,
Mixtral: llama.DecoderStack) share.

A model captures each layer's forward and backward once
(seqfuse.quantization.make_graphed_callables, FP8 included) for inputs of
exactly one shape, and later calls of that shape in training replay the
graphs: the host then issues two graph launches a layer instead of every
kernel, which is what a step whose host work outruns its GPU work needs.
``check_graphable`` holds the preconditions every model states the same
way; ``LayerGraphs`` keeps the captured callables and decides, call by
call, whether they may replay (the model adds the reasons of its own
layouts: packed, padded), logging once per reason when they may not.
"""
import logging

import torch

__all__ = ["LayerGraphs", "check_graphable"]

_log = logging.getLogger("seqfuse")


def check_graphable(owner, on_cuda, dropout, checkpointing, training, batch_size, seq_len):
    """ValueError / RuntimeError naming the rule a model ``owner`` breaks for
    graph_layers: its parameters on CUDA (``on_cuda``), ``dropout`` (None,
    or the model's non-zero dropout settings as text: a graph replays one
    random mask), activation ``checkpointing`` off, ``training`` mode, and
    positive int batch_size and seq_len."""
    if not torch.cuda.is_available() or not on_cuda:
        raise RuntimeError(f"{owner}.graph_layers: CUDA graphs need the model on a CUDA device")
    if dropout:
        raise ValueError(f"{owner}.graph_layers: dropout must be 0 to graph the layers (a graph replays one "
                         f"random mask), got {dropout}")
    if checkpointing:
        raise ValueError(f"{owner}.graph_layers: activation checkpointing is on; graphed layers keep their "
                         "activations in the graphs' memory (turn one of them off)")
    for name, v in (("batch_size", batch_size), ("seq_len", seq_len)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{owner}.graph_layers: argument '{name}' must be a positive int, got {v!r}")
    if not training:
        raise ValueError(f"{owner}.graph_layers: call it in training mode (model.train()); eval calls run "
                         "eagerly")


def eager_reason(packed=False, padded=False, hidden_states=False):
    """The cause, found in the call's layout without a host read, that
    keeps it off the graphed layers (the first of: packed, padded, hidden
    states asked for), or None: LayerGraphs.for_call's ``layout_reason``
    for every model family."""
    if packed:
        return "packed (thd) call"
    if padded:
        return "padded call (attention_mask has zeros)"
    return "output_hidden_states" if hidden_states else None


class LayerGraphs:
    """A model's graphed layers: ``set(shape, recipe, graphed)`` after the
    capture, ``for_call`` at every forward, ``clear()`` where they stop
    applying.  ``log``: the logger that says when a call runs eagerly (the
    model's module logger)."""

    def __init__(self, owner, log=_log):
        self.owner, self.log = owner, log
        self.shape = self.recipe = self.graphed = None
        self.skips = set()  # reasons already logged for running the layers eagerly

    def set(self, shape, recipe, graphed):
        self.shape, self.recipe, self.graphed = tuple(shape), recipe, tuple(graphed)
        self.skips.clear()

    def clear(self):
        self.shape = self.recipe = self.graphed = None
        self.skips.clear()

    def for_call(self, training, shape, layout_reason=None, late_reason=None):
        """The graphed layers where a call of input ``shape`` may replay them,
        else None, the reason logged once per reason.  The reasons, first
        found first: not training; ``layout_reason`` (the caller's cause
        that costs nothing to find, or None); another shape;
        ``late_reason()`` (a callable for a cause that costs a host read, run
        only when nothing before it applies).  A call under another FP8
        recipe than the captured one (its type or any setting) is a
        ValueError: the graphs hold that recipe's casts and routes."""
        if self.graphed is None:
            return None
        from ..quantization.autocast import get_recipe, is_fp8_enabled

        reason = None
        if not (training and torch.is_grad_enabled()):
            reason = "not training (eval mode or no grad)"
        elif layout_reason is not None:
            reason = layout_reason
        elif tuple(shape) != self.shape:
            reason = f"input_ids {tuple(shape)}, graphed for {self.shape}"
        elif late_reason is not None:
            reason = late_reason()
        if reason is None:
            active = get_recipe() if is_fp8_enabled() else None
            recipe = self.recipe
            if (active is None) != (recipe is None) or (recipe is not None and active != recipe):
                raise ValueError(f"{self.owner}: the layers were graphed with fp8_recipe={recipe!r} but this "
                                 f"call runs under {active!r}: call graph_layers again with this recipe")
            return self.graphed
        if reason not in self.skips:
            self.skips.add(reason)
            self.log.warning("%s: graphed layers not used, layers run eagerly: %s", self.owner, reason)
        return None
