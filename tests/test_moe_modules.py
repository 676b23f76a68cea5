"""GroupedLinear and GroupedMLP (seqfuse.modules) against plain torch: a
per-expert loop of torch linear layers, and a plain torch MoE block (router,
top-k, SwiGLU experts, weighted sum), in outputs and in the gradients of
the input and of every parameter; the cuda-marked tests run the modules on
the GPU in bf16 against the same modules on the CPU in float32."""
import pytest
import torch
import torch.nn.functional as F

from seqfuse.quantization import fp8_autocast
from seqfuse.common.recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format,
                                   MXFP8BlockScaling)
from seqfuse.modules import GroupedLinear, GroupedMLP, Linear
from seqfuse.ops import moe as moe_ops
from seqfuse.quantization.gemm_quantizers import weight_casts

from helpers import REL_TOL, grouped_and_per_expert_fp8_step, needs_fp8, pair_tol, rel_error


def _grads(module):
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("splits", [[5, 0, 9, 2], [16], [0, 0, 7]])
@pytest.mark.parametrize("bias", [True, False])
def test_grouped_linear_matches_per_expert_linear(splits, bias, seed):
    G, fin, fout = len(splits), 12, 20
    layer = GroupedLinear(G, fin, fout, bias=bias, device="cpu")
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_()
    x = torch.randn(sum(splits), fin, requires_grad=True)
    y = layer(x, splits)
    g = torch.randn_like(y)
    y.backward(g)
    xr = x.detach().double().requires_grad_()
    ws = [getattr(layer, f"weight{e}").detach().double().requires_grad_() for e in range(G)]
    bs = [getattr(layer, f"bias{e}").detach().double().requires_grad_() for e in range(G)] if bias else [None] * G
    outs, o = [], 0
    for e, m in enumerate(splits):
        outs.append(F.linear(xr[o:o + m], ws[e], bs[e]))
        o += m
    ref = torch.cat(outs)
    (ref * g.double()).sum().backward()
    assert rel_error(y, ref) <= REL_TOL[torch.float32]
    assert rel_error(x.grad, xr.grad) <= REL_TOL[torch.float32]
    for e in range(G):
        w = getattr(layer, f"weight{e}")
        assert rel_error(w.grad, ws[e].grad) <= REL_TOL[torch.float32]
        if splits[e] == 0:
            assert torch.equal(w.grad, torch.zeros_like(w))  # an expert with no tokens
        if bias:
            assert rel_error(getattr(layer, f"bias{e}").grad, bs[e].grad) <= REL_TOL[torch.float32]


def test_grouped_linear_parameters_and_te_names():
    layer = GroupedLinear(3, 8, 4, bias=True, device="cpu", params_dtype=torch.bfloat16)
    names = [n for n, _ in layer.named_parameters()]
    assert names == ["weight0", "bias0", "weight1", "bias1", "weight2", "bias2"]
    assert layer.weight1.dtype == torch.bfloat16 and layer.weight1.shape == (4, 8)
    meta = GroupedLinear(2, 8, 4, device="meta")
    assert meta.weight0.is_meta
    y, biases = GroupedLinear(2, 8, 4, device="cpu", return_bias=True)(torch.randn(3, 8), [1, 2])
    assert y.shape == (3, 4) and len(biases) == 2


def test_grouped_linear_accumulates_into_main_grad(seed):
    splits = [3, 0, 4]
    layer = GroupedLinear(3, 8, 4, bias=False, device="cpu")
    for w in layer.parameters():
        w.main_grad = torch.ones_like(w, dtype=torch.float32)
        w.grad_added_to_main_grad = False
    x = torch.randn(7, 8)
    layer(x, splits).sum().backward()
    o = 0
    for e, m in enumerate(splits):
        w = getattr(layer, f"weight{e}")
        ref = 1 + torch.ones(4, m) @ x[o:o + m]
        assert w.grad is None and w.grad_added_to_main_grad
        assert torch.allclose(w.main_grad, ref, rtol=1e-6, atol=1e-6)
        o += m


