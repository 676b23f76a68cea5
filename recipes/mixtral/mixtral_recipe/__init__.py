"""The Mixtral training recipe on DNA (recipes/mixtral/train_fsdp2.py): its
config schema (config.py) and what is specific to a mixture-of-experts
causal LM in the training loop (trainer.py: model, auxiliary loss, FLOPs,
Hugging Face export).  The loop, checkpoints, FSDP2 wrapping, metric
logging and config machinery are the recipes' shared ones
(recipes/recipe_common); the data, tokenizer and loaders are the Llama 3
recipe's (recipes/llama3/llama3_recipe).  Both folders are put on sys.path
here."""
import os
import sys

_RECIPES = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
for _p in (_RECIPES, os.path.join(_RECIPES, "llama3")):  # recipe_common, llama3_recipe
    if _p not in sys.path:
        sys.path.insert(0, _p)

from .config import Cfg, load_config, main_entry  # noqa: E402
from .trainer import train  # noqa: E402

__all__ = ["Cfg", "load_config", "main_entry", "train"]
