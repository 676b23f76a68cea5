"""The model-family-independent half of weight conversion: checking a state
dict's keys (missing: KeyError, unexpected: ValueError, each naming the
keys), dropping module bookkeeping that is not a weight, building the
other side's model around a converted state dict, and (``ModelFamily``)
the model-level conversions every family offers: from_hf_model,
to_hf_model, export_hf and from_hf_pretrained (``family_functions`` gives a
family module these four as module-level functions).

Each family's conversion (convert.py for ESM-2, llama_convert.py for Llama,
mixtral_convert.py for Mixtral) defines its key mapping as two state-dict
functions and names its classes in a ``ModelFamily``; the model-level
steps, the same for every family, live here once.  Only tensors are moved,
never recomputed, so a round trip through a family's mapping is
bit-identical.
"""
import logging
import os
from dataclasses import dataclass
from typing import Callable, Optional

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


def check_tied(sd, head, embedding, config, side):
    """Where ``config.tie_word_embeddings`` ties the output layer ``head`` to
    the input ``embedding`` and ``sd`` holds both, they must be one tensor
    (or equal): ValueError otherwise, instead of a conversion that keeps the
    embedding and drops an output layer replaced after the model was built."""
    if not config.tie_word_embeddings or head not in sd or embedding not in sd:
        return
    h, e = sd[head], sd[embedding]
    same = h.shape == e.shape and (h.data_ptr() == e.data_ptr() or torch.equal(h, e.to(h.device, h.dtype)))
    if not same:
        raise ValueError(f"{side} state dict: config.tie_word_embeddings=True ties {head!r} to {embedding!r}, "
                         "but the two tensors differ (the output layer was replaced or untied after the model "
                         "was built); set tie_word_embeddings=False in the config to convert both, or tie them")


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


_log = logging.getLogger("seqfuse")

#: transformers' single-file weights, which its loader reads before a sharded checkpoint's index
_SINGLE_FILE = "model.safetensors"
_INDEX = "model.safetensors.index.json"


def _stamp(file):
    """(size, mtime_ns, inode) of ``file``, or None where there is none: what
    tells whether a save wrote it."""
    try:
        st = os.stat(file)
    except FileNotFoundError:
        return None
    return st.st_size, st.st_mtime_ns, st.st_ino


def _saves_on_this_process(model, is_main_process):
    """Whether transformers' save_pretrained writes the checkpoint files on
    this process: ``is_main_process``, and rank 0 where torch.distributed is
    initialised (transformers' ``should_save_on_this_rank``, used where the
    model has it; the same rule otherwise)."""
    should = getattr(model, "should_save_on_this_rank", None)
    if callable(should):
        return bool(should(is_main_process))
    import torch.distributed as dist

    initialised = dist.is_available() and dist.is_initialized()
    return bool(is_main_process) and (not initialised or dist.get_rank() == 0)


def save_pretrained_checked(model, path, where, save=None, **save_kwargs):
    """``model.save_pretrained(path, **save_kwargs)`` (or ``save(path, ...)``)
    with what transformers leaves silent made loud: a ``path`` that is a
    file raises NotADirectoryError (transformers logs an error and writes
    nothing), and the weights an earlier save left beside the new ones are
    removed, each named in a log line: after a sharded save, an earlier
    single-file ``model.safetensors`` (transformers' loader would read it
    ahead of the new shards); after a single-file save, an earlier sharded
    save's index (whose shards transformers removed).  Only files this save
    did not write are removed, and only on the process that saves
    (``is_main_process`` true and, under torch.distributed, rank 0, as
    transformers decides who writes): every other process calls the save
    (which may take part in collectives) and removes nothing, so ranks
    saving together do not race to remove a file rank 0's save made stale."""
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise NotADirectoryError(f"{where}: {path!r} is a file; a checkpoint is written into a directory")
    index = os.path.join(path, _INDEX)
    single = os.path.join(path, _SINGLE_FILE)
    before = {f: _stamp(f) for f in (index, single)}
    (save or model.save_pretrained)(path, **save_kwargs)
    if not _saves_on_this_process(model, save_kwargs.get("is_main_process", True)):
        return
    after = {f: _stamp(f) for f in (index, single)}
    written = {f for f in after if after[f] is not None and after[f] != before[f]}
    if index in written and after[single] is not None and single not in written:
        stale, why = single, "an earlier single-file save that the new sharded checkpoint replaces"
    elif single in written and after[index] is not None and index not in written:
        stale, why = index, "an earlier sharded save's index, whose shards the new single-file save replaced"
    else:
        return
    os.remove(stale)
    _log.warning("%s: removed %s, %s (transformers' loader would have read it instead of the new weights)",
                 where, stale, why)


