"""FSDP2 wrapping of a recipe's model (ESM-2, Llama 3), shared by the
recipes' trainer and the benchmarks (benchmarks/esm2/bench_esm2.py reaches it
through esm2_recipe.fsdp) so all measure the same thing.

fully_shard on every TransformerLayer (the ``layers`` given), then on the
whole model (embeddings, final norm and the LM head form the root unit).  The knobs that decide
how much of the communication hides behind compute:
  * ``reshard_after_forward``: True frees each layer's gathered weights after
    its forward (ZeRO-3: all-gathered again for the backward); False keeps
    them until the backward (one all-gather per layer per step instead of
    two; + one layer's full weights of memory per layer).
  * ``reduce_dtype``: dtype of the gradient reduce-scatter.  float32 doubles
    the bytes moved and adds a cast of every gradient in and out; with bf16
    parameters the reduced gradient is cast back to bf16 anyway, so bf16
    only changes the rounding of one sum per element.
  * ``prefetch``: 0 leaves FSDP2's defaults (forward all-gathers issued when
    the host reaches each layer, which only overlaps if the host runs ahead
    of the GPU; backward prefetches one layer).  N > 0 asks explicitly for
    the next N layers' all-gathers at each layer's forward and backward, so
    they are queued on the all-gather stream before the compute that should
    hide them, whatever the host's lead.
  * ``layers_per_unit``: k > 1 shards k consecutive layers as one FSDP unit
    (fully_shard of a list of modules): k times fewer all-gathers,
    reduce-scatters and hook/stream/event round trips per step, at the cost
    of k layers' full weights (and gradients) live at once.  Worth it when
    the per-unit host overhead, not the bandwidth, is what the GPU waits for.
"""
import torch

REDUCE_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def shard_model(model, layers, *, reshard_after_forward=True, reduce_dtype="float32", prefetch=0,
                layers_per_unit=1, mesh=None):
    """fully_shard ``layers`` (the model's TransformerLayers, in order, or a
    function returning them, called after the settings are checked;
    ``layers_per_unit`` at a time) and then the root ``model`` in place;
    returns the model.  See the module note."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if reduce_dtype not in REDUCE_DTYPES:
        raise ValueError(f"shard_model: reduce_dtype must be one of {sorted(REDUCE_DTYPES)}, got {reduce_dtype!r}")
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"shard_model: prefetch must be an int >= 0 (layers), got {prefetch!r}")
    if isinstance(layers_per_unit, bool) or not isinstance(layers_per_unit, int) or layers_per_unit < 1:
        raise ValueError(f"shard_model: layers_per_unit must be an int >= 1, got {layers_per_unit!r}")
    mp = MixedPrecisionPolicy(reduce_dtype=REDUCE_DTYPES[reduce_dtype])
    kw = dict(mp_policy=mp, reshard_after_forward=bool(reshard_after_forward))
    if mesh is not None:
        kw["mesh"] = mesh
    if callable(layers) and not isinstance(layers, (list, tuple, torch.nn.Module)):  # (a ModuleList is callable)
        layers = layers()
    layers = list(layers)
    k = layers_per_unit
    units = [layers[i:i + k] for i in range(0, len(layers), k)]
    for unit in units:
        fully_shard(unit[0] if len(unit) == 1 else unit, **kw)  # a list: one unit, one all-gather
    fully_shard(model, **kw)
    if prefetch:
        n = prefetch
        heads = [unit[0] for unit in units]  # a unit's modules share one FSDP state: its first names it
        for i, head in enumerate(heads):
            nxt = heads[i + 1:i + 1 + n]
            prev = heads[max(0, i - n):i][::-1]  # the backward runs the units in reverse
            if nxt:
                head.set_modules_to_forward_prefetch(nxt)
            if prev:
                head.set_modules_to_backward_prefetch(prev)
        # the root's forward starts with the embedding: queue the first units'
        # gathers there; its backward starts at the LM head: queue the last ones
        model.set_modules_to_forward_prefetch(heads[:n])
        model.set_modules_to_backward_prefetch(heads[::-1][:n])
    return model
