"""seqfuse.hf.accelerate on transformers models (BERT, Llama, GPT-2 tiny random
configs): what is swapped, what is left and why, tied weights, and outputs
and gradients against the untouched original.

The walk/report logic is also tested with stand-in modules (plain torch
Linear/LayerNorm under seqfuse's constructor signature) so it is covered even
where seqfuse.pytorch.Linear/LayerNorm are not built; the real-module tests
skip until those exist."""
import copy
import importlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

transformers = pytest.importorskip("transformers")

import seqfuse.pytorch  # noqa: E402
from seqfuse.hf import accelerate  # noqa: E402
from seqfuse.hf.fuse_layers import hf_named_tensors  # noqa: E402
from helpers import rel_error, rel_tol  # noqa: E402

# The module (the package exports the function under the same name).
accelerate_mod = importlib.import_module("seqfuse.hf.accelerate")


class StandInLinear(nn.Module):
    def __init__(self, in_features, out_features, bias=True, params_dtype=None, device=None, init_method=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=params_dtype, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=params_dtype, device=device)) if bias else None

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class StandInLayerNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-5, params_dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=params_dtype, device=device))
        self.bias = nn.Parameter(torch.empty(hidden_size, dtype=params_dtype, device=device))

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class StandInRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-5, zero_centered_gamma=False, params_dtype=None, device=None):
        super().__init__()
        self.eps, self.zero_centered_gamma = eps, zero_centered_gamma
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=params_dtype, device=device))

    def forward(self, x):
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (self.weight.float() + (1.0 if self.zero_centered_gamma else 0.0))).to(x.dtype)


@pytest.fixture
def stand_ins(monkeypatch):
    monkeypatch.setattr(accelerate_mod, "_seqfuse_modules", lambda: (StandInLinear, StandInLayerNorm))
    monkeypatch.setattr(accelerate_mod, "_seqfuse_rmsnorm", lambda: StandInRMSNorm)
    return StandInLinear, StandInLayerNorm


def bert():
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=37, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForMaskedLM(cfg).eval()


def llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=99, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    return transformers.LlamaForCausalLM(cfg).eval()


def gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=99, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                  bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def count(model, cls):
    return sum(1 for m in model.modules() if type(m) is cls)


def check_bert(model, report, Linear, LayerNorm):
    assert count(model, nn.Linear) == 0 and count(model, nn.LayerNorm) == 0
    assert count(model, Linear) == 2 * 6 + 2 and count(model, LayerNorm) == 1 + 2 * 2 + 1
    assert "bert.encoder.layer.1.attention.self.query" in report.swapped_names()
    assert "cls.predictions.decoder" in report.swapped_names()
    # Tied weights stay tied: decoder weight = word embeddings, decoder bias = head bias.
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
    assert model.cls.predictions.decoder.bias is model.cls.predictions.bias
    assert "embedding" in report.reason("bert.embeddings.word_embeddings")
    assert "bias" in report.reason("cls.predictions")
    assert set(report.left_names()) == {"bert.embeddings.word_embeddings", "bert.embeddings.position_embeddings",
                                        "bert.embeddings.token_type_embeddings", "cls.predictions"}


def check_llama(model, report, Linear, LayerNorm):
    assert count(model, nn.Linear) == 0
    assert count(model, Linear) == 2 * 7 + 1
    # the model's own RMSNorm class computes what seqfuse's does: all 5 swapped (probe-checked)
    assert not [n for n, m in model.named_modules() if type(m).__name__ == "LlamaRMSNorm"]
    norms = [s.name for s in report.swapped if s.original == "LlamaRMSNorm"]
    assert len(norms) == 5 and "model.norm" in norms
    assert "embedding" in report.reason("model.embed_tokens")


def check_gpt2(model, report, Linear, LayerNorm):
    conv = [n for n, m in model.named_modules() if type(m).__name__ == "Conv1D"]
    assert len(conv) == 2 * 4
    for n in conv:
        assert "Conv1D" in report.reason(n) and "transposed" in report.reason(n)
    assert count(model, nn.LayerNorm) == 0 and count(model, LayerNorm) == 2 * 2 + 1
    assert "lm_head" in report.swapped_names()
    assert model.lm_head.weight is model.transformer.wte.weight


MODELS = {"bert": (bert, check_bert), "llama": (llama, check_llama), "gpt2": (gpt2, check_gpt2)}


def run_and_compare(make, check, Linear, LayerNorm, tol):
    model = make()
    ref = copy.deepcopy(model)
    params_before = {id(p) for p in model.parameters()}
    # the module-by-module walk (whole-layer fusion and the fused loss: test_hf_accelerate_fused.py)
    report = accelerate(model, fuse_layers=False, fused_loss=False)
    # Attention goes through seqfuse's fused kernel too.
    assert "config._attn_implementation" in report.swapped_names()
    assert model.config._attn_implementation == "seqfuse"
    # The same Parameter objects, none new, none lost.
    assert {id(p) for p in model.parameters()} == params_before
    check(model, report, Linear, LayerNorm)
    torch.manual_seed(1)
    ids = torch.randint(3, 99, (2, 11))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    labels = ids.masked_fill(mask == 0, -100)  # padded positions: no prediction to compare
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    exp = ref(input_ids=ids, attention_mask=mask, labels=labels)
    real = mask.bool()
    assert rel_error(out.logits[real], exp.logits[real]) <= tol
    assert abs(out.loss.item() - exp.loss.item()) <= tol * 10 * exp.loss.item()
    out.loss.backward()
    exp.loss.backward()
    ref_params = dict(ref.named_parameters())
    grad_scale = max(q.grad.double().norm().item() for q in ref.parameters() if q.grad is not None)
    for name, p in model.named_parameters():
        # Swapped modules may not rename parameters: names map one to one.
        q = ref_params[name]
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            if q.grad.double().norm().item() <= 1e-9 * grad_scale:
                # zero in exact arithmetic (the key bias under softmax): both sides hold
                # rounding noise whose relative difference means nothing
                assert p.grad.double().norm().item() <= 1e-8 * grad_scale, name
            else:
                assert rel_error(p.grad, q.grad) <= tol * 10, name
    return report


