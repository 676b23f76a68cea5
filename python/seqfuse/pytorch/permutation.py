"""Transformer Engine's ``transformer_engine.pytorch.permutation`` spelled the
same way: token permutation for MoE with a routing mask, implemented in
seqfuse.ops.moe (C kernels in csrc/moe/).  seqfuse's row_id_map layout is
its own ([tokens, experts] int32): pass it only back to these functions.

moe_sort_chunks_by_index(_with_probs) reorders contiguous chunks of rows
(expert parallelism: the tokens received from each rank, grouped by rank,
regrouped by local expert).  It is an exact row gather (index_select, so
autograd scatters the gradient back); it reads split_sizes and
sorted_index on the host (one device-to-host copy each when they are CUDA
tensors), where TE's kernel reads them on the device.

moe_permute_and_pad_with_probs is moe_permute_with_probs with each
expert's block of rows padded with zero rows to a multiple of align_size
(the FP8 grouped GEMM's row alignment).  Its row_id_map already points at
the padded rows, so moe_unpermute needs no offsets to undo it; it takes
TE's pad_offsets argument and checks that the map came from this function
(a map from moe_permute_with_probs with pad_offsets is refused: seqfuse
would not apply them)."""
import warnings
from typing import Optional, Tuple

import torch

from ..ops import moe as _moe
from ..ops.moe import moe_permute, moe_permute_with_probs  # noqa: F401

__all__ = ["moe_permute", "moe_permute_with_probs", "moe_permute_and_pad_with_probs", "moe_unpermute",
           "moe_sort_chunks_by_index", "moe_sort_chunks_by_index_with_probs"]

#: attribute set on the row_id_map moe_permute_and_pad_with_probs returns (its rows include the padding)
_PADDED = "_seqfuse_padded_row_id_map"


def moe_permute_and_pad_with_probs(inp: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
                                   tokens_per_expert: torch.Tensor, align_size: int):
    """TE's padded permutation: (output [sum(target), H], permuted_probs,
    row_id_map, pad_offsets or None, target_tokens_per_expert), where
    target = tokens_per_expert rounded up to a multiple of align_size, each
    expert's rows followed by zero rows (probability 0) up to its target,
    and pad_offsets[e] the padding rows before expert e (None when nothing
    is padded).  tokens_per_expert must be the routing map's per-expert
    counts.  Differentiable in inp and probs."""
    op = "moe_permute_and_pad_with_probs"
    if tokens_per_expert is None:
        raise ValueError(f"{op}: argument 'tokens_per_expert' must be given (the routing map's per-expert counts)")
    if isinstance(align_size, bool) or not isinstance(align_size, int) or align_size <= 0:
        raise ValueError(f"{op}: argument 'align_size' must be a positive int, got {align_size!r}")
    out, permuted_probs, ids = moe_permute_with_probs(inp, probs, routing_map)
    counts = (ids >= 0).sum(0)
    tokens_per_expert = torch.as_tensor(tokens_per_expert, device=counts.device)
    if tokens_per_expert.dtype.is_floating_point or tokens_per_expert.dtype.is_complex \
            or tokens_per_expert.dtype == torch.bool:
        raise TypeError(f"{op}: argument 'tokens_per_expert' must hold integer counts, got {tokens_per_expert.dtype} "
                        "(a fractional count would be truncated)")
    if tokens_per_expert.shape != counts.shape or not torch.equal(tokens_per_expert.long(), counts.long()):
        raise ValueError(f"{op}: argument 'tokens_per_expert' ({tokens_per_expert.tolist()}) must be the routing "
                         f"map's per-expert counts ({counts.tolist()})")
    counts = counts.long()
    target = (counts + align_size - 1) // align_size * align_size
    if torch.equal(target, counts):
        pad_offsets = None
        row_id_map = ids
    else:
        pad = target - counts
        pad_offsets = torch.cumsum(pad, 0) - pad  # padding rows before each expert
        row_id_map = torch.where(ids >= 0, ids + pad_offsets.to(ids.dtype)[None, :], ids)
        # each unpadded row's padded row: expert e's rows shift by pad_offsets[e]
        dest = torch.repeat_interleave(pad_offsets, counts) + torch.arange(out.shape[0], device=out.device)
        total = int(target.sum().item())
        out = out.new_zeros((total, out.shape[1])).index_copy(0, dest, out)
        permuted_probs = permuted_probs.new_zeros(total).index_copy(0, dest, permuted_probs)
    setattr(row_id_map, _PADDED, True)
    return out, permuted_probs, row_id_map, pad_offsets, target


