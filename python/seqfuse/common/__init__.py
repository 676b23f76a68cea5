"""Framework-neutral pieces shared by seqfuse's PyTorch layers, named as in
Transformer Engine's ``transformer_engine.common`` (``recipe``), and ``notes`` (log a route's
name once)."""
from . import notes, recipe

__all__ = ["notes", "recipe"]
