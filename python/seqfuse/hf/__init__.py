"""Hugging Face integration.

- ``accelerate(model, recipe=None, attention=True, fuse_layers=True,
  fused_loss=True)``: in place, switch a PreTrainedModel's attention to
  seqfuse's fused kernel (transformers' AttentionInterface, "seqfuse"),
  replace its Llama-family decoder layers (Llama, Mistral, Qwen2, Qwen3,
  Gemma, Phi-3) by whole fused layers (seqfuse.hf.fuse_layers; state dicts
  keep transformers' keys), swap the remaining nn.Linear / nn.LayerNorm /
  RMSNorm modules for seqfuse's, and compute a causal LM's labels loss as a
  chunked fused linear cross-entropy (seqfuse.hf.fused_loss); returns a
  report of what was fused, swapped and left, and why.
- ESM-2 in seqfuse layers: ``SeqfuseEsmConfig`` (and the published shapes via
  ``esm2_config``), config conversion ``from_hf_config`` / ``to_hf_config``,
  weight conversion in ``seqfuse.hf.convert``.
- Llama (Llama 3 included) in seqfuse layers: ``SeqfuseLlamaConfig`` (a
  LlamaConfig; the published Llama 3.x shapes via ``llama3_config``),
  ``SeqfuseLlamaModel`` / ``SeqfuseLlamaForCausalLM``, conversion both ways
  and the export transformers loads in ``seqfuse.hf.llama_convert``;
  key/value-cached generation (``InferenceParams``, TE's name) in
  ``seqfuse.hf.generation``, reached as ``SeqfuseLlamaForCausalLM.generate``.

Importing this package registers the "seqfuse_esm", "seqfuse_llama" and "seqfuse_mixtral" model types with
transformers' Auto classes.  It needs ``transformers`` (>= 5).
"""
from .accelerate import AccelerateReport, accelerate, graph_layers
from .esm_config import ESM2_SHAPES, SeqfuseEsmConfig, esm2_config, from_hf_config, to_hf_config
from .qkv import fuse_qkv, split_qkv

__all__ = [
    "AccelerateReport", "accelerate", "graph_layers",
    "ESM2_SHAPES", "SeqfuseEsmConfig", "esm2_config", "from_hf_config", "to_hf_config",
    "fuse_qkv", "split_qkv",
]

from .esm import SeqfuseEsmForMaskedLM, SeqfuseEsmModel  # noqa: E402

__all__ += ["SeqfuseEsmForMaskedLM", "SeqfuseEsmModel"]

from .llama_config import LLAMA3_SHAPES, SeqfuseLlamaConfig, llama3_config  # noqa: E402
from .llama import SeqfuseLlamaForCausalLM, SeqfuseLlamaModel  # noqa: E402
from .generation import InferenceParams  # noqa: E402

__all__ += ["LLAMA3_SHAPES", "SeqfuseLlamaConfig", "llama3_config", "SeqfuseLlamaForCausalLM", "SeqfuseLlamaModel",
            "InferenceParams"]

from .mixtral_config import SeqfuseMixtralConfig  # noqa: E402
from .mixtral import SeqfuseMixtralForCausalLM, SeqfuseMixtralModel  # noqa: E402

__all__ += ["SeqfuseMixtralConfig", "SeqfuseMixtralForCausalLM", "SeqfuseMixtralModel"]
