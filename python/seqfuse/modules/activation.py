"""Differentiable activations and bias + dropout + residual over
seqfuse.ops.act (autograd Functions; the MLP modules and users call these).

    activation(x, "swiglu")                      # y = silu(x[..., :n]) * x[..., n:]
    bias_dropout_add(x, bias, residual, p, training=True)
"""
import torch

from ..ops import act as act_ops


class _ActivationFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, name):
        ctx.save_for_backward(x)
        ctx.name = name
        return act_ops.act_forward(x, name)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        return act_ops.act_backward(dy, x, ctx.name), None


def activation(x, name):
    """One of seqfuse.ops.act.ACTIVATIONS applied to x, with autograd."""
    if name not in act_ops.ACTIVATIONS:
        raise ValueError(f"activation: argument 'name' must be one of {', '.join(act_ops.ACTIVATIONS)}, got {name!r}")
    return _ActivationFn.apply(x, name)


class _BiasDropoutAddFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, residual, p):
        out, seed, offset = act_ops.bias_dropout_add(x, bias, residual, p)
        ctx.p, ctx.seed, ctx.offset = p, seed, offset
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return out

    @staticmethod
    def backward(ctx, dout):
        dx, dbias = act_ops.dropout_backward(dout, ctx.p, ctx.seed, ctx.offset, ctx.bias_dtype)
        return dx, dbias, dout, None


def bias_dropout_add(x, bias, residual, p, training=True):
    """residual + dropout(x + bias, p) (p ignored when not training), one
    kernel each way; the keep mask is regenerated in the backward, not stored."""
    return _BiasDropoutAddFn.apply(x, bias, residual, float(p) if training else 0.0)


__all__ = ["activation", "bias_dropout_add"]
