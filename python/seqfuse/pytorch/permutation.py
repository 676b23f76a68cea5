"""Transformer Engine's ``transformer_engine.pytorch.permutation`` spelled the
same way: token permutation for MoE with a routing mask, implemented in
seqfuse.ops.moe (C kernels in csrc/moe/).  seqfuse's row_id_map layout is
its own ([tokens, experts] int32): pass it only back to these functions."""
from ..ops.moe import moe_permute, moe_permute_with_probs, moe_unpermute  # noqa: F401

__all__ = ["moe_permute", "moe_permute_with_probs", "moe_unpermute"]
