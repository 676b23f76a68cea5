"""A tied input embedding whose gradient goes straight into the LM head's.

A causal LM whose input embedding and LM head share one weight (Llama 3.2
1B, Gemma, most small models) gets that weight's gradient from both uses.
seqfuse's fused loss (``linear_cross_entropy``) makes the head's part, a
dense [V, H] tensor, in its forward and hands it to autograd in its
backward; torch's embedding backward then makes a second dense [V, H]
gradient (a zero fill and a scatter of the token rows) and autograd adds the
two (at a 128k vocabulary and H 2,048 in bf16: 0.5 GB filled, then 1.5 GB
read and written by the add).

``tied_embedding(ids, weight, link)`` is the lookup ``weight[ids]`` whose
backward adds the token rows into the head gradient instead: the loss,
given the same ``link`` (``linear_cross_entropy(..., tied_embedding=link)``),
hands the head gradient it made to the link and returns no gradient for
the weight itself; the embedding's backward, which autograd runs after it
(the embedding is the first use of the weight, the loss the last), adds its
rows into that tensor in place (seqfuse.ops.embedding_backward_add: each
token's rows summed in float32, added with one rounding) and returns it as
the weight's gradient.  So the two parts reach autograd as one tensor, and
any other gradient of the weight (a second loss, a weight penalty) is added
to it by autograd as usual.  Where the loss handed nothing over in this
backward (it was not part of it), the backward makes the embedding's
gradient as torch does and logs that once.  The loss hands over only
where the lookup was recorded for autograd and its backward has not run
yet (else it returns the gradient itself); the lookup's output must reach
the loss's hidden states (as a model's forward makes them).  An offer the
lookup's backward does not take by the end of the backward (the weight's
gradient was not asked for) is dropped with a warning once.

One link per forward pass and loss: a link is bound to one loss, offered to
once and taken from once.
"""
import logging

import torch

from .. import ops

_log = logging.getLogger("seqfuse")
_logged_alone = False
_warned_untaken = False


class TiedGradient:
    """The link between a fused loss and the tied embedding lookup of one
    forward pass over ``weight`` (the shared leaf Parameter)."""

    __slots__ = ("weight", "bound", "armed", "taken", "_grad", "_stream")

    def __init__(self, weight):
        if not isinstance(weight, torch.Tensor) or not weight.is_leaf or weight.dim() != 2:
            raise ValueError("TiedGradient: argument 'weight' must be the shared 2-D leaf Parameter of the "
                             "embedding and the LM head")
        self.weight = weight
        self.bound = False  # (a loss took it: linear_cross_entropy)
        self.armed = False  # (a lookup recorded for autograd: tied_embedding under grad mode)
        self.taken = False  # (the lookup's backward ran)
        self._grad = self._stream = None

    def hands_over(self):
        """The loss's backward: whether to hand its head gradient over (the
        lookup was recorded and its backward has not run yet; else the loss
        returns the gradient itself)."""
        return self.armed and not self.taken

    def offer(self, grad):
        """The loss's backward: the head gradient it made, handed over in
        place of its own gradient of the weight.  Where the lookup's backward
        does not take it in this backward (the weight's gradient was not
        asked for, or the lookup's output was cut from the graph), it is
        dropped at the backward's end, with a warning once."""
        self._grad = grad  # (one offer per link: a link serves one loss, whose second backward raises)
        self._stream = torch.cuda.current_stream(grad.device) if grad.is_cuda else None
        torch.autograd.Variable._execution_engine.queue_callback(self._drop_untaken)

    def _drop_untaken(self):
        global _warned_untaken
        if self._grad is None:
            return
        self._grad = None
        if not _warned_untaken:
            _warned_untaken = True
            _log.warning("seqfuse tied embedding: the LM head's gradient handed to the embedding lookup was not taken "
                         "in this backward (the lookup's backward did not run): the shared weight got no gradient "
                         "from this loss.  Expected where the weight's gradient was not asked for (autograd.grad, "
                         "backward(inputs=...)); else the lookup's output was cut from the loss's graph")

    def take(self):
        """The embedding's backward: the offered gradient (once, ordered after
        the stream that made it), or None."""
        self.taken = True
        grad, self._grad = self._grad, None
        if grad is not None and self._stream is not None:
            here = torch.cuda.current_stream(grad.device)
            if here != self._stream:
                here.wait_stream(self._stream)
        return grad


class _TiedEmbeddingFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, padding_idx, link):
        ctx.save_for_backward(ids)
        ctx.padding_idx, ctx.link, ctx.num_weights = padding_idx, link, weight.shape[0]
        return torch.nn.functional.embedding(ids, weight)

    @staticmethod
    def backward(ctx, dy):
        (ids,) = ctx.saved_tensors
        head = ctx.link.take()
        if head is not None:  # (the loss's weight gradient: the weight's dtype and device, as dy's)
            # the head's and the embedding's parts as one tensor: the weight's only gradient from this pair
            return None, ops.embedding_backward_add(dy, ids, head, ctx.padding_idx), None, None
        global _logged_alone
        if not _logged_alone:
            _logged_alone = True
            _log.info("seqfuse tied embedding: the fused loss handed no head gradient over in this backward; the "
                      "embedding's gradient made on its own (torch's embedding backward)")
        pad = -1 if ctx.padding_idx is None else ctx.padding_idx
        return None, torch.ops.aten.embedding_dense_backward(dy, ids, ctx.num_weights, pad, False), None, None


def tied_embedding(ids, weight, link, padding_idx=None):
    """``weight[ids]`` (torch.nn.functional.embedding without max_norm,
    scale_grad_by_freq or sparse gradients), its backward adding into the
    head gradient ``link`` (a TiedGradient over ``weight``) carries."""
    if not isinstance(link, TiedGradient) or link.weight is not weight:
        raise ValueError("tied_embedding: argument 'link' must be a TiedGradient over this 'weight'")
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
        got = ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise TypeError(f"tied_embedding: argument 'ids' must be an int64 or int32 torch.Tensor, got {got}")
    if padding_idx is not None:
        if isinstance(padding_idx, bool) or not isinstance(padding_idx, int) \
                or not -weight.shape[0] <= padding_idx < weight.shape[0]:
            raise ValueError(f"tied_embedding: argument 'padding_idx' must be an int within the "
                             f"{weight.shape[0]} rows of 'weight' (or None), got {padding_idx!r}")
        padding_idx %= weight.shape[0]
    link.armed = link.armed or (torch.is_grad_enabled() and weight.requires_grad)
    return _TiedEmbeddingFunction.apply(ids, weight, padding_idx, link)
