"""The configuration of seqfuse's Llama model family, its conversion from (and
to) transformers' ``LlamaConfig``, and Llama 3's rotary frequencies.

``SeqfuseLlamaConfig`` IS a ``LlamaConfig`` (a subclass: the same fields,
defaults, RoPE standardisation and validation, read by the same code) with
its own model_type ("seqfuse_llama", registered with AutoConfig when
``seqfuse.hf`` is imported) and two seqfuse fields, ``attn_input_format``
and ``mlp_recompute_activation``.
It refuses, naming the field, any value seqfuse's model cannot compute
exactly (another activation than SiLU, biases, RoPE types other than
"default" and "llama3", partial rotary), instead of building a different
model.  ``from_hf_config`` / ``to_hf_config_llama`` convert both ways.

``rope_inv_freq(config)`` computes the inverse frequencies of the rotary
embedding the way transformers does (``_compute_llama3_parameters`` for
rope_type "llama3": wavelengths longer than original_max_position_embeddings
/ low_freq_factor divided by ``factor``, shorter than .../high_freq_factor
kept, smoothly interpolated in between), to the bit; the tests compare it
with transformers' own.

``LLAMA3_SHAPES`` spells out the published Llama 3.x sizes, so recipes and
tests can build models of those shapes from random weights.
"""
import math

import torch
from transformers import AutoConfig, LlamaConfig, PreTrainedConfig

from .pretrained import register_auto

MODEL_TYPE = "seqfuse_llama"

#: Published Llama 3.x shapes: (hidden_size, num_hidden_layers,
#: num_attention_heads, num_key_value_heads, intermediate_size, rope factor,
#: tie_word_embeddings).  All use rope_theta 500000, llama3 scaling with
#: low/high_freq_factor 1/4 over 8192 original positions, RMSNorm eps 1e-5
#: and a 128256-token vocabulary.
LLAMA3_SHAPES = {
    "1B": (2048, 16, 32, 8, 8192, 32.0, True),     # Llama 3.2 1B
    "3B": (3072, 28, 24, 8, 8192, 32.0, True),     # Llama 3.2 3B
    "8B": (4096, 32, 32, 8, 14336, 8.0, False),    # Llama 3.1 8B
    "70B": (8192, 80, 64, 8, 28672, 8.0, False),   # Llama 3.1 70B
}

#: The RoPE types seqfuse's Llama computes.
ROPE_TYPES = ("default", "llama3")
#: The keys a "llama3" rope_parameters dict must hold.
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


class SeqfuseLlamaConfig(LlamaConfig):
    """A LlamaConfig for seqfuse's Llama (pre-RMSNorm, SwiGLU, RoPE with
    optional Llama 3 scaling, grouped-query causal attention, no biases).

    ``attn_input_format`` is the default layout of ``forward`` ("bshd" padded
    batches; packed "thd" batches are chosen per call by passing cu_seqlens
    or restarting position_ids).  ``mlp_recompute_activation`` sets every
    layer's LayerNormMLP ``recompute_activation`` (the SwiGLU output, under
    FP8 its transposed FP8 copy, made again in the backward instead of
    kept: the same bits, one [tokens, FFN] tensor less a layer)."""

    model_type = MODEL_TYPE

    attn_input_format: str = "bshd"
    mlp_recompute_activation: bool = False

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        self.validate_seqfuse()

    def validate_seqfuse(self):
        """Raise ValueError (a bad value) or NotImplementedError (a model
        seqfuse does not compute), naming the field."""
        name = type(self).__name__
        check_decoder_fields(self, name)
        for field in ("attention_bias", "mlp_bias"):
            if getattr(self, field):
                raise NotImplementedError(f"{name}: {field}=True cannot be represented: seqfuse's Llama has no "
                                          "biases (as Llama 3)")
        if not isinstance(self.mlp_recompute_activation, bool):
            raise ValueError(f"{name}: mlp_recompute_activation must be a bool, got "
                             f"{type(self.mlp_recompute_activation).__name__}")


def check_decoder_fields(config, name):
    """The checks every seqfuse decoder family's config shares (Llama,
    Mixtral): the input layout, grouped-query heads, an even head_dim, SiLU
    (SwiGLU) and the RoPE types seqfuse computes.  ValueError (a bad value)
    or NotImplementedError (a model seqfuse does not compute), naming the field."""
    if config.attn_input_format not in ("bshd", "thd"):
        raise ValueError(f"{name}: attn_input_format must be 'bshd' or 'thd', got {config.attn_input_format!r}")
    if config.num_attention_heads % config.num_key_value_heads:
        raise ValueError(f"{name}: num_attention_heads ({config.num_attention_heads}) must be a multiple of "
                         f"num_key_value_heads ({config.num_key_value_heads})")
    if config.head_dim % 2:
        raise ValueError(f"{name}: head_dim ({config.head_dim}) must be even for rotary embeddings")
    if config.hidden_act != "silu":
        raise NotImplementedError(f"{name}: hidden_act={config.hidden_act!r} cannot be represented: seqfuse's "
                                  "MLP is SwiGLU (silu)")
    rope = config.rope_parameters or {}
    if rope.get("rope_type", "default") not in ROPE_TYPES:
        raise NotImplementedError(f"{name}: rope_parameters rope_type={rope.get('rope_type')!r} cannot be "
                                  f"represented: seqfuse computes {ROPE_TYPES}")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise NotImplementedError(f"{name}: rope_parameters partial_rotary_factor="
                                  f"{rope['partial_rotary_factor']!r} cannot be represented (full rotary only)")
    if rope.get("rope_type") == "llama3":
        missing = [k for k in LLAMA3_ROPE_KEYS if rope.get(k) is None]
        if missing:
            raise ValueError(f"{name}: rope_parameters of rope_type 'llama3' need {missing}")
        if rope["high_freq_factor"] <= rope["low_freq_factor"]:
            raise ValueError(f"{name}: rope_parameters high_freq_factor ({rope['high_freq_factor']}) must "
                             f"exceed low_freq_factor ({rope['low_freq_factor']})")