@pytest.mark.parametrize("name", sorted(MODELS))
def test_accelerate_logic_with_stand_ins(name, stand_ins):
    make, check = MODELS[name]
    report = run_and_compare(make, check, *stand_ins, tol=1e-6)
    text = str(report)
    assert "swapped" in text and "left" in text


@pytest.mark.parametrize("name", sorted(MODELS))
def test_accelerate_real_modules(name):
    make, check = MODELS[name]
    run_and_compare(make, check, seqfuse.pytorch.Linear, seqfuse.pytorch.LayerNorm, tol=1e-5)


class MyLinear(nn.Linear):
    pass


class Odd(nn.Module):
    def __init__(self):
        super().__init__()
        self.sub = MyLinear(16, 16)
        self.f64 = nn.Linear(16, 16).double()
        self.hooked = nn.Linear(16, 16)
        self.hooked.register_forward_hook(lambda m, i, o: o)
        self.no_affine = nn.LayerNorm(16, elementwise_affine=False)
        self.no_bias = nn.LayerNorm(16, bias=False)
        self.two_d = nn.LayerNorm((4, 16))
        self.sub_norm = type("MyLayerNorm", (nn.LayerNorm,), {})(16)
        self.hooked_norm = nn.LayerNorm(16)
        self.hooked_norm.register_forward_pre_hook(lambda m, i: None)
        self.unaligned = nn.Linear(16, 24)
        self.shared = nn.Linear(16, 32)
        self.inner = nn.Sequential(self.shared)
        self.scale = nn.Parameter(torch.ones(3))


def test_edge_cases_are_left_with_reasons(stand_ins, monkeypatch):
    Linear, LayerNorm = stand_ins
    m = Odd()
    report = accelerate(m)
    assert "subclasses nn.Linear" in report.reason("sub")
    # Linear and LayerNorm share one check (a subclass, then hooks and the other common reasons)
    assert report.reason("sub_norm") == ("MyLayerNorm subclasses nn.LayerNorm with its own behaviour; "
                                         "only plain nn.LayerNorm is swapped")
    assert report.reason("sub").startswith("MyLinear subclasses nn.Linear with its own behaviour; only plain nn.Linear")
    assert "hooks" in report.reason("hooked_norm")
    assert "float64" in report.reason("f64")
    assert "hooks" in report.reason("hooked")
    assert "elementwise_affine=False" in report.reason("no_affine")
    assert "bias=False" in report.reason("no_bias")
    assert "last 2 dimensions" in report.reason("two_d")
    assert "scale" in report.reason("")
    assert set(report.swapped_names()) == {"unaligned", "shared"}
    # A module reachable from two parents is replaced in both.
    assert m.inner[0] is m.shared and type(m.shared) is Linear

    # Under a low-precision recipe, shapes its GEMMs cannot take are left.
    wrapped = []
    monkeypatch.setattr(accelerate_mod, "_wrap_forward", lambda model, recipe: wrapped.append(recipe))

    from seqfuse.common.recipe import DelayedScaling, MXFP8BlockScaling

    m = Odd()
    report = accelerate(m, recipe=DelayedScaling())
    assert "divisible by 16" in report.reason("unaligned") and "(16, 24)" in report.reason("unaligned")
    assert "shared" in report.swapped_names()
    m = Odd()
    report = accelerate(m, recipe=MXFP8BlockScaling())
    assert "divisible by 32" in report.reason("shared")
    # block scaling's 128-wide blocks: a 16 x 32 Linear would be refused when it runs, so it is left
    from seqfuse.common.recipe import Float8BlockScaling

    m = Odd()
    report = accelerate(m, recipe=Float8BlockScaling())
    assert "divisible by 128" in report.reason("shared")
    assert len(wrapped) == 3
    with pytest.raises(TypeError, match="argument 'recipe' must be a seqfuse.common.recipe recipe"):
        accelerate(Odd(), recipe="fp8")


def test_accelerate_bad_input():
    with pytest.raises(TypeError, match="nn.Module"):
        accelerate("not a model")


def test_recipe_runs_forward_under_autocast(stand_ins):
    from seqfuse.common.recipe import DelayedScaling
    from seqfuse.quantization import is_fp8_enabled

    seen = []

    class Probe(nn.Module):
        def forward(self, x):
            seen.append(is_fp8_enabled())
            return x

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(32, 32)
            self.probe = Probe()

        def forward(self, x):
            return self.probe(self.fc(x))

    net = Net()
    recipe = DelayedScaling()
    report = accelerate(net, recipe=recipe)
    assert report.recipe is recipe and "recipe" in str(report)
    net(torch.randn(4, 32))
    assert seen == [True] and not is_fp8_enabled()


def test_second_accelerate_keeps_the_first_recipe(stand_ins):
    """A second accelerate() without a recipe keeps the first call's: the
    forward stays under it and a Linear its GEMMs cannot take stays left
    (swapped, it would raise under the first call's autocast)."""
    from seqfuse.common.recipe import DelayedScaling, Float8CurrentScaling

    net = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 24))
    recipe = DelayedScaling()
    accelerate(net, recipe=recipe)
    again = accelerate(net)
    assert again.recipe is recipe and "divisible by 16" in again.reason("1") and type(net[1]) is nn.Linear
    assert accelerate(net, recipe=DelayedScaling()).recipe is recipe  # an equal recipe: the same
    with pytest.raises(ValueError, match="argument 'recipe' is Float8CurrentScaling"):
        accelerate(net, recipe=Float8CurrentScaling())


