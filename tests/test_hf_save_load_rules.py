"""Saving, loading and converting seqfuse's Hugging Face families where
transformers stays silent: an untied output layer missing from a checkpoint,
a checkpoint of another model type, a save path that is a file, a sharded
save over an earlier single-file one, a tied config whose output layer was
replaced, an ESM MLP activation transformers cannot describe, and a
config.json that cannot be read.  Each is refused naming the rule, or (the
stale single file) fixed and logged; a process that does not save (not the
main process, or not rank 0) writes and removes nothing."""
import json
import logging
import os
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

from seqfuse.hf import SeqfuseEsmForMaskedLM, SeqfuseLlamaForCausalLM, esm2_config  # noqa: E402
from seqfuse.hf import convert as esm_convert  # noqa: E402
from seqfuse.hf import pretrained as hf_pretrained  # noqa: E402
from seqfuse.hf.state_dict import save_pretrained_checked  # noqa: E402
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


# ---- a process that does not save ----------------------------------------------------------

def _tree(root):
    """Every file under ``root``: {relative path: (size, mtime_ns, inode, bytes)}."""
    out = {}
    for d, _, files in os.walk(root):
        for name in files:
            f = os.path.join(d, name)
            st = os.stat(f)
            with open(f, "rb") as fh:
                out[os.path.relpath(f, root)] = (st.st_size, st.st_mtime_ns, st.st_ino, fh.read())
    return out


def test_non_main_process_save_writes_and_removes_nothing(tmp_path, caplog):
    """save_pretrained / export_hf with is_main_process=False (every process of
    a distributed job calls them; only the main one saves): over an earlier
    single-file save, a sharded save on a non-main process leaves the
    directory exactly as it was, the earlier weights included."""
    old, new = _llama(seed=0), _llama(seed=1)
    old.save_pretrained(tmp_path)
    before = _tree(tmp_path)
    assert "model.safetensors" in before
    with caplog.at_level(logging.WARNING, logger="seqfuse"):
        new.save_pretrained(tmp_path, max_shard_size="20KB", is_main_process=False)
        export_hf(new, tmp_path, max_shard_size="20KB", is_main_process=False)
    assert _tree(tmp_path) == before
    assert "removed" not in caplog.text
    back = SeqfuseLlamaForCausalLM.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(_logits(back), _logits(old), rtol=0, atol=0)


def _writes_an_index(path, **kw):
    """A save that writes a sharded checkpoint's index (as the saving process
    does meanwhile, or transformers 4 did on every process)."""
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {}}, f)


@pytest.mark.parametrize("how", ["is_main_process=False", "rank 1 (should_save_on_this_rank)",
                                 "rank 1 (torch.distributed)"])
def test_a_process_that_does_not_save_removes_nothing(tmp_path, caplog, monkeypatch, how):
    """The removal of an earlier save's weights runs only where transformers
    saves.  A non-main process, or rank 1 of a job whose every rank calls
    save_pretrained with the default is_main_process=True (transformers
    writes on rank 0 only), sees the index rank 0 writes appear beside the
    earlier model.safetensors: it removed that file too (two ranks racing to
    remove one file).  Now only the saving process removes it."""
    (tmp_path / "model.safetensors").write_bytes(b"earlier weights")
    kw = {}
    model = _llama()
    if how == "is_main_process=False":
        kw["is_main_process"] = False
    elif how.startswith("rank 1 (should"):
        monkeypatch.setattr(model, "should_save_on_this_rank", lambda is_main_process: False, raising=False)
    else:
        import torch.distributed as dist

        model = object()  # no should_save_on_this_rank (older transformers): torch.distributed decides
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    with caplog.at_level(logging.WARNING, logger="seqfuse"):
        save_pretrained_checked(model, tmp_path, "where", save=_writes_an_index, **kw)
    assert (tmp_path / "model.safetensors").read_bytes() == b"earlier weights"
    assert "removed" not in caplog.text
    # the process that saves removes it, naming it
    monkeypatch.undo()
    (tmp_path / "model.safetensors.index.json").unlink()
    with caplog.at_level(logging.WARNING, logger="seqfuse"):
        save_pretrained_checked(_llama(), tmp_path, "where", save=_writes_an_index)
    assert not (tmp_path / "model.safetensors").exists()
    assert "where: removed" in caplog.text