def moe_unpermute(inp: torch.Tensor, row_id_map: torch.Tensor, merging_probs: Optional[torch.Tensor] = None,
                  restore_shape: Optional[torch.Size] = None, map_type: str = "mask",
                  probs: Optional[torch.Tensor] = None, pad_offsets: Optional[torch.Tensor] = None) -> torch.Tensor:
    """TE's moe_unpermute (seqfuse.ops.moe.moe_unpermute with TE's full
    signature): probs is TE's deprecated name of merging_probs; pad_offsets
    is taken with the row_id_map of moe_permute_and_pad_with_probs (which
    already points at the padded rows)."""
    op = "moe_unpermute"
    if probs is not None:
        if merging_probs is not None:
            raise ValueError(f"{op}: both 'merging_probs' and its deprecated name 'probs' are given")
        warnings.warn(f"{op}: argument 'probs' is deprecated (as in TE); use 'merging_probs'", DeprecationWarning)
        merging_probs = probs
    if pad_offsets is not None and not getattr(row_id_map, _PADDED, False):
        raise NotImplementedError(f"{op}: argument 'pad_offsets' is not supported with this row_id_map: seqfuse "
                                  "takes it only with the row_id_map returned by moe_permute_and_pad_with_probs "
                                  "(pass that tensor itself, not a copy), whose rows already include the padding")
    return _moe.moe_unpermute(inp, row_id_map, merging_probs, restore_shape, map_type)


def _host_ints(op, name, t):
    if torch.is_tensor(t):
        if t.dim() != 1 or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise TypeError(f"{op}: argument '{name}' must be a 1-D integer tensor, got {t.dim()}-D {t.dtype}")
        return [int(v) for v in t.tolist()]
    if not isinstance(t, (list, tuple)) or any(isinstance(v, bool) or not isinstance(v, int) for v in t):
        raise TypeError(f"{op}: argument '{name}' must be a 1-D integer tensor or a list of ints, got {t!r}")
    return list(t)


def _chunk_rows(op, inp, split_sizes, sorted_index):
    """The source row of each output row."""
    if not torch.is_tensor(inp) or inp.dim() < 1:
        raise TypeError(f"{op}: argument 'inp' must be a tensor [num_tokens, ...]")
    sizes = _host_ints(op, "split_sizes", split_sizes)
    order = _host_ints(op, "sorted_index", sorted_index)
    if any(s < 0 for s in sizes):
        raise ValueError(f"{op}: argument 'split_sizes' must be non-negative, got {sizes}")
    if sum(sizes) != inp.shape[0]:
        raise ValueError(f"{op}: sum(split_sizes) = {sum(sizes)} but 'inp' has {inp.shape[0]} rows")
    if sorted(order) != list(range(len(sizes))):
        raise ValueError(f"{op}: argument 'sorted_index' must be a permutation of the {len(sizes)} chunk "
                         f"indices, got {order}")
    starts = [0]
    for s in sizes[:-1]:
        starts.append(starts[-1] + s)
    parts = [torch.arange(starts[i], starts[i] + sizes[i], device=inp.device) for i in order]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long, device=inp.device)


def moe_sort_chunks_by_index(inp: torch.Tensor, split_sizes: torch.Tensor,
                             sorted_index: torch.Tensor) -> torch.Tensor:
    """Split inp along dim 0 into chunks of split_sizes rows and concatenate
    them in the order sorted_index gives: out = cat([chunk[i] for i in
    sorted_index]).  Differentiable in inp."""
    op = "moe_sort_chunks_by_index"
    rows = _chunk_rows(op, inp, split_sizes, sorted_index)
    if not inp.numel():
        return inp
    return inp.index_select(0, rows)


def moe_sort_chunks_by_index_with_probs(inp: torch.Tensor, probs: torch.Tensor, split_sizes: torch.Tensor,
                                        sorted_index: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """moe_sort_chunks_by_index that moves probs [num_tokens] with the rows:
    (out, permuted_probs).  Differentiable in inp and probs."""
    op = "moe_sort_chunks_by_index_with_probs"
    rows = _chunk_rows(op, inp, split_sizes, sorted_index)
    if not torch.is_tensor(probs) or probs.dim() != 1 or probs.shape[0] != inp.shape[0]:
        raise ValueError(f"{op}: argument 'probs' must be a 1-D tensor of {inp.shape[0]} entries (one per row "
                         f"of 'inp'), got {tuple(probs.shape) if torch.is_tensor(probs) else type(probs).__name__}")
    return inp.index_select(0, rows), probs.index_select(0, rows)
