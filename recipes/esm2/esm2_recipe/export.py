"""The ESM-2 recipe's final export: the trained model as transformers'
EsmForMaskedLM (safetensors + config) with the ESM tokenizer files
(recipe_common/export.py does the steps)."""
import os

from recipe_common.export import write_hf_export


def _save_esm_tokenizer(out_dir):
    from transformers import EsmTokenizer

    from seqfuse.data import ESM2_VOCAB

    vocab = os.path.join(out_dir, "vocab.txt")
    with open(vocab, "w") as f:
        f.write("\n".join(ESM2_VOCAB) + "\n")
    EsmTokenizer(vocab_file=vocab).save_pretrained(out_dir)


def export_hf(model_config, state_dict: dict, out_dir: str) -> str:
    """Write the trained model as transformers' EsmForMaskedLM (safetensors
    + config) and the ESM tokenizer files into ``out_dir``; rank 0 only."""
    from seqfuse.hf import SeqfuseEsmForMaskedLM
    from seqfuse.hf.convert import export_hf as write_esm

    return write_hf_export(SeqfuseEsmForMaskedLM, write_esm, model_config, state_dict,
                           "esm.embeddings.word_embeddings.weight", out_dir, _save_esm_tokenizer)