@needs_fp8
def test_grouped_linear_fp8_accumulates_into_main_grad(seed):
    """FP8 weight gradients accumulate into main_grad as the per-expert FP8 Linear's do."""
    splits = [5, 0, 20]
    gl = GroupedLinear(3, 32, 16, bias=False, device="cpu")
    lins = [Linear(32, 16, bias=False, device="cpu") for _ in splits]
    for g, lin in enumerate(lins):
        with torch.no_grad():
            lin.weight.copy_(getattr(gl, f"weight{g}"))
        for w in (lin.weight, getattr(gl, f"weight{g}")):
            w.main_grad = torch.ones(16, 32)
            w.grad_added_to_main_grad = False
    x, dy = torch.randn(25, 32), torch.randn(25, 16)
    with fp8_autocast(enabled=True, fp8_recipe=Float8CurrentScaling()):
        gl(x, splits).backward(dy)
        o = 0
        for g, m in enumerate(splits):
            if m:
                lins[g](x[o:o + m]).backward(dy[o:o + m])
            o += m
    for g in range(3):
        w = getattr(gl, f"weight{g}")
        assert w.grad is None and w.grad_added_to_main_grad
        assert torch.equal(w.main_grad, lins[g].weight.main_grad)


def test_grouped_linear_refuses_what_it_lacks():
    layer = GroupedLinear(2, 16, 16, device="cpu")
    with pytest.raises(ValueError, match="add up to 5"):
        layer(torch.randn(6, 16), [2, 3])
    with pytest.raises(ValueError, match="num_gemms = 2"):
        layer(torch.randn(6, 16), [6])
    with pytest.raises(ValueError, match="in_features"):
        layer(torch.randn(6, 15), [3, 3])
    with pytest.raises(NotImplementedError, match="tensor/sequence parallelism"):
        GroupedLinear(2, 16, 16, device="cpu", sequence_parallel=True)
    with pytest.raises(NotImplementedError, match="MXFP8BlockScaling"):
        with fp8_autocast(enabled=True, fp8_recipe=MXFP8BlockScaling()):
            GroupedLinear(2, 128, 128, device="cpu")(torch.randn(6, 128), [3, 3])
    with pytest.raises(ValueError, match="multiple of 128"):
        with fp8_autocast(enabled=True, fp8_recipe=Float8BlockScaling()):
            GroupedLinear(2, 64, 128, device="cpu")(torch.randn(6, 64), [3, 3])
    with pytest.raises(ValueError, match="multiple of 16"):
        with fp8_autocast(enabled=True, fp8_recipe=DelayedScaling()):
            GroupedLinear(2, 24, 16, device="cpu")(torch.randn(6, 24), [3, 3])


@needs_fp8
@pytest.mark.parametrize("recipe", [Float8CurrentScaling(), DelayedScaling(fp8_format=Format.HYBRID),
                                    Float8BlockScaling()],
                         ids=["current", "delayed_hybrid", "block"])
