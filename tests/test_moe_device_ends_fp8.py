"""The device-split route under FP8 delayed scaling
(DeviceEndsFp8GroupedLinearFunction): the forward casts with the groups'
ends on the device (ops.moe.cast_fp8_grouped_ends) and multiplies by the
sm90 kernel reading them there (grouped_gemm_device_ends_fp8); the backward
reads the counts' host copy and is the host-count route's.

The route's answer is the host-count route's bit for bit: the same input
bytes (each row cast with its expert's scale, padded or not), the same
per-row products, the same backward, and the weight gradient's transposed
copy made in the backward with the forward's scales equals the one the
host route makes in its forward.  On the CPU (both ops have CPU
references) the Function is driven directly with the route's kernel check
stubbed out; on CUDA a GroupedMLP takes the route by itself and is held to
the host-count GroupedMLP over training steps, and its forward waits on
nothing the GPU computes."""
import copy
import itertools
import logging

import pytest
import torch

from seqfuse.common import notes as notes_module
from seqfuse.common.recipe import DelayedScaling, Format
from seqfuse.modules import GroupedLinear, GroupedMLP
from seqfuse.modules import grouped_linear as gl_module
from seqfuse.ops import moe as moe_ops
from seqfuse.quantization import fp8_autocast

from helpers import needs_fp8, no_host_sync

pytestmark = needs_fp8

SPLITS = [5, 0, 19, 8]
WARM = [8, 8, 8, 8]  # (every expert's first cast: an expert that never had rows has no history)


def _layer(G=4, k=32, n=48, bias=False):
    torch.manual_seed(0)
    return GroupedLinear(G, k, n, bias=bias, params_dtype=torch.bfloat16, device="cpu")


def _warm(layers, x, splits, recipe, probs=None):
    """One host-route training step of each of ``layers`` in one autocast
    region (the experts' first delayed casts, whose amaxes give every slot a
    history at the region's exit; one region, so that every state is
    updated as often as the other)."""
    with fp8_autocast(fp8_recipe=recipe):
        ys = [layer(x, splits, swiglu_probs=probs) if probs is not None else layer(x, splits) for layer in layers]
    for layer, y in zip(layers, ys):
        y.float().sum().backward()
        layer.zero_grad(set_to_none=True)


def test_refusals_name_their_rule(monkeypatch):
    recipe = DelayedScaling()
    x = torch.randn(4, 32)
    with fp8_autocast(fp8_recipe=recipe):
        assert "sm90 grouped kernel: the tensors are not on a CUDA device" in _layer().device_split_refusal(x)
        assert "adds no bias" in _layer(bias=True).device_split_refusal(x)
        monkeypatch.setattr(moe_ops, "sm90_kernel_refusal", lambda device: None)
        assert "writes bfloat16, this call computes in torch.float32" in \
            GroupedLinear(2, 32, 32, bias=False, device="cpu").device_split_refusal(x)
        assert "multiples of 16" in GroupedLinear(2, 32, 40, bias=False, params_dtype=torch.bfloat16,
                                                  device="cpu").device_split_refusal(x)
        assert "the layer's first FP8 forward" in _layer().device_split_refusal(x.bfloat16())
    layer = _layer()
    _warm([layer], torch.randn(32, 32).bfloat16(), WARM, recipe)
    with fp8_autocast(fp8_recipe=recipe):
        assert layer.device_split_refusal(torch.randn(4, 32).bfloat16()) is None


def test_stacked_weights_view_or_copy(caplog, monkeypatch):
    buf = torch.arange(3 * 16 * 32, dtype=torch.uint8).view(3, 16, 32).view(torch.float8_e4m3fn)
    si = torch.tensor([1.0, 2.0, 3.0])
    ops = [(buf[g], si[g:g + 1], None) for g in range(3)]
    b, b_si = gl_module._stacked_fp8_weights(ops)
    assert b.data_ptr() == buf.data_ptr() and b.shape == (3, 16, 32) and torch.equal(b_si, si)
    assert b_si.data_ptr() == si.data_ptr()  # (views, no copies)
    spaced = torch.arange(3 * 64, dtype=torch.float32).view(3, 64)[:, 0]  # (the list cast's scale inverses)
    _, b_si = gl_module._stacked_fp8_weights([(buf[g], spaced[g:g + 1], None) for g in range(3)])
    assert b_si.data_ptr() == spaced.data_ptr() and b_si.stride() == (64,) and torch.equal(b_si, spaced)
    apart = [(buf[g].clone(), si[g:g + 1], None) for g in range(3)]
    monkeypatch.setattr(notes_module, "_noted", set())  # this process's earlier notes forgotten
    with caplog.at_level("INFO", logger="seqfuse"):
        b2, _ = gl_module._stacked_fp8_weights(apart)
    assert b2.data_ptr() != buf.data_ptr()
    assert torch.equal(b2.view(torch.uint8), buf.view(torch.uint8))
    assert "stacks them (a copy of each)" in caplog.text


