"""seqfuse.hf.accelerate's whole-layer fusion (seqfuse.hf.fuse_layers) and
fused linear cross-entropy (seqfuse.hf.fused_loss) on small random Llama,
Mistral (sliding window), Qwen2 (q/k/v biases), Qwen3 (QK norms) and Gemma
(zero-centred norms, GeGLU) and Phi-3 (fused projections, partial rotary)
models,
against the untouched model: logits, loss and gradients (float32 to
float32 rounding; bfloat16 within twice plain transformers' own bf16 error
against its float32 self, tests/helpers.py's torch_bound), several training
steps, state dicts and save_pretrained in transformers' own keys, greedy
generation with the dynamic and the static cache, gradient checkpointing,
and what is refused."""
import copy

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from seqfuse.hf import accelerate  # noqa: E402
from seqfuse.hf.fuse_layers import SeqfuseDecoderLayer, hf_named_tensors  # noqa: E402
from helpers import (  # noqa: E402
    check_bf16_within_twice_plain, hf_fp8_grads_close, hf_grads_close, needs_fp8, nudge_biases_and_norms,
    padded_lm_batch, rel_error, rel_tol, train_alongside)

V = 96


def _common(**kw):
    return dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, **kw)


def llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**_common()))


def mistral():
    return transformers.MistralForCausalLM(transformers.MistralConfig(**_common(sliding_window=5)))


def qwen2():
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**_common()))


def qwen3():
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**_common(head_dim=16)))


def gemma():  # RMSNorm with 1 + weight, GeGLU (tanh GELU), embeddings scaled by sqrt(hidden)
    return transformers.GemmaForCausalLM(transformers.GemmaConfig(**_common(head_dim=16)))


def phi3():  # qkv_proj and gate_up_proj already fused; a partial rotary (half of each head turns)
    return transformers.Phi3ForCausalLM(transformers.Phi3Config(**_common(
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})))


FAMILIES = {"llama": llama, "mistral": mistral, "qwen2": qwen2, "qwen3": qwen3, "gemma": gemma, "phi3": phi3}


def make(name, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return nudge_biases_and_norms(FAMILIES[name]().to(dtype), "norm")


def batch(seed=1, b=2, s=13):
    return padded_lm_batch(V, seed, b, s, low=1)


def accelerated(name, dtype=torch.float32, **kw):
    ref = make(name, dtype)
    model = copy.deepcopy(ref)
    report = accelerate(model, **kw)
    return ref, model, report


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_layer_fused_and_report(name):
    model = make(name)
    ref = copy.deepcopy(model)
    own = dict(model.named_parameters())
    report = accelerate(model)
    assert report.fused_names() == ["model.layers.0", "model.layers.1"]
    for layer in model.model.layers:
        assert isinstance(layer, SeqfuseDecoderLayer)
        assert isinstance(layer, type(ref.model.layers[0]))  # transformers' isinstance checks still hold
    # the norms and o_proj / down_proj weights are the model's own Parameter objects
    layer = model.model.layers[1]
    assert layer.qkv.layer_norm_weight is own["model.layers.1.input_layernorm.weight"]
    assert layer.mlp_fused.layer_norm_weight is own["model.layers.1.post_attention_layernorm.weight"]
    assert layer.proj.weight is own["model.layers.1.self_attn.o_proj.weight"]
    assert layer.mlp_fused.fc2_weight is own["model.layers.1.mlp.down_proj.weight"]
    assert "linear_cross_entropy" in report.loss
    text = str(report)
    assert "fused model.layers.1" in text and "loss with labels" in text
    if name == "qwen3":
        assert type(layer.q_norm).__name__ == "RMSNorm"
    if name == "phi3":  # nothing to fuse: every Parameter is the model's own
        assert {id(p) for p in model.parameters()} == {id(p) for p in own.values()}
        assert layer.rope_fused  # the kernel turns the first half of each head
    # a second call leaves the fused layers (and what is inside them) alone
    again = accelerate(model)
    assert again.fused == [] and not [n for n in again.left_names() if n.startswith("model.layers.")]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_fp32_logits_loss_gradients_and_training(name):
    ref, model, _ = accelerated(name)
    ids, mask, labels = batch()
    real = mask.bool()
    with torch.no_grad():
        got, want = model(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits
    assert rel_error(got[real], want[real]) <= rel_tol(torch.float32, 10)
    out = train_alongside(model, ref, dict(input_ids=ids, attention_mask=mask, labels=labels), 1e-2,
                          rel_tol(torch.float32, 100), lambda m, r: hf_grads_close(m, r, rel_tol(torch.float32, 100)))
    assert out.logits is None
    # after three AdamW steps the weights still agree, under transformers' names.  AdamW divides each
    # gradient element by its own magnitude, so an element whose gradient is near 0 moves by up to lr
    # whichever way rounding tips it: the bound is looser than the gradients'
    values = hf_named_tensors(model, "data")
    for n, q in ref.named_parameters():
        assert rel_error(values[n], q.detach()) <= 1e-3, n


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "gemma"])
def test_bf16_within_twice_plain_transformers_error(name):
    """bf16 accelerate()d against the fp32 model, bounded by twice plain
    transformers' bf16 error against the same fp32 model (at least bf16's
    REL_TOL): logits, loss and every gradient."""
    ref32 = make(name)
    ref16 = copy.deepcopy(ref32).to(torch.bfloat16)
    model = copy.deepcopy(ref16)
    report = accelerate(model)
    assert len(report.fused) == 2
    check_bf16_within_twice_plain(ref32, model, *batch(s=16))


