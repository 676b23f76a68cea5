"""Constructor arguments of Transformer Engine's core modules that the TE
compatibility table calls "taken" and that no other test file exercises,
each checked against a torch reference or its documented meaning:
init_method / output_layer_init_method, the RNG tracker, name, layer_number,
seq_length / micro_batch_size, the userbuffers flags TransformerLayer reads
only under ub_tp_comm_overlap, MultiheadAttention's kv_channels,
layernorm_epsilon, normalization, zero_centered_gamma, params_dtype and
cross-attention, DotProductAttention's window_size and softmax_scale,
Linear's fuse_wgrad_accumulation, TransformerLayer's decoder arguments.

tests/test_te_api_table.py's coverage check names, for every taken
argument, the test here or elsewhere that exercises it."""
import contextlib

import pytest
import torch
import torch.nn.functional as F

import seqfuse.pytorch as te
from helpers import norm_reference, rel_error, rel_tol, seeded_rng_tracker
from test_te_api import close, mha_reference, rope_angles

F32 = rel_tol(torch.float32, 4)


def _ramp(scale):
    """init_method writing scale * a ramp from -1 to 1 (any shape)."""
    def init(w):
        with torch.no_grad():
            w.copy_(torch.linspace(-1, 1, w.numel()).view_as(w) * scale)
    return init


def _is_ramp(w, scale):
    return torch.equal(w.detach(), torch.linspace(-1, 1, w.numel()).view_as(w) * scale)


def test_init_methods_reach_every_weight():
    a, b = _ramp(0.1), _ramp(-0.2)
    lnl = te.LayerNormLinear(8, 12, init_method=a, device="cpu")
    assert _is_ramp(lnl.weight, 0.1) and not lnl.bias.any()
    mlp = te.LayerNormMLP(8, 16, init_method=a, output_layer_init_method=b, device="cpu")
    assert _is_ramp(mlp.fc1_weight, 0.1) and _is_ramp(mlp.fc2_weight, -0.2)
    mha = te.MultiheadAttention(16, 2, init_method=a, output_layer_init_method=b, input_layernorm=True,
                                device="cpu")
    # split Q/K/V parameters: the init method draws each piece on its own, as TE's per-parameter init
    qkv = mha.layernorm_qkv
    assert all(_is_ramp(w, 0.1) for w in (qkv.query_weight, qkv.key_weight, qkv.value_weight))
    assert _is_ramp(mha.proj.weight, -0.2)
    layer = te.TransformerLayer(16, 32, 2, init_method=a, output_layer_init_method=b, layer_type="decoder",
                                device="cpu")
    assert _is_ramp(layer.self_attention.proj.weight, -0.2) and _is_ramp(layer.layernorm_mlp.fc2_weight, -0.2)
    kv = layer.inter_attention.key_value
    assert _is_ramp(kv.key_weight, 0.1) and _is_ramp(kv.value_weight, 0.1)
    assert _is_ramp(layer.layernorm_mlp.fc1_weight, 0.1)
    # the MLP computes with them, as torch does
    xm = torch.randn(3, 8)
    w1, w2 = mlp.fc1_weight.detach().double(), mlp.fc2_weight.detach().double()
    ref = F.gelu(F.layer_norm(xm.double(), (8,), eps=1e-5) @ w1.T, approximate="tanh") @ w2.T
    close(mlp(xm), ref)


def test_rng_tracker_reaches_every_weight():
    tracker = seeded_rng_tracker(99)
    lnl = te.LayerNormLinear(8, 12, get_rng_state_tracker=tracker, name="lnl", device="cpu")
    torch.manual_seed(99)
    assert torch.equal(lnl.weight, torch.empty(12, 8).normal_(0.0, 0.023)) and lnl.name == "lnl"
    mha = te.MultiheadAttention(16, 2, get_rng_state_tracker=tracker, name="attn", device="cpu")
    torch.manual_seed(99)
    assert torch.equal(mha.proj.weight, torch.empty(16, 16).normal_(0.0, 0.023)) and mha.name == "attn"
    n = len(tracker.calls)
    layer = te.TransformerLayer(16, 32, 2, get_rng_state_tracker=tracker, name="layer0", device="cpu")
    assert len(tracker.calls) - n == 3 and layer.name == "layer0"  # QKV, proj and the MLP
    torch.manual_seed(99)
    assert torch.equal(layer.layernorm_mlp.fc1_weight, torch.empty(32, 16).normal_(0.0, 0.023))


