"""Splitting a batch for context parallelism, before the model.

Under CP each rank of the group feeds the model only its share of every
sequence: the 2*cp chunks of the load-balanced split, chunks r and 2cp-1-r
for rank r (context_parallel.py says why).  ``split_batch_for_cp_rank`` picks
those tokens from the per-token tensors of a batch (input ids, labels,
position ids), as Transformer Engine's ``get_batch_on_this_cp_rank`` and
BioNeMo's Llama 3 recipe do; position ids keep the tokens' positions in
their full sequences (made here when not given), which is what rotary
embeddings must be computed from.  ``cu_seqlens`` come back unchanged: the
attention under CP takes the full batch's (TE's convention).
``freqs_for_cp_rank`` picks the rows of a rotary angle table for a rank's
tokens, which is what TE's apply_rotary_pos_emb(cp_size, cp_rank) does.

Padding rule: every sequence length must be a multiple of 2*cp (bshd: the
padded row length; thd: each packed sequence).  ``pad_thd_sequences_for_cp``
pads each packed sequence at its end (labels -100 there, so the loss skips
them).  Labels are the caller's business: shift them for causal LM before
splitting, since a rank does not hold the token after its chunk's last one.
"""
from typing import NamedTuple, Optional

import torch

from ..ops.args import exact_int
from .context_parallel import local_token_index


class CPBatch(NamedTuple):
    """One rank's share of a batch (None where the input was None)."""
    input_ids: torch.Tensor
    labels: Optional[torch.Tensor]
    position_ids: torch.Tensor
    cu_seqlens: Optional[torch.Tensor]   # the full batch's, unchanged (thd), or None (bshd)
    max_seqlen: Optional[int]            # the full batch's longest sequence (thd), or None


def _check_cp(cp_size, cp_rank, who):
    """(cp_size, cp_rank) as ints, checked."""
    size, rank = exact_int(cp_size), exact_int(cp_rank)
    if size is None or size < 1:
        raise ValueError(f"{who}: cp_size must be a positive int, got {cp_size!r}")
    if rank is None or not 0 <= rank < size:
        raise ValueError(f"{who}: cp_rank must be an int in [0, {size}), got {cp_rank!r}")
    return size, rank


def _lengths(cu_seqlens, who, name="cu_seqlens"):
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"{who}: {name} must be a 1-D tensor of cumulative lengths starting at 0")
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    if int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"{who}: {name} must start at 0 and never decrease, got {cu.tolist()}")
    return cu[1:] - cu[:-1]


def split_batch_for_cp_rank(input_ids, labels=None, position_ids=None, cu_seqlens=None, *, cp_size, cp_rank,
                            qkv_format=None):
    """This rank's tokens of a batch, as a CPBatch.

    ``qkv_format`` "thd" (packed: tensors [t] or [1, t], ``cu_seqlens`` int32
    [n + 1] required) or "bshd" (tensors [b, s], split along s); by default
    thd when cu_seqlens is given.  Every sequence length must be a multiple
    of 2 * cp_size (ValueError naming the sequence otherwise).  The tokens
    come in the rank's local order: per sequence, chunk cp_rank then chunk
    2*cp_size-1-cp_rank."""
    return _split(input_ids, labels, position_ids, cu_seqlens, cp_size, cp_rank, qkv_format,
                  "split_batch_for_cp_rank")