@pytest.mark.parametrize("name", ["qwen2", "phi3"])
def test_state_dict_save_pretrained_and_load(tmp_path, name):
    ref, model, _ = accelerated(name)  # qwen2: biases, every kind of split; phi3: renames only
    sd, want = model.state_dict(), ref.state_dict()
    assert list(sd) == list(want)  # transformers' keys, transformers' order
    for k in want:
        assert torch.equal(sd[k], want[k]), k
    # one training step so the saved weights are not the originals
    ids, mask, labels = batch()
    model(ids, attention_mask=mask, labels=labels).loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is type(ref)
    values = hf_named_tensors(model, "data")
    lsd = loaded.state_dict()
    assert set(lsd) == set(values)
    for k, t in values.items():
        assert torch.equal(lsd[k], t), k
    # and back: a plain transformers state dict loads (strictly) into the fused model
    fresh = copy.deepcopy(ref)
    accelerate(fresh)
    fresh.load_state_dict(lsd)
    after = hf_named_tensors(fresh, "data")
    for k, t in values.items():
        assert torch.equal(after[k], t), k
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, model(ids).logits)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("name", ["llama", "qwen3", "mistral", "phi3", "llama-unfused"])
def test_greedy_generate_matches_plain(name, cache):
    """Greedy tokens equal the plain model's (fp32, CPU) with both caches;
    Mistral's window (5) is shorter than prompt + new tokens; "llama-unfused"
    is the module-by-module path (seqfuse's attention function alone)."""
    if name == "llama-unfused":
        ref, model, _ = accelerated("llama", fuse_layers=False)
    else:
        ref, model, _ = accelerated(name)
    ref.eval(), model.eval()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, V, (2, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # a left-padded row, as decoder tokenizers pad for generation
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    if cache == "static":
        kw["cache_implementation"] = "static"
    want = ref.generate(ids, **kw)
    got = model.generate(ids, **kw)
    assert torch.equal(got, want)


def test_static_cache_forward_without_mask():
    """A StaticCache and no attention mask: the keys are the filled slots."""
    ref, model, _ = accelerated("llama")
    ids = torch.randint(1, V, (1, 6))
    outs = []
    for m in (ref, model):
        cache = transformers.StaticCache(config=m.config, max_cache_len=16)
        with torch.no_grad():
            first = m(ids, past_key_values=cache, use_cache=True).logits
            nxt = m(ids[:, :1], past_key_values=cache, use_cache=True,
                    position_ids=torch.tensor([[6]])).logits
        outs.append((first, nxt))
    assert rel_error(outs[1][0], outs[0][0]) <= rel_tol(torch.float32, 10)
    assert rel_error(outs[1][1], outs[0][1]) <= rel_tol(torch.float32, 10)


def test_packed_sequences_match_plain():
    """transformers' padding-free batches (one row, position ids restarting
    per sequence, as DataCollatorWithFlattening makes them): no token sees
    another sequence and RoPE restarts per sequence.  Logits, loss and
    gradients equal the plain model's run on each sequence alone (plain
    transformers' sdpa path itself attends across the packed sequences)."""
    ref, model, _ = accelerated("qwen2")
    g = torch.Generator().manual_seed(5)
    lengths, starts = (5, 8, 3), (0, 5, 13)
    ids = torch.randint(1, V, (1, sum(lengths)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = ids.clone()
    labels[0, list(starts)] = -100  # the collator's rule: no label across a sequence boundary
    out = model(ids, position_ids=pos, labels=labels)
    sep = torch.cat([ref(ids[:, a:a + n]).logits for a, n in zip(starts, lengths)], 1)
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    want = torch.nn.functional.cross_entropy(sep.reshape(-1, V), shifted.reshape(-1))
    assert abs(out.loss.item() - want.item()) <= rel_tol(torch.float32, 100) * want.item()
    with torch.no_grad():
        assert rel_error(model(ids, position_ids=pos).logits, sep) <= rel_tol(torch.float32, 10)
    out.loss.backward()
    want.backward()
    hf_grads_close(model, ref, rel_tol(torch.float32, 100))


def test_gradient_checkpointing_and_hidden_states():
    ref, model, _ = accelerated("llama")
    model.train(), ref.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids, mask, labels = batch()
    out = model(ids, attention_mask=mask, labels=labels)
    exp = ref(ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    exp.loss.backward()
    hf_grads_close(model, ref, rel_tol(torch.float32, 100))
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states
        hs_ref = ref(ids, output_hidden_states=True).hidden_states
    assert len(hs) == len(hs_ref) == 3
    assert rel_error(hs[1], hs_ref[1]) <= rel_tol(torch.float32, 10)


def test_fused_loss_arguments():
    ref, model, _ = accelerated("llama")
    ids, mask, labels = batch()
    # positional input_ids, num_items_in_batch (transformers' gradient accumulation), tuple output
    n = torch.tensor(7)
    got = model(ids, None, labels=labels, num_items_in_batch=n, return_dict=False)
    want = ref(ids, labels=labels, num_items_in_batch=n)
    assert abs(got[0].item() - want.loss.item()) <= rel_tol(torch.float32, 100) * want.loss.item()
    # without labels, logits as transformers makes them (logits_to_keep included)
    assert model(ids, logits_to_keep=3).logits.shape == (2, 3, V)
    # fused_loss=False keeps transformers' head and loss (logits returned)
    _, plain_loss, _ = accelerated("llama", fused_loss=False)
    assert plain_loss(ids, labels=labels).logits is not None


def test_output_attentions_and_bad_positions_refused():
    _, model, _ = accelerated("llama")
    with pytest.raises(NotImplementedError, match="output_attentions"):
        model(torch.randint(1, V, (1, 5)), output_attentions=True)
    with pytest.raises(ValueError, match="position_ids"):
        model(torch.randint(1, V, (2, 5)), position_ids=torch.arange(6)[None])


def test_layers_left_with_reasons():
    # an adapter-like extra module in one layer, a forward hook on another
    ref = make("llama")
    model = copy.deepcopy(ref)
    model.model.layers[0].self_attn.q_proj = nn.Sequential(ref.model.layers[0].self_attn.q_proj)
    model.model.layers[1].register_forward_hook(lambda m, i, o: o)
    report = accelerate(model)
    assert report.fused == []
    assert "modules differ" in report.reason("model.layers.0")
    assert "hooks" in report.reason("model.layers.1")
    # no attention switch: no fusion (the layers need seqfuse's mask format)
    model = make("llama")
    report = accelerate(model, attention=False)
    assert report.fused == []
    # a recipe whose GEMMs the shapes do not fit: left, naming the sizes
    from seqfuse.common.recipe import Float8BlockScaling

    model = make("llama")
    report = accelerate(model, recipe=Float8BlockScaling())
    assert "divisible by 128" in report.reason("model.layers.0")
    with pytest.raises(TypeError, match="fuse_layers"):
        accelerate(make("llama"), fuse_layers="yes")


def test_dynamic_rope_rotates_in_torch():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**_common(rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                              "rope_theta": 10000.0}))
    ref = transformers.LlamaForCausalLM(cfg)
    model = copy.deepcopy(ref)
    report = accelerate(model)
    assert len(report.fused) == 2 and "rope_type 'dynamic'" in report.fused[0].notes[0]
    ids = torch.randint(1, V, (2, 9))
    with torch.no_grad():
        assert rel_error(model(ids).logits, ref(ids).logits) <= rel_tol(torch.float32, 10)


@needs_fp8
@pytest.mark.parametrize("recipe_name", ["delayed", "block"])
def test_fp8_recipes_train_on_cpu(recipe_name):
    """FP8 (the CPU backend: the definition of the numerics) through the fused
    layers: every layer fused under the recipe (block scaling: 128-multiple
    sizes), the loss within 2 % of the float32 model's over three AdamW steps
    on one batch, gradients under transformers' names within 25 %: the
    gradients pass through E5M2 casts (Format.HYBRID, 2**-3 relative
    rounding each) in two layers' GEMMs, and the embedding's (deepest) comes
    out 10-12 % off here."""
    from seqfuse.common.recipe import DelayedScaling, Float8BlockScaling

    recipe = DelayedScaling() if recipe_name == "delayed" else Float8BlockScaling()
    torch.manual_seed(0)
    extra = dict(hidden_size=128, intermediate_size=256, head_dim=32) if recipe_name == "block" else {}
    cfg = dict(_common(), **extra)
    ref = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**cfg))
    model = copy.deepcopy(ref)
    report = accelerate(model, recipe=recipe)
    assert len(report.fused) == 2, str(report)
    ids, mask, labels = batch(s=16)
    train_alongside(model, ref, dict(input_ids=ids, attention_mask=mask, labels=labels), 1e-3, 0.02,
                    hf_fp8_grads_close)
    # the state dict: transformers' keys, plus the FP8 scaling state under seqfuse's names (kept for resume)
    sd = model.state_dict()
    hf_keys = set(ref.state_dict())
    extra = set(sd) - hf_keys
    assert hf_keys <= set(sd) and all(".fp8_state." in k for k in extra), sorted(extra)[:4]
    assert extra or recipe_name == "block"  # block scaling keeps no state between steps
    copy.deepcopy(model).load_state_dict(sd)  # strict: every entry finds its place again
    missing, unexpected = copy.deepcopy(ref).load_state_dict(sd, strict=False)
    assert not missing and set(unexpected) == extra