def test_bookkeeping_arguments_change_nothing():
    """layer_number, name, seq_length, micro_batch_size and (without
    ub_tp_comm_overlap) the userbuffers flags: kept, outputs unchanged."""
    torch.manual_seed(20)
    kw = dict(hidden_dropout=0.0, attention_dropout=0.0, attn_input_format="bshd", device="cpu")
    base = te.TransformerLayer(16, 32, 2, **kw)
    other = te.TransformerLayer(16, 32, 2, layer_number=3, seq_length=5, micro_batch_size=2, name="l3",
                                ub_overlap_ag=False, ub_overlap_rs=False, ub_overlap_rs_dgrad=True,
                                ub_bulk_dgrad=False, ub_bulk_wgrad=False, **kw)
    other.load_state_dict(base.state_dict())
    x = torch.randn(2, 5, 16)
    assert torch.equal(base(x), other(x))
    assert other.layer_number == 3 and other.self_attention.layer_number == 3
    assert other.self_attention.core_attention.layer_number == 3
    assert other.seq_length == 5 and other.layernorm_mlp.micro_batch_size == 2
    mha = te.MultiheadAttention(16, 2, layer_number=2, seq_length=5, micro_batch_size=2, attention_dropout=0.0,
                                qkv_format="bshd", device="cpu")
    plain = te.MultiheadAttention(16, 2, attention_dropout=0.0, qkv_format="bshd", device="cpu")
    plain.load_state_dict(mha.state_dict())
    assert torch.equal(mha(x), plain(x)) and mha.seq_length == 5
    dpa = te.DotProductAttention(2, 8, layer_number=4)
    assert dpa.layer_number == 4


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_multihead_attention_norm_arguments(normalization):
    """kv_channels (head dim not hidden / heads), layernorm_epsilon,
    normalization and zero_centered_gamma against the float64 reference."""
    torch.manual_seed(21)
    m = te.MultiheadAttention(24, 4, kv_channels=8, num_gqa_groups=2, layernorm_epsilon=1e-3,
                              normalization=normalization, zero_centered_gamma=True, input_layernorm=True,
                              attention_dropout=0.0, qkv_format="bshd", device="cpu")
    assert m.layernorm_qkv.zero_centered_gamma and not m.layernorm_qkv.layer_norm_weight.any()
    with torch.no_grad():
        m.layernorm_qkv.layer_norm_weight.uniform_(-0.5, 0.5)
    assert m.layernorm_qkv.eps == 1e-3 and m.proj.in_features == 32
    x = torch.randn(2, 6, 24)
    freqs, angles = rope_angles(6, 8)
    lq = m.layernorm_qkv
    # the reference's norm with zero-centred gamma: weight + 1
    with torch.no_grad():
        saved = lq.layer_norm_weight.clone()
        lq.layer_norm_weight.add_(1.0)
        lq.zero_centered_gamma = False
        ref = mha_reference(m, x, angles)
        lq.layer_norm_weight.copy_(saved)
        lq.zero_centered_gamma = True
    close(m(x, rotary_pos_emb=freqs), ref)


def test_multihead_attention_params_dtype():
    torch.manual_seed(22)
    m = te.MultiheadAttention(32, 4, params_dtype=torch.bfloat16, input_layernorm=True, attention_dropout=0.0,
                              qkv_format="bshd", device="cpu")
    assert {p.dtype for p in m.parameters()} == {torch.bfloat16}
    x = torch.randn(2, 6, 32, dtype=torch.bfloat16)
    out = m(x)
    assert out.dtype == torch.bfloat16
    assert rel_error(out.double(), mha_reference(m, x, None)) <= rel_tol(torch.bfloat16, 8)


def test_multihead_attention_cross():
    torch.manual_seed(23)
    m = te.MultiheadAttention(16, 2, attention_type="cross", input_layernorm=True, attn_mask_type="no_mask",
                              attention_dropout=0.0, qkv_format="bshd", fuse_qkv_params=False, device="cpu")
    x, enc = torch.randn(2, 4, 16), torch.randn(2, 7, 16)
    out = m(x, encoder_output=enc)
    lq = m.layernorm_query
    ln = F.layer_norm(x.double(), (16,), lq.layer_norm_weight.double(), lq.layer_norm_bias.double(), 1e-5)
    q = (ln @ lq.weight.double().T + lq.bias.double()).view(2, 4, 2, 8)
    kv = m.key_value
    k = (enc.double() @ kv.key_weight.double().T + kv.key_bias.double()).view(2, 7, 2, 8)
    v = (enc.double() @ kv.value_weight.double().T + kv.value_bias.double()).view(2, 7, 2, 8)
    ctx = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    ref = ctx.transpose(1, 2).reshape(2, 4, 16) @ m.proj.weight.double().T + m.proj.bias.double()
    close(out, ref)


