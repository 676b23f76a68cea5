"""An embedding table's gradient added into an existing gradient (csrc/embed/).

``embedding_backward_add(dy, ids, dweight)`` adds the gradient of an
embedding lookup ``weight[ids]`` into ``dweight`` in place: each index's
rows of ``dy`` summed in float32 and added with one rounding, the same on
every run (sorted indices, no atomics).  seqfuse.modules.embedding uses it
where an input embedding shares its weight with the LM head (tied
embeddings): the embedding's rows go straight into the head's gradient,
which the fused loss made in its forward, instead of a dense [V, H]
gradient of their own that autograd then adds to it.

A plain functional op (no autograd), as every seqfuse.ops op.
"""
import torch

from .. import _C
from ._call import given_out, mark_written, stream_for

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def embedding_backward_add(dy, ids, dweight, padding_idx=None):
    """``dweight[i] += sum(dy[ids == i])`` for every index ``i`` in ``ids``,
    in place; returns ``dweight``.  ``dy``: float [..., H], the gradient of
    the lookup's output; ``ids``: int64 (or int32) indices of ``dy``'s
    leading shape; ``dweight``: [V, H] of ``dy``'s dtype and device, unit
    stride along H.  Rows whose index is ``padding_idx`` add nothing, as
    torch.nn.Embedding's.  An index outside [0, V) is a ValueError on the
    CPU; on the GPU such a row adds nothing (no host read: torch's lookup
    refuses the index in the forward that made ``dy``)."""
    op = "embedding_backward_add"
    if not isinstance(dy, torch.Tensor) or dy.dtype not in _FLOATS:
        got = dy.dtype if isinstance(dy, torch.Tensor) else type(dy).__name__
        raise TypeError(f"{op}: argument 'dy' must be a float32, float16 or bfloat16 torch.Tensor, got {got}")
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
        got = ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise TypeError(f"{op}: argument 'ids' must be an int64 or int32 torch.Tensor, got {got}")
    if not isinstance(dweight, torch.Tensor) or dweight.dim() != 2:
        raise ValueError(f"{op}: argument 'dweight' must be a 2-D [V, H] torch.Tensor")
    if dy.dim() < 1 or tuple(dy.shape[:-1]) != tuple(ids.shape):
        raise ValueError(f"{op}: argument 'dy' must have shape ids.shape + [H] = {tuple(ids.shape)} + [H], "
                         f"got {tuple(dy.shape)}")
    if padding_idx is not None:
        if isinstance(padding_idx, bool) or not isinstance(padding_idx, int):
            raise TypeError(f"{op}: argument 'padding_idx' must be an int or None, got {type(padding_idx).__name__}")
        if not -dweight.shape[0] <= padding_idx < dweight.shape[0]:
            raise ValueError(f"{op}: argument 'padding_idx' must be within the {dweight.shape[0]} rows of "
                             f"'dweight', got {padding_idx}")
        padding_idx %= dweight.shape[0]  # (a negative one counts from the end, as torch.nn.Embedding's)
    flat = ids.reshape(-1)
    if flat.device != dy.device:
        raise ValueError(f"{op}: argument 'ids' is on {flat.device}, 'dy' on {dy.device}")
    sorted_ids, order = torch.sort(flat.to(torch.int64), stable=True)
    if flat.device.type == "cpu" and flat.numel() and not 0 <= sorted_ids[0] <= sorted_ids[-1] < dweight.shape[0]:
        bad = sorted_ids[0] if sorted_ids[0] < 0 else sorted_ids[-1]
        raise ValueError(f"{op}: argument 'ids' holds {int(bad)}, outside [0, {dweight.shape[0]}) (the rows of "
                         "'dweight')")
    rows = dy.reshape(-1, dy.shape[-1]) if dy.dim() != 2 else dy
    if (rows.shape[-1] > 1 and rows.stride(-1) != 1) or (rows.shape[0] > 1 and rows.stride(0) < rows.shape[1]):
        rows = rows.contiguous()  # (a transposed or broadcast gradient: rows of their own)
    out = given_out(op, dweight, "dweight")
    _C.embedding_backward_add(rows.detach(), sorted_ids, order, -1 if padding_idx is None else padding_idx, out,
                              stream_for(dy))
    mark_written(out)
    return dweight