def test_recipe_after_a_first_accelerate_without_one_is_refused(stand_ins):
    """A first accelerate() without a recipe swapped modules without FP8's
    size rules: a second call with a recipe is refused by name (the swapped
    Linear [32 -> 24] would raise under its autocast)."""
    from seqfuse.common.recipe import DelayedScaling

    net = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 24))
    assert accelerate(net).recipe is None
    with pytest.raises(ValueError, match="argument 'recipe' is DelayedScaling.*had none"):
        accelerate(net, recipe=DelayedScaling())
    assert accelerate(net).recipe is None


@pytest.mark.parametrize("name", sorted(MODELS))
def test_checkpoint_still_loads_into_original_class(name, stand_ins, tmp_path):
    """After the swap, parameter names are unchanged: save_pretrained writes a
    checkpoint the original transformers class loads, weights identical."""
    make, _ = MODELS[name]
    model = make()
    accelerate(model)
    model.save_pretrained(tmp_path)
    fresh = type(model).from_pretrained(tmp_path)
    a, b = model.state_dict(), fresh.state_dict()
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_dtype_and_training_mode_kept(stand_ins):
    model = llama().to(torch.bfloat16).train()
    accelerate(model, fuse_layers=False)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    q = model.model.layers[0].self_attn.q_proj
    assert type(q) is stand_ins[0] and q.training


def test_attention_left_with_reasons(stand_ins):
    model = bert()
    model._supports_attention_backend = False  # as models with their own attention code declare
    before = model.config._attn_implementation
    report = accelerate(model)
    assert "_supports_attention_backend is False" in report.reason("config._attn_implementation")
    assert model.config._attn_implementation == before
    model = bert()
    before = model.config._attn_implementation
    report = accelerate(model, attention=False)
    assert model.config._attn_implementation == before
    assert "config._attn_implementation" not in report.swapped_names() + report.left_names()


def test_attention_function_refuses_what_it_cannot_compute():
    from seqfuse.hf.attention import seqfuse_attention_forward

    class M(nn.Module):
        is_causal = False

    q = torch.randn(2, 4, 6, 8)
    holes = torch.tensor([[1, 1, 0, 1, 1, 1], [1] * 6], dtype=torch.bool)
    with pytest.raises(NotImplementedError, match="holes"):
        seqfuse_attention_forward(M(), q, q, q, holes)
    with pytest.raises(NotImplementedError, match="custom mask"):
        seqfuse_attention_forward(M(), q, q, q, torch.ones(2, 1, 6, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="sliding_window must be a positive int"):
        seqfuse_attention_forward(M(), q, q, q, None, sliding_window=0)
    with pytest.raises(NotImplementedError, match="soft-capping"):
        seqfuse_attention_forward(M(), q, q, q, None, softcap=30.0)
    # Right padding and GQA work: compare with torch.
    k = torch.randn(2, 2, 6, 8)
    mask = torch.tensor([[1] * 6, [1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    out, _ = seqfuse_attention_forward(M().eval(), q, k, k, mask, scaling=0.3)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), k.repeat_interleave(2, 1),
                                         attn_mask=mask[:, None, None, :], scale=0.3).transpose(1, 2)
    assert rel_error(out[0], ref[0]) <= 1e-5 and rel_error(out[1, :4], ref[1, :4]) <= 1e-5


@pytest.mark.cuda
@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_accelerate_cuda_bf16_llama(family):
    """A Llama-shaped model (head dim 64, GQA) in bf16 on the GPU, and the same
    as Mistral with a 64-token sliding window over 256 tokens: every Linear,
    and attention, through seqfuse; logits and loss against the untouched model
    with right padding, then left padding and a decode step on its key cache."""
    torch.manual_seed(0)
    shape = dict(vocab_size=512, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                 num_attention_heads=16, num_key_value_heads=4)
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape))
    else:
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**shape, sliding_window=64))
    model = model.to("cuda", torch.bfloat16).eval()
    ref = copy.deepcopy(model)
    report = accelerate(model)
    assert "config._attn_implementation" in report.swapped_names(), str(report)
    ids = torch.randint(0, 512, (4, 256), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, 200:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        exp = ref(input_ids=ids, attention_mask=mask, labels=labels)
    real = mask.bool()
    assert rel_error(out.logits[real], exp.logits[real]) <= 2e-2
    assert abs(out.loss.item() - exp.loss.item()) <= 1e-2 * exp.loss.item()
    # left padding (packed thd runs on the GPU), and one greedy step on from it through the key cache
    left = torch.ones_like(ids)
    left[0, :56] = 0
    left[3, :3] = 0
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=left, use_cache=True)
        exp = ref(input_ids=ids, attention_mask=left, use_cache=True)
        real = left.bool()
        assert rel_error(out.logits[real], exp.logits[real]) <= 2e-2
        nxt = exp.logits[:, -1:].argmax(-1)
        mask2 = torch.cat((left, torch.ones_like(nxt)), 1)
        step = model(input_ids=nxt, attention_mask=mask2, past_key_values=out.past_key_values).logits
        want = ref(input_ids=nxt, attention_mask=mask2, past_key_values=exp.past_key_values).logits
        assert rel_error(step, want) <= 2e-2


