"""Transformer Engine arguments that seqfuse's TE-named modules took but
ignored or computed differently, each honoured as TE computes it or
refused naming the argument, the value and why:

- window_size=(-1, 0) with a non-causal attn_mask_type: TE reads it as "no
  window" for that mask (full attention, with a warning); seqfuse attended
  causally.  Now read as TE reads it, logged once (DotProductAttention,
  MultiheadAttention, TransformerLayer; constructor or per call).
- fuse_wgrad_accumulation=True with is_first_microbatch=True, or a weight
  whose ``overwrite_main_grad`` is True: TE writes dW into main_grad
  (overwrites); seqfuse added it to what main_grad held (Linear,
  LayerNormLinear, LayerNormMLP and GroupedLinear).
- GroupedLinear's get_rng_state_tracker / rng_tracker_name: TE draws the
  weights inside the tracker's fork; seqfuse ignored both (and ``name``).
  GroupedLinear(device="meta").reset_parameters() left the parameters on the
  meta device; TE materialises them.
- TransformerLayer's cu_seqlens_kv / max_seqlen_kv: TE's self-attention takes
  the query's (cu_seqlens_q, max_seqlen_q) for its keys and hands
  cu_seqlens_q / cu_seqlens_kv to the decoder's cross-attention; seqfuse gave
  the self-attention the encoder's key lengths and the cross-attention none.
- LayerNormLinear / LayerNormMLP under torch.autocast: TE computes in the
  autocast dtype (input, norm and GEMM parameters cast); seqfuse computed in
  the input's dtype (float32 GEMMs under a bfloat16 autocast).  The bias
  that return_bias hands back is in the output's dtype (TE's
  cast_if_needed), in Linear too.
"""
import contextlib

import pytest
import torch

import seqfuse.pytorch as te
from helpers import needs_fp8, rel_tol, seeded_rng_tracker
from seqfuse.common.recipe import Float8CurrentScaling
from test_te_api import close
from test_transformer_layer import make_layer, pad_mask, reference_layer


def _cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


# ---------------------------------------------------------------- window_size (-1, 0) without a causal mask
def _qkv(b=2, s=6, h=2, d=8):
    g = torch.Generator().manual_seed(3)
    return tuple(torch.randn(b, s, h, d, generator=g) for _ in range(3))


@pytest.mark.parametrize("mask", ["no_mask", "padding"])
def test_causal_window_with_a_non_causal_mask_reads_as_te_reads_it(mask, caplog):
    """TE reads window_size=(-1, 0) with a non-causal mask as no window
    (full attention, with a warning); seqfuse attended causally."""
    import seqfuse.modules.te_compat as tc

    tc._window_read_logged.clear()
    q, k, v = _qkv()
    kw = dict(attention_mask=pad_mask([6, 4], 6)) if mask == "padding" else {}
    full = te.DotProductAttention(2, 8, qkv_format="bshd", attn_mask_type=mask)(q, k, v, **kw)
    causal_mask = "causal" if mask == "no_mask" else "padding_causal"
    causal = te.DotProductAttention(2, 8, qkv_format="bshd", attn_mask_type=causal_mask)(q, k, v, **kw)
    assert not torch.allclose(full, causal)
    with caplog.at_level("WARNING", logger="seqfuse"):
        built = te.DotProductAttention(2, 8, qkv_format="bshd", attn_mask_type=mask, window_size=(-1, 0))
        torch.testing.assert_close(built(q, k, v, **kw), full, rtol=0, atol=0)
        per_call = te.DotProductAttention(2, 8, qkv_format="bshd", attn_mask_type="causal")
        torch.testing.assert_close(per_call(q, k, v, attn_mask_type=mask, window_size=[-1, 0], **kw), full,
                                   rtol=0, atol=0)
    assert f"window_size=(-1, 0) with attn_mask_type='{mask}' is read as no window" in caplog.text
    x = torch.randn(2, 6, 16)
    torch.manual_seed(5)
    mha_full = te.MultiheadAttention(16, 2, attn_mask_type=mask, attention_dropout=0.0, qkv_format="bshd",
                                     device="cpu")
    mha = te.MultiheadAttention(16, 2, attn_mask_type=mask, window_size=(-1, 0), attention_dropout=0.0,
                                qkv_format="bshd", device="cpu")
    mha.load_state_dict(mha_full.state_dict())
    torch.testing.assert_close(mha(x, **kw), mha_full(x, **kw), rtol=0, atol=0)


