"""Argument checks shared by the data layer (batching, collators, writers)."""
from __future__ import annotations

import operator

import numpy as np
import torch


def exact_int(value):
    """``value`` as a Python int where it is an integer of any kind (int,
    numpy's, a one-element integer torch tensor), else None (a bool, a float,
    a string).  seqfuse.ops.args has the same reading for the layers below;
    the data layer depends on nothing of seqfuse's (tests/test_import_graph.py)."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


#: The largest seed: seeds are mixed as unsigned 64-bit integers (masking.sample_seed).
MAX_SEED = 2**64 - 1


def as_int(caller: str, name: str, value, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as a Python int: any integer (Python, numpy, a 0-d integer
    torch tensor, through ``operator.index``), never a float or a bool; at
    least ``minimum`` and at most ``maximum`` when given. TypeError /
    ValueError naming the argument."""
    n = exact_int(value)
    if n is None:
        raise TypeError(f"{caller}: argument '{name}' must be an integer, got {type(value).__name__} ({value!r:.80})")
    if minimum is not None and n < minimum:
        raise ValueError(f"{caller}: argument '{name}' must be >= {minimum}, got {n}")
    if maximum is not None and n > maximum:
        bound = "2**64 - 1" if maximum == MAX_SEED else str(maximum)
        raise ValueError(f"{caller}: argument '{name}' must be <= {bound}, got {n}")
    return n


def as_optional_int(caller: str, name: str, value, minimum: int | None = None) -> int | None:
    """``as_int``, with None passed through (the argument's "off" value)."""
    return None if value is None else as_int(caller, name, value, minimum)


def as_seed(caller: str, name: str, value) -> int:
    """A seed: an integer in [0, 2**64 - 1] (larger ones would be folded
    onto smaller ones by the 64-bit mixing: 2**64 would be seed 0)."""
    return as_int(caller, name, value, 0, MAX_SEED)


def as_bool(caller: str, name: str, value) -> bool:
    """``value`` as a Python bool: True / False or numpy's bools, nothing
    else (the string "False" is truthy, so a flag read from a command line
    or a hand-written config as a string would silently mean True)."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(
        f"{caller}: argument '{name}' must be a bool (True or False), got {type(value).__name__} ({value!r:.80})"
    )


def integer_ids(caller: str, name: str, value, *, allow_sequence: bool = False) -> torch.Tensor:
    """``value`` as a 1-D-or-more integer torch tensor of ids >= 0: a
    tensor of an integer dtype (never float: 20.7 would become id 20; never
    bool), or, with ``allow_sequence``, a list / tuple / numpy array of
    integers. TypeError / ValueError naming the argument, the first
    negative id and its position."""
    if not isinstance(value, torch.Tensor):
        if not allow_sequence or isinstance(value, (str, bytes)):
            raise TypeError(
                f"{caller}: argument '{name}' must be a torch.Tensor of token ids, got {type(value).__name__}"
            )
        try:
            value = torch.as_tensor(np.asarray(value))
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"{caller}: argument '{name}' must be a tensor or a sequence of integer ids, got "
                            f"{type(value).__name__}") from None
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise TypeError(f"{caller}: argument '{name}' must hold integers, got dtype {value.dtype}")
    found = first_negative(value)
    if found is not None:
        pos, v = found
        raise ValueError(
            f"{caller}: argument '{name}' holds {v} at position {pos}; token ids are >= 0"
            " (-100 marks ignored labels, not tokens)"
        )
    return value


def first_negative(ids: torch.Tensor):
    """(position, value) of the first negative entry of ``ids`` read flat,
    or None: where a negative token id (labels given as ids: -100) is."""
    if not ids.numel() or not bool((ids < 0).any()):
        return None
    flat = ids.reshape(-1)
    pos = int(torch.nonzero(flat < 0)[0])
    return pos, int(flat[pos])
