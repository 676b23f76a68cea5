"""Train ESM-2 (masked LM) on real UniProt proteins with FSDP2.

One process:            python recipes/esm2/train_fsdp2.py --config L0_sanity
Several (one per GPU):  torchrun --nproc_per_node 2 recipes/esm2/train_fsdp2.py --config 650M
Overrides:              ... train.steps=500 precision.recipe=fp8_delayed data.packed=false

Every TransformerLayer and then the whole model go through
torch.distributed.fsdp.fully_shard (parameters, gradients and optimizer
state sharded across ranks).  Configs are composed by Hydra's compose API
(``--config NAME`` or ``--config-name NAME``) and checked against the
schema in esm2_recipe/config.py before anything is built.  The loop is
recipes/esm2/esm2_recipe/trainer.py.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from esm2_recipe import main_entry, train  # noqa: E402

if __name__ == "__main__":
    main_entry(train, "fsdp2")
