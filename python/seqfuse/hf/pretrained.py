"""What every seqfuse model family in transformers' PreTrainedModel form
shares: ``SeqfusePreTrainedModel`` (strict ``from_pretrained``, activation
checkpointing through transformers' names), ``init_by_name`` (the usual
N(0, std) / zeros / ones initialisation, by parameter name so that it covers
seqfuse's fused modules), ``default_device`` and ``TiedCausalLM`` (the
decoder families' causal LM: base model and output layer tied to the input
embedding).

The Llama (llama.py), Mixtral (mixtral.py) and ESM-2 (esm.py) families
derive from it.
"""
import json
import os

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init

from .state_dict import save_pretrained_checked


def register_auto(key, *pairs):
    """Register each (transformers Auto class, class) pair under ``key``, so
    AutoConfig / AutoModel / AutoModelForCausalLM / ... load a family's saved
    directory: ``key`` is the config class for the model Auto classes, the
    ``model_type`` string for AutoConfig (transformers' ``register(key, cls)``
    takes both).  A pair already registered (the module reloaded) is kept."""
    for auto, cls in pairs:
        try:
            auto.register(key, cls)
        except ValueError:
            pass  # already registered (module reloaded)


def default_device():
    """The default device, which is "meta" while transformers builds a model
    to load into; seqfuse's modules would otherwise pick one themselves."""
    return torch.get_default_device()


@torch.no_grad()
def init_by_name(module, std):
    """Matrices and embeddings N(0, std), biases 0, 1-D weights (norms) 1, for
    ``module``'s own parameters; an embedding's padding row 0.
    transformers.initialization's functions skip tensors already loaded from
    a checkpoint (and work on meta tensors)."""
    for name, p in module.named_parameters(recurse=False):
        if name.endswith("bias"):
            init.zeros_(p)
        elif p.dim() == 1:
            init.ones_(p)  # norm weights (layer_norm_weight, RMSNorm.weight)
        else:
            init.normal_(p, mean=0.0, std=std)
    if isinstance(module, nn.Embedding) and module.padding_idx is not None:
        if not getattr(module.weight, "_is_hf_initialized", False) and not module.weight.is_meta:
            module.weight[module.padding_idx].zero_()


