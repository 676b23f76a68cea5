"""Transformer Engine names added to seqfuse.pytorch for issue 22, against
torch references: Fp8Padding / Fp8Unpadding (each split padded to a
multiple of the alignment with zero rows, the alignment from the recipe
when not given), moe_sort_chunks_by_index(_with_probs) (chunks reordered),
moe_permute_and_pad_with_probs with moe_unpermute(pad_offsets=...),
and the refused names' "off" settings (onnx_export, get_cpu_offload_context
with enabled=False behave as TE's).  The refusals themselves are checked in
test_te_api_table.py against REFUSED_NAMES.  CPU only: these are row copies
with no CUDA kernel of their own."""
import pytest
import torch

import seqfuse.pytorch as te
from helpers import rel_error, rel_tol
from seqfuse.common.recipe import DelayedScaling, MXFP8BlockScaling, NVFP4BlockScaling
from seqfuse import quantization


def _pad_reference(x, m_splits, align):
    out, start = [], 0
    for m in m_splits:
        p = (m + align - 1) // align * align
        out += [x[start:start + m], x.new_zeros((p - m, x.shape[1]))]
        start += m
    return torch.cat(out)


@pytest.mark.parametrize("m_splits,align", [([3, 0, 17, 16], 16), ([1, 40], 32), ([5], 8)])
def test_fp8_padding_round_trip_against_torch(m_splits, align):
    torch.manual_seed(0)
    x = torch.randn(sum(m_splits), 6, requires_grad=True)
    out, padded = te.Fp8Padding(len(m_splits), align_size=align)(x, m_splits)
    assert padded == [(m + align - 1) // align * align for m in m_splits]
    assert torch.equal(out, _pad_reference(x.detach(), m_splits, align))
    back = te.Fp8Unpadding(len(m_splits), align_size=align)(out, m_splits)
    assert torch.equal(back, x.detach())
    g = torch.randn_like(back)
    back.backward(g)
    assert torch.equal(x.grad, g)
    # the padding rows' gradient is dropped: Fp8Padding's backward keeps only the real rows
    x2 = x.detach().clone().requires_grad_(True)
    out2, _ = te.Fp8Padding(len(m_splits), align_size=align)(x2, m_splits)
    gp = torch.randn_like(out2)
    out2.backward(gp)
    assert torch.equal(x2.grad, te.Fp8Unpadding(len(m_splits), align_size=align)(gp, m_splits))


def test_fp8_padding_returns_input_when_aligned():
    x = torch.randn(48, 4)
    out, padded = te.Fp8Padding(2)(x, [16, 32])
    assert out is x and padded == [16, 32]
    assert te.Fp8Unpadding(2)(x, [16, 32]) is x


@pytest.mark.parametrize("recipe,align", [(DelayedScaling(), 16), (MXFP8BlockScaling(), 32),
                                          (NVFP4BlockScaling(), 128)])
def test_fp8_padding_alignment_follows_the_recipe(monkeypatch, recipe, align):
    monkeypatch.setattr(quantization.autocast_state(), "recipe", recipe)
    pad = te.Fp8Padding(1)
    assert pad.align_size is None  # decided at the first forward, as TE
    _, padded = pad(torch.randn(3, 4), [3])
    assert padded == [align] and pad.align_size == align


def test_fp8_padding_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="num_gemms"):
        te.Fp8Padding(0)
    with pytest.raises(ValueError, match="align_size"):
        te.Fp8Unpadding(2, align_size=0)
    with pytest.raises(ValueError, match="m_splits.*num_gemms"):
        te.Fp8Padding(2)(torch.randn(4, 2), [4])
    with pytest.raises(ValueError, match="rows but sum"):
        te.Fp8Padding(2)(torch.randn(4, 2), [1, 2])
    with pytest.raises(ValueError, match="rows but sum"):
        te.Fp8Unpadding(2)(torch.randn(4, 2), [1, 2])


