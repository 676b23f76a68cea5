"""Transformer Engine's public API as seqfuse.pytorch offers it, against torch
references (issue 22): capability queries, QK-norm, LayerNormMLP's
checkpoint / return_layernorm_output / return_bias, LayerNormLinear and
MultiheadAttention return_bias, the TransformerLayer variants (post-LN
residual, output_layernorm, parallel attention + MLP, drop path), deferred
initialisation on the meta device, the RNG tracker used for initialisation,
the norms' argument names, te.optimizers and te.ops.

Float32 on the CPU backend against float64 torch references (tolerances from
helpers.REL_TOL); the cuda-marked tests repeat the module checks in bf16 on a
GPU against the CPU module."""
import contextlib

import copy

import pytest
import torch
import torch.nn.functional as F

import seqfuse.pytorch as te
from helpers import act_reference, norm_reference, rel_error, rel_tol, rope_reference, seeded_rng_tracker
from seqfuse.common.recipe import DelayedScaling
from seqfuse.modules.te_compat import materialize_device

F32 = rel_tol(torch.float32, 4)


def close(out, ref, tol=F32):
    err = rel_error(out.double(), ref.double())
    assert err <= tol, f"relative error {err:.3g} > {tol:.3g}"


# ---------------------------------------------------------------- capability queries
def _fake_device(monkeypatch, capability, cublaslt=130100, cuda=True):
    from seqfuse import _runtime
    info = dict(_runtime.build_info(), cuda=cuda, cublaslt=cublaslt)
    monkeypatch.setattr(_runtime, "build_info", lambda: info)
    monkeypatch.setattr(_runtime, "device_info",
                        lambda: [] if capability is None else [{"index": 0, "capability": capability}])


@pytest.mark.parametrize("cap,fp8,block,bf16", [("8.0", False, False, True), ("8.9", True, False, True),
                                                ("9.0", True, True, True), ("10.0", True, False, True),
                                                ("7.5", False, False, False)])
def test_capability_queries_follow_the_device(monkeypatch, cap, fp8, block, bf16):
    _fake_device(monkeypatch, cap)
    assert te.get_device_compute_capability() == tuple(int(c) for c in cap.split("."))
    for fn, want in ((te.is_fp8_available, fp8), (te.is_fp8_block_scaling_available, block),
                     (te.is_bf16_available, bf16), (te.is_mxfp8_available, False),
                     (te.is_nvfp4_available, False)):
        assert fn() is want, fn.__name__
        ok, reason = fn(return_reason=True)
        assert ok is want and isinstance(reason, str)
        assert (reason == "") == want, (fn.__name__, reason)


def test_capability_queries_without_a_device(monkeypatch):
    _fake_device(monkeypatch, None)
    assert te.is_fp8_available(return_reason=True) == (False, te.is_fp8_available(True)[1])
    assert "no CUDA device" in te.is_fp8_available(return_reason=True)[1]
    assert te.is_bf16_available() is True  # the CPU backend computes in bf16
    with pytest.raises(RuntimeError, match="get_device_compute_capability: no CUDA device"):
        te.get_device_compute_capability()
    _fake_device(monkeypatch, "9.0", cublaslt=120800)
    assert "cuBLASLt 12.9" in te.is_fp8_block_scaling_available(return_reason=True)[1]


def test_capability_queries_initialise_nothing():
    if torch.cuda.is_initialized():
        pytest.skip("torch's CUDA was initialised by an earlier test")
    te.is_fp8_available(), te.is_bf16_available(), te.is_fp8_block_scaling_available()
    assert not torch.cuda.is_initialized()


def test_cudnn_version_and_default_recipe():
    if torch.backends.cudnn.is_available() and torch.backends.cudnn.version():
        v = torch.backends.cudnn.version()
        major, minor, patch = te.get_cudnn_version()
        assert (major * 10000 + minor * 100 + patch == v) or (major * 1000 + minor * 100 + patch == v)
    else:
        with pytest.raises(RuntimeError, match="no cuDNN"):
            te.get_cudnn_version()
    assert isinstance(te.get_default_recipe(), DelayedScaling)


# ---------------------------------------------------------------- references
def _qk_norm_ref(t, kind, eps, module):
    if kind == "L2Normalization":
        return t * torch.rsqrt(t.pow(2).sum(-1, keepdim=True) + eps)
    return norm_reference(t, module.weight.double(), None if module.bias is None else module.bias.double(), eps, kind)


def mha_reference(m, x, angles, causal=True):
    """MultiheadAttention (self, input_layernorm, bshd, separate Q/K/V
    parameters) in float64 from its own parameters."""
    x = x.double()
    lq = m.layernorm_qkv
    ln = norm_reference(x, lq.layer_norm_weight.double(),
                        None if lq.layer_norm_bias is None else lq.layer_norm_bias.double(), lq.eps, lq.normalization)
    h, g, d = m.num_attention_heads, m.num_gqa_groups, m.kv_channels
    b, s, _ = x.shape
    q = (ln @ lq.query_weight.double().T + lq.query_bias.double()).view(b, s, h, d)
    k = (ln @ lq.key_weight.double().T + lq.key_bias.double()).view(b, s, g, d)
    v = (ln @ lq.value_weight.double().T + lq.value_bias.double()).view(b, s, g, d)
    kind = m.qk_norm_type
    if kind and m.qk_norm_before_rope:
        q, k = _qk_norm_ref(q, kind, m.qk_norm_eps, m.q_norm), _qk_norm_ref(k, kind, m.qk_norm_eps, m.k_norm)
    if angles is not None:
        q, k = rope_reference(q, angles), rope_reference(k, angles)
    if kind and not m.qk_norm_before_rope:
        q, k = _qk_norm_ref(q, kind, m.qk_norm_eps, m.q_norm), _qk_norm_ref(k, kind, m.qk_norm_eps, m.k_norm)
    k, v = k.repeat_interleave(h // g, 2), v.repeat_interleave(h // g, 2)
    ctx = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=causal).transpose(1, 2).reshape(b, s, h * d)
    return ctx @ m.proj.weight.double().T + m.proj.bias.double()


def rope_angles(s, d):
    freqs = te.RotaryPositionEmbedding(d)(s)  # [s, 1, 1, d]
    return freqs, freqs[:, 0, 0, :].double()


