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

Packed (thd) batches change their token count, their number of sequences
and their longest sequence every step; a graph holds one of each.
``PackedLayout`` makes every packed call within its bounds (at most
``tokens`` tokens, ``sequences`` sequences, ``max_seqlen`` the longest) the
one shape the graphs hold, on the device and without a host read: the
hidden states get zero rows up to ``tokens``, those rows form padding
sequences (so no real token attends to them, nor they to one) of
PAD_SEGMENT tokens where the sequence bound leaves room for that many (their
attention then costs little), else of the fewest tokens that fit them in
the room left, at most ``max_seqlen``; cu_seqlens gets zero-length
sequences up to ``sequences``.  The attention and RoPE
kernels take ``max_seqlen`` as a bound, not as the longest length, so the
bound replays every batch.  The caller keeps the first rows of the
layers' output; the padding rows get no gradient from the loss, so the
weights' gradients are the unpadded call's (up to the GEMMs' rounding at
another row count).
"""
import logging

import torch

__all__ = ["LayerGraphs", "PackedLayout", "check_graphable"]

#: The padding sequences' length where the sequence bound leaves room (one
#: attention tile: such a padding sequence costs about one tile per head).
PAD_SEGMENT = 128

_log = logging.getLogger("seqfuse")


def check_sizes(where, **sizes):
    """ValueError naming the first of ``sizes`` (argument name: value) that
    is not a positive int; ``where`` names the call."""
    for name, v in sizes.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{where}: argument '{name}' must be a positive int, got {v!r}")


def check_graphable(owner, on_cuda, dropout, checkpointing, training, method="graph_layers", **sizes):
    """ValueError / RuntimeError naming the rule a model ``owner`` breaks for
    its ``method`` (graph_layers, graph_packed_layers): its parameters on
    CUDA (``on_cuda``), ``dropout`` (None, or the model's non-zero dropout
    settings as text: a graph replays one random mask), activation
    ``checkpointing`` off, ``training`` mode, and the ``sizes`` (argument
    name: value) positive ints."""
    where = f"{owner}.{method}"
    if not torch.cuda.is_available() or not on_cuda:
        raise RuntimeError(f"{where}: CUDA graphs need the model on a CUDA device")
    if dropout:
        raise ValueError(f"{where}: dropout must be 0 to graph the layers (a graph replays one "
                         f"random mask), got {dropout}")
    if checkpointing:
        raise ValueError(f"{where}: activation checkpointing is on; graphed layers keep their "
                         "activations in the graphs' memory (turn one of them off)")
    check_sizes(where, **sizes)
    if not training:
        raise ValueError(f"{where}: call it in training mode (model.train()); eval calls run eagerly")


class PackedLayout:
    """The packed calls one set of graphed layers serves (module note): at
    most ``tokens`` tokens in at most ``sequences`` sequences (padding
    sequences included), none longer than ``max_seqlen``.  ``where`` names
    the method for its refusals."""

    def __init__(self, where, tokens, sequences, max_seqlen):
        check_sizes(where, tokens=tokens, max_sequences=sequences, max_seqlen=max_seqlen)
        self.tokens, self.sequences, self.max_seqlen = tokens, sequences, max_seqlen
        self.pad_segment = min(PAD_SEGMENT, max_seqlen)
        need = self.min_sequences(tokens, max_seqlen)
        if need > sequences:
            raise ValueError(f"{where}: argument 'max_sequences' ({sequences}) must be at least {need}: the "
                             f"capture's sample batch holds {tokens} tokens in sequences of at most max_seqlen "
                             f"{max_seqlen}")
        self._steps = None  # 1, 2, ..., sequences (int64) on the device (pad)

    def key(self):
        """What LayerGraphs compares a call's shape with."""
        return ("thd", self.tokens, self.sequences, self.max_seqlen)

    def padding(self, tokens, sequences):
        """(count, length): the padding sequences a fitting call of
        ``tokens`` tokens in ``sequences`` sequences gets, each ``length``
        tokens but the last (pad_segment where the room left allows, else
        the fewest that fit the room, at most max_seqlen)."""
        pad = self.tokens - tokens
        room = max(self.sequences - sequences, 1)
        length = min(self.max_seqlen, max(self.pad_segment, -(-pad // room)))
        return -(-pad // length), length

    def misfit(self, tokens, sequences, longest):
        """Why a packed call of ``tokens`` tokens in ``sequences`` sequences,
        the longest ``longest`` tokens (host ints), cannot replay these
        graphs, as (the bound it breaks, what the log says), or None."""
        if tokens > self.tokens:
            return "tokens", f"packed call of {tokens} tokens, graphed for at most {self.tokens}"
        if longest > self.max_seqlen:
            return "max_seqlen", (f"packed call with a sequence of {longest} tokens, graphed for at most "
                                  f"max_seqlen {self.max_seqlen}")
        pad = self.tokens - tokens
        least = self.padding_sequences(pad, self.max_seqlen)
        if sequences + least > self.sequences:
            return "sequences", (f"packed call of {sequences} sequences and {pad} padding tokens, which need "
                                 f"{least} more sequences of at most max_seqlen {self.max_seqlen}: graphed for "
                                 f"at most {self.sequences} sequences")
        return None

    @staticmethod
    def padding_sequences(rows, max_seqlen):
        """The fewest padding sequences that hold ``rows`` padding rows:
        sequences of ``max_seqlen`` tokens (misfit's rule).  With
        ``rows`` = ``tokens``, the padding of an empty call: a call of at
        most ``sequences`` less that many sequences fits whatever its
        token count."""
        return -(-rows // max_seqlen)

    def sequences_wanted(self, tokens, sequences):
        """The sequence bound at which a call of ``tokens`` tokens in
        ``sequences`` sequences gets padding sequences of pad_segment
        tokens (the cheapest)."""
        return sequences + -(-(self.tokens - tokens) // self.pad_segment)

    @staticmethod
    def sample_lengths(tokens, max_seqlen):
        """The capture's sample batch: ``tokens`` tokens in sequences of
        ``max_seqlen``, the first one token shorter where there are two or
        more and max_seqlen > 1 (the route of a batch of unequal lengths,
        which a batch of equal lengths, run eagerly, may not take)."""
        lengths, left = [], tokens
        while left:
            n = min(max_seqlen, left) - (not lengths and 1 < max_seqlen <= left)
            lengths.append(n)
            left -= n
        return lengths

    @staticmethod
    def min_sequences(tokens, max_seqlen):
        """The fewest ``sequences`` a layout of these bounds may have: the
        capture's sample batch's (sample_lengths: its first sequence one
        token short where 1 < max_seqlen <= tokens)."""
        return -(-(tokens + (1 < max_seqlen <= tokens)) // max_seqlen)

    def sample_cu_seqlens(self, device):
        lengths = self.sample_lengths(self.tokens, self.max_seqlen)
        ends = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        return torch.cat([ends, ends[-1:].expand(self.sequences + 1 - ends.numel())]).to(device)

    def pad(self, x, cu_seqlens):
        """``x`` [t, ...] with zero rows up to ``tokens``, and ``cu_seqlens``
        [n + 1] extended to ``sequences`` + 1 entries: the padding rows as
        the sequences ``padding`` gives, then zero-length ones.  A call that
        fits (``misfit`` None); a few launches, no host read."""
        t, n = x.shape[0], cu_seqlens.numel() - 1
        why = self.misfit(t, n, 0)  # (the longest sequence is the caller's to check)
        if why is not None or cu_seqlens.device != x.device:
            raise ValueError(f"PackedLayout.pad: a call of {t} tokens in {n} sequences (cu_seqlens on "
                             f"{cu_seqlens.device}, hidden states on {x.device}) does not fit these graphs"
                             + (f": {why[1]}" if why is not None else ": not on one device"))
        _, length = self.padding(t, n)
        if self._steps is None or self._steps.device != cu_seqlens.device:
            self._steps = torch.arange(1, self.sequences + 1, dtype=torch.int64, device=cu_seqlens.device)
        # (in int64: the ends past the last padding sequence may exceed int32 before the clamp)
        ends = (self._steps[:self.sequences - n] * length + t).clamp_(max=self.tokens).to(torch.int32)
        x = torch.nn.functional.pad(x, (0,) * (2 * x.dim() - 1) + (self.tokens - t,))
        return x, torch.cat([cu_seqlens, ends])


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
    capture (``packed``: the PackedLayout they serve, whose key is then the
    shape), ``for_call`` at every forward, ``clear()`` where they stop
    applying.  ``log``: the logger that says when a call runs eagerly (the
    model's module logger)."""

    def __init__(self, owner, log=_log):
        self.owner, self.log = owner, log
        self.shape = self.recipe = self.graphed = self.packed = None
        self.autocast = False  # torch's CUDA autocast on when the graphs were captured
        self.skips = set()  # reasons already logged for running the layers eagerly

    def set(self, shape, recipe, graphed, packed=None):
        """Called right after the capture, in its context: torch's CUDA
        autocast setting now is the one the graphs hold."""
        self.shape, self.recipe, self.graphed, self.packed = tuple(shape), recipe, tuple(graphed), packed
        self.autocast = torch.is_autocast_enabled("cuda")
        self.skips.clear()

    @property
    def method(self):
        """The model method that captured these graphs."""
        return "graph_layers" if self.packed is None else "graph_packed_layers"

    def clear(self):
        self.shape = self.recipe = self.graphed = self.packed = None
        self.skips.clear()

    def for_call(self, training, shape, layout_reason=None, late_reason=None):
        """The graphed layers where a call of input ``shape`` may replay them,
        else None, the reason logged once per reason.  The reasons, first
        found first: not training; ``layout_reason`` (the caller's cause
        that costs nothing to find, or None; text, or (key, text) where the
        text carries the call's own figures and the key names the rule,
        logged once per key); another shape; torch's CUDA autocast on where
        the capture had it off or the reverse (the graphs replay the
        capture's precision);
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
        elif torch.is_autocast_enabled("cuda") != self.autocast:
            reason = (f"torch autocast {'on' if not self.autocast else 'off'}, graphed with it "
                      f"{'on' if self.autocast else 'off'}")
        elif late_reason is not None:
            reason = late_reason()
        if reason is None:
            active = get_recipe() if is_fp8_enabled() else None
            recipe = self.recipe
            if (active is None) != (recipe is None) or (recipe is not None and active != recipe):
                raise ValueError(f"{self.owner}: the layers were graphed with fp8_recipe={recipe!r} but this "
                                 f"call runs under {active!r}: call {self.method} again with this recipe")
            return self.graphed
        key, text = reason if isinstance(reason, tuple) else (reason, reason)
        if key not in self.skips:
            self.skips.add(key)
            self.log.warning("%s: graphed layers not used, layers run eagerly: %s", self.owner, text)
        return None
