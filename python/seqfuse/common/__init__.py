"""Framework-neutral pieces shared by seqfuse's PyTorch layers, named as in
Transformer Engine's ``transformer_engine.common`` (``recipe``)."""
from . import recipe

__all__ = ["recipe"]