@pytest.mark.parametrize("sizes,order", [([2, 0, 3, 1], [3, 1, 0, 2]), ([4], [0]), ([1, 2, 3], [2, 0, 1])])
def test_sort_chunks_by_index_against_torch(sizes, order):
    torch.manual_seed(1)
    x = torch.randn(sum(sizes), 5, requires_grad=True)
    probs = torch.rand(sum(sizes), requires_grad=True)
    chunks, pchunks = torch.split(x.detach(), sizes), torch.split(probs.detach(), sizes)
    ref = torch.cat([chunks[i] for i in order])
    out = te.moe_sort_chunks_by_index(x, torch.tensor(sizes), torch.tensor(order))
    assert torch.equal(out, ref)
    out2, p2 = te.moe_sort_chunks_by_index_with_probs(x, probs, torch.tensor(sizes), torch.tensor(order))
    assert torch.equal(out2, ref) and torch.equal(p2, torch.cat([pchunks[i] for i in order]))
    g, gp = torch.randn_like(out2), torch.randn_like(p2)
    torch.autograd.backward([out2, p2], [g, gp])
    # the gradient goes back through the inverse order
    inv = [order.index(i) for i in range(len(order))]
    gs, gps = torch.split(g, [sizes[i] for i in order]), torch.split(gp, [sizes[i] for i in order])
    assert torch.equal(x.grad, torch.cat([gs[j] for j in inv]))
    assert torch.equal(probs.grad, torch.cat([gps[j] for j in inv]))


def test_sort_chunks_bad_input_names_the_argument():
    x = torch.randn(5, 2)
    with pytest.raises(ValueError, match="sum\\(split_sizes\\)"):
        te.moe_sort_chunks_by_index(x, torch.tensor([2, 2]), torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="sorted_index.*permutation"):
        te.moe_sort_chunks_by_index(x, torch.tensor([2, 3]), torch.tensor([1, 1]))
    with pytest.raises(TypeError, match="split_sizes"):
        te.moe_sort_chunks_by_index(x, torch.tensor([2.0, 3.0]), torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="probs"):
        te.moe_sort_chunks_by_index_with_probs(x, torch.rand(4), torch.tensor([2, 3]), torch.tensor([1, 0]))


def test_refused_names_off_settings_are_tes():
    model = torch.nn.Linear(3, 3)
    x = torch.randn(2, 3)
    with te.onnx_export(enabled=False):
        y = model(x)
    assert torch.equal(y, model(x))
    ctx, sync = te.get_cpu_offload_context(enabled=False, num_layers=2, model_layers=2)
    with ctx:
        y = model(x)
    assert sync(y) is y
    ctx, sync, controller = te.get_cpu_offload_context(enabled=False, manual_synchronization=True)
    assert controller is None and sync(x) is x
    with pytest.raises(TypeError, match="enabled"):
        te.get_cpu_offload_context(enabled=1)
    with pytest.raises(TypeError, match="enabled"), te.onnx_export(enabled="yes"):
        pass


def _padded_permutation_reference(x, probs, routing_map, align):
    """Expert by expert: the tokens routed there in token order, then zero rows up to the alignment."""
    rows, prows = [], []
    for e in range(routing_map.shape[1]):
        tok = routing_map[:, e].nonzero().flatten()
        n = tok.numel()
        pad = (n + align - 1) // align * align - n
        rows += [x[tok], x.new_zeros((pad, x.shape[1]))]
        prows += [probs[tok, e], probs.new_zeros(pad)]
    return torch.cat(rows), torch.cat(prows)


