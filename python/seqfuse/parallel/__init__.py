"""Parallelism over several GPUs built on torch.distributed (NCCL on GPUs,
gloo on the CPU): context parallelism of attention (context_parallel.py) and
the per-rank batch split it needs (split_batch.py), and expert parallelism
(expert_parallel.py: the token exchange, the dp x ep mesh, gradient
reduction and clipping; the layer is seqfuse.modules.ExpertParallelGroupedMLP).  Modules reach the
attention through DotProductAttention.set_context_parallel_group, with
Transformer Engine's arguments."""
from .context_parallel import COMM_TYPES, context_parallel_attention, local_token_index, merge_partial
from .expert_parallel import (EPDispatch, all_to_all_single_autograd, clip_grad_norm_, combine_tokens,
                              dispatch_tokens, expert_parameters, fully_shard_expert_parallel,
                              init_expert_parallel_mesh, reduce_expert_parallel_grads)
from .split_batch import (CPBatch, freqs_for_cp_rank, get_batch_on_this_cp_rank, pad_thd_sequences_for_cp,
                          split_batch_for_cp_rank)

__all__ = ["COMM_TYPES", "context_parallel_attention", "local_token_index", "merge_partial", "CPBatch",
           "split_batch_for_cp_rank", "freqs_for_cp_rank", "get_batch_on_this_cp_rank", "pad_thd_sequences_for_cp",
           "EPDispatch", "all_to_all_single_autograd", "dispatch_tokens", "combine_tokens", "clip_grad_norm_",
           "expert_parameters", "fully_shard_expert_parallel", "init_expert_parallel_mesh",
           "reduce_expert_parallel_grads"]
