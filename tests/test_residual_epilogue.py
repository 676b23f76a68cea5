"""Residual adds in the GEMM epilogue: ops.gemm's ``addend`` (tests/test_gemm.py
covers the op), Linear(..., residual=r) and LayerNormMLP(..., residual=r)
against the same module's output plus r (outputs and every gradient; float32
on the CPU bit for bit, bf16 and FP8 on the GPU within one rounding of the
output), FP8 row counts that are not multiples of 16 and unaligned residuals
(copied into an aligned padded buffer for the same epilogue, logged once),
LayerNormMLP's own input as residual (its gradient added in the norm's
backward), TransformerLayer, the arguments' rules, and the fused
transformers decoder layer, whose residual branches end in those epilogues
when no dropout is active."""
import contextlib
import copy
import logging

import pytest
import torch

import seqfuse.pytorch as te
from seqfuse.common.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format
from seqfuse.quantization import autocast

from helpers import needs_fp8, rel_error

RECIPES = {"none": None, "delayed": DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4),
           "current": Float8CurrentScaling(), "block": Float8BlockScaling()}


def _fp8_param(name):
    return pytest.param(name, marks=needs_fp8) if name != "none" else name


def _module(kind, hidden, dtype, device, **kw):
    torch.manual_seed(1)
    if kind == "Linear":
        return te.Linear(hidden, hidden, params_dtype=dtype, device=device, **kw)
    return te.LayerNormMLP(hidden, 2 * hidden, normalization="RMSNorm", activation="swiglu", bias=False,
                           params_dtype=dtype, device=device, **kw)


def _both_ways(m, x, r, dy, recipe, steps=2):
    """(output, grads of x, r and every parameter) of ``m(x, residual=r)`` and
    of ``m(x) + r`` on copies of m, each run ``steps`` times (FP8: the later
    steps on an amax history)."""
    results = []
    for fused in (True, False):
        mc = copy.deepcopy(m)
        for _ in range(steps):
            xc, rc = x.detach().clone().requires_grad_(), r.detach().clone().requires_grad_()
            with autocast(recipe=recipe) if recipe is not None else contextlib.nullcontext():
                y = mc(xc, residual=rc) if fused else mc(xc)
            if isinstance(y, tuple):  # (output, bias and / or norm output): the residual goes to the output
                y = y[0]
            if not fused:
                y = y + rc
            for p in mc.parameters():
                p.grad = None
            y.backward(dy)
        results.append([y.detach(), xc.grad, rc.grad] + [p.grad for p in mc.parameters()])
    return results


@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP"])
@pytest.mark.parametrize("recipe", [_fp8_param(n) for n in RECIPES])
@pytest.mark.parametrize("rows", [32, 40])
def test_residual_equals_the_add_after_the_module_cpu(kind, recipe, rows):
    """float32 on the CPU: the epilogue adds in float32 before the one
    rounding, as the add after it does: the same bits, outputs and
    gradients (the residual's gradient is the output's).  (Block scaling:
    features of 128.)"""
    h = 128 if recipe == "block" else 64
    m = _module(kind, h, torch.float32, "cpu")
    x, r, dy = torch.randn(rows, h), torch.randn(rows, h), torch.randn(rows, h)
    fused, plain = _both_ways(m, x, r, dy, RECIPES[recipe])
    for a, b in zip(fused, plain):
        assert torch.equal(a, b)
    assert torch.equal(fused[2], dy)