def test_attention_function_dropout_while_training_only():
    """The probability the layer passes goes to the kernel while the module
    trains (the same mask as ops.attention from the same torch seed), and is
    ignored in eval; a bad probability is a ValueError naming dropout_p."""
    from seqfuse.hf.attention import seqfuse_attention_forward

    class M(nn.Module):
        is_causal = False

    q, k, v = (torch.randn(2, 4, 9, 8) for _ in range(3))
    mask = torch.tensor([[1] * 9, [1] * 6 + [0] * 3], dtype=torch.bool)
    plain, _ = seqfuse_attention_forward(M().eval(), q, k, v, mask)
    torch.manual_seed(5)
    dropped, _ = seqfuse_attention_forward(M().train(), q, k, v, mask, dropout=0.3)
    torch.manual_seed(5)
    cu = torch.tensor([0, 9, 15], dtype=torch.int32)
    want = seqfuse.ops.attention(*(t.transpose(1, 2) for t in (q, k, v)), attn_mask_type="padding",
                                 cu_seqlens_q=cu, cu_seqlens_kv=cu, dropout_p=0.3)
    assert torch.equal(dropped, want)
    assert not torch.allclose(dropped[0], plain[0])
    evald, _ = seqfuse_attention_forward(M().eval(), q, k, v, mask, dropout=0.3)
    assert torch.equal(evald, plain)
    with pytest.raises(ValueError, match="dropout_p"):
        seqfuse_attention_forward(M().train(), q, k, v, mask, dropout=1.5)


@pytest.mark.parametrize("fuse_layers", [True, False])
def test_accelerate_bert_with_attention_dropout(fuse_layers):
    """BERT's default attention dropout (0.1) no longer keeps its attention in
    torch: accelerate switches it; in eval the model matches the original,
    in training the same seed gives the same loss and another seed another
    one, and gradients reach every parameter the original's do."""
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=37, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.1)
    model = transformers.BertForMaskedLM(cfg).eval()
    ref = copy.deepcopy(model)
    report = accelerate(model, fuse_layers=fuse_layers)
    assert "config._attn_implementation" in report.swapped_names()
    assert len(report.fused) == (2 if fuse_layers else 0)
    ids = torch.randint(3, 99, (2, 11))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    real = mask.bool()
    out = model(input_ids=ids, attention_mask=mask).logits
    exp = ref(input_ids=ids, attention_mask=mask).logits
    assert rel_error(out[real], exp[real]) <= 1e-5
    model.train()
    losses = []
    for seed in (3, 3, 4):
        torch.manual_seed(seed)
        losses.append(model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(~real, -100)).loss)
    assert losses[0].item() == losses[1].item() != losses[2].item()
    losses[0].backward()
    ref.train()
    ref(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(~real, -100)).loss.backward()
    from seqfuse.hf.fuse_layers import hf_named_tensors

    grads = hf_named_tensors(model)  # (under transformers' names, also for fused layers)
    for name, q in ref.named_parameters():
        assert (grads[name] is None) == (q.grad is None), name
        if q.grad is not None:
            assert torch.isfinite(grads[name]).all(), name


@pytest.mark.parametrize("causal", [True, False])
def test_attention_function_sliding_window(causal):
    """transformers' sliding_window W (flash-attention semantics: the W keys
    up to the query when causal, W - 1 either side when not) against SDPA
    with that mask written out, with right padding and GQA."""
    from seqfuse.hf.attention import seqfuse_attention_forward

    class M(nn.Module):
        is_causal = causal

    torch.manual_seed(2)
    q = torch.randn(2, 4, 13, 8)
    k, v = torch.randn(2, 2, 13, 8), torch.randn(2, 2, 13, 8)
    keep = torch.ones(2, 13, dtype=torch.bool)
    keep[1, 10:] = False
    w = 4
    out, _ = seqfuse_attention_forward(M().eval(), q, k, v, keep, sliding_window=w)
    i, j = torch.arange(13)[:, None], torch.arange(13)[None, :]
    allowed = (j > i - w) & ((j <= i) if causal else (j < i + w))
    mask = allowed[None, None] & keep[:, None, None, :]
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                         attn_mask=mask).transpose(1, 2)
    assert rel_error(out[0], ref[0]) <= 1e-5 and rel_error(out[1, :10], ref[1, :10]) <= 1e-5


def mistral():
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(vocab_size=99, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                     sliding_window=4, head_dim=8)
    return transformers.MistralForCausalLM(cfg).eval()


def test_accelerate_mistral_sliding_window():
    """A sliding-window model (Mistral, window 4 over 11 tokens, so the window
    matters) is switched to seqfuse's attention and matches the original in
    logits, loss and gradients."""
    def check(model, report, Linear, LayerNorm):
        assert model.config.sliding_window == 4
        assert not [n for n, m in model.named_modules() if type(m) is nn.Linear]

    run_and_compare(mistral, check, seqfuse.pytorch.Linear, seqfuse.pytorch.LayerNorm, tol=1e-5)


def _packed_case(lengths, h=4, g=2, d=8, seed=3):
    torch.manual_seed(seed)
    n = sum(lengths)
    q, k, v = torch.randn(1, h, n, d), torch.randn(1, g, n, d), torch.randn(1, g, n, d)
    pos = torch.cat([torch.arange(m) for m in lengths])[None]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    return q, k, v, pos, cu


@pytest.mark.parametrize("causal", [True, False])
def test_attention_function_packed_batches(causal):
    """transformers' padding-free packing (one row, sequences concatenated):
    from restarting position ids and from cu_seq_lens keywords, the output of
    each sequence equals attention over that sequence alone (no attention
    across the boundaries), with GQA and a sliding window."""
    from seqfuse.hf.attention import seqfuse_attention_forward

    class M(nn.Module):
        is_causal = causal

    lengths = [5, 7, 1, 4]
    q, k, v, pos, cu = _packed_case(lengths)
    for kw in (dict(position_ids=pos),
               dict(position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=7, max_length_k=7)):
        for window in (None, 3):
            out, _ = seqfuse_attention_forward(M().eval(), q, k, v, None, sliding_window=window, **kw)
            assert out.shape == (1, sum(lengths), 4, 8)
            start = 0
            for m in lengths:
                sl = slice(start, start + m)
                alone, _ = seqfuse_attention_forward(M().eval(), q[:, :, sl], k[:, :, sl], v[:, :, sl], None,
                                                     sliding_window=window)
                assert rel_error(out[:, sl], alone) <= 1e-6, (kw.keys(), window, m)
                start += m