@needs_fp8
def test_fp8_lm_head(monkeypatch):
    """Under a recipe the LM head stays in high precision (left, with the
    reason; the fused loss without FP8) unless fp8_lm_head=True: then it is
    swapped, the report says the loss's GEMMs are FP8, the loss gets the
    recipe, and the loss and the head's gradient stay within FP8 rounding of
    the high-precision head's (and differ from it)."""
    from seqfuse.common.recipe import DelayedScaling, Float8BlockScaling
    from seqfuse.hf import fused_loss
    from seqfuse.pytorch import Linear

    seen = []
    real = fused_loss.linear_cross_entropy

    def spy(*args, **kw):
        seen.append(kw.get("fp8_recipe"))
        return real(*args, **kw)

    monkeypatch.setattr(fused_loss, "linear_cross_entropy", spy)
    ids, mask, labels = batch(s=16)
    results = []
    for fp8_head in (False, True):
        model = make("llama")
        recipe = DelayedScaling()
        report = accelerate(model, recipe=recipe, fp8_lm_head=fp8_head)
        assert isinstance(model.lm_head, Linear) == fp8_head
        assert ("in FP8" in report.loss) == fp8_head
        if not fp8_head:
            assert "stays in high precision" in report.reason("lm_head")
        out = model(ids, attention_mask=mask, labels=labels)
        assert seen.pop() is (recipe if fp8_head else None)
        out.loss.backward()
        results.append((out.loss.item(), model.lm_head.weight.grad.clone()))
    (loss_hp, g_hp), (loss_8, g_8) = results
    assert abs(loss_8 - loss_hp) <= 0.02 * loss_hp
    assert 0 < rel_error(g_8, g_hp) <= 0.25
    cfg = transformers.LlamaConfig(**dict(_common(), vocab_size=128, hidden_size=128, intermediate_size=256,
                                          head_dim=32))
    block_model = transformers.LlamaForCausalLM(cfg)
    with pytest.raises(ValueError, match="fp8_lm_head=True needs a per-tensor recipe"):
        accelerate(block_model, recipe=Float8BlockScaling(), fp8_lm_head=True)
    # refused before anything changed: the model takes another recipe afterwards
    assert len(accelerate(block_model, recipe=DelayedScaling(), fp8_lm_head=True).fused) == 2
    # the recipe an earlier call set is the one the rule reads
    earlier = transformers.LlamaForCausalLM(cfg)
    accelerate(earlier, recipe=Float8BlockScaling())
    with pytest.raises(ValueError, match="fp8_lm_head=True needs a per-tensor recipe"):
        accelerate(earlier, fp8_lm_head=True)
    with pytest.raises(TypeError, match="'fp8_lm_head' must be a bool"):
        accelerate(make("llama"), fp8_lm_head=None)