@pytest.mark.parametrize("option", ["checkpoint", "return_layernorm_output", "return_bias", "recompute_activation"])
@pytest.mark.parametrize("recipe", ["none", _fp8_param("delayed")])
def test_layernorm_mlp_residual_with_its_options_cpu(option, recipe):
    kw = {option: True}
    if option == "return_bias":
        kw["bias"] = True
    torch.manual_seed(1)
    m = te.LayerNormMLP(64, 128, normalization="RMSNorm", activation="swiglu", device="cpu",
                        **{"bias": False, **kw})
    x, r, dy = torch.randn(3, 16, 64), torch.randn(3, 16, 64), torch.randn(3, 16, 64)
    fused, plain = _both_ways(m, x, r, dy, RECIPES[recipe])
    for a, b in zip(fused, plain):  # (return_bias: FC2's bias has no gradient either way)
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP"])
@pytest.mark.parametrize("recipe", [_fp8_param(n) for n in RECIPES])
@pytest.mark.parametrize("rows", [4096, 1000])
def test_residual_in_the_epilogue_cuda(kind, recipe, rows):
    """bf16 on the GPU: the epilogue rounds acc + r once where the add after
    the module rounds twice; outputs within that, gradients (which do not
    depend on the add) bit for bit, the residual's gradient the output's."""
    m = _module(kind, 1024, torch.bfloat16, "cuda")
    x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
    fused, plain = _both_ways(m, x, r, dy, RECIPES[recipe])
    assert rel_error(fused[0], plain[0]) < 2 ** -8
    for a, b in zip(fused[1:], plain[1:]):
        assert torch.equal(a, b)
    assert torch.equal(fused[2], dy)


@needs_fp8
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_fp8_residual_with_padded_rows_or_unaligned_takes_the_same_epilogue(device, caplog):
    """FP8 at 40 rows (padded to 48 for the GEMMs) or with a residual at a
    2-byte offset: the residual is copied into an aligned buffer of the
    padded rows (logged once) and added in the same epilogue, so the rows
    equal those of the same rows inside an aligned batch bit for bit."""
    from seqfuse.modules import _fp8

    dt = torch.bfloat16
    m = _module("Linear", 64, dt, device)
    x, r = torch.randn(48, 64, device=device, dtype=dt), torch.randn(48, 64, device=device, dtype=dt)
    recipe = Float8CurrentScaling()  # (per-tensor scales from each call's own amax: the 40 rows' are the 48's)
    x[40:] = 0
    _fp8._logged_copied_residual.clear()
    with autocast(recipe=recipe):
        whole = m(x, residual=r)
        with caplog.at_level(logging.INFO, logger="seqfuse"):
            part = m(x[:40], residual=r[:40])
        shifted = torch.empty(48 * 64 + 1, device=device, dtype=dt)[1:].view(48, 64)
        shifted.copy_(r)
        unaligned = m(x, residual=shifted)
    assert "a residual is copied into an aligned buffer of 48 rows for its GEMM's epilogue (40 token rows" in caplog.text
    assert torch.equal(part, whole[:40])
    assert torch.equal(unaligned, whole)


@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP"])
def test_residual_rules(kind):
    m = _module(kind, 32, torch.float32, "cpu")
    x = torch.randn(4, 32)
    with pytest.raises(TypeError, match=f"{kind}: residual must be a torch.Tensor or None, got list"):
        m(x, residual=[0.0] * 32)
    with pytest.raises(ValueError, match=rf"{kind}: residual must have the output's shape \(4, 32\), got \(4, 16\)"):
        m(x, residual=torch.randn(4, 16))
    with pytest.raises(ValueError, match=rf"{kind}: residual must have the output's shape \(4, 32\), got \(128,\)"):
        m(x, residual=torch.randn(128))
    with pytest.raises(TypeError, match=f"{kind}: residual must have the output's dtype torch.float32 "
                                        r"\(the GEMM adds it in its epilogue, in the output's dtype\), got "
                                        "torch.bfloat16"):
        m(x, residual=torch.randn(4, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=f"{kind}: residual must be on the input's device cpu, got meta"):
        m(x, residual=torch.empty(4, 32, device="meta"))


transformers = pytest.importorskip("transformers")


def _llama(**kw):
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   pad_token_id=0, **kw)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _last_node(out):
    """The autograd node that made ``out``, through reshapes."""
    node = out.grad_fn
    while type(node).__name__ in ("ViewBackward0", "ReshapeAliasBackward0", "UnsafeViewBackward0"):
        node = node.next_functions[0][0]
    return type(node).__name__


