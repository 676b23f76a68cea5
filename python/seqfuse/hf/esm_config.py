"""The configuration of seqfuse's ESM-2 model family, and its conversion
from (and to) transformers' ``EsmConfig``.

``SeqfuseEsmConfig`` is a ``PreTrainedConfig`` with its own model_type
("seqfuse_esm"), registered with AutoConfig when ``seqfuse.hf`` is imported,
so a checkpoint written by ``save_pretrained`` loads back through
``AutoModelForMaskedLM.from_pretrained``.  Its fields are EsmConfig's, minus
what ESM-2 never uses; ``from_hf_config`` refuses, naming the field, any
EsmConfig that seqfuse's model cannot compute exactly (absolute position
embeddings of ESM-1, the ESMFold trunk, decoder/cross-attention use, RoPE
scaling), instead of converting it into a different model.

The ESM-2 shapes (8M ... 15B) are spelled out in ``ESM2_SHAPES`` so tests and
recipes can build models of the published sizes from random weights.
"""
import logging

from transformers import AutoConfig, EsmConfig, PreTrainedConfig

from .pretrained import register_auto

MODEL_TYPE = "seqfuse_esm"

_log = logging.getLogger("seqfuse")

#: the MLP activations whose model transformers' EsmConfig can describe (it has no activation field: exact
#: GELU; "gelu", its tanh approximation, exports with a logged warning): what to_hf_config / export_hf take
HF_EXPORTABLE_ACTIVATIONS = ("gelu_erf", "gelu")

#: Published ESM-2 sizes: (hidden_size, num_hidden_layers, num_attention_heads,
#: intermediate_size); vocabulary, norms and RoPE are the same for all.
ESM2_SHAPES = {
    "8M": (320, 6, 20, 1280),
    "35M": (480, 12, 20, 1920),
    "150M": (640, 30, 20, 2560),
    "650M": (1280, 33, 20, 5120),
    "3B": (2560, 36, 40, 10240),
    "15B": (5120, 48, 40, 20480),
}