@pytest.mark.parametrize("align", [1, 4, 16])
def test_permute_and_pad_with_probs_against_torch(align):
    torch.manual_seed(2)
    T, E, H = 9, 4, 6
    routing_map = torch.rand(T, E) < 0.4
    routing_map[:, 3] = False  # an expert with no tokens
    x = torch.randn(T, H, requires_grad=True)
    probs = torch.rand(T, E, requires_grad=True)
    out, pprobs, row_id_map, pad_offsets, target = te.moe_permute_and_pad_with_probs(
        x, probs, routing_map, routing_map.sum(0), align)
    ref, pref = _padded_permutation_reference(x.detach(), probs.detach(), routing_map, align)
    assert torch.equal(out, ref) and torch.equal(pprobs, pref)
    counts = routing_map.sum(0)
    assert torch.equal(target, (counts + align - 1) // align * align)
    if align == 1:
        assert pad_offsets is None
    else:
        pad = target - counts
        assert torch.equal(pad_offsets, torch.cat([pad.new_zeros(1), torch.cumsum(pad, 0)[:-1]]))
    # expert outputs back to tokens, weighted: the same as without padding
    merging = (probs * routing_map).detach().requires_grad_(True)
    back = te.moe_unpermute(out * pprobs[:, None], row_id_map, merging, pad_offsets=pad_offsets)
    # token t's single-expert terms: sum_e m[t,e] * p[t,e] * x[t]
    ref_back = x.detach() * (merging.detach() * probs.detach() * routing_map).sum(1, keepdim=True)
    assert torch.allclose(back, ref_back, rtol=1e-6, atol=1e-6)
    g = torch.randn_like(back)
    back.backward(g)
    w = (merging.detach() * probs.detach() * routing_map).sum(1, keepdim=True)
    assert torch.allclose(x.grad, g * w, rtol=1e-6, atol=1e-6)
    assert torch.allclose(probs.grad, (g * x.detach()).sum(1, keepdim=True) * merging.detach() * routing_map,
                          rtol=1e-6, atol=1e-6)


def test_permute_and_pad_refusals_and_bad_input():
    torch.manual_seed(3)
    routing_map = torch.rand(5, 2) < 0.5
    routing_map[0] = True
    x, probs = torch.randn(5, 3), torch.rand(5, 2)
    with pytest.raises(ValueError, match="tokens_per_expert"):
        te.moe_permute_and_pad_with_probs(x, probs, routing_map, routing_map.sum(0) + 1, 4)
    with pytest.raises(ValueError, match="tokens_per_expert"):
        te.moe_permute_and_pad_with_probs(x, probs, routing_map, None, 4)
    with pytest.raises(ValueError, match="align_size"):
        te.moe_permute_and_pad_with_probs(x, probs, routing_map, routing_map.sum(0), 0)
    out, _, ids = te.moe_permute_with_probs(x, probs, routing_map)
    with pytest.raises(NotImplementedError, match="moe_unpermute: argument 'pad_offsets'"):
        te.moe_unpermute(out, ids, pad_offsets=torch.zeros(2, dtype=torch.long))
    # TE's deprecated 'probs' name of merging_probs
    with pytest.warns(DeprecationWarning, match="probs"):
        a = te.moe_unpermute(out, ids, probs=probs * routing_map)
    assert torch.equal(a, te.moe_unpermute(out, ids, probs * routing_map))
    with pytest.raises(ValueError, match="merging_probs"):
        te.moe_unpermute(out, ids, probs * routing_map, probs=probs * routing_map)


# ---------------------------------------------------------------- te.optimizers multi-tensor entry points
def test_multi_tensor_l2norm_and_scale_against_torch():
    """Megatron-LM's gradient clipping, as it calls TE: the total and
    per-tensor norms, then every gradient scaled in place."""
    from seqfuse.pytorch import optimizers as opt
    torch.manual_seed(4)
    grads = [torch.randn(7, 3), torch.randn(0), torch.randn(11).to(torch.bfloat16), torch.randn(2, 2, 2)]
    flag = torch.zeros(1, dtype=torch.int32)
    total, per = opt.multi_tensor_applier(opt.multi_tensor_l2norm, flag, [grads], True)
    kept = [g for g in grads if g.numel()]  # the applier drops empty tensors, as TE's
    ref_per = torch.stack([g.double().norm() for g in kept])
    assert total.dtype == torch.float32 and total.shape == (1,)
    assert torch.allclose(total.double(), ref_per.norm().reshape(1), rtol=1e-6)
    assert torch.allclose(per.double(), ref_per, rtol=1e-6)
    total2, per2 = opt.multi_tensor_applier(opt.multi_tensor_l2norm, flag, [grads], False)
    assert torch.equal(total2, total) and per2.numel() == 0 and flag.item() == 0
    inv = torch.tensor([0.5])
    t3, p3 = opt.multi_tensor_unscale_l2norm(2048, flag, [kept], inv, True)
    assert torch.allclose(t3.double(), 0.5 * ref_per.norm().reshape(1), rtol=1e-6)
    refs = [g.float() * 0.25 for g in kept]
    opt.multi_tensor_applier(opt.multi_tensor_scale, flag, [grads, grads], 0.25)
    for g, r in zip(kept, refs):
        assert torch.equal(g, r.to(g.dtype))
    opt.multi_tensor_scale_tensor(2048, flag, [kept, kept], torch.tensor([4.0]))
    for g, r in zip(kept, refs):
        assert torch.equal(g, (r * 4).to(g.dtype))
    assert flag.item() == 0
    assert opt.multi_tensor_applier(opt.multi_tensor_l2norm, flag, [[torch.randn(0)]], False) is None


def test_multi_tensor_flags_non_finite_values():
    from seqfuse.pytorch import optimizers as opt
    flag = torch.zeros(1, dtype=torch.int32)
    src, dst = [torch.tensor([1.0, float("inf")])], [torch.zeros(2)]
    opt.multi_tensor_scale(2048, flag, [src, dst], 2.0)
    assert flag.item() == 1 and dst[0][0].item() == 2.0
    flag.zero_()
    opt.multi_tensor_l2norm(2048, flag, [[torch.tensor([float("nan")])]])
    assert flag.item() == 1
    with pytest.raises(ValueError, match="tensor_lists"):
        opt.multi_tensor_scale(2048, flag, [src], 2.0)
    with pytest.raises(ValueError, match="one size"):
        opt.multi_tensor_scale(2048, flag, [src, [torch.zeros(3)]], 2.0)
    with pytest.raises(TypeError, match="inv_scale"):
        opt.multi_tensor_unscale_l2norm(2048, flag, [src], 0.5)
    with pytest.raises(RuntimeError, match="one length"):
        opt.multi_tensor_applier(opt.multi_tensor_scale, flag, [src, []], 2.0)


@pytest.mark.cuda
def test_cuda_padded_permutation_and_multi_tensor_match_cpu():
    """On the GPU (seqfuse's permutation kernels, torch's CUDA foreach ops):
    the same results as the CPU backend, exactly for the row copies and to
    fp32 rounding for the norms."""
    from seqfuse.pytorch import optimizers as opt
    torch.manual_seed(5)
    T, E, H = 64, 8, 32
    routing_map = torch.rand(T, E) < 0.3
    x, probs = torch.randn(T, H), torch.rand(T, E)
    cpu = te.moe_permute_and_pad_with_probs(x, probs, routing_map, routing_map.sum(0), 16)
    xg = x.cuda().requires_grad_(True)
    gpu = te.moe_permute_and_pad_with_probs(xg, probs.cuda(), routing_map.cuda(), routing_map.sum(0).cuda(), 16)
    for a, b in zip(cpu, gpu):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b.cpu())
    back = te.moe_unpermute(gpu[0], gpu[2], (probs * routing_map).cuda(), pad_offsets=gpu[3])
    ref = te.moe_unpermute(cpu[0], cpu[2], probs * routing_map, pad_offsets=cpu[3])
    assert torch.allclose(back.cpu(), ref, rtol=1e-6, atol=1e-6)
    back.sum().backward()
    assert torch.isfinite(xg.grad).all()
    pad, unpad = te.Fp8Padding(E), te.Fp8Unpadding(E)
    splits = routing_map.sum(0).tolist()
    rows = torch.randn(sum(splits), H, device="cuda")
    padded, _ = pad(rows, splits)
    assert torch.equal(unpad(padded, splits), rows)
    grads = [torch.randn(100, 7), torch.randn(33).to(torch.bfloat16)]
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    tg, pg = opt.multi_tensor_applier(opt.multi_tensor_l2norm, flag, [[g.cuda() for g in grads]], True)
    tc, pc = opt.multi_tensor_l2norm(2048, torch.zeros(1, dtype=torch.int32), [grads], True)
    assert torch.allclose(tg.cpu(), tc, rtol=1e-5) and torch.allclose(pg.cpu(), pc, rtol=1e-5)
    assert flag.item() == 0
    # te.ops.ScaledSwiGLU on seqfuse's CUDA scaled_swiglu kernel, bf16, against the CPU backend in fp32
    xs, sc = torch.randn(4, 16, 64), torch.rand(4, 16)
    ref = te.ops.ScaledSwiGLU()(xs, sc)
    out = te.ops.ScaledSwiGLU()(xs.cuda().bfloat16(), sc.cuda())
    assert rel_error(out.float().cpu(), ref) <= rel_tol(torch.bfloat16, 4)


