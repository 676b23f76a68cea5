"""The recipes' final export, shared: a trained model's full (gathered)
state rebuilt as seqfuse's model on the CPU, written as transformers' own
model directory (config.json + safetensors, loadable without seqfuse) by
the model family's ``export_hf`` (seqfuse.hf.convert, llama_convert,
mixtral_convert), with the recipe's tokenizer files beside it.

Each recipe names its classes and tokenizer (esm2_recipe/export.py,
llama3_recipe.trainer.export_hf, mixtral_recipe.trainer.export_hf); the
steps are here once.  Rank 0 only: the state is gathered before
(checkpoint.full_model_state_dict, a collective every rank calls).
"""
from __future__ import annotations

import os

import torch


def model_from_full_state(model_class, model_config, state_dict: dict, embedding_key: str):
    """A fresh ``model_class(model_config)`` on the CPU holding ``state_dict``
    (a full, gathered model state, e.g. full_model_state_dict's), in that
    state's dtype (``embedding_key`` names the tensor that gives it), tied
    where the config says so.  Module bookkeeping a gathered state lacks
    stays as built; a key the model does not have is an error (strict load)."""
    from transformers.initialization import no_init_weights

    with torch.device("cpu"), no_init_weights():
        model = model_class(model_config)
    sd = dict(state_dict)
    for k, v in model.state_dict().items():
        sd.setdefault(k, v)
    model = model.to(sd[embedding_key].dtype)
    model.load_state_dict(sd, strict=True)
    if getattr(model_config, "tie_word_embeddings", False):
        model.tie_weights()
    return model


def write_hf_export(model_class, write_hf, model_config, state_dict: dict, embedding_key: str, out_dir: str,
                    save_tokenizer) -> str:
    """``model_from_full_state(model_class, model_config, state_dict,
    embedding_key)`` written to ``out_dir`` by ``write_hf(model, out_dir)``
    (the family's export_hf) in eval mode, then ``save_tokenizer(out_dir)``;
    returns ``out_dir``."""
    model = model_from_full_state(model_class, model_config, state_dict, embedding_key)
    os.makedirs(out_dir, exist_ok=True)
    write_hf(model.eval(), out_dir)
    save_tokenizer(out_dir)
    return out_dir