def test_windows_te_takes_still_run():
    """(-1, 0) with a causal mask is the causal mask; a true window (>= 0,
    >= 0) with no mask is a sliding window (the refusal is of (-1, 0) alone)."""
    q, k, v = _qkv()
    causal = te.DotProductAttention(2, 8, qkv_format="bshd", attn_mask_type="causal")(q, k, v)
    same = te.DotProductAttention(2, 8, qkv_format="bshd", attn_mask_type="causal", window_size=(-1, 0))(q, k, v)
    assert torch.equal(causal, same)
    full = te.DotProductAttention(2, 8, qkv_format="bshd", attn_mask_type="no_mask")(q, k, v)
    windowed = te.DotProductAttention(2, 8, qkv_format="bshd", attn_mask_type="no_mask", window_size=(2, 0))(q, k, v)
    assert not torch.allclose(windowed, full) and not torch.allclose(windowed, causal)


# ---------------------------------------------------------------- main_grad: overwrite on the first micro-batch
def _main_grad_builders(dtype):
    return [
        lambda **kw: te.Linear(128, 64, params_dtype=dtype, device="cpu", **kw),
        lambda **kw: te.LayerNormLinear(128, 128, params_dtype=dtype, device="cpu", **kw),
        lambda **kw: te.LayerNormMLP(128, 256, activation="gelu", params_dtype=dtype, device="cpu", **kw),
        lambda **kw: te.LayerNormMLP(128, 256, activation="swiglu", normalization="RMSNorm", params_dtype=dtype,
                                     device="cpu", **kw),
        lambda **kw: te.MultiheadAttention(128, 4, input_layernorm=True, fuse_qkv_params=True, params_dtype=dtype,
                                           attention_dropout=0.0, qkv_format="bshd", device="cpu", **kw),
        lambda **kw: te.TransformerLayer(128, 256, 4, fuse_qkv_params=True, params_dtype=dtype, hidden_dropout=0.0,
                                         attention_dropout=0.0, attn_input_format="bshd", device="cpu", **kw),
    ]


def _main_grad_step(fp8, first, overwrite_attr=False, checkpoint=False):
    """For each module: a plain twin's weight gradients, and the
    fuse_wgrad_accumulation module's main_grad (started at 0.5) after one
    step with is_first_microbatch=first."""
    torch.manual_seed(41)
    dtype = torch.bfloat16 if fp8 else torch.float32
    x = torch.randn(2, 16, 128, dtype=dtype)
    ctx = (lambda: te.autocast(enabled=True, recipe=Float8CurrentScaling())) if fp8 else contextlib.nullcontext
    results = []
    for build in _main_grad_builders(dtype):
        plain, fused = build(), build(fuse_wgrad_accumulation=True)
        fused.load_state_dict(plain.state_dict())
        if checkpoint and isinstance(fused, te.LayerNormMLP):
            plain.checkpoint = fused.checkpoint = True
        for p in fused.parameters():
            if p.dim() == 2:
                p.main_grad = torch.full(p.shape, 0.5)
                p.grad_added_to_main_grad = False
                if overwrite_attr:
                    p.overwrite_main_grad = True
        for m, kw in ((plain, {}), (fused, dict(is_first_microbatch=first))):
            with ctx():
                out = m(x, **kw)
            (out[0] if isinstance(out, tuple) else out).float().pow(2).sum().backward()
        ref = dict(plain.named_parameters())
        results += [(type(fused).__name__, n, p.main_grad, ref[n].grad.float())
                    for n, p in fused.named_parameters() if p.dim() == 2]
    return results, rel_tol(dtype, 2)


