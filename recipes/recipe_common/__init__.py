"""What the training recipes share (recipes/esm2, recipes/llama3,
recipes/mixtral): the training loop and its pieces (trainer.py), checkpoints
with their CRC-32 manifest (checkpoint.py), FSDP2 wrapping (fsdp.py), the
Hugging Face export (export.py), the metric logger and MFU peaks
(metrics.py), and the config machinery: Hydra composition, schema checks,
the shared groups (config.py).  A recipe folder holds only what is specific
to its model: its schema, model building, data, FLOPs, its export's classes
and tokenizer.

The recipes' scripts put recipes/ on sys.path and import ``recipe_common``."""
