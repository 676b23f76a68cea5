"""The Llama 3 training recipe on DNA (recipes/llama3/train_*.py): its config
schema and layer-wise precision rule (config.py) and what is specific to
Llama in the training loop (trainer.py: model, precision per layer, data,
FLOPs, Hugging Face export).  The loop, checkpoints, FSDP2 wrapping, metric
logging and config machinery are shared with the ESM-2 recipe
(recipes/recipe_common, put on sys.path here)."""
import os
import sys

_RECIPES = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _RECIPES not in sys.path:
    sys.path.insert(0, _RECIPES)

from .config import Cfg, load_config, main_entry  # noqa: E402
from .trainer import train  # noqa: E402

__all__ = ["Cfg", "load_config", "main_entry", "train"]
