"""Functional ops: torch tensors in and out.

Each op allocates its outputs with torch (so the caching allocator owns all
memory), hands them to seqfuse._C as destination arguments, and runs on the
caller's current CUDA stream.
"""
from .quant import amax
from .gemm import gemm
from .loss import cross_entropy_backward, cross_entropy_forward
from .rope import rope_backward, rope_forward, rope_parts

__all__ = ["amax", "gemm", "rope_forward", "rope_backward", "rope_parts"]

from .attn import attention, attention_backward, attention_forward  # noqa: E402
from .attn import attention_backward_kernel, attention_forward_kernel  # noqa: E402
from .attn import set_attention_backward_kernel, set_attention_forward_kernel  # noqa: E402
from .attn import attention_backend, cudnn_eligibility, set_attention_backend  # noqa: E402

__all__ += ["attention", "attention_forward", "attention_backward"]
__all__ += ["attention_forward_kernel", "set_attention_forward_kernel"]
__all__ += ["attention_backward_kernel", "set_attention_backward_kernel"]
__all__ += ["attention_backend", "set_attention_backend", "cudnn_eligibility"]

__all__ += ["cross_entropy_forward", "cross_entropy_backward"]

from .pending_errors import check_pending_errors  # noqa: E402

__all__ += ["check_pending_errors"]

from .quant import (cast_fp8, cast_transpose_fp8, dequantize_block_fp8,  # noqa: E402
                    dequantize_fp8, dequantize_mxfp8, dequantize_nvfp4, fp8_compute_scale,
                    fp8_scale_update, quantize_block_fp8, quantize_block_fp8_rowcol,
                    quantize_block_fp8_weight, block_transpose_fp8, quantize_mxfp8, quantize_nvfp4,
                    quantize_rowwise_fp8, transpose_fp8)

__all__ += ["cast_fp8", "cast_transpose_fp8", "dequantize_fp8", "fp8_compute_scale",
            "fp8_scale_update", "quantize_block_fp8", "dequantize_block_fp8", "quantize_mxfp8",
            "dequantize_mxfp8", "quantize_nvfp4", "dequantize_nvfp4",
            "quantize_block_fp8_rowcol", "quantize_block_fp8_weight", "block_transpose_fp8",
            "quantize_rowwise_fp8", "transpose_fp8"]

from .norm import layernorm_backward, layernorm_forward, rmsnorm_backward, rmsnorm_forward  # noqa: E402

__all__ += ["layernorm_forward", "layernorm_backward", "rmsnorm_forward", "rmsnorm_backward"]

from .optim import multi_tensor_adamw, multi_tensor_l2norm, multi_tensor_scale  # noqa: E402

__all__ += ["multi_tensor_adamw", "multi_tensor_l2norm", "multi_tensor_scale"]

from .act import act_backward, act_forward, bias_dropout_add, dropout_backward  # noqa: E402

__all__ += ["act_forward", "act_backward", "bias_dropout_add", "dropout_backward"]

from .embed import embedding_backward_add  # noqa: E402

__all__ += ["embedding_backward_add"]

from ._call import exchange_api_in_use  # noqa: E402

__all__ += ["exchange_api_in_use"]