@pytest.mark.parametrize("fp8", [False, pytest.param(True, marks=needs_fp8)])
@pytest.mark.parametrize("first", [True, None])
def test_first_microbatch_overwrites_main_grad(fp8, first):
    """TE: with fuse_wgrad_accumulation, is_first_microbatch=True makes the
    weight-gradient GEMM write main_grad (beta = 0), False / None add to it."""
    results, tol = _main_grad_step(fp8, first)
    for cls, name, main_grad, grad in results:
        expected = grad if first else grad + 0.5
        close(main_grad, expected, tol)


def test_later_microbatch_accumulates_and_checkpoint_overwrites():
    results, tol = _main_grad_step(False, False)
    for cls, name, main_grad, grad in results:
        close(main_grad, grad + 0.5, tol)
    results, tol = _main_grad_step(False, True, checkpoint=True)  # LayerNormMLP's recompute path
    for cls, name, main_grad, grad in results:
        close(main_grad, grad, tol)


@pytest.mark.parametrize("fp8", [False, pytest.param(True, marks=needs_fp8)])
def test_overwrite_main_grad_attribute_overwrites(fp8):
    """TE: a weight whose overwrite_main_grad is True gets main_grad written,
    not added to, whatever is_first_microbatch says."""
    results, tol = _main_grad_step(fp8, None, overwrite_attr=True)
    for cls, name, main_grad, grad in results:
        close(main_grad, grad, tol)


# ---------------------------------------------------------------- GroupedLinear's RNG tracker, name, meta
@pytest.mark.parametrize("tracker_name", [None, "expert-parallel-rng"])
def test_grouped_linear_draws_its_weights_inside_the_rng_tracker(tracker_name):
    tracker = seeded_rng_tracker(77)
    n = len(tracker.calls)
    torch.manual_seed(1)  # (not the tracker's seed: weights drawn outside the fork would differ)
    gl = te.GroupedLinear(3, 8, 4, get_rng_state_tracker=tracker, rng_tracker_name=tracker_name, name="experts",
                          device="cpu")
    assert tracker.calls[n:] == [tracker_name or "model-parallel-rng"]
    assert gl.name == "experts"
    torch.manual_seed(77)
    for g in range(3):
        assert torch.equal(getattr(gl, f"weight{g}"), torch.empty(4, 8).normal_(0.0, 0.023)), g
    assert not torch.equal(torch.randn(3), torch.randn(3))  # (the caller's generator was left going)


def test_grouped_linear_meta_device_materialises_like_direct_construction():
    torch.manual_seed(5)
    direct = te.GroupedLinear(2, 8, 4, device="cpu")
    torch.manual_seed(5)
    meta = te.GroupedLinear(2, 8, 4, device="meta")
    assert meta.weight0.is_meta
    meta.reset_parameters()
    assert not any(p.is_meta for p in meta.parameters())
    for (name, p), (_, q) in zip(direct.named_parameters(), meta.named_parameters()):
        assert torch.equal(p, q.cpu()), name
    # the experts' weights are again slices of one buffer (the device-split route reads them without a copy)
    w0, w1 = meta.weight0, meta.weight1
    assert w0.untyped_storage().data_ptr() == w1.untyped_storage().data_ptr()
    y = meta(torch.randn(3, 8, device=w0.device), [1, 2])
    assert y.shape == (3, 4) and torch.isfinite(y).all()


# ---------------------------------------------------------------- TransformerLayer's cu_seqlens
def test_transformer_layer_cu_seqlens_go_where_te_sends_them():
    """A decoder layer on a right-padded bshd batch described by cu_seqlens:
    the self-attention's keys are the decoder's tokens (cu_seqlens_q, as
    TE passes it for both), the cross-attention's keys the encoder's
    (cu_seqlens_kv)."""
    torch.manual_seed(48)
    layer = make_layer(hidden=32, ffn=48, heads=2, layer_type="decoder", mask="padding_causal")
    lengths, enc_lengths, s = [6, 4], [3, 5], 6
    x, enc = torch.randn(2, s, 32), torch.randn(2, s, 32)
    out = layer(x, encoder_output=enc, self_attn_mask_type="padding_causal", enc_dec_attn_mask_type="padding",
                cu_seqlens_q=_cu(lengths), cu_seqlens_kv=_cu(enc_lengths), max_seqlen_q=s, max_seqlen_kv=s)
    ref = reference_layer(layer, x, lengths, True, None, "gelu", "LayerNorm", 1e-5, encoder=enc,
                          enc_lengths=enc_lengths)
    for i, n in enumerate(lengths):
        close(out[i, :n], ref[i, :n])


