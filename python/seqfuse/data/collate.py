"""Batch layouts: packed THD (no padding between sequences) and padded BSHD.

Both take a list of samples ``{"input_ids": [L_i], "labels": [L_i], ...}``
(1-D integer tensors, input ids >= 0; an optional integer ``"index"``) and
return a dict of tensors. One sample dict instead of a list, a float or
bool tensor, and a negative input id (-100: labels given as ids) are
refused, naming the sample.

PackedTHDCollator -> THD layout (tokens, heads, head dim) for attention with
cu_seqlens (flash-attention varlen, seqfuse DotProductAttention qkv_format
"thd"):
  input_ids     int64 [T]       the sequences concatenated in sample order
  labels        int64 [T]
  position_ids  int64 [T]       0, 1, ... restarting at every sequence
  cu_seqlens    int32 [S + 1]   cumulative segment starts, 0 first, T last
  max_seqlen    int             longest segment
  num_sequences int             real sequences (b)
  num_tokens    int             real (unpadded) tokens = sum of L_i
  sample_indices int64 [b]      dataset indices of the samples (when given)
With ``pad_to_multiple_of`` (16 for FP8 GEMMs, whose token dimension must be a
multiple of 16) the total T is rounded up by appending pad tokens that form
their OWN dummy segment at the end: S = b + 1 and cu_seqlens has b + 2
entries, the dummy segment's position_ids restart at 0, and its labels are
-100. Attention restricted by cu_seqlens never lets a real token see a pad
token (nor the reverse), and the loss ignores them, so the padding changes
no result; only ``num_tokens`` and ``num_sequences`` count the real ones.
Without padding (or when T is already a multiple) S = b.

PaddedBSHDCollator -> batch-first padded layout (Hugging Face style):
  input_ids      int64 [B, L]   right-padded with the pad id
  attention_mask int64 [B, L]   1 on real tokens, 0 on padding
  labels         int64 [B, L]   -100 on padding
  num_tokens     int            real tokens
  sample_indices int64 [B]      dataset indices (when the samples carry them)
L is the longest sample, rounded up to ``pad_to_multiple_of`` if given (so
B * L is a multiple of it), or a fixed ``max_length``.
"""
from __future__ import annotations

import operator
from typing import Mapping, Sequence

import numpy as np
import torch

from ._checks import as_int, as_optional_int, exact_int, first_negative
from .masking import IGNORE_INDEX

__all__ = ["PackedTHDCollator", "PaddedBSHDCollator", "batch_to_device"]


_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _check_samples(name: str, samples: Sequence[dict]) -> list[int]:
    """Refuses an empty batch and malformed samples; the samples' token counts."""
    if not isinstance(samples, (list, tuple)):
        raise TypeError(f"{name}: argument 'samples' must be a list of sample dicts, got {type(samples).__name__}")
    if len(samples) == 0:
        raise ValueError(f"{name}: got an empty batch")
    for k, s in enumerate(samples):
        if type(s) is not dict and not isinstance(s, Mapping):
            raise TypeError(f"{name}: sample {k} must be a dict with 'input_ids' and 'labels', got {type(s).__name__}")
        for key in ("input_ids", "labels"):
            if key not in s:
                raise ValueError(f"{name}: sample {k} has no {key!r}")
            t = s[key]
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}: sample {k}: {key!r} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype not in _INT_DTYPES:  # a float id would be truncated (0.7 -> 0), a bool read as 0 / 1
                raise TypeError(f"{name}: sample {k}: {key!r} must be an integer tensor, got dtype {t.dtype}")
        ids, lab = s["input_ids"], s["labels"]
        if ids.dim() != 1 or lab.shape != ids.shape:
            raise ValueError(
                f"{name}: sample {k}: 'input_ids' and 'labels' must be 1-D of one length, got "
                f"{tuple(ids.shape)} and {tuple(lab.shape)}"
            )
        if ids.numel() == 0:
            raise ValueError(f"{name}: sample {k} is empty")
        if "index" in s:
            idx = s["index"]
            if type(idx) is not int and exact_int(idx) is None:
                raise TypeError(
                    f"{name}: sample {k}: 'index' must be an integer, got {type(idx).__name__} ({idx!r:.40})"
                )
    return [int(s["input_ids"].numel()) for s in samples]


def _refuse_negative_ids(name: str, samples, collated: torch.Tensor) -> None:
    """A negative input id (labels given as ids: -100) would make the
    embedding lookup fail far from here, or index from the end of a table;
    one check over the collated ids, then the sample is found."""
    lowest = collated.numpy().min() if collated.device.type == "cpu" else int(collated.min())  # (numpy's: 10x faster)
    if lowest < 0:
        for k, s in enumerate(samples):
            found = first_negative(s["input_ids"])
            if found is not None:
                raise ValueError(
                    f"{name}: sample {k}: 'input_ids' holds {found[1]} at position {found[0]}; token ids "
                    "must be >= 0 (-100 marks ignored labels, not tokens)"
                )