def test_fused_decoder_layer_adds_its_residuals_in_the_epilogues():
    """Both residual branches of the fused Llama layer end in a GEMM whose
    epilogue adds the residual: the layer's output comes out of
    LayerNormMLP's autograd node and its attention half out of Linear's,
    with no add node; dtypes that differ (float32 hidden states under a
    bfloat16 autocast) take the add after the GEMM, logged; the model
    matches transformers either way (tests/test_hf_accelerate_fused.py)."""
    from seqfuse.hf import accelerate
    from seqfuse.hf.fuse_layers import SeqfuseDecoderLayer

    model = _llama()
    plain = copy.deepcopy(model)
    accelerate(model)
    layer = model.model.layers[0]
    assert isinstance(layer, SeqfuseDecoderLayer)
    seen = []
    layer.register_forward_hook(lambda mod, args, out: seen.append(out[0] if isinstance(out, tuple) else out))
    proj_out = []
    layer.proj.register_forward_hook(lambda mod, args, out: proj_out.append(out))
    ids = torch.randint(1, 96, (2, 12))
    out = model(input_ids=ids, labels=ids)
    assert "LayerNormMLP" in _last_node(seen[0]) and "Linear" in _last_node(proj_out[0])
    ref = plain(input_ids=ids, labels=ids)
    assert rel_error(out.loss, ref.loss) < 1e-5


def test_fused_decoder_layer_residual_rules_logged(caplog, monkeypatch):
    """The add stays after the GEMM, said once per reason: hidden states in
    another dtype than the branch computes in (float32 under a bf16
    autocast), residual dropout in training."""
    from seqfuse.common import notes
    from seqfuse.hf import accelerate

    model = _llama()
    accelerate(model)
    layer = model.model.layers[0]
    monkeypatch.setattr(notes, "_noted", set())  # this process's earlier notes forgotten
    with caplog.at_level(logging.INFO, logger="seqfuse"):
        assert not layer._residual_fusable(torch.zeros(2, dtype=torch.float32), torch.bfloat16, 0)
        assert not layer._residual_fusable(torch.zeros(2, dtype=torch.float32), torch.bfloat16, 0)
        assert layer._residual_fusable(torch.zeros(2), torch.float32, 1)
        layer.train()
        layer.resid_dropout = (0.1, 0.0)
        assert not layer._residual_fusable(torch.zeros(2), torch.float32, 0)
        assert layer._residual_fusable(torch.zeros(2), torch.float32, 1)
    said = [r.getMessage() for r in caplog.records if "residual adds" in r.getMessage()]
    assert said == ["seqfuse fused decoder layer: residual adds run after the GEMMs, not in their epilogues: the "
                    "hidden states are torch.float32 and the branch computes in torch.bfloat16 (autocast)",
                    "seqfuse fused decoder layer: residual adds run after the GEMMs, not in their epilogues: "
                    "residual dropout in training"]


def test_multihead_attention_residual_in_another_dtype_is_added_after(caplog, monkeypatch):
    """MultiheadAttention's residual in another dtype than the output
    projection computes in (float32 hidden states and parameters under a
    bfloat16 torch.autocast) is added after the GEMM, as x + mha(x) adds it
    (it raised the Linear's dtype rule before), said once in a log line; the
    pre-norm case (the residual is hidden_states) included, gradients too."""
    from seqfuse.common import notes

    monkeypatch.setattr(notes, "_noted", set())
    torch.manual_seed(0)
    mha = te.MultiheadAttention(32, 2, attention_dropout=0.0, qkv_format="bshd", attn_mask_type="causal",
                                input_layernorm=True, device="cpu")
    x = torch.randn(2, 5, 32, requires_grad=True)
    other = torch.randn(2, 5, 32)
    with caplog.at_level(logging.INFO, logger="seqfuse"), torch.autocast("cpu", dtype=torch.bfloat16):
        for r in (x, other):
            out = mha(x, residual=r)
            grad = torch.autograd.grad(out.sum(), x)[0]
            ref = r + mha(x)
            assert out.dtype == ref.dtype == torch.float32 and torch.equal(out, ref)
            assert torch.equal(grad, torch.autograd.grad(ref.sum(), x)[0])
    said = [m for m in (r.getMessage() for r in caplog.records) if "residual adds" in m]
    assert said == ["MultiheadAttention: residual adds run after the GEMMs, not in their epilogues: the hidden "
                    "states are torch.float32 and the branch computes in torch.bfloat16 (autocast)"]