@pytest.mark.parametrize("window", [(2, 0), (1, 1)])
def test_dot_product_attention_window_and_scale(window):
    torch.manual_seed(24)
    mask_type = "causal" if window[1] == 0 else "no_mask"
    dpa = te.DotProductAttention(2, 8, qkv_format="bshd", attn_mask_type=mask_type, window_size=window,
                                 softmax_scale=0.2)
    q, k, v = (torch.randn(2, 6, 2, 8) for _ in range(3))
    i, j = torch.arange(6)[:, None], torch.arange(6)[None, :]
    keep = (j >= i - window[0]) & (j <= i + window[1])
    ref = F.scaled_dot_product_attention(*(t.transpose(1, 2).double() for t in (q, k, v)), attn_mask=keep,
                                         scale=0.2)
    close(dpa(q, k, v), ref.transpose(1, 2).reshape(2, 6, 16))


def test_linear_fuse_wgrad_accumulation():
    torch.manual_seed(25)
    lin = te.Linear(8, 4, fuse_wgrad_accumulation=True, device="cpu")
    lin.weight.main_grad = torch.ones(4, 8)
    x = torch.randn(5, 8)
    lin(x).sum().backward()
    ref = torch.ones(4, 8, dtype=torch.float64) + torch.ones(5, 4, dtype=torch.float64).T @ x.double()
    close(lin.weight.main_grad, ref)
    assert lin.weight.grad is None and lin.fuse_wgrad_accumulation


def test_transformer_layer_decoder_arguments():
    """enc_dec_attn_mask_type and enc_dec_window_size reach the cross
    attention; kv_channels, zero_centered_gamma, normalization, activation
    and layernorm_epsilon reach every submodule."""
    layer = te.TransformerLayer(16, 32, 2, kv_channels=12, layer_type="decoder", enc_dec_attn_mask_type="padding",
                                enc_dec_window_size=(3, 3), zero_centered_gamma=True, normalization="RMSNorm",
                                activation="swiglu", layernorm_epsilon=1e-3, device="cpu")
    cross = layer.inter_attention
    assert cross.attn_mask_type == "padding" and cross.window_size == (3, 3) and cross.kv_channels == 12
    assert layer.self_attention.kv_channels == 12 and layer.self_attention.proj.in_features == 24
    mlp = layer.layernorm_mlp
    assert mlp.activation == "swiglu" and mlp.normalization == "RMSNorm" and mlp.zero_centered_gamma
    assert mlp.eps == 1e-3 and layer.self_attention.layernorm_qkv.eps == 1e-3
    assert layer.self_attention.layernorm_qkv.normalization == "RMSNorm"
    # the layer computes with them: MLP block against torch (swiglu, zero-centred RMSNorm)
    x = torch.randn(5, 16)
    w = mlp.layer_norm_weight.detach().double() + 1
    ln = norm_reference(x.double(), w, None, 1e-3, "RMSNorm")
    h = ln @ mlp.fc1_weight.detach().double().T + mlp.fc1_bias.detach().double()
    a, g = h.chunk(2, -1)
    ref = (F.silu(a) * g) @ mlp.fc2_weight.detach().double().T + mlp.fc2_bias.detach().double()
    close(mlp(x), ref)


def test_multihead_attention_window_size():
    torch.manual_seed(26)
    m = te.MultiheadAttention(16, 2, window_size=(2, 0), attn_mask_type="causal", attention_dropout=0.0,
                              qkv_format="bshd", device="cpu")
    assert m.core_attention.window_size == (2, 0)
    x = torch.randn(2, 6, 16)
    q, k, v = m._split_qkv(m.qkv(x))
    dpa = te.DotProductAttention(2, 8, qkv_format="bshd", attn_mask_type="causal", window_size=(2, 0))
    close(m(x), m.proj(dpa(q, k, v)), rel_tol(torch.float32))
    full = te.MultiheadAttention(16, 2, attn_mask_type="causal", attention_dropout=0.0, qkv_format="bshd",
                                 device="cpu")
    full.load_state_dict(m.state_dict())
    assert rel_error(full(x), m(x)) > 1e-3  # the window changed the result