@dataclass(frozen=True)
class ModelFamily:
    """One model family's two sides and the functions between them; its
    methods are the model-level conversions, the same for every family.

    hf_model / hf_config: transformers' model and config classes (e.g.
    LlamaForCausalLM, LlamaConfig); seqfuse_model: seqfuse's model class.
    config_from_hf / config_to_hf: the config converters (from_hf_config
    refuses what seqfuse cannot compute exactly).  to_seqfuse / to_hf: the
    state-dict mappings, each called as f(state_dict, seqfuse_config).
    checkpoint_optional(config): the keys a transformers checkpoint may
    lack (a tied LM head).  ignore_unexpected: see load_hf_checkpoint.

    A family module builds its ModelFamily in a function, on first use,
    because the classes live in modules that import transformers' model
    code and the family's model module (which must not import the
    conversion module back)."""

    hf_model: type
    hf_config: type
    seqfuse_model: type
    config_from_hf: Callable
    config_to_hf: Callable
    to_seqfuse: Callable
    to_hf: Callable
    checkpoint_optional: Callable = lambda config: ()
    ignore_unexpected: Optional[Callable] = None

    def from_hf_model(self, hf_model):
        """The seqfuse model holding copies of the weights of ``hf_model``
        (an instance of hf_model), each tensor in its dtype, on the same
        device; its config converted with config_from_hf."""
        if not isinstance(hf_model, self.hf_model):
            raise TypeError(f"from_hf_model: expected transformers.{self.hf_model.__name__}, "
                            f"got {type(hf_model).__name__}")
        config = self.config_from_hf(hf_model.config)
        sd = self.to_seqfuse(hf_model.state_dict(), config)
        return build_and_load(self.seqfuse_model, config, sd, hf_model)

    def to_hf_model(self, model):
        """transformers' model holding copies of the weights of ``model`` (an
        instance of seqfuse_model); FP8 bookkeeping is not a weight and is dropped."""
        if not isinstance(model, self.seqfuse_model):
            raise TypeError(f"to_hf_model: expected {self.seqfuse_model.__name__}, got {type(model).__name__}")
        sd = self.to_hf(strip_extra_state(model.state_dict()), model.config)
        return build_and_load(self.hf_model, self.config_to_hf(model.config), sd, model)

    def export_hf(self, model, path, **save_kwargs):
        """to_hf_model(model).save_pretrained(path, **save_kwargs) through
        :func:`save_pretrained_checked`: a checkpoint transformers loads with
        no seqfuse installed.  Returns ``path``."""
        save_pretrained_checked(self.to_hf_model(model), path, type(model).__name__ + ".export_hf", **save_kwargs)
        return path

    def from_hf_pretrained(self, path, dtype=None, device=None):
        """The seqfuse model from a local transformers checkpoint directory,
        the config checked (config_from_hf) before any weight is read, a
        missing weight a KeyError naming it (see load_hf_checkpoint)."""
        if not os.path.isdir(path):
            raise FileNotFoundError(f"from_hf_pretrained: {path!r} is not a local directory")
        config = self.config_from_hf(self.hf_config.from_pretrained(path))  # refuses unrepresentable configs
        hf = load_hf_checkpoint(self.hf_model, path, dtype, optional=self.checkpoint_optional(config),
                                ignore_unexpected=self.ignore_unexpected)
        model = self.from_hf_model(hf)
        return model if device is None else model.to(device)


def family_functions(family, seqfuse_model, hf_model):
    """A family module's four model-level functions, from_hf_model,
    to_hf_model, export_hf and from_hf_pretrained, in that order: each calls
    the ModelFamily method of its name on ``family()``, the function that
    builds the module's ModelFamily on first use (importing the module
    imports no model code).  ``seqfuse_model`` and ``hf_model`` name the two
    classes in the functions' docstrings."""
    names = {"sf": seqfuse_model, "hf": hf_model}

    def from_hf_model(hf_model):
        return family().from_hf_model(hf_model)

    def to_hf_model(model):
        return family().to_hf_model(model)

    def export_hf(model, path, **save_kwargs):
        return family().export_hf(model, path, **save_kwargs)

    def from_hf_pretrained(path, dtype=None, device=None):
        return family().from_hf_pretrained(path, dtype, device)

    from_hf_model.__doc__ = """{sf} holding copies of the weights of transformers'
    {hf}, each tensor in its dtype, on the same device.  The config must be
    representable (the family's from_hf_config refuses what seqfuse cannot
    compute exactly).""".format(**names)
    to_hf_model.__doc__ = """transformers' {hf} holding copies of the weights of a
    {sf}; FP8 bookkeeping is not a weight and is dropped.""".format(**names)
    export_hf.__doc__ = """Write ``model`` (a {sf}) to directory ``path`` as a
    transformers {hf} checkpoint (config.json with transformers' own
    model_type, safetensors weights in the model's dtype), which
    ``transformers.{hf}.from_pretrained`` loads with no seqfuse installed.
    ``save_kwargs`` go to transformers' save_pretrained.  Returns ``path``.""".format(**names)
    from_hf_pretrained.__doc__ = """{sf} from a local transformers {hf}
    checkpoint directory.  transformers reads the files (it knows the
    on-disk namings its versions wrote); unlike transformers, a weight
    missing from the checkpoint raises KeyError naming it instead of being
    initialised at random, and the config is checked (from_hf_config)
    before any weight is read.  ``dtype``: the dtype to load in (None: the
    checkpoint's); ``device``: where to move the model (None: left where
    transformers loaded it).""".format(**names)
    functions = (from_hf_model, to_hf_model, export_hf, from_hf_pretrained)
    for f in functions:  # help() and tracebacks name the family module
        f.__module__, f.__qualname__ = family.__module__, f.__name__
    return functions
