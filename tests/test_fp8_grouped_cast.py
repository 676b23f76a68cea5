"""The grouped FP8 cast (seqfuse.ops.moe.cast_fp8_grouped), its SwiGLU form
(swiglu_cast_fp8_grouped) and the GroupedLinear / GroupedMLP paths that
use them (seqfuse.quantization.grouped).

The op is checked against the per-tensor casts of each group's rows
(cast_transpose_fp8 / cast_fp8_current with the padded row count), bit for
bit, on the CPU and on CUDA; its bad inputs against the messages they must
give; the module against its per-expert path (the same values, one cast
call per operand instead of one per expert)."""
import logging

import numpy as np
import pytest
import torch

from seqfuse.common import notes as notes_module
from seqfuse.common.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format
from seqfuse.modules import GroupedLinear, GroupedMLP, Linear
from seqfuse.modules import grouped_linear as grouped_linear_module
from seqfuse.ops import moe as moe_ops
from seqfuse.ops import quant as qops
from seqfuse.quantization import fp8_autocast
from seqfuse.quantization.gemm_quantizers import weight_casts

from helpers import grouped_and_per_expert_fp8_step, needs_fp8, pair_tol, rel_error

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _padded(m):
    return -(-m // 16) * 16


def _bytes(t):
    return t.view(torch.uint8)


def _per_group_reference(x, splits, fp8_dtype, scale, amax, current):
    """(data, data_t, scale_inv, scale, amax) made one group at a time by the
    per-tensor casts, laid out as cast_fp8_grouped lays them out."""
    k = x.shape[1]
    mp = sum(_padded(m) for m in splits)
    data = torch.zeros((mp, k), dtype=torch.uint8, device=x.device)
    data_t = torch.zeros((k, mp), dtype=torch.uint8, device=x.device)
    G = len(splits)
    scale, amax = scale.clone(), amax.clone()
    scale_inv = torch.empty(G, device=x.device)
    o = p = 0
    for g, m in enumerate(splits):
        mpg = _padded(m)
        xg = x[o:o + m]
        if current:
            a, s, i = (torch.empty(1, device=x.device) for _ in range(3))
            if m:
                d, dt = qops.cast_fp8_current(xg, fp8_dtype, amax=a, scale=s, scale_inv=i, transpose=True,
                                              rows=mpg)
            else:
                a.zero_(), s.fill_(1.0), i.fill_(1.0)
            amax[g], scale[g], scale_inv[g] = a[0], s[0], i[0]
        else:
            a = amax[g:g + 1].clone()
            i = torch.empty(1, device=x.device)
            if m:
                d, dt = qops.cast_transpose_fp8(xg, scale[g:g + 1].clone(), a, fp8_dtype, scale_inv=i, rows=mpg)
            else:
                i.fill_(1.0 / scale[g].item())
            amax[g], scale_inv[g] = a[0], i[0]
        if m:
            data[p:p + mpg] = _bytes(d)
            data_t[:, p:p + mpg] = _bytes(dt)
        o += m
        p += mpg
    return data, data_t, scale_inv, scale, amax


def _slots(G, device):
    """Scale and amax as the every-third-column views a ScalingState hands out."""
    buf = torch.zeros(2, 3 * G, device=device)
    buf[0] = torch.rand(3 * G, device=device) * 2 + 0.25
    buf[1, ::2] = 3.0  # some groups already hold an amax this step (delayed scaling folds into it)
    return buf[0, 1::3], buf[1, 1::3]


def _check_grouped_cast(device, dtype, splits, k, fp8_dtype, current):
    G = len(splits)
    x = torch.randn(sum(splits), k, device=device) * torch.linspace(0.1, 50, sum(splits), device=device)[:, None]
    x = x.to(dtype)
    scale, amax = _slots(G, device)
    want = _per_group_reference(x, splits, fp8_dtype, scale, amax, current)
    data, data_t, scale_inv = moe_ops.cast_fp8_grouped(x, splits, fp8_dtype, scale=scale, amax=amax,
                                                       current=current)
    assert data.shape == (sum(_padded(m) for m in splits), k) and data.dtype == fp8_dtype
    assert torch.equal(_bytes(data), want[0])
    assert torch.equal(_bytes(data_t), want[1])
    assert torch.equal(scale_inv, want[2])
    assert torch.equal(scale, want[3]) and torch.equal(amax, want[4])
    assert scale_inv.stride(0) == 64  # 256 bytes apart: what cuBLASLt wants of per-group scales


@needs_fp8
@pytest.mark.parametrize("current", [False, True], ids=["delayed", "current"])
@pytest.mark.parametrize("splits", [[5, 0, 37, 16], [0], [1], [0, 0, 130, 0], [300, 1, 0, 129, 64, 7]])
def test_grouped_cast_equals_per_group_casts(splits, current, seed):
    for dtype, fp8_dtype in ((torch.float32, E4M3), (torch.bfloat16, E5M2)):
        _check_grouped_cast("cpu", dtype, splits, 48, fp8_dtype, current)


@needs_fp8
def test_grouped_cast_one_copy_only(seed):
    """rowwise=False / transpose=False leave that copy out (None)."""
    x = torch.randn(40, 32)
    scale, amax = _slots(3, "cpu")
    d, dt, _ = moe_ops.cast_fp8_grouped(x, [20, 0, 20], E4M3, scale=scale, amax=amax, transpose=False)
    d2, dt2, _ = moe_ops.cast_fp8_grouped(x, [20, 0, 20], E4M3, scale=scale, amax=amax, rowwise=False)
    assert dt is None and d2 is None
    assert torch.equal(_bytes(d).T.contiguous(), _bytes(dt2))


@needs_fp8
def test_grouped_cast_bad_inputs():
    x = torch.randn(40, 32)
    scale, amax = _slots(2, "cpu")
    cast = moe_ops.cast_fp8_grouped
    with pytest.raises(ValueError, match="m_splits.*add.* up to 39 rows but 'x' has 40"):
        cast(x, [20, 19], E4M3, scale=scale, amax=amax)
    with pytest.raises(ValueError, match="m_splits.*the 40 rows of 'x'"):
        cast(x, [41, 0], E4M3, scale=scale, amax=amax)
    with pytest.raises(ValueError, match="'x' must have K .* multiple of 16"):
        cast(torch.randn(40, 24), [20, 20], E4M3, scale=scale, amax=amax)
    with pytest.raises(ValueError, match="'scale' must be a 1-D float32 tensor of 3 elements"):
        cast(x, [20, 10, 10], E4M3, scale=scale, amax=None)
    with pytest.raises(ValueError, match="'amax' must be given under current scaling"):
        cast(x, [20, 20], E4M3, scale=scale, current=True)
    with pytest.raises(ValueError, match="row counts >= 0"):
        cast(x, [50, -10], E4M3, scale=scale, amax=amax)
    with pytest.raises(ValueError, match="'x' must be 2-D"):
        cast(x.view(2, 20, 32), [20, 20], E4M3, scale=scale, amax=amax)
    with pytest.raises(ValueError, match="'row_multiple' must be a positive multiple of 16"):
        cast(x, [20, 20], E4M3, scale=scale, amax=amax, row_multiple=8)


def _check_swiglu_cast(device, dtype, splits, k, fp8_dtype, current, probs_dtype=torch.float32):
    """swiglu_cast_fp8_grouped against cast_fp8_grouped of scaled_swiglu's
    output on the same device, bit for bit (data, transposed data, scales,
    amaxes); probs_dtype None: no probs."""
    G, M = len(splits), sum(splits)
    h = (torch.randn(M, 2 * k, device=device) * torch.linspace(0.1, 6, M, device=device)[:, None]).to(dtype)
    probs = None
    if probs_dtype is not None:
        probs = torch.rand(M, device=device).to(probs_dtype)
        probs[::7] = 0  # padding rows of GroupedMLP's permutation carry probability 0
    scale, amax = _slots(G, device)
    scale2, amax2 = scale.clone(), amax.clone()
    want = moe_ops.cast_fp8_grouped(moe_ops.scaled_swiglu(h, probs), splits, fp8_dtype, scale=scale2, amax=amax2,
                                    current=current)
    got = moe_ops.swiglu_cast_fp8_grouped(h, probs, splits, fp8_dtype, scale=scale, amax=amax, current=current)
    assert torch.equal(_bytes(got[0]), _bytes(want[0])) and torch.equal(_bytes(got[1]), _bytes(want[1]))
    assert torch.equal(got[2], want[2]) and torch.equal(scale, scale2) and torch.equal(amax, amax2)


@needs_fp8
@pytest.mark.parametrize("current", [False, True], ids=["delayed", "current"])
@pytest.mark.parametrize("splits", [[5, 0, 37, 16], [0], [33], [0, 0, 130, 0]])
def test_swiglu_cast_equals_cast_of_scaled_swiglu(splits, current, seed):
    for dtype, fp8_dtype, pd in ((torch.float32, E4M3, torch.float32), (torch.bfloat16, E4M3, torch.float32),
                                 (torch.float16, E5M2, torch.bfloat16), (torch.bfloat16, E4M3, None)):
        _check_swiglu_cast("cpu", dtype, splits, 32, fp8_dtype, current, pd)


@pytest.mark.cuda
@needs_fp8
@pytest.mark.parametrize("current", [False, True], ids=["delayed", "current"])
def test_swiglu_cast_cuda_equals_cast_of_scaled_swiglu(current, seed):
    """The fused kernel against the SwiGLU kernel then the grouped cast kernel,
    bit for bit on the GPU (both compute silu with the same device code and
    round to the input dtype the same way)."""
    g = torch.Generator().manual_seed(seed)
    many = torch.bincount(torch.multinomial(torch.rand(70, generator=g) ** 2, 3000, replacement=True,
                                            generator=g), minlength=70).tolist()
    for dtype, fp8_dtype, pd in ((torch.bfloat16, E4M3, torch.float32), (torch.float16, E5M2, torch.bfloat16),
                                 (torch.float32, E4M3, torch.float32), (torch.bfloat16, E4M3, None)):
        for splits, k in (([300, 1, 0, 129, 64, 7, 1000, 33], 272), ([0, 0, 130, 0], 1024), (many, 144)):
            _check_swiglu_cast("cuda", dtype, splits, k, fp8_dtype, current, pd)


@needs_fp8
def test_swiglu_cast_bad_inputs():
    h = torch.randn(40, 64)
    scale, amax = _slots(2, "cpu")
    cast = moe_ops.swiglu_cast_fp8_grouped
    with pytest.raises(ValueError, match="'x' must have an even last dimension"):
        cast(torch.randn(40, 65), None, [20, 20], E4M3, scale=scale, amax=amax)
    with pytest.raises(ValueError, match="'x' must have K \\(half its last dimension\\) a multiple of 16"):
        cast(torch.randn(40, 48), None, [20, 20], E4M3, scale=scale, amax=amax)
    with pytest.raises(ValueError, match="'probs' must be a contiguous 1-D tensor of one entry per row of x \\(40\\)"):
        cast(h, torch.rand(39), [20, 20], E4M3, scale=scale, amax=amax)
    with pytest.raises(ValueError, match="'probs' must be 1-D"):
        cast(h, torch.rand(40, 1), [20, 20], E4M3, scale=scale, amax=amax)
    with pytest.raises(TypeError, match="probs"):
        cast(h, torch.ones(40, dtype=torch.int32), [20, 20], E4M3, scale=scale, amax=amax)
    with pytest.raises(ValueError, match="m_splits.*add.* up to 39 rows but 'x' has 40"):
        cast(h, None, [20, 19], E4M3, scale=scale, amax=amax)


def test_grouped_linear_swiglu_probs_is_scaled_swiglu_then_forward(seed):
    """Outside FP8, swiglu_probs computes scaled_swiglu(inp, probs) and then
    the layer, gradients included; its arguments are checked."""
    torch.manual_seed(seed)
    m = GroupedLinear(3, 16, 24, bias=True, device="cpu")
    splits = [5, 0, 9]
    h = torch.randn(14, 32, requires_grad=True)
    p = torch.rand(14, requires_grad=True)
    y = m(h, splits, swiglu_probs=p)
    y.backward(torch.ones_like(y))
    grads = h.grad.clone(), p.grad.clone(), m.weight0.grad.clone()
    h.grad = p.grad = None
    m.zero_grad()
    y2 = m(moe_ops.scaled_swiglu(h, p), splits)
    y2.backward(torch.ones_like(y2))
    assert torch.equal(y, y2)
    assert torch.equal(grads[0], h.grad) and torch.equal(grads[1], p.grad) and torch.equal(grads[2], m.weight0.grad)
    with pytest.raises(ValueError, match="last dimension must be 2 x in_features"):
        m(torch.randn(14, 16), splits, swiglu_probs=p)
    with pytest.raises(ValueError, match="swiglu_probs must be 1-D with one entry per row of the input \\(14\\)"):
        m(h, splits, swiglu_probs=torch.rand(13))
    with pytest.raises(TypeError, match="swiglu_probs must be a torch.Tensor"):
        m(h, splits, swiglu_probs=[0.5] * 14)
    with pytest.raises(TypeError, match="swiglu_probs must be a floating-point tensor .*got torch.int64"):
        m(h, splits, swiglu_probs=torch.ones(14, dtype=torch.int64))
    # a non-contiguous input and probabilities: read row-major, the same values
    hp = torch.randn(32, 14).t()
    pp = torch.rand(28)[::2]
    assert torch.equal(m(hp, splits, swiglu_probs=pp), m(hp.contiguous(), splits, swiglu_probs=pp.contiguous()))


@needs_fp8
@pytest.mark.parametrize("wants", [(True, False), (False, True), (True, True)], ids=["h", "probs", "both"])
def test_grouped_linear_fp8_swiglu_gradients_of_either_input(wants, seed):
    """Under FP8 delayed scaling (steady state: the fused cast) swiglu_probs'
    gradients equal scaled_swiglu-then-forward's bit for bit when only the
    gate-up input, only the probabilities, or both need them; a 3-D input
    keeps its leading shape."""
    torch.manual_seed(seed)
    a = GroupedLinear(3, 32, 48, bias=False, device="cpu")
    b = GroupedLinear(3, 32, 48, bias=False, device="cpu")
    b.load_state_dict(a.state_dict())
    splits = [10, 0, 14]
    recipe = DelayedScaling()
    for step in range(2):
        h0, p0, dy = torch.randn(2, 12, 64), torch.rand(24), torch.randn(2, 12, 48)
        res = []
        for m, fused in ((a, True), (b, False)):
            h, p = h0.clone().requires_grad_(wants[0]), p0.clone().requires_grad_(wants[1])
            with fp8_autocast(enabled=True, fp8_recipe=recipe):
                y = m(h, splits, swiglu_probs=p) if fused else \
                    m(moe_ops.scaled_swiglu(h.view(24, 64), p), splits).view(2, 12, 48)
            y.backward(dy)
            res.append((y.detach(), h.grad, p.grad, m.weight2.grad.clone()))
            m.zero_grad()
        (ya, ha, pa, wa), (yb, hb, pb, wb) = res
        assert ya.shape == (2, 12, 48) and torch.equal(ya, yb) and torch.equal(wa, wb)
        for ga, gb, want in ((ha, hb, wants[0]), (pa, pb, wants[1])):
            assert (ga is None) == (not want) and (ga is None or torch.equal(ga, gb))


@needs_fp8
@pytest.mark.parametrize("recipe", [Float8CurrentScaling(), DelayedScaling()], ids=["current", "delayed"])
def test_grouped_mlp_fp8_writes_no_swiglu_output(recipe, monkeypatch, caplog, seed):
    """Under delayed scaling (steady state) GroupedMLP's SwiGLU runs inside
    fc2's input cast: the SwiGLU forward kernel is not called, the fused cast
    is, once a step (its transposed FP8 copy kept for the weight gradient).
    Current scaling writes the SwiGLU output, then casts it (its fused cast
    reads the input twice and measured slower), and says so in one log line
    over both steps (note_grouped); its backward writes the output again for
    the weight gradient's FP8 copy, which is not kept: the SwiGLU forward
    kernel runs twice a step."""
    from seqfuse import _C

    monkeypatch.setattr(notes_module, "_noted", set())  # this process's earlier notes forgotten
    caplog.set_level(logging.INFO, logger="seqfuse")
    torch.manual_seed(seed)
    m = GroupedMLP(32, 48, num_experts=4, topk=2, device="cpu")
    calls = []
    for name in ("moe_swiglu_forward", "swiglu_cast_fp8_grouped"):
        real = getattr(_C, name)
        monkeypatch.setattr(_C, name, lambda *a, _real=real, _name=name, **k: (calls.append(_name), _real(*a, **k))[1])
    for step in range(2):
        calls.clear()
        x = torch.randn(40, 32, requires_grad=True)
        with fp8_autocast(enabled=True, fp8_recipe=recipe):
            m(x).sum().backward()
    fused = isinstance(recipe, DelayedScaling)
    assert calls == (["swiglu_cast_fp8_grouped"] if fused else ["moe_swiglu_forward"] * 2)
    lines = [r.getMessage() for r in caplog.records if "writes the SwiGLU output" in r.getMessage()]
    assert lines == ([] if fused else [
        "seqfuse FP8 GroupedLinear: current scaling writes the SwiGLU output, then casts it (the fused SwiGLU "
        "cast serves delayed scaling; under current scaling it reads the input twice and is slower)"])


def _check_current_list(device, dtype, G, n, k, fp8_dtype):
    xs = [torch.randn(n, k, device=device).mul(g + 0.5).to(dtype) for g in range(G)]
    slots = torch.full((3 * G,), -1.0, device=device)
    data, data_t, scale_inv, scale, amax = moe_ops.cast_fp8_current_list(xs, fp8_dtype, amax=slots[1::3])
    assert amax.data_ptr() == slots[1:].data_ptr()  # written into the given (strided) slots
    for g, x in enumerate(xs):
        a, s, i = (torch.empty(1, device=device) for _ in range(3))
        d, dt = qops.cast_fp8_current(x, fp8_dtype, amax=a, scale=s, scale_inv=i, transpose=True)
        assert torch.equal(_bytes(data[g]), _bytes(d)) and torch.equal(_bytes(data_t[g]), _bytes(dt)), g
        assert (amax[g], scale[g], scale_inv[g]) == (a[0], s[0], i[0]), g


@needs_fp8
def test_current_list_equals_per_tensor_casts(seed):
    for dtype, fp8_dtype in ((torch.float32, E4M3), (torch.bfloat16, E5M2)):
        _check_current_list("cpu", dtype, 5, 48, 32, fp8_dtype)
    with pytest.raises(ValueError, match="'xs' .*N a multiple of 16"):
        moe_ops.cast_fp8_current_list([torch.randn(40, 32)], E4M3)
    with pytest.raises(ValueError, match="'xs' must have xs\\[0\\]'s shape .*xs\\[1\\] is \\(16, 48\\)"):
        moe_ops.cast_fp8_current_list([torch.randn(16, 32), torch.randn(16, 48)], E4M3)
    with pytest.raises(ValueError, match="non-empty list"):
        moe_ops.cast_fp8_current_list([], E4M3)


def _mlp_pair(G, fin, fout, device, dtype):
    gl = GroupedLinear(G, fin, fout, bias=False, device=device, params_dtype=dtype)
    lins = [Linear(fin, fout, bias=False, device=device, params_dtype=dtype) for _ in range(G)]
    with torch.no_grad():
        for g, lin in enumerate(lins):
            lin.weight.copy_(getattr(gl, f"weight{g}"))
    return gl, lins


def _count_grouped_casts(monkeypatch, name="cast_fp8_grouped"):
    calls = []
    real = getattr(moe_ops, name)

    def spy(*args, **kwargs):
        calls.append(kwargs.get("current", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(moe_ops, name, spy)
    return calls


@needs_fp8
@pytest.mark.parametrize("first", [None, True], ids=["lean", "micro_batches"])
@pytest.mark.parametrize("recipe", [Float8CurrentScaling(), DelayedScaling(fp8_format=Format.HYBRID)],
                         ids=["current", "delayed_hybrid"])
def test_grouped_linear_one_cast_per_operand_equals_per_expert_linear(recipe, first, monkeypatch, seed):
    """Without biases both operands a GroupedLinear casts (input, output
    gradient) go through the one grouped call once the recipe allows it
    (delayed scaling: from the second step, when every expert's tensors have
    an amax history), and the results stay the per-expert FP8 Linear's bit
    for bit on the CPU, over three steps with weight updates.  The weights:
    one list cast a step; under is_first_microbatch=True it writes its first
    buffers again at every later step (the module keeps them); in training
    without it (None) into new buffers, the module keeping no cast once the
    forward returned (lean_weights)."""
    calls = _count_grouped_casts(monkeypatch)
    new_weight_lists = _count_grouped_casts(monkeypatch, "cast_fp8_current_list")
    weight_calls = _count_grouped_casts(monkeypatch, "cast_fp8_current_list_into")  # (new buffers or in place)
    splits = [5, 0, 37, 16]
    G, fin, fout = len(splits), 32, 48
    gl, lins = _mlp_pair(G, fin, fout, "cpu", torch.float32)
    for step in range(3):
        before = len(calls)
        casts_before = weight_casts(gl)
        (y, dx), (y_ref, dx_ref) = grouped_and_per_expert_fp8_step(gl, lins, splits, recipe, first)
        grouped_now = len(calls) - before
        first_delayed = isinstance(recipe, DelayedScaling) and step == 0
        assert grouped_now == (0 if first_delayed else 2), (step, grouped_now)
        # every expert's weight changed (all are updated below, the idle one too): one list cast a step
        assert len(weight_calls) == step + 1 and weight_casts(gl) - casts_before == G, step
        q = gl._quantizers(recipe, torch.device("cpu"))
        if first is None:  # new buffers every step, nothing kept by the module
            assert len(new_weight_lists) == step + 1, step
            assert q.weight_list is None and all(r.pair is None for r in q.weights), step
        else:  # new buffers at the first step only (then into those: nothing holds them after each backward)
            assert len(new_weight_lists) == 1, step
            assert q.weight_list is not None and all(r.pair is not None for r in q.weights), step
        assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref), step
        for g in range(G):
            w = getattr(gl, f"weight{g}")
            ref = lins[g].weight.grad if splits[g] else torch.zeros_like(w)
            assert torch.equal(w.grad, ref), (step, g)
        with torch.no_grad():
            for g in range(G):
                p, q = getattr(gl, f"weight{g}"), lins[g].weight
                if q.grad is not None:
                    p -= 0.1 * p.grad
                    q -= 0.1 * q.grad
                else:  # the idle expert moves too (weight decay would move it), keeping the two equal
                    p *= 0.99
                    q *= 0.99
                p.grad = q.grad = None
    if isinstance(recipe, DelayedScaling):
        # the grouped casts folded each expert's amaxes into its own slots: the same values as the
        # per-expert Linears' (the two autocast regions roll their histories at different exits,
        # so the values are compared as sets)
        hist = gl.fp8_state.amax_history
        for g in range(G):
            if splits[g]:
                ref = lins[g].fp8_state.amax_history
                for mine, theirs in ((3 * g, 0), (3 * g + 2, 2)):
                    assert torch.equal(hist[:, mine].sort().values, ref[:, theirs].sort().values), g


@pytest.mark.cuda
@needs_fp8
@pytest.mark.parametrize("current", [False, True], ids=["delayed", "current"])
def test_grouped_cast_cuda_equals_per_group_casts(current, seed):
    """The CUDA kernels against the per-tensor CUDA casts, bit for bit: 16-bit
    and float32 inputs, skewed and empty groups, more groups than one launch
    takes (70 > 64)."""
    g = torch.Generator().manual_seed(seed)
    many = torch.multinomial(torch.rand(70, generator=g) ** 2, 3000, replacement=True, generator=g)
    many = torch.bincount(many, minlength=70).tolist()
    for dtype, fp8_dtype in ((torch.bfloat16, E4M3), (torch.float16, E5M2), (torch.float32, E4M3)):
        for splits, k in (([300, 1, 0, 129, 64, 7, 1000, 33], 272), ([0, 0, 130, 0], 1024), (many, 144)):
            _check_grouped_cast("cuda", dtype, splits, k, fp8_dtype, current)


@pytest.mark.cuda
@needs_fp8
def test_current_list_cuda_equals_per_tensor_casts(seed):
    for dtype, fp8_dtype in ((torch.bfloat16, E4M3), (torch.float16, E5M2), (torch.float32, E4M3)):
        _check_current_list("cuda", dtype, 8, 272, 144, fp8_dtype)
        _check_current_list("cuda", dtype, 70, 16, 32, fp8_dtype)  # two launches


@pytest.mark.cuda
@needs_fp8
@pytest.mark.parametrize("recipe", [Float8CurrentScaling(), DelayedScaling()], ids=["current", "delayed"])
def test_grouped_linear_cuda_grouped_cast_equals_per_expert_casts(recipe, monkeypatch, seed):
    """On the GPU the grouped path and the per-expert path (quantize_grouped
    declining) give the same outputs and gradients over three steps."""
    splits = [100, 0, 333, 16, 1]
    G, fin, fout = len(splits), 256, 512
    torch.manual_seed(seed)
    a = GroupedLinear(G, fin, fout, bias=False, device="cuda", params_dtype=torch.bfloat16)
    b = GroupedLinear(G, fin, fout, bias=False, device="cuda", params_dtype=torch.bfloat16)
    b.load_state_dict(a.state_dict())
    real = grouped_linear_module.quantize_grouped
    real_weights = grouped_linear_module.weight_pairs
    calls = _count_grouped_casts(monkeypatch)
    new_weight_lists = _count_grouped_casts(monkeypatch, "cast_fp8_current_list")
    weight_calls = _count_grouped_casts(monkeypatch, "cast_fp8_current_list_into")  # (new buffers or in place)
    for step in range(3):
        x = torch.randn(sum(splits), fin, device="cuda").bfloat16()
        dy = torch.randn(sum(splits), fout, device="cuda").bfloat16()
        results = []
        for m, grouped in ((a, True), (b, False)):
            monkeypatch.setattr(grouped_linear_module, "quantize_grouped",
                                real if grouped else (lambda *args, **kwargs: None))
            monkeypatch.setattr(grouped_linear_module, "weight_pairs", real_weights if grouped else
                                (lambda q, ws, first: [q.weights[g].get(w, first) for g, w in enumerate(ws)]))
            xi = x.clone().requires_grad_()
            with fp8_autocast(enabled=True, fp8_recipe=recipe):
                y = m(xi, splits)
            y.backward(dy)
            results.append((y.detach(), xi.grad, [getattr(m, f"weight{g}").grad for g in range(G)]))
        (ya, dxa, dwa), (yb, dxb, dwb) = results
        assert rel_error(ya, yb) <= pair_tol(torch.bfloat16) and rel_error(dxa, dxb) <= pair_tol(torch.bfloat16)
        for g in range(G):
            assert rel_error(dwa[g], dwb[g]) <= pair_tol(torch.bfloat16), (step, g)
        with torch.no_grad():
            for m in (a, b):
                for g in range(G):
                    w = getattr(m, f"weight{g}")
                    w -= 0.01 * w.grad
                    w.grad = None
    # module a's input and gradient casts: one grouped call each a step (delayed scaling: from the
    # second step, when every expert's tensors have an amax history)
    assert len(calls) == (4 if isinstance(recipe, DelayedScaling) else 6)
    # module a's weights: one list cast a step, into new buffers each time (training without
    # is_first_microbatch keeps none past the forward: lean_weights)
    assert len(weight_calls) == 3 and len(new_weight_lists) == 3


def _unpadded_grouped_mlp(m, x):
    """GroupedMLP's forward with the experts' rows permuted unpadded (each
    GroupedLinear pads per expert itself): the reference for its padded
    FP8 permutation."""
    x2 = x.reshape(-1, m.hidden_size)
    probs, routing_map, _ = m.route(x2)
    row_ids, counts = moe_ops.moe_row_id_map(routing_map)
    splits = counts.tolist()
    xp, pp = moe_ops.moe_permute_by_row_id_map(x2, row_ids, sum(splits), probs)
    y = m.fc2(moe_ops.scaled_swiglu(m.fc1(xp, splits), pp), splits)
    return moe_ops.moe_unpermute(y, row_ids).view(x.shape)


def _grouped_mlp_against_unpadded(a, b, recipe, shape, dtype, same, update):
    """Three steps of GroupedMLP ``a`` and the unpadded reference run of its
    copy ``b`` on the same inputs under ``recipe``: ``same(got, want)`` holds
    for the outputs, input gradients and every parameter gradient;
    ``update(p)`` is each step's weight change."""
    device = a.fc1.weight0.device
    for step in range(3):
        x = torch.randn(shape, device=device).to(dtype)
        dy = torch.randn(shape, device=device).to(dtype)
        outs = []
        for m, run in ((a, lambda m, x: m(x)), (b, _unpadded_grouped_mlp)):
            xi = x.clone().requires_grad_()
            with fp8_autocast(enabled=True, fp8_recipe=recipe):
                y = run(m, xi)
            y.backward(dy)
            outs.append((y.detach(), xi.grad, {n: p.grad.clone() for n, p in m.named_parameters()}))
        (ya, dxa, ga), (yb, dxb, gb) = outs
        assert same(ya, yb) and same(dxa, dxb), step
        for n in ga:
            assert same(ga[n], gb[n]), (step, n)
        with torch.no_grad():
            for m in (a, b):
                for p in m.parameters():
                    p -= update(p.grad)
                    p.grad = None


@needs_fp8
@pytest.mark.parametrize("recipe", [Float8CurrentScaling(), DelayedScaling()], ids=["current", "delayed"])
def test_grouped_mlp_fp8_padded_permutation_equals_unpadded(recipe, seed):
    """Under FP8 GroupedMLP permutes into blocks of 16 rows per expert (zero
    rows between) and (delayed scaling) computes the SwiGLU inside fc2's
    input cast; the output and every gradient equal the unpadded
    permutation's with the SwiGLU written out (scaled_swiglu, then fc2; whose
    GEMMs pad per expert) bit for bit, over steps with weight updates
    (delayed scaling: with and without amax histories)."""
    torch.manual_seed(seed)
    a = GroupedMLP(32, 48, num_experts=4, topk=2, device="cpu")
    b = GroupedMLP(32, 48, num_experts=4, topk=2, device="cpu")
    b.load_state_dict(a.state_dict())
    _grouped_mlp_against_unpadded(a, b, recipe, (2, 37, 32), torch.float32, torch.equal, lambda g: 0.05 * g)


@pytest.mark.cuda
@needs_fp8
@pytest.mark.parametrize("recipe", [Float8CurrentScaling(), DelayedScaling()], ids=["current", "delayed"])
def test_grouped_mlp_fp8_cuda_fused_swiglu_equals_unfused(recipe, seed):
    """On the GPU: GroupedMLP (padded permutation; the SwiGLU inside fc2's
    cast under delayed scaling, written first under current scaling) against
    the unpadded permutation with the SwiGLU written out, bf16, over
    three steps with weight updates: outputs and gradients agree (the same
    FP8 operands; the GEMMs may pick other algorithms for other shapes)."""
    torch.manual_seed(seed)
    kw = dict(num_experts=8, topk=2, device="cuda", params_dtype=torch.bfloat16)
    a, b = GroupedMLP(256, 512, **kw), GroupedMLP(256, 512, **kw)
    b.load_state_dict(a.state_dict())
    tol = pair_tol(torch.bfloat16)
    _grouped_mlp_against_unpadded(a, b, recipe, (3, 331, 256), torch.bfloat16,
                                  lambda got, want: rel_error(got, want) <= tol,
                                  lambda g: g.float().sign().to(g.dtype) * 5e-4)


def test_pad_row_id_map_moves_rows_past_earlier_padding():
    # three tokens, three experts with two rows each (rows 0-1, 2-3, 4-5 unpadded)
    ids = torch.tensor([[0, -1, 4], [1, 2, -1], [-1, 3, 5]], dtype=torch.int32)
    got = moe_ops.pad_row_id_map(ids, torch.tensor([2, 2, 2]), 16)
    assert got.tolist() == [[0, -1, 32], [1, 16, -1], [-1, 17, 33]]


@needs_fp8
def test_grouped_linear_fp8_non_contiguous_input(seed):
    """A strided input takes the grouped cast after a contiguous copy: the
    same result as the contiguous input."""
    splits = [20, 0, 20]
    gl = GroupedLinear(3, 32, 48, bias=False, device="cpu")
    wide = torch.randn(40, 64)
    with fp8_autocast(enabled=True, fp8_recipe=Float8CurrentScaling()):
        y_strided = gl(wide[:, :32], splits)
        y_dense = gl(wide[:, :32].contiguous(), splits)
    assert torch.equal(y_strided, y_dense)


@needs_fp8
def test_prefetch_fp8_weights_is_the_forwards_cast(monkeypatch, seed):
    """prefetch_fp8_weights casts the experts' weights the forward would cast
    (one list call); the forward then reuses them (in training, then lets
    them go); outside FP8 autocast it does nothing.  Without gradients the
    casts are kept per weight version: a moved weight alone is cast again."""
    gl = GroupedLinear(3, 32, 48, bias=False, device="cpu")
    calls = _count_grouped_casts(monkeypatch, "cast_fp8_current_list")
    gl.prefetch_fp8_weights()
    assert weight_casts(gl) == 0 and not calls
    x = torch.randn(40, 32)
    recipe = DelayedScaling()
    with fp8_autocast(enabled=True, fp8_recipe=recipe):
        gl.prefetch_fp8_weights()
        assert weight_casts(gl) == 3 and len(calls) == 1
        y = gl(x, [20, 0, 20])
        assert weight_casts(gl) == 3 and len(calls) == 1  # reused
    q = gl._quantizers(recipe, x.device)
    assert q.weight_list is None and all(r.pair is None for r in q.weights)  # training: none kept
    with torch.no_grad(), fp8_autocast(enabled=True, fp8_recipe=recipe):
        assert torch.equal(gl(x, [20, 0, 20]), y)
        assert weight_casts(gl) == 6 and len(calls) == 2
        gl.weight0.mul_(1.5)
        y2 = gl(x, [20, 0, 20])  # one weight moved: the forward re-casts it (expert by expert)
    assert weight_casts(gl) == 7 and len(calls) == 2
    assert not torch.equal(y, y2)


@needs_fp8
@pytest.mark.parametrize("recipe", [Float8CurrentScaling(), DelayedScaling()], ids=["current", "delayed"])
def test_lean_forward_frees_the_forward_copy_and_the_backward_the_transposed(recipe, monkeypatch, seed):
    """In training without is_first_microbatch the experts' forward FP8
    copy is gone once the forward returned (nothing holds its storage), the
    transposed copy lives until the backward has used it, then goes too."""
    import gc
    import weakref

    made = []
    real = moe_ops.cast_fp8_current_list

    def spy(*args, **kwargs):
        data, data_t, *rest = real(*args, **kwargs)
        made.append((weakref.ref(data[0]._base), weakref.ref(data_t[0]._base)))
        return (data, data_t, *rest)

    monkeypatch.setattr(moe_ops, "cast_fp8_current_list", spy)
    gl = GroupedLinear(3, 32, 48, bias=False, device="cpu")
    x = torch.randn(40, 32, requires_grad=True)
    with fp8_autocast(enabled=True, fp8_recipe=recipe):
        y = gl(x, [20, 0, 20])
    gc.collect()
    assert len(made) == 1
    forward_copy, transposed = made[0]
    assert forward_copy() is None and transposed() is not None
    y.sum().backward()
    del y
    gc.collect()
    assert transposed() is None and x.grad is not None


@needs_fp8
def test_frozen_experts_keep_their_fp8_weights_in_training(monkeypatch, seed):
    """A GroupedLinear whose weights do not learn keeps their casts through
    training forwards (the input's gradient still flows): the weights cannot
    change between forwards, so lean_weights does not apply; nor where
    keep_fp8_weights is set."""
    calls = _count_grouped_casts(monkeypatch, "cast_fp8_current_list")
    for frozen in (True, False):
        gl = GroupedLinear(3, 32, 48, bias=False, device="cpu")
        gl.keep_fp8_weights = not frozen
        for w in gl.weights():
            w.requires_grad_(not frozen)
        before = len(calls)
        for _ in range(2):
            x = torch.randn(40, 32, requires_grad=True)
            with fp8_autocast(enabled=True, fp8_recipe=Float8CurrentScaling()):
                y = gl(x, [20, 0, 20])
            y.sum().backward()
            assert x.grad is not None
        q = gl._quantizers(Float8CurrentScaling(), x.device)
        assert len(calls) - before == 1 and weight_casts(gl) == 3, frozen
        assert all(r.pair is not None for r in q.weights), frozen


def test_counts_to_host_cpu():
    assert moe_ops.counts_to_host(torch.tensor([3, 0, 5]))() == [3, 0, 5]


@pytest.mark.cuda
def test_counts_to_host_cuda_waits_for_its_copy():
    """The values are the counts at the call, after the queued work that
    made them, whatever is queued after it."""
    counts = torch.zeros(4, dtype=torch.int64, device="cuda")
    big = torch.randn(4096, 4096, device="cuda")
    for _ in range(3):
        big = big @ big.T / 4096  # work before the counts are written
    counts += torch.tensor([7, 0, 3, 1], device="cuda")
    wait = moe_ops.counts_to_host(counts)
    counts.zero_()  # queued after the copy: not seen
    for _ in range(3):
        big = big @ big.T / 4096
    assert wait() == [7, 0, 3, 1]


@pytest.mark.cuda
@needs_fp8
def test_grouped_linear_fp8_cuda_misaligned_input_takes_the_per_expert_casts(seed):
    """An input 8 bytes off 16-byte alignment: the grouped cast declines (its
    kernel reads 16-byte vectors) and the per-expert casts give the aligned
    input's result (the same FP8 bytes; the GEMMs may pick other cuBLASLt
    algorithms for other operand addresses, so within bf16's pair tolerance)."""
    splits = [100, 0, 60]
    gl = GroupedLinear(3, 256, 128, bias=False, device="cuda", params_dtype=torch.bfloat16)
    x = torch.randn(160, 256, device="cuda").bfloat16()
    buf = torch.empty(160 * 256 + 4, dtype=torch.bfloat16, device="cuda")
    off = buf[4:].view(160, 256)
    off.copy_(x)
    assert off.data_ptr() % 16 == 8
    with fp8_autocast(enabled=True, fp8_recipe=Float8CurrentScaling()):
        y_off = gl(off, splits)
        y = gl(x, splits)
    assert rel_error(y_off, y) <= pair_tol(torch.bfloat16)


@needs_fp8
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("recipe", [Float8CurrentScaling, Float8BlockScaling])
def test_grouped_linear_fp8_cuda_misaligned_swiglu_input_trains(recipe, monkeypatch, caplog, seed):
    """A down projection's gate|up input 8 bytes off 16-byte alignment: the
    forward's casts take the per-expert path and the backward's SwiGLU the
    unfused kernels (the fused grouped pass reads 16-byte vectors): forward
    and backward run and give the aligned input's results within bf16's
    pair tolerance (other cuBLASLt algorithms for other addresses)."""
    monkeypatch.setattr(notes_module, "_noted", set())  # (this process's earlier notes forgotten)
    caplog.set_level(logging.INFO, logger="seqfuse")
    splits = [100, 0, 60]
    gl = GroupedLinear(3, 128, 128, bias=False, device="cuda", params_dtype=torch.bfloat16)  # (block: 128s)
    h = torch.randn(160, 256, device="cuda").bfloat16()
    buf = torch.empty(160 * 256 + 4, dtype=torch.bfloat16, device="cuda")
    off = buf[4:].view(160, 256)
    off.copy_(h)
    assert off.data_ptr() % 16 == 8
    probs, dy = torch.rand(160, device="cuda"), torch.randn(160, 128, device="cuda").bfloat16()
    grads = []
    for inp in (off, h):
        x, p = inp.detach().requires_grad_(), probs.clone().requires_grad_()
        with fp8_autocast(enabled=True, fp8_recipe=recipe()):
            y = gl(x, splits, swiglu_probs=p)
        y.backward(dy)
        grads.append((y, x.grad, p.grad))
        gl.zero_grad(set_to_none=True)
    for a, b in zip(*grads):
        assert rel_error(a, b) <= pair_tol(torch.bfloat16)
    assert "not 16-byte aligned (the pass reads 16-byte vectors)" in caplog.text


@needs_fp8
def test_weight_pairs_casts_mismatched_weights_one_by_one(monkeypatch, caplog, seed):
    """Expert weights of different dtypes cannot share the list cast: each is
    cast by its own quantizer (the same values a lone cast gives), and a log
    line names the reason once, however often it recurs (note_grouped)."""
    from seqfuse.quantization.grouped import weight_pairs

    monkeypatch.setattr(notes_module, "_noted", set())  # this process's earlier notes forgotten
    caplog.set_level(logging.INFO, logger="seqfuse")
    gl = GroupedLinear(3, 32, 48, bias=False, device="cpu")
    calls = _count_grouped_casts(monkeypatch, "cast_fp8_current_list")
    ws = [gl.weight0, gl.weight1.detach().bfloat16(), gl.weight2]
    with fp8_autocast(enabled=True, fp8_recipe=Float8CurrentScaling()):
        q = gl._quantizers(Float8CurrentScaling(), torch.device("cpu"))
        pairs = weight_pairs(q, ws)
    assert not calls and weight_casts(gl) == 3
    for w, (forward_q, _) in zip(ws, pairs):
        a, s, i = (torch.empty(1) for _ in range(3))
        d, _ = qops.cast_fp8_current(w.detach(), forward_q.data.dtype, amax=a, scale=s, scale_inv=i, transpose=True)
        assert torch.equal(_bytes(forward_q.data), _bytes(d))
    with fp8_autocast(enabled=True, fp8_recipe=Float8CurrentScaling()):
        weight_pairs(q, [w.detach() * 2 for w in ws])  # changed weights, declined again for the same reason
    lines = [r.getMessage() for r in caplog.records if "one by one" in r.getMessage()]
    assert lines == ["seqfuse FP8 GroupedLinear: experts cast one by one (expert weights of different shapes or "
                     "dtypes, or not 16-byte aligned); steady-state delayed or current scaling casts them in one "
                     "call"]


def test_fp8_gemm_nt_names_a_bad_scaling():
    from seqfuse.ops.gemm import fp8_gemm_nt

    a = torch.zeros(16, 16).to(E4M3)
    with pytest.raises(ValueError, match="'a_scaling' must be one of"):
        fp8_gemm_nt(a, torch.ones(1), "bogus", a, torch.ones(1), None, torch.empty(16, 16))
    with pytest.raises(TypeError, match="'a' and 'b' must be torch.Tensors"):
        fp8_gemm_nt([a], torch.ones(1), None, a, torch.ones(1), None, torch.empty(16, 16))
    with pytest.raises(TypeError, match="'a' and 'b' must be torch.Tensors"):  # a 2-D non-tensor operand
        fp8_gemm_nt(a, torch.ones(1), None, np.zeros((16, 16)), torch.ones(1), None, torch.empty(16, 16))
    with pytest.raises(ValueError, match="'b_scaling' must be one of"):  # unhashable: not a KeyError
        fp8_gemm_nt(a, torch.ones(1), None, a, torch.ones(1), ["tensor"], torch.empty(16, 16))
    with pytest.raises(ValueError, match=r"'a' and 'b' must be 2-D, got 3-D and 2-D"):
        fp8_gemm_nt(a.view(1, 16, 16), torch.ones(1), None, a, torch.ones(1), None, torch.empty(16, 16))
