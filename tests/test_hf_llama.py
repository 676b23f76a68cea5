"""Llama on seqfuse layers against transformers' own LlamaForCausalLM with the
same weights (random initialisation, nothing downloaded).

CPU (CI), tiny configs (hidden 64, 2 layers, 4 heads, 2 key/value heads,
vocabulary 16, the size of a nucleotide vocabulary): logits, loss and
gradients in float32 with tied and untied embeddings and with Llama 3's
rope scaling on (its frequency bands all exercised) or off; bf16 logits
against transformers' bf16, both measured against float32; packed thd
(cu_seqlens, or restarting position_ids) against padded bshd; left padding;
the rotary inverse frequencies bit-identical to transformers'.  Conversion
and export are in test_hf_llama_convert.py.  CUDA (bf16) at the end.
"""
import pytest
import torch

transformers = pytest.importorskip("transformers")

import seqfuse  # noqa: E402
from causal_lm_checks import (VOCAB, batch, check_activation_checkpointing,  # noqa: E402,F401 (batch, packed: test_hf_llama_generate's)
                              check_bad_inputs_named, check_bf16_within_bf16_rounding, check_grads,
                              check_left_padding_matches_transformers, check_packed_thd_matches_padded_bshd,
                              hf_grads_in_seqfuse_names, packed, real, spread_weights)
from helpers import check_same_logits_and_losses, needs_fp8, rel_error, saved_activation_bytes  # noqa: E402
from seqfuse.hf import SeqfuseLlamaConfig, SeqfuseLlamaForCausalLM, llama3_config  # noqa: E402
from seqfuse.hf.llama import shift_labels  # noqa: E402
from seqfuse.hf.llama_config import from_hf_config, rope_inv_freq, to_hf_config  # noqa: E402
from seqfuse.hf.llama_convert import from_hf_model, hf_to_seqfuse_state_dict  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

#: Llama 3 scaling over 64 original positions: with head dim 16 and theta
#: 500000, the 8 frequencies fall in all three bands (kept, interpolated, divided).
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=64)
DEFAULT_ROPE = dict(rope_type="default", rope_theta=10000.0)


def tiny_config(tie=False, rope=LLAMA3_ROPE, **kw):
    base = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, intermediate_size=96, rms_norm_eps=1e-5, tie_word_embeddings=tie,
                max_position_embeddings=256, rope_parameters=dict(rope), pad_token_id=0)
    base.update(kw)
    return transformers.LlamaConfig(**base)


def hf_model(seed=0, dtype=torch.float32, **kw):
    torch.manual_seed(seed)
    model = spread_weights(transformers.LlamaForCausalLM(tiny_config(**kw)).eval())
    return cast(model, dtype)


def cast(model, dtype):
    """transformers' model in ``dtype``, its rotary inv_freq kept float32 as
    from_pretrained(dtype=...) keeps it (.to() alone rounds that buffer too)."""
    model = model.to(dtype)
    model.model.rotary_emb = modeling_llama.LlamaRotaryEmbedding(model.config).to(next(model.parameters()).device)
    return model


# ------------------------------------------------------------------ RoPE
@pytest.mark.parametrize("rope", [LLAMA3_ROPE, DEFAULT_ROPE,
                                  dict(LLAMA3_ROPE, factor=32.0, original_max_position_embeddings=8192)])
def test_rope_inv_freq_bit_identical_to_transformers(rope):
    cfg = tiny_config(rope=rope)
    ours = rope_inv_freq(cfg)
    theirs = modeling_llama.LlamaRotaryEmbedding(cfg).inv_freq
    assert ours.dtype == torch.float32 and torch.equal(ours, theirs)
    model = SeqfuseLlamaForCausalLM(from_hf_config(cfg))
    assert torch.equal(model.model.rotary_emb.inv_freq, theirs)
    assert "model.rotary_emb.inv_freq" not in model.state_dict()  # computed from the config, as in transformers


