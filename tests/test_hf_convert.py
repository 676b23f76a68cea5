"""Weight conversion HF EsmForMaskedLM <-> seqfuse, at the state-dict level
(the model-level round trips are in test_hf_esm.py): exact round trip, the
key sets, and errors that name the key."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers import check_conversion_refused  # noqa: E402
from seqfuse.hf import from_hf_config  # noqa: E402
from seqfuse.hf.convert import (hf_keys, hf_to_seqfuse_state_dict, seqfuse_keys,  # noqa: E402
                                seqfuse_to_hf_state_dict)


def tiny_hf(layers=2, **kw):
    cfg = dict(vocab_size=33, mask_token_id=32, pad_token_id=1, hidden_size=32, num_hidden_layers=layers,
               num_attention_heads=4, intermediate_size=64, position_embedding_type="rotary",
               token_dropout=True, emb_layer_norm_before=False, layer_norm_eps=1e-5,
               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    cfg.update(kw)
    torch.manual_seed(0)
    return transformers.EsmForMaskedLM(transformers.EsmConfig(**cfg))


@pytest.mark.parametrize("kw", [{}, {"emb_layer_norm_before": True}, {"tie_word_embeddings": False}])
def test_round_trip_bit_identical(kw):
    hf = tiny_hf(**kw)
    cfg = from_hf_config(hf.config)
    sd = hf.state_dict()
    # Make every tensor distinct so a mix-up cannot pass.
    sd = {k: torch.randn_like(v) if v.is_floating_point() and k != "lm_head.decoder.weight" else v
          for k, v in sd.items()}
    if cfg.tie_word_embeddings:
        sd["lm_head.decoder.weight"] = sd["esm.embeddings.word_embeddings.weight"]
    sf = hf_to_seqfuse_state_dict(sd, cfg)
    tied = {"lm_head.decoder.weight"} if cfg.tie_word_embeddings else set()
    assert set(sf) - tied == set(seqfuse_keys(cfg))
    back = seqfuse_to_hf_state_dict(sf, cfg)
    assert set(back) == set(sd)
    for k in sd:
        assert back[k].dtype == sd[k].dtype and torch.equal(back[k], sd[k]), k
    # The fused QKV holds q, k, v rows head by head.
    w = sf["esm.encoder.layers.1.self_attention.layernorm_qkv.weight"]
    d = cfg.head_dim
    assert torch.equal(w[:d], sd["esm.encoder.layer.1.attention.self.query.weight"][:d])
    assert torch.equal(w[d:2 * d], sd["esm.encoder.layer.1.attention.self.key.weight"][:d])
    assert torch.equal(w[2 * d:3 * d], sd["esm.encoder.layer.1.attention.self.value.weight"][:d])


def test_hf_keys_match_transformers():
    for kw in ({}, {"emb_layer_norm_before": True}, {"tie_word_embeddings": False}):
        hf = tiny_hf(**kw)
        cfg = from_hf_config(hf.config)
        assert set(hf.state_dict()) - {"lm_head.decoder.weight"} == set(hf_keys(cfg)) - {"lm_head.decoder.weight"}


def test_missing_key_is_named():
    hf = tiny_hf()
    cfg = from_hf_config(hf.config)
    check_conversion_refused(hf_to_seqfuse_state_dict, hf.state_dict(), cfg, KeyError,
                             r"esm\.encoder\.layer\.1\.attention\.self\.key\.bias",
                             drop=["esm.encoder.layer.1.attention.self.key.bias"])
    sf = hf_to_seqfuse_state_dict(hf.state_dict(), cfg)
    check_conversion_refused(seqfuse_to_hf_state_dict, sf, cfg, KeyError, r"layers\.0\.layernorm_mlp\.fc2_bias",
                             drop=["esm.encoder.layers.0.layernorm_mlp.fc2_bias"])


def test_unexpected_key_and_shape_are_named():
    hf = tiny_hf()
    cfg = from_hf_config(hf.config)
    check_conversion_refused(hf_to_seqfuse_state_dict, hf.state_dict(), cfg, ValueError, r"layer\.7\.LayerNorm\.weight",
                             put={"esm.encoder.layer.7.LayerNorm.weight": torch.zeros(32)})
    check_conversion_refused(hf_to_seqfuse_state_dict, hf.state_dict(), cfg, ValueError,
                             r"intermediate\.dense\.weight.*\(48, 32\)",
                             put={"esm.encoder.layer.0.intermediate.dense.weight": torch.zeros(48, 32)})
    # A checkpoint of another depth: the layers the config needs are missing.
    with pytest.raises(KeyError, match=r"layer\.2\."):
        hf_to_seqfuse_state_dict(hf.state_dict(), from_hf_config(tiny_hf(layers=3).config))
