"""The model families' ``mlp_recompute_activation`` config field: it reaches
every layer's LayerNormMLP, survives save_pretrained / from_pretrained, is
checked (a bool; not with TE's tanh "gelu" for ESM-2), and training with it
gives the same loss and gradients, bit for bit, as keeping the activation
(the CPU backend; CUDA's bit-identity is tests/test_layernorm_mlp_fp8_recompute.py's
and test_layernorm_modules.py's)."""
import pytest
import torch

from seqfuse.hf.esm import SeqfuseEsmForMaskedLM
from seqfuse.hf.esm_config import SeqfuseEsmConfig
from seqfuse.hf.llama import SeqfuseLlamaForCausalLM
from seqfuse.hf.llama_config import SeqfuseLlamaConfig


def _esm(**kw):
    return SeqfuseEsmConfig(vocab_size=33, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=96, **kw)


def _llama(**kw):
    return SeqfuseLlamaConfig(vocab_size=40, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, intermediate_size=96, max_position_embeddings=128,
                              pad_token_id=0, **kw)


FAMILIES = {"esm": (_esm, SeqfuseEsmForMaskedLM, lambda m: m.esm.encoder.layers),
            "llama": (_llama, SeqfuseLlamaForCausalLM, lambda m: m.model.layers)}


def _grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_field_reaches_every_layer_and_gives_the_same_bits(family, seed):
    make_config, model_cls, layers = FAMILIES[family]
    torch.manual_seed(seed)
    kept = model_cls(make_config())
    remade = model_cls(make_config(mlp_recompute_activation=True))
    remade.load_state_dict(kept.state_dict())
    assert [lay.layernorm_mlp.recompute_activation for lay in layers(kept)] == [False, False]
    assert [lay.layernorm_mlp.recompute_activation for lay in layers(remade)] == [True, True]
    ids = torch.randint(4, 30, (2, 24))
    loss_k, grads_k = _grads(kept, ids)
    loss_r, grads_r = _grads(remade, ids)
    assert torch.equal(loss_k, loss_r)
    assert grads_k.keys() == grads_r.keys()
    for name in grads_k:
        assert torch.equal(grads_k[name], grads_r[name]), name


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_field_survives_save_and_load(family, tmp_path):
    make_config, model_cls, layers = FAMILIES[family]
    model_cls(make_config(mlp_recompute_activation=True)).save_pretrained(tmp_path)
    loaded = model_cls.from_pretrained(tmp_path)
    assert loaded.config.mlp_recompute_activation is True
    assert all(lay.layernorm_mlp.recompute_activation for lay in layers(loaded))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_field_is_checked(family):
    make_config = FAMILIES[family][0]
    with pytest.raises(ValueError, match="mlp_recompute_activation must be a bool, got str"):
        make_config(mlp_recompute_activation="yes")


def test_esm_tanh_gelu_cannot_be_made_again():
    with pytest.raises(ValueError, match="mlp_recompute_activation=True needs an mlp_activation other than 'gelu'"):
        _esm(mlp_activation="gelu", mlp_recompute_activation=True)
    assert _esm(mlp_activation="gelu").mlp_recompute_activation is False