def test_llama3_scaling_bands_are_all_exercised():
    cfg = tiny_config()
    plain = rope_inv_freq(tiny_config(rope=dict(rope_type="default", rope_theta=LLAMA3_ROPE["rope_theta"])))
    scaled = rope_inv_freq(cfg)
    ratio = plain / scaled
    assert (ratio == 1).any() and (ratio == LLAMA3_ROPE["factor"]).any()
    assert ((ratio > 1) & (ratio < LLAMA3_ROPE["factor"])).any()


# ---------------------------------------------------------------- golden
@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("rope", [LLAMA3_ROPE, DEFAULT_ROPE], ids=["llama3", "default"])
def test_golden_fp32_logits_loss_grads(tie, rope):
    hf = hf_model(seed=1, tie=tie, rope=rope)
    sf = from_hf_model(hf).eval()
    assert (sf.lm_head.weight is sf.model.embed_tokens.weight) == tie
    b, _ = batch(seed=1)
    check_same_logits_and_losses(hf, sf, b)
    check_grads(sf, hf, hf_to_seqfuse_state_dict, 1e-4)


def test_rope_scaling_changes_the_logits():
    """The golden test above can fail on the scaling: dropping it moves the
    logits by far more than its tolerance."""
    hf = hf_model(seed=2)
    b, _ = batch(seed=2)
    with torch.no_grad():
        scaled = hf(**b).logits
        sf = from_hf_model(hf).eval()
        sf.model.rotary_emb.inv_freq.copy_(rope_inv_freq(tiny_config(
            rope=dict(rope_type="default", rope_theta=LLAMA3_ROPE["rope_theta"]))))
        unscaled = sf(**b).logits
    m = b["attention_mask"]
    assert rel_error(real(unscaled, m), real(scaled, m)) > 1e-3


def test_bf16_within_bf16_rounding_of_transformers():
    """bf16 weights: seqfuse's and transformers' bf16 logits, each against
    transformers in float32 with the same (bf16-representable) weights.
    Bound: seqfuse's error <= max(2 x transformers' own, 1e-2); loss within 1 %."""
    hf16 = hf_model(seed=3, dtype=torch.bfloat16)
    hf32 = cast(hf_model(seed=3, dtype=torch.bfloat16), torch.float32)
    check_bf16_within_bf16_rounding(hf16, hf32, from_hf_model(hf16).eval(), batch(seed=3)[0])


# ---------------------------------------------------------------- layouts
def test_packed_thd_matches_padded_bshd():
    sf = from_hf_model(hf_model(seed=4)).eval()
    check_packed_thd_matches_padded_bshd(sf, *batch(seed=4))


def test_packed_with_collator_padding_segment():
    """seqfuse.data's PackedTHDCollator pads to a multiple of 16 with a dummy
    segment of its own, labels -100: the loss over the real sequences is unchanged."""
    sf = from_hf_model(hf_model(seed=5)).eval()
    _, seqs = batch(seed=5)
    ids, cu, _ = packed(seqs)
    n_pad = -ids.numel() % 16
    ids_p = torch.cat([ids, torch.zeros(n_pad, dtype=torch.long)])
    labels_p = torch.cat([ids, torch.full((n_pad,), -100)])
    cu_p = torch.cat([cu, cu[-1:] + n_pad])
    with torch.no_grad():
        a = sf(input_ids=ids, labels=ids, cu_seqlens=cu)
        b = sf(input_ids=ids_p, labels=labels_p, cu_seqlens=cu_p)
    assert torch.equal(b.logits[:ids.numel()], a.logits)
    assert abs(a.loss.item() - b.loss.item()) <= 1e-6 * a.loss.item()


def test_left_padding_matches_transformers():
    """transformers' forward without position_ids takes the column index as
    position; so does seqfuse's, and left padding is computed exactly."""
    hf = hf_model(seed=6)
    check_left_padding_matches_transformers(hf, from_hf_model(hf).eval(), batch(seed=6)[0])


def test_cast_keeps_rope_frequencies_float32():
    sf = from_hf_model(hf_model(seed=10)).eval()
    b, _ = batch(seed=10)
    sf16 = sf.to(torch.bfloat16)
    rope = sf16.model.rotary_emb
    assert rope.inv_freq.dtype == torch.float32 and torch.equal(rope.inv_freq, rope_inv_freq(sf.config))
    assert sf16.model.embed_tokens.weight.dtype == torch.bfloat16
    assert rope(300).dtype == torch.float32
    with torch.no_grad():
        ref = cast(hf_model(seed=10, dtype=torch.bfloat16), torch.float32)(**b).logits
        out = sf16(**b).logits
    m = b["attention_mask"]
    assert rel_error(real(out, m), real(ref, m)) <= 2e-2


