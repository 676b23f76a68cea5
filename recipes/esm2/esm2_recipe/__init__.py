"""The ESM-2 training recipe (recipes/esm2/train_*.py): its config schema
(config.py), what is specific to ESM-2 in the training loop (trainer.py),
its Hugging Face export (export.py), FLOPs (metrics.py) and the encoder
layers run as CUDA graphs (graphs.py, train.cuda_graphs).  The loop,
checkpoints, FSDP2 wrapping, metric logging and config machinery are shared
with the other recipes (recipes/recipe_common, put on sys.path here)."""
import os
import sys

_RECIPES = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _RECIPES not in sys.path:
    sys.path.insert(0, _RECIPES)

from .config import Cfg, load_config, main_entry  # noqa: E402
from .trainer import train  # noqa: E402

__all__ = ["Cfg", "load_config", "main_entry", "train"]