def _split(input_ids, labels, position_ids, cu_seqlens, cp_size, cp_rank, qkv_format, who, split=True,
           names=None):
    """split_batch_for_cp_rank's body.  ``split=False`` (a group of one
    rank, which keeps every token in its order): the same checks of the
    batch against cu_seqlens, but no 2*cp_size padding rule (nothing is cut
    into chunks) and the given tensors come back themselves, not copies.
    ``names``: the caller's names of the four tensors (input_ids, labels,
    position_ids, cu_seqlens), for its messages."""
    ids_n, labels_n, pos_n, cu_n = names or ("input_ids", "labels", "position_ids", "cu_seqlens")
    cp_size, cp_rank = _check_cp(cp_size, cp_rank, who)
    fmt = qkv_format or ("thd" if cu_seqlens is not None else "bshd")
    if fmt not in ("thd", "bshd"):
        raise ValueError(f"{who}: qkv_format must be 'thd' or 'bshd', got {fmt!r}")
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"{who}: {ids_n} must be a torch.Tensor, got {type(input_ids).__name__}")
    if fmt == "thd":
        if cu_seqlens is None:
            raise ValueError(f"{who}: qkv_format 'thd' needs {cu_n}")
        lengths = _lengths(cu_seqlens, who, cu_n)
        total, seq_dim = int(lengths.sum()), input_ids.dim() - 1
        if input_ids.dim() not in (1, 2) or (input_ids.dim() == 2 and input_ids.shape[0] != 1):
            raise ValueError(f"{who}: thd {ids_n} must be [t] or [1, t], got {tuple(input_ids.shape)}")
        if input_ids.shape[-1] != total:
            raise ValueError(f"{who}: {ids_n} hold {input_ids.shape[-1]} tokens but {cu_n} ends at {total} "
                             f"({cu_n}[-1] must be the packed batch's token count)")
    else:
        if cu_seqlens is not None:
            raise ValueError(f"{who}: {cu_n} is for qkv_format 'thd'; bshd rows are split along dim 1")
        if input_ids.dim() != 2:
            raise ValueError(f"{who}: bshd {ids_n} must be [b, s], got {tuple(input_ids.shape)}")
        total, seq_dim = input_ids.shape[1], 1
        lengths = torch.tensor([total])
    bad = (lengths % (2 * cp_size)) != 0
    if split and bool(bad.any()):
        i = int(bad.nonzero()[0])
        what = "the row length" if fmt == "bshd" else f"sequence {i}'s length"
        raise ValueError(f"{who}: with cp_size {cp_size} every sequence length must be a multiple of 2*cp_size = "
                         f"{2 * cp_size}; {what} is {int(lengths[i])} (pad it: pad_thd_sequences_for_cp)")
    if position_ids is None:
        starts = torch.cumsum(lengths, 0) - lengths
        pos = torch.arange(total) - torch.repeat_interleave(starts, lengths)
        position_ids = pos.to(input_ids.device).expand(input_ids.shape) if fmt == "bshd" \
            else pos.to(input_ids.device).view(input_ids.shape)
    index = local_token_index(lengths, cp_size, cp_rank) if split else None

    def take(name, x):
        if x is None:
            return None
        if not isinstance(x, torch.Tensor) or x.shape != input_ids.shape:
            raise ValueError(f"{who}: {name} must be a tensor of {ids_n}' shape {tuple(input_ids.shape)}, got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        return x.index_select(seq_dim, index.to(x.device)) if split else x

    max_seqlen = int(lengths.max()) if fmt == "thd" and len(lengths) else None
    return CPBatch(take(ids_n, input_ids), take(labels_n, labels), take(pos_n, position_ids),
                   cu_seqlens if fmt == "thd" else None, max_seqlen)


def get_batch_on_this_cp_rank(cu_seqlens_padded, input_ids_padded, labels_padded, position_ids_padded,
                              cp_group=None, qvk_format="thd"):
    """Transformer Engine's name and argument order: (input_ids, labels,
    position_ids) of this rank of ``cp_group`` (thd only, as TE's).

    A group of one rank keeps the whole batch: the given tensors come back
    themselves (position ids made per sequence when None, as with more
    ranks), after the same checks as with more ranks: cu_seqlens a 1-D
    tensor starting at 0, never decreasing and ending at input_ids' token
    count, input_ids [t] or [1, t], labels and position ids of its shape
    (ValueError naming the argument otherwise; one host read of cu_seqlens,
    as with more ranks).  Only the padding rule (each length a multiple of
    2 * cp_size) is left out there: one rank cuts nothing into chunks."""
    import torch.distributed as dist

    who = "get_batch_on_this_cp_rank"
    if qvk_format != "thd":
        raise ValueError(f"{who}: qvk_format must be 'thd' (as Transformer Engine's), got "
                         f"{qvk_format!r}; split_batch_for_cp_rank takes bshd")
    size = dist.get_world_size(cp_group)
    b = _split(input_ids_padded, labels_padded, position_ids_padded, cu_seqlens_padded, size,
               dist.get_rank(cp_group), "thd", who, split=size > 1,
               names=("input_ids_padded", "labels_padded", "position_ids_padded", "cu_seqlens_padded"))
    return b.input_ids, b.labels, b.position_ids


def pad_thd_sequences_for_cp(input_ids, labels, cu_seqlens, cp_size, padding_token_id=0, padding_label_id=-100):
    """Each packed sequence padded at its end to a multiple of 2 * cp_size:
    returns (input_ids, labels, cu_seqlens) of the padded batch ([t'] / [1, t']
    as given, cu_seqlens int32).  Padding tokens get ``padding_token_id`` and
    labels ``padding_label_id`` (ignored by the loss); they are real keys to
    the attention of their own sequence's later padding only, since they sit
    after every real token of it (causal), or to all its tokens (no mask:
    use a loss mask and accept the extra keys, or pad to a length of real
    tokens only)."""
    who = "pad_thd_sequences_for_cp"
    cp_size, _ = _check_cp(cp_size, 0, who)
    lengths = _lengths(cu_seqlens, who)
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"{who}: input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
    if input_ids.dim() not in (1, 2) or (input_ids.dim() == 2 and input_ids.shape[0] != 1):
        # (any other shape was flattened and came back [t'] or [1, t']: the caller's rows merged into one)
        raise ValueError(f"{who}: input_ids must be packed, [t] or [1, t], got {tuple(input_ids.shape)}")
    if labels is not None and (not isinstance(labels, torch.Tensor) or labels.numel() != input_ids.numel()):
        raise ValueError(f"{who}: labels must be a tensor of one label per token of input_ids "
                         f"({input_ids.numel()}), got "
                         f"{tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__}")
    flat_ids = input_ids.reshape(-1)
    flat_labels = labels.reshape(-1) if labels is not None else None
    if flat_ids.numel() != int(lengths.sum()):
        raise ValueError(f"{who}: input_ids hold {flat_ids.numel()} tokens, cu_seqlens {int(lengths.sum())}")
    m = 2 * cp_size
    padded = (lengths + m - 1) // m * m
    starts = torch.cumsum(padded, 0) - padded
    # where each real token lands in the padded batch
    dest = torch.arange(int(lengths.sum())) - torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths) \
        + torch.repeat_interleave(starts, lengths)
    dest = dest.to(flat_ids.device)
    out_ids = torch.full((int(padded.sum()),), padding_token_id, dtype=flat_ids.dtype, device=flat_ids.device)
    out_ids[dest] = flat_ids
    out_labels = None
    if flat_labels is not None:
        out_labels = torch.full_like(out_ids, padding_label_id, dtype=flat_labels.dtype)
        out_labels[dest] = flat_labels
    shape = (1, -1) if input_ids.dim() == 2 else (-1,)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(padded, 0)]).to(cu_seqlens.device, torch.int32)
    return out_ids.view(shape), (out_labels.view(shape) if out_labels is not None else None), cu


