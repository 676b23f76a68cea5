"""Saving, loading and converting seqfuse's Hugging Face families where
transformers stays silent: an untied output layer missing from a checkpoint,
a checkpoint of another model type, a save path that is a file, a sharded
save over an earlier single-file one, a tied config whose output layer was
replaced, and an ESM MLP activation transformers cannot describe.  Each is
refused naming the rule, or (the stale single file) fixed and logged."""
import json
import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

from seqfuse.hf import SeqfuseEsmForMaskedLM, SeqfuseLlamaForCausalLM, esm2_config  # noqa: E402
from seqfuse.hf import convert as esm_convert  # noqa: E402
from seqfuse.hf.llama_config import from_hf_config  # noqa: E402
from seqfuse.hf.llama_convert import export_hf, from_hf_model  # noqa: E402
from test_hf_llama import hf_model, tiny_config  # noqa: E402


def _llama(tie=False, seed=0):
    torch.manual_seed(seed)
    return SeqfuseLlamaForCausalLM(from_hf_config(tiny_config(tie=tie))).eval()


def _logits(model):
    ids = torch.tensor([[1, 5, 7, 3, 2]])
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_untied_output_layer_missing_from_checkpoint_is_refused(tmp_path):
    _llama(tie=False).save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    sd = safetensors.load_file(weights)
    del sd["lm_head.weight"]
    safetensors.save_file(sd, weights, metadata={"format": "pt"})
    with pytest.raises(KeyError, match=r"from_pretrained.*missing weight\(s\) \['lm_head.weight'\]"):
        SeqfuseLlamaForCausalLM.from_pretrained(tmp_path)


def test_tied_checkpoint_without_output_layer_still_loads(tmp_path):
    model = _llama(tie=True)
    model.save_pretrained(tmp_path)
    back = SeqfuseLlamaForCausalLM.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(_logits(back), _logits(model), rtol=0, atol=0)


def test_checkpoint_of_another_model_type_is_refused(tmp_path):
    _llama().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"SeqfuseEsmForMaskedLM.from_pretrained.*model_type 'seqfuse_llama', "
                                         r"but SeqfuseEsmForMaskedLM loads 'seqfuse_esm' checkpoints"):
        SeqfuseEsmForMaskedLM.from_pretrained(tmp_path)


def test_save_and_export_into_a_file_path_raise(tmp_path):
    file = tmp_path / "a_file"
    file.write_text("mine")
    model = _llama()
    with pytest.raises(NotADirectoryError, match=r"SeqfuseLlamaForCausalLM.save_pretrained: .*a_file.* is a file"):
        model.save_pretrained(file)
    with pytest.raises(NotADirectoryError, match=r"SeqfuseLlamaForCausalLM.export_hf: .*a_file.* is a file"):
        export_hf(model, file)
    assert file.read_text() == "mine"


@pytest.mark.parametrize("exporting", [False, True])
def test_sharded_save_over_a_single_file_save_loads_the_new_model(tmp_path, caplog, exporting):
    old, new = _llama(seed=0), _llama(seed=1)
    if exporting:
        export_hf(old, tmp_path)
        with caplog.at_level(logging.WARNING, logger="seqfuse"):
            export_hf(new, tmp_path, max_shard_size="20KB")
        back = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    else:
        old.save_pretrained(tmp_path)
        with caplog.at_level(logging.WARNING, logger="seqfuse"):
            new.save_pretrained(tmp_path, max_shard_size="20KB")
        back = SeqfuseLlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert not (tmp_path / "model.safetensors").exists()
    assert "removed" in caplog.text and "model.safetensors" in caplog.text
    torch.testing.assert_close(_logits(back), _logits(new), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(_logits(back), _logits(old))


def test_single_file_save_over_a_sharded_save_keeps_the_new_file(tmp_path, caplog):
    """The reverse order: transformers removes the earlier shards but keeps their index; the new
    model.safetensors stays (the save wrote it) and the stale index goes, named in the log."""
    old, new = _llama(seed=0), _llama(seed=1)
    old.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    with caplog.at_level(logging.WARNING, logger="seqfuse"):
        new.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    assert not (tmp_path / "model.safetensors.index.json").exists()
    assert "earlier sharded save's index" in caplog.text
    back = SeqfuseLlamaForCausalLM.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(_logits(back), _logits(new), rtol=1e-5, atol=1e-5)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="seqfuse"):
        new.save_pretrained(tmp_path)  # the same kind again: nothing stale, nothing removed
    assert (tmp_path / "model.safetensors").is_file() and "removed" not in caplog.text


def test_tied_config_with_a_replaced_output_layer_is_refused():
    hf = hf_model(tie=True)
    hf.lm_head.weight = torch.nn.Parameter(torch.randn_like(hf.lm_head.weight))  # untied after it was built
    with pytest.raises(ValueError, match=r"transformers state dict: config.tie_word_embeddings=True ties "
                                         r"'lm_head.weight' to 'model.embed_tokens.weight', but the two tensors "
                                         r"differ"):
        from_hf_model(hf)
    assert isinstance(from_hf_model(hf_model(tie=True)), SeqfuseLlamaForCausalLM)  # tied: converts


def test_esm_tied_decoder_replaced_is_refused():
    hf = esm_convert.to_hf_model(SeqfuseEsmForMaskedLM(esm2_config("8M", num_hidden_layers=1)))
    assert hf.config.tie_word_embeddings
    hf.lm_head.decoder.weight = torch.nn.Parameter(torch.randn_like(hf.lm_head.decoder.weight))
    with pytest.raises(ValueError, match=r"ties 'lm_head.decoder.weight' to "
                                         r"'esm.embeddings.word_embeddings.weight', but the two tensors differ"):
        esm_convert.from_hf_model(hf)


def test_esm_activation_without_a_transformers_counterpart_is_refused(caplog):
    with pytest.raises(NotImplementedError, match=r"to_hf_config: mlp_activation='relu' has no transformers "
                                                  r"EsmConfig counterpart"):
        esm_convert.to_hf_model(SeqfuseEsmForMaskedLM(esm2_config("8M", num_hidden_layers=1,
                                                                   mlp_activation="relu")))
    with caplog.at_level(logging.WARNING, logger="seqfuse"):
        hf = esm_convert.to_hf_model(SeqfuseEsmForMaskedLM(esm2_config("8M", num_hidden_layers=1,
                                                                        mlp_activation="gelu")))
    assert "mlp_activation='gelu' (tanh approximation) exports as EsmConfig's exact GELU" in caplog.text
    assert isinstance(hf, transformers.EsmForMaskedLM)
    assert json.loads(hf.config.to_json_string())["model_type"] == "esm"
