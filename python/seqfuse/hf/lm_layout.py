"""What the causal-LM families (Llama, Mixtral) and their context-parallel
mode share about a batch: the label value the loss ignores and ``Layout``,
how one batch runs through the layers.  Its own module so that
seqfuse.hf.context_parallel and the families import it without importing
each other.
"""
from typing import NamedTuple, Optional

import torch

IGNORE_INDEX = -100


class Layout(NamedTuple):
    """How one batch runs through the layers: packed (thd) or not, the
    keyword arguments of every TransformerLayer call, the length of the RoPE
    table, and the packed batch's cu_seqlens (None when padded)."""
    packed: bool
    layer_kw: dict
    rope_len: int
    cu_seqlens: Optional[torch.Tensor]