def test_attention_function_packed_refusals():
    from seqfuse.hf.attention import seqfuse_attention_forward

    class M(nn.Module):
        is_causal = True

    q, k, v, pos, cu = _packed_case([5, 7])
    with pytest.raises(NotImplementedError, match="count up by one"):
        seqfuse_attention_forward(M(), q, k, v, None, position_ids=torch.tensor([[0, 1, 2, 4, 5, 0, 1, 2, 3, 4, 5, 6]]))
    holes = torch.ones(1, 12, dtype=torch.bool)
    holes[0, -1] = False
    with pytest.raises(NotImplementedError, match="padding mask"):
        seqfuse_attention_forward(M(), q, k, v, holes, position_ids=pos)
    with pytest.raises(ValueError, match="come together"):
        seqfuse_attention_forward(M(), q, k, v, None, cu_seq_lens_q=cu)
    # one sequence counting up from 0 is not packed: the plain path, same answer
    one, _ = seqfuse_attention_forward(M(), q, k, v, None, position_ids=torch.arange(12)[None])
    plain, _ = seqfuse_attention_forward(M(), q, k, v, None)
    assert torch.equal(one, plain)


def test_accelerate_llama_packed_batch_matches_sequences_alone():
    """A tiny Llama after accelerate(), fed three sequences packed into one
    row with restarting position ids (DataCollatorWithFlattening's format):
    each sequence's logits equal the untouched model's on that sequence alone."""
    model = llama()
    ref = copy.deepcopy(model)
    accelerate(model)
    torch.manual_seed(4)
    seqs = [torch.randint(3, 99, (m,)) for m in (6, 9, 4)]
    ids = torch.cat(seqs)[None]
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=pos).logits[0]
        start = 0
        for s in seqs:
            alone = ref(input_ids=s[None]).logits[0]
            assert rel_error(packed[start:start + len(s)], alone) <= 1e-5
            start += len(s)


@pytest.mark.parametrize("causal", [True, False])
def test_attention_function_left_and_both_sided_padding(causal):
    """Rows padded on the left, on both sides, on the right, not at all and
    entirely: every real token's output equals SDPA's with the padding masked
    out (GQA; and with a sliding window), whatever the padding computes."""
    from seqfuse.hf.attention import seqfuse_attention_forward

    class M(nn.Module):
        is_causal = causal

    torch.manual_seed(6)
    s = 10
    q, k, v = torch.randn(5, 4, s, 8), torch.randn(5, 2, s, 8), torch.randn(5, 2, s, 8)
    keep = torch.zeros(5, s, dtype=torch.bool)
    keep[0, 3:] = True      # left
    keep[1, 2:7] = True     # both sides
    keep[2, :6] = True      # right
    keep[3, :] = True       # none
    # row 4: all padding
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    for window in (None, 3):
        out, _ = seqfuse_attention_forward(M().eval(), q, k, v, keep, sliding_window=window)
        assert out.shape == (5, s, 4, 8) and torch.isfinite(out).all()
        allowed = torch.ones(s, s, dtype=torch.bool)
        if causal:
            allowed &= j <= i
        if window:
            allowed &= (j > i - window) & (j < i + window)
        for r in range(4):
            m = allowed[None] & keep[r][None, None, :]
            ref = F.scaled_dot_product_attention(q[r:r + 1], k[r:r + 1].repeat_interleave(2, 1),
                                                 v[r:r + 1].repeat_interleave(2, 1), attn_mask=m[None])
            real = keep[r]
            assert rel_error(out[r][real], ref.transpose(1, 2)[0][real]) <= 1e-5, (r, window)


def test_accelerate_llama_left_padded_batch():
    """A tiny Llama after accelerate() on a left-padded batch (how decoder
    tokenizers often pad): logits of the real tokens, loss and gradients as
    the untouched model's.  Outputs at padding positions are defined by no
    implementation (here the padding attends among itself), so the label a
    causal LM would predict from a padding position (each row's first token)
    is masked too."""
    model = llama().train()  # no dropout in this config: train() only selects the fused loss (training calls)
    ref = copy.deepcopy(model)
    accelerate(model)
    torch.manual_seed(7)
    ids = torch.randint(3, 99, (3, 12))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    mask[2, :1] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, 5] = labels[2, 1] = -100  # predicted from a padding position
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    exp = ref(input_ids=ids, attention_mask=mask, labels=labels)
    assert out.logits is None  # the fused loss makes no logits; a call without labels does
    real = mask.bool()
    logits = model(input_ids=ids, attention_mask=mask).logits
    assert rel_error(logits[real], exp.logits[real]) <= 1e-5
    assert abs(out.loss.item() - exp.loss.item()) <= 1e-5 * exp.loss.item()
    out.loss.backward()
    exp.loss.backward()
    grads = hf_named_tensors(model)  # the fused layers' gradients under transformers' names
    for name, q in ref.named_parameters():
        if q.grad is not None and q.grad.norm() > 0:
            assert rel_error(grads[name], q.grad) <= 1e-4, name