def rope_inv_freq(config, device=None):
    """float32 [head_dim / 2]: the rotary inverse frequencies of ``config``
    (a LlamaConfig), computed with transformers' formula and operation order
    (its default and llama3 rope initialisers)."""
    rope = config.rope_parameters
    base, dim = rope["rope_theta"], config.head_dim
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float)
                               / dim))
    if rope.get("rope_type", "default") == "default":
        return inv_freq
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context_len = rope["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low
    high_freq_wavelen = old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths: divided by factor; short: kept; in between: interpolated
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def llama3_config(size="1B", **overrides):
    """A SeqfuseLlamaConfig of a published Llama 3.x shape ("1B", "3B", "8B",
    "70B"), fields overridable by keyword (``rope_parameters`` replaces the
    whole dict)."""
    if size not in LLAMA3_SHAPES:
        raise ValueError(f"llama3_config: size must be one of {sorted(LLAMA3_SHAPES)}, got {size!r}")
    h, n, a, g, f, factor, tie = LLAMA3_SHAPES[size]
    kw = dict(hidden_size=h, num_hidden_layers=n, num_attention_heads=a, num_key_value_heads=g,
              intermediate_size=f, tie_word_embeddings=tie, vocab_size=128256, rms_norm_eps=1e-5,
              max_position_embeddings=131072,
              rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=factor, low_freq_factor=1.0,
                                   high_freq_factor=4.0, original_max_position_embeddings=8192))
    if "vocab_size" not in overrides:  # Llama 3's tokenizer's <|begin_of_text|> and <|end_of_text|>
        kw.update(bos_token_id=128000, eos_token_id=128001)
    kw.update(overrides)
    return SeqfuseLlamaConfig(**kw)


#: Fields of SeqfuseLlamaConfig that LlamaConfig does not have.
SEQFUSE_FIELDS = ("attn_input_format", "mlp_recompute_activation")
#: LlamaConfig fields that do not change the model's numbers: field -> why.
_IGNORED = {
    "pretraining_tp": "transformers 5 does not read it (the weights are whole)",
    "use_cache": "a generation setting",
}


def _base_config_fields():
    return set(PreTrainedConfig().to_dict().keys())


def config_from_hf(hf_config, hf_cls, sf_cls, seqfuse_fields):
    """``sf_cls`` (a seqfuse subclass of ``hf_cls``) from transformers' config
    ``hf_config``: every field copied, a field unknown to ``hf_cls`` refused
    (NotImplementedError naming it), the seqfuse config's own checks run."""
    if not isinstance(hf_config, hf_cls):
        raise TypeError(f"from_hf_config: expected transformers.{hf_cls.__name__}, got {type(hf_config).__name__}")
    d = hf_config.to_dict()
    known = set(hf_cls().to_dict().keys()) | _base_config_fields() | set(seqfuse_fields)
    unknown = sorted(k for k in d if k not in known and not k.startswith("_"))
    if unknown:
        # A field transformers added after this code was written (or a
        # hand-written config.json): refuse rather than guess.
        raise NotImplementedError(
            f"from_hf_config: {hf_cls.__name__} field(s) {unknown} are not known to seqfuse; "
            "cannot tell whether the converted model would compute the same thing")
    kw = {k: v for k, v in d.items() if k not in ("model_type", "transformers_version", "architectures")
          and not k.startswith("_")}
    if kw.get("rope_parameters") is not None:
        kw["rope_parameters"] = dict(kw["rope_parameters"])
    return sf_cls(**kw)


def config_to_hf(config, sf_cls, hf_cls, seqfuse_fields):
    """transformers' ``hf_cls`` with the same model as ``config`` (an ``sf_cls``):
    every field but seqfuse's own copied."""
    if not isinstance(config, sf_cls):
        raise TypeError(f"to_hf_config: expected {sf_cls.__name__}, got {type(config).__name__}")
    d = config.to_dict()
    kw = {k: v for k, v in d.items() if k not in ("model_type", "transformers_version", "architectures")
          and k not in seqfuse_fields and not k.startswith("_")}
    kw["rope_parameters"] = dict(kw["rope_parameters"])
    return hf_cls(**kw)


def from_hf_config(hf_config):
    """SeqfuseLlamaConfig from transformers' LlamaConfig.

    Raises NotImplementedError naming the field when the LlamaConfig describes
    a model seqfuse cannot compute exactly, ValueError when a value is
    invalid, TypeError when ``hf_config`` is not a LlamaConfig."""
    return config_from_hf(hf_config, LlamaConfig, SeqfuseLlamaConfig, SEQFUSE_FIELDS)


def to_hf_config(config):
    """transformers' LlamaConfig with the same model as a SeqfuseLlamaConfig."""
    return config_to_hf(config, SeqfuseLlamaConfig, LlamaConfig, SEQFUSE_FIELDS)


register_auto(MODEL_TYPE, (AutoConfig, SeqfuseLlamaConfig))
