"""Train a Mixtral-style mixture-of-experts causal LM on real DNA with FSDP2.

One process:            python recipes/mixtral/train_fsdp2.py --config L0_sanity
Several (one per GPU):  torchrun --nproc_per_node 8 recipes/mixtral/train_fsdp2.py --config 8x1B
Overrides:              ... train.steps=500 precision.recipe=fp8_block model.router_aux_loss_coef=0.01

Every decoder layer and then the whole model go through
torch.distributed.fsdp.fully_shard (parameters, gradients and optimizer
state sharded across ranks; each rank holds a shard of every expert).
With distributed.expert_parallel_size=EP > 1 each rank holds 1/EP of every
layer's experts instead, tokens travel to their experts' ranks and back,
and FSDP2 shards the experts over the data-parallel ranks
(mixtral_recipe/trainer.py):
    torchrun --nproc_per_node 8 recipes/mixtral/train_fsdp2.py --config 8x1B distributed.expert_parallel_size=8
Configs are composed by Hydra's compose API (``--config NAME`` or
``--config-name NAME``) and checked against the schema in
mixtral_recipe/config.py before anything is built.  The loop is
recipes/recipe_common/trainer.py, with recipes/mixtral/mixtral_recipe/trainer.py
for what is Mixtral's; the data are the Llama 3 recipe's (recipes/llama3/DATA.md).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mixtral_recipe import main_entry, train  # noqa: E402

if __name__ == "__main__":
    main_entry(train, "fsdp2")
