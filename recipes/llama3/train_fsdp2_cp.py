"""Train a Llama 3 causal LM on real DNA with FSDP2 and context parallelism.

    torchrun --nproc_per_node=4 recipes/llama3/train_fsdp2_cp.py --config-name L0_sanity_cp cp_size=2
    torchrun --nproc_per_node=2 recipes/llama3/train_fsdp2_cp.py --config-name L0_sanity_cp cp_size=2 cp_comm_type=all_gather

The processes form a ("dp", "cp") DeviceMesh of world/cp_size x cp_size
ranks: each sequence is spread over cp_size ranks (attention under context
parallelism, p2p ring or all_gather of K/V), each dp rank reads its own
batches, and FSDP2 shards the model over all ranks.  Batches are cut for the
CP rank before the model.  Checkpoints resume with the same world size and
cp_size; the Hugging Face export gathers the full model.  The configs, keys
and loop are train_fsdp2.py's (recipes/llama3/llama3_recipe/context_parallel.py
says what CP changes).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from llama3_recipe import main_entry  # noqa: E402
from llama3_recipe.context_parallel import train  # noqa: E402

if __name__ == "__main__":
    main_entry(train, "fsdp2")
