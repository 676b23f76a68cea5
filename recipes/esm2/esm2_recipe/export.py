"""The ESM-2 recipe's final export: the trained model as transformers'
EsmForMaskedLM (safetensors + config) with the ESM tokenizer files."""
import os

import torch


def export_hf(model_config, state_dict: dict, out_dir: str) -> str:
    """Write the trained model as transformers' EsmForMaskedLM (safetensors
    + config) and the ESM tokenizer files into ``out_dir``; rank 0 only."""
    from transformers import EsmTokenizer
    from transformers.initialization import no_init_weights

    from seqfuse.data import ESM2_VOCAB
    from seqfuse.hf import SeqfuseEsmForMaskedLM
    from seqfuse.hf.convert import to_hf_model

    with torch.device("cpu"), no_init_weights():
        sf = SeqfuseEsmForMaskedLM(model_config)
    own = sf.state_dict()
    sd = {k: v for k, v in state_dict.items()}
    for k, v in own.items():  # module bookkeeping missing from a gathered state stays as built
        sd.setdefault(k, v)
    dtype = sd["esm.embeddings.word_embeddings.weight"].dtype
    sf = sf.to(dtype)
    sf.load_state_dict(sd, strict=True)
    sf.tie_weights()
    hf = to_hf_model(sf.eval())
    os.makedirs(out_dir, exist_ok=True)
    hf.save_pretrained(out_dir, safe_serialization=True)
    vocab = os.path.join(out_dir, "vocab.txt")
    with open(vocab, "w") as f:
        f.write("\n".join(ESM2_VOCAB) + "\n")
    EsmTokenizer(vocab_file=vocab).save_pretrained(out_dir)
    return out_dir