def _indices(samples) -> dict:
    if all("index" in s for s in samples):
        return {"sample_indices": torch.tensor([operator.index(s["index"]) for s in samples], dtype=torch.long)}
    return {}


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


class _Collator:
    """What both collators take alike: the padding token's id and an optional
    ``pad_to_multiple_of`` (>= 1, checked here)."""

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None):
        name = type(self).__name__
        self.pad_token_id = as_int(name, "pad_token_id", pad_token_id, 0)
        self.pad_to_multiple_of = as_optional_int(name, "pad_to_multiple_of", pad_to_multiple_of, 1)


class PackedTHDCollator(_Collator):
    """Concatenate samples into one THD batch (see the module note).

    ``max_tokens`` (optional) is a hard check: a batch whose padded total
    exceeds it raises ValueError (the batch sampler should never build one).
    """

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None, max_tokens: int | None = None):
        super().__init__(pad_token_id, pad_to_multiple_of)
        self.max_tokens = as_optional_int("PackedTHDCollator", "max_tokens", max_tokens, 1)

    def __call__(self, samples: Sequence[dict]) -> dict:
        lens = _check_samples("PackedTHDCollator", samples)
        n_real = sum(lens)
        total = _round_up(n_real, self.pad_to_multiple_of) if self.pad_to_multiple_of else n_real
        if self.max_tokens is not None and total > self.max_tokens:
            raise ValueError(
                f"PackedTHDCollator: batch of {len(samples)} sequences holds {total} tokens"
                f" (padded), more than max_tokens={self.max_tokens}"
            )
        n_pad = total - n_real
        seg_lens = lens + ([n_pad] if n_pad else [])
        ids = [s["input_ids"].to(torch.long) for s in samples]
        labels = [s["labels"].to(torch.long) for s in samples]
        if n_pad:
            ids.append(torch.full((n_pad,), self.pad_token_id, dtype=torch.long))
            labels.append(torch.full((n_pad,), IGNORE_INDEX, dtype=torch.long))
        seg = np.asarray(seg_lens, dtype=np.int64)
        cu = np.zeros(len(seg_lens) + 1, dtype=np.int64)
        np.cumsum(seg, out=cu[1:])
        # position = token index minus the start of its segment (numpy: torch's
        # repeat_interleave is slow on CPU for this size)
        position_ids = np.arange(total, dtype=np.int64) - np.repeat(cu[:-1], seg)
        flat = torch.cat(ids)
        _refuse_negative_ids("PackedTHDCollator", samples, flat)
        return {
            "input_ids": flat,
            "labels": torch.cat(labels),
            "position_ids": torch.from_numpy(position_ids),
            "cu_seqlens": torch.from_numpy(cu.astype(np.int32)),
            "max_seqlen": max(seg_lens),
            "num_sequences": len(samples),
            "num_tokens": n_real,
            **_indices(samples),
        }


class PaddedBSHDCollator(_Collator):
    """Right-pad samples into ``[B, L]`` tensors (see the module note)."""

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None, max_length: int | None = None):
        super().__init__(pad_token_id, pad_to_multiple_of)
        max_length = as_optional_int("PaddedBSHDCollator", "max_length", max_length, 1)
        if max_length is not None and pad_to_multiple_of and max_length % pad_to_multiple_of:
            raise ValueError(
                f"PaddedBSHDCollator: 'max_length' ({max_length}) must be a multiple of "
                f"'pad_to_multiple_of' ({pad_to_multiple_of})"
            )
        self.max_length = max_length

    def __call__(self, samples: Sequence[dict]) -> dict:
        lens = _check_samples("PaddedBSHDCollator", samples)
        longest = max(lens)
        if self.max_length is not None:
            if longest > self.max_length:
                raise ValueError(
                    f"PaddedBSHDCollator: a sample of {longest} tokens exceeds max_length={self.max_length}"
                )
            L = self.max_length
        else:
            L = _round_up(longest, self.pad_to_multiple_of) if self.pad_to_multiple_of else longest
        B = len(samples)
        input_ids = torch.full((B, L), self.pad_token_id, dtype=torch.long)
        labels = torch.full((B, L), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((B, L), dtype=torch.long)
        for b, (s, n) in enumerate(zip(samples, lens)):
            input_ids[b, :n] = s["input_ids"]
            labels[b, :n] = s["labels"]
            attention_mask[b, :n] = 1
        _refuse_negative_ids("PaddedBSHDCollator", samples, input_ids)
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "labels": labels,
            "num_tokens": sum(lens),
            **_indices(samples),
        }


def batch_to_device(batch: dict, device, non_blocking: bool = True) -> dict:
    """Move a collated batch's tensors to ``device`` (ints stay ints).
    ``sample_indices`` stays on the CPU: it is bookkeeping, not model input."""
    if not isinstance(batch, Mapping):
        raise TypeError(
            f"batch_to_device: argument 'batch' must be a dict (a collated batch), got {type(batch).__name__}"
        )
    return {
        k: v.to(device, non_blocking=non_blocking) if isinstance(v, torch.Tensor) and k != "sample_indices" else v
        for k, v in batch.items()
    }