@pytest.mark.parametrize("window", [None, 3])
def test_attention_function_padded_queries_against_a_key_cache(window):
    """Generation: the last s_q of s_kv positions query a key cache whose
    rows are padded on the left (or not at all): every real query's output
    equals SDPA's with the padding masked and causality aligned bottom-right."""
    from seqfuse.hf.attention import seqfuse_attention_forward

    class M(nn.Module):
        is_causal = True

    torch.manual_seed(8)
    s_kv = 9
    keep = torch.ones(3, s_kv, dtype=torch.bool)
    keep[0, :4] = False
    keep[2, :8] = False
    k, v = torch.randn(3, 2, s_kv, 8), torch.randn(3, 2, s_kv, 8)
    for s_q in (1, 3):
        q = torch.randn(3, 4, s_q, 8)
        out, _ = seqfuse_attention_forward(M().eval(), q, k, v, keep, sliding_window=window)
        i = torch.arange(s_kv - s_q, s_kv)[:, None]  # the queries' positions
        j = torch.arange(s_kv)[None, :]
        allowed = (j <= i) & ((j > i - window) if window else True)
        for r in range(3):
            m = allowed[None, None] & keep[r][None, None, None, :]
            ref = F.scaled_dot_product_attention(q[r:r + 1], k[r:r + 1].repeat_interleave(2, 1),
                                                 v[r:r + 1].repeat_interleave(2, 1), attn_mask=m)
            real = keep[r, s_kv - s_q:]
            assert rel_error(out[r][real], ref.transpose(1, 2)[0][real]) <= 1e-5, (s_q, r)


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_accelerate_generate_left_padded_batch(family):
    """model.generate on a left-padded batch (one row padded on 6 of 7
    positions), greedy: the same tokens as the untouched model, with a key
    cache, and for Mistral a sliding window shorter than the prompt."""
    torch.manual_seed(0)
    shape = dict(vocab_size=99, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape)).eval()
    else:
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**shape, sliding_window=3,
                                                                            head_dim=8)).eval()
    ref = copy.deepcopy(model)
    report = accelerate(model)
    assert "config._attn_implementation" in report.swapped_names()
    ids = torch.randint(3, 99, (3, 7))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[2, :6] = 0
    ids = ids.masked_fill(mask == 0, 0)
    got = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, want)


class ZeroCenteredRMSNorm(nn.Module):
    """Gemma's form: x / rms(x) * (1 + weight), in float32, eps as ``eps``."""

    def __init__(self, n, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(n))

    def forward(self, x):
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


class EpsOutsideNorm(nn.Module):
    """Not RMSNorm: eps added outside the square root."""

    def __init__(self, n):
        super().__init__()
        self.variance_epsilon = 1e-2
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x):
        return self.weight * x / (x.pow(2).mean(-1, keepdim=True).sqrt() + self.variance_epsilon)


class BiasedNorm(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.eps = 1e-5
        self.weight = nn.Parameter(torch.ones(n))
        self.bias = nn.Parameter(torch.zeros(n))

    def forward(self, x):
        return x * self.weight + self.bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_rmsnorm_classes_swapped_only_when_the_probe_agrees(dtype):
    """Gemma-style zero-centred RMSNorm becomes seqfuse's RMSNorm with
    zero_centered_gamma (the same Parameter, the same outputs); a norm with
    eps outside the root, and one with a bias, are left with the reason."""
    torch.manual_seed(0)
    model = nn.Sequential(ZeroCenteredRMSNorm(64), nn.ReLU(), EpsOutsideNorm(64), BiasedNorm(64)).to(dtype)
    with torch.no_grad():
        model[0].weight.normal_()
    ref = copy.deepcopy(model)
    w0 = model[0].weight
    report = accelerate(model, attention=False)
    assert type(model[0]) is seqfuse.pytorch.RMSNorm and model[0].zero_centered_gamma
    assert model[0].weight is w0
    assert "does not compute what seqfuse's RMSNorm computes" in report.reason("2")
    assert "holds parameter(s) ['weight', 'bias']" in report.reason("3")
    x = torch.randn(4, 7, 64).to(dtype)
    tol = rel_tol(dtype)
    assert rel_error(model[0](x), ref[0](x)) <= tol
    assert rel_error(model(x), ref(x)) <= tol


def test_accelerate_gemma_zero_centered_rmsnorm():
    """Gemma (RMSNorm with 1 + weight, GQA): every GemmaRMSNorm becomes
    seqfuse's RMSNorm with zero-centred gamma, and the model matches the
    original in logits, loss and gradients."""
    def gemma():
        torch.manual_seed(0)
        cfg = transformers.GemmaConfig(vocab_size=99, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8)
        model = transformers.GemmaForCausalLM(cfg).eval()
        with torch.no_grad():  # Gemma initialises the norm weights to 0 (gamma 1): make them matter
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.normal_(0, 0.3)
        return model

    def check(model, report, Linear, LayerNorm):
        swapped = [s for s in report.swapped if s.original == "GemmaRMSNorm"]
        assert len(swapped) == 5
        assert all(m.zero_centered_gamma for m in model.modules() if type(m) is seqfuse.pytorch.RMSNorm)

    run_and_compare(gemma, check, seqfuse.pytorch.Linear, seqfuse.pytorch.LayerNorm, tol=1e-5)


def _counting_layouts(monkeypatch):
    """seqfuse.hf.attention with an empty mask-layout cache whose computations
    are counted, a causal stand-in module, and the list of counts."""
    from seqfuse.hf import attention as att

    class M(nn.Module):
        is_causal = True

    calls = []
    real = att._padding_layout_cached.compute
    monkeypatch.setattr(att._padding_layout_cached, "compute", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(att._padding_layout_cached, "entries", [])
    return att, M, calls


def test_attention_function_reads_a_mask_once_per_tensor(monkeypatch):
    """Every layer gets the same mask tensor: its padding layout (host syncs)
    is worked out once and reused, and worked out again for another tensor or
    after the mask is modified in place."""
    att, M, calls = _counting_layouts(monkeypatch)
    q = torch.randn(2, 4, 6, 8)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[0, :2] = False
    first, _ = att.seqfuse_attention_forward(M(), q, q, q, mask)
    for _ in range(3):  # "layers"
        again, _ = att.seqfuse_attention_forward(M(), q, q, q, mask)
        assert torch.equal(again, first)
    assert len(calls) == 1
    mask[1, :3] = False  # in place: the cached layout is stale
    changed, _ = att.seqfuse_attention_forward(M(), q, q, q, mask)
    assert len(calls) == 2 and not torch.equal(changed[1, 3:], first[1, 3:])
    att.seqfuse_attention_forward(M(), q, q, q, mask.clone())  # another tensor, same values
    assert len(calls) == 3


@pytest.mark.parametrize("order", ["before", "after"])
def test_accelerate_fp8_with_transformers_gradient_checkpointing(order, caplog):
    """accelerate(model, recipe=DelayedScaling()) with transformers' gradient
    checkpointing enabled before or after the swap: the recompute goes
    through seqfuse's checkpoint (torch's would run outside autocast and
    raise), and the losses and gradients equal the run without checkpointing
    bit for bit over 3 steps; a use_reentrant=True request is logged as not taken."""
    import logging

    from seqfuse.common.recipe import DelayedScaling

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    base = transformers.LlamaForCausalLM(cfg).train()

    def run(ck):
        m = copy.deepcopy(base)
        if ck and order == "before":
            m.gradient_checkpointing_enable()
        accelerate(m, recipe=DelayedScaling(amax_history_len=1, amax_compute_algo="most_recent"))
        if ck and order == "after":
            with caplog.at_level(logging.WARNING, logger="seqfuse"):
                m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
            assert any("use_reentrant=True is not taken" in r.getMessage() for r in caplog.records)
        out = []
        for step in range(3):
            ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(step))
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            out.append([loss.detach()] + [p.grad.clone() for p in m.parameters() if p.grad is not None])
            m.zero_grad(set_to_none=True)
        return out

    for a, b in zip(run(False), run(True)):
        assert len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b))