def test_dot_product_attention_context_parallel_arguments(tmp_path):
    """cp_group, cp_global_ranks, cp_stream and cp_comm_type reach the
    module's context parallelism (a group of one rank: CP off, the result is
    plain attention; seqfuse.distributed's tests run CP at 2 and 4 ranks)."""
    import torch.distributed as dist
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        group = dist.new_group([0])
        dpa = te.DotProductAttention(2, 8, qkv_format="bshd", attn_mask_type="causal", cp_group=group,
                                     cp_global_ranks=[0], cp_stream=None, cp_comm_type="all_gather")
        assert dpa.cp_group is group and dpa.cp_global_ranks == [0] and dpa.cp_comm_type == "all_gather"
        q, k, v = (torch.randn(1, 4, 2, 8) for _ in range(3))
        ref = F.scaled_dot_product_attention(*(t.transpose(1, 2).double() for t in (q, k, v)), is_causal=True)
        close(dpa(q, k, v), ref.transpose(1, 2).reshape(1, 4, 16))
    finally:
        dist.destroy_process_group()


def test_transformer_layer_without_bias():
    torch.manual_seed(27)
    layer = te.TransformerLayer(16, 32, 2, bias=False, hidden_dropout=0.0, attention_dropout=0.0,
                                attn_input_format="bshd", device="cpu")
    names = [n for n, _ in layer.named_parameters()]
    assert not any(n.endswith(("query_bias", "key_bias", "value_bias", "proj.bias", "fc1_bias", "fc2_bias"))
                   for n in names), names
    x = torch.randn(2, 5, 16)
    h = x + layer.self_attention(x)
    mlp = layer.layernorm_mlp
    ln = F.layer_norm(h.detach().double(), (16,), mlp.layer_norm_weight.detach().double(),
                      mlp.layer_norm_bias.detach().double(), 1e-5)
    ref = h.double() + F.gelu(ln @ mlp.fc1_weight.detach().double().T,
                              approximate="tanh") @ mlp.fc2_weight.detach().double().T
    close(layer(x), ref)


@pytest.mark.parametrize("fp8", [False, True])
def test_fuse_wgrad_accumulation_into_main_grad(fp8):
    """LayerNormLinear, LayerNormMLP, MultiheadAttention and TransformerLayer
    with fuse_wgrad_accumulation: each weight carrying a float32 main_grad gets
    dW added to it (weight.grad stays None), equal to the gradient the same
    module computes without main_grad."""
    from seqfuse.common.recipe import Float8CurrentScaling
    torch.manual_seed(28)
    dtype = torch.bfloat16 if fp8 else torch.float32
    builders = [
        lambda **kw: te.LayerNormLinear(128, 128, params_dtype=dtype, device="cpu", **kw),
        lambda **kw: te.LayerNormMLP(128, 256, activation="gelu", params_dtype=dtype, device="cpu", **kw),
        lambda **kw: te.LayerNormMLP(128, 256, activation="swiglu", params_dtype=dtype, checkpoint=not fp8,
                                     device="cpu", **kw),
        lambda **kw: te.MultiheadAttention(128, 4, input_layernorm=True, fuse_qkv_params=True, params_dtype=dtype,
                                           attention_dropout=0.0, qkv_format="bshd", device="cpu", **kw),
        lambda **kw: te.TransformerLayer(128, 256, 4, fuse_qkv_params=True, params_dtype=dtype, hidden_dropout=0.0,
                                         attention_dropout=0.0, attn_input_format="bshd", device="cpu", **kw),
    ]
    x = torch.randn(2, 16, 128, dtype=dtype)
    ctx = (lambda: te.autocast(enabled=True, recipe=Float8CurrentScaling())) if fp8 else contextlib.nullcontext
    for build in builders:
        plain, fused = build(), build(fuse_wgrad_accumulation=True)
        fused.load_state_dict(plain.state_dict())
        weights = [n for n, p in fused.named_parameters() if p.dim() == 2]
        for n, p in fused.named_parameters():
            if p.dim() == 2:
                p.main_grad = torch.full(p.shape, 0.5)
                p.grad_added_to_main_grad = False
        for m in (plain, fused):
            with ctx():
                out = m(x)
            (out[0] if isinstance(out, tuple) else out).float().pow(2).sum().backward()
        ref = dict(plain.named_parameters())
        for n in weights:
            p = dict(fused.named_parameters())[n]
            assert p.grad is None and p.grad_added_to_main_grad, (type(fused).__name__, n)
            close(p.main_grad - 0.5, ref[n].grad.float(), rel_tol(dtype, 2))
        for n, p in fused.named_parameters():  # biases and norm weights: ordinary gradients
            if p.dim() == 1:
                assert torch.equal(p.grad, ref[n].grad), n