def test_grouped_linear_fp8_equals_per_expert_fp8_linear(recipe, seed):
    """FP8 GroupedLinear is the per-expert FP8 Linear bit for bit on the CPU:
    the same quantizers (one scale per expert and operand, rows padded to
    16), the same reference GEMM, over three steps with weight updates (so
    delayed scaling runs on updated amax histories)."""
    splits = [5, 0, 37, 16]
    G, fin, fout = (len(splits), 128, 256) if isinstance(recipe, Float8BlockScaling) else (len(splits), 32, 48)
    gl = GroupedLinear(G, fin, fout, bias=True, device="cpu")
    lins = [Linear(fin, fout, bias=True, device="cpu") for _ in range(G)]
    with torch.no_grad():
        for g, lin in enumerate(lins):
            lin.weight.copy_(getattr(gl, f"weight{g}"))
            getattr(gl, f"bias{g}").normal_()
            lin.bias.copy_(getattr(gl, f"bias{g}"))
    for step in range(3):
        (y, dx), (y_ref, dx_ref) = grouped_and_per_expert_fp8_step(gl, lins, splits, recipe)
        assert torch.equal(y, y_ref), step
        assert torch.equal(dx, dx_ref), step
        for g in range(G):
            w, b = getattr(gl, f"weight{g}"), getattr(gl, f"bias{g}")
            if splits[g] == 0:
                assert torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(b.grad, torch.zeros_like(b))
            else:
                assert torch.equal(w.grad, lins[g].weight.grad), (step, g)
                assert torch.equal(b.grad, lins[g].bias.grad), (step, g)
        with torch.no_grad():  # the same SGD step on both
            for g in range(G):
                for p, q in ((getattr(gl, f"weight{g}"), lins[g].weight), (getattr(gl, f"bias{g}"), lins[g].bias)):
                    if q.grad is not None:
                        p -= 0.1 * p.grad
                        q -= 0.1 * q.grad
                    p.grad = q.grad = None
    if isinstance(recipe, DelayedScaling):
        assert gl.fp8_state is not None  # TE's 3 x num_gemms slots
        # training without is_first_microbatch: every expert's weight cast at every forward, the idle one's
        # too (nothing is kept past a forward: lean_weights)
        assert weight_casts(gl) == 3 * G


def plain_moe(x, m, bias):
    """transformers-style MoE in float64: route, loop over experts, weighted sum."""
    E, F_, k = m.num_experts, m.ffn_hidden_size, m.topk
    p = {n: t.detach().double().requires_grad_() for n, t in m.named_parameters()}
    x2 = x.reshape(-1, m.hidden_size)
    logits = x2 @ p["router_weight"].T
    if m.score_function == "softmax":
        vals, idx = logits.topk(k, -1)
        probs = torch.softmax(vals, -1)
    else:
        s = torch.sigmoid(logits)
        sel = s + (m.expert_bias.double() if m.expert_bias is not None else 0)
        idx = sel.topk(k, -1).indices
        probs = s.gather(1, idx)
        probs = probs / (probs.sum(-1, keepdim=True) + 1e-20)
    out = torch.zeros_like(x2)
    for e in range(E):
        tok, slot = (idx == e).nonzero(as_tuple=True)
        w1, w2 = p[f"fc1.weight{e}"], p[f"fc2.weight{e}"]
        h = F.linear(x2[tok], w1, p[f"fc1.bias{e}"] if bias else None)
        a = F.silu(h[:, :F_]) * h[:, F_:] * probs[tok, slot, None]
        out = out.index_add(0, tok, F.linear(a, w2, p[f"fc2.bias{e}"] if bias else None))
    aux = None
    if m.aux_loss_coeff > 0:
        scores = torch.softmax(logits, -1) if m.score_function == "softmax" else \
            torch.sigmoid(logits) / (torch.sigmoid(logits).sum(-1, keepdim=True) + 1e-20)
        amap = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, scores.topk(k, -1).indices, True)
        T = x2.shape[0]
        aux = (scores.sum(0) * amap.sum(0)).sum() * (E * m.aux_loss_coeff / (k * T * T))
    if m.z_loss_coeff > 0:
        z = torch.logsumexp(logits, -1).square().mean() * m.z_loss_coeff
        aux = z if aux is None else aux + z
    return out.view(x.shape), aux, p