# ---------------------------------------------------------------- te.ops.ClampedSwiGLU
@pytest.mark.parametrize("kwargs", [{}, {"limit": 0.5, "alpha": 1.0, "glu_linear_offset": 0.0},
                                    {"glu_interleave_size": 2}])
def test_ops_clamped_swiglu_against_torch(kwargs):
    """GPT-OSS's formula in float64, values on both sides of the limits."""
    torch.manual_seed(6)
    limit, alpha = kwargs.get("limit", 7.0), kwargs.get("alpha", 1.702)
    offset, k = kwargs.get("glu_linear_offset", 1.0), kwargs.get("glu_interleave_size")
    x = (torch.randn(3, 5, 8) * 6).requires_grad_(True)
    op = te.ops.ClampedSwiGLU(**kwargs)
    out = op(x)
    xd = x.detach().double().requires_grad_(True)
    xr = xd if k is None else xd.reshape(3, 5, 8 // (2 * k), 2, k).transpose(-3, -2).reshape(3, 5, 8)
    a, b = xr[..., :4], xr[..., 4:]
    ac = torch.minimum(a, torch.tensor(limit, dtype=a.dtype))
    ref = ac * torch.sigmoid(alpha * ac) * (torch.maximum(torch.minimum(b, torch.tensor(limit, dtype=b.dtype)),
                                                          torch.tensor(-limit, dtype=b.dtype)) + offset)
    assert torch.allclose(out.double(), ref, rtol=1e-6, atol=1e-6)
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g.double())
    assert torch.allclose(x.grad.double(), xd.grad, rtol=1e-5, atol=1e-6)
    assert bool((x.abs() > limit).any())  # the clamps were exercised
    seq = te.ops.Sequential(te.ops.Linear(8, 8, device="cpu"), op)
    assert seq.plan()[-1] == (None, ["ClampedSwiGLU"]) and seq(x.detach()).shape == (3, 5, 4)
    with pytest.raises(NotImplementedError, match="cache_quantized_input"):
        te.ops.ClampedSwiGLU(cache_quantized_input=True)
    with pytest.raises(ValueError, match="multiple of"):
        op(torch.randn(2, 6) if k else torch.randn(2, 7))


