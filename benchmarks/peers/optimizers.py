"""The optimizers the training benchmarks step, one definition each.

``torch_adamw``: torch's AdamW as a transformers user builds it (fused on
the GPU); over bf16 parameters it keeps bf16 moments and no fp32 master.
``fused_adamw_like_torch``: seqfuse's FusedAdamW set to that same update
and state (bf16 parameters updated in place, bf16 moments, no master): a
seqfuse row stepping it differs from one stepping torch's AdamW only in the
optimizer's kernel, so the two rows side by side say what that kernel is
worth, and a result records which one a row stepped.
"""
import torch


def torch_adamw(params, device, **hyper):
    """torch.optim.AdamW over ``params`` (fused on a CUDA ``device``)."""
    return torch.optim.AdamW(params, fused=torch.device(device).type == "cuda", **hyper)


def fused_adamw_like_torch(params, **hyper):
    """seqfuse.optim.FusedAdamW doing torch_adamw's update on the same state."""
    from seqfuse.optim import FusedAdamW

    return FusedAdamW(params, master_weights=False, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16,
                      **hyper)


#: What a result's JSON records of each.
DESCRIPTIONS = {
    "torch_adamw": "torch.optim.AdamW (fused on the GPU): bf16 moments, no master",
    "fused_adamw": "seqfuse FusedAdamW(master_weights=False, bf16 moments): torch AdamW's update and state",
}
