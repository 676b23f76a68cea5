"""Transformer Engine's ``transformer_engine.pytorch.permutation`` spelled the
same way: token permutation for MoE with a routing mask, implemented in
seqfuse.ops.moe (C kernels in csrc/moe/).  seqfuse's row_id_map layout is
its own ([tokens, experts] int32): pass it only back to these functions.

moe_sort_chunks_by_index(_with_probs) reorders contiguous chunks of rows
(expert parallelism: the tokens received from each rank, grouped by rank,
regrouped by local expert).  It is an exact row gather (index_select, so
autograd scatters the gradient back); it reads split_sizes and
sorted_index on the host (one device-to-host copy each when they are CUDA
tensors), where TE's kernel reads them on the device."""
from typing import Tuple

import torch

from ..ops.moe import moe_permute, moe_permute_with_probs, moe_unpermute  # noqa: F401

__all__ = ["moe_permute", "moe_permute_with_probs", "moe_unpermute", "moe_sort_chunks_by_index",
           "moe_sort_chunks_by_index_with_probs"]


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
