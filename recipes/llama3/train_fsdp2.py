"""Train a Llama 3 causal LM on real DNA with FSDP2.

One process:            python recipes/llama3/train_fsdp2.py --config L0_sanity
Several (one per GPU):  torchrun --nproc_per_node 8 recipes/llama3/train_fsdp2.py --config 8B
Overrides:              ... train.steps=500 precision.recipe=fp8_delayed precision.fp8_layers=[2,3,4,5,6,7,8,9,10,11,12,13,14,15]

Every TransformerLayer and then the whole model go through
torch.distributed.fsdp.fully_shard (parameters, gradients and optimizer
state sharded across ranks).  Configs are composed by Hydra's compose API
(``--config NAME`` or ``--config-name NAME``) and checked against the
schema in llama3_recipe/config.py before anything is built.  The loop is
recipes/recipe_common/trainer.py, with recipes/llama3/llama3_recipe/trainer.py
for what is Llama's.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from llama3_recipe import main_entry, train  # noqa: E402

if __name__ == "__main__":
    main_entry(train, "fsdp2")
