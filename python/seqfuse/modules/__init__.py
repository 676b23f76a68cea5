"""torch.nn.Module layers built on seqfuse.ops, each with its autograd
Function: Linear, LayerNorm, RMSNorm, LayerNormLinear, LayerNormMLP,
DotProductAttention, MultiheadAttention, TransformerLayer, ..."""
from .cross_entropy import (CrossEntropyFunction, CrossEntropyLoss, LinearCrossEntropyFunction,
                            cross_entropy, linear_cross_entropy, parallel_cross_entropy)
from .rope import FusedRoPEFunc, RotaryPositionEmbedding, apply_rotary_pos_emb

__all__ = ["FusedRoPEFunc", "RotaryPositionEmbedding", "apply_rotary_pos_emb"]

from .attention import DotProductAttention  # noqa: E402

__all__ += ["DotProductAttention"]

__all__ += ["CrossEntropyFunction", "CrossEntropyLoss", "LinearCrossEntropyFunction", "cross_entropy",
            "linear_cross_entropy", "parallel_cross_entropy"]

from .embedding import TiedGradient, tied_embedding  # noqa: E402

__all__ += ["TiedGradient", "tied_embedding"]

from .norm import LayerNorm, RMSNorm, layer_norm, rms_norm  # noqa: E402

__all__ += ["LayerNorm", "RMSNorm", "layer_norm", "rms_norm"]

from .multihead_attention import MultiheadAttention  # noqa: E402
from .transformer_layer import TransformerLayer  # noqa: E402

__all__ += ["MultiheadAttention", "TransformerLayer"]

from .activation import activation, bias_dropout_add  # noqa: E402

__all__ += ["activation", "bias_dropout_add"]

from .layernorm_linear import LayerNormLinear  # noqa: E402
from .layernorm_mlp import LayerNormMLP  # noqa: E402

__all__ += ["LayerNormLinear", "LayerNormMLP"]

from .linear import Linear, LinearFunction  # noqa: E402
from ._base import compute_dtype, residual_fusable  # noqa: E402

__all__ += ["Linear", "LinearFunction", "compute_dtype", "residual_fusable"]

from .grouped_linear import GroupedLinear, GroupedLinearFunction  # noqa: E402
from .moe import GroupedMLP  # noqa: E402

__all__ += ["GroupedLinear", "GroupedLinearFunction", "GroupedMLP"]

from .moe_expert_parallel import ExpertParallelGroupedMLP  # noqa: E402

__all__ += ["ExpertParallelGroupedMLP"]
