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
offers the gradient it returns for ``weight``; the embedding's backward,
which autograd runs after it (the embedding is the first use of the
weight, the loss the last), adds its rows into that tensor in place
(seqfuse.ops.embedding_backward_add: each token's rows summed in float32,
added with one rounding) and returns no gradient of its own.  Autograd
then accumulates one tensor that holds both parts.  Where no offer was
made in this backward (the loss was not part of it, or a gradient of
another dtype or device), the backward makes the embedding's gradient as
torch does and logs that once.

One link per forward pass: a link is offered to and taken from once.
"""
import logging

import torch

from .. import ops

_log = logging.getLogger("seqfuse")
_logged_alone = False


class TiedGradient:
    """The link between a fused loss and the tied embedding lookup of one
    forward pass over ``weight`` (the shared leaf Parameter)."""

    __slots__ = ("weight", "_grad")

    def __init__(self, weight):
        if not isinstance(weight, torch.Tensor) or not weight.is_leaf or weight.dim() != 2:
            raise ValueError("TiedGradient: argument 'weight' must be the shared 2-D leaf Parameter of the "
                             "embedding and the LM head")
        self.weight = weight
        self._grad = None

    def offer(self, grad):
        """The loss's backward: the gradient it returns for the weight."""
        self._grad = grad

    def take(self):
        """The embedding's backward: the offered gradient (once), or None."""
        grad, self._grad = self._grad, None
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
        if head is not None and head.dtype == dy.dtype and head.device == dy.device and head.stride(-1) == 1:
            ops.embedding_backward_add(dy, ids, head, ctx.padding_idx)
            del head  # (autograd's own reference stays the only one: it accumulates the tensor, no copy)
            return None, None, None, None
        global _logged_alone
        if not _logged_alone:
            _logged_alone = True
            why = ("the fused loss offered no head gradient in this backward" if head is None else
                   f"the head gradient is {head.dtype} on {head.device}, the embedding's {dy.dtype} on {dy.device}")
            _log.info("seqfuse tied embedding: %s; the embedding's gradient made on its own (torch's embedding "
                      "backward) and added by autograd", why)
        pad = -1 if ctx.padding_idx is None else ctx.padding_idx
        grad = torch.ops.aten.embedding_dense_backward(dy, ids, ctx.num_weights, pad, False)
        return None, grad, None, None


def tied_embedding(ids, weight, link, padding_idx=None):
    """``weight[ids]`` (torch.nn.functional.embedding without max_norm,
    scale_grad_by_freq or sparse gradients), its backward adding into the
    head gradient ``link`` (a TiedGradient over ``weight``) carries."""
    if not isinstance(link, TiedGradient) or link.weight is not weight:
        raise ValueError("tied_embedding: argument 'link' must be a TiedGradient over this 'weight'")
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
        got = ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise TypeError(f"tied_embedding: argument 'ids' must be an int64 or int32 torch.Tensor, got {got}")
    if padding_idx is not None and padding_idx < 0:
        padding_idx += weight.shape[0]
    return _TiedEmbeddingFunction.apply(ids, weight, padding_idx, link)
