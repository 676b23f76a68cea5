"""Optimizers on seqfuse's multi-tensor kernels: FusedAdamW (fp32 master
weights for bf16/fp16 parameters) and clip_grad_norm_ (the gradient norm and
the clipping without reading anything back to the host)."""
from .adamw import FusedAdamW, moment_dtype
from .clip import clip_grad_norm_

__all__ = ["FusedAdamW", "clip_grad_norm_", "moment_dtype"]
