"""Transformer Engine's ``transformer_engine.pytorch.router`` spelled the
same way: the fused MoE router functions, implemented in seqfuse.ops.moe
(C kernels in csrc/moe/)."""
from ..ops.moe import (fused_compute_score_for_moe_aux_loss, fused_moe_aux_loss,  # noqa: F401
                       fused_topk_with_score_function)

__all__ = ["fused_topk_with_score_function", "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss"]