class TiedCausalLM:
    """The causal-LM model the decoder families (Llama, Mixtral) share: the
    family's base model ``model`` (its class: the subclass's
    ``base_model_class``) and the output layer, a plain nn.Linear
    ``lm_head`` (hidden_size -> vocab_size, no bias) whose weight is tied to
    the base model's ``model.embed_tokens.weight``.  Listed before the
    family's PreTrainedModel in the bases, so that its ``_tied_weights_keys``
    wins over PreTrainedModel's empty default."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config):
        super().__init__(config)
        self.model = self.base_model_class(config)
        # Plain torch: tying needs nn.Linear's weight, and a small vocabulary is not FP8-aligned.
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, device=default_device())
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings


def _check_model_type(cls, path, config, where, subfolder=None):
    """Refuse a local checkpoint directory whose config.json names another
    model_type than ``cls``'s config class (transformers only warns, then
    fails later with an error that names neither), or whose config.json
    cannot be read as the JSON object save_pretrained writes: OSError naming
    the file where it cannot be read, ValueError naming it and the rule
    where it is not JSON (transformers' OSError says so, naming the file) or
    not a JSON object (a list, a string: transformers' TypeError named
    neither the file nor the rule), or that names no model_type (transformers
    would build the config class's default model from it).  A missing
    config.json is left to transformers (its error names what is missing).
    ``subfolder``: from_pretrained's, where the checkpoint's config.json is."""
    want = getattr(getattr(cls, "config_class", None), "model_type", None)
    if config is not None or not want or not isinstance(path, (str, os.PathLike)):
        return
    file = os.path.join(os.fspath(path), subfolder or "", "config.json")
    if not os.path.isfile(file):
        return  # (transformers' own error for a missing config)
    try:
        with open(file, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"{where}: the checkpoint's config file {file} is not UTF-8 text ({e}); it must hold "
                         "the JSON object save_pretrained writes") from None
    except OSError as e:
        raise OSError(e.errno, f"{where}: the checkpoint's config file {file} cannot be read: "
                               f"{e.strerror or e}") from e
    try:
        saved = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{where}: the checkpoint's config file {file} is not valid JSON ({e}); it must hold "
                         "the JSON object save_pretrained writes") from None
    if not isinstance(saved, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(saved), "a number")
        raise ValueError(f"{where}: the checkpoint's config file {file} holds {kind}, not the JSON object "
                         "save_pretrained writes")
    got = saved.get("model_type")
    if got is None:
        # (transformers fills every missing field with the config class's defaults: an empty config
        # builds a 32-layer, 4,096-wide Llama, whose allocation alone can take the process down)
        raise ValueError(f"{where}: the checkpoint's config file {file} has no model_type; {cls.__name__} loads "
                         f"{want!r} checkpoints, whose config.json save_pretrained writes with "
                         f"\"model_type\": \"{want}\" and every field of the model's shape")
    if got != want:
        raise ValueError(f"{where}: the checkpoint's config.json has model_type {got!r}, but {cls.__name__} "
                         f"loads {want!r} checkpoints")


class SeqfusePreTrainedModel(PreTrainedModel):
    """Base of seqfuse's model families.  A subclass's base model (the one
    under ``base_model_prefix``) has a ``layers``-running forward that reads
    its ``activation_checkpointing`` flag.  ``_headless_ignores`` names the
    key prefixes a headless class may find in a checkpoint of the full model
    (e.g. "lm_head.")."""

    supports_gradient_checkpointing = False  # transformers' own mechanism is not used: see below
    _headless_ignores = ()

    # Activation checkpointing: seqfuse's FP8-aware checkpoint around each
    # TransformerLayer while training.  transformers' enable/disable names
    # (the Trainer's gradient_checkpointing=True calls them) lead here:
    # gradient_checkpointing_enable/disable are overridden, and transformers'
    # own activation_checkpointing_enable/disable hand an overridden
    # gradient_checkpointing_enable/disable the call.
    def set_activation_checkpointing(self, enabled=True):
        """Recompute each TransformerLayer's activations in the backward
        (seqfuse.pytorch.checkpoint: the forward's FP8 settings and scales)
        while training: less activation memory for one more layer forward."""
        self.base_model.activation_checkpointing = bool(enabled)
        return self

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None, every_n_layers=1, offload=False):
        """transformers' entry: every layer, non-reentrant, activations kept on the device."""
        if (gradient_checkpointing_kwargs or {}).get("use_reentrant"):
            raise NotImplementedError("gradient_checkpointing_kwargs: use_reentrant=True is not supported; "
                                      "seqfuse's checkpoint is non-reentrant")
        if every_n_layers != 1 or offload:
            raise NotImplementedError(f"gradient_checkpointing_enable: every_n_layers={every_n_layers!r} and "
                                      f"offload={offload!r} are not supported (every layer, on the device)")
        self.set_activation_checkpointing(True)

    def gradient_checkpointing_disable(self):
        self.set_activation_checkpointing(False)

    @property
    def is_activation_checkpointing(self):
        return bool(getattr(self.base_model, "activation_checkpointing", False))

    @property
    def is_gradient_checkpointing(self):
        return self.is_activation_checkpointing

    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' save_pretrained, made loud where it is silent
        (seqfuse.hf.state_dict.save_pretrained_checked): a path that is a file
        raises, and a sharded save removes an earlier single-file save that
        transformers' loader would read instead, naming it in a log line."""
        save = lambda path, **kw: super(SeqfusePreTrainedModel, self).save_pretrained(path, *args, **kw)  # noqa: E731
        return save_pretrained_checked(self, save_directory, f"{type(self).__name__}.save_pretrained", save=save,
                                       **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """transformers' from_pretrained, made strict: a checkpoint of another
        model type (config.json's model_type) raises ValueError naming both, a
        config.json that is not a readable JSON object raises (ValueError, or
        OSError where it cannot be read) naming the file, and
        one with missing or unexpected weights raises (KeyError / ValueError
        naming the keys) instead of leaving randomly initialised weights behind
        (an output layer may be absent only where the config ties it to the
        input embedding)."""
        where = f"{cls.__name__}.from_pretrained({pretrained_model_name_or_path!r})"
        _check_model_type(cls, pretrained_model_name_or_path, kwargs.get("config"), where, kwargs.get("subfolder"))
        want_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(pretrained_model_name_or_path, *args, output_loading_info=True,
                                              **kwargs)
        tied = set(getattr(cls, "_tied_weights_keys", None) or {})
        if not getattr(model.config, "tie_word_embeddings", False):
            tied = set()  # an untied output layer is a weight of its own: its absence is a missing weight
        missing = sorted(k for k in info.get("missing_keys", ()) if k not in tied)
        if missing:
            raise KeyError(f"{where}: the checkpoint is missing weight(s) {missing[:8]}"
                           + (" ..." if len(missing) > 8 else ""))
        unexpected = sorted(k for k in info.get("unexpected_keys", ()) if not k.startswith(cls._headless_ignores))
        if unexpected:
            raise ValueError(f"{where}: the checkpoint has unexpected weight(s) {unexpected[:8]}"
                             + (" ..." if len(unexpected) > 8 else ""))
        mismatched = info.get("mismatched_keys", ())
        if mismatched:
            raise ValueError(f"{where}: weight shapes differ from the config: {list(mismatched)[:8]}")
        return (model, info) if want_info else model
