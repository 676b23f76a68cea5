"""Shared code of the ESM-2 training recipe (recipes/esm2/train_*.py):
config composition (Hydra's compose API) and schema checks (config.py), the training loop
(trainer.py), checkpoints and Hugging Face export (checkpoint.py), FLOPs,
MFU and logging (metrics.py)."""
from .config import Cfg, load_config, main_entry
from .trainer import train

__all__ = ["Cfg", "load_config", "main_entry", "train"]
