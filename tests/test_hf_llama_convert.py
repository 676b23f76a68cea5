"""Llama weight conversion between transformers' LlamaForCausalLM and
seqfuse's SeqfuseLlamaForCausalLM, checkpoints, and the export transformers
loads: the round trip is bit-identical (float32 and bf16, tied and untied,
grouped-query heads); bad state dicts are refused naming the key;
save_pretrained / from_pretrained through the Auto classes give back the
same model (inv_freq, which is not saved, recomputed from the config); the
exported directory is a plain "llama" checkpoint that transformers'
LlamaForCausalLM and AutoModelForCausalLM load, with the same logits."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers import check_conversion_refused, check_strict_from_pretrained, pair_tol, rel_error, rel_tol  # noqa: E402
from seqfuse.hf import SeqfuseLlamaForCausalLM, SeqfuseLlamaModel  # noqa: E402
from seqfuse.hf.llama_config import from_hf_config, rope_inv_freq  # noqa: E402
from seqfuse.hf.llama_convert import (export_hf, from_hf_model, from_hf_pretrained, hf_keys,  # noqa: E402
                                      hf_to_seqfuse_state_dict, seqfuse_keys, seqfuse_to_hf_state_dict,
                                      to_hf_model)
from causal_lm_checks import batch, check_keys_match, check_round_trip, real  # noqa: E402
from test_hf_llama import hf_model, tiny_config  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_round_trip_bit_identical(dtype, tie, kv_heads):
    hf = hf_model(seed=20, dtype=dtype, tie=tie, num_key_value_heads=kv_heads)
    sf, back = check_round_trip(hf, from_hf_model, to_hf_model, dtype, tie)
    # The converted model is a copy, not a view of the original.
    with torch.no_grad():
        sf.model.embed_tokens.weight.add_(1)
    assert torch.equal(hf.model.embed_tokens.weight, back.model.embed_tokens.weight)
    ids = torch.tensor([[1, 5, 9, 7, 3, 2]])
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids).logits, hf(input_ids=ids).logits)


def test_keys_match_both_models():
    check_keys_match(transformers.LlamaForCausalLM, SeqfuseLlamaForCausalLM, tiny_config, from_hf_config, hf_keys,
                     seqfuse_keys)


def test_fused_layouts():
    """q/k/v rows land in TE's per-group order, gate/up as [gate; up]."""
    hf = hf_model(seed=21, num_key_value_heads=2)
    sd = hf_to_seqfuse_state_dict(hf.state_dict(), from_hf_config(hf.config))
    p = "model.layers.1."
    qkv = sd[p + "self_attention.layernorm_qkv.weight"].view(2, 4, 16, 64)  # groups, (2 q + k + v), d, h
    q = hf.state_dict()[p + "self_attn.q_proj.weight"].view(2, 2, 16, 64)
    k = hf.state_dict()[p + "self_attn.k_proj.weight"].view(2, 16, 64)
    v = hf.state_dict()[p + "self_attn.v_proj.weight"].view(2, 16, 64)
    assert torch.equal(qkv[:, :2], q) and torch.equal(qkv[:, 2], k) and torch.equal(qkv[:, 3], v)
    fc1 = sd[p + "layernorm_mlp.fc1_weight"]
    assert torch.equal(fc1[:96], hf.state_dict()[p + "mlp.gate_proj.weight"])
    assert torch.equal(fc1[96:], hf.state_dict()[p + "mlp.up_proj.weight"])


def test_bad_state_dicts_are_named():
    hf = hf_model(seed=22)
    cfg = from_hf_config(hf.config)
    sd = hf.state_dict()
    check_conversion_refused(hf_to_seqfuse_state_dict, sd, cfg, KeyError, r"layers\.1\.mlp\.up_proj\.weight",
                             drop=["model.layers.1.mlp.up_proj.weight"])
    check_conversion_refused(hf_to_seqfuse_state_dict, sd, cfg, ValueError, r"layers\.7\.input_layernorm\.weight",
                             put={"model.layers.7.input_layernorm.weight": torch.ones(64)})
    check_conversion_refused(hf_to_seqfuse_state_dict, sd, cfg, ValueError,
                             r"k_proj\.weight.*\(64, 64\).*\(32, 64\)",
                             put={"model.layers.0.self_attn.k_proj.weight": torch.zeros(64, 64)})
    check_conversion_refused(seqfuse_to_hf_state_dict, from_hf_model(hf).state_dict(), cfg, KeyError,
                             r"layers\.0\.layernorm_mlp\.fc1_weight", drop=["model.layers.0.layernorm_mlp.fc1_weight"])
    with pytest.raises(TypeError, match="LlamaForCausalLM"):
        from_hf_model(transformers.LlamaModel(tiny_config()))
    with pytest.raises(TypeError, match="SeqfuseLlamaForCausalLM"):
        to_hf_model(hf)