# ---- a config.json that cannot be read ----------------------------------------------------

@pytest.mark.parametrize("content,rule", [
    (b'{"model_type": "seqfuse_llama", "hidden', r"is not valid JSON \(.*\); it must hold the JSON object"),
    (b"", r"is not valid JSON"),
    (b"\xff\xfe{}", r"is not UTF-8 text"),
    (b"[1, 2]", r"holds an array, not the JSON object save_pretrained writes"),
    (b'"seqfuse_llama"', r"holds a string, not the JSON object"),
    (b"null", r"holds null, not the JSON object"),
    (b"4096", r"holds a number, not the JSON object"),
    # (no model_type: transformers would build the default 32-layer, 4,096-wide Llama from it)
    (b"{}", r"has no model_type; SeqfuseLlamaForCausalLM loads 'seqfuse_llama' checkpoints"),
    (b'{"hidden_size": 64}', r"has no model_type"),
], ids=["truncated", "empty", "not-utf8", "array", "string", "null", "number", "empty-object", "no-model-type"])
def test_unreadable_config_json_is_refused_naming_the_file(tmp_path, content, rule):
    """from_pretrained of a directory whose config.json is not the JSON
    object save_pretrained writes: seqfuse's ValueError names the call, the
    file and the rule.  (It was left to transformers: an OSError for
    invalid JSON, and for a list or a string a TypeError naming neither
    the file nor the rule.)"""
    _llama().save_pretrained(tmp_path)
    (tmp_path / "config.json").write_bytes(content)
    file = os.path.join(str(tmp_path), "config.json")
    with pytest.raises(ValueError, match=r"SeqfuseLlamaForCausalLM.from_pretrained\(.*\): the checkpoint's config "
                                         r"file " + re.escape(file) + " " + rule):
        SeqfuseLlamaForCausalLM.from_pretrained(tmp_path)


def test_config_json_that_cannot_be_opened_is_refused_naming_the_file(tmp_path, monkeypatch):
    """An I/O error reading config.json (permissions, a failing disk) is an
    OSError naming the call and the file (the tests run as root, so the
    failure is injected)."""
    _llama().save_pretrained(tmp_path)

    def failing_open(file, *args, **kwargs):
        raise PermissionError(13, "Permission denied", file)

    monkeypatch.setattr(hf_pretrained, "open", failing_open, raising=False)
    file = os.path.join(str(tmp_path), "config.json")
    with pytest.raises(OSError, match=r"SeqfuseLlamaForCausalLM.from_pretrained\(.*\): the checkpoint's config file "
                                      + re.escape(file) + " cannot be read: Permission denied") as err:
        SeqfuseLlamaForCausalLM.from_pretrained(tmp_path)
    assert err.value.errno == 13
    monkeypatch.undo()
    SeqfuseLlamaForCausalLM.from_pretrained(tmp_path)  # readable: loads


def test_model_type_check_reads_the_subfolders_config(tmp_path):
    """from_pretrained(dir, subfolder=...) reads the subfolder's config.json
    (a root config.json without model_type, of something else, is not the
    checkpoint's and refuses nothing)."""
    _llama().save_pretrained(tmp_path / "model")
    (tmp_path / "config.json").write_text("{}")
    loaded = SeqfuseLlamaForCausalLM.from_pretrained(tmp_path, subfolder="model")
    assert isinstance(loaded, SeqfuseLlamaForCausalLM)
    (tmp_path / "model" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"config file .*model.config\.json has no model_type"):
        SeqfuseLlamaForCausalLM.from_pretrained(tmp_path, subfolder="model")