def test_rng_tracker_draws_attention_dropout():
    """With a tracker, attention dropout's seed comes from its fork (TE):
    torch's own generator is left where it was, and two calls under the
    same tracker state drop the same elements."""
    class Seeded:
        @contextlib.contextmanager
        def fork(self, name="model-parallel-rng"):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(7)
                yield

    torch.manual_seed(29)
    dpa = te.DotProductAttention(2, 8, attention_dropout=0.5, qkv_format="bshd", get_rng_state_tracker=Seeded)
    mha = te.MultiheadAttention(16, 2, attention_dropout=0.5, qkv_format="bshd", get_rng_state_tracker=Seeded,
                                device="cpu")
    q, k, v = (torch.randn(1, 5, 2, 8) for _ in range(3))
    x = torch.randn(1, 5, 16)
    for module, args in ((dpa, (q, k, v)), (mha, (x,))):
        module.train()
        state = torch.get_rng_state()
        a, b = module(*args), module(*args)
        assert torch.equal(a, b) and torch.equal(torch.get_rng_state(), state)
        module.eval()
        c = module(*args)
        assert not torch.equal(a, c)  # dropout was on in training
    plain = te.DotProductAttention(2, 8, attention_dropout=0.5, qkv_format="bshd")
    assert not torch.equal(plain(q, k, v), plain(q, k, v))  # without a tracker: torch's generator moves on


def test_norm_arguments_of_both_classes_against_torch():
    """Each TE argument of LayerNorm and of RMSNorm given to that class:
    normalized_shape / hidden_size, eps, params_dtype / dtype,
    sequence_parallel (an attribute on the weights, as TE marks them for
    Megatron's gradient all-reduce), zero_centered_gamma, device; results
    against torch."""
    torch.manual_seed(56)
    x = torch.randn(3, 12)
    xd = x.double()
    for cls in (te.LayerNorm, te.RMSNorm):
        by_new = cls(normalized_shape=12, eps=1e-3, dtype=torch.float32, sequence_parallel=True,
                     zero_centered_gamma=True, device="cpu")
        by_old = cls(hidden_size=12, eps=1e-3, params_dtype=torch.float32, sequence_parallel=False,
                     zero_centered_gamma=True, device="cpu")
        assert all(getattr(w, "sequence_parallel", None) is True for w in by_new.parameters())
        with torch.no_grad():
            for m in (by_new, by_old):
                for w in m.parameters():
                    w.copy_(torch.linspace(-0.5, 0.5, 12))
        gamma = torch.linspace(-0.5, 0.5, 12).double() + 1  # zero-centred: weight + 1
        if cls is te.LayerNorm:
            ref = F.layer_norm(xd, (12,), gamma, torch.linspace(-0.5, 0.5, 12).double(), 1e-3)
        else:
            ref = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-3) * gamma
        for m in (by_new, by_old):
            assert m.weight.dtype == torch.float32
            close(m(x), ref)


def test_multihead_attention_without_bias_against_torch():
    """bias=False: no bias parameters anywhere, and the block computes
    softmax(q k^T / sqrt(d)) v W_proj^T from bias-free projections."""
    from test_transformer_layer import _split
    torch.manual_seed(57)
    m = te.MultiheadAttention(16, 2, bias=False, input_layernorm=False, fuse_qkv_params=True,
                              attention_dropout=0.0, qkv_format="bshd", attn_mask_type="causal", device="cpu")
    assert not [n for n, _ in m.named_parameters() if "bias" in n]
    x = torch.randn(2, 5, 16)
    xd = x.double()
    q, k, v = _split(xd @ m.qkv.weight.double().T, 2, 2, 8, m.qkv_weight_interleaved)
    ctx = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    ref = ctx.transpose(1, 2).reshape(2, 5, 16) @ m.proj.weight.double().T
    close(m(x), ref)


def test_make_graphed_callables_takes_te_2_20_names():
    """make_graphed_callables takes TE 2.20's names (enabled, calibrating,
    recipe, amax_reduction_group, cache_quantized_params) and their older
    fp8_* ones, one of each pair: both is a ValueError naming both, before
    anything is captured (on a CPU the call then stops at the CUDA check)."""
    lin = te.Linear(16, 16, device="cpu")
    sample = (torch.randn(2, 16),)
    pairs = (("fp8_enabled", "enabled", True), ("fp8_calibrating", "calibrating", False),
             ("fp8_recipe", "recipe", te.recipe.DelayedScaling()), ("fp8_group", "amax_reduction_group", None),
             ("fp8_weight_caching", "cache_quantized_params", True))
    for old, new, value in pairs:
        if value is None:
            continue
        with pytest.raises(ValueError, match=f"give '{new}' or its older name '{old}', not both"):
            te.make_graphed_callables(lin, sample, **{old: value, new: value})
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA graphs need a CUDA device"):
            te.make_graphed_callables(lin, sample, enabled=True, recipe=te.recipe.DelayedScaling(),
                                      cache_quantized_params=True)