@pytest.mark.parametrize("recipe", ["none", _fp8_param("delayed")])
@pytest.mark.parametrize("fmt", ["bshd", "thd"])
def test_transformer_layer_residuals_in_the_epilogues_cpu(recipe, fmt, monkeypatch):
    """TransformerLayer with hidden_dropout 0: both residual adds in the GEMM
    epilogues (attention's projection, the MLP's FC2), the same output bits
    as the adds after them (float32); the MLP block's input gradient is the
    norm's dx plus the output's gradient rounded once (not twice), which the
    gradients upstream of it carry (float32 rounding; FP8: its casts of those
    gradients); with hidden dropout in training the adds stay after the
    GEMMs."""
    from seqfuse.modules import transformer_layer as tl

    torch.manual_seed(2)
    m = te.TransformerLayer(64, 128, 4, hidden_dropout=0.0, attention_dropout=0.0, normalization="RMSNorm",
                            activation="swiglu", self_attn_mask_type="causal" if fmt == "bshd" else "padding_causal",
                            attn_input_format=fmt, device="cpu")
    shape = (2, 16, 64) if fmt == "bshd" else (32, 64)
    kw = {} if fmt == "bshd" else dict(cu_seqlens_q=torch.tensor([0, 12, 32], dtype=torch.int32),
                                       cu_seqlens_kv=torch.tensor([0, 12, 32], dtype=torch.int32),
                                       max_seqlen_q=20, max_seqlen_kv=20)
    x, dy = torch.randn(*shape), torch.randn(*shape)
    calls = []
    results = []
    for fused in (True, False):
        mc = copy.deepcopy(m)
        if not fused:
            monkeypatch.setattr(tl.TransformerLayer, "_residual_fusable", lambda self, r, d: False)
        for _ in range(2):
            xc = x.clone().requires_grad_()
            with autocast(recipe=RECIPES[recipe]) if recipe != "none" else contextlib.nullcontext():
                y = mc(xc, **kw)
            calls.append(type(y.grad_fn).__name__)
            for p in mc.parameters():
                p.grad = None
            y.backward(dy)
        results.append([y.detach(), xc.grad] + [p.grad for p in mc.parameters()])
    assert "LayerNormMLP" in calls[0] and "Add" in calls[-1]
    assert torch.equal(results[0][0], results[1][0]) or recipe != "none"
    for a, b in zip(*results):  # (atol: the key bias's gradient is 0 up to rounding: softmax ignores it)
        assert (a is None and b is None) or torch.allclose(a, b, rtol=1e-5 if recipe == "none" else 2e-2,
                                                           atol=1e-5 if recipe == "none" else 1e-3)
    monkeypatch.undo()
    m.hidden_dropout = 0.1
    m.train()
    assert not m._residual_fusable(x, x.dtype)
    m.eval()
    assert m._residual_fusable(x, x.dtype)
    m.apply_residual_connection_post_layernorm = True
    assert not m._residual_fusable(x, x.dtype)
    m.apply_residual_connection_post_layernorm, m.parallel_attention_mlp = False, True
    assert not m._residual_fusable(x, x.dtype)


