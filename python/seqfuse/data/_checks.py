"""Argument checks shared by the data layer (batching, collators, writers)."""
from __future__ import annotations

import operator

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


def as_int(caller: str, name: str, value, minimum: int | None = None) -> int:
    """``value`` as a Python int: any integer (Python, numpy, a 0-d integer
    torch tensor, through ``operator.index``), never a float or a bool; at
    least ``minimum`` when given. TypeError / ValueError naming the argument."""
    n = exact_int(value)
    if n is None:
        raise TypeError(f"{caller}: argument '{name}' must be an integer, got {type(value).__name__} ({value!r})")
    if minimum is not None and n < minimum:
        raise ValueError(f"{caller}: argument '{name}' must be >= {minimum}, got {n}")
    return n


def as_optional_int(caller: str, name: str, value, minimum: int | None = None) -> int | None:
    """``as_int``, with None passed through (the argument's "off" value)."""
    return None if value is None else as_int(caller, name, value, minimum)
