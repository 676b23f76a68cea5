"""seqfuse under torch.distributed (NCCL on GPUs, gloo on the CPU): the
parallelism that spans GPUs and the process-group helpers of a run.

- Context parallelism of attention (context_parallel.py) and the per-rank
  batch split it needs (split_batch.py); modules reach the attention through
  DotProductAttention.set_context_parallel_group, with Transformer Engine's
  arguments.
- Expert parallelism (expert_parallel.py: the token exchange, the dp x ep
  mesh, gradient reduction and clipping); the layer is
  seqfuse.modules.ExpertParallelGroupedMLP.
- FSDP2's FP8 weight all-gather (fp8_allgather.py: enable_fp8_all_gather).
- end_process_group: FSDP2 models, device meshes and DTensors keep the
  process group alive through reference cycles.  Left to the interpreter's
  exit, gloo's threads were destroyed in std::terminate (SIGABRT,
  intermittent in 2-process FSDP2 runs: about 1 in 6 of the AdamW test
  before this existed).  So the cycles are collected first, every rank waits
  at a barrier until all are past their last collective, and only then is
  the group destroyed.

This package sits beside seqfuse.modules in the layer order (it imports
ops, quantization and common only; the modules import it for CP and EP).
"""
import gc

import torch.distributed as dist

from .context_parallel import COMM_TYPES, context_parallel_attention, local_token_index, merge_partial
from .expert_parallel import (EPDispatch, all_to_all_single_autograd, clip_grad_norm_, combine_tokens,
                              dispatch_tokens, expert_parameters, fully_shard_expert_parallel,
                              init_expert_parallel_mesh, reduce_expert_parallel_grads)
from .fp8_allgather import (FP8ShardWeight, GatheredFP8Weight, enable_fp8_all_gather,  # noqa: E402
                            fp8_all_gather_params, gathered_bytes)
from .split_batch import (CPBatch, freqs_for_cp_rank, get_batch_on_this_cp_rank, pad_thd_sequences_for_cp,
                          split_batch_for_cp_rank)

__all__ = ["end_process_group", "enable_fp8_all_gather", "fp8_all_gather_params", "gathered_bytes",
           "FP8ShardWeight", "GatheredFP8Weight",
           "COMM_TYPES", "context_parallel_attention", "local_token_index", "merge_partial", "CPBatch",
           "split_batch_for_cp_rank", "freqs_for_cp_rank", "get_batch_on_this_cp_rank", "pad_thd_sequences_for_cp",
           "EPDispatch", "all_to_all_single_autograd", "dispatch_tokens", "combine_tokens", "clip_grad_norm_",
           "expert_parameters", "fully_shard_expert_parallel", "init_expert_parallel_mesh",
           "reduce_expert_parallel_grads"]


def end_process_group(ok=True):
    """Tear down the default process group at the end of a distributed run.

    Call it after the function that held the models has returned (they must
    be unreachable, or collecting cannot free them).  ``ok=False`` (the run
    failed on this rank) skips the barrier: the other ranks may never reach
    it, and waiting would hang instead of letting the failure surface."""
    if not dist.is_initialized():
        return
    gc.collect()
    if ok:
        dist.barrier()
    dist.destroy_process_group()