def _same(a, b, what):
    assert (a is None) == (b is None), what
    if a is not None:
        assert torch.equal(a, b), what


def _compare_routes(recipe, swiglu, x_grad=True, p_grad=True, w_grad=True, firsts=(None, None), main_grad=False):
    """A host-route layer and a device-ends one (the same weights, warmed
    alike in one autocast region), stepped through ``firsts``
    (is_first_microbatch per step): the outputs, input / probs / weight
    gradients (or main_grads) and scaling states equal bit for bit."""
    M, k = sum(SPLITS), 32
    width = 2 * k if swiglu else k
    host, dev = _layer(), _layer()  # (the same weights; a deep copy's state would note no first casts)
    probs = torch.rand(M) if swiglu else None
    _warm([host, dev], torch.randn(M, width).bfloat16(), WARM, recipe, probs)
    for layer in (host, dev):
        for w in layer.parameters():
            w.requires_grad_(w_grad)
            if main_grad:
                w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
    counts = torch.tensor(SPLITS)
    for step, first in enumerate(firsts):
        x = (torch.randn(M, width) * (step + 1)).bfloat16()
        dy = torch.randn(M, 48).bfloat16()
        xs = [x.clone().requires_grad_(x_grad), x.clone().requires_grad_(x_grad)]
        ps = [probs.clone().requires_grad_(p_grad), probs.clone().requires_grad_(p_grad)] if swiglu else [None, None]
        with fp8_autocast(fp8_recipe=recipe):
            yh = host(xs[0], SPLITS, first, swiglu_probs=ps[0]) if swiglu else host(xs[0], SPLITS, first)
            assert dev.device_split_refusal(xs[1]) is None
            yd = dev._device_split(xs[1], counts, None, first, ps[1])
        _same(yh, yd, ("y", step))
        if yd.requires_grad:
            assert yd.grad_fn.name().startswith("DeviceEndsFp8GroupedLinearFunction")
            yh.backward(dy)
            yd.backward(dy)
        _same(xs[0].grad, xs[1].grad, ("dx", step))
        if swiglu:
            _same(ps[0].grad, ps[1].grad, ("dprobs", step))
        for (n, ph), (_, pd) in zip(host.named_parameters(), dev.named_parameters()):
            _same(ph.grad, pd.grad, (step, n))
            if main_grad:
                _same(ph.main_grad, pd.main_grad, (step, n, "main_grad"))
        qh, qd = host._quantizers(recipe, "cpu"), dev._quantizers(recipe, "cpu")
        for a, b in zip(qh.state.state_dict().values(), qd.state.state_dict().values()):
            if isinstance(a, torch.Tensor):
                _same(a, b, ("state", step))
        # the experts' weight casts, counted alike (the route's lean cast of the stack included)
        assert [r.casts for r in qh.weights] == [r.casts for r in qd.weights], step
        host.zero_grad(set_to_none=True)
        dev.zero_grad(set_to_none=True)


@pytest.mark.parametrize("swiglu", [False, True], ids=["plain", "swiglu"])
@pytest.mark.parametrize("fmt", [Format.HYBRID, Format.E4M3])
def test_route_equals_host_route_bit_for_bit_on_cpu(swiglu, fmt, monkeypatch, seed):
    """Two steps after the warm one: the output, the input (and probs)
    gradients, the weight gradients and the scaling state after each step."""
    monkeypatch.setattr(moe_ops, "sm90_kernel_refusal", lambda device: None)
    _compare_routes(DelayedScaling(fp8_format=fmt), swiglu)


@pytest.mark.parametrize("swiglu,x_grad,p_grad,w_grad", [
    (False, False, False, True),   # the input needs no gradient (a first layer)
    (False, True, False, False),   # frozen experts
    (True, False, True, True),     # the probabilities' gradient alone of the two inputs
    (True, True, False, False),    # the gate|up pairs alone, experts frozen
    (True, False, False, False),   # no gradient at all (evaluation under autocast)
], ids=["no_dx", "frozen", "probs_only", "h_only_frozen", "none"])
def test_route_equals_host_route_for_every_gradient_set(swiglu, x_grad, p_grad, w_grad, monkeypatch, seed):
    monkeypatch.setattr(moe_ops, "sm90_kernel_refusal", lambda device: None)
    _compare_routes(DelayedScaling(), swiglu, x_grad, p_grad, w_grad)


