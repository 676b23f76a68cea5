"""The grouped GEMM's device-split route: row counts that stay on the GPU
(ops.moe.grouped_gemm_device over device_split_offsets; GroupedLinear with
a CUDA m_splits; GroupedMLP in bfloat16).  The CPU tests cover the weights'
one-buffer layout that the route reads without a copy and the argument
checks; the cuda-marked ones compare the route with the cuBLASLt route
(host row counts) and the float64 reference, and check that a GroupedMLP
step under it never synchronizes with the host."""
import logging

import pytest
import torch

from seqfuse.common import notes as notes_module
from seqfuse.modules import GroupedLinear
from seqfuse.ops import moe

from helpers import REL_TOL, grouped_mlp_pair, no_host_sync, pair_tol, rel_error


# ---- the weights as one buffer ------------------------------------------------

def test_weights_are_slices_of_one_buffer():
    """stacked_weights is a view of the parameters' own storage (no copy),
    and each parameter keeps a version counter of its own, so the FP8
    weight cache re-casts only the expert that changed."""
    gl = GroupedLinear(4, 16, 24, bias=False, device="cpu")
    w = gl.stacked_weights()
    assert w.shape == (4, 24, 16)
    assert w.data_ptr() == gl.weight0.data_ptr()
    assert torch.equal(w, torch.stack(gl.weights()))
    versions = [p._version for p in gl.weights()]
    with torch.no_grad():
        gl.weight2.add_(1.0)
    assert [p._version for p in gl.weights()] == [versions[0], versions[1], versions[2] + 1, versions[3]]
    assert torch.equal(gl.stacked_weights()[2], gl.weight2)


def test_weights_back_in_one_buffer_after_to_and_assign_load(seed):
    """``module.to(dtype)`` and load_state_dict(assign=True) give every
    parameter storage of its own; the module puts them back into one buffer
    (same parameter objects, same values, versions of their own)."""
    gl = GroupedLinear(3, 8, 16, bias=False, device="cpu").to(torch.float64)
    assert gl.stacked_weights().data_ptr() == gl.weight0.data_ptr()
    values = {k: v.clone() for k, v in gl.state_dict().items()}
    fresh = {k: torch.randn_like(v) for k, v in values.items()}
    gl.load_state_dict(fresh, assign=True)
    assert gl.stacked_weights().data_ptr() == gl.weight0.data_ptr()
    assert all(torch.equal(getattr(gl, k), v) for k, v in fresh.items())
    gl.load_state_dict(values)
    assert torch.equal(gl.stacked_weights(), torch.stack([values[f"weight{g}"] for g in range(3)]))


def test_forward_never_moves_the_weights(monkeypatch, caplog, seed):
    """Weights another owner re-homed (not slices of one buffer) are stacked
    per call (a copy, said once), their storage left where it is."""
    monkeypatch.setattr(notes_module, "_noted", set())
    caplog.set_level(logging.INFO, logger="seqfuse")
    gl = GroupedLinear(3, 8, 16, bias=False, device="cpu")
    flat = torch.randn(3 * 16 * 8)
    for g, w in enumerate(reversed(gl.weights())):  # an owner's flat buffer, in another order
        w.data = flat[g * 128:(g + 1) * 128].view(16, 8)
    ptrs = [w.data_ptr() for w in gl.weights()]
    for _ in range(2):
        w = gl.stacked_weights()
    assert torch.equal(w, torch.stack(gl.weights()))
    assert [p.data_ptr() for p in gl.weights()] == ptrs
    lines = [r.getMessage() for r in caplog.records if "stacked into one tensor at every" in r.getMessage()]
    assert len(lines) == 1


def test_device_split_refusals(monkeypatch):
    """The reasons a call keeps host row counts, checked before the device's."""
    from seqfuse.quantization import gemm_quantizers

    x = torch.randn(4, 16)
    gl = GroupedLinear(2, 16, 16, bias=True, device="cpu")
    assert "bias" in gl.device_split_refusal(x)
    gl = GroupedLinear(2, 16, 16, bias=False, device="cpu")
    assert "CUDA" in gl.device_split_refusal(x)
    for w in gl.weights():
        w.main_grad = torch.zeros(w.shape)
    assert "main_grad" in gl.device_split_refusal(x)
    gl = GroupedLinear(2, 16, 16, bias=False, device="cpu")
    monkeypatch.setattr(gemm_quantizers, "fsdp2_in_use", lambda: True)
    assert "FSDP2" in gl.device_split_refusal(x)


# ---- argument checks ------------------------------------------------------------

