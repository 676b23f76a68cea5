"""torch.nn.Module layers built on seqfuse.ops, each with its autograd
Function: Linear, LayerNorm, RMSNorm, LayerNormLinear, LayerNormMLP,
DotProductAttention, MultiheadAttention, TransformerLayer, ..."""
__all__ = []
