"""Transformer Engine's Fp8Padding and Fp8Unpadding: the MoE helpers that pad
each expert's block of rows to a multiple of the quantization alignment
before a grouped GEMM (FP8 GEMMs need row counts that are multiples of 16,
MXFP8 of 32, NVFP4 of 128) and drop the padding after it.

Same constructors, forwards and return conventions as TE 2.20:

    pad = Fp8Padding(num_gemms, align_size=None)
    out, padded_m_splits = pad(inp, m_splits)     # inp returned as is when nothing pads
    unpad = Fp8Unpadding(num_gemms, align_size=None)
    out = unpad(inp, m_splits)                     # m_splits: the unpadded sizes

align_size=None takes it from the recipe active at the first forward (as TE
does): 32 for MXFP8BlockScaling, 128 for NVFP4BlockScaling, 16 otherwise.
Padding rows are zeros.  Both are exact row copies (index_copy /
index_select), so autograd gives the gradient: the padding rows' gradient
is dropped, as in TE's fused kernels.
"""
from typing import List, Optional, Tuple

import torch

from ..quantization import get_recipe

__all__ = ["Fp8Padding", "Fp8Unpadding"]


def _align_for(recipe):
    if recipe.mxfp8():
        return 32
    if recipe.nvfp4():
        return 128
    return 16


def _check_init(who, num_gemms, align_size):
    if isinstance(num_gemms, bool) or not isinstance(num_gemms, int) or num_gemms < 1:
        raise ValueError(f"{who}: argument 'num_gemms' must be a positive int, got {num_gemms!r}")
    if align_size is not None and (isinstance(align_size, bool) or not isinstance(align_size, int)
                                   or align_size < 1):
        raise ValueError(f"{who}: argument 'align_size' must be a positive int or None, got {align_size!r}")


def _splits(who, m_splits, num_gemms):
    if torch.is_tensor(m_splits):
        m_splits = m_splits.tolist()
    m_splits = list(m_splits)
    if len(m_splits) != num_gemms:
        raise ValueError(f"{who}: argument 'm_splits' has {len(m_splits)} entries but num_gemms is {num_gemms}")
    if any(isinstance(m, bool) or not isinstance(m, int) or m < 0 for m in m_splits):
        raise ValueError(f"{who}: argument 'm_splits' must hold non-negative ints, got {m_splits}")
    return m_splits


def _row_index(m_splits, padded_m_splits, device):
    """The padded row of each unpadded row, as one index tensor."""
    parts, start = [], 0
    for m, p in zip(m_splits, padded_m_splits):
        parts.append(torch.arange(start, start + m, device=device))
        start += p
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long, device=device)


class _Aligned(torch.nn.Module):
    def __init__(self, num_gemms: int, align_size: Optional[int] = None) -> None:
        super().__init__()
        _check_init(type(self).__name__, num_gemms, align_size)
        self.num_gemms = num_gemms
        self.align_size = align_size

    def _padded(self, m_splits):
        if self.align_size is None:  # fixed at the first forward, from the active recipe (as TE)
            self.align_size = _align_for(get_recipe())
        a = self.align_size
        return [(m + a - 1) // a * a for m in m_splits]

    @staticmethod
    def _rows(who, name, inp, want):
        if not torch.is_tensor(inp) or inp.dim() < 1:
            raise TypeError(f"{who}: argument 'inp' must be a tensor of at least one dimension")
        x = inp.reshape(-1, inp.shape[-1])
        if x.shape[0] != want:
            raise ValueError(f"{who}: argument 'inp' has {x.shape[0]} rows but sum({name}) is {want}")
        return x


class Fp8Padding(_Aligned):
    """Pad each split of the grouped-GEMM input to a multiple of align_size
    rows (zeros appended at the end of each split)."""

    def forward(self, inp: torch.Tensor, m_splits: List[int]) -> Tuple[torch.Tensor, List[int]]:
        who = "Fp8Padding"
        m_splits = _splits(who, m_splits, self.num_gemms)
        padded = self._padded(m_splits)
        x = self._rows(who, "m_splits", inp, sum(m_splits))
        if padded == m_splits:
            return inp, m_splits
        idx = _row_index(m_splits, padded, x.device)
        out = x.new_zeros((sum(padded), x.shape[1])).index_copy(0, idx, x)
        return out, padded


class Fp8Unpadding(_Aligned):
    """Drop the padding rows Fp8Padding added: m_splits are the unpadded
    sizes, inp holds the padded ones."""

    def forward(self, inp: torch.Tensor, m_splits: List[int]) -> torch.Tensor:
        who = "Fp8Unpadding"
        m_splits = _splits(who, m_splits, self.num_gemms)
        padded = self._padded(m_splits)
        x = self._rows(who, "padded m_splits", inp, sum(padded))
        if padded == m_splits:
            return inp
        return x.index_select(0, _row_index(m_splits, padded, x.device))