# ---------------------------------------------------------------- QK-norm
@pytest.mark.parametrize("kind", ["RMSNorm", "LayerNorm", "L2Normalization"])
@pytest.mark.parametrize("before_rope", [False, True])
def test_qk_norm_against_torch(kind, before_rope):
    torch.manual_seed(1)
    m = te.MultiheadAttention(32, 4, num_gqa_groups=2, attention_dropout=0.0, input_layernorm=True,
                              qkv_format="bshd", qk_norm_type=kind, qk_norm_eps=1e-5,
                              qk_norm_before_rope=before_rope, device="cpu")
    if kind != "L2Normalization":  # non-trivial norm weights
        with torch.no_grad():
            for p in list(m.q_norm.parameters()) + list(m.k_norm.parameters()):
                p.uniform_(0.5, 1.5)
        assert m.q_norm is not m.k_norm
    else:
        assert m.q_norm is m.k_norm and not list(m.q_norm.parameters())
    x = torch.randn(2, 6, 32, requires_grad=True)
    freqs, angles = rope_angles(6, 8)
    out = m(x, rotary_pos_emb=freqs)
    xr = x.detach().double().requires_grad_()
    ref = mha_reference(m, xr, angles)
    close(out, ref)
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g.double())
    close(x.grad, xr.grad, rel_tol(torch.float32, 12))
    if kind != "L2Normalization":
        assert m.q_norm.weight.grad is not None and m.k_norm.weight.grad.abs().sum() > 0


def test_qk_norm_order_matters_and_bad_type():
    torch.manual_seed(2)
    kw = dict(attention_dropout=0.0, input_layernorm=True, qkv_format="bshd", qk_norm_type="LayerNorm",
              device="cpu")
    a = te.MultiheadAttention(32, 4, qk_norm_before_rope=False, **kw)
    b = te.MultiheadAttention(32, 4, qk_norm_before_rope=True, **kw)
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 6, 32)
    freqs, _ = rope_angles(6, 8)
    assert rel_error(a(x, rotary_pos_emb=freqs), b(x, rotary_pos_emb=freqs)) > 1e-3
    with pytest.raises(ValueError, match="qk_norm_type must be None or one of"):
        te.MultiheadAttention(32, 4, qk_norm_type="BatchNorm", device="cpu")


def test_transformer_layer_passes_qk_norm():
    layer = te.TransformerLayer(32, 64, 4, qk_norm_type="RMSNorm", qk_norm_eps=1e-4, qk_norm_before_rope=True,
                                device="cpu", layer_type="decoder")
    for attn in (layer.self_attention, layer.inter_attention):
        assert isinstance(attn.q_norm, te.RMSNorm) and attn.q_norm.eps == 1e-4 and attn.qk_norm_before_rope


# ---------------------------------------------------------------- LayerNormMLP
def mlp_reference(m, x):
    """LayerNormMLP in float64 torch from (detached copies of) its parameters."""
    m = _Detached(m)
    x = x.double()
    ln = norm_reference(x, m.layer_norm_weight.double(),
                        None if m.layer_norm_bias is None else m.layer_norm_bias.double(), m.eps, m.normalization,
                        m.zero_centered_gamma)
    h = ln @ m.fc1_weight.double().T + (0 if m.fc1_bias is None else m.fc1_bias.double())
    a = act_reference(m.activation, h)
    return a @ m.fc2_weight.double().T + (0 if m.fc2_bias is None else m.fc2_bias.double()), ln


class _Detached:
    """Attribute access to a module with its parameters detached (a
    reference computed from them leaves the module's gradients alone)."""

    def __init__(self, module):
        self._m = module

    def __getattr__(self, name):
        value = getattr(self._m, name)
        return value.detach() if isinstance(value, torch.Tensor) else value


class SavedBytes:
    """Bytes of the tensors autograd saves for the backward inside the block."""

    def __init__(self):
        self.nbytes = 0

    def pack(self, t):
        self.nbytes += t.numel() * t.element_size()
        return t

    @contextlib.contextmanager
    def counting(self):
        with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t):
            yield


@pytest.mark.parametrize("activation", ["gelu", "swiglu", "relu"])
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_layernorm_mlp_checkpoint_recomputes(activation, normalization):
    torch.manual_seed(3)
    plain = te.LayerNormMLP(32, 128, activation=activation, normalization=normalization, device="cpu")
    ckpt = te.LayerNormMLP(32, 128, activation=activation, normalization=normalization, checkpoint=True,
                           device="cpu")
    ckpt.load_state_dict(plain.state_dict())
    x = torch.randn(64, 32)
    outs, grads, saved = [], [], []
    for m in (plain, ckpt):
        xi = x.clone().requires_grad_()
        counter = SavedBytes()
        with counter.counting():
            y = m(xi)
        y.backward(torch.ones_like(y))
        outs.append(y)
        grads.append([xi.grad] + [p.grad for p in m.parameters()])
        saved.append(counter.nbytes)
    assert torch.equal(outs[0], outs[1])  # the same kernels, recomputed
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    ref, _ = mlp_reference(plain, x)
    close(outs[1], ref)
    fc1_out = plain.fc1_weight.shape[0]
    # not kept: FC1's output [64, fc1_out] and the activation [64, 128] (neither path keeps the norm
    # output: both make it again in the backward); kept instead: FC1's bias (for the recompute)
    assert saved[0] - saved[1] == 4 * (64 * (fc1_out + 128) - fc1_out), saved


def test_layernorm_mlp_return_layernorm_output_and_bias():
    torch.manual_seed(4)
    m = te.LayerNormMLP(32, 64, return_layernorm_output=True, return_bias=True, zero_centered_gamma=True,
                        device="cpu")
    with torch.no_grad():
        m.layer_norm_weight.uniform_(-0.5, 0.5)
        m.fc2_bias.uniform_(-1, 1)
    x = torch.randn(3, 5, 32, requires_grad=True)
    out, bias, ln = m(x)
    assert bias is m.fc2_bias or torch.equal(bias, m.fc2_bias)
    xr = x.detach().double().requires_grad_()
    ref, ln_ref = mlp_reference(m, xr)
    close(out + bias, ref)
    close(ln, ln_ref)
    # both outputs carry gradients back through the norm
    (out.sum() + (ln * 3).sum()).backward()
    ((ref - m.fc2_bias.detach().double()).sum() + (ln_ref * 3).sum()).backward()
    close(x.grad, xr.grad)
    assert m.fc2_bias.grad is None  # not added inside: the caller owns it