# ---------------------------------------------------------------- te.ops extra inputs and outputs
@pytest.mark.parametrize("k", [None, 2])
def test_ops_scaled_swiglu_against_torch(k):
    torch.manual_seed(7)
    x = torch.randn(3, 5, 8, requires_grad=True)
    scales = torch.rand(3, 5, requires_grad=True)
    out = te.ops.ScaledSwiGLU(glu_interleave_size=k)(x, scales)
    xd = x.detach().double().requires_grad_(True)
    sd = scales.detach().double().requires_grad_(True)
    xr = xd if k is None else xd.reshape(3, 5, 8 // (2 * k), 2, k).transpose(-3, -2).reshape(3, 5, 8)
    ref = torch.nn.functional.silu(xr[..., :4]) * xr[..., 4:] * sd[..., None]
    assert torch.allclose(out.double(), ref, rtol=1e-6, atol=1e-6)
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g.double())
    assert torch.allclose(x.grad.double(), xd.grad, rtol=1e-5, atol=1e-6)
    assert torch.allclose(scales.grad.double(), sd.grad, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="scales"):
        te.ops.ScaledSwiGLU()(x, scales[:, :4])
    with pytest.raises(NotImplementedError, match="activation_recompute_in_mlp"):
        te.ops.ScaledSwiGLU(activation_recompute_in_mlp=True)


