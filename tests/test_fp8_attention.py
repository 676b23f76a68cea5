"""FP8 attention (Transformer Engine's fp8_dpa) on the CPU: seqfuse.quantization
.attention.fp8_attention and DotProductAttention under a DelayedScaling recipe
with fp8_dpa=True, against a float64 reference of the exact attention.

The CPU route is the definition the CUDA route (cuDNN's FP8 graphs) is
tested against in test_fp8_attention_cuda.py: the same FP8 roundings of Q, K,
V, the probabilities, O and the gradients, in float64.  Bounds, stated here
and in the README: FP8 attention's output within FORWARD_BOUND and its gradients
within BACKWARD_BOUND (relative Frobenius error against the float64 exact
attention of the same high-precision inputs); bf16 attention's own errors are
about 0.3 % and 1 % (helpers.REL_TOL), so these bounds are FP8's (E4M3 keeps 3
mantissa bits: 6 % per element at worst).

Also: the first step's scales saturate nothing (the bounds of
quantization/attention.py), delayed scaling takes over after the step's
update, the calls FP8 attention cannot take run in bf16 with a WARNING naming
the rule, fp8_mha=True is refused, bad arguments raise naming them, and the
state is made by init_fp8_state and saved with the model.
"""
import logging
import math

import pytest
import torch

import seqfuse.pytorch as te
from helpers import rel_error
from seqfuse.common.recipe import DelayedScaling, Float8CurrentScaling
from seqfuse.ops import attn as attn_ops
from seqfuse.quantization import attention as fp8a
from seqfuse.quantization import autocast, init_fp8_state, reduce_and_update

FORWARD_BOUND = 0.08
BACKWARD_BOUND = 0.15
#: and at most this many times the error of the exact attention of
#: FP8-rounded Q, K, V and dO (the rounding every FP8 attention starts
#: from): the probabilities' rounding adds to it, and dS's in the backward
FORWARD_FLOOR_FACTOR = 1.5
BACKWARD_FLOOR_FACTOR = 2.0


def exact(q, k, v, layout, causal, scale=None):
    """float64 attention of [b, s, h, d] / [s, b, h, d] tensors, k/v heads
    repeated for grouped-query."""
    perm = (0, 2, 1, 3) if layout == "bshd" else (1, 2, 0, 3)
    q, k, v = (x.double().permute(*perm) for x in (q, k, v))
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(), float("-inf"))
    o = torch.softmax(s, -1) @ v
    return o.permute(0, 2, 1, 3) if layout == "bshd" else o.permute(2, 0, 1, 3)


def fp8_rounded(x, dtype=torch.float8_e4m3fn):
    """x (float64) after FP8 rounding with a per-tensor scale from its amax:
    Q, K, V in E4M3 and dO in E5M2 are the error floor every FP8 attention
    starts from."""
    x = x.detach().double()
    m = 448.0 if dtype == torch.float8_e4m3fn else 57344.0
    s = m / x.abs().max()
    return ((x * s).to(dtype).double() / s).requires_grad_()


def inputs(layout, b, s_q, s_kv, h, h_kv, d, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)

    def t(s, heads):
        shape = (b, s, heads, d) if layout == "bshd" else (s, b, heads, d)
        return torch.randn(shape, generator=g).to(dtype).requires_grad_()

    return t(s_q, h), t(s_kv, h_kv), t(s_kv, h_kv)


def grads(fn, xs, dout):
    out = fn(*xs)
    gs = torch.autograd.grad(out, xs, dout)
    return out, gs