class SeqfuseEsmConfig(PreTrainedConfig):
    """ESM-2 (rotary, pre-LayerNorm, GELU MLP, tied LM head) for seqfuse.

    Defaults are the ESM-2 8M model (facebook/esm2_t6_8M_UR50D's config).
    ``token_dropout`` reproduces ESM-2's "mask dropout": embeddings of
    ``mask_token_id`` are zeroed and the rest scaled by
    0.88 / (1 - observed mask fraction per sequence), in training and in
    evaluation alike, exactly as transformers' EsmEmbeddings does.
    ``attn_input_format`` is the default layout of ``forward`` ("bshd" padded
    batches; "thd" packed batches are chosen per call by passing cu_seqlens).
    ``mlp_activation`` is the activation name passed to seqfuse's LayerNormMLP:
    "gelu_erf" (default) is ESM-2's exact GELU; TE's "gelu" (tanh
    approximation) may be chosen for speed, at ~2e-4 relative change in logits.
    ``mlp_recompute_activation`` sets every layer's LayerNormMLP
    ``recompute_activation``: the MLP activation (under FP8 its transposed
    FP8 copy) is made again in the backward instead of kept, the same bits
    (ESM-2 650M, 16 x 1,024 tokens on an H100: 5.2 GiB less peak memory in
    bf16 and 2.6 GiB under FP8 for 2.4-2.7 % of the step); not with "gelu".
    """

    model_type = MODEL_TYPE

    vocab_size: int = 33
    mask_token_id: int | None = 32
    pad_token_id: int | None = 1
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = 2
    hidden_size: int = 320
    num_hidden_layers: int = 6
    num_attention_heads: int = 20
    intermediate_size: int = 1280
    hidden_dropout_prob: float | int = 0.0
    attention_probs_dropout_prob: float | int = 0.0
    max_position_embeddings: int = 1026
    rope_theta: float | int = 10000.0
    initializer_range: float | int = 0.02
    layer_norm_eps: float | int = 1e-5
    emb_layer_norm_before: bool = False
    token_dropout: bool = True
    tie_word_embeddings: bool = True
    attn_input_format: str = "bshd"
    mlp_activation: str = "gelu_erf"
    mlp_recompute_activation: bool = False

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        self.validate_seqfuse()

    def validate_seqfuse(self):
        """Raise ValueError naming the field when the values cannot build a model."""
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"SeqfuseEsmConfig: hidden_size ({self.hidden_size}) must be a multiple of "
                f"num_attention_heads ({self.num_attention_heads})")
        if (self.hidden_size // self.num_attention_heads) % 2:
            raise ValueError(
                f"SeqfuseEsmConfig: the head dim hidden_size / num_attention_heads = "
                f"{self.hidden_size // self.num_attention_heads} must be even for rotary embeddings")
        if self.token_dropout and self.mask_token_id is None:
            raise ValueError("SeqfuseEsmConfig: token_dropout=True needs mask_token_id")
        if self.attn_input_format not in ("bshd", "thd"):
            raise ValueError(
                f"SeqfuseEsmConfig: attn_input_format must be 'bshd' or 'thd', got {self.attn_input_format!r}")
        check_recompute_activation(self, "SeqfuseEsmConfig", self.mlp_activation)

    @property
    def head_dim(self):
        return self.hidden_size // self.num_attention_heads


def check_recompute_activation(config, name, activation):
    """ValueError naming ``mlp_recompute_activation`` unless it is a bool the
    activation allows (LayerNormMLP makes every activation but TE's tanh
    "gelu" again bit for bit)."""
    value = config.mlp_recompute_activation
    if not isinstance(value, bool):
        raise ValueError(f"{name}: mlp_recompute_activation must be a bool, got {type(value).__name__}")
    if value and activation == "gelu":
        raise ValueError(f"{name}: mlp_recompute_activation=True needs an mlp_activation other than 'gelu' (its "
                         "tanh GELU is computed in FC1's epilogue, which the backward cannot make again bit for "
                         "bit); 'gelu_erf' takes it")


def esm2_config(size="8M", **overrides):
    """A SeqfuseEsmConfig of a published ESM-2 size ("8M", "35M", "150M",
    "650M", "3B", "15B"), fields overridable by keyword."""
    if size not in ESM2_SHAPES:
        raise ValueError(f"esm2_config: size must be one of {sorted(ESM2_SHAPES)}, got {size!r}")
    h, n, a, f = ESM2_SHAPES[size]
    kw = dict(hidden_size=h, num_hidden_layers=n, num_attention_heads=a, intermediate_size=f)
    kw.update(overrides)
    return SeqfuseEsmConfig(**kw)


# EsmConfig fields copied one to one.
_COPIED = (
    "vocab_size", "mask_token_id", "pad_token_id", "bos_token_id", "eos_token_id",
    "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
    "hidden_dropout_prob", "attention_probs_dropout_prob", "max_position_embeddings",
    "rope_theta", "initializer_range", "layer_norm_eps", "emb_layer_norm_before",
    "token_dropout", "tie_word_embeddings",
)
# EsmConfig fields that seqfuse represents only at one value: field -> (the
# value, why another value cannot be computed by seqfuse's model).
_REQUIRED = {
    "position_embedding_type": ("rotary", "seqfuse's ESM is ESM-2, which uses rotary position "
                                "embeddings; ESM-1's absolute/relative embeddings are not implemented"),
    "is_folding_model": (False, "the ESMFold trunk is not implemented in seqfuse"),
    "esmfold_config": (None, "the ESMFold trunk is not implemented in seqfuse"),
    "is_decoder": (False, "ESM-2 is a bidirectional encoder; causal ESM is not implemented"),
    "add_cross_attention": (False, "cross-attention is not implemented in seqfuse's ESM"),
}
# EsmConfig fields that do not change the model's numbers: field -> why.
_IGNORED = {
    "use_cache": "an encoder keeps no key/value cache",
    "vocab_list": "only read by ESMFold",
    "chunk_size_feed_forward": "feed-forward chunking saves memory without changing results",
}
# RoPE variants transformers may attach to a config; seqfuse computes only the default.
_ROPE_SCALING_FIELDS = ("rope_scaling", "rope_parameters")


def _base_config_fields():
    return set(PreTrainedConfig().to_dict().keys())


def from_hf_config(hf_config):
    """SeqfuseEsmConfig from transformers' EsmConfig.

    Raises NotImplementedError naming the field when the EsmConfig describes a
    model seqfuse cannot compute exactly, ValueError when a value is invalid,
    TypeError when ``hf_config`` is not an EsmConfig.
    """
    if not isinstance(hf_config, EsmConfig):
        raise TypeError(f"from_hf_config: expected transformers.EsmConfig, got {type(hf_config).__name__}")
    d = hf_config.to_dict()
    for field, (value, why) in _REQUIRED.items():
        got = d.get(field, value)
        if got != value:
            raise NotImplementedError(
                f"from_hf_config: EsmConfig.{field}={got!r} cannot be represented "
                f"(seqfuse needs {value!r}): {why}")
    for field in _ROPE_SCALING_FIELDS:
        got = d.get(field)
        if got and (not isinstance(got, dict) or got.get("rope_type", "default") != "default"):
            raise NotImplementedError(
                f"from_hf_config: EsmConfig.{field}={got!r} cannot be represented: "
                "seqfuse's ESM computes the default rotary embedding only")
    if d.get("token_dropout") and d.get("mask_token_id") is None:
        raise ValueError("from_hf_config: EsmConfig.token_dropout=True needs EsmConfig.mask_token_id")
    if d.get("vocab_size") is None:
        raise ValueError("from_hf_config: EsmConfig.vocab_size is None")
    known = set(_COPIED) | set(_REQUIRED) | set(_IGNORED) | set(_ROPE_SCALING_FIELDS) | _base_config_fields()
    unknown = sorted(k for k in d if k not in known and not k.startswith("_"))
    if unknown:
        # A field transformers added after this code was written: refuse
        # rather than guess whether it changes the model.
        raise NotImplementedError(
            f"from_hf_config: EsmConfig field(s) {unknown} are not known to seqfuse; "
            "cannot tell whether the converted model would compute the same thing")
    kw = {k: d[k] for k in _COPIED if k in d}
    if kw.get("layer_norm_eps") is None:
        kw["layer_norm_eps"] = 1e-12  # EsmConfig's own default
    if kw.get("emb_layer_norm_before") is None:
        kw["emb_layer_norm_before"] = False
    if kw.get("token_dropout") is None:
        kw["token_dropout"] = False
    for k in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
        if kw.get(k) is None:
            kw[k] = 0.0
    if hf_config.dtype is not None:
        kw["dtype"] = hf_config.dtype
    return SeqfuseEsmConfig(**kw)


def to_hf_config(config):
    """transformers' EsmConfig with the same model as a SeqfuseEsmConfig."""
    if not isinstance(config, SeqfuseEsmConfig):
        raise TypeError(f"to_hf_config: expected SeqfuseEsmConfig, got {type(config).__name__}")
    if config.mlp_activation not in HF_EXPORTABLE_ACTIVATIONS:
        raise NotImplementedError(
            f"to_hf_config: mlp_activation={config.mlp_activation!r} has no transformers EsmConfig "
            "counterpart (EsmForMaskedLM computes the exact GELU): only 'gelu_erf' exports as the same "
            "network ('gelu', its tanh approximation, exports with a logged warning)")
    if config.mlp_activation == "gelu":
        _log.warning("to_hf_config: mlp_activation='gelu' (tanh approximation) exports as EsmConfig's exact "
                     "GELU: transformers' model computes slightly different logits (~1e-4 relative)")
    kw = {k: getattr(config, k) for k in _COPIED}
    kw["position_embedding_type"] = "rotary"
    if config.dtype is not None:
        kw["dtype"] = config.dtype
    return EsmConfig(**kw)


register_auto(MODEL_TYPE, (AutoConfig, SeqfuseEsmConfig))
