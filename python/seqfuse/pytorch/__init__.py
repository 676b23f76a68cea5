"""Transformer Engine's PyTorch API, spelled the same way, so code written for
it runs by changing the import:

    import seqfuse.pytorch as te
    from seqfuse.common.recipe import Format, DelayedScaling

Each export below comes from the module that implements it (seqfuse.modules,
seqfuse.quantization); this file only gathers the names.
"""
# Exports are added here by each module family as it lands.
from ..modules.cross_entropy import CrossEntropyLoss, linear_cross_entropy, parallel_cross_entropy
from ..modules.rope import RotaryPositionEmbedding, apply_rotary_pos_emb

__all__ = ["RotaryPositionEmbedding", "apply_rotary_pos_emb"]

from .attention import DotProductAttention  # noqa: E402  (TE's full constructor; see attention.py)

__all__ += ["DotProductAttention"]

__all__ += ["CrossEntropyLoss", "linear_cross_entropy", "parallel_cross_entropy"]

# quantization: autocast, model init, recipes, quantized tensors
from ..quantization import (Float8Tensor, autocast, checkpoint, fp8_autocast, fp8_model_init,  # noqa: E402
                            is_fp8_enabled, make_graphed_callables, quantized_model_init)
from ..common import recipe  # noqa: E402

__all__ += ["autocast", "fp8_autocast", "quantized_model_init", "fp8_model_init",
            "is_fp8_enabled", "Float8Tensor", "recipe", "checkpoint", "make_graphed_callables"]

from ..modules.norm import LayerNorm, RMSNorm  # noqa: E402

__all__ += ["LayerNorm", "RMSNorm"]

from ..modules.multihead_attention import MultiheadAttention  # noqa: E402
from ..modules.transformer_layer import TransformerLayer  # noqa: E402

__all__ += ["MultiheadAttention", "TransformerLayer"]

from ..modules.layernorm_linear import LayerNormLinear  # noqa: E402
from ..modules.layernorm_mlp import LayerNormMLP  # noqa: E402

__all__ += ["LayerNormLinear", "LayerNormMLP"]

from ..modules.linear import Linear  # noqa: E402

__all__ += ["Linear"]

# capability and version queries (TE's names and return conventions)
from .utils import (deinterleave_glu_tensor, get_cudnn_version, get_default_recipe,  # noqa: E402
                    get_device_compute_capability, interleave_glu_tensor, is_bf16_available, is_fp8_available,
                    is_fp8_block_scaling_available, is_mxfp8_available, is_nvfp4_available)

__all__ += ["deinterleave_glu_tensor", "interleave_glu_tensor", "get_cudnn_version", "get_default_recipe",
            "get_device_compute_capability", "is_bf16_available", "is_fp8_available",
            "is_fp8_block_scaling_available", "is_mxfp8_available", "is_nvfp4_available"]

# te.ops (fusible operations) and te.optimizers
from . import ops, optimizers  # noqa: E402

__all__ += ["ops", "optimizers"]

# te.distributed: checkpoint (above) and the RNG tracker
from . import distributed  # noqa: E402
from .distributed import CudaRNGStatesTracker  # noqa: E402

__all__ += ["distributed", "CudaRNGStatesTracker"]

# mixture of experts: TE's GroupedLinear and its top-level permutation functions (te.router and
# te.permutation hold the rest under TE's module paths)
from ..modules.grouped_linear import GroupedLinear  # noqa: E402
from ..modules.moe import GroupedMLP  # noqa: E402
from . import permutation, router  # noqa: E402
from .permutation import moe_permute, moe_permute_with_probs, moe_unpermute  # noqa: E402

__all__ += ["GroupedLinear", "GroupedMLP", "permutation", "router", "moe_permute", "moe_permute_with_probs",
            "moe_unpermute"]
from .permutation import (moe_permute_and_pad_with_probs, moe_sort_chunks_by_index,  # noqa: E402
                          moe_sort_chunks_by_index_with_probs)
from .fp8_padding import Fp8Padding, Fp8Unpadding  # noqa: E402

__all__ += ["moe_permute_and_pad_with_probs", "moe_sort_chunks_by_index", "moe_sort_chunks_by_index_with_probs", "Fp8Padding", "Fp8Unpadding"]

# TE names seqfuse refuses (NotImplementedError naming the name and what to use instead; see refused.py)
from .refused import destroy_ub, get_cpu_offload_context, initialize_ub, onnx_export  # noqa: E402

__all__ += ["destroy_ub", "get_cpu_offload_context", "initialize_ub", "onnx_export"]