def test_layernorm_mlp_seq_length_changes_nothing():
    torch.manual_seed(5)
    a = te.LayerNormMLP(16, 32, device="cpu")
    b = te.LayerNormMLP(16, 32, seq_length=7, micro_batch_size=3, name="mlp", device="cpu")
    b.load_state_dict(a.state_dict())
    x = torch.randn(7, 3, 16)
    assert torch.equal(a(x), b(x)) and b.seq_length == 7 and b.name == "mlp"


def test_layernorm_linear_return_bias():
    torch.manual_seed(6)
    plain = te.LayerNormLinear(16, 24, device="cpu", return_layernorm_output=True)
    rb = te.LayerNormLinear(16, 24, device="cpu", return_layernorm_output=True, return_bias=True)
    rb.load_state_dict(plain.state_dict())
    with torch.no_grad():
        plain.bias.uniform_(-1, 1)
        rb.bias.copy_(plain.bias)
    x = torch.randn(5, 16)
    y, ln = plain(x)
    y2, bias, ln2 = rb(x)
    close(y2 + bias, y, rel_tol(torch.float32))
    assert torch.equal(ln, ln2)


def test_multihead_attention_return_bias():
    torch.manual_seed(7)
    kw = dict(attention_dropout=0.0, input_layernorm=True, qkv_format="bshd", device="cpu")
    a = te.MultiheadAttention(32, 4, **kw)
    b = te.MultiheadAttention(32, 4, return_bias=True, return_layernorm_output=True, **kw)
    b.load_state_dict(a.state_dict())
    with torch.no_grad():
        a.proj.bias.uniform_(-1, 1)
        b.proj.bias.copy_(a.proj.bias)
    x = torch.randn(2, 5, 32)
    out, bias, ln = b(x)
    close(out + bias, a(x), rel_tol(torch.float32))
    close(ln, F.layer_norm(x, (32,), b.layernorm_qkv.layer_norm_weight, b.layernorm_qkv.layer_norm_bias, 1e-5))


# ---------------------------------------------------------------- TransformerLayer variants
def _layer(**kw):
    return te.TransformerLayer(32, 64, 4, hidden_dropout=0.0, attention_dropout=0.0, attn_input_format="bshd",
                               self_attn_mask_type="causal", device="cpu", **kw)


def test_post_layernorm_residual():
    torch.manual_seed(8)
    layer = _layer(apply_residual_connection_post_layernorm=True)
    x = torch.randn(2, 5, 32)
    out = layer(x)
    attn, ln1 = layer.self_attention(x)
    h = ln1 + attn
    mlp, ln2 = layer.layernorm_mlp(h)
    close(out, ln2 + mlp, rel_tol(torch.float32))
    sa = layer.self_attention.layernorm_qkv
    close(ln1, F.layer_norm(x, (32,), sa.layer_norm_weight, sa.layer_norm_bias, 1e-5))


def test_output_layernorm_is_post_ln():
    torch.manual_seed(9)
    layer = _layer(output_layernorm=True, normalization="RMSNorm")
    assert not layer.self_attention.input_layernorm and isinstance(layer.layernorm, te.RMSNorm)
    with torch.no_grad():
        layer.layernorm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 5, 32)
    h = x + layer.self_attention(x)
    ref = h + layer.layernorm_mlp(h)
    ref = ref * torch.rsqrt(ref.pow(2).mean(-1, keepdim=True) + 1e-5) * layer.layernorm.weight
    close(layer(x), ref)


def test_parallel_attention_mlp():
    torch.manual_seed(10)
    layer = _layer(parallel_attention_mlp=True)
    x = torch.randn(2, 5, 32)
    close(layer(x), x + layer.self_attention(x) + layer.layernorm_mlp(x), rel_tol(torch.float32))
    with pytest.raises(NotImplementedError, match="parallel_attention_mlp"):
        _layer(parallel_attention_mlp=True, output_layernorm=True)


def test_drop_path_is_te_droppath():
    torch.manual_seed(11)
    layer = _layer(drop_path_rate=0.5)
    x = torch.randn(8, 5, 32)
    layer.eval()
    close(layer(x), _layer_ref_eval(layer, x), rel_tol(torch.float32))  # off in eval
    layer.train()
    torch.manual_seed(12)
    out = layer(x)
    torch.manual_seed(12)  # the same draws, in the layer's order: attention branch, then MLP branch
    attn = layer.self_attention(x)
    keep1 = (0.5 + torch.rand(8, 1, 1)).floor()
    h = x + attn / 0.5 * keep1
    mlp = layer.layernorm_mlp(h)
    keep2 = (0.5 + torch.rand(8, 1, 1)).floor()
    close(out, h + mlp / 0.5 * keep2, rel_tol(torch.float32))
    assert 0 < keep1.sum() + keep2.sum() < 16  # some samples dropped, some kept (seeded)


def _layer_ref_eval(layer, x):
    h = x + layer.self_attention(x)
    return h + layer.layernorm_mlp(h)


# ---------------------------------------------------------------- deferred initialisation
MODULES = {
    "Linear": lambda d: te.Linear(16, 24, device=d, parameters_split={"a": 8, "b": 16}),
    "LayerNormLinear": lambda d: te.LayerNormLinear(16, 24, device=d, normalization="RMSNorm"),
    "LayerNormMLP": lambda d: te.LayerNormMLP(16, 32, device=d, activation="swiglu"),
    "LayerNorm": lambda d: te.LayerNorm(16, device=d, zero_centered_gamma=True),
    "RMSNorm": lambda d: te.RMSNorm(16, device=d),
    "MultiheadAttention": lambda d: te.MultiheadAttention(32, 4, input_layernorm=True, qk_norm_type="LayerNorm",
                                                          device=d),
    "TransformerLayer": lambda d: te.TransformerLayer(32, 64, 4, layer_type="decoder", output_layernorm=True,
                                                      device=d),
}