@pytest.mark.parametrize("swiglu", [False, True], ids=["plain", "swiglu"])
def test_route_equals_host_route_over_micro_batches_into_main_grad(swiglu, monkeypatch, seed):
    """is_first_microbatch True, False, False (the weights cast once and
    kept), the weight gradients accumulated into float32 main_grad."""
    monkeypatch.setattr(moe_ops, "sm90_kernel_refusal", lambda device: None)
    _compare_routes(DelayedScaling(), swiglu, firsts=(True, False, False), main_grad=True)


def test_an_expert_without_history_is_cast_at_scale_one_then_joins(monkeypatch, caplog, seed):
    """Expert 1 gets no rows in the warm step, so no history: the route
    still runs (logging why its numbers differ), casts expert 1's rows with
    its state's scale (1) where the host route takes one from their amax,
    so only expert 1's rows and weight gradient differ from the host route's
    (a little); its backward notes the first cast (the counts are on the
    host there), the next update gives it a history, and the next step is
    bit-equal again."""
    monkeypatch.setattr(moe_ops, "sm90_kernel_refusal", lambda device: None)
    monkeypatch.setattr(notes_module, "_noted", set())
    recipe = DelayedScaling()
    host, dev = _layer(), _layer()
    _warm([host, dev], torch.randn(32, 32).bfloat16(), [8, 0, 16, 8], recipe)
    qd = dev._quantizers(recipe, "cpu")
    assert not qd.state.has_history(3) and qd.state.has_history(0)
    assert qd.state.role_slots(0, 3)[0][1].item() == 1.0  # (expert 1's input scale: never cast)
    for step, splits in enumerate(([5, 3, 16, 8], SPLITS)):
        x = torch.randn(32, 32).bfloat16()
        dy = torch.randn(32, 48).bfloat16()
        xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
        with caplog.at_level("INFO", logger="seqfuse"), fp8_autocast(fp8_recipe=recipe):
            yh = host(xs[0], splits)
            assert dev.device_split_refusal(xs[1]) is None
            yd = dev._device_split(xs[1], torch.tensor(splits), None, None, None)
        yh.backward(dy)
        yd.backward(dy)
        assert torch.equal(xs[0].grad, xs[1].grad)  # (the input gradient reads no input cast)
        if step == 0:
            assert "no amax history yet (no rows so far) are cast on the device-ends route" in caplog.text
            assert torch.equal(yh[:5], yd[:5]) and torch.equal(yh[8:], yd[8:])
            assert not torch.equal(yh[5:8], yd[5:8])
            assert (yh[5:8].float() - yd[5:8].float()).norm() <= 0.1 * yh[5:8].float().norm()
            for g, (ph, pd) in enumerate(zip(host.parameters(), dev.parameters())):
                assert torch.equal(ph.grad, pd.grad) == (g != 1), g
            assert not qd.state.has_history(3)  # (noted in the backward: a history from the next update on)
        else:
            assert qd.state.has_history(3)
            assert torch.equal(yh, yd)
            for ph, pd in zip(host.parameters(), dev.parameters()):
                assert torch.equal(ph.grad, pd.grad)
        host.zero_grad(set_to_none=True)
        dev.zero_grad(set_to_none=True)


def test_backward_refuses_counts_that_do_not_add_up(monkeypatch, seed):
    monkeypatch.setattr(moe_ops, "sm90_kernel_refusal", lambda device: None)
    recipe = DelayedScaling()
    layer = _layer()
    _warm([layer], torch.randn(32, 32).bfloat16(), WARM, recipe)
    x = torch.randn(32, 32).bfloat16().requires_grad_()
    with fp8_autocast(fp8_recipe=recipe):
        y = layer._device_split(x, torch.tensor(SPLITS), None, None, None, lambda: [5, 0, 19, 7])
    with pytest.raises(RuntimeError, match="routing counts read in the backward .* 32 rows"):
        y.float().sum().backward()


