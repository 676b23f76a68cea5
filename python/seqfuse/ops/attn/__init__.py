"""Fused attention (csrc/attn/): softmax(scale * Q K^T + mask) V without the
attention matrix, for padded (bshd, sbhd) and packed (thd) batches.

``attention`` is the autograd-aware entry; ``attention_forward`` and
``attention_backward`` are the two halves, with the log-sum-exp the forward saves
for the backward.  Masks and layouts are spelled as in Transformer Engine:

- ``qkv_format``: "bshd" [b, s, h, d], "sbhd" [s, b, h, d], "thd" [t, h, d]
  (sequences packed back to back, delimited by ``cu_seqlens_q/kv``, int32
  [b+1] cumulative lengths).
- ``attn_mask_type``: "no_mask", "padding", "causal", "padding_causal"
  (top-left aligned diagonal, as TE's "causal" and torch's ``is_causal``),
  "causal_bottom_right", "padding_causal_bottom_right" (diagonal through the
  last query and the last key, as flash-attn 2.1+).  In thd every mask is a
  padding mask (sequences never see each other).
- ``window_size`` = (left, right): query r sees keys r+off-left .. r+off+right,
  -1 for unbounded; (-1, -1) or None means no window.  off is 0 for the
  top-left causal masks and sk - sq otherwise (as TE).
- GQA/MQA: k and v may have fewer heads than q (a divisor of its count).

CUDA: float16/bfloat16, head dims 16, 24, 32, 64 and 128 (float32 and other
head dims through torch's kernels, _torch_routes.py).  CPU: the reference in
double precision, any head dim, float32 too.

Dropout (``dropout_p``, ``rng_state``) and how its mask is drawn:
_dropout.py.  Which code runs a call (the sm90/sm80 kernels on Hopper, or
cuDNN fused attention through torch SDPA) and the environment variables that
choose it: _routing.py; the routes through torch's FlashAttention-2 and
float32 SDPA: _torch_routes.py.

Files, one concern each:

- _entry.py: ``attention``, ``attention_forward``, ``attention_backward``.
- _args.py: argument checks and the C config tuple.
- _routing.py: kernel and backend choice, SEQFUSE_ATTN_BACKEND.
- _torch_routes.py: the "flash" and "torch_fp32" routes: rules, layouts, calls.
- _cudnn_ragged.py: the opt-in "cudnn_ragged" route (cuDNN's variable-length
  attention through torch's private op) and what torch 2.11 offers for it.
- _fp8.py: FP8 attention's kernel calls (``fp8_attention_forward`` /
  ``fp8_attention_backward``: cuDNN's FP8 graphs on CUDA through
  nvidia-cudnn-frontend, the float64 reference on the CPU); the scaling
  around them is seqfuse.quantization.attention's.
- _dropout.py: the Philox (seed, offset) state.
- _padding.py: ``padding_layout`` for padding masks (``PerTensorCache``, re-exported here, lives in ops/tensor_cache.py).
"""
from ._args import FORMATS, MASKS
from ._dropout import dropout_rng_state
from ._entry import attention, attention_backward, attention_forward
from ._fp8 import LAYOUTS as FP8_LAYOUTS
from ._fp8 import fp8_attention_backward, fp8_attention_forward, fp8_attention_unavailable
from ..tensor_cache import PerTensorCache
from ._padding import PaddingLayout, padding_layout
from ._cudnn_ragged import ragged_eligibility
from ._routing import (BACKENDS, attention_backend, attention_backward_kernel, attention_forward_kernel,
                       cudnn_eligibility, set_attention_backend, set_attention_backward_kernel,
                       set_attention_cudnn_ragged, set_attention_forward_kernel)
from ._torch_routes import flash_eligibility, fp32_eligibility

__all__ = ["attention", "attention_forward", "attention_backward", "attention_forward_kernel", "attention_backward_kernel",
           "set_attention_forward_kernel", "set_attention_backward_kernel", "attention_backend", "set_attention_backend",
           "cudnn_eligibility", "flash_eligibility", "fp32_eligibility", "ragged_eligibility",
           "set_attention_cudnn_ragged", "dropout_rng_state", "padding_layout",
           "PaddingLayout", "PerTensorCache", "FORMATS", "MASKS", "BACKENDS",
           "fp8_attention_forward", "fp8_attention_backward", "fp8_attention_unavailable", "FP8_LAYOUTS"]