@pytest.mark.parametrize("config", [
    dict(score_function="softmax", topk=2, bias=False, aux_loss_coeff=0.01, z_loss_coeff=1e-3),
    dict(score_function="sigmoid", topk=3, bias=True, expert_bias=True, aux_loss_coeff=0.02),
    dict(score_function="softmax", topk=1, bias=False),
], ids=["mixtral", "sigmoid_bias", "top1"])
def test_grouped_mlp_matches_plain_torch_moe(config, seed):
    H, Fh, E = 16, 24, 6
    m = GroupedMLP(H, Fh, E, device="cpu", **config)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
        if m.expert_bias is not None:
            m.expert_bias.normal_(0, 0.1)
    x = torch.randn(3, 7, H, requires_grad=True)
    y = m(x)
    g = torch.randn_like(y)
    loss = (y * g).sum() + (m.aux_loss if m.aux_loss is not None else 0)
    loss.backward()
    xr = x.detach().double().requires_grad_()
    ref, aux, params = plain_moe(xr, m, config.get("bias", False))
    rloss = (ref * g.double()).sum() + (aux if aux is not None else 0)
    rloss.backward()
    assert y.shape == x.shape
    assert rel_error(y, ref) <= REL_TOL[torch.float32] * 2
    if aux is not None:
        assert rel_error(m.aux_loss, aux) <= REL_TOL[torch.float32]
    assert rel_error(x.grad, xr.grad) <= REL_TOL[torch.float32] * 2
    for n, p in m.named_parameters():
        ref_grad = params[n].grad
        if ref_grad is None:  # an expert nobody was routed to
            assert torch.equal(p.grad, torch.zeros_like(p))
        else:
            assert rel_error(p.grad, ref_grad) <= REL_TOL[torch.float32] * 2, n


def test_grouped_mlp_equals_transformers_mixtral_block(seed):
    """transformers' MixtralSparseMoeBlock (softmax, top-2, renormalised) with
    its weights copied in (benchmarks/moe/bench_moe_layer.py's mapping)."""
    transformers = pytest.importorskip("transformers")
    import importlib.util
    import sys
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    spec = importlib.util.spec_from_file_location(
        "bench_moe_layer", __file__.replace("tests/test_moe_modules.py", "benchmarks/moe/bench_moe_layer.py"))
    bench = importlib.util.module_from_spec(spec)
    sys.path.insert(0, __file__.replace("tests/test_moe_modules.py", "benchmarks"))
    try:
        spec.loader.exec_module(bench)
    finally:
        sys.path.pop(0)
    H, Fh, E = 32, 48, bench.EXPERTS
    cfg = transformers.MixtralConfig(hidden_size=H, intermediate_size=Fh, num_local_experts=E,
                                     num_experts_per_tok=2, router_jitter_noise=0.0)
    cfg._experts_implementation = "eager"
    block = MixtralSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    m = GroupedMLP(H, Fh, E, 2, device="cpu")
    bench.copy_weights(block, m)
    x = torch.randn(2, 10, H)
    ref = block(x)
    ref = ref[0] if isinstance(ref, tuple) else ref
    assert rel_error(m(x), ref) <= REL_TOL[torch.float32] * 2


