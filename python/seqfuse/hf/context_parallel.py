"""Context parallelism (CP) for seqfuse's decoder families (Llama): how a
model whose attention runs under CP (TransformerLayer.set_context_parallel_group,
seqfuse.distributed) lays out a batch and reduces its loss.

Under CP every rank of the CP group holds its share of every sequence: the
2*cp chunks of the load-balanced split, chunks r and 2cp-1-r for rank r
(seqfuse.distributed.split_batch_for_cp_rank picks them before the model).
What changes for the model:

- Layout (``cp_layout``).  Packed (thd): ``input_ids`` hold the rank's
  tokens (t / cp of them) and ``cu_seqlens`` / ``max_seqlen`` are the FULL
  batch's (Transformer Engine's convention), every sequence length a
  multiple of 2*cp.  Padded (bshd): ``input_ids`` [b, s / cp], the full row
  length s a multiple of 2*cp; there is no attention mask under CP (the
  attention refuses padding masks in bshd): right padding is exact anyway
  for the real tokens, which under the causal mask never see the padding
  after them, and the padding's labels are -100.  In both, RoPE turns each
  local token by its full-sequence position: the rotary table covers the
  full length and the layers pick the rank's rows (MultiheadAttention under
  CP).  ``position_ids`` are refused under CP (the positions follow from the
  split) and so is an ``attention_mask``.

- Labels.  Token i predicts token i + 1, which may live on another rank, so
  the targets are shifted over the FULL sequences before the split
  (``shift_labels`` of seqfuse.hf.llama, packed with the full cu_seqlens)
  and passed as ``shift_labels`` (transformers' argument name for
  pre-shifted targets); unshifted ``labels`` are refused under CP.

- Loss (``context_parallel_lm_loss``).  Each rank sums the cross-entropy of
  its predicted tokens; the sums and the counts are added over the CP group
  (the sum through an autograd all-reduce), so every CP rank returns the
  loss of the whole sequences, the value CP=1 returns.  Every rank then
  backpropagates that same loss: the all-reduce's backward adds the cp
  ranks' incoming gradients, so each rank's parameter gradients are cp times
  its share, and the MEAN of the gradients over the CP group is exactly the
  CP=1 gradient.  That mean is what data-parallel training already takes:
  FSDP2 (or DDP) over the dp x cp ranks averages gradients over all of them.
"""
import torch
import torch.distributed as dist

from ..modules.cross_entropy import cross_entropy
from .lm_layout import IGNORE_INDEX, Layout


def cp_size_of(group) -> int:
    """The size of a CP group (1 for None)."""
    return 1 if group is None else dist.get_world_size(group)


def cp_layout(input_ids, group, attention_mask=None, position_ids=None, cu_seqlens=None, max_seqlen=None,
              name="SeqfuseLlama"):
    """How a rank's share of a batch runs through the layers under CP (a
    seqfuse.hf.llama.Layout), its arguments checked (see the module note)."""
    cp = cp_size_of(group)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name}: input_ids must be an int64 or int32 torch.Tensor")
    if attention_mask is not None:
        raise ValueError(f"{name}: under context parallelism (cp size {cp}) attention_mask must be None: pad rows "
                         "on the right (labels -100 there; the causal mask keeps real tokens off the padding) or "
                         "pack the sequences with cu_seqlens")
    if position_ids is not None:
        raise ValueError(f"{name}: under context parallelism position_ids must be None: each local token's "
                         "position follows from the load-balanced split (seqfuse.distributed.split_batch_for_cp_rank)")
    if cu_seqlens is not None:
        if input_ids.dim() == 2 and input_ids.shape[0] != 1 or input_ids.dim() not in (1, 2):
            raise ValueError(f"{name}: packed input_ids must be [t] or [1, t], got {tuple(input_ids.shape)}")
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
            raise TypeError(f"{name}: cu_seqlens must be a 1-D int32 torch.Tensor")
        if max_seqlen is None:
            max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item())
        # (the attention checks that every length is a multiple of 2*cp and the rank's token count)
        kw = dict(cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens, max_seqlen_q=int(max_seqlen),
                  max_seqlen_kv=int(max_seqlen), qkv_format="thd", self_attn_mask_type="padding_causal")
        return Layout(True, kw, int(max_seqlen), cu_seqlens)
    if input_ids.dim() != 2:
        raise ValueError(f"{name}: under context parallelism input_ids must be [batch, seq / cp] (bshd) or "
                         f"packed with cu_seqlens, got {tuple(input_ids.shape)}")
    return Layout(False, dict(self_attn_mask_type="causal", qkv_format="bshd"), input_ids.shape[1] * cp, None)


class _AllReduceSum(torch.autograd.Function):
    """dist.all_reduce (sum) over ``group`` with its gradient: every rank's
    output depends on every rank's input, so the backward sums the ranks'
    incoming gradients the same way."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        out = tensor.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def context_parallel_lm_loss(logits, targets, group, num_items_in_batch=None):
    """The next-token cross-entropy of the whole sequences, from this rank's
    ``logits`` [..., V] and its already shifted ``targets`` (-100 ignored),
    the same value on every rank of the CP ``group`` (see the module note
    for its gradient); ``group`` None or of one rank: no reduction.  Mean over the predicted tokens of the group, or the
    group's sum / ``num_items_in_batch`` when given (the caller's count of
    the whole batch's predicted tokens)."""
    flat, target = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    if target.shape[0] != flat.shape[0]:
        raise ValueError(f"context_parallel_lm_loss: targets hold {target.shape[0]} tokens, logits "
                         f"{flat.shape[0]}")
    local = cross_entropy(flat, target, ignore_index=IGNORE_INDEX, reduction="sum")
    reduce = group is not None and cp_size_of(group) > 1
    total = _AllReduceSum.apply(local, group) if reduce else local  # backward: the group's gradients added
    if num_items_in_batch is not None:
        return total / num_items_in_batch
    count = (target != IGNORE_INDEX).sum().to(torch.float32)
    if reduce:
        dist.all_reduce(count, group=group)  # a count: no gradient
    return total / count.clamp(min=1)
