"""Train a Llama 3 causal LM on real DNA with DistributedDataParallel.

One process:            python recipes/llama3/train_ddp.py --config L0_sanity
Several (one per GPU):  torchrun --nproc_per_node 2 recipes/llama3/train_ddp.py --config 1B
Overrides:              ... train.steps=500 precision.recipe=fp8_block train.grad_accum=4

Every rank holds the whole model and optimizer; gradients are all-reduced
(only on the last micro-batch of an accumulation).  For models that do not
fit one GPU (8B) use train_fsdp2.py.  Same configs and loop as
train_fsdp2.py.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from llama3_recipe import main_entry, train  # noqa: E402

if __name__ == "__main__":
    main_entry(train, "ddp")