def test_device_split_offsets_checks():
    with pytest.raises(TypeError, match="m_splits.*1-D integer tensor"):
        moe.device_split_offsets(torch.tensor([1.0, 2.0]), 3)
    with pytest.raises(TypeError, match="m_splits.*1-D integer tensor"):
        moe.device_split_offsets(torch.tensor([[1, 2]]), 3)
    with pytest.raises(ValueError, match="at least one group"):
        moe.device_split_offsets(torch.tensor([], dtype=torch.int64), 0)
    # on the CPU the device-side check runs at once
    with pytest.raises(RuntimeError, match="m_splits"):
        moe.device_split_offsets(torch.tensor([1, 2]), 4)
    offsets = moe.device_split_offsets(torch.tensor([3, 0, 5]), 8)
    assert offsets.dtype == torch.int32 and offsets.tolist() == [3, 3, 8]


def test_grouped_gemm_device_refuses_what_it_cannot_do():
    x, w = torch.randn(8, 16).bfloat16(), torch.randn(2, 8, 16).bfloat16()
    dy = torch.randn(8, 8).bfloat16()
    offsets = torch.tensor([4, 8], dtype=torch.int32)
    with pytest.raises(TypeError, match="'a' must be a bfloat16 CUDA tensor"):
        moe.grouped_gemm_device(x, w, offsets, transb=True)
    with pytest.raises(TypeError, match="'offsets' must be a 1-D int32 tensor"):
        moe.grouped_gemm_device(x, w, offsets.long(), transb=True)
    with pytest.raises(ValueError, match="b \\[G, N, K\\] stacked weights with G = 3"):
        moe.grouped_gemm_device(x, w, torch.tensor([2, 4, 8], dtype=torch.int32), transb=True)
    with pytest.raises(ValueError, match="a has 16 columns but each group of b has 8 rows"):
        moe.grouped_gemm_device(x, w, offsets)
    with pytest.raises(ValueError, match="weight-gradient form takes a \\[M, N\\] and b \\[M, K\\]"):
        moe.grouped_gemm_device(dy, x[:4], offsets, transa=True)
    with pytest.raises(ValueError, match="'a' must have its non-split dimensions multiples of 8"):
        moe.grouped_gemm_device(torch.randn(8, 12).bfloat16(), torch.randn(2, 8, 12).bfloat16(), offsets,
                                transb=True)


def test_grouped_linear_m_splits_on_another_device():
    gl = GroupedLinear(2, 16, 16, bias=False, device="cpu")
    with pytest.raises(ValueError, match="m_splits on meta but the input on cpu"):
        gl(torch.randn(4, 16), torch.tensor([2, 2], device="meta"))


def test_grouped_linear_m_offsets_only_with_device_counts():
    gl = GroupedLinear(2, 16, 16, bias=False, device="cpu")
    with pytest.raises(ValueError, match="m_offsets goes with m_splits given as a CUDA tensor"):
        gl(torch.randn(4, 16), [2, 2], m_offsets=torch.tensor([2, 4], dtype=torch.int32))


