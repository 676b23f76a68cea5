"""Process-group helpers for runs that use seqfuse under torch.distributed,
and FSDP2's FP8 weight all-gather (fp8_allgather.py: enable_fp8_all_gather).

end_process_group: FSDP2 models, device meshes and DTensors keep the process
group alive through reference cycles.  Left to the interpreter's exit, gloo's
threads were destroyed in std::terminate (SIGABRT, intermittent in 2-process
FSDP2 runs: about 1 in 6 of the AdamW test before this existed).  So the
cycles are collected first, every rank waits at a barrier until all are past
their last collective, and only then is the group destroyed.
"""
import gc

import torch.distributed as dist

from .fp8_allgather import (FP8ShardWeight, GatheredFP8Weight, enable_fp8_all_gather,  # noqa: E402
                            fp8_all_gather_params, gathered_bytes)

__all__ = ["end_process_group", "enable_fp8_all_gather", "fp8_all_gather_params", "gathered_bytes",
           "FP8ShardWeight", "GatheredFP8Weight"]


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