def test_residual_storage_and_dres_rules():
    """A residual whose storage was shrunk under it is refused naming the
    module's argument (not read past its end: the FP8 padded-rows copy, a
    strided view's copy); a dres that is no tensor names 'dres'."""
    from seqfuse.ops import norm as norm_ops

    m = _module("Linear", 32, torch.float32, "cpu")
    x = torch.randn(4, 32)
    for r in (torch.randn(4, 32), torch.randn(4, 64)[:, ::2]):
        r.untyped_storage().resize_(16)
        with pytest.raises(ValueError, match="Linear: residual needs .* bytes of storage"):
            m(x, residual=r)
    _, rstd = norm_ops.rmsnorm_forward(x, torch.ones(32), 1e-5, False)
    with pytest.raises(TypeError, match="norm backward: argument 'dres' must be a torch.Tensor or None, got list"):
        norm_ops.rmsnorm_backward(torch.ones_like(x), x, rstd, torch.ones(32), dres=[1.0])
    # (an empty product gets the C entry's checks, worded as for any product)
    with pytest.raises(TypeError, match=r"gemm: argument 'addend' must be a tensor supporting DLPack .*got list"):
        seqfuse_ops().gemm(torch.randn(4, 0), torch.randn(0, 3), addend=[0.0])


def seqfuse_ops():
    import seqfuse.ops

    return seqfuse.ops


@pytest.mark.parametrize("device,dtype", [("cpu", torch.float32),
                                          pytest.param("cuda", torch.bfloat16, marks=pytest.mark.cuda)])
@pytest.mark.parametrize("recipe", [_fp8_param(n) for n in RECIPES])
@pytest.mark.parametrize("option", [None, "checkpoint"])
def test_layernorm_mlp_own_input_as_residual(device, dtype, recipe, option):
    """mlp(x, residual=x): x's one gradient is the norm's dx plus out's
    gradient, added in the norm's backward pass (no add of two gradients
    in autograd); equal to mlp(x) + x within one rounding of that sum."""
    kw = {option: True} if option else {}
    m = _module("LayerNormMLP", 256 if device == "cuda" or recipe == "block" else 64, dtype, device, **kw)
    h = m.hidden_size
    x = torch.randn(96, h, device=device, dtype=dtype)
    dy = torch.randn(96, h, device=device, dtype=dtype)
    outs = []
    for fused in (True, False):
        mc = copy.deepcopy(m)
        for _ in range(2):
            xc = x.clone().requires_grad_()
            with autocast(recipe=RECIPES[recipe]) if recipe != "none" else contextlib.nullcontext():
                y = mc(xc, residual=xc) if fused else mc(xc) + xc
            for p in mc.parameters():
                p.grad = None
            y.backward(dy)
        outs.append([y.detach(), xc.grad] + [p.grad for p in mc.parameters()])
    tol = 1e-6 if dtype == torch.float32 else 2 ** -8
    assert rel_error(outs[0][0], outs[1][0]) <= tol
    assert rel_error(outs[0][1], outs[1][1]) <= tol  # x's gradient: (norm dx + dy) rounded once, or twice
    for a, b in zip(outs[0][2:], outs[1][2:]):  # the parameters' gradients do not see the residual
        assert torch.equal(a, b)


# ------------------------------------------------------------------ the attention block's residual gradient
def _dres_calls(monkeypatch):
    """The norm backward calls made through seqfuse.modules (LayerNormLinear's
    and LayerNormMLP's): whether each got a residual gradient (dres)."""
    from seqfuse.modules import layernorm_linear, layernorm_mlp

    seen = []
    for mod in (layernorm_linear, layernorm_mlp):
        real = mod.norm_backward

        def spy(*args, real=real, who=mod.__name__.rsplit(".", 1)[1], **kw):
            seen.append((who, kw.get("dres") is not None))
            return real(*args, **kw)
        monkeypatch.setattr(mod, "norm_backward", spy)
    return seen