@pytest.mark.cuda
@pytest.mark.parametrize("one_node", [True, False], ids=["one_node", "two_nodes"])
def test_grouped_mlp_takes_the_route_and_trains_as_the_host_route(one_node, seed):
    """A bfloat16 GroupedMLP under DelayedScaling: the first step reads the
    counts to the host (no history yet), the next ones take the route
    without a synchronizing call in the forward, and every step's output,
    input gradient and parameter gradients equal the host-count GroupedMLP's
    bit for bit (the same weights and scaling state throughout).
    ``two_nodes``: a hook on the gate-up layer keeps its two layers two
    autograd nodes (the gradient handed over between them)."""
    recipe = DelayedScaling()
    dev = GroupedMLP(256, 512, 8, 2, params_dtype=torch.bfloat16, device="cuda")
    host = copy.deepcopy(dev)
    host.device_splits = False
    if not one_node:
        dev.fc1.register_forward_hook(lambda *a: None)
    calls = []
    cls = gl_module.DeviceEndsFp8GroupedMLPFunction if one_node else gl_module.DeviceEndsFp8GroupedLinearFunction
    real = cls.apply
    cls.apply = lambda *a: calls.append(1) or real(*a)
    try:
        for step in range(4):
            x = torch.randn(3, 333, 256, device="cuda").bfloat16()
            g = torch.randn(3, 333, 256, device="cuda").bfloat16()
            xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
            # both forwards in one autocast region (its exit updates every scaling state once)
            with fp8_autocast(fp8_recipe=recipe):
                yh = host(xs[0])
                if step > 0:
                    with no_host_sync():
                        yd = dev(xs[1])
                else:
                    yd = dev(xs[1])
            outs = [yh, yd]
            for y in outs:
                (y * g).float().sum().backward()
            assert torch.equal(outs[0], outs[1]), step
            assert torch.equal(xs[0].grad, xs[1].grad), step
            for (n, ph), (_, pd) in zip(host.named_parameters(), dev.named_parameters()):
                assert torch.equal(ph.grad, pd.grad), (step, n)
            with torch.no_grad():
                for ph, pd in zip(host.parameters(), dev.parameters()):
                    ph.add_(ph.grad, alpha=-1e-3)
                    pd.add_(pd.grad, alpha=-1e-3)
            host.zero_grad(set_to_none=True)
            dev.zero_grad(set_to_none=True)
            assert len(calls) == (0 if step == 0 else (1 if one_node else 2) * step), step
    finally:
        cls.apply = real