def _swiglu_step(gl, h, probs, splits, dy, fused, inputs_grad=True):
    """One forward and backward of GroupedLinear ``gl`` as a down projection
    on gate|up rows ``h`` and row scales ``probs``: with ``fused`` through
    swiglu_probs (the SwiGLU in the layer's autograd Function, its output
    made again in the backward), else fed scaled_swiglu's output (the
    SwiGLU's own autograd node: the layer keeps that output for its weight
    gradient).  Returns ([output, dh, dprobs, main_grads or grads of every
    parameter], the distinct storages the forward saved for the backward:
    {data_ptr: (dtype, nbytes)})."""
    h = h.detach().clone().requires_grad_(inputs_grad)
    probs = probs.detach().clone().requires_grad_(inputs_grad)
    for prm in gl.parameters():
        prm.grad = None
        if hasattr(prm, "main_grad"):
            prm.main_grad.fill_(0.5)
    params = {prm.untyped_storage().data_ptr() for prm in gl.parameters()}
    saved = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            saved[st.data_ptr()] = (t.dtype, st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = gl(h, splits, swiglu_probs=probs) if fused else gl(moe_ops.scaled_swiglu(h, probs), splits)
    y.backward(dy)
    grads = [getattr(prm, "main_grad", None) if hasattr(prm, "main_grad") else prm.grad for prm in gl.parameters()]
    return [y.detach(), h.grad, probs.grad] + [g.clone() if g is not None else None for g in grads], saved


def _same(a, b):
    assert len(a) == len(b)
    for i, (u, v) in enumerate(zip(a, b)):
        assert (u is None) == (v is None), i
        assert u is None or (u.dtype == v.dtype and torch.equal(u, v)), i


@pytest.mark.parametrize("mode", ["float32", "bfloat16", "autocast", "main_grad", "weights_only"])
@pytest.mark.parametrize("splits", [[5, 0, 9, 2], [0, 0, 7]])
def test_swiglu_probs_gradients_bit_identical_to_the_kept_swiglu_output(mode, splits, seed):
    """GroupedLinear's down-projection call (swiglu_probs: the SwiGLU output
    not kept, made again for the weight gradient from the saved gate|up rows
    and probabilities) against the same layer fed scaled_swiglu's output,
    which keeps it: the output and the gradients of the gate|up rows, the
    probabilities, the weights and biases bit for bit; in float32, bfloat16,
    float32 parameters under torch.autocast's bfloat16 (the SwiGLU output
    converted for the GEMMs, its gradient converted back), accumulation into
    main_grad, and with only the parameters' gradients wanted.  The
    swiglu_probs call keeps the SwiGLU output's [M, K] less, nothing else
    (the reference's SwiGLU node keeps the same gate|up rows and
    probabilities); with only the parameters' gradients wanted (no SwiGLU
    backward to keep the gate|up rows for) it keeps the SwiGLU output, as
    the reference does."""
    G, K, N = len(splits), 24, 20
    dtype = torch.bfloat16 if mode == "bfloat16" else torch.float32
    gl = GroupedLinear(G, K, N, bias=True, device="cpu", params_dtype=dtype)
    with torch.no_grad():
        for prm in gl.parameters():
            prm.normal_()
    if mode == "main_grad":
        for w in gl.weights():
            w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
    M = sum(splits)
    h = torch.randn(M, 2 * K).to(dtype)
    probs = torch.rand(M)
    dy = torch.randn(M, N).to(dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
        got, kept = _swiglu_step(gl, h, probs, splits, dy, True, inputs_grad=mode != "weights_only")
        ref, ref_kept = _swiglu_step(gl, h, probs, splits, dy, False, inputs_grad=mode != "weights_only")
    _same(got, ref)
    if mode == "weights_only":
        assert got[1] is None and got[2] is None
    if mode == "main_grad":
        assert all(w.grad is None for w in gl.weights())
    a_bytes = M * K * (2 if dtype == torch.bfloat16 or mode == "autocast" else 4)  # (the GEMMs' dtype)
    if mode == "weights_only":
        a_bytes = 0
    assert sum(n for _, n in ref_kept.values()) - sum(n for _, n in kept.values()) == a_bytes


@needs_fp8
@pytest.mark.parametrize("recipe", [Float8CurrentScaling(), Float8BlockScaling(), DelayedScaling()],
                         ids=["current", "block", "delayed"])
def test_fp8_swiglu_probs_gradients_bit_identical_and_what_is_kept(recipe, seed):
    """Under FP8 (host row counts) GroupedLinear's down-projection call
    (swiglu_probs) against the same layer (a second one, same weights and
    scaling history) fed scaled_swiglu's output, over two steps (delayed
    scaling's second casts through the fused SwiGLU cast): the output and
    the gradients of the gate|up rows, the probabilities and the weights bit
    for bit.  Kept for the backward: under current and block scaling not the
    SwiGLU output's transposed FP8 copy (one byte per element of [K, each
    expert's rows padded to 16, under block scaling to 128]: that many
    bytes fewer than the reference, which keeps it; made again in the
    backward, its scales coming from its values); under delayed scaling
    that copy, as the reference (its scales are the state's at the forward,
    replaced at the autocast region's exit)."""
    splits, K, N = [5, 0, 21, 3], 128, 128  # (block scaling: features of 128)
    G, M = len(splits), sum(splits)
    pad = 128 if isinstance(recipe, Float8BlockScaling) else 16
    Mp = sum(-(-m // pad) * pad for m in splits)
    layers = [GroupedLinear(G, K, N, bias=False, device="cpu") for _ in range(2)]
    layers[1].load_state_dict(layers[0].state_dict())
    for step in range(2):
        h, probs, dy = torch.randn(M, 2 * K), torch.rand(M), torch.randn(M, N)
        runs = []
        for gl, fused in zip(layers, (True, False)):
            with fp8_autocast(enabled=True, fp8_recipe=recipe):
                runs.append(_swiglu_step(gl, h, probs, splits, dy, fused))
        (got, kept), (ref, ref_kept) = runs
        _same(got, ref)

        def fp8_bytes(saved):
            return sum(n for dt, n in saved.values() if dt.itemsize == 1)

        fewer = 0 if isinstance(recipe, DelayedScaling) else K * Mp
        assert fp8_bytes(ref_kept) - fp8_bytes(kept) == fewer, step


@pytest.mark.cuda
@pytest.mark.parametrize("route", ["host_bf16", "device_bf16", "host_current", "host_block", "device_fp8"])
def test_swiglu_probs_cuda_bit_identical_to_the_kept_swiglu_output(route, seed):
    """On the GPU, each route's down-projection call (swiglu_probs) against
    the same layer (a second one, same weights) fed scaled_swiglu's output,
    which keeps it: the CUDA kernels run again in the backward (the SwiGLU;
    under current and block scaling the grouped cast of its transposed FP8
    copy, scales included) give the forward's values, so the output and
    the gradients of the gate|up rows and the weights are the same bit for
    bit, and less is kept.  The probabilities' gradient too, but on the
    FP8 host-count routes, whose SwiGLU backward runs in the grouped pass
    that reads the padded input gradient (swiglu_backward_cast_fp8_grouped:
    each row's sum over K in another order than moe_swiglu_backward's)
    within float32 rounding of a K-term sum."""
    splits, K, N = [128, 0, 77, 300, 5], 256, 128
    G, M = len(splits), sum(splits)
    recipe = {"host_current": Float8CurrentScaling(), "host_block": Float8BlockScaling(),
              "device_fp8": Float8CurrentScaling(fp8_format=Format.E4M3)}.get(route)
    layers = [GroupedLinear(G, K, N, bias=False, device="cuda", params_dtype=torch.bfloat16) for _ in range(2)]
    layers[1].load_state_dict(layers[0].state_dict())
    h = torch.randn(M, 2 * K, device="cuda").bfloat16()
    probs, dy = torch.rand(M, device="cuda"), torch.randn(M, N, device="cuda").bfloat16()
    counts = torch.tensor(splits, device="cuda") if route.startswith("device") else splits
    if route.startswith("device"):
        assert layers[0].device_split_refusal(h, recipe) is None
    runs = []
    for gl, fused in zip(layers, (True, False)):
        with fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
            runs.append(_swiglu_step(gl, h, probs, counts, dy, fused))
    (got, kept), (ref, ref_kept) = runs
    if route in ("host_current", "host_block"):  # (got[2]: dprobs)
        torch.testing.assert_close(got[2], ref[2], rtol=1e-5, atol=1e-5 * K ** 0.5)
        got, ref = got[:2] + got[3:], ref[:2] + ref[3:]
    _same(got, ref)
    assert sum(n for _, n in kept.values()) < sum(n for _, n in ref_kept.values())


@needs_fp8
def test_grouped_mlp_fp8_current_close_to_bf16_path(seed):
    """GroupedMLP under Float8CurrentScaling: its grouped GEMMs in FP8, within
    FP8's error of the same block without the autocast, gradients finite."""
    m = GroupedMLP(32, 32, 4, 2, device="cpu", aux_loss_coeff=0.01)
    x = torch.randn(40, 32, requires_grad=True)
    with fp8_autocast(enabled=True, fp8_recipe=Float8CurrentScaling()):
        y = m(x)
    (y.square().sum() + m.aux_loss).backward()
    ref = m(x.detach())
    assert rel_error(y, ref) <= 0.1  # E4M3 operands (3 mantissa bits) through two GEMMs
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    assert all(torch.isfinite(p.grad).all() for p in m.parameters())


@pytest.mark.parametrize("recipe", ["Float8CurrentScaling", "DelayedScaling", "Float8BlockScaling"])
def test_grouped_mlp_passes_is_first_microbatch_on(recipe, seed):
    """GroupedMLP.forward's is_first_microbatch reaches both GroupedLinears:
    False reuses the FP8 weights cast by the True call (an in-place change
    of the experts' weights in between is not seen, as in Transformer
    Engine), None casts them again."""
    from seqfuse.common import recipe as recipes

    m = GroupedMLP(128, 128, 4, 2, device="cpu")
    x = torch.randn(24, 128)
    with torch.no_grad(), fp8_autocast(enabled=True, fp8_recipe=getattr(recipes, recipe)()):
        first = m(x, is_first_microbatch=True)
        # the prefetch cast, the forward reused it: one cast per expert weight, not two
        quantizers = [fc._quantizers(getattr(recipes, recipe)(), x.device) for fc in (m.fc1, m.fc2)]
        if recipe != "Float8BlockScaling":  # (block scaling casts in the forward: no prefetch)
            assert [w.casts for q in quantizers for w in q.weights] == [1] * 8
        for w in m.fc1.weights() + m.fc2.weights():
            w.mul_(2.0)
        reused = m(x, is_first_microbatch=False)
        recast = m(x)
    assert torch.equal(reused, first)
    assert not torch.allclose(recast, first)


@needs_fp8
def test_expert_parallel_mlp_passes_is_first_microbatch_on(seed):
    """ExpertParallelGroupedMLP.forward's is_first_microbatch (one rank: no
    EP group) reaches both local GroupedLinears, as GroupedMLP's does: True
    casts each expert weight once and gives the default call's output,
    False reuses those casts (an in-place change of the weights in between
    is not seen) and casts nothing, None casts the changed weights."""
    from seqfuse.modules import ExpertParallelGroupedMLP

    m = ExpertParallelGroupedMLP(128, 128, 4, 2, device="cpu")
    x = torch.randn(24, 128)
    with torch.no_grad(), fp8_autocast(enabled=True, fp8_recipe=Float8CurrentScaling()):
        default = m(x)
        assert weight_casts(m) == 8
        first = m(x, is_first_microbatch=True)
        assert weight_casts(m) == 16 and torch.equal(first, default)
        for w in m.fc1.weights() + m.fc2.weights():
            w.mul_(2.0)
        reused = m(x, is_first_microbatch=False)
        assert weight_casts(m) == 16 and torch.equal(reused, first)
        recast = m(x)
        assert weight_casts(m) == 24 and not torch.allclose(recast, first)


def test_grouped_mlp_with_no_tokens():
    """An idle rank's step: no tokens in, zero gradients out, no aux loss."""
    m = GroupedMLP(16, 16, 4, 2, device="cpu", aux_loss_coeff=0.01, bias=True)
    x = torch.randn(0, 16, requires_grad=True)
    y = m(x)
    y.sum().backward()
    assert y.shape == (0, 16) and x.grad.shape == (0, 16) and m.aux_loss is None
    for n, p in m.named_parameters():
        assert torch.equal(p.grad, torch.zeros_like(p)), n


def test_grouped_mlp_eval_has_no_aux_loss():
    m = GroupedMLP(8, 8, 4, 2, device="cpu", aux_loss_coeff=0.1).eval()
    with torch.no_grad():
        m(torch.randn(5, 8))
    assert m.aux_loss is None


@pytest.mark.cuda
def test_grouped_mlp_cuda_bf16_matches_cpu(seed):
    H, Fh, E = 256, 512, 8
    cpu = GroupedMLP(H, Fh, E, 2, device="cpu", aux_loss_coeff=0.01)
    gpu = GroupedMLP(H, Fh, E, 2, device="cuda", params_dtype=torch.bfloat16, aux_loss_coeff=0.01)
    gpu.load_state_dict({k: v.to(torch.bfloat16) for k, v in cpu.state_dict().items()})
    with torch.no_grad():  # the CPU copy holds the bf16-rounded weights, so both see the same ones
        for p in cpu.parameters():
            p.copy_(p.bfloat16().float())
    x = torch.randn(4, 300, H).bfloat16().float()
    g = torch.randn(4, 300, H)
    yc = cpu(x.requires_grad_())
    (yc * g).sum().add(cpu.aux_loss).backward()
    xg = x.detach().cuda().bfloat16().requires_grad_()
    yg = gpu(xg)
    (yg.float() * g.cuda()).sum().add(gpu.aux_loss).backward()
    # bf16 through router, two GEMMs and SwiGLU: the routing of a few tokens may flip
    # where two logits are within bf16 rounding, so compare the tokens routed alike
    with torch.no_grad():
        _, map_c, _ = cpu.route(x.reshape(-1, H))
        _, map_g, _ = gpu.route(xg.reshape(-1, H))
    same = (map_c == map_g.cpu()).all(-1)
    assert same.float().mean() > 0.97
    assert rel_error(yg.float().cpu().reshape(-1, H)[same], yc.detach().reshape(-1, H)[same]) <= REL_TOL[torch.bfloat16] * 2
    if bool(same.all()):
        assert rel_error(xg.grad.float().cpu(), x.grad) <= REL_TOL[torch.bfloat16] * 4
        for (n, pc), (_, pg) in zip(cpu.named_parameters(), gpu.named_parameters()):
            assert rel_error(pg.grad.float().cpu(), pc.grad) <= REL_TOL[torch.bfloat16] * 4, n


@pytest.mark.cuda
@needs_fp8
@pytest.mark.parametrize("recipe", [Float8CurrentScaling(), DelayedScaling(), Float8BlockScaling()],
                         ids=["current", "delayed", "block"])
def test_grouped_linear_fp8_cuda_matches_per_expert_linear(recipe, seed):
    splits = [100, 0, 333, 16, 1]
    G, fin, fout = len(splits), 256, 512
    gl = GroupedLinear(G, fin, fout, bias=True, device="cuda", params_dtype=torch.bfloat16)
    lins = [Linear(fin, fout, bias=True, device="cuda", params_dtype=torch.bfloat16) for _ in range(G)]
    with torch.no_grad():
        for g, lin in enumerate(lins):
            lin.weight.copy_(getattr(gl, f"weight{g}"))
            getattr(gl, f"bias{g}").normal_()
            lin.bias.copy_(getattr(gl, f"bias{g}"))
    x = torch.randn(sum(splits), fin, device="cuda").bfloat16().requires_grad_()
    dy = torch.randn(sum(splits), fout, device="cuda").bfloat16()
    with fp8_autocast(enabled=True, fp8_recipe=recipe):
        y = gl(x, splits)
    y.backward(dy)
    xr = x.detach().clone().requires_grad_()
    offs = [0]
    for m in splits:
        offs.append(offs[-1] + m)
    with fp8_autocast(enabled=True, fp8_recipe=recipe):
        parts = [lins[g](xr[offs[g]:offs[g + 1]]) for g in range(G) if splits[g]]
    ref = torch.cat(parts)
    ref.backward(dy)
    assert rel_error(y, ref) <= pair_tol(torch.bfloat16)
    assert rel_error(x.grad, xr.grad) <= pair_tol(torch.bfloat16)
    for g in range(G):
        if splits[g]:
            assert rel_error(getattr(gl, f"weight{g}").grad, lins[g].weight.grad) <= pair_tol(torch.bfloat16)
            assert rel_error(getattr(gl, f"bias{g}").grad, lins[g].bias.grad) <= pair_tol(torch.bfloat16)