def test_fp8_lm_head_without_a_recipe_says_it_changes_nothing(caplog):
    model = make("llama")
    with caplog.at_level("WARNING", logger="seqfuse"):
        report = accelerate(model, fp8_lm_head=True)
    assert "fp8_lm_head=True changes nothing without an FP8 recipe" in caplog.text
    assert "in FP8" not in report.loss


@pytest.mark.cuda
@pytest.mark.parametrize("recipe_name", [None, "delayed", "delayed_head", "block"])
def test_cuda_llama_bf16_and_fp8(recipe_name):
    """On the GPU: bf16 and FP8 (delayed, with the LM head too, block) accelerate()d Llama trains:
    the loss is finite and near plain bf16 transformers' (FP8: within 5 %),
    gradients flow to every weight, and the fused layers ran."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from seqfuse.common.recipe import DelayedScaling, Float8BlockScaling

    recipe = {None: None, "delayed": DelayedScaling(), "delayed_head": DelayedScaling(),
              "block": Float8BlockScaling()}[recipe_name]
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    ref = transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)
    model = copy.deepcopy(ref)
    report = accelerate(model, recipe=recipe, fp8_lm_head=recipe_name == "delayed_head")
    assert len(report.fused) == 2, str(report)
    assert ("in FP8" in report.loss) == (recipe_name == "delayed_head")
    ids = torch.randint(0, 512, (2, 256), device="cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        out = model(ids, labels=ids)
        want = ref(ids, labels=ids).loss.float()
        assert torch.isfinite(out.loss)
        bound = 0.05 if recipe is not None else 0.01
        assert abs(out.loss.float() - want) <= bound * want
        out.loss.backward()
        for n, p in model.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), n
        opt.step()
        opt.zero_grad()
        # follow the trained weights: transformers' keys, plus FP8 scaling state under seqfuse's names
        missing, unexpected = ref.load_state_dict(model.state_dict(), strict=False)
        assert not missing and all(".fp8_state." in k for k in unexpected), unexpected[:4]


@pytest.mark.cuda
def test_cuda_fused_loss_memory_is_one_chunk():
    """The labels path's loss (seqfuse.hf.fused_loss) at 32,768 tokens and a
    32k vocabulary (four chunks of 8,192 rows, 500 MiB of logits each, the default at this size)
    holds at most one chunk of logits: its peak beyond the inputs is bounded
    by one chunk's bf16 logits, the weight gradient (summed in bf16: no
    float32 [V, H] buffer, 131 MB, which the bound's slack does not cover)
    and the hidden-state gradient (10 % slack and the GEMMs' 32 MiB
    workspace), and is below the full bf16 logits."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from seqfuse.hf.fused_loss import fused_causal_lm_loss
    from seqfuse.modules.cross_entropy import default_chunk_size

    n, h, v = 32768, 1024, 32000
    head = nn.Linear(h, v, bias=False, device="cuda", dtype=torch.bfloat16)
    holder = nn.Module()
    holder.lm_head = head
    hidden = torch.randn(1, n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, v, (1, n), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = fused_causal_lm_loss(holder, hidden, labels)
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    chunk = default_chunk_size(n, v, 2)
    assert chunk < n
    bound = 1.1 * (chunk * v * 2 + v * h * 2 + n * h * 2 * 2) + (33 << 20)
    assert peak <= bound, (peak, bound)
    assert peak < n * v * 2  # the full bf16 logits alone
    # and the loss is torch's
    want = torch.nn.functional.cross_entropy(
        (hidden.detach().float() @ head.weight.detach().float().T)[0, :-1], labels[0, 1:])
    assert abs(loss.item() - want.item()) <= 2e-2 * want.item()


@pytest.mark.cuda
def test_cuda_generate_static_cache():
    """On the GPU transformers compiles the decoding step of a static-cache
    generate() (mode reduce-overhead); the fused layers run uncompiled inside
    it.  bf16 greedy tokens: static cache (compiled), static cache with
    compilation off, and the dynamic cache all equal (the same kernels on the
    same keys), and the first new token is plain transformers' choice to
    bf16 rounding."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    ref = transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    model = copy.deepcopy(ref)
    assert len(accelerate(model).fused) == 2
    ids = torch.randint(1, 512, (2, 40), device="cuda")
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    dyn = model.generate(ids, **kw)
    static = model.generate(ids, cache_implementation="static", **kw)
    static_eager = model.generate(ids, cache_implementation="static", disable_compile=True, **kw)
    assert torch.equal(static, dyn) and torch.equal(static_eager, dyn)
    # the first new token is plain transformers' choice up to bf16 rounding (a random model's logits are close)
    with torch.no_grad():
        last = ref(ids, attention_mask=mask).logits[:, -1].float()
    chosen = last.gather(1, dyn[:, 40:41]).squeeze(1)
    assert (chosen >= last.max(1).values - 2e-2 * last.abs().max()).all()


def test_pickle_round_trip():
    """torch.save of a whole accelerated model: the fused layer classes are
    found again by name, also where they were not made yet (a new process)."""
    import io

    import seqfuse.hf.fuse_layers as fuse_layers

    ref, model, _ = accelerated("qwen3")
    buf = io.BytesIO()
    torch.save(model, buf)
    fuse_layers.__dict__.pop("SeqfuseQwen3DecoderLayer")  # as in a process that has not fused a Qwen3 yet
    fuse_layers._FUSED_CLASSES.clear()
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    ids = torch.randint(1, V, (2, 7))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert type(loaded.model.layers[0]).__name__ == "SeqfuseQwen3DecoderLayer"
    # the forward's wrapping comes back with it (the labels path makes no logits), bound to the loaded model
    out = loaded(ids, labels=ids)
    assert out.logits is None and torch.equal(out.loss, model(ids, labels=ids).loss)
    assert loaded.forward.__self__ is loaded


def test_fused_loss_only_in_training_and_tuple_keeps_the_logits_place():
    """The fused loss (no logits) serves training calls with labels only:
    evaluation with labels (metrics want the logits) runs transformers'
    head and loss; a tuple return keeps the logits' position (None)."""
    ref, model, _ = accelerated("llama")
    ids, mask, labels = batch()
    model.train(), ref.train()
    out = model(ids, attention_mask=mask, labels=labels, return_dict=False)
    exp = ref(ids, attention_mask=mask, labels=labels, return_dict=False)
    assert out[1] is None and abs(out[0].item() - exp[0].item()) <= rel_tol(torch.float32, 100) * exp[0].item()
    assert len(out) == len(exp)
    model.eval(), ref.eval()
    with torch.no_grad():
        got = model(ids, attention_mask=mask, labels=labels)
        want = ref(ids, attention_mask=mask, labels=labels)
    real = mask.bool()
    assert got.logits is not None and rel_error(got.logits[real], want.logits[real]) <= rel_tol(torch.float32, 10)
    assert abs(got.loss.item() - want.loss.item()) <= rel_tol(torch.float32, 100) * want.loss.item()


def test_new_fused_parameters_are_reported_and_logged(caplog):
    """Whole-layer fusion makes new Parameters (fused QKV, gate/up): the
    report lists them and a WARNING says to build the optimizer after."""
    import logging

    ref = make("llama", torch.float32)
    model = copy.deepcopy(ref)
    kept = list(model.parameters())  # held here, so no new Parameter can take a freed one's id
    before = {id(p) for p in kept}
    with caplog.at_level(logging.WARNING, logger="seqfuse"):
        report = accelerate(model)
    new = [n for n, p in model.named_parameters() if id(p) not in before]
    assert new and report.new_parameters == new
    assert "build the optimizer after accelerate()" in caplog.text
    assert "new Parameters" in str(report)


def _live_tensor_bytes():
    import gc

    gc.collect()
    seen, total = set(), 0
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            st = obj.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
    return total


def test_fusion_frees_each_replaced_layer_as_it_goes(monkeypatch):
    """accelerate() frees a replaced layer's unfused weights before it fuses
    the next layer: the live tensor bytes during the walk stay within about
    one layer's fused weights of the model's (not one more copy of every
    layer's QKV and gate/up weights at the end), and the report still names
    exactly the new Parameters."""
    import seqfuse.hf.fuse_layers as FL

    layers = 6
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**_common(), "num_hidden_layers": layers}))
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    layer_bytes = sum(m.weight.numel() * m.weight.element_size()
                      for m in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj))
    del attn, mlp
    start = _live_tensor_bytes()
    growth = []
    real = FL.fused_param

    def watched(tensors, requires_grad):
        out = real(tensors, requires_grad)
        growth.append(_live_tensor_bytes() - start)
        return out

    monkeypatch.setattr(FL, "fused_param", watched)
    report = accelerate(model)
    assert len(report.fused) == layers and len(growth) == 2 * layers
    # the same growth at the last layer as at the second (held to the end, it rose by a layer's weights
    # each layer: 5 x layer_bytes more by the last here), within a few layers' worth of new tensors
    assert growth[-1] <= growth[3] + layer_bytes // 4 and max(growth) <= 3 * layer_bytes, (growth, layer_bytes)
    assert _live_tensor_bytes() - start <= layer_bytes // 10
    assert sorted(report.new_parameters) == sorted(
        n for n, _ in model.named_parameters() if n.endswith(("qkv.weight", "fc1_weight")))


