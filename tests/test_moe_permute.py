"""Token permutation for MoE (csrc/moe/, seqfuse.ops.moe): the row-id map,
moe_permute / moe_permute_with_probs / moe_unpermute and the
probability-scaled SwiGLU, forward and backward, against plain torch (the
permutation copies rows, so it is checked bit for bit; the weighted
combination against float64); the cuda-marked tests compare the kernels
with the CPU backend on poisoned outputs."""
import pytest
import torch
import torch.nn.functional as F

from seqfuse.ops import moe

from helpers import REL_TOL, pair_tol, poisoned_like, rel_error


def random_map(T, E, topk, device="cpu"):
    idx = torch.rand(T, E).argsort(-1)[:, :topk]
    return torch.zeros(T, E, dtype=torch.bool).scatter_(1, idx, True).to(device)


def reference_order(rmap):
    """(token index of each permuted row, expert of each row): experts in
    order, tokens in order within an expert."""
    e, t = rmap.t().nonzero(as_tuple=True)
    return t, e


@pytest.mark.parametrize("shape", [(1, 4, 1), (37, 8, 2), (64, 16, 4), (10, 3, 3)])
def test_row_id_map_and_permute_bit_for_bit(shape, seed):
    T, E, topk = shape
    rmap = random_map(T, E, topk)
    rmap[0] = False  # a token routed nowhere (capacity drop)
    ids, counts = moe.moe_row_id_map(rmap)
    tok, exp = reference_order(rmap)
    assert counts.tolist() == rmap.sum(0).tolist()
    assert torch.equal(ids[tok, exp], torch.arange(len(tok), dtype=torch.int32))
    assert (ids[~rmap] == -1).all()
    x = torch.randn(T, 24).bfloat16()
    probs = torch.rand(T, E)
    out, pp, ids2 = moe.moe_permute_with_probs(x, probs, rmap)
    assert torch.equal(ids2, ids)
    assert torch.equal(out, x[tok]) and torch.equal(pp, probs[tok, exp])
    out2, _ = moe.moe_permute(x, rmap)
    assert torch.equal(out2, out)


def test_permute_backward_against_torch(seed):
    T, E, topk, H = 33, 6, 2, 20
    rmap = random_map(T, E, topk)
    x = torch.randn(T, H, requires_grad=True)
    probs = torch.rand(T, E, requires_grad=True)
    out, pp, _ = moe.moe_permute_with_probs(x, probs, rmap)
    g, gp = torch.randn_like(out), torch.randn_like(pp)
    ((out * g).sum() + (pp * gp).sum()).backward()
    tok, exp = reference_order(rmap)
    xr = x.detach().double().requires_grad_()
    pr = probs.detach().double().requires_grad_()
    ((xr[tok] * g.double()).sum() + (pr[tok, exp] * gp.double()).sum()).backward()
    assert rel_error(x.grad, xr.grad) <= REL_TOL[torch.float32]
    assert torch.equal(probs.grad, pr.grad.float())  # a gather: exact, zero off the map


