"""Train ESM-2 (masked LM) on real UniProt proteins with DistributedDataParallel.

One process:            python recipes/esm2/train_ddp.py --config L0_sanity
Several (one per GPU):  torchrun --nproc_per_node 2 recipes/esm2/train_ddp.py --config 150M
Overrides:              ... train.steps=500 precision.recipe=fp8_block train.grad_accum=4

Every rank holds the whole model and optimizer; gradients are all-reduced
(only on the last micro-batch of an accumulation).  For models that do not
fit one GPU use train_fsdp2.py.  Same configs and loop
(recipes/esm2/esm2_recipe/trainer.py).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from esm2_recipe import main_entry, train  # noqa: E402

if __name__ == "__main__":
    main_entry(train, "ddp")