# ----------------------------------------------------------- save and load
@pytest.mark.parametrize("tie", [False, True])
def test_save_pretrained_from_pretrained(tmp_path, tie):
    model = from_hf_model(hf_model(seed=23, tie=tie)).eval()
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["SeqfuseLlamaForCausalLM"] and cfg["model_type"] == "seqfuse_llama"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is SeqfuseLlamaForCausalLM
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tie
    assert torch.equal(loaded.model.rotary_emb.inv_freq, rope_inv_freq(model.config))
    a, b = model.state_dict(), loaded.state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    bt, _ = batch(seed=23)
    with torch.no_grad():
        assert torch.equal(loaded(**bt).logits, model(**bt).logits)
    base = transformers.AutoModel.from_pretrained(tmp_path)
    assert type(base) is SeqfuseLlamaModel


def test_from_pretrained_missing_and_unexpected_keys(tmp_path):
    from_hf_model(hf_model(seed=24)).save_pretrained(tmp_path)
    check_strict_from_pretrained(SeqfuseLlamaForCausalLM, tmp_path, "model.layers.5.layernorm_mlp.fc1_weight",
                                 torch.zeros(192, 64), "model.layers.1.self_attention.proj.weight")


# ------------------------------------------------------------------ export
@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_export_loads_in_transformers(tmp_path, tie, dtype):
    model = from_hf_model(hf_model(seed=25, tie=tie, dtype=dtype)).eval()
    assert export_hf(model, tmp_path) == tmp_path
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["rope_parameters"]["rope_type"] == "llama3" and "attn_input_format" not in cfg
    bt, _ = batch(seed=25)
    with torch.no_grad():
        ours = model(**bt)
    m = bt["attention_mask"]
    for loader in (transformers.LlamaForCausalLM, transformers.AutoModelForCausalLM):
        hf = loader.from_pretrained(tmp_path, dtype=dtype).eval()
        assert type(hf) is transformers.LlamaForCausalLM
        assert next(hf.parameters()).dtype == dtype
        assert (hf.lm_head.weight is hf.model.embed_tokens.weight) == tie
        with torch.no_grad():
            theirs = hf(**bt)
        # two models in dtype: pair_tol; float32 holds the tighter single bound
        bound = rel_tol(dtype) if dtype == torch.float32 else pair_tol(dtype)
        assert rel_error(real(ours.logits, m), real(theirs.logits, m)) <= bound
        assert abs(ours.loss.item() - theirs.loss.item()) <= bound * theirs.loss.item()
    # and back: the exported directory converts to the same seqfuse weights
    again = from_hf_pretrained(str(tmp_path))
    a, b = model.state_dict(), again.state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_from_hf_pretrained_strict(tmp_path):
    from safetensors.torch import load_file, save_file

    hf = hf_model(seed=26)
    hf.save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    sd = load_file(path)
    # older transformers saved every layer's rotary inv_freq: accepted, recomputed from the config
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)
    save_file(sd, path, metadata={"format": "pt"})
    sf = from_hf_pretrained(str(tmp_path))
    assert torch.equal(sf.model.rotary_emb.inv_freq, rope_inv_freq(hf.config))
    del sd["model.layers.1.self_attn.v_proj.weight"]
    save_file(sd, path, metadata={"format": "pt"})
    with pytest.raises(KeyError, match=r"layers\.1\.self_attn\.v_proj\.weight"):
        from_hf_pretrained(str(tmp_path))
    sd["model.layers.1.self_attn.v_proj.weight"] = hf.state_dict()["model.layers.1.self_attn.v_proj.weight"]
    sd["model.layers.1.self_attn.v_proj.bias"] = torch.zeros(32)
    save_file(sd, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"v_proj\.bias"):
        from_hf_pretrained(str(tmp_path))
    with pytest.raises(FileNotFoundError):
        from_hf_pretrained(str(tmp_path / "nowhere"))
    # An unrepresentable config is refused before any weight is read.
    tiny_config(hidden_act="gelu").save_pretrained(tmp_path)
    with pytest.raises(NotImplementedError, match="hidden_act"):
        from_hf_pretrained(str(tmp_path))


def test_family_functions_name_their_module_and_classes():
    # state_dict.family_functions builds each family module's model-level
    # functions; they belong to the module that asked and name its classes.
    import seqfuse.hf.convert as esm_convert
    import seqfuse.hf.mixtral_convert as mixtral_convert
    for module, sf, hf in ((esm_convert, "SeqfuseEsmForMaskedLM", "EsmForMaskedLM"),
                           (mixtral_convert, "SeqfuseMixtralForCausalLM", "MixtralForCausalLM")):
        for name in ("from_hf_model", "to_hf_model", "export_hf", "from_hf_pretrained"):
            f = getattr(module, name)
            assert (f.__module__, f.__qualname__) == (module.__name__, name)
            assert sf in f.__doc__ and hf in f.__doc__
    assert export_hf.__module__ == "seqfuse.hf.llama_convert" and "SeqfuseLlamaForCausalLM" in export_hf.__doc__