@pytest.mark.parametrize("in_place", [False, True])
def test_ops_sequential_routes_extra_inputs_and_outputs(in_place):
    """An MoE expert block the way TE writes it with te.ops: Linear,
    MakeExtraOutput (the pre-activation also returned), ScaledSwiGLU with
    the routing probabilities, Linear, AddExtraInput (the residual); against
    the same computation in torch, gradients included."""
    torch.manual_seed(8)
    fc1, fc2 = te.ops.Linear(6, 8, device="cpu"), te.ops.Linear(4, 6, device="cpu")
    seq = te.ops.Sequential(fc1, te.ops.MakeExtraOutput(in_place=in_place), te.ops.ScaledSwiGLU(), fc2,
                            te.ops.AddExtraInput(in_place=in_place))
    x = torch.randn(5, 6, requires_grad=True)
    probs = torch.rand(5, requires_grad=True)
    residual = torch.randn(5, 6)
    out, pre = seq(x, probs, residual.clone())
    w1, b1 = fc1.weight.detach().double(), fc1.bias.detach().double()
    w2, b2 = fc2.weight.detach().double(), fc2.bias.detach().double()
    xd = x.detach().double().requires_grad_(True)
    pd = probs.detach().double().requires_grad_(True)
    h = xd @ w1.T + b1
    ref = (torch.nn.functional.silu(h[:, :4]) * h[:, 4:] * pd[:, None]) @ w2.T + b2 + residual.double()
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5)
    assert torch.allclose(pre.double(), h, rtol=1e-5, atol=1e-5)
    g, gp = torch.randn_like(out), torch.randn_like(pre)
    torch.autograd.backward([out, pre], [g, gp])  # the extra output's gradient adds to the main path's
    torch.autograd.backward([ref, h], [g.double(), gp.double()])
    assert torch.allclose(x.grad.double(), xd.grad, rtol=1e-5, atol=1e-5)
    assert torch.allclose(probs.grad.double(), pd.grad, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="extra input"):
        seq(x, probs)
    with pytest.raises(NotImplementedError, match="op_kwargs"):
        seq(x, probs, residual, op_kwargs={0: {}})


def _situ_ref(a, b, beta1=4.0, beta2=25.0):
    return beta1 * torch.tanh(a / beta1) * torch.sigmoid(a) * beta2 * torch.tanh(b / beta2)


def _clamped_ref(a, b, limit=7.0, alpha=1.702, offset=1.0):
    ac = torch.clamp(a, max=limit)
    return ac * torch.sigmoid(alpha * ac) * (torch.clamp(b, -limit, limit) + offset)


