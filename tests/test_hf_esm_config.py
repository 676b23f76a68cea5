"""ESM-2 config conversion (transformers EsmConfig <-> SeqfuseEsmConfig) and the
fused-QKV reshuffles, on CPU."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from seqfuse.hf import ESM2_SHAPES, SeqfuseEsmConfig, esm2_config, from_hf_config, fuse_qkv, split_qkv, to_hf_config  # noqa: E402


def hf_esm2_config(size="8M", **kw):
    h, n, a, f = ESM2_SHAPES[size]
    base = dict(vocab_size=33, mask_token_id=32, pad_token_id=1, hidden_size=h, num_hidden_layers=n,
                num_attention_heads=a, intermediate_size=f, position_embedding_type="rotary",
                token_dropout=True, emb_layer_norm_before=False, layer_norm_eps=1e-5,
                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=1026)
    base.update(kw)
    return transformers.EsmConfig(**base)


@pytest.mark.parametrize("size", ["8M", "35M", "150M", "650M", "3B", "15B"])
def test_config_round_trip(size):
    hf = hf_esm2_config(size)
    sf = from_hf_config(hf)
    assert isinstance(sf, SeqfuseEsmConfig)
    assert (sf.hidden_size, sf.num_hidden_layers, sf.num_attention_heads, sf.intermediate_size) == ESM2_SHAPES[size]
    assert sf.token_dropout and sf.mask_token_id == 32 and sf.layer_norm_eps == 1e-5
    back = to_hf_config(sf)
    assert back.to_diff_dict() == hf.to_diff_dict()
    assert sf.to_diff_dict() == esm2_config(size).to_diff_dict()


@pytest.mark.parametrize("field,value,exc", [
    ("position_embedding_type", "absolute", NotImplementedError),
    ("is_decoder", True, NotImplementedError),
    ("add_cross_attention", True, NotImplementedError),
    ("is_folding_model", True, NotImplementedError),
])
def test_unrepresentable_config_names_field(field, value, exc):
    kw = {field: value}
    if field == "add_cross_attention":
        kw["is_decoder"] = False
    hf = hf_esm2_config(**kw)
    with pytest.raises(exc, match=field):
        from_hf_config(hf)


def test_token_dropout_without_mask_token_names_field():
    hf = hf_esm2_config(mask_token_id=None)
    with pytest.raises(ValueError, match="mask_token_id"):
        from_hf_config(hf)


def test_unknown_field_is_refused():
    hf = hf_esm2_config()
    hf.some_future_switch = True
    with pytest.raises(NotImplementedError, match="some_future_switch"):
        from_hf_config(hf)


def test_wrong_type_and_bad_values():
    with pytest.raises(TypeError, match="EsmConfig"):
        from_hf_config(transformers.BertConfig())
    with pytest.raises(ValueError, match="num_attention_heads"):
        SeqfuseEsmConfig(hidden_size=100, num_attention_heads=3)
    with pytest.raises(ValueError, match="attn_input_format"):
        SeqfuseEsmConfig(attn_input_format="sbhd")
    with pytest.raises(ValueError, match="size"):
        esm2_config("9M")


def test_auto_config_finds_seqfuse_esm(tmp_path):
    cfg = esm2_config("8M", num_hidden_layers=2)
    cfg.save_pretrained(tmp_path)
    loaded = transformers.AutoConfig.from_pretrained(tmp_path)
    assert isinstance(loaded, SeqfuseEsmConfig)
    assert loaded.to_diff_dict() == cfg.to_diff_dict()


@pytest.mark.parametrize("heads,groups", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("interleaved", [True, False])
def test_qkv_fuse_split_exact(heads, groups, interleaved):
    d, hidden = 8, 24
    q = torch.randn(heads * d, hidden)
    k = torch.randn(groups * d, hidden)
    v = torch.randn(groups * d, hidden)
    fused = fuse_qkv(q, k, v, heads, groups, interleaved=interleaved)
    assert fused.shape == ((heads + 2 * groups) * d, hidden)
    q2, k2, v2 = split_qkv(fused, heads, groups, interleaved=interleaved)
    assert torch.equal(q, q2) and torch.equal(k, k2) and torch.equal(v, v2)
    # Biases (1-D) too.
    qb, kb, vb = q[:, 0].clone(), k[:, 0].clone(), v[:, 0].clone()
    fb = fuse_qkv(qb, kb, vb, heads, groups, interleaved=interleaved)
    assert torch.equal(fb, fused[:, 0])


def test_qkv_interleaved_layout():
    # Two heads, head dim 1, MHA: interleaved rows are q0 k0 v0 q1 k1 v1.
    q, k, v = torch.tensor([[1.], [2.]]), torch.tensor([[3.], [4.]]), torch.tensor([[5.], [6.]])
    assert fuse_qkv(q, k, v, 2, interleaved=True).flatten().tolist() == [1, 3, 5, 2, 4, 6]
    assert fuse_qkv(q, k, v, 2, interleaved=False).flatten().tolist() == [1, 2, 3, 4, 5, 6]


def test_qkv_bad_shapes():
    with pytest.raises(ValueError, match="num_gqa_groups"):
        fuse_qkv(torch.zeros(8, 4), torch.zeros(8, 4), torch.zeros(8, 4), 4, 3)
    with pytest.raises(ValueError, match="key"):
        fuse_qkv(torch.zeros(8, 4), torch.zeros(6, 4), torch.zeros(6, 4), 4, 4)
    with pytest.raises(ValueError, match="fused rows"):
        split_qkv(torch.zeros(10, 4), 4, 4)