@pytest.mark.parametrize("name", list(MODULES))
def test_meta_device_materialises_like_direct_construction(name):
    want = materialize_device()  # the current CUDA device where seqfuse can use one, else the CPU
    torch.manual_seed(13)
    direct = MODULES[name](want)
    torch.manual_seed(13)
    deferred = MODULES[name]("meta")
    assert all(p.is_meta for p in deferred.parameters())
    deferred.reset_parameters()
    got, ref = deferred.state_dict(), direct.state_dict()
    assert got.keys() == ref.keys()
    for k in ref:
        if isinstance(ref[k], torch.Tensor):
            assert got[k].device == ref[k].device, k
            assert torch.equal(got[k], ref[k]), k


def test_meta_model_materialises_and_trains():
    torch.manual_seed(14)
    model = torch.nn.Sequential(te.TransformerLayer(32, 64, 4, hidden_dropout=0.0, attention_dropout=0.0,
                                                    attn_input_format="bshd", device="meta"),
                                te.LayerNormLinear(32, 8, device="meta"))
    for m in model:
        m.reset_parameters()
    opt = te.optimizers.FusedAdam(model.parameters(), lr=1e-2)
    x, target = torch.randn(4, 6, 32), torch.randn(4, 6, 8)
    losses = []
    for _ in range(8):
        loss = F.mse_loss(model(x), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses


def test_rng_tracker_draws_the_initialisation():
    Tracker = seeded_rng_tracker(1234)
    torch.manual_seed(0)
    a = te.Linear(8, 8, device="cpu", get_rng_state_tracker=Tracker, rng_tracker_name="tp-rng")
    torch.manual_seed(1234)
    ref = torch.empty(8, 8).normal_(0.0, 0.023)
    assert torch.equal(a.weight, ref) and Tracker.calls == ["tp-rng"]
    b = te.LayerNormMLP(8, 16, device="cpu", get_rng_state_tracker=Tracker)
    torch.manual_seed(1234)
    w1 = torch.empty(16, 8).normal_(0.0, 0.023)
    assert torch.equal(b.fc1_weight, w1)


# ---------------------------------------------------------------- norms' TE argument names
def test_norm_argument_names():
    a = te.LayerNorm(normalized_shape=12, dtype=torch.bfloat16, device="cpu")
    b = te.RMSNorm(hidden_size=12, params_dtype=torch.bfloat16, sequence_parallel=True, device="cpu")
    assert a.weight.dtype == b.weight.dtype == torch.bfloat16 and a.weight.shape == (12,)
    assert b.weight.sequence_parallel is True
    with pytest.raises(ValueError, match="'normalized_shape' or its deprecated name 'hidden_size'"):
        te.LayerNorm(12, hidden_size=12, device="cpu")
    with pytest.raises(ValueError, match="'dtype' or its deprecated name 'params_dtype'"):
        te.RMSNorm(12, dtype=torch.float32, params_dtype=torch.float32, device="cpu")
    with pytest.raises(TypeError, match="'normalized_shape'"):
        te.LayerNorm(device="cpu")
    x = torch.randn(3, 12, dtype=torch.bfloat16)
    xd = x.double()
    close(a(x), F.layer_norm(xd, (12,), a.weight.double(), a.bias.double(), 1e-5), rel_tol(torch.bfloat16, 2))
    close(b(x), xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5), rel_tol(torch.bfloat16, 2))


# ---------------------------------------------------------------- te.DotProductAttention
def test_dot_product_attention_facade():
    torch.manual_seed(15)
    dpa = te.DotProductAttention(2, 8, qkv_format="bshd", attn_mask_type="causal", name="core")
    assert dpa.name == "core"
    q, k, v = (torch.randn(2, 5, 2, 8) for _ in range(3))
    ref = F.scaled_dot_product_attention(*(t.transpose(1, 2).double() for t in (q, k, v)), is_causal=True)
    close(dpa(q, k, v), ref.transpose(1, 2).reshape(2, 5, 16))


# ---------------------------------------------------------------- te.optimizers
def _params(dtype=torch.float32, seed=16):
    torch.manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(n, dtype=dtype)) for n in (7, 130, 33)]
    for p in ps:
        p.grad = torch.randn_like(p)
    return ps


@pytest.mark.parametrize("adam_w_mode,wd", [(True, 0.1), (True, 0.0), (False, 0.0)])
def test_fused_adam_matches_torch(adam_w_mode, wd):
    ours, theirs = _params(), _params()
    opt = te.optimizers.FusedAdam(ours, lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=wd,
                                  adam_w_mode=adam_w_mode)
    ref_cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    ref = ref_cls(theirs, lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=wd)
    for step in range(3):
        opt.step()
        ref.step()
        for p, r in zip(ours, theirs):
            close(p, r, rel_tol(torch.float32, 8))
            p.grad, r.grad = torch.randn_like(p), None
            r.grad = p.grad.clone()


def test_fused_adam_master_weights_and_defaults():
    ps = _params(torch.bfloat16)
    opt = te.optimizers.FusedAdam(ps, lr=1e-2, master_weights=True)
    assert opt.defaults["weight_decay"] == 0.0  # TE's default
    ref = [p.detach().float().clone().requires_grad_() for p in ps]
    for r, p in zip(ref, ps):
        r.grad = p.grad.float()
    torch_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.0)
    opt.step()
    torch_opt.step()
    for p, r in zip(ps, ref):
        assert opt.state[p]["master_param"].dtype == torch.float32
        close(opt.state[p]["master_param"], r, rel_tol(torch.float32, 8))
        assert torch.equal(p, r.to(torch.bfloat16))
    opt.zero_grad()
    assert all(p.grad is None for p in ps)
    keep = te.optimizers.FusedAdam(_params(), set_grad_none=False)
    keep.zero_grad()
    assert all(p.grad is not None and not p.grad.any() for g in keep.param_groups for p in g["params"])