@pytest.mark.parametrize("with_probs", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unpermute_against_float64(with_probs, dtype, seed):
    T, E, topk, H = 40, 8, 2, 32
    rmap = random_map(T, E, topk)
    ids, counts = moe.moe_row_id_map(rmap)
    N = int(counts.sum())
    y = torch.randn(N, H).to(dtype).requires_grad_()
    probs = torch.rand(T, E).to(dtype).requires_grad_() if with_probs else None
    out = moe.moe_unpermute(y, ids, probs)
    tok, exp = reference_order(rmap)
    yr = y.detach().double().requires_grad_()
    pr = probs.detach().double().requires_grad_() if with_probs else None
    w = pr[tok, exp][:, None] if with_probs else 1.0
    ref = torch.zeros(T, H, dtype=torch.float64).index_add(0, tok, yr * w)
    assert out.dtype == dtype and rel_error(out, ref) <= REL_TOL[dtype]
    g = torch.randn(T, H, dtype=torch.float64)
    (out.double() * g).sum().backward()
    (ref * g).sum().backward()
    assert rel_error(y.grad, yr.grad) <= REL_TOL[dtype]
    if with_probs:
        assert rel_error(probs.grad, pr.grad) <= REL_TOL[dtype]


def test_round_trip_restores_tokens(seed):
    T, E, topk = 25, 5, 2
    rmap = random_map(T, E, topk)
    x = torch.randn(T, 16)
    out, ids = moe.moe_permute(x, rmap)
    back = moe.moe_unpermute(out, ids, restore_shape=(T, 16))
    assert torch.allclose(back, x * topk, rtol=1e-6, atol=0)


def test_num_out_tokens_drops_the_last_rows(seed):
    T, E, topk = 12, 4, 2
    rmap = random_map(T, E, topk)
    x = torch.randn(T, 8)
    full, ids = moe.moe_permute(x, rmap)
    cut, _ = moe.moe_permute(x, rmap, num_out_tokens=10)
    assert torch.equal(cut, full[:10])
    with pytest.raises(ValueError, match="num_out_tokens"):
        moe.moe_permute(x, rmap, num_out_tokens=T * topk + 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scaled_swiglu_against_float64(dtype, seed):
    N, Fh = 30, 24
    h = torch.randn(N, 2 * Fh).to(dtype).requires_grad_()
    p = torch.rand(N, requires_grad=True)
    a = moe.scaled_swiglu(h, p)
    hr = h.detach().double().requires_grad_()
    pr = p.detach().double().requires_grad_()
    ref = F.silu(hr[:, :Fh]) * hr[:, Fh:] * pr[:, None]
    assert a.dtype == dtype and rel_error(a, ref) <= REL_TOL[dtype]
    g = torch.randn(N, Fh, dtype=torch.float64)
    (a.double() * g).sum().backward()
    (ref * g).sum().backward()
    assert rel_error(h.grad, hr.grad) <= REL_TOL[dtype]
    assert rel_error(p.grad, pr.grad) <= REL_TOL[dtype]
    assert torch.equal(moe.scaled_swiglu(h.detach(), None), moe.scaled_swiglu(h.detach(), torch.ones(N)))


def test_permutation_errors_are_named():
    rmap = random_map(6, 4, 2)
    with pytest.raises(TypeError, match="routing_map"):
        moe.moe_permute(torch.randn(6, 8), rmap.int())
    with pytest.raises(ValueError, match="6 tokens but 'inp' has 5"):
        moe.moe_permute(torch.randn(5, 8), rmap)
    with pytest.raises(NotImplementedError, match="mask"):
        moe.moe_permute(torch.randn(6, 8), rmap, map_type="index")
    ids, _ = moe.moe_row_id_map(rmap)
    with pytest.raises(ValueError, match="merging_probs|probs"):
        moe.moe_unpermute(torch.randn(12, 8), ids, torch.rand(6, 3))
    with pytest.raises(ValueError, match="even"):
        moe.scaled_swiglu(torch.randn(4, 7))


def test_unpermute_backward_takes_inp_only_with_probs():
    """moe_unpermute_backward reads the forward's input only for dprobs: the
    C entry takes inp, probs and dprobs together or not at all (an inp
    without probs, which no backend would read, is refused by name)."""
    from seqfuse import _C

    ids, counts = moe.moe_row_id_map(random_map(6, 4, 2))
    N = int(counts.sum())
    dout, dinp = torch.randn(6, 8), torch.empty(N, 8)
    with pytest.raises(ValueError, match="moe_unpermute_backward: argument 'inp' is read only with 'probs'"):
        _C.moe_unpermute_backward(dout, torch.randn(N, 8), ids, None, dinp, None, None)
    with pytest.raises(ValueError, match="'inp' .*'dprobs' are required"):
        _C.moe_unpermute_backward(dout, None, ids, torch.rand(6, 4), dinp, torch.empty(6, 4), None)
    _C.moe_unpermute_backward(dout, None, ids, None, dinp, None, None)
    assert torch.equal(dinp, moe.moe_permute_by_row_id_map(dout, ids, N)[0])


# ---- CUDA against the CPU reference ----------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(1, 8, 2), (4099, 8, 2), (2048, 64, 6), (777, 128, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H", [136, 133], ids=["rows16B", "rows_odd"])  # 16-byte row copies, or per element
def test_cuda_permutation_matches_cpu(shape, dtype, H, seed):
    T, E, topk = shape
    rmap = random_map(T, E, topk)
    x = torch.randn(T, H).to(dtype)
    probs = torch.rand(T, E)
    ids, counts = moe.moe_row_id_map(rmap)
    ids_c, counts_c = moe.moe_row_id_map(rmap.cuda())
    assert torch.equal(ids_c.cpu(), ids) and torch.equal(counts_c.cpu(), counts)
    N = int(counts.sum())
    out, pp = moe.moe_permute_by_row_id_map(x, ids, N, probs)
    out_c, pp_c = moe.moe_permute_by_row_id_map(x.cuda(), ids_c, N, probs.cuda())
    assert torch.equal(out_c.cpu(), out) and torch.equal(pp_c.cpu(), pp)
    # unpermute forward + backward, outputs poisoned
    from seqfuse import _C
    y = torch.randn(N, H).to(dtype)
    dout = torch.randn(T, H).to(dtype)
    res = {}
    for dev in ("cpu", "cuda"):
        o = poisoned_like(torch.empty(T, H, dtype=dtype, device=dev))
        _C.moe_unpermute(y.to(dev), ids.to(dev), probs.to(dev), o, None)
        dy = poisoned_like(torch.empty(N, H, dtype=dtype, device=dev))
        dp = poisoned_like(torch.empty(T, E, device=dev))
        _C.moe_unpermute_backward(dout.to(dev), y.to(dev), ids.to(dev), probs.to(dev), dy, dp, None)
        res[dev] = (o.cpu(), dy.cpu(), dp.cpu())
    for a, b in zip(res["cuda"], res["cpu"]):
        assert rel_error(a, b.double()) <= pair_tol(dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_scaled_swiglu_matches_cpu(dtype, seed):
    N, Fh = 5000, 352
    h = torch.randn(N, 2 * Fh).to(dtype)
    p = torch.rand(N)
    g = torch.randn(N, Fh).to(dtype)
    res = {}
    for dev in ("cpu", "cuda"):
        hh = h.detach().to(dev, copy=True).requires_grad_()
        pp = p.detach().to(dev, copy=True).requires_grad_()
        a = moe.scaled_swiglu(hh, pp)
        a.backward(g.to(dev))
        res[dev] = (a.detach().cpu(), hh.grad.cpu(), pp.grad.cpu())
    for a, b in zip(res["cuda"], res["cpu"]):
        assert rel_error(a, b.double()) <= pair_tol(dtype)