def freqs_for_cp_rank(freqs, cp_size, cp_rank, cu_seqlens=None, seq_len=None):
    """The rows of a rotary angle table ``freqs`` ([max_s, 1, 1, d], as
    RotaryPositionEmbedding makes it, covering the full sequence) for this
    rank's tokens: [seq_len / cp, 1, 1, d] for bshd/sbhd (``seq_len``: the
    full sequence length, default the table's; row i is the position of
    local token i: rotate the local tensor with it as usual), or with
    ``cu_seqlens`` (thd, the full batch's) one row per local packed token,
    [t / cp, 1, 1, d]: rotate the local [t, h, d] tensor viewed as sbhd
    [t, 1, h, d], each token then getting its own row."""
    who = "freqs_for_cp_rank"
    cp_size, cp_rank = _check_cp(cp_size, cp_rank, who)
    if not isinstance(freqs, torch.Tensor) or freqs.dim() != 4:
        raise ValueError(f"{who}: freqs must be a [s, 1, 1, d] tensor, got "
                         f"{tuple(freqs.shape) if isinstance(freqs, torch.Tensor) else type(freqs).__name__}")
    if cu_seqlens is None:
        s = freqs.shape[0] if seq_len is None else exact_int(seq_len)
        if s is None:
            raise TypeError(f"{who}: seq_len must be an int (the full sequence length), got "
                            f"{type(seq_len).__name__} {seq_len!r}")
        if s < 0:
            raise ValueError(f"{who}: seq_len must be >= 0, got {s}")
        if s % (2 * cp_size) or s > freqs.shape[0]:
            raise ValueError(f"{who}: the full sequence length {s} must be a multiple of 2*cp_size = "
                             f"{2 * cp_size} and at most the table's {freqs.shape[0]} rows")
        position = local_token_index(torch.tensor([s]), cp_size, cp_rank)
    else:
        lengths = _lengths(cu_seqlens, who)
        bad = (lengths % (2 * cp_size)) != 0
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise ValueError(f"{who}: sequence {i}'s length {int(lengths[i])} in cu_seqlens is not a multiple of "
                             f"2*cp_size = {2 * cp_size}")
        if len(lengths) and int(lengths.max()) > freqs.shape[0]:
            raise ValueError(f"{who}: freqs has {freqs.shape[0]} rows, the longest sequence {int(lengths.max())}")
        starts = torch.cumsum(lengths, 0) - lengths
        in_seq = torch.arange(int(lengths.sum())) - torch.repeat_interleave(starts, lengths)
        position = in_seq[local_token_index(lengths, cp_size, cp_rank)]
    return freqs.index_select(0, position.to(freqs.device))