def test_shift_labels():
    labels = torch.tensor([5, 6, 7, 8, 9, -100])
    cu = torch.tensor([0, 2, 5, 6], dtype=torch.int32)
    assert shift_labels(labels, cu).tolist() == [6, -100, 8, 9, -100, -100]
    assert shift_labels(labels[None]).tolist() == [[6, 7, 8, 9, -100, -100]]


def test_num_items_in_batch_and_hidden_states():
    sf = from_hf_model(hf_model(seed=7)).eval()
    b, _ = batch(seed=7)
    n = int((b["labels"][:, 1:] != -100).sum())
    with torch.no_grad():
        mean = sf(**b).loss
        summed = sf(**b, num_items_in_batch=2 * n).loss
        out = sf(**b, output_hidden_states=True)
    assert abs(summed.item() - mean.item() / 2) <= 1e-6 * mean.item()
    assert len(out.hidden_states) == 3 and out.hidden_states[-1].shape == (3, 40, 64)


def test_activation_checkpointing_same_loss_and_grads():
    check_activation_checkpointing(from_hf_model(hf_model(seed=8)).train(), batch(seed=8)[0])


# ------------------------------------------------------------ bad inputs
def test_bad_inputs_are_named():
    b, seqs = batch(seed=9)
    check_bad_inputs_named(from_hf_model(hf_model(seed=9)).eval(), b, seqs, "SeqfuseLlama")


# ------------------------------------------------------------------ config
@pytest.mark.parametrize("kw,err,match", [
    (dict(hidden_act="gelu"), NotImplementedError, "hidden_act"),
    (dict(attention_bias=True), NotImplementedError, "attention_bias"),
    (dict(mlp_bias=True), NotImplementedError, "mlp_bias"),
    (dict(num_key_value_heads=3), ValueError, "num_key_value_heads"),
    (dict(rope=dict(rope_type="linear", rope_theta=1e4, factor=2.0)), NotImplementedError, "rope_type"),
    (dict(rope=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5)), NotImplementedError,
     "partial_rotary_factor"),
])
def test_unrepresentable_config_is_refused(kw, err, match):
    cfg = tiny_config(**kw)
    with pytest.raises(err, match=match):
        from_hf_config(cfg)
    with pytest.raises(err, match=match):
        from_hf_model(transformers.LlamaForCausalLM(cfg))


def test_config_round_trip_and_unknown_fields():
    cfg = tiny_config(tie=True)
    ours = from_hf_config(cfg)
    assert isinstance(ours, SeqfuseLlamaConfig) and ours.model_type == "seqfuse_llama"
    back = to_hf_config(ours)
    assert type(back) is transformers.LlamaConfig
    a, b = cfg.to_dict(), back.to_dict()
    assert a == b
    odd = tiny_config()
    odd.sliding_window = 4
    with pytest.raises(NotImplementedError, match="sliding_window"):
        from_hf_config(odd)
    with pytest.raises(TypeError, match="LlamaConfig"):
        from_hf_config(transformers.BertConfig())
    with pytest.raises(ValueError, match="attn_input_format"):
        SeqfuseLlamaConfig(attn_input_format="sbhd")


#: Parameter counts of the published checkpoints, in billions (model cards:
#: Llama 3.2 1B 1.24, 3B 3.21, Llama 3.1 8B 8.03).
PUBLISHED_B = {"1B": 1.236, "3B": 3.213, "8B": 8.030}


@pytest.mark.parametrize("size", sorted(PUBLISHED_B))
def test_llama3_shapes_parameter_counts(size):
    cfg = llama3_config(size)
    with torch.device("meta"):
        model = SeqfuseLlamaForCausalLM(cfg)
    n = sum(p.numel() for p in model.parameters()) / 1e9  # tied weights counted once
    assert abs(n - PUBLISHED_B[size]) <= 0.005, n
    with pytest.raises(ValueError, match="size"):
        llama3_config("2B")