# ---------------------------------------------------------------- torch.autocast
def _autocast_builders():
    return {
        "LayerNormLinear": lambda dt: te.LayerNormLinear(16, 24, params_dtype=dt, device="cpu"),
        "LayerNormLinear-rms-zc": lambda dt: te.LayerNormLinear(16, 24, normalization="RMSNorm",
                                                                 zero_centered_gamma=True, params_dtype=dt,
                                                                 device="cpu"),
        "LayerNormMLP-gelu": lambda dt: te.LayerNormMLP(16, 32, params_dtype=dt, device="cpu"),
        "LayerNormMLP-swiglu": lambda dt: te.LayerNormMLP(16, 32, activation="swiglu", normalization="RMSNorm",
                                                         params_dtype=dt, device="cpu"),
    }


@pytest.mark.parametrize("name", list(_autocast_builders()))
def test_norm_gemm_modules_compute_in_the_autocast_dtype(name):
    """Under torch.autocast (bfloat16) float32 modules fed float32 input
    compute what the bfloat16 module computes on the bfloat16 input (TE:
    input, norm parameters and weights cast to the autocast dtype), bit for
    bit, output and gradients."""
    torch.manual_seed(9)
    build = _autocast_builders()[name]
    m32 = build(torch.float32)
    with torch.no_grad():
        for p in m32.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    m16 = build(torch.bfloat16)
    m16.load_state_dict(m32.state_dict())
    x = torch.randn(2, 5, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m32(x)
    assert y.dtype == torch.bfloat16
    xb = x.detach().bfloat16().requires_grad_()
    yb = m16(xb)
    assert torch.equal(y, yb)
    g = torch.randn_like(yb)
    y.backward(g)
    yb.backward(g)
    assert x.grad.dtype == torch.float32 and torch.equal(x.grad, xb.grad.float())
    for (n, p), (_, q) in zip(m32.named_parameters(), m16.named_parameters()):
        assert p.grad.dtype == torch.float32, n
        assert torch.equal(p.grad.bfloat16(), q.grad), n


@pytest.mark.parametrize("cls", ["Linear", "LayerNormLinear", "LayerNormMLP"])
def test_returned_bias_is_in_the_output_dtype(cls):
    """return_bias=True under torch.autocast: the bias comes back in the
    output's dtype (TE: cast_if_needed(bias, activation_dtype)), so
    out + bias is what the module computes with the bias added; outside
    autocast with matching dtypes it is the parameter itself."""
    torch.manual_seed(10)
    m = getattr(te, cls)(16, 16, return_bias=True, device="cpu")
    x = torch.randn(3, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, bias = m(x)
    assert out.dtype == bias.dtype == torch.bfloat16
    param = m.fc2_bias if cls == "LayerNormMLP" else m.bias
    assert torch.equal(bias, param.detach().bfloat16())
    out, bias = m(x)
    assert bias is param


def test_residual_and_input_alias_keep_their_dtype_under_autocast():
    """seqfuse's residual arguments when torch.autocast casts the input:
    LayerNormMLP's residual (the input itself, or another float32 tensor)
    is added to the bfloat16 output after FC2 in float32 (torch's
    promotion), not rounded to bfloat16 for the epilogue; LayerNormLinear's
    return_input_alias hands back the caller's input itself."""
    torch.manual_seed(11)
    mlp = te.LayerNormMLP(16, 32, device="cpu")
    x = torch.randn(3, 16, requires_grad=True)
    r = torch.randn(3, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = mlp(x)
        with_input = mlp(x, residual=x)
        with_other = mlp(x, residual=r)
    assert plain.dtype == torch.bfloat16 and with_input.dtype == with_other.dtype == torch.float32
    assert torch.equal(with_input, plain.float() + x) and torch.equal(with_other, plain.float() + r)
    with_input.sum().backward()
    g = x.grad.clone()
    x.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (mlp(x).float() + x).sum().backward()
    assert torch.equal(g, x.grad)
    lnl = te.LayerNormLinear(16, 8, device="cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, alias = lnl(x, return_input_alias=True)
    assert out.dtype == torch.bfloat16 and alias is x


@needs_fp8
def test_fp8_checkpointed_mlp_overwrites_main_grad():
    """LayerNormMLP(checkpoint=True) under FP8 autocast (the whole module
    recomputed by seqfuse.quantization.checkpoint) keeps TE's overwrite rule."""
    torch.manual_seed(42)
    x = torch.randn(2, 16, 128, dtype=torch.bfloat16)
    plain = te.LayerNormMLP(128, 256, params_dtype=torch.bfloat16, checkpoint=True, device="cpu")
    fused = te.LayerNormMLP(128, 256, params_dtype=torch.bfloat16, checkpoint=True, fuse_wgrad_accumulation=True,
                            device="cpu")
    fused.load_state_dict(plain.state_dict())
    for w in (fused.fc1_weight, fused.fc2_weight):
        w.main_grad = torch.full(w.shape, 0.5)
    for m, kw in ((plain, {}), (fused, dict(is_first_microbatch=True))):
        with te.autocast(enabled=True, recipe=Float8CurrentScaling()):
            out = m(x, **kw)
        out.float().pow(2).sum().backward()
    close(fused.fc1_weight.main_grad, plain.fc1_weight.grad.float(), rel_tol(torch.bfloat16, 2))
    close(fused.fc2_weight.main_grad, plain.fc2_weight.grad.float(), rel_tol(torch.bfloat16, 2))


def test_grouped_linear_te_arguments_refused_or_noted(caplog):
    """single_grouped_weight / single_grouped_bias (one grouped parameter) are
    refused naming the argument and why; use_grouped_tensor (TE's choice of
    its own GEMM path) is taken, noted once at INFO."""
    for arg in ("single_grouped_weight", "single_grouped_bias"):
        with pytest.raises(NotImplementedError, match=rf"GroupedLinear: argument '{arg}'=True is not supported: "
                                                      "the experts'"):
            te.GroupedLinear(2, 8, 4, device="cpu", **{arg: True})
        te.GroupedLinear(2, 8, 4, device="cpu", **{arg: False})
    with caplog.at_level("INFO", logger="seqfuse"):
        a = te.GroupedLinear(2, 8, 4, device="cpu", use_grouped_tensor=True)
    assert "argument 'use_grouped_tensor'=True" in caplog.text and "changes nothing" in caplog.text
    torch.manual_seed(0)
    b = te.GroupedLinear(2, 8, 4, device="cpu")
    b.load_state_dict(a.state_dict())
    x = torch.randn(5, 8)
    assert torch.equal(a(x, [2, 3]), b(x, [2, 3]))


# ---------------------------------------------------------------- CUDA
@pytest.mark.cuda
@pytest.mark.parametrize("name", list(_autocast_builders()))
def test_cuda_norm_gemm_modules_compute_in_the_autocast_dtype(name):
    """torch.autocast("cuda") (TE reads CUDA's autocast): the float32 module on
    float32 input computes what the bfloat16 module computes on the
    bfloat16 input, bit for bit (the same kernels on the same operands)."""
    torch.manual_seed(12)
    m32 = _autocast_builders()[name](torch.float32).cuda()
    m16 = _autocast_builders()[name](torch.bfloat16).cuda()
    m16.load_state_dict(m32.state_dict())
    x = torch.randn(4, 64, 16, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = m32(x)
    xb = x.detach().bfloat16().requires_grad_()
    yb = m16(xb)
    assert y.dtype == torch.bfloat16 and torch.equal(y, yb)
    g = torch.randn_like(yb)
    y.backward(g)
    yb.backward(g)
    assert torch.equal(x.grad, xb.grad.float())
    for (n, p), (_, q) in zip(m32.named_parameters(), m16.named_parameters()):
        assert torch.equal(p.grad.bfloat16(), q.grad), n


@pytest.mark.cuda
@pytest.mark.parametrize("fp8", [False, True])
def test_cuda_first_microbatch_overwrites_main_grad(fp8):
    """The overwrite rule on the GPU (cuBLASLt's accumulating GEMMs, the FP8
    ones too): main_grad holds dW alone after is_first_microbatch=True, and
    dW added after False."""
    if fp8 and not te.is_fp8_available():
        pytest.skip("no FP8 GEMMs on this GPU")
    torch.manual_seed(43)
    x = torch.randn(2, 64, 256, device="cuda", dtype=torch.bfloat16)
    ctx = (lambda: te.autocast(enabled=True, recipe=Float8CurrentScaling())) if fp8 else contextlib.nullcontext
    for build in (lambda **kw: te.Linear(256, 128, params_dtype=torch.bfloat16, **kw),
                  lambda **kw: te.LayerNormLinear(256, 128, params_dtype=torch.bfloat16, **kw),
                  lambda **kw: te.LayerNormMLP(256, 512, activation="swiglu", params_dtype=torch.bfloat16, **kw)):
        plain, fused = build(device="cuda"), build(device="cuda", fuse_wgrad_accumulation=True)
        fused.load_state_dict(plain.state_dict())
        weights = [(n, p) for n, p in fused.named_parameters() if p.dim() == 2]
        for _, p in weights:
            p.main_grad = torch.full(p.shape, 0.5, device="cuda")
        for m, kw in ((plain, {}), (fused, dict(is_first_microbatch=True))):
            with ctx():
                out = m(x, **kw)
            out.float().pow(2).sum().backward()
        ref = dict(plain.named_parameters())
        for n, p in weights:
            close(p.main_grad, ref[n].grad.float(), rel_tol(torch.bfloat16, 2))
        with ctx():
            fused(x, is_first_microbatch=False).float().pow(2).sum().backward()
        for n, p in weights:
            close(p.main_grad, 2 * ref[n].grad.float(), rel_tol(torch.bfloat16, 4))


@pytest.mark.parametrize("fp8", [False, pytest.param(True, marks=needs_fp8)])
@pytest.mark.parametrize("first, overwrite_attr", [(True, False), (None, False), (None, True), (False, False)])
def test_grouped_linear_follows_the_main_grad_overwrite_rule(fp8, first, overwrite_attr):
    """TE's GroupedLinear, as its Linear: with fuse_wgrad_accumulation,
    is_first_microbatch=True or weights[0].overwrite_main_grad writes dW into
    main_grad (beta = 0); otherwise dW is added to it."""
    torch.manual_seed(41)
    dtype = torch.bfloat16 if fp8 else torch.float32
    splits = [32, 16, 16]
    x = torch.randn(sum(splits), 128, dtype=dtype)
    ctx = (lambda: te.autocast(enabled=True, recipe=Float8CurrentScaling())) if fp8 else contextlib.nullcontext
    plain = te.GroupedLinear(3, 128, 64, bias=False, params_dtype=dtype, device="cpu")
    fused = te.GroupedLinear(3, 128, 64, bias=False, params_dtype=dtype, device="cpu", fuse_wgrad_accumulation=True)
    fused.load_state_dict(plain.state_dict())
    for w in fused.weights():
        w.main_grad = torch.full(w.shape, 0.5)
        if overwrite_attr:
            w.overwrite_main_grad = True
    for m, kw in ((plain, {}), (fused, dict(is_first_microbatch=first))):
        with ctx():
            out = m(x, splits, **kw)
        out.float().pow(2).sum().backward()
    writes = bool(first) or overwrite_attr
    for w, r in zip(fused.weights(), plain.weights()):
        close(w.main_grad, r.grad.float() if writes else r.grad.float() + 0.5, rel_tol(dtype, 2))