def test_grouped_linear_asks_the_refusal_once_or_takes_the_callers(monkeypatch):
    """With m_splits on a device, GroupedLinear.forward asks
    device_split_refusal once per call (also with swiglu_probs), and not at
    all where the caller passes its answer (_refusal, GroupedMLP's: it asks
    once per forward for both of its layers).  Meta tensors stand in for
    CUDA ones and shape-only stand-ins for torch's grouped kernel and the
    SwiGLU, so the route's bookkeeping runs on the CPU."""
    asked = []

    def refusal(self, x, *args):
        asked.append(self)
        return None

    def grouped_gemm_device(a, b, offsets, transa=False, transb=False):
        return torch.empty(a.shape[0], b.shape[1] if transb else b.shape[2], dtype=torch.bfloat16,
                           device=a.device)

    monkeypatch.setattr(GroupedLinear, "device_split_refusal", refusal)
    monkeypatch.setattr(moe, "grouped_gemm_device", grouped_gemm_device)
    monkeypatch.setattr(moe, "swiglu_forward", lambda x, p: x[:, :x.shape[1] // 2] * p[:, None])
    gl = GroupedLinear(2, 16, 24, bias=False, params_dtype=torch.bfloat16, device="cpu")
    counts = torch.empty(2, dtype=torch.int64, device="meta")
    offsets = torch.empty(2, dtype=torch.int32, device="meta")
    x = torch.empty(10, 16, dtype=torch.bfloat16, device="meta")
    h = torch.empty(10, 32, dtype=torch.bfloat16, device="meta")
    probs = torch.empty(10, dtype=torch.float32, device="meta")
    for call in (lambda **kw: gl(x, counts, m_offsets=offsets, **kw),
                 lambda **kw: gl(h, counts, swiglu_probs=probs, m_offsets=offsets, **kw)):
        asked.clear()
        y = call()
        assert y.shape == (10, 24) and y.device.type == "meta"  # the device-split route ran
        assert asked == [gl]
        asked.clear()
        assert call(_refusal=None).shape == (10, 24) and asked == []


# ---- CUDA: the route against cuBLASLt's and the float64 reference -----------

CUDA_SPLITS = [[128, 256, 64, 512], [0, 300, 0, 1, 77, 0], [1000], [0, 0, 0, 5]]


@pytest.mark.cuda
@pytest.mark.parametrize("splits", CUDA_SPLITS, ids=["balanced", "empty", "single", "mostly_empty"])
def test_grouped_gemm_device_matches_host_route(splits, seed):
    k, n, G, M = 256, 192, len(splits), sum(splits)
    x = torch.randn(M, k, device="cuda").bfloat16()
    w = torch.randn(G, n, k, device="cuda").bfloat16()
    dy = torch.randn(M, n, device="cuda").bfloat16()
    offsets = moe.device_split_offsets(torch.tensor(splits, device="cuda"), M)
    # poison: blocks the products' outputs may reuse hold NaN, so an unwritten element cannot read as zero
    torch.full((4 * (M * max(k, n) + G * n * k),), float("nan"), dtype=torch.bfloat16, device="cuda")
    y = moe.grouped_gemm_device(x, w, offsets, transb=True)
    dx = moe.grouped_gemm_device(dy, w, offsets)
    dw = moe.grouped_gemm_device(dy, x, offsets, transa=True)
    ry = moe.grouped_gemm(x, w, splits, transb=True)
    rdx = moe.grouped_gemm(dy, w, splits)
    rdw = moe.grouped_gemm(dy, x, splits, transa=True)
    assert y.shape == (M, n) and dx.shape == (M, k) and dw.shape == (G, n, k)
    tol = pair_tol(torch.bfloat16)
    assert rel_error(y, ry) <= tol
    assert rel_error(dx, rdx) <= tol
    assert rel_error(dw, rdw) <= tol
    # against float64, group by group
    o = 0
    for g, m in enumerate(splits):
        xs, ds = x[o:o + m].double(), dy[o:o + m].double()
        if m:
            assert rel_error(y[o:o + m], xs @ w[g].double().t()) <= REL_TOL[torch.bfloat16]
        assert torch.equal(dw[g], torch.zeros_like(dw[g])) if m == 0 else \
            rel_error(dw[g], ds.t() @ xs) <= REL_TOL[torch.bfloat16]
        o += m


@pytest.mark.cuda
@pytest.mark.parametrize("params", ["bf16", "fp32_autocast"])
def test_grouped_linear_device_split_matches_host_route(params, seed):
    """bfloat16 parameters, and float32 parameters under torch.autocast
    (bfloat16 compute, float32 gradients)."""
    splits = [40, 0, 300, 17, 123]
    G, fin, fout = len(splits), 128, 256
    dtype = torch.bfloat16 if params == "bf16" else torch.float32
    dev = GroupedLinear(G, fin, fout, bias=False, params_dtype=dtype, device="cuda")
    host = GroupedLinear(G, fin, fout, bias=False, params_dtype=dtype, device="cuda")
    host.load_state_dict(dev.state_dict())
    x = torch.randn(sum(splits), fin, device="cuda").to(dtype)
    g = torch.randn(sum(splits), fout, device="cuda").bfloat16()
    xd, xh = x.clone().requires_grad_(), x.clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=params != "bf16"):
        yd = dev(xd, torch.tensor(splits, device="cuda"))
        yh = host(xh, splits)
    assert yd.dtype == yh.dtype == torch.bfloat16
    (yd * g).sum().backward()
    (yh * g).sum().backward()
    tol = pair_tol(torch.bfloat16)
    assert rel_error(yd, yh) <= tol
    assert xd.grad.dtype == dtype and rel_error(xd.grad, xh.grad) <= tol
    for wd, wh, m in zip(dev.weights(), host.weights(), splits):
        assert wd.grad.dtype == dtype
        if m == 0:
            assert torch.equal(wd.grad, torch.zeros_like(wd.grad))
        else:
            assert rel_error(wd.grad, wh.grad) <= tol


@pytest.mark.cuda
def test_grouped_mlp_device_split_never_waits_on_the_host(seed):
    """A GroupedMLP step in bfloat16 takes the routing counts on the GPU:
    forward and backward run with torch's sync debug mode set to raise on
    any synchronizing call, and give the host-count route's results."""
    dev, host, xd, xh, g = grouped_mlp_pair(256, 512, 8)
    with no_host_sync():
        yd = dev(xd)
        (yd * g).sum().backward()
    yh = host(xh)
    (yh * g).sum().backward()
    tol = pair_tol(torch.bfloat16)
    assert rel_error(yd, yh) <= tol
    assert rel_error(xd.grad, xh.grad) <= tol
    for (n, pd), (_, ph) in zip(dev.named_parameters(), host.named_parameters()):
        assert rel_error(pd.grad, ph.grad) <= tol, n


@pytest.mark.cuda
def test_grouped_mlp_device_split_asks_each_layer_once(monkeypatch, seed):
    """A GroupedMLP forward on the device-split route asks each
    GroupedLinear's device_split_refusal once (GroupedMLP's own check, whose
    answer both layers take), not again in the layers' forwards."""
    dev, _, xd, _, g = grouped_mlp_pair(256, 512, 8)
    asked = []
    real = GroupedLinear.device_split_refusal

    def counting(self, *args, **kw):
        asked.append(self)
        return real(self, *args, **kw)

    monkeypatch.setattr(GroupedLinear, "device_split_refusal", counting)
    with no_host_sync():  # (the route taken: nothing waits on the host)
        y = dev(xd)
        (y * g).sum().backward()
    assert len(asked) == 2 and asked[0] is dev.fc1 and asked[1] is dev.fc2


@pytest.mark.cuda
def test_grouped_linear_device_counts_read_where_the_route_does_not_apply(monkeypatch, caplog, seed):
    """With a bias (which the device-split route does not add) a CUDA
    m_splits is read to the host, said once, and the cuBLASLt route gives
    its list form's results bit for bit."""
    monkeypatch.setattr(notes_module, "_noted", set())
    caplog.set_level(logging.INFO, logger="seqfuse")
    splits = [7, 0, 25]
    gl = GroupedLinear(3, 64, 32, bias=True, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(sum(splits), 64, device="cuda").bfloat16()
    for _ in range(2):
        y = gl(x, torch.tensor(splits, device="cuda"))
    assert torch.equal(y, gl(x, splits))
    lines = [r.getMessage() for r in caplog.records if "read to the host" in r.getMessage()]
    assert len(lines) == 1 and "bias" in lines[0]


@pytest.mark.cuda
@pytest.mark.parametrize("drop", [False, True], ids=["all_routed", "some_dropped"])
def test_accelerate_experts_device_split_never_waits_on_the_host(drop, monkeypatch, seed):
    """accelerate()'s SeqfuseExperts over transformers' stacked experts in
    bfloat16: the counts stay on the GPU (no synchronizing call in forward
    or backward), and the results are the host-count route's, also where
    some (token, expert) pairs name an expert out of range (dropped: fewer
    rows routed than T * k)."""
    from seqfuse.hf.fuse_experts import SeqfuseExperts

    E, H, Fh, T, k = 8, 256, 512, 300, 2

    class Experts(torch.nn.Module):  # transformers' layout: gate_up_proj [E, 2F, H], down_proj [E, H, F]
        def __init__(self):
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.randn(E, 2 * Fh, H, device="cuda").bfloat16() * 0.05)
            self.down_proj = torch.nn.Parameter(torch.randn(E, H, Fh, device="cuda").bfloat16() * 0.05)

    experts = Experts()
    dev, host = SeqfuseExperts(experts), SeqfuseExperts(experts)
    x = torch.randn(T, H, device="cuda").bfloat16()
    idx = torch.randn(T, E, device="cuda").topk(k, dim=-1).indices
    if drop:
        idx[::7, 1] = E  # out of range: no expert
    w = torch.rand(T, k, device="cuda")
    g = torch.randn(T, H, device="cuda").bfloat16()
    xd, xh = x.clone().requires_grad_(), x.clone().requires_grad_()
    wd, wh = w.clone().requires_grad_(), w.clone().requires_grad_()
    torch.full((T * k * 2 * Fh * 4,), float("nan"), dtype=torch.bfloat16, device="cuda")  # poison freed blocks
    with no_host_sync():
        yd = dev(xd, idx, wd)
        (yd * g).sum().backward()
    grads_dev = [p.grad.clone() for p in experts.parameters()]
    for p in experts.parameters():
        p.grad = None
    monkeypatch.setattr(moe, "device_split_refusal", lambda *a: "forced off by the test")
    yh = host(xh, idx, wh)
    (yh * g).sum().backward()
    tol = pair_tol(torch.bfloat16)
    assert rel_error(yd, yh) <= tol
    assert rel_error(xd.grad, xh.grad) <= tol
    assert rel_error(wd.grad, wh.grad) <= tol
    for gd, p in zip(grads_dev, experts.parameters()):
        assert rel_error(gd, p.grad) <= tol