# -------------------------------------------------------------------- CUDA
def cuda_batch(lengths, seed):
    b, seqs = batch(lengths, seed)
    return {k: v.cuda() for k, v in b.items()}, [s.cuda() for s in seqs]


CUDA_LENGTHS = (512, 381, 200, 77)


@pytest.mark.cuda
@pytest.mark.parametrize("tie", [False, True])
def test_cuda_bf16_golden(tie):
    """bf16 on the GPU, 4 layers, head dim 64, 4 sequences up to 512 tokens:
    seqfuse vs transformers (sdpa) with the same bf16 weights, both against
    transformers in float32.  Bounds: seqfuse's logits' relative error
    <= max(2 x transformers' own, 1e-2), loss within 1 % of float32's;
    gradients against float32 transformers' within max(2 x transformers'
    bf16 gradients' error, 2e-2)."""
    kw = dict(tie=tie, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512,
              num_hidden_layers=4)
    hf32 = cast(hf_model(seed=11, dtype=torch.bfloat16, **kw), torch.float32).cuda()
    hf16 = hf_model(seed=11, dtype=torch.bfloat16, **kw).cuda()
    sf = from_hf_model(hf16).eval()
    b, _ = cuda_batch(CUDA_LENGTHS, seed=11)
    ref = hf32(**b)
    base = hf16(**b)
    out = sf(**b)
    m = b["attention_mask"]
    err_sf = rel_error(real(out.logits, m), real(ref.logits, m))
    err_hf = rel_error(real(base.logits, m), real(ref.logits, m))
    print(f"bf16 logits rel. error vs fp32: seqfuse {err_sf:.2e}, transformers {err_hf:.2e}")
    assert err_sf <= max(2 * err_hf, 1e-2)
    assert abs(out.loss.item() - ref.loss.item()) <= 1e-2 * ref.loss.item()
    for loss in (ref.loss, base.loss, out.loss):
        loss.backward()
    mapped = hf_grads_in_seqfuse_names(hf32, hf_to_seqfuse_state_dict, sf.config)
    mapped16 = hf_grads_in_seqfuse_names(hf16, hf_to_seqfuse_state_dict, sf.config)
    for name, p in sf.named_parameters():
        err_sf, err_hf = rel_error(p.grad, mapped[name]), rel_error(mapped16[name], mapped[name])
        assert err_sf <= max(2 * err_hf, 2e-2), (name, err_sf, err_hf)


def packed_padded_against_cpu(device, kw, lengths, seed):
    """seqfuse bf16 on ``device`` (the CUDA attention takes fp16/bf16 only),
    padded and packed, against the CPU backend in float32 with the same
    (bf16-representable) weights, the definition of correct; transformers
    bf16 (sdpa) on ``device`` against the same reference gives the bound.
    Returns the errors: {seqfuse padded, seqfuse packed, transformers}, and
    the losses {reference, padded, packed}."""
    hf16 = hf_model(seed=seed, dtype=torch.bfloat16, **kw).to(device)
    hf32 = cast(hf_model(seed=seed, dtype=torch.bfloat16, **kw), torch.float32)
    sf_cpu = from_hf_model(hf32).eval()
    sf = from_hf_model(hf16).eval()
    assert {p.dtype for p in sf.parameters()} == {torch.bfloat16}
    b, seqs = batch(lengths, seed)
    bd = {k: v.to(device) for k, v in b.items()}
    with torch.no_grad():
        cpu = sf_cpu(**b)
        ref_hf = hf32(**b)
        base = hf16(**bd)
        padded = sf(**bd)
        ids, cu, _ = packed(seqs)
        thd = sf(input_ids=ids.to(device), labels=ids.to(device), cu_seqlens=cu.to(device))
    assert padded.logits.dtype == thd.logits.dtype == torch.bfloat16
    m = b["attention_mask"]
    # the CPU float32 reference is transformers' float32 model (1e-5, as the CPU tests check)
    assert rel_error(real(cpu.logits, m), real(ref_hf.logits, m)) <= 1e-5
    ref = real(cpu.logits, m)
    errs = dict(padded=rel_error(real(padded.logits, m.to(device)), ref), packed=rel_error(thd.logits, ref),
                hf=rel_error(real(base.logits, m.to(device)), ref))
    losses = dict(ref=cpu.loss.item(), padded=padded.loss.item(), packed=thd.loss.item())
    return errs, losses