def test_fused_adam_bf16_moments():
    """TE's exp_avg_dtype / exp_avg_sq_dtype=torch.bfloat16: the state is
    kept in bf16, as TE keeps it."""
    ps = _params()
    opt = te.optimizers.FusedAdam(ps, lr=1e-2, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()
    for p in ps:
        assert opt.state[p]["exp_avg"].dtype == opt.state[p]["exp_avg_sq"].dtype == torch.bfloat16
        assert opt.state[p]["exp_avg"].abs().sum() > 0
    # TE's state dict holds float32 moments; loading gives the bf16 ones back bit for bit
    sd = opt.state_dict()
    assert all(st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.float32 for st in sd["state"].values())
    assert all(opt.state[p]["exp_avg"].dtype == torch.bfloat16 for p in ps)  # the optimizer's own, unchanged
    again = te.optimizers.FusedAdam(_params(), lr=1e-2, exp_avg_dtype=torch.bfloat16,
                                    exp_avg_sq_dtype=torch.bfloat16)
    again.load_state_dict(sd)
    for p, q in zip(ps, (q for g in again.param_groups for q in g["params"])):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(again.state[q][key], opt.state[p][key])
    with pytest.raises(NotImplementedError, match="FusedAdam: arguments 'exp_avg_dtype'.*must be equal"):
        te.optimizers.FusedAdam(_params(), exp_avg_dtype=torch.bfloat16)
    # the master dtype matters only with master weights (TE's rule)
    te.optimizers.FusedAdam(_params(), master_weight_dtype=torch.float16)


@pytest.mark.parametrize("kw,name", [(dict(amsgrad=True), "amsgrad"), (dict(bias_correction=False), "bias_correction"),
                                     (dict(adam_w_mode=False, weight_decay=0.1), "adam_w_mode"),
                                     (dict(capturable=True), "capturable"),
                                     (dict(exp_avg_dtype=torch.float16), "exp_avg_dtype"),
                                     (dict(exp_avg_sq_dtype=torch.uint8), "exp_avg_sq_dtype"),
                                     (dict(master_weights=True, master_weight_dtype=torch.float16),
                                      "master_weight_dtype"),
                                     (dict(use_decoupled_grad=True), "use_decoupled_grad"),
                                     (dict(store_param_remainders=True), "store_param_remainders")])
def test_fused_adam_refuses_by_name(kw, name):
    with pytest.raises(NotImplementedError, match=f"FusedAdam: argument '{name}'="):
        te.optimizers.FusedAdam(_params(), **kw)


@pytest.mark.parametrize("momentum,nesterov,dampening,wd", [(0.0, False, 0.0, 0.0), (0.9, True, 0.0, 0.01),
                                                             (0.9, False, 0.1, 0.0)])
def test_fused_sgd_matches_torch(momentum, nesterov, dampening, wd, caplog):
    ours, theirs = _params(), _params()
    with caplog.at_level("INFO", logger="seqfuse"):
        opt = te.optimizers.FusedSGD(ours, lr=0.1, momentum=momentum, dampening=dampening, weight_decay=wd,
                                     nesterov=nesterov)
    ref = torch.optim.SGD(theirs, lr=0.1, momentum=momentum, dampening=dampening, weight_decay=wd,
                          nesterov=nesterov, foreach=False)
    for _ in range(3):
        opt.step()
        ref.step()
        for p, r in zip(ours, theirs):
            close(p, r, rel_tol(torch.float32, 4))
    with pytest.raises(NotImplementedError, match="FusedSGD: argument 'wd_after_momentum'="):
        te.optimizers.FusedSGD(_params(), lr=0.1, wd_after_momentum=True)
    with pytest.raises(NotImplementedError, match="FusedSGD: argument 'materialize_master_grads'="):
        te.optimizers.FusedSGD(_params(), lr=0.1, materialize_master_grads=False)


# ---------------------------------------------------------------- te.ops
def _ops_reference(seq, x):
    """The operations of a te.ops.Sequential in float64 torch, one by one."""
    x = x.double()
    for op in seq:
        if isinstance(op, (te.ops.LayerNorm, te.ops.RMSNorm)):
            kind = "RMSNorm" if isinstance(op, te.ops.RMSNorm) else "LayerNorm"
            x = norm_reference(x, op.weight.double(), None if op.bias is None else op.bias.double(), op.eps, kind,
                               op.zero_centered_gamma)
        elif isinstance(op, (te.ops.Linear, te.ops.BasicLinear)):
            x = x @ op.weight.double().T
            if getattr(op, "bias", None) is not None:
                x = x + op.bias.double()
        elif isinstance(op, te.ops.Bias):
            x = x + op.bias.double()
        elif isinstance(op, te.ops.Quantize):
            pass
        elif op.name == "reglu":  # (not in helpers.act_reference)
            a, g = x.chunk(2, dim=-1)
            x = F.relu(a) * g
        else:
            x = act_reference(op.name, x)
    return x


@pytest.mark.parametrize("case", ["mlp_swiglu", "mlp_gelu_basic", "norm_linear", "linear_bias", "loose"])
def test_ops_sequential_against_torch(case, caplog):
    torch.manual_seed(17)
    O, d = te.ops, "cpu"
    cases = {
        "mlp_swiglu": ([O.LayerNorm(16, device=d), O.Linear(16, 64, device=d), O.SwiGLU(),
                        O.Linear(32, 16, device=d)], [("LayerNormMLP", 4)]),
        "mlp_gelu_basic": ([O.RMSNorm(16, device=d, zero_centered_gamma=True), O.BasicLinear(16, 32, device=d),
                            O.GELU(), O.BasicLinear(32, 16, device=d)], [("LayerNormMLP", 4)]),
        "norm_linear": ([O.LayerNorm(16, device=d), O.BasicLinear(16, 8, device=d), O.Bias(8, device=d),
                         O.ReLU()], [("LayerNormLinear", 3), (None, 1)]),
        "linear_bias": ([O.BasicLinear(16, 8, device=d), O.Bias(8, device=d), O.SiLU(), O.Quantize()],
                        [("Linear", 2), (None, 1), (None, 1)]),
        "loose": ([O.GEGLU(), O.BasicLinear(8, 16, device=d), O.ReGLU(), O.Bias(8, device=d),
                   O.LayerNorm(8, device=d)], [(None, 1)] * 5),
    }
    ops, plan = cases[case]
    for op in ops:
        with torch.no_grad():
            for p in op.parameters():
                p.add_(torch.rand_like(p) * 0.2)  # non-trivial norm weights and biases
    with caplog.at_level("INFO", logger="seqfuse"):
        seq = O.Sequential(*ops)
    assert [(label, len(names)) for label, names in seq.plan()] == plan
    assert "te.ops.Sequential: fused" in caplog.text
    x = torch.randn(6, 16, requires_grad=True)
    out = seq(x)
    xr = x.detach().double().requires_grad_()
    ref = _ops_reference(seq, xr)
    close(out, ref)
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g.double())
    close(x.grad, xr.grad, rel_tol(torch.float32, 8))
    assert all(p.grad is not None for p in seq.parameters())
    # a deep copy runs on its own parameters (the fused steps are planned again over the copies)
    twin = copy.deepcopy(seq)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
        close(twin(x.detach()), _ops_reference(twin, x.detach()))


