"""seqfuse.hf.accelerate's whole-layer fusion of BERT and RoBERTa encoder
layers (seqfuse.hf.fuse_encoder) on small random masked-LM models, against
the untouched model: logits on the real (unpadded) tokens, loss and
gradients (float32 to float32 rounding; bfloat16 within twice plain
transformers' own bf16 error against its float32 self), several training
steps, state dicts and save_pretrained in transformers' own keys, pickling,
FP8 training on the CPU backend, and the layers refused with a reason."""
import copy
import io

import pytest
import torch

transformers = pytest.importorskip("transformers")

from seqfuse.hf import accelerate  # noqa: E402
from seqfuse.hf.fuse_encoder import SeqfuseEncoderLayer  # noqa: E402
from seqfuse.hf.fuse_layers import hf_named_tensors  # noqa: E402
from helpers import (  # noqa: E402
    check_bf16_within_twice_plain, hf_fp8_grads_close, hf_grads_close, needs_fp8, nudge_biases_and_norms,
    padded_lm_batch, rel_error, rel_tol, train_alongside)

V = 96


def _cfg(family, **kw):
    base = dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
                max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0)
    base.update(kw)
    return getattr(transformers, f"{family}Config")(**base)


def make(family, dtype=torch.float32, seed=0, **kw):
    """BERT (erf GELU) or RoBERTa (tanh GELU: hidden_act gelu_new) masked LM,
    biases and norm weights moved off their 0 / 1 init so a mix-up shows."""
    torch.manual_seed(seed)
    if family == "Roberta":
        kw.setdefault("hidden_act", "gelu_new")
    return nudge_biases_and_norms(getattr(transformers, f"{family}ForMaskedLM")(_cfg(family, **kw)).to(dtype),
                                  "LayerNorm")


def batch(seed=1, b=2, s=13):
    return padded_lm_batch(V, seed, b, s, low=3)


def encoder_layers(model):
    return getattr(model, model.base_model_prefix).encoder.layer