@pytest.mark.cuda
def test_ends_gemm_fp8_matches_the_padded_host_product(seed):
    """grouped_gemm_device_ends_fp8 against ops.moe.grouped_gemm over the
    same FP8 operands with the groups padded to 16 rows (the host-count
    route's layout): equal bit for bit, row by row."""
    f8 = torch.float8_e4m3fn
    G, N, K = 5, 96, 128
    splits = [33, 0, 17, 64, 1]
    M = sum(splits)
    a = (torch.randn(M, K, device="cuda") * 4).to(f8)
    b = (torch.randn(G, N, K, device="cuda") * 4).to(f8)
    sa = torch.rand(G, device="cuda") + 0.5
    sb = torch.rand(G, device="cuda") + 0.5
    ends = torch.tensor(splits, device="cuda").cumsum(0).to(torch.int32)
    got = moe_ops.grouped_gemm_device_ends_fp8(a, sa, b, sb, ends)
    padded = [-(-m // 16) * 16 for m in splits]
    ap = torch.zeros(sum(padded), K, device="cuda").to(f8)
    r = p = 0
    for m, mp in zip(splits, padded):
        ap[p:p + m] = a[r:r + m]
        r, p = r + m, p + mp
    want = moe_ops.grouped_gemm(ap, list(b.unbind(0)), padded, transb=True, a_scale_inv=sa, b_scale_inv=sb,
                                fast_accum=True)
    r = p = 0
    for m, mp in zip(splits, padded):
        assert torch.equal(got[r:r + m], want[p:p + m])
        r, p = r + m, p + mp


def test_refusals_of_statistics_checkpoints_and_expert_count(monkeypatch):
    """The route's other refusals, each naming its rule (the device check
    answered yes, bfloat16 weights on the CPU)."""
    from seqfuse.quantization import recompute, stats

    monkeypatch.setattr(moe_ops, "sm90_kernel_refusal", lambda device: None)
    x = torch.randn(4, 32).bfloat16()
    with fp8_autocast(fp8_recipe=DelayedScaling()):
        assert "at most 64 experts" in GroupedLinear(65, 32, 32, bias=False, params_dtype=torch.bfloat16,
                                                     device="cpu").device_split_refusal(x)
        monkeypatch.setattr(recompute, "open_contexts", 1)
        assert "inside an activation checkpoint" in _layer().device_split_refusal(x)
        monkeypatch.setattr(recompute, "open_contexts", 0)
        stats.enable_stats(every=100)
        try:
            assert "FP8 statistics are on" in _layer().device_split_refusal(x)
        finally:
            stats.disable_stats()


def test_sm90_device_query():
    """C's answer for the kernel's device (asked once a device), through the
    binding: a reason for a device id the kernel does not take, and for a CPU
    device before C is asked; a non-integer device is a TypeError."""
    from seqfuse import _C

    assert "device ids 0 to 63" in _C.grouped_sm90_unfit(70) or "without CUDA" in _C.grouped_sm90_unfit(70)
    assert moe_ops.sm90_kernel_refusal(torch.device("cpu")) == "the tensors are not on a CUDA device"
    with pytest.raises(TypeError):
        _C.grouped_sm90_unfit("0")


def test_ends_gemm_fp8_argument_checks():
    f8 = torch.float8_e4m3fn
    a, b = torch.zeros(8, 32).to(f8), torch.zeros(2, 16, 32).to(f8)
    s, ends = torch.ones(2), torch.tensor([4, 8], dtype=torch.int32)
    gemm = moe_ops.grouped_gemm_device_ends_fp8
    with pytest.raises(TypeError, match="argument 'a' must be float8_e4m3fn"):
        gemm(a.to(torch.float8_e5m2), s, b, s, ends)
    with pytest.raises(TypeError, match="argument 'b' must be float8_e4m3fn"):
        gemm(a, s, b.float(), s, ends)
    with pytest.raises(ValueError, match="takes a \\[M, K\\], b \\[G, N, K\\] and offsets \\[G\\]"):
        gemm(a, s, b, s, torch.tensor([2, 4, 8], dtype=torch.int32))
    with pytest.raises(TypeError, match="'offsets' must be a 1-D int32"):
        gemm(a, s, b, s, ends.long())


def test_one_view_takes_only_one_dtype():
    base = torch.zeros(2, 4, dtype=torch.int32)
    assert gl_module._one_view([base[0], base[1]]) is not None
    mixed = [base[0], base[1].view(torch.float32)]  # (one base, the same element size, another dtype)
    assert gl_module._one_view(mixed) is None


def _mlp_pairs():
    """Two alike (gate-up, down) GroupedLinear pairs: 4 experts, 32 -> 2 x 48 -> 32."""
    pairs = []
    for _ in range(2):
        torch.manual_seed(0)
        pairs.append((GroupedLinear(4, 32, 96, bias=False, params_dtype=torch.bfloat16, device="cpu"),
                      GroupedLinear(4, 48, 32, bias=False, params_dtype=torch.bfloat16, device="cpu")))
    return pairs


@pytest.mark.parametrize("accumulate", [False, True], ids=["handed", "accumulated"])
def test_grad_handoff_equals_the_gate_up_layers_own_cast(accumulate, monkeypatch, caplog, seed):
    """GroupedMLP's two device-ends layers sharing a GradHandoff: the down
    projection's SwiGLU backward casts the gate-up layer's output gradient
    (swiglu_backward_cast_fp8_grouped's grad outputs) and the gate-up
    layer's backward takes those copies instead of casting them itself,
    with the same outputs, gradients and scaling states bit for bit as the
    same pair without the handoff.  ``accumulated``: the gate-up output also
    feeds another term of the loss, so its gradient is not the tensor the
    down projection cast: the gate-up layer casts its own, logged."""
    monkeypatch.setattr(moe_ops, "sm90_kernel_refusal", lambda device: None)
    monkeypatch.setattr(notes_module, "_noted", set())  # (this process's earlier notes forgotten)
    caplog.set_level(logging.INFO, logger="seqfuse")
    recipe = DelayedScaling()
    pairs = _mlp_pairs()
    M = sum(SPLITS)
    xw, pw = torch.randn(M, 32).bfloat16(), torch.rand(M)
    with fp8_autocast(fp8_recipe=recipe):  # the warm step (every expert's first casts) of both pairs
        ys = [fc2(fc1(xw, WARM), WARM, swiglu_probs=pw) for fc1, fc2 in pairs]
    for y in ys:
        y.float().sum().backward()
    for fc1, fc2 in pairs:
        fc1.zero_grad(set_to_none=True)
        fc2.zero_grad(set_to_none=True)
    grad_casts = []
    real = gl_module.quantize_grouped

    def spy(q, role, x, *a, **kw):
        grad_casts.append((role, x.shape[1]))
        return real(q, role, x, *a, **kw)

    monkeypatch.setattr(gl_module, "quantize_grouped", spy)
    counts = torch.tensor(SPLITS)
    for step in range(2):
        x, probs = torch.randn(M, 32).bfloat16(), torch.rand(M)
        dy = torch.randn(M, 32).bfloat16()
        # both pairs' forwards in one autocast region (its exit updates every scaling state once)
        runs = []
        with fp8_autocast(fp8_recipe=recipe):
            for (fc1, fc2), link in zip(pairs, (gl_module.GradHandoff(), None)):
                xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
                h = fc1._device_split(xi, counts, None, None, None, None, link)
                runs.append((xi, pi, h, fc2._device_split(h, counts, None, None, pi, None, link), link))
        results = []
        for (fc1, fc2), (xi, pi, h, y, link) in zip(pairs, runs):
            grad_casts.clear()
            loss = (y.float() * dy.float()).sum()
            if accumulate:
                loss = loss + h.float().square().sum() * 1e-3
            loss.backward()
            wide = [r for r in grad_casts if r == ("grad", 96)]  # the gate-up layer's own gradient cast
            assert len(wide) == (0 if link is not None and not accumulate else 1), (step, link, grad_casts)
            results.append([y, xi.grad, pi.grad] + [p.grad for p in fc1.parameters()] +
                           [p.grad for p in fc2.parameters()])
        for i, (a, b) in enumerate(zip(*results)):
            _same(a, b, (step, i))
        for (fc1a, fc2a), (fc1b, fc2b) in [pairs]:
            for la, lb in ((fc1a, fc1b), (fc2a, fc2b)):
                qa, qb = la._quantizers(recipe, "cpu"), lb._quantizers(recipe, "cpu")
                for a, b in zip(qa.state.state_dict().values(), qb.state.state_dict().values()):
                    if isinstance(a, torch.Tensor):
                        _same(a, b, ("state", step))
        for fc1, fc2 in pairs:
            fc1.zero_grad(set_to_none=True)
            fc2.zero_grad(set_to_none=True)
    taken_again = "not the tensor the down projection's backward cast" in caplog.text
    assert taken_again == accumulate, caplog.text


@pytest.mark.parametrize("x_grad,p_grad,w1_grad,w2_grad", list(itertools.product([True, False], repeat=4)))
def test_one_node_mlp_equals_two_layers(x_grad, p_grad, w1_grad, w2_grad, monkeypatch, seed):
    """GroupedMLP's one-node form (device_ends_mlp): the gate-up layer's
    output gradient is never written in bfloat16 (the down projection's
    SwiGLU pass makes only its FP8 copies, which the gate-up layer's
    backward reads; nothing casts that gradient again), and the outputs,
    gradients and scaling states equal the two layers run as two nodes
    without any handoff, bit for bit, for every set of wanted gradients."""
    monkeypatch.setattr(moe_ops, "sm90_kernel_refusal", lambda device: None)
    recipe = DelayedScaling()
    pairs = _mlp_pairs()
    for fc1, fc2 in pairs:
        fc1.requires_grad_(w1_grad)
        fc2.requires_grad_(w2_grad)
    M = sum(SPLITS)
    # the warm step (every expert's first casts, the gate-up layer's gradient's too) of both pairs
    xw, pw = torch.randn(M, 32).bfloat16().requires_grad_(), torch.rand(M)
    with fp8_autocast(fp8_recipe=recipe):
        ys = [fc2(fc1(xw, WARM), WARM, swiglu_probs=pw) for fc1, fc2 in pairs]
    for y in ys:
        y.float().sum().backward()
    grad_casts, dx_wanted = [], []
    real_cast, real_pass = gl_module.quantize_grouped, moe_ops.swiglu_backward_cast_fp8_grouped

    def spy_cast(q, role, x, *a, **kw):
        grad_casts.append((role, x.shape[1]))
        return real_cast(q, role, x, *a, **kw)

    def spy_pass(*a, **kw):
        dx_wanted.append(kw.get("want_dx", True))
        return real_pass(*a, **kw)

    monkeypatch.setattr(gl_module, "quantize_grouped", spy_cast)
    monkeypatch.setattr(moe_ops, "swiglu_backward_cast_fp8_grouped", spy_pass)
    counts = torch.tensor(SPLITS)
    for step in range(2):
        for fc1, fc2 in pairs:
            fc1.zero_grad(set_to_none=True)
            fc2.zero_grad(set_to_none=True)
        x, probs, dy = torch.randn(M, 32).bfloat16(), torch.rand(M), torch.randn(M, 32).bfloat16()
        runs = []
        with fp8_autocast(fp8_recipe=recipe):  # (one region: its exit updates every state once)
            for i, (fc1, fc2) in enumerate(pairs):
                xi, pi = x.clone().requires_grad_(x_grad), probs.clone().requires_grad_(p_grad)
                offsets = moe_ops.device_split_offsets(counts, M)
                wait = moe_ops.counts_to_host(counts)
                if i == 0:
                    y = gl_module.device_ends_mlp(fc1, fc2, xi, pi, offsets, wait)
                    assert y.grad_fn is None if not (x_grad or p_grad or w1_grad or w2_grad) else \
                        y.grad_fn.name().startswith("DeviceEndsFp8GroupedMLPFunction")
                else:
                    h = fc1._device_split(xi, counts, offsets, None, None, wait)
                    y = fc2._device_split(h, counts, offsets, None, pi, wait)
                runs.append((xi, pi, y))
        results = []
        for i, ((fc1, fc2), (xi, pi, y)) in enumerate(zip(pairs, runs)):
            grad_casts.clear()
            dx_wanted.clear()
            if y.requires_grad:
                (y.float() * dy.float()).sum().backward()
            if i == 0:  # the one node: the gate-up layer's gradient only as the pass's FP8 copies
                assert ("grad", 96) not in grad_casts, (step, grad_casts)
                # (the pass runs where x, probs or fc1 want a gradient: fc2's weights alone need none of it)
                runs_pass = x_grad or p_grad or w1_grad
                assert dx_wanted == ([False] if runs_pass else []), (step, dx_wanted)
                if y.requires_grad:
                    with pytest.raises(RuntimeError):  # (not differentiable again)
                        torch.autograd.grad((y.float() * dy.float()).sum(), [t for t in (xi, pi) if t.requires_grad]
                                            + [p for p in (*fc1.parameters(), *fc2.parameters()) if p.requires_grad],
                                            create_graph=True)[0].sum().backward()
            results.append([y, xi.grad, pi.grad] + [p.grad for p in fc1.parameters()] +
                           [p.grad for p in fc2.parameters()])
        for j, (a, b) in enumerate(zip(*results)):
            _same(a, b, (step, j))
        for la, lb in zip(pairs[0], pairs[1]):
            qa, qb = la._quantizers(recipe, "cpu"), lb._quantizers(recipe, "cpu")
            for a, b in zip(qa.state.state_dict().values(), qb.state.state_dict().values()):
                if isinstance(a, torch.Tensor):
                    _same(a, b, ("state", step))


def test_grouped_mlp_names_why_its_layers_run_as_two_nodes():
    mlp = GroupedMLP(32, 48, 4, 2, params_dtype=torch.bfloat16, device="cpu")
    assert mlp._one_node_refusal() is None
    handle = mlp.fc1.register_forward_hook(lambda *a: None)
    assert "fc1 has module hooks" in mlp._one_node_refusal()
    handle.remove()
    mlp.fc2.forward = lambda *a, **k: None  # (what Hugging Face accelerate's add_hook_to_module does)
    assert "fc2's forward is replaced" in mlp._one_node_refusal()
    del mlp.fc2.forward
    handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda *a: None)
    try:
        assert "global module hooks" in mlp._one_node_refusal()
    finally:
        handle.remove()
    assert mlp._one_node_refusal() is None


def test_swiglu_backward_names_why_it_runs_unfused():
    """The one grouped pass needs the input gradient in the saved pairs'
    dtype and 16-byte aligned CUDA pairs; otherwise the reason is named
    (the backward logs it and takes the unfused kernels)."""
    h = torch.zeros(4, 32, dtype=torch.bfloat16)
    assert gl_module._swiglu_unfused(torch.zeros(4, 16, dtype=torch.bfloat16), h) is None
    why = gl_module._swiglu_unfused(torch.zeros(4, 16), h)
    assert "torch.float32" in why and "torch.bfloat16" in why



def test_routed_offsets_skip_the_device_checks(monkeypatch):
    """device_split_offsets(routed=True) (GroupedMLP's own router counts) gives the same offsets without the
    device-side assertions; a non-bool ``routed`` is refused."""
    counts = torch.tensor([3, 0, 5, 8])
    asserts = []
    real = torch._assert_async
    monkeypatch.setattr(torch, "_assert_async", lambda *a: asserts.append(1) or real(*a))
    checked = moe_ops.device_split_offsets(counts, 16)
    assert len(asserts) == 2
    asserts.clear()
    assert torch.equal(moe_ops.device_split_offsets(counts, 16, routed=True), checked) and not asserts
    with pytest.raises(TypeError, match="argument 'routed' must be a bool"):
        moe_ops.device_split_offsets(counts, 16, routed=1)


def test_device_ends_mlp_refuses_layers_that_do_not_pair():
    fc1, fc2 = _mlp_pairs()[0]
    with pytest.raises(ValueError, match="fc1.out_features == 2 x fc2.in_features"):
        gl_module.device_ends_mlp(fc2, fc2, torch.zeros(4, 48), torch.zeros(4), None, None)


def _warmed_mlp(monkeypatch):
    """(recipe, fc1, fc2, M): one of _mlp_pairs' layer pairs after a warm FP8 delayed step (every expert's
    first casts, so each has a history), the sm90 check answered yes, M = sum(SPLITS) rows for the node."""
    monkeypatch.setattr(moe_ops, "sm90_kernel_refusal", lambda device: None)
    recipe = DelayedScaling()
    fc1, fc2 = _mlp_pairs()[0]
    M = sum(SPLITS)
    xw = torch.randn(M, 32).bfloat16().requires_grad_()
    with fp8_autocast(fp8_recipe=recipe):
        fc2(fc1(xw, WARM), WARM, swiglu_probs=torch.rand(M)).float().sum().backward()
    return recipe, fc1, fc2, M


def test_one_node_under_retain_graph_and_no_grad(monkeypatch, seed):
    """The one node under retain_graph (two backward passes over one graph: the second adds the first's
    gradients again) and under no_grad (its output alone, no graph).  (Checkpoints: the device-ends route
    refuses seqfuse's recompute, test_refusals_of_statistics_checkpoints_and_expert_count.)"""
    recipe, fc1, fc2, M = _warmed_mlp(monkeypatch)
    fc1.zero_grad(set_to_none=True)
    fc2.zero_grad(set_to_none=True)
    counts = torch.tensor(SPLITS)
    x, probs, dy = torch.randn(M, 32).bfloat16(), torch.rand(M), torch.randn(M, 32).bfloat16()

    def node(xi, pi):
        return gl_module.device_ends_mlp(fc1, fc2, xi, pi, moe_ops.device_split_offsets(counts, M),
                                         moe_ops.counts_to_host(counts))

    xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
    with fp8_autocast(fp8_recipe=recipe):
        y = node(xi, pi)
        with torch.no_grad():
            y_ng = node(x, probs)
    assert y_ng.grad_fn is None
    _same(y_ng, y.detach(), "no_grad output")
    loss = (y.float() * dy.float()).sum()
    loss.backward(retain_graph=True)
    params = [*fc1.parameters(), *fc2.parameters()]
    first = [xi.grad.clone(), pi.grad.clone()] + [p.grad.clone() for p in params]
    loss.backward()
    for i, (a, b) in enumerate(zip(first, [xi.grad, pi.grad] + [p.grad for p in params])):
        torch.testing.assert_close(b.float(), (2 * a).float(), rtol=1e-2, atol=1e-6, msg=f"retain_graph {i}")


def test_one_node_backward_names_a_lost_handoff_and_releases_it(monkeypatch, seed):
    """Where the gate-up layer's backward would get neither its output gradient (the one node never writes it)
    nor the FP8 copies the down projection's pass made, it raises naming the fault, not a wrong gradient; the
    node then holds none of its layers' tensors or copies (its ``finally``)."""
    recipe, fc1, fc2, M = _warmed_mlp(monkeypatch)
    counts = torch.tensor(SPLITS)
    x = torch.randn(M, 32).bfloat16().requires_grad_()
    with fp8_autocast(fp8_recipe=recipe):
        y = gl_module.device_ends_mlp(fc1, fc2, x, torch.rand(M), moe_ops.device_split_offsets(counts, M),
                                      moe_ops.counts_to_host(counts))
    links = []
    real_put = gl_module.GradHandoff.put
    monkeypatch.setattr(gl_module.GradHandoff, "put", lambda self, dx, gq: links.append(self) or
                        real_put(self, dx, gq))
    monkeypatch.setattr(gl_module.GradHandoff, "take", lambda self, *a: None)  # (the copies lost)
    with pytest.raises(RuntimeError, match="got neither its output gradient nor its FP8 copies"):
        y.float().sum().backward()
    assert len(links) == 1 and links[0].stash is None
    assert all(c.saved_tensors is None for c in y.grad_fn.layers)  # (the node's layer contexts: released)