def test_attention_function_refusals_of_packing_and_masks():
    from seqfuse.hf.attention import seqfuse_attention_forward

    class M(nn.Module):
        is_causal = True

    q, k, v, pos, cu = _packed_case([5, 7])
    q2 = torch.cat([q, q])
    with pytest.raises(NotImplementedError, match="come as one row"):
        seqfuse_attention_forward(M(), q2, torch.cat([k, k]), torch.cat([v, v]), None, cu_seq_lens_q=cu,
                                  cu_seq_lens_k=cu)
    with pytest.raises(NotImplementedError, match="key cache"):
        seqfuse_attention_forward(M(), q[:, :, :6], k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    with pytest.raises(ValueError, match="covers 5 keys"):
        seqfuse_attention_forward(M(), q, k, v, torch.ones(1, 5, dtype=torch.bool))


def test_gradient_checkpointing_function_other_than_torchs_is_kept_with_a_warning(caplog):
    import functools
    import logging

    from seqfuse.hf.positions import marked_checkpoint
    from seqfuse.quantization.recompute import checkpoint as sf_checkpoint

    like = accelerate_mod._seqfuse_checkpoint_like
    ck = torch.utils.checkpoint.checkpoint
    assert like(ck) is marked_checkpoint and like(sf_checkpoint) is marked_checkpoint
    routed = like(functools.partial(ck, use_reentrant=False, preserve_rng_state=False))
    assert routed.func is marked_checkpoint and routed.keywords == {"preserve_rng_state": False}
    assert like(routed) is routed
    assert like(functools.partial(sf_checkpoint, preserve_rng_state=False)).func is marked_checkpoint

    def mine(fn, *a, **k):
        return fn(*a, **k)

    with caplog.at_level(logging.WARNING, logger="seqfuse"):
        assert like(mine) is mine
    assert any("is not torch's checkpoint and is kept" in r.getMessage() for r in caplog.records)


class NoEpsRMSNorm(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class FailingNorm(NoEpsRMSNorm):
    eps = 1e-6

    def forward(self, x):
        raise ValueError("only takes 2-D input")


def test_model_norms_without_eps_or_failing_the_probe_are_left():
    model = nn.Sequential(NoEpsRMSNorm(16), FailingNorm(16))
    report = accelerate(model, attention=False)
    assert "has no eps" in report.reason("0")
    assert "probing it against seqfuse's RMSNorm failed (ValueError: only takes 2-D input)" in report.reason("1")
    assert type(model[0]) is NoEpsRMSNorm and type(model[1]) is FailingNorm


def test_attention_function_refuses_attention_sinks():
    """gpt-oss passes s_aux=self.sinks (others sinks=): the fused kernel has no
    sink logit, so the call is refused rather than computing other attention;
    sinks=None (MiMo's full-attention layers) is attention without sinks."""
    from seqfuse.hf.attention import seqfuse_attention_forward

    class M(nn.Module):
        is_causal = True

    q = torch.randn(1, 4, 6, 8)
    sinks = torch.randn(4)
    for name in ("s_aux", "sinks"):
        with pytest.raises(NotImplementedError, match=rf"attention sinks \({name}="):
            seqfuse_attention_forward(M().eval(), q, q, q, None, **{name: sinks})
    out, _ = seqfuse_attention_forward(M().eval(), q, q, q, None, s_aux=None, sinks=None)
    ref = F.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2)
    assert rel_error(out, ref) <= 1e-5


@pytest.mark.skipif(not hasattr(transformers, "GptOssConfig"), reason="transformers without gpt-oss")
def test_accelerate_gpt_oss_attention_sinks_left_in_torch(stand_ins):
    """gpt-oss's attention modules carry a ``sinks`` parameter: accelerate
    leaves the attention implementation as it was, says why, and the model
    computes what the original computes (sinks included)."""
    torch.manual_seed(0)
    cfg = transformers.GptOssConfig(vocab_size=99, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                    num_local_experts=4, num_experts_per_tok=2)
    model = transformers.GptOssForCausalLM(cfg).eval()
    with torch.no_grad():  # large sinks, so attention without them is far off
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0, 3.0)
    ref = copy.deepcopy(model)
    before = model.config._attn_implementation
    report = accelerate(model)
    why = report.reason("config._attn_implementation")
    assert "attention sinks" in why and "model.layers.0.self_attn" in why
    assert model.config._attn_implementation == before
    assert "config._attn_implementation" not in report.swapped_names()
    ids = torch.randint(0, 99, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert rel_error(model(ids).logits, ref(ids).logits) <= 1e-5


class GatedRMSNorm(nn.Module):
    """Mamba2 / Qwen3-Next style: RMSNorm, then times silu(gate) when a gate is given."""

    def __init__(self, n, eps=1e-6):
        super().__init__()
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, hidden_states, gate=None):
        y = hidden_states * torch.rsqrt(hidden_states.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        y = self.weight * y
        return y if gate is None else y * F.silu(gate)


class GatedBlock(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.norm = GatedRMSNorm(n)

    def forward(self, x):
        return self.norm(x, gate=2 * x)


class AttributeErrorNorm(NoEpsRMSNorm):
    """Reaches for an attribute it lacks (as a gated norm does with gate=None)."""

    eps = 1e-6

    def forward(self, x):
        return x * self.missing_gate_projection


def test_gated_model_norms_are_left_and_probe_errors_are_refusals(stand_ins):
    """A norm whose forward takes a gate besides the input agrees with RMSNorm
    when probed without the gate, but the model calls it with one: it is
    left (the model still runs and computes what it did); a norm whose probe
    raises anything (here AttributeError) is left, not a crash."""
    torch.manual_seed(0)
    model = nn.Sequential(GatedBlock(16), AttributeErrorNorm(16))
    with torch.no_grad():
        model[0].norm.weight.normal_()
    ref = copy.deepcopy(model[0])
    report = accelerate(model, attention=False)
    assert type(model[0].norm) is GatedRMSNorm
    assert "GatedRMSNorm.forward takes ['gate'] besides the input" in report.reason("0.norm")
    x = torch.randn(3, 5, 16)
    assert torch.equal(model[0](x), ref(x))
    assert type(model[1]) is AttributeErrorNorm
    assert "probing it against seqfuse's RMSNorm failed (AttributeError:" in report.reason("1")
    # transformers' own gated norms, where this version has them
    gated = []
    for mod, name, args in (("mamba2", "MambaRMSNormGated", (16, 16)),
                            ("kimi_linear", "KimiLinearRMSNormGated", (16,))):
        try:
            m = importlib.import_module(f"transformers.models.{mod}.modeling_{mod}")
        except ImportError:
            continue
        if hasattr(m, name):
            gated.append(getattr(m, name)(*args))
    model = nn.Sequential(*gated)
    report = accelerate(model, attention=False)
    assert [type(m) for m in model] == [type(m) for m in gated]
    for i, m in enumerate(gated):
        assert "takes ['gate'] besides the input" in report.reason(str(i))


def test_deepcopy_of_an_accelerated_model_is_independent(stand_ins):
    """accelerate() replaces the model's forward (recipe) and its
    _set_gradient_checkpointing (routing): a deepcopy's must act on the copy.
    Enabling checkpointing on the copy changes the copy's layers and leaves
    the original's; the copy's forward runs the copy's weights, under
    autocast; forward keeps the model's signature (the Trainer reads it)."""
    import inspect

    from seqfuse.common.recipe import DelayedScaling
    from seqfuse.quantization import is_fp8_enabled
    from seqfuse.hf.positions import marked_checkpoint

    model = llama().train()
    accelerate(model, recipe=DelayedScaling())
    assert "input_ids" in inspect.signature(model.forward).parameters
    c = copy.deepcopy(model)
    c.gradient_checkpointing_enable()
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    assert all(layer.gradient_checkpointing for layer in c.model.layers)
    assert all(layer._gradient_checkpointing_func.func is marked_checkpoint for layer in c.model.layers)
    seen = []
    c.model.norm.register_forward_hook(lambda *_: seen.append(is_fp8_enabled()))
    with torch.no_grad():
        c.model.norm.weight.mul_(3.0)
    ids = torch.randint(0, 99, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = c(input_ids=ids).logits, model(input_ids=ids).logits
    assert seen == [True]  # the copy's own modules ran, under autocast
    assert rel_error(got, 3.0 * want) <= 1e-4  # lm_head is linear: 3 x the final norm, 3 x the logits
    c.gradient_checkpointing_disable()
    assert not any(layer.gradient_checkpointing for layer in c.model.layers)


def test_attention_function_keeps_masks_of_alternating_layers(monkeypatch):
    """Layers alternating sliding-window and full attention get two mask
    tensors in turn: both layouts stay cached (worked out once each, not at
    every layer), and a mask that dies leaves the cache."""
    import gc

    att, M, calls = _counting_layouts(monkeypatch)
    q = torch.randn(2, 4, 6, 8)
    full = torch.ones(2, 6, dtype=torch.bool)
    full[0, :2] = False
    sliding = full.clone()
    outs = {}
    for layer in range(6):
        mask = sliding if layer % 2 == 0 else full
        out, _ = att.seqfuse_attention_forward(M(), q, q, q, mask)
        assert torch.equal(out, outs.setdefault(id(mask), out))
    assert len(calls) == 2
    del sliding, mask
    gc.collect()
    att.seqfuse_attention_forward(M(), q, q, q, full.clone())
    assert len(att._padding_layout_cached.entries) == 2  # the new mask's and full's