FAMILIES = ["Bert", "Roberta"]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_layer_fused_and_own_parameters(family):
    model = make(family)
    ref = copy.deepcopy(model)
    own = dict(model.named_parameters())
    report = accelerate(model)
    prefix = model.base_model_prefix
    assert report.fused_names() == [f"{prefix}.encoder.layer.0", f"{prefix}.encoder.layer.1"]
    for layer in encoder_layers(model):
        assert isinstance(layer, SeqfuseEncoderLayer) and isinstance(layer, type(encoder_layers(ref)[0]))
    layer, p = encoder_layers(model)[1], f"{prefix}.encoder.layer.1."
    assert layer.proj.weight is own[p + "attention.output.dense.weight"]
    assert layer.mlp_fused.layer_norm_weight is own[p + "attention.output.LayerNorm.weight"]
    assert layer.mlp_fused.fc1_weight is own[p + "intermediate.dense.weight"]
    assert layer.mlp_fused.fc2_bias is own[p + "output.dense.bias"]
    assert layer.norm.weight is own[p + "output.LayerNorm.weight"]
    assert layer.mlp_fused.activation == ("gelu_erf" if family == "Bert" else "gelu")
    assert report.new_parameters == [f"{prefix}.encoder.layer.{i}.qkv.{w}" for i in (0, 1) for w in ("weight", "bias")]
    again = accelerate(model)  # a second call leaves the fused layers alone
    assert again.fused == [] and not [n for n in again.left_names() if ".encoder.layer." in n]


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_logits_loss_gradients_and_training(family):
    ref = make(family)
    model = copy.deepcopy(ref)
    accelerate(model)
    ids, mask, labels = batch()
    real = mask.bool()
    with torch.no_grad():
        got, want = model(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits
    assert rel_error(got[real], want[real]) <= rel_tol(torch.float32, 10)
    train_alongside(model, ref, dict(input_ids=ids, attention_mask=mask, labels=labels), 1e-2,
                    rel_tol(torch.float32, 100), lambda m, r: hf_grads_close(m, r, rel_tol(torch.float32, 100)))
    values = hf_named_tensors(model, "data")
    for n, q in ref.named_parameters():
        assert rel_error(values[n], q.detach()) <= 1e-3, n


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_within_twice_plain_transformers_error(family):
    ref32 = make(family)
    ref16 = copy.deepcopy(ref32).to(torch.bfloat16)
    model = copy.deepcopy(ref16)
    assert len(accelerate(model).fused) == 2
    check_bf16_within_twice_plain(ref32, model, *batch(s=16))


def test_dropout_trains_and_eval_is_deterministic():
    """With BERT's default dropouts (0.1 on the attention probabilities and on
    both residual branches) the fused layer trains (finite loss and
    gradients, the loss differing between two training calls) and eval mode
    matches the plain model."""
    ref = make("Bert", hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    model = copy.deepcopy(ref)
    accelerate(model)
    ids, mask, labels = batch()
    model.train()
    a, b = (model(ids, attention_mask=mask, labels=labels).loss for _ in range(2))
    assert torch.isfinite(a) and a.item() != b.item()
    a.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    model.eval(), ref.eval()
    with torch.no_grad():
        got, want = model(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits
    assert rel_error(got[mask.bool()], want[mask.bool()]) <= rel_tol(torch.float32, 10)


def test_residual_dropout_placement_matches_transformers():
    """Dropout p=1 on both residual branches (attention dropout 0): each
    branch is dropped entirely, so the fused layer must give exactly
    transformers' LN2(LN1(x)) path; a dropout placed elsewhere would not."""
    ref = make("Bert", hidden_dropout_prob=1.0, attention_probs_dropout_prob=0.0)
    model = copy.deepcopy(ref)
    accelerate(model)
    ids, mask, _ = batch()
    ref.train(), model.train()
    with torch.no_grad():
        got, want = model(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits
    assert rel_error(got[mask.bool()], want[mask.bool()]) <= rel_tol(torch.float32, 10)


def test_state_dict_save_pretrained_pickle(tmp_path):
    ref = make("Bert")
    model = copy.deepcopy(ref)
    accelerate(model)
    sd, want = model.state_dict(), ref.state_dict()
    assert list(sd) == list(want)
    assert all(torch.equal(sd[k], want[k]) for k in want)
    ids, mask, labels = batch()
    model(ids, attention_mask=mask, labels=labels).loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    model.save_pretrained(tmp_path)
    plain = transformers.BertForMaskedLM.from_pretrained(tmp_path)
    trained = hf_named_tensors(model, "data")
    for n, p in plain.named_parameters():
        assert torch.equal(p, trained[n]), n
    with torch.no_grad():
        assert rel_error(plain(ids).logits, model(ids).logits) <= rel_tol(torch.float32, 10)
    fresh = copy.deepcopy(ref)
    accelerate(fresh)
    fresh.load_state_dict(plain.state_dict())  # transformers' keys into the fused layers
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, model(ids).logits)
    import seqfuse.hf.fuse_encoder as fuse_encoder

    buf = io.BytesIO()
    torch.save(model, buf)
    fuse_encoder.__dict__.pop("SeqfuseBertLayer")  # as in a process that has not fused a BERT yet
    fuse_encoder._FUSED_CLASSES.clear()
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert type(encoder_layers(loaded)[0]).__name__ == "SeqfuseBertLayer"
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_layers_left_with_reasons():
    model = make("Bert", hidden_act="quick_gelu")
    report = accelerate(model)
    assert report.fused == []
    text = str(report)
    assert "bert.encoder.layer.0" in report.left_names() and "activation QuickGELUActivation" in text
    dec = make("Bert", is_decoder=True)
    text = str(accelerate(dec))
    assert "a decoder / cross-attention layer" in text
    model = make("Bert")
    encoder_layers(model)[1].output.dense.register_forward_hook(lambda *a: None)
    report = accelerate(model)
    assert report.fused_names() == ["bert.encoder.layer.0"] and "has hooks" in str(report)


def test_fused_layer_refuses_what_it_cannot_compute():
    model = make("Bert")
    accelerate(model)
    ids, mask, _ = batch()
    with pytest.raises(NotImplementedError, match="output_attentions=True is not supported"):
        model(ids, attention_mask=mask, output_attentions=True)
    layer = encoder_layers(model)[0]
    x = torch.randn(2, 5, 64)
    with pytest.raises(NotImplementedError, match="cross-attention inputs and key caches are not supported"):
        layer(x, encoder_hidden_states=x)


@needs_fp8
@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_fp8_trains_on_cpu(recipe_name):
    """FP8 through the fused encoder layers on the CPU backend: the loss
    within 2 % of the float32 model's over three AdamW steps, gradients
    under transformers' names within 25 % (E5M2 gradients)."""
    from seqfuse.common.recipe import DelayedScaling, Float8CurrentScaling

    recipe = DelayedScaling() if recipe_name == "delayed" else Float8CurrentScaling()
    ref = make("Bert", hidden_size=64, intermediate_size=128)
    model = copy.deepcopy(ref)
    report = accelerate(model, recipe=recipe)
    assert len(report.fused) == 2, str(report)
    ids, mask, labels = batch(s=16)
    train_alongside(model, ref, dict(input_ids=ids, attention_mask=mask, labels=labels), 1e-3, 0.02,
                    hf_fp8_grads_close)


@pytest.mark.cuda
@pytest.mark.parametrize("recipe_name", [None, "delayed"])
def test_cuda_bert_bf16_and_fp8(recipe_name):
    """On the GPU: a bf16 BERT accelerate()d, bf16 and FP8 delayed, trains
    with dropout on: the loss finite and near plain bf16 transformers' (bf16
    within 2 % with dropout's different random numbers, FP8 within 5 %),
    every gradient finite."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from seqfuse.common.recipe import DelayedScaling

    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=512, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=1024, max_position_embeddings=512)
    ref = transformers.BertForMaskedLM(cfg).to("cuda", torch.bfloat16)
    model = copy.deepcopy(ref)
    report = accelerate(model, recipe=DelayedScaling() if recipe_name else None)
    assert len(report.fused) == 2, str(report)
    ids = torch.randint(3, 512, (4, 256), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, 200:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(3):
        out = model(ids, attention_mask=mask, labels=labels)
        ref.eval(), model.eval()
        with torch.no_grad():
            want = ref(ids, attention_mask=mask, labels=labels).loss.float()
            got = model(ids, attention_mask=mask, labels=labels).loss.float()
        ref.train(), model.train()
        assert torch.isfinite(out.loss)
        assert abs(got - want) <= (0.05 if recipe_name else 0.02) * want, (got, want)
        out.loss.backward()
        for n, p in model.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), n
        opt.step()
        opt.zero_grad()
        missing, unexpected = ref.load_state_dict(model.state_dict(), strict=False)
        assert not missing and all(".fp8_state." in k for k in unexpected), unexpected[:4]