def test_ops_initialisation_and_refusals():
    torch.manual_seed(18)
    lin = te.ops.BasicLinear(12, 7, device="cpu")
    torch.manual_seed(18)
    ref = torch.nn.Linear(12, 7, bias=False)  # Kaiming-uniform, a = sqrt(5): TE's
    assert torch.equal(lin.weight, ref.weight)
    assert torch.equal(te.ops.Bias(5, device="cpu").bias, torch.zeros(5))
    meta = te.ops.Linear(4, 3, device="meta")
    meta.reset_parameters()
    assert not meta.weight.is_meta and not meta.bias.any()
    for make, name in ((lambda: te.ops.BasicLinear(4, 4, tensor_parallel_mode="row"), "tensor_parallel_mode"),
                       (lambda: te.ops.LayerNorm(4, sm_margin=2), "sm_margin"),
                       (lambda: te.ops.GELU(cache_quantized_input=True), "cache_quantized_input")):
        with pytest.raises(NotImplementedError, match=f"argument '{name}'="):
            make()
    with pytest.raises(TypeError, match="argument 1 must be a torch.nn.Module"):
        te.ops.Sequential(te.ops.GELU(), "relu")
    q = te.ops.Sequential(te.ops.Quantize())
    x = torch.randn(3, 4)
    assert q(x) is x
    with te.autocast(enabled=True, recipe=DelayedScaling()):
        with pytest.raises(NotImplementedError, match="te.ops.Quantize under FP8 autocast"):
            q(x)


