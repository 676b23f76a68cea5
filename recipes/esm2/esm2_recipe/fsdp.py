"""FSDP2 wrapping of the ESM-2 model: the shared shard_model
(recipes/recipe_common/fsdp.py, where the knobs are explained) over ESM-2's
encoder layers; used by the recipe and benchmarks/esm2/bench_esm2.py."""
from recipe_common.fsdp import REDUCE_DTYPES  # noqa: F401
from recipe_common.fsdp import shard_model as _shard_layers


def shard_model(model, *, reshard_after_forward=True, reduce_dtype="float32", prefetch=0, layers_per_unit=1,
                mesh=None):
    """fully_shard the encoder layers (``layers_per_unit`` at a time) and the
    root of a SeqfuseEsmForMaskedLM in place; returns the model."""
    return _shard_layers(model, lambda: model.esm.encoder.layers, reshard_after_forward=reshard_after_forward,
                         reduce_dtype=reduce_dtype, prefetch=prefetch, layers_per_unit=layers_per_unit, mesh=mesh)