@pytest.mark.parametrize("recipe", ["none", _fp8_param("delayed")])
@pytest.mark.parametrize("options", [{}, dict(return_bias=True), dict(return_layernorm_output=True)])
def test_layernorm_linear_input_alias(recipe, options, monkeypatch):
    """LayerNormLinear(x, return_input_alias=True) returns, last, a view of x
    (no copy); a gradient reaching the alias is added to x's in the norm
    backward (dres), and every gradient equals the module's plus x's
    gradient summed by autograd (float32, also under FP8 delayed scaling
    from one state: the same values up to one rounding of the sum)."""
    torch.manual_seed(3)
    m = te.LayerNormLinear(64, 64, normalization="RMSNorm", params_dtype=torch.float32, **options)
    proj = te.Linear(64, 64, params_dtype=torch.float32)
    x, dy = torch.randn(32, 64), torch.randn(32, 64)
    seen = _dres_calls(monkeypatch)
    grads = []
    fresh = (copy.deepcopy(m), copy.deepcopy(proj))  # each path from the same FP8 scaling state
    for alias in (True, False):
        m, proj = copy.deepcopy(fresh[0]), copy.deepcopy(fresh[1])
        xc = x.clone().requires_grad_()
        with autocast(recipe=RECIPES[recipe]) if recipe != "none" else contextlib.nullcontext():
            outs = m(xc, return_input_alias=alias)
            outs = outs if isinstance(outs, tuple) else (outs,)
            if alias:
                assert outs[-1].data_ptr() == xc.data_ptr() and torch.equal(outs[-1], xc)
                assert len(outs) == 1 + len(options) + 1
                if options.get("return_bias"):  # TE's order: output, bias, (norm output,) then the alias
                    assert outs[1] is m.bias
                if options.get("return_layernorm_output"):
                    assert outs[1].shape == xc.shape and not torch.equal(outs[1], xc)
                y = proj(outs[0], residual=outs[-1])
            else:
                y = proj(outs[0]) + xc
        y.backward(dy)
        grads.append([y.detach(), xc.grad] + [p.grad for p in list(m.parameters()) + list(proj.parameters())])
    assert seen == [("layernorm_linear", True), ("layernorm_linear", False)]
    tol = 1e-6  # (FP8: the same casts of the same values in both paths, so the same float32 sums)
    for a, b in zip(*grads):
        assert (a is None and b is None) or torch.allclose(a, b, rtol=tol, atol=tol)
    # no gradient reaches the alias (it is not used): the backward adds nothing
    seen.clear()
    out, alias = m(x.clone().requires_grad_(), return_input_alias=True)[::len(options) + 1]
    (out[0] if isinstance(out, tuple) else out).sum().backward()
    assert seen == [("layernorm_linear", False)]


@pytest.mark.parametrize("recipe", ["none", _fp8_param("delayed")])
def test_pre_norm_blocks_add_both_residual_gradients_in_the_norms(recipe, monkeypatch):
    """A pre-norm TransformerLayer (no hidden dropout) and the fused
    transformers decoder layer: both norm backwards (attention's QKV norm
    and the MLP's) take their block's residual gradient (dres), so the
    layer's backward has no residual add of its own; under no_grad no alias
    is made."""
    from seqfuse.hf import accelerate

    torch.manual_seed(4)
    layer = te.TransformerLayer(64, 128, 4, hidden_dropout=0.0, attention_dropout=0.0, normalization="RMSNorm",
                                activation="swiglu", self_attn_mask_type="causal", attn_input_format="bshd")
    seen = _dres_calls(monkeypatch)
    x = torch.randn(2, 16, 64, requires_grad=True)
    with autocast(recipe=RECIPES[recipe]) if recipe != "none" else contextlib.nullcontext():
        y = layer(x)
    y.backward(torch.randn_like(y))
    assert sorted(seen) == [("layernorm_linear", True), ("layernorm_mlp", True)]
    model = _llama()
    accelerate(model)
    seen.clear()
    ids = torch.randint(1, 96, (2, 12))
    model(input_ids=ids, labels=ids).loss.backward()
    n = len(model.model.layers)
    assert sorted(seen) == [("layernorm_linear", True)] * n + [("layernorm_mlp", True)] * n
    seen.clear()
    with torch.no_grad():
        model(input_ids=ids)
    assert not seen