@pytest.mark.cuda
def test_cuda_packed_matches_padded_and_cpu():
    """bf16 on the GPU, padded bshd and packed thd, each against the CPU
    backend in float32 (same bf16-representable weights): logits' relative
    error <= max(2 x transformers' own bf16 (sdpa) error against that
    reference, 1e-2), losses within 1 %; packed and padded within 1e-2 of
    each other (same kernels, other layout)."""
    kw = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512)
    errs, losses = packed_padded_against_cpu("cuda", kw, CUDA_LENGTHS, seed=12)
    print(f"bf16 logits rel. error vs CPU fp32: {errs}; losses {losses}")
    bound = max(2 * errs["hf"], 1e-2)
    assert errs["padded"] <= bound and errs["packed"] <= bound, (errs, bound)
    for k in ("padded", "packed"):
        assert abs(losses[k] - losses["ref"]) <= 1e-2 * losses["ref"], losses
    assert abs(losses["packed"] - losses["padded"]) <= 1e-2 * losses["padded"], losses


@pytest.mark.cuda
@needs_fp8
def test_cuda_fp8_delayed_scaling_loss_close_to_bf16():
    """FP8 (delayed scaling, E4M3 forward) on the layers' GEMMs of a bf16
    model (the CUDA attention takes bf16): loss within 5 % of bf16's, and a
    backward that reaches every parameter with finite bf16 gradients."""
    from seqfuse.common.recipe import DelayedScaling
    from seqfuse.pytorch import fp8_autocast

    kw = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512)
    sf = from_hf_model(hf_model(seed=13, dtype=torch.bfloat16, **kw).cuda()).train()
    assert {p.dtype for p in sf.parameters()} == {torch.bfloat16}
    b, _ = cuda_batch((512, 384, 256, 128), seed=13)
    with torch.no_grad():
        base = sf(**b).loss.item()
    with fp8_autocast(enabled=True, fp8_recipe=DelayedScaling()):
        out = sf(**b)
    assert out.logits.dtype == torch.bfloat16
    out.loss.backward()
    print(f"loss bf16 {base:.4f}, FP8 delayed {out.loss.item():.4f}")
    assert out.loss.item() != base  # the GEMMs did run in FP8
    assert abs(out.loss.item() - base) <= 5e-2 * base
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 and torch.isfinite(p.grad).all()
               for p in sf.parameters())


def test_training_keeps_the_counted_activations_per_layer():
    """What one decoder layer keeps for its backward, counted by saved-tensor
    hooks in [tokens, hidden] units (hidden 256, 8 query heads and 2
    key-value heads of 32, SwiGLU over 512): the QKV module's input (1),
    attention's q (1), k and v (0.25 each) and output (1, also the
    projection's input), the MLP's input (1), FC1's gate and up (4) and the
    SwiGLU output (2): 10.5.  Kept no more: the norm outputs (made again in
    the backward) and the QKV projection's output (attention gets a copy of
    v, so rotated q and k do not leave the projection alive)."""
    tokens, hidden = 256, 256
    kept = {}
    for layers in (1, 2):
        torch.manual_seed(0)
        cfg = tiny_config(hidden_size=hidden, num_attention_heads=8, num_key_value_heads=2, intermediate_size=512,
                          num_hidden_layers=layers)
        model = from_hf_model(transformers.LlamaForCausalLM(cfg))
        ids = torch.randint(1, VOCAB, (1, tokens))
        kept[layers] = saved_activation_bytes(model, lambda: model(input_ids=ids, labels=ids))
    units = (kept[2] - kept[1]) / (tokens * hidden * 4)
    assert 10.5 <= units < 10.75, units  # (+ the norms' statistics and attention's softmax sums: [tokens] each)
