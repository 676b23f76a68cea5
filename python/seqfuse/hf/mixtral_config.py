"""The configuration of seqfuse's Mixtral model family and its conversion
from (and to) transformers' ``MixtralConfig``.

``SeqfuseMixtralConfig`` IS a ``MixtralConfig`` (a subclass: the same
fields, defaults and RoPE standardisation) with its own model_type
("seqfuse_mixtral", registered with AutoConfig when ``seqfuse.hf`` is
imported) and one seqfuse field, ``attn_input_format`` (SeqfuseLlamaConfig's
first; its MLP field has no counterpart: the experts are a GroupedMLP).  ``head_dim`` left None is filled in as transformers'
Mixtral computes it (hidden_size // num_attention_heads), so the model's
code reads one number.

It refuses, naming the field, what seqfuse's Mixtral cannot compute exactly
instead of building a different model: the decoder checks shared with the
Llama family (llama_config.check_decoder_fields: layout, grouped-query
heads, SiLU, RoPE types), a sliding attention window, and router jitter
noise (a random multiplicative noise on the router's input while training).

``from_hf_config`` / ``to_hf_config`` convert both ways (the shared code of
llama_config: an unknown MixtralConfig field is refused).
"""
from transformers import AutoConfig, MixtralConfig

from .llama_config import check_decoder_fields, config_from_hf, config_to_hf
from .pretrained import register_auto

MODEL_TYPE = "seqfuse_mixtral"

#: Fields of SeqfuseMixtralConfig that MixtralConfig does not have.
SEQFUSE_FIELDS = ("attn_input_format",)


class SeqfuseMixtralConfig(MixtralConfig):
    """A MixtralConfig for seqfuse's Mixtral (pre-RMSNorm, grouped-query causal
    attention with RoPE, a top-k softmax-routed mixture of SwiGLU experts,
    no biases).

    ``attn_input_format`` is the default layout of ``forward`` ("bshd" padded
    batches; packed "thd" batches are chosen per call by passing cu_seqlens
    or restarting position_ids).  The load-balancing loss follows
    transformers: computed when ``output_router_logits`` (the config's, or
    forward's argument), added to the loss times ``router_aux_loss_coef``
    when labels are given."""

    model_type = MODEL_TYPE

    attn_input_format: str = "bshd"

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        self.validate_seqfuse()

    def validate_seqfuse(self):
        """Raise ValueError (a bad value) or NotImplementedError (a model
        seqfuse does not compute), naming the field."""
        name = type(self).__name__
        check_decoder_fields(self, name)
        if self.num_local_experts < 1 or not 1 <= self.num_experts_per_tok <= self.num_local_experts:
            raise ValueError(f"{name}: need num_local_experts >= 1 and 1 <= num_experts_per_tok <= "
                             f"num_local_experts, got {self.num_local_experts} and {self.num_experts_per_tok}")
        if self.sliding_window is not None:
            raise NotImplementedError(f"{name}: sliding_window={self.sliding_window!r} cannot be represented: "
                                      "seqfuse's Mixtral attends over the whole causal context (sliding_window "
                                      "None)")
        if self.router_jitter_noise:
            raise NotImplementedError(f"{name}: router_jitter_noise={self.router_jitter_noise!r} cannot be "
                                      "represented (0 only: no noise on the router's input)")


def from_hf_config(hf_config):
    """SeqfuseMixtralConfig from transformers' MixtralConfig.

    Raises NotImplementedError naming the field when the MixtralConfig
    describes a model seqfuse cannot compute exactly, ValueError when a
    value is invalid, TypeError when ``hf_config`` is not a MixtralConfig."""
    return config_from_hf(hf_config, MixtralConfig, SeqfuseMixtralConfig, SEQFUSE_FIELDS)


def to_hf_config(config):
    """transformers' MixtralConfig with the same model as a SeqfuseMixtralConfig."""
    return config_to_hf(config, SeqfuseMixtralConfig, MixtralConfig, SEQFUSE_FIELDS)


register_auto(MODEL_TYPE, (AutoConfig, SeqfuseMixtralConfig))