# ---------------------------------------------------------------- GPU
@pytest.mark.cuda
def test_cuda_modules_match_cpu():
    """QK-norm attention, the checkpointed MLP and a fused te.ops MLP in bf16
    on the GPU against the same modules on the CPU in float32."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    torch.manual_seed(19)
    mods = [te.MultiheadAttention(64, 4, input_layernorm=True, qkv_format="bshd", attention_dropout=0.0,
                                  qk_norm_type="RMSNorm", device="cpu"),
            te.LayerNormMLP(64, 256, activation="swiglu", checkpoint=True, device="cpu"),
            te.ops.Sequential(te.ops.LayerNorm(64, device="cpu"), te.ops.Linear(64, 256, device="cpu"),
                              te.ops.GELU(), te.ops.Linear(256, 64, device="cpu"))]
    x = torch.randn(2, 32, 64)
    for m in mods:
        ref = m(x)
        gpu = m.to("cuda", torch.bfloat16)
        xg = x.to("cuda", torch.bfloat16).requires_grad_()
        out = gpu(xg)
        assert rel_error(out.float().cpu(), ref) <= rel_tol(torch.bfloat16, 4)
        out.float().sum().backward()
        assert torch.isfinite(xg.grad).all()


@pytest.mark.cuda
def test_cuda_meta_materialises_on_the_current_device():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    torch.manual_seed(20)
    direct = te.TransformerLayer(64, 128, 4, device="cuda")
    torch.manual_seed(20)
    deferred = te.TransformerLayer(64, 128, 4, device="meta")
    deferred.reset_parameters()
    for (k, a), b in zip(direct.state_dict().items(), deferred.state_dict().values()):
        if isinstance(a, torch.Tensor):
            assert b.is_cuda and torch.equal(a, b), k
    assert te.get_device_compute_capability() == torch.cuda.get_device_capability()
    assert te.is_bf16_available() is (torch.cuda.get_device_capability()[0] >= 8)


def test_glu_interleave_utilities_and_interleaved_swiglu():
    w = torch.arange(8.0)[:, None].repeat(1, 3)  # rows W0..W3 = 0..3, V0..V3 = 4..7
    inter = te.interleave_glu_tensor(w, 2)
    assert inter[:, 0].tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    assert torch.equal(te.deinterleave_glu_tensor(inter, 2), w)
    bias = torch.arange(12.0)
    assert torch.equal(te.deinterleave_glu_tensor(te.interleave_glu_tensor(bias, 3), 3), bias)
    with pytest.raises(ValueError, match="must be a multiple of 2 \\* interleave_size = 8"):
        te.interleave_glu_tensor(torch.zeros(12), 4)
    with pytest.raises(ValueError, match="'interleave_size' must be a positive int"):
        te.deinterleave_glu_tensor(torch.zeros(12), 0)
    # an FC1 whose rows are interleaved, then the interleaved SwiGLU: the same as the contiguous pair
    torch.manual_seed(30)
    plain = [te.ops.BasicLinear(8, 16, device="cpu"), te.ops.SwiGLU()]
    inter = [te.ops.BasicLinear(8, 16, device="cpu"), te.ops.SwiGLU(glu_interleave_size=4)]
    with torch.no_grad():
        inter[0].weight.copy_(te.interleave_glu_tensor(plain[0].weight, 4))
    seq_plain, seq_inter = te.ops.Sequential(*plain), te.ops.Sequential(*inter)
    x = torch.randn(5, 8)
    close(seq_inter(x), seq_plain(x).double(), rel_tol(torch.float32))
    xr = x.double()
    a, g = (xr @ plain[0].weight.detach().double().T).chunk(2, -1)
    close(seq_inter(x), F.silu(a) * g)
    mlp = te.ops.Sequential(te.ops.LayerNorm(8, device="cpu"), te.ops.Linear(8, 16, device="cpu"),
                            te.ops.SwiGLU(glu_interleave_size=4), te.ops.Linear(8, 8, device="cpu"))
    assert mlp.plan()[0] == ("LayerNormLinear", ["LayerNorm", "Linear"])  # the interleaved SwiGLU: op by op


def test_checkpoint_core_attention_recomputes():
    torch.manual_seed(31)
    layer = te.TransformerLayer(32, 64, 4, hidden_dropout=0.0, attention_dropout=0.0, attn_input_format="bshd",
                                device="cpu")
    x = torch.randn(2, 6, 32)
    outs, grads, saved = [], [], []
    for ckpt in (False, True):
        xi = x.clone().requires_grad_()
        counter = SavedBytes()
        with counter.counting():
            out = layer(xi, checkpoint_core_attention=ckpt)
        out.sum().backward()
        outs.append(out)
        grads.append(xi.grad)
        saved.append(counter.nbytes)
    assert torch.equal(outs[0], outs[1]) and torch.equal(grads[0], grads[1])
    assert saved[1] < saved[0]  # the attention's saved tensors (output, statistics) are not kept
    with pytest.raises(NotImplementedError, match="'pad_between_seqs'=True"):
        layer(x, pad_between_seqs=True)
    with pytest.raises(NotImplementedError, match="'bottom_right_diagonal'=True"):
        layer(x, bottom_right_diagonal=True)
    with pytest.raises(NotImplementedError, match="'enc_dec_bottom_right_diagonal'=False"):
        layer(x, enc_dec_bottom_right_diagonal=False)
    close(layer(x, fast_zero_fill=False), outs[0].double(), 0.0)


@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_fp8_checkpoint_and_fused_ops_match_the_modules(recipe):
    """Under FP8 autocast (CPU backend): LayerNormMLP(checkpoint=True)
    recomputes through seqfuse.quantization.checkpoint and equals the module
    without it; a fused te.ops MLP equals te.LayerNormMLP on the same
    weights."""
    from seqfuse.common.recipe import Float8CurrentScaling
    make = (lambda: Float8CurrentScaling()) if recipe == "current" else (lambda: DelayedScaling())
    torch.manual_seed(32)
    plain = te.LayerNormMLP(128, 256, activation="swiglu", device="cpu", params_dtype=torch.bfloat16)
    ckpt = te.LayerNormMLP(128, 256, activation="swiglu", checkpoint=True, device="cpu",
                           params_dtype=torch.bfloat16)
    initial = {k: v.clone() for k, v in plain.state_dict().items()}  # before any FP8 state exists
    ckpt.load_state_dict(initial)
    x = torch.randn(32, 128, dtype=torch.bfloat16)
    results = []
    for m in (plain, ckpt):
        xi = x.clone().requires_grad_()
        with te.autocast(enabled=True, recipe=make()):
            y = m(xi)
        y.float().sum().backward()
        results.append((y, xi.grad, m.fc1_weight.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    O = te.ops
    ops = [O.LayerNorm(128, device="cpu", dtype=torch.bfloat16),
           O.Linear(128, 512, device="cpu", dtype=torch.bfloat16), O.SwiGLU(),
           O.Linear(256, 128, device="cpu", dtype=torch.bfloat16)]
    with torch.no_grad():
        ops[0].weight.copy_(initial["layer_norm_weight"])
        ops[0].bias.copy_(initial["layer_norm_bias"])
        ops[1].weight.copy_(initial["fc1_weight"])
        ops[1].bias.copy_(initial["fc1_bias"])
        ops[3].weight.copy_(initial["fc2_weight"])
        ops[3].bias.copy_(initial["fc2_bias"])
    seq = O.Sequential(*ops)
    fresh = te.LayerNormMLP(128, 256, activation="swiglu", device="cpu", params_dtype=torch.bfloat16)
    fresh.load_state_dict(initial)
    with te.autocast(enabled=True, recipe=make()):
        assert torch.equal(seq(x), fresh(x))


def test_fused_adam_takes_dtensor_parameters(tmp_path):
    """FSDP2's parameters are DTensors: FusedAdam updates their local shards
    (a one-rank gloo mesh here; seqfuse.optim's tests shard over ranks)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        torch.manual_seed(33)
        full = torch.randn(8, 4)
        p = torch.nn.Parameter(distribute_tensor(full.clone(), mesh, [Shard(0)]))
        p.grad = distribute_tensor(torch.ones(8, 4), mesh, [Shard(0)])
        opt = te.optimizers.FusedAdam([p], lr=0.1, weight_decay=0.01)
        opt.step()
        ref = full.clone().requires_grad_()
        ref.grad = torch.ones(8, 4)
        torch.optim.AdamW([ref], lr=0.1, weight_decay=0.01).step()
        assert isinstance(p.data, DTensor) and isinstance(opt.state[p]["exp_avg"], DTensor)
        close(p.full_tensor(), ref.detach(), rel_tol(torch.float32, 4))
    finally:
        dist.destroy_process_group()


def test_ops_torch_operations():
    O = te.ops
    seq = O.Sequential(O.Identity(), O.ConstantScale(0.5), O.Reshape((3, -1)), O.Dropout(0.5))
    x = torch.randn(6, 4)
    seq.eval()
    assert torch.equal(seq(x), (x * 0.5).reshape(3, 8))
    seq.train()
    torch.manual_seed(34)
    y = seq(x)
    torch.manual_seed(34)
    assert torch.equal(y, F.dropout((x * 0.5).reshape(3, 8), 0.5, training=True))
    with pytest.raises(ValueError, match="te.ops.Dropout: argument 'p' must be in"):
        O.Dropout(1.0)


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
def test_apply_fused_qkv_rotary_pos_emb(fmt):
    from seqfuse.pytorch.attention.rope import apply_fused_qkv_rotary_pos_emb
    torch.manual_seed(35)
    s, b, g, d = 6, 2, 2, 8
    shape = (s, b, g, 2 * d + d + d) if fmt == "sbhd" else (b, s, g, 2 * d + d + d)
    qkv = torch.randn(shape, requires_grad=True)
    q_freqs, q_angles = rope_angles(s, d)
    k_freqs = te.RotaryPositionEmbedding(d, rotary_base=500.0)(s)
    q, k, v = apply_fused_qkv_rotary_pos_emb(qkv, q_freqs, k_freqs, [2 * d, d, d], tensor_format=fmt)
    x = qkv.detach().double().requires_grad_()
    xb = x if fmt == "bshd" else x.transpose(0, 1)  # [b, s, g, *] for the reference
    qr, kr, vr = xb.split([2 * d, d, d], dim=-1)
    qr = rope_reference(qr.reshape(b, s, 2 * g, d), q_angles)
    kr = rope_reference(kr, k_freqs[:, 0, 0, :].double())
    back = (lambda t: t) if fmt == "bshd" else (lambda t: t.transpose(0, 1))
    assert q.shape == back(qr).shape and k.shape == back(kr).shape and v.shape == back(vr).shape
    for out, ref in ((q, back(qr)), (k, back(kr)), (v, back(vr))):
        close(out, ref)
    (q.sum() * 2 + k.pow(2).sum() + v.sum()).backward()
    (back(qr).sum() * 2 + back(kr).pow(2).sum() + back(vr).sum()).backward()
    close(qkv.grad, x.grad)
    with pytest.raises(ValueError, match="'qkv_split_arg_list' must be three positive sizes"):
        apply_fused_qkv_rotary_pos_emb(qkv, q_freqs, k_freqs, [d, d, d])
    with pytest.raises(ValueError, match="'tensor_format' must be 'sbhd' or 'bshd'"):
        apply_fused_qkv_rotary_pos_emb(qkv, q_freqs, k_freqs, [2 * d, d, d], tensor_format="thd")


def test_rng_states_tracker():
    tracker = te.CudaRNGStatesTracker()
    assert not tracker.is_initialized()
    tracker.add("model-parallel-rng", 123)
    assert tracker.is_initialized()
    with pytest.raises(ValueError, match="seed 123 is already used"):
        tracker.add("other", 123)
    with pytest.raises(ValueError, match="already exists"):
        tracker.add("model-parallel-rng", 5)
    with pytest.raises(KeyError, match="no stream named 'missing'"):
        with tracker.fork("missing"):
            pass
    torch.manual_seed(0)
    outside = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(4)
    with tracker.fork():
        b = torch.rand(4)  # the stream continues
    assert torch.equal(torch.get_rng_state(), outside)  # the caller's generator is untouched
    torch.manual_seed(123)
    assert torch.equal(torch.cat([a, b]), torch.rand(8))
    saved = tracker.get_states()
    with tracker.fork():
        c = torch.rand(4)
    tracker.set_states(saved)
    with tracker.fork():
        assert torch.equal(torch.rand(4), c)
    # a TE layer initialised under the tracker: the same weights as a layer drawn from that seed
    fresh = te.CudaRNGStatesTracker()
    fresh.add("model-parallel-rng", 77)
    layer = te.Linear(8, 8, device="cpu", get_rng_state_tracker=lambda: fresh)
    torch.manual_seed(77)
    assert torch.equal(layer.weight, torch.empty(8, 8).normal_(0.0, 0.023))
    tracker.reset()
    assert not tracker.is_initialized() and tracker.get_states() == {}
    assert te.distributed.checkpoint is te.checkpoint


def test_ops_torch_activations_and_l2():
    O = te.ops
    x = torch.randn(4, 8, requires_grad=True)
    a, b = x.double().chunk(2, -1)
    xd = x.double()
    cases = [(O.GLU(), torch.sigmoid(a) * b), (O.QGELU(), xd * torch.sigmoid(1.702 * xd)),
             (O.QGEGLU(), a * torch.sigmoid(1.702 * a) * b), (O.SReLU(), torch.relu(xd) ** 2),
             (O.SReGLU(), torch.relu(a) ** 2 * b),
             (O.L2Normalization(eps=1e-3), xd / torch.sqrt(xd.pow(2).sum(-1, keepdim=True) + 1e-3))]
    for op, ref in cases:
        seq = O.Sequential(op)
        assert seq.plan() == [(None, [type(op).__name__])]
        close(seq(x), ref)
    with pytest.raises(NotImplementedError, match="argument 'cache_quantized_input'"):
        O.SReLU(cache_quantized_input=True)


def test_dot_product_attention_te_forward_arguments():
    torch.manual_seed(36)
    dpa = te.DotProductAttention(2, 8, qkv_format="bshd", attn_mask_type="causal")
    q, k, v = (torch.randn(1, 4, 2, 8) for _ in range(3))
    ref = dpa(q, k, v)
    off = dict(bottom_right_diagonal=None, pad_between_seqs=False, fp8_output=False, bf16_backward=False,
               num_splits=1, score_mod=None, qkv_layer=None, kv_layer=None, qkv_interleave_dim=-3)
    assert torch.equal(dpa(q, k, v, **off), ref)
    for name, value in (("bottom_right_diagonal", True), ("pad_between_seqs", True), ("fp8_output", True),
                        ("num_splits", 2), ("score_mod", lambda s: s), ("qkv_layer", q)):
        with pytest.raises(NotImplementedError, match=f"DotProductAttention: argument '{name}'="):
            dpa(q, k, v, **{name: value})


def test_fp8_output_flags_refused_by_name():
    lin, lnl = te.Linear(8, 8, device="cpu"), te.LayerNormLinear(8, 8, device="cpu")
    x = torch.randn(2, 8)
    for m in (lin, lnl):
        assert torch.equal(m(x, fp8_output=False, fp8_grad=False), m(x))
        for name in ("fp8_output", "fp8_grad"):
            with pytest.raises(NotImplementedError, match=f"{type(m).__name__}: argument '{name}'=True"):
                m(x, **{name: True})


def test_ops_meta_reset_keeps_requires_grad():
    """reset_parameters() materialises a meta parameter with its
    requires_grad: a frozen weight stays frozen."""
    for op in (te.ops.BasicLinear(8, 4, device="meta"), te.ops.Bias(4, device="meta"),
               te.ops.Linear(8, 4, device="meta"), te.ops.LayerNorm(8, device="meta")):
        for p in op.parameters():
            p.requires_grad_(False)
        op.reset_parameters()
        assert all(p.device.type != "meta" and not p.requires_grad for p in op.parameters()), type(op).__name__