CASES = [  # layout, b, s_q, s_kv, heads, kv heads, head dim, mask
    ("bshd", 2, 64, 64, 4, 4, 32, "no_mask"),
    ("bshd", 2, 64, 64, 4, 4, 32, "causal"),
    ("sbhd", 1, 48, 80, 4, 2, 64, "no_mask"),
    ("bshd", 1, 96, 96, 8, 1, 16, "causal"),
    ("sbhd", 2, 33, 33, 2, 2, 48, "causal_bottom_right"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_fp8_attention_within_bound_of_exact(case):
    layout, b, s_q, s_kv, h, h_kv, d, mask = case
    q, k, v = inputs(layout, b, s_q, s_kv, h, h_kv, d)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q.dtype)
    state = fp8a.attention_state(DelayedScaling())
    out, gs = grads(lambda *x: fp8a.fp8_attention(*x, state, qkv_format=layout, attn_mask_type=mask), (q, k, v), dout)
    ref, refs = grads(lambda *x: exact(*x, layout, mask != "no_mask"), tuple(x.detach().double().requires_grad_()
                                                                        for x in (q, k, v)), dout.double())
    floor, floors = grads(lambda *x: exact(*x, layout, mask != "no_mask"), tuple(fp8_rounded(x) for x in (q, k, v)),
                          fp8_rounded(dout, torch.float8_e5m2).detach())
    assert out.dtype == q.dtype and out.shape == q.shape
    err = rel_error(out, ref)
    assert 1e-2 < err <= FORWARD_BOUND, err  # above 1e-2: FP8 really ran (bf16 alone is ~3e-3)
    assert err <= FORWARD_FLOOR_FACTOR * rel_error(floor, ref)
    for name, g_, r, f in zip("qkv", gs, refs, floors):
        assert g_.dtype == q.dtype and g_.shape == r.shape
        e = rel_error(g_, r)
        assert e <= BACKWARD_BOUND and e <= BACKWARD_FLOOR_FACTOR * rel_error(f, r), (name, e, rel_error(f, r))


def test_first_step_scales_saturate_nothing():
    """Before any history, O, dP, dQ, dK and dV take their scale from bounds of
    their amax: the amax each kernel reports, times the scale it was cast
    with, stays within the format's maximum."""
    q, k, v = inputs("bshd", 2, 64, 64, 4, 2, 32)
    q, k, v = (x.detach().mul(8).requires_grad_() for x in (q, k, v))  # amaxes far from 1
    state = fp8a.attention_state(DelayedScaling())
    out = fp8a.fp8_attention(q, k, v, state, attn_mask_type="causal")
    out.backward(torch.randn_like(out) * 1e-3)
    for i in (fp8a.O, fp8a.DP, fp8a.DQ, fp8a.DK, fp8a.DV):
        amax, scale = state.amax_of(i).item(), state.scale_of(i).item()
        assert amax > 0 and scale != 1.0, (fp8a.ATTENTION_TENSORS[i], amax, scale)
        assert amax * scale <= state.fp8_max(i), (fp8a.ATTENTION_TENSORS[i], amax, scale)
        # and the bounds are not so loose that the largest values come near the bottom of the format's
        # normal range: at least 6 binades above its smallest normal
        min_normal = 2.0 ** -14 if state.fp8_dtype(i) == torch.float8_e5m2 else 2.0 ** -6
        assert amax * scale >= min_normal * 2 ** 6, (fp8a.ATTENTION_TENSORS[i], amax * scale)
        assert not state.has_history(i)
    assert state.amax_of(fp8a.Q).item() == pytest.approx(q.detach().abs().max().item(), rel=1e-6)


def test_delayed_scaling_takes_over_after_the_update():
    torch.manual_seed(0)
    recipe = DelayedScaling(fp8_dpa=True, amax_history_len=4)
    dpa = te.DotProductAttention(4, 32, num_gqa_groups=2, qkv_format="bshd", attn_mask_type="causal")
    q, k, v = inputs("bshd", 2, 64, 64, 4, 2, 32)
    for step in range(3):
        with autocast(enabled=True, recipe=recipe):
            out = dpa(q, k, v)
        out.float().pow(2).mean().backward()
        state = dpa.fp8_state
        if step == 0:  # the exit gave the forward tensors a history; the backward ones wait for the next
            assert [state.has_history(i) for i in range(9)] == [True] * 4 + [False] * 5
    # the step-1 exit folded step 0's backward amaxes: every tensor now has a history
    assert all(state.has_history(i) for i in range(9))
    hist = state.amax_history  # three updates: rows 2 and 3 hold amaxes of every tensor
    assert hist.shape == (4, 9) and bool((hist[2:4] > 0).all()), hist
    expected = state.fp8_max(fp8a.V) / hist[:, fp8a.V].max()
    assert state.scale[fp8a.V].item() == pytest.approx(expected.item(), rel=1e-6)


def test_module_fp8_output_within_bound_of_bf16_module():
    dpa = te.DotProductAttention(4, 32, qkv_format="sbhd", attn_mask_type="no_mask")
    q, k, v = inputs("sbhd", 2, 40, 40, 4, 4, 32)
    plain = dpa(q, k, v)
    with autocast(enabled=True, recipe=DelayedScaling(fp8_dpa=True)):
        out = dpa(q, k, v)
    assert out.shape == plain.shape == (40, 2, 128)
    assert 1e-2 < rel_error(out, plain) <= FORWARD_BOUND
    with autocast(enabled=True, recipe=DelayedScaling()):  # fp8_dpa off: the bf16 attention, exactly
        assert torch.equal(dpa(q, k, v), plain)


@pytest.mark.parametrize("what", ["current_scaling", "thd", "dropout", "padding", "window"])
def test_calls_fp8_cannot_take_run_high_precision_with_a_warning(what, caplog, monkeypatch):
    from seqfuse.modules import attention as attention_module
    monkeypatch.setattr(attention_module, "_fp8_refusals_logged", set())
    recipe = DelayedScaling(fp8_dpa=True)
    kwargs, ctor = {}, dict(qkv_format="bshd", attn_mask_type="no_mask")
    q, k, v = inputs("bshd", 2, 16, 16, 2, 2, 16)
    rule = {"current_scaling": "needs DelayedScaling", "thd": "qkv_format", "dropout": "dropout",
            "padding": "takes no padding", "window": "sliding window"}[what]
    if what == "current_scaling":
        recipe = Float8CurrentScaling(fp8_dpa=True)
    elif what == "thd":
        q, k, v = (x.detach().reshape(32, 2, 16) for x in (q, k, v))
        ctor = dict(qkv_format="thd", attn_mask_type="padding")
        kwargs = dict(cu_seqlens_q=torch.tensor([0, 16, 32], dtype=torch.int32), max_seqlen_q=16)
    elif what == "dropout":
        ctor["attention_dropout"] = 0.1
    elif what == "padding":
        ctor["attn_mask_type"] = "padding"
        kwargs = dict(cu_seqlens_q=torch.tensor([0, 16, 28], dtype=torch.int32),
                      cu_seqlens_kv=torch.tensor([0, 16, 28], dtype=torch.int32))
    else:
        ctor["window_size"] = (4, 0)
        ctor["attn_mask_type"] = "causal"
    dpa = te.DotProductAttention(2, 16, **ctor)
    with caplog.at_level(logging.WARNING, logger="seqfuse"):
        with autocast(enabled=True, recipe=recipe):
            out = dpa(q, k, v, **kwargs)
    assert "fp8_state" not in dpa._modules
    msgs = [r.getMessage() for r in caplog.records if "fp8_dpa=True" in r.getMessage()]
    assert len(msgs) == 1 and rule in msgs[0], msgs
    torch.manual_seed(0)
    if what != "dropout":  # (dropout draws a new mask per call)
        assert torch.equal(out, dpa(q, k, v, **kwargs))


def test_fp8_mha_is_refused():
    with pytest.raises(NotImplementedError, match="fp8_mha"):
        DelayedScaling(fp8_mha=True)
    r = Float8CurrentScaling()
    with pytest.raises(NotImplementedError, match="fp8_mha"):
        r.fp8_mha = True
    assert r.fp8_mha is False
    with pytest.raises(TypeError, match="fp8_dpa must be a bool"):
        DelayedScaling(fp8_dpa="yes")


def test_bad_arguments_name_the_rule():
    q, k, v = inputs("bshd", 1, 8, 8, 2, 2, 16)
    state = fp8a.attention_state(DelayedScaling())
    with pytest.raises(TypeError, match="argument 'state' must be a ScalingState of 9"):
        fp8a.fp8_attention(q, k, v, fp8a.ScalingState(3))
    with pytest.raises(ValueError, match="attn_mask_type"):
        fp8a.fp8_attention(q, k, v, state, attn_mask_type="padding")
    with pytest.raises(ValueError, match="qkv_format"):
        fp8a.fp8_attention(q, k, v, state, qkv_format="thd")
    with pytest.raises(ValueError, match="causal_bottom_right is taken only with s_q == s_kv"):
        fp8a.fp8_attention(q, k[:, :4], v[:, :4], state, attn_mask_type="causal_bottom_right")
    with pytest.raises(ValueError, match="argument 'q' must be a 4-D tensor"):
        fp8a.fp8_attention(q[0], k, v, state)
    q8 = q.detach().to(torch.float8_e4m3fn)
    one = torch.ones(1)
    kw = dict(o=torch.empty(q.shape, dtype=torch.float8_e4m3fn), stats=torch.empty(1, 2, 8, 1),
              amax_s=torch.empty(1), amax_o=torch.empty(1))
    with pytest.raises(TypeError, match="argument 'k' must be float8"):
        attn_ops.fp8_attention_forward(q8, k.detach(), q8, one, one, one, one, one, one, **kw)
    with pytest.raises(ValueError, match="heads \\(2\\) must be a multiple"):
        attn_ops.fp8_attention_forward(q8, q8[:, :, :1].repeat(1, 1, 3, 1).contiguous(),
                                       q8[:, :, :1].repeat(1, 1, 3, 1).contiguous(), one, one, one, one, one, one,
                                       **kw)
    with pytest.raises(TypeError, match="argument 'scale_o' must be a float32 tensor of one element"):
        attn_ops.fp8_attention_forward(q8, q8, q8, one, one, one, one, one, torch.ones(2), **kw)
    with pytest.raises(ValueError, match="argument 'stats' must be a contiguous torch.float32 tensor of shape"):
        attn_ops.fp8_attention_forward(q8, q8, q8, one, one, one, one, one, one,
                                       **dict(kw, stats=torch.empty(1, 8, 2, 1)))


def test_init_fp8_state_makes_the_attention_state_and_it_round_trips():
    def model():
        torch.manual_seed(0)
        return te.TransformerLayer(64, 128, 4, params_dtype=torch.float32, hidden_dropout=0.0,
                                   attention_dropout=0.0, self_attn_mask_type="causal", device="cpu")

    recipe = DelayedScaling(fp8_dpa=True)
    a = model()
    x = torch.randn(16, 2, 64)
    for _ in range(2):
        with autocast(enabled=True, recipe=recipe):
            y = a(x)
        y.sum().backward()
    sd = a.state_dict()
    keys = [k for k in sd if k.endswith("core_attention.fp8_state.amax_history")]
    assert len(keys) == 1 and sd[keys[0]].shape == (recipe.amax_history_len, 9)
    b = model()
    assert init_fp8_state(b, recipe) >= 1
    b.load_state_dict(sd)
    prefix = keys[0][: -len("amax_history")]
    for name in ("amax_history", "scale", "scale_inv"):
        assert torch.equal(b.state_dict()[prefix + name], sd[prefix + name])
    with autocast(enabled=True, recipe=recipe):
        ya, yb = a(x), b(x)
    assert torch.equal(ya, yb)


def test_reduce_and_update_covers_the_attention_state():
    recipe = DelayedScaling(fp8_dpa=True)
    state = fp8a.attention_state(recipe)
    q, k, v = inputs("bshd", 1, 16, 16, 2, 2, 16)
    fp8a.fp8_attention(q, k, v, state).sum().backward()
    before = state.amax_history[0].clone()
    assert bool((before > 0).all()), before
    reduce_and_update(recipe)
    assert bool((state.amax_history[0] == 0).all()) and torch.equal(state.amax_history[-1], before)
    assert all(math.isfinite(s) and s > 0 for s in state.scale.tolist())


def test_checkpointed_fp8_attention_equals_the_plain_one_over_steps():
    """checkpoint_core_attention=True recomputes the FP8 attention in the
    backward with the forward's scales: outputs and gradients equal the
    un-checkpointed module's bit for bit, across the first steps (no
    history, then delayed scales)."""
    recipe = DelayedScaling(fp8_dpa=True, amax_history_len=4)
    mods = [te.DotProductAttention(4, 32, num_gqa_groups=2, qkv_format="bshd", attn_mask_type="causal")
            for _ in range(2)]
    for step in range(3):
        q, k, v = inputs("bshd", 2, 32, 32, 4, 2, 32, seed=step)
        res = []
        for ckpt, dpa in zip((False, True), mods):
            xs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
            with autocast(enabled=True, recipe=recipe):
                out = dpa(*xs, checkpoint_core_attention=ckpt)
            out.float().pow(2).sum().backward()
            # (the two states share a pool chunk, so every autocast exit updates both: compare each
            # module's state right after its own step)
            st = dpa.fp8_state
            res.append([out.detach()] + [x.grad for x in xs] + [st.amax_history.clone(), st.scale.clone()])
        for a, b in zip(*res):
            assert torch.equal(a, b), step


def test_more_bad_arguments_name_the_rule():
    q, k, v = inputs("bshd", 1, 8, 8, 2, 2, 16)
    with pytest.raises(ValueError, match="argument 'state' is on meta, q on cpu"):
        fp8a.fp8_attention(q, k, v, fp8a.attention_state(DelayedScaling(), "meta"))
    q8 = q.detach().to(torch.float8_e4m3fn)
    one = torch.ones(1)
    stats = torch.zeros(1, 2, 8, 1)
    g8 = [torch.empty(q.shape, dtype=torch.float8_e5m2) for _ in range(3)]

    def backward(o=q8, do=q8.to(torch.float8_e5m2), dq=g8[0]):
        attn_ops.fp8_attention_backward(q8, q8, q8, o, do, stats, *([one] * 12), dq=dq, dk=g8[1], dv=g8[2],
                                        amax_dq=one.clone(), amax_dk=one.clone(), amax_dv=one.clone(),
                                        amax_dp=one.clone())
    backward()  # the arguments as they should be
    with pytest.raises(TypeError, match="argument 'o' must be float8"):
        backward(o=q.detach())
    with pytest.raises(ValueError, match="argument 'do' must be a contiguous .* on cpu, got .* on meta"):
        backward(do=torch.empty(q.shape, dtype=torch.float8_e5m2, device="meta"))
    with pytest.raises(TypeError, match="argument 'dq' must be an FP8 tensor, got torch.bfloat16"):
        backward(dq=q.detach())
    with pytest.raises(TypeError, match="argument 'o' must be an FP8 tensor, got NoneType"):
        attn_ops.fp8_attention_forward(q8, q8, q8, *([one] * 6), o=None, stats=stats, amax_s=one.clone(),
                                       amax_o=one.clone())


def test_missing_frontend_is_named_and_asked_once(monkeypatch):
    """Without nvidia-cudnn-frontend a CUDA call is refused with the package's
    name (DotProductAttention then falls back with it in its WARNING), and the
    failed import is not retried at every call."""
    import sys
    from seqfuse.ops.attn import _fp8
    monkeypatch.setattr(_fp8, "_cudnn", None)
    monkeypatch.setattr(_fp8, "_cudnn_missing", None)
    monkeypatch.setitem(sys.modules, "cudnn", None)  # import cudnn -> ImportError
    why = attn_ops.fp8_attention_unavailable("cuda")
    assert "pip install nvidia-cudnn-frontend" in why and "import of cudnn halted" in why
    monkeypatch.delitem(sys.modules, "cudnn")  # importable or not now: the first answer stands
    assert attn_ops.fp8_attention_unavailable("cuda") == why
    assert attn_ops.fp8_attention_unavailable("cpu") is None
