"""The model-family-independent half of weight conversion: checking a state
dict's keys (missing: KeyError, unexpected: ValueError, each naming the
keys), dropping module bookkeeping that is not a weight, and building the
other side's model around a converted state dict.

Each family's conversion (convert.py for ESM-2, llama_convert.py for Llama)
defines its key mapping and calls these.  Only tensors are moved, never
recomputed, so a round trip through a family's mapping is bit-identical.
"""
import torch

#: The suffix of module bookkeeping entries (e.g. FP8 scaling state) in a state dict.
EXTRA_STATE = "._extra_state"


def _first(keys, n=8):
    more = f" (and {len(keys) - n} more)" if len(keys) > n else ""
    return f"{keys[:n]}{more}"


def check_keys(sd, expected, side, optional=()):
    """KeyError naming the keys of ``expected`` that ``sd`` lacks; ValueError
    naming the keys of ``sd`` in neither ``expected`` nor ``optional``.
    ``side`` names the state dict in the message ("transformers", "seqfuse")."""
    present = set(sd)
    missing = [k for k in expected if k not in present]
    if missing:
        raise KeyError(f"{side} state dict is missing key(s) {_first(missing)}")
    allowed = set(expected) | set(optional)
    unexpected = sorted(k for k in present if k not in allowed)
    if unexpected:
        raise ValueError(f"{side} state dict has unexpected key(s) {_first(unexpected)}")


def check_shapes(sd, want, side):
    """ValueError naming the first key of ``want`` ({key: shape}) whose tensor in ``sd`` has another shape."""
    for k, shape in want.items():
        if tuple(sd[k].shape) != tuple(shape):
            raise ValueError(f"{side} state dict key {k!r} has shape {tuple(sd[k].shape)}, "
                             f"the config needs {tuple(shape)}")


def strip_extra_state(sd):
    """Module bookkeeping (e.g. FP8 scaling state) is not a weight: not converted."""
    return {k: v for k, v in sd.items() if not k.endswith(EXTRA_STATE)}


def build_and_load(cls, config, sd, like):
    """``cls(config)`` on ``like``'s device without random init, holding
    copies of the tensors of ``sd`` (dtype and values exactly as given), in
    ``like``'s training mode.  When config.tie_word_embeddings, the keys of
    ``cls._tied_weights_keys`` absent from ``sd`` are filled from their
    sources, and the model's weights are tied."""
    from transformers.initialization import no_init_weights

    device = next(like.parameters()).device
    with torch.device(device), no_init_weights():
        model = cls(config)
    own = model.state_dict()
    full = {k: v.detach().clone() for k, v in sd.items()}
    for k, v in own.items():
        if k.endswith(EXTRA_STATE):
            full[k] = v
    if config.tie_word_embeddings:
        for target, source in (getattr(cls, "_tied_weights_keys", None) or {}).items():
            if target in own and target not in full:
                full[target] = full[source]
    model.load_state_dict(full, strict=True, assign=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.train(like.training)


def load_hf_checkpoint(hf_cls, path, dtype=None, optional=(), ignore_unexpected=None):
    """transformers' ``hf_cls.from_pretrained`` of the local directory
    ``path`` in eval mode, made strict: a weight missing from the checkpoint
    (other than those in ``optional``) raises KeyError naming it instead of
    being initialised at random; weight shapes that differ from the config
    raise ValueError.  With ``ignore_unexpected`` (a predicate on key names),
    checkpoint weights the model does not use raise ValueError too, except
    those the predicate accepts; without it they are left to transformers."""
    kw = {} if dtype is None else {"dtype": dtype}
    hf, info = hf_cls.from_pretrained(path, output_loading_info=True, local_files_only=True, **kw)
    where = f"from_hf_pretrained({path!r})"
    missing = sorted(k for k in info.get("missing_keys", ()) if k not in optional)
    if missing:
        raise KeyError(f"{where}: the checkpoint is missing weight(s) {_first(missing)}")
    if ignore_unexpected is not None:
        unexpected = sorted(k for k in info.get("unexpected_keys", ()) if not ignore_unexpected(k))
        if unexpected:
            raise ValueError(f"{where}: the checkpoint has unexpected weight(s) {_first(unexpected)}")
    mismatched = info.get("mismatched_keys", ())
    if mismatched:
        raise ValueError(f"{where}: weight shapes differ from the config: {list(mismatched)[:8]}")
    return hf.eval()