@pytest.mark.parametrize("name,kwargs,ref", [
    ("SiTUGLU", {}, lambda x, s: _situ_ref(x[..., :4], x[..., 4:])),
    ("SiTUGLU", {"beta1": 1.5, "beta2": 2.0}, lambda x, s: _situ_ref(x[..., :4], x[..., 4:], 1.5, 2.0)),
    ("ScaledSiTUGLU", {"beta1": 2.0}, lambda x, s: _situ_ref(x[..., :4], x[..., 4:], 2.0) * s[..., None]),
    ("ScaledClampedQGeGLU", {"limit": 3.0},
     lambda x, s: _clamped_ref(x[..., :4], x[..., 4:], limit=3.0) * s[..., None]),
    ("ScaledSReLU", {}, lambda x, s: torch.relu(x) ** 2 * s[..., None]),
])
def test_ops_soft_capped_and_scaled_activations_against_torch(name, kwargs, ref):
    """The GLU variants seqfuse has no kernel for (torch, op by op), with
    TE's formulas (transformer_engine/common/util/math.h) in float64."""
    torch.manual_seed(9)
    op = getattr(te.ops, name)(**kwargs)
    x = (torch.randn(2, 3, 8) * 5).requires_grad_(True)
    s = torch.rand(2, 3, requires_grad=True)
    args = (x, s) if op.num_extra_inputs else (x,)
    out = op(*args)
    xd, sd = x.detach().double().requires_grad_(True), s.detach().double().requires_grad_(True)
    r = ref(xd, sd)
    assert torch.allclose(out.double(), r, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(out)
    out.backward(g)
    r.backward(g.double())
    assert torch.allclose(x.grad.double(), xd.grad, rtol=1e-5, atol=1e-5)
    if op.num_extra_inputs:
        assert torch.allclose(s.grad.double(), sd.grad, rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError, match="scales"):
            op(x, s[:1])
        with pytest.raises(NotImplementedError, match="activation_recompute_in_mlp"):
            getattr(te.ops, name)(activation_recompute_in_mlp=True)
    if "SiTU" in name:
        with pytest.raises(ValueError, match="beta1"):
            getattr(te.ops, name)(beta1=0.0)


@pytest.mark.parametrize("mode,masters", [(1, False), (0, False), (1, True)])
def test_multi_tensor_adam_against_torch(mode, masters):
    """TE's multi_tensor_adam, two steps, against torch.optim.AdamW (mode 1)
    / Adam with L2 (mode 0) in float64; with fp32 masters the bf16 params
    are the masters rounded."""
    from seqfuse.pytorch import optimizers as opt
    torch.manual_seed(10)
    shapes = [(4, 3), (7,)]
    params = [torch.randn(s).to(torch.bfloat16 if masters else torch.float32) for s in shapes]
    master = [p.float() for p in params]  # used with masters=True: fp32 copies of the bf16 params
    ref = [p.double().requires_grad_(True) for p in params]
    m = [torch.zeros(s) for s in shapes]
    v = [torch.zeros(s) for s in shapes]
    torch_opt = (torch.optim.AdamW if mode == 1 else torch.optim.Adam)(ref, lr=1e-2, betas=(0.9, 0.99), eps=1e-8,
                                                                       weight_decay=0.1)
    flag = torch.zeros(1, dtype=torch.int32)
    for step in (1, 2):
        grads = [torch.randn(s) for s in shapes]
        for r, g in zip(ref, grads):
            r.grad = g.double()
        torch_opt.step()
        lists = [grads, params, m, v] + ([master] if masters else [])
        opt.multi_tensor_applier(opt.multi_tensor_adam, flag, lists, 1e-2, 0.9, 0.99, 1e-8, step, mode, 1, 0.1)
    for p, r in zip(master if masters else params, ref):
        assert torch.allclose(p.double(), r.detach(), rtol=1e-5, atol=1e-6)
    if masters:
        for p, mp in zip(params, master):
            assert torch.equal(p, mp.to(torch.bfloat16))
    with pytest.raises(ValueError, match="mode"):
        opt.multi_tensor_adam(2048, flag, [grads, params, m, v], 1e-2, 0.9, 0.99, 1e-8, 1, 2, 1, 0.0)
    with pytest.raises(ValueError, match="4 or 5"):
        opt.multi_tensor_adam(2048, flag, [grads, params, m], 1e-2, 0.9, 0.99, 1e-8, 1, 1, 1, 0.0)


@pytest.mark.parametrize("nesterov,wd_after", [(False, False), (True, False), (False, True)])
def test_multi_tensor_sgd_against_torch(nesterov, wd_after):
    """TE's multi_tensor_sgd, three steps (the first with first_run=True),
    against torch.optim.SGD in float64 (wd_after_momentum against the
    formula: torch has no such mode); a set noop_flag changes nothing."""
    from seqfuse.pytorch import optimizers as opt
    torch.manual_seed(11)
    shapes = [(5, 2), (3,)]
    w = [torch.randn(s) for s in shapes]
    copies = [x.to(torch.bfloat16) for x in w]
    mom = [torch.zeros(s) for s in shapes]
    ref = [x.double().requires_grad_(True) for x in w]
    ref_mom = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    torch_opt = torch.optim.SGD(ref, lr=0.1, momentum=0.9, dampening=0.0, nesterov=nesterov,
                                weight_decay=0.0 if wd_after else 0.01)
    flag = torch.zeros(1, dtype=torch.int32)
    for step in range(3):
        grads = [torch.randn(s) for s in shapes]
        if wd_after:
            with torch.no_grad():
                for r, g, mb in zip(ref, grads, ref_mom):
                    mb.copy_(g.double() * 0.5 if step == 0 else mb * 0.9 + g.double() * 0.5)
                    r -= 0.1 * (mb + 0.01 * r)
        else:
            for r, g in zip(ref, grads):
                r.grad = g.double() * 0.5
            torch_opt.step()
        opt.multi_tensor_applier(opt.multi_tensor_sgd, flag, [grads, w, mom, copies], 0.01, 0.9, 0.0, 0.1,
                                 nesterov, step == 0, wd_after, 0.5)
    for x, r, c in zip(w, ref, copies):
        assert torch.allclose(x.double(), r.detach(), rtol=1e-5, atol=1e-6)
        assert torch.equal(c, x.to(torch.bfloat16))
    before = [x.clone() for x in w]
    flag.fill_(1)
    opt.multi_tensor_sgd(2048, flag, [grads, w, mom], 0.01, 0.9, 0.0, 0.1, nesterov, False, wd_after, 1.0)
    assert all(torch.equal(a, b) for a, b in zip(before, w))


# ---------------------------------------------------------------- te.checkpoint's legacy positional form
def test_checkpoint_legacy_positional_form():
    """TE's deprecated checkpoint(fn, distribute_saved_activations,
    get_rng_state_tracker, tp_group, *tensors): recognised (not passed on
    to fn as arguments), warned about, and its values judged as keywords
    (the RNG tracker it always carries is refused by name, where passing
    it on to fn would have been a silent wrong call)."""
    torch.manual_seed(12)
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    y = torch.randn(3, 4)

    def fn(a, b, c):
        return torch.tanh(lin(a)) * b + c

    ref = fn(x, y, y)
    g_ref, = torch.autograd.grad(ref.sum(), x)
    with pytest.warns(DeprecationWarning, match="positionally"), pytest.raises(NotImplementedError,
                                                                               match="get_rng_state_tracker"):
        te.checkpoint(fn, False, te.CudaRNGStatesTracker, None, x, y, y)
    # the plain form runs, values and gradients as without checkpointing
    out = te.checkpoint(fn, x, y, y)
    g, = torch.autograd.grad(out.sum(), x)
    assert torch.equal(out, ref) and torch.equal(g, g_ref)
