"""Argument checks shared by the data layer (batching, collators, writers)."""
from __future__ import annotations

import operator


def as_int(caller: str, name: str, value, minimum: int | None = None) -> int:
    """``value`` as a Python int: any integer (Python, numpy, a 0-d integer
    torch tensor, through ``operator.index``), never a float or a bool; at
    least ``minimum`` when given. TypeError / ValueError naming the argument."""
    if isinstance(value, bool):
        raise TypeError(f"{caller}: argument '{name}' must be an integer, got bool ({value})")
    try:
        n = operator.index(value)
    except TypeError:
        raise TypeError(f"{caller}: argument '{name}' must be an integer, got {type(value).__name__} ({value!r})") from None
    if minimum is not None and n < minimum:
        raise ValueError(f"{caller}: argument '{name}' must be >= {minimum}, got {n}")
    return n


def as_optional_int(caller: str, name: str, value, minimum: int | None = None) -> int | None:
    """``as_int``, with None passed through (the argument's "off" value)."""
    return None if value is None else as_int(caller, name, value, minimum)