def _saved_bytes(fn):
    """(fn()'s result, bytes of the distinct storages autograd saved while it ran)."""
    seen = {}

    def pack(t):
        seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


@pytest.mark.parametrize("name", ["llama", "gemma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recompute_activation_same_bits_one_ffn_tensor_less(name, dtype):
    """accelerate() (recompute_activation None, the default) against
    recompute_activation=False: the same loss and gradients bit for bit
    (the backward makes the gated activation with the forward's kernel), and
    autograd keeps one [tokens, intermediate] tensor less per layer (SwiGLU
    for Llama, GeGLU for Gemma); the report says so; a second call with the
    default leaves the layers fused with False as they are, and one with
    True turns it on for them."""
    ids, mask, labels = batch()
    _, plain, kept = accelerated(name, dtype, recompute_activation=False)
    _, lean, report = accelerated(name, dtype)
    assert all(layer.mlp_fused.recompute_activation for layer in lean.model.layers)
    assert not any(layer.mlp_fused.recompute_activation for layer in plain.model.layers)
    assert "made again in the backward" in str(report) and "made again in the backward" not in str(kept)
    results = []
    for model in (plain, lean):
        out, saved = _saved_bytes(lambda: model(ids, attention_mask=mask, labels=labels))
        out.loss.backward()
        results.append((out.loss.detach(), hf_named_tensors(model), saved))
    (loss_a, grads_a, saved_a), (loss_b, grads_b, saved_b) = results
    assert torch.equal(loss_a, loss_b)
    for n, g in grads_a.items():
        assert (g is None) == (grads_b[n] is None) and (g is None or torch.equal(g, grads_b[n])), n
    tokens, ffn = ids.numel(), plain.config.intermediate_size
    assert saved_a - saved_b == len(plain.model.layers) * tokens * ffn * dtype.itemsize
    accelerate(plain)
    assert not any(layer.mlp_fused.recompute_activation for layer in plain.model.layers)
    again = accelerate(plain, recompute_activation=True)
    assert again.fused == [] and all(layer.mlp_fused.recompute_activation for layer in plain.model.layers)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_cuda_attention_keeps_none_of_the_qkv_output(name):
    """What autograd saves in a fused layer's training forward holds none of
    the QKV GEMM's output: v is copied out of it (split_qkv_rope for Llama,
    the torch.split path under Qwen3's q/k norms), so the attention's saved
    v (cuDNN's route on an unpadded bf16 batch saves the tensors it is
    given) does not keep the whole [tokens, (heads + 2 kv_heads) d] output
    alive."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = make(name, torch.bfloat16).cuda()
    accelerate(model)
    ids = batch()[0].cuda()
    qkv_out = []

    def note_output(module, args, out):  # (the outputs kept alive: no later tensor can take their addresses)
        qkv_out.append(out[0] if isinstance(out, tuple) else out)

    hooks = [layer.qkv.register_forward_hook(note_output) for layer in model.model.layers]
    saved = set()

    def pack(t):
        saved.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(ids, labels=ids, use_cache=False)
    for h in hooks:
        h.remove()
    assert len(qkv_out) == len(model.model.layers)
    assert not saved & {t.untyped_storage().data_ptr() for t in qkv_out}
    out.loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "qkv" in n)


@needs_fp8
def test_recompute_activation_under_an_fp8_recipe():
    """Under accelerate()'s FP8 recipe the default (as without one) makes
    the fused MLPs' activation FP8 copy again in the backward; False keeps
    it: the same loss and gradients bit for bit, one byte per [tokens,
    intermediate] element less kept per layer by the default (its FP8
    transposed copy), the report says so."""
    from seqfuse.common.recipe import DelayedScaling

    ids, mask, labels = batch()
    _, plain, kept = accelerated("llama", torch.bfloat16, recipe=DelayedScaling(), recompute_activation=False)
    _, lean, report = accelerated("llama", torch.bfloat16, recipe=DelayedScaling())
    assert not any(layer.mlp_fused.recompute_activation for layer in plain.model.layers)
    assert all(layer.mlp_fused.recompute_activation for layer in lean.model.layers)
    assert "made again in the backward" in str(report) and "made again in the backward" not in str(kept)
    # (the second step: delayed scaling's activation cast in the kernel)
    _same_bits_one_fp8_copy_less(plain, lean, ids, mask, labels, plain.config.intermediate_size)


def _same_bits_one_fp8_copy_less(kept, lean, ids, mask, labels, width):
    """Two FP8 training steps of ``kept`` and ``lean`` (the same weights): the
    second step's loss and gradients equal bit for bit, and autograd keeps
    one byte per element of a [width, rows] FP8 copy less per layer in
    ``lean`` (its scale-inverse's few bytes allowed)."""
    results = []
    for model in (kept, lean):
        for _ in range(2):  # (the second step runs on the scales the first one's update made)
            out, saved = _saved_bytes(lambda: model(ids, attention_mask=mask, labels=labels))
            out.loss.backward()
            grads = hf_named_tensors(model)
            model.zero_grad()
        results.append((out.loss.detach(), grads, saved))
    (loss_a, grads_a, saved_a), (loss_b, grads_b, saved_b) = results
    assert torch.equal(loss_a, loss_b)
    for n, g in grads_a.items():
        assert (g is None) == (grads_b[n] is None) and (g is None or torch.equal(g, grads_b[n])), n
    rows = (ids.numel() + 15) // 16 * 16  # (FP8 copies carry the token rows padded to 16)
    less = saved_a - saved_b
    layers = len(kept.model.layers)
    # one byte per element of the [width, rows] copy, less the one-element scale copy delayed scaling keeps
    assert layers * (width * rows - 8) <= less <= layers * width * rows, (less, layers * width * rows)


@needs_fp8
def test_attention_projection_keeps_the_attention_output_under_fp8():
    """accelerate()'s fused layers set Linear's save_original_input on the
    attention output's projection: under an FP8 recipe its backward keeps
    the attention output (which the attention keeps for its own backward)
    and makes the FP8 transposed copy again, not kept: the same loss and
    gradients bit for bit over two steps as with the copy kept, one byte per
    [rows, heads x head_dim] element less kept per layer."""
    from seqfuse.common.recipe import DelayedScaling

    ids, mask, labels = batch()
    _, copy_kept, _ = accelerated("llama", torch.bfloat16, recipe=DelayedScaling())
    _, lean, _ = accelerated("llama", torch.bfloat16, recipe=DelayedScaling())
    assert all(layer.proj.save_original_input for layer in lean.model.layers)
    for layer in copy_kept.model.layers:
        layer.proj.save_original_input = False
    _same_bits_one_fp8_copy_less(copy_kept, lean, ids, mask, labels, copy_kept.model.layers[0].proj.in_features)


def test_recompute_activation_argument_rules():
    from seqfuse.pytorch import LayerNormMLP

    with pytest.raises(TypeError, match="accelerate: argument 'recompute_activation' must be a bool or None"):
        accelerate(make("llama"), recompute_activation=1)
    with pytest.raises(ValueError, match="recompute_activation=True needs an activation other than 'gelu'"):
        LayerNormMLP(64, 96, activation="gelu", recompute_activation=True, device="cpu")


def test_graph_layers_replays_only_the_calls_it_holds(caplog):
    """seqfuse.hf.graph_layers' dispatch (CPU: graphs stood in for by
    recording callables): an unpadded training call of the captured shape
    replays every fused layer; a mask with zeros, a key cache, the
    caller's position ids, another shape, eval mode and no-grad run the
    layers eagerly, each reason logged once; the rules are checked first."""
    from seqfuse.hf import graph_layers
    from seqfuse.hf.layer_graphs import LayerGraphs

    model = make("llama")
    with pytest.raises(ValueError, match="graph_layers: the model has no fused decoder layer"):
        graph_layers(model, 2, 8)
    accelerate(model)
    model.train()
    with pytest.raises(RuntimeError, match="graph_layers: CUDA graphs need the model on a CUDA device"):
        graph_layers(model, 2, 8)
    layers = [m for m in model.modules() if isinstance(m, SeqfuseDecoderLayer)]
    replayed = []

    def stand_in(i):
        def replay(x):
            replayed.append(i)
            return x * 1.0
        return replay

    graphs = LayerGraphs("LlamaForCausalLM")
    graphs.set((2, 8), None, [stand_in(i) for i in range(len(layers))])
    for i, m in enumerate(layers):
        m.set_graphs(graphs, i, torch.float32)
    ids = torch.randint(1, V, (2, 8))
    model(ids, labels=ids, use_cache=False).loss.backward()
    assert replayed == [0, 1]
    copied = copy.deepcopy(model)  # a copy holds no graphs (they hold the original's parameters)
    copied(ids, labels=ids, use_cache=False)
    assert replayed == [0, 1] and all("_layer_graphs" not in m.__dict__ for m in copied.model.layers)
    mask = torch.ones_like(ids)
    mask[0, -2:] = 0
    calls = [dict(attention_mask=mask), dict(use_cache=True), dict(position_ids=torch.arange(8)[None] + 3)]
    with caplog.at_level("WARNING", logger="seqfuse"):
        for kw in calls:
            model(ids, labels=ids, **{"use_cache": False, **kw})
        model(ids[:, :6], labels=ids[:, :6], use_cache=False)
        with torch.no_grad():
            model(ids, use_cache=False)
        model(ids, labels=ids, attention_mask=mask, use_cache=False)  # a reason already given: not again
        for m in layers:
            m.set_graphs(graphs, layers.index(m), torch.bfloat16)
        model(ids, labels=ids, use_cache=False)  # captured for bf16 hidden states: this call's are float32
    assert replayed == [0, 1]
    said = [r.getMessage() for r in caplog.records if "graphed layers not used" in r.getMessage()]
    for reason in ("an attention mask", "a key cache", "position_ids given by the caller",
                   "input_ids (2, 6), graphed for (2, 8)", "not training",
                   "hidden states torch.float32 with torch autocast off, graphed for torch.bfloat16"):
        assert sum(reason in m for m in said) == 1, (reason, said)


@pytest.mark.cuda
@pytest.mark.parametrize("recipe_name", [None, "delayed"])
def test_cuda_graph_layers_match_eager(recipe_name):
    """graph_layers on the GPU: three AdamW steps of the graphed model give
    the eager model's losses and weights (the same kernels replayed: bf16
    within 1e-3 relative, FP8 within 2e-2), and a padded call still runs."""
    from seqfuse.common.recipe import DelayedScaling
    from seqfuse.hf import graph_layers

    recipe = DelayedScaling() if recipe_name else None
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    base = transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)
    eager, graphed = copy.deepcopy(base), copy.deepcopy(base)
    accelerate(eager, recipe=recipe)
    accelerate(graphed, recipe=recipe)
    eager.train(), graphed.train()
    graph_layers(graphed, 2, 128)
    graphs = graphed.model.layers[0].__dict__["_layer_graphs"].graphs
    calls = []

    def counted(i, g):
        def call(x):
            calls.append(i)
            return g(x)
        return call

    graphs.graphed = tuple(counted(i, g) for i, g in enumerate(graphs.graphed))
    ids = torch.randint(0, 512, (2, 128), device="cuda")
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (eager, graphed)]
    bound = 2e-2 if recipe else 1e-3
    for _ in range(3):
        losses = []
        for model, opt in zip((eager, graphed), opts):
            loss = model(ids, labels=ids, use_cache=False).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.float())
        assert abs(losses[1] - losses[0]) <= bound * losses[0], losses
    assert calls == [0, 1] * 3  # every step's layers went to the graphed callables (FP8: eager until history)
    a, b = dict(eager.named_parameters()), dict(graphed.named_parameters())
    for n in a:
        assert rel_error(b[n].float(), a[n].float()) <= bound, n
    mask = torch.ones_like(ids)
    mask[1, -5:] = 0
    assert torch.isfinite(graphed(ids, labels=ids, attention_mask=mask, use_cache=False).loss)
