"""Transient buffers (seqfuse.ops.buffers): one buffer per place (purpose,
stream, thread) for outputs that die inside the call that makes them -- the
FP8 modules' GEMM inputs in row-wise FP8 and backward gradient casts, and
the norms' backward workspaces.

The pool's rules: the same arguments give the same tensor, another purpose
other memory, another dtype or shape at the same place a view of the same
bytes (grown to the largest request); nothing over the size limit is kept;
past the total limit, and on clear(), every kept buffer is let go; under
CUDA graph capture nothing is kept.  And the effect on training: a stack of FP8
modules whose backward casts share buffers (two layers of one shape, and
LayerNormMLP, whose two gradient casts meet at one place; with ffn ==
hidden in one view)
gives bit-identical outputs and gradients to the same stack with nothing
kept, over several steps, under every recipe, at a row count that pads;
and so does a stack whose places serve several shapes and dtypes at token
counts that change every step.
"""
import copy
import threading

import pytest
import torch

import seqfuse.pytorch as te
from seqfuse.common.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling
from seqfuse.ops import buffers

from helpers import needs_fp8

RECIPES = {"delayed": DelayedScaling, "current": Float8CurrentScaling, "block": Float8BlockScaling}


def _devices():
    return ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.fixture
def empty_pool():
    buffers.clear()
    yield
    buffers.clear()


@pytest.mark.parametrize("device", _devices())
def test_same_arguments_same_tensor(device, empty_pool):
    x = torch.zeros(2, device=device)
    where = buffers.transient_stream(x)
    a = buffers.transient((where, "grad"), torch.float8_e4m3fn, 32, 16)
    assert a.shape == (32, 16) and a.dtype == torch.float8_e4m3fn and a.device == x.device and a.is_contiguous()
    assert buffers.transient((where, "grad"), torch.float8_e4m3fn, 32, 16) is a
    other = buffers.transient((where, "grad_t"), torch.float8_e4m3fn, 32, 16)  # another purpose: other memory
    assert other is not a and other.data_ptr() != a.data_ptr()
    # the same place in another dtype or shape that fits: a view of the same bytes (one buffer per place)
    same = [buffers.transient((where, "grad"), torch.float8_e5m2, 32, 16),
            buffers.transient((where, "grad"), torch.float32, 4, 8),
            buffers.transient((where, "grad"), torch.float8_e4m3fn, 16, 32)]
    assert all(t is not a and t.data_ptr() == a.data_ptr() for t in same)
    assert [tuple(t.shape) for t in same] == [(32, 16), (4, 8), (16, 32)] and same[1].stride() == (8, 1)
    for shape in [(128, 0), (0, 128), (1, 5), (3, 1, 4), (0,)]:  # torch's contiguous strides, none 0
        assert buffers.transient((where, "grad"), torch.float32, *shape).stride() == torch.empty(shape).stride()
    assert buffers._transient_bytes[0] == 2 * 512
    buffers.clear()
    assert buffers.transient((where, "grad"), torch.float8_e4m3fn, 32, 16) is not a


@pytest.mark.parametrize("device", _devices())
def test_a_place_grows_to_its_largest_request(device, empty_pool):
    """Packed batches change their token count every step: each place keeps
    one buffer, grown to the largest request, so the kept bytes stay the
    largest shape's whatever the sequence of shapes, and shapes the buffer
    already fits make no allocation."""
    where = buffers.transient_stream(torch.zeros(1, device=device))
    sizes = [(40 + 16 * (i % 7)) for i in range(30)]
    held, largest = [], 0
    for m in sizes:
        t = buffers.transient((where, "grad"), torch.float8_e4m3fn, m, 128)
        largest = max(largest, m)
        assert t.shape == (m, 128) and buffers._transient_bytes[0] == largest * 128
        raw = buffers._places[(where, "grad")][0]
        if not any(r is raw for r in held):  # (kept alive here, so no address or id is reused)
            held.append(raw)
    assert buffers._transient_bytes[0] == max(sizes) * 128
    assert len(held) == len({max(sizes[:i + 1]) for i in range(len(sizes))})  # one allocation per new maximum
    # past VIEWS_PER_PLACE shapes the oldest view is let go (made again if asked for again), the bytes kept
    raw = buffers._places[(where, "grad")][0]
    views = [buffers.transient((where, "grad"), torch.float8_e4m3fn, m, 8)
             for m in range(1, buffers.VIEWS_PER_PLACE + 3)]
    assert buffers._places[(where, "grad")][0] is raw
    kept = [k for k in buffers._transient if k[0] == (where, "grad")]
    assert len(kept) == len(buffers._places[(where, "grad")][2]) == buffers.VIEWS_PER_PLACE
    assert buffers.transient((where, "grad"), torch.float8_e4m3fn, buffers.VIEWS_PER_PLACE + 2, 8) is views[-1]
    again = buffers.transient((where, "grad"), torch.float8_e4m3fn, 1, 8)  # the oldest: let go, a new view
    assert again is not views[0] and again.data_ptr() == views[0].data_ptr()


def test_size_limits(monkeypatch, empty_pool):
    where = buffers.transient_stream(torch.zeros(1))
    monkeypatch.setattr(buffers, "TRANSIENT_MAX_BYTES", 1024)
    big = buffers.transient((where, "grad"), torch.uint8, 2, 1024)  # 2 KiB: made, not kept
    assert buffers.transient((where, "grad"), torch.uint8, 2, 1024) is not big
    monkeypatch.setattr(buffers, "TRANSIENT_POOL_BYTES", 2048)
    a = buffers.transient((where, "a"), torch.uint8, 1024)
    b = buffers.transient((where, "b"), torch.uint8, 1024)
    assert buffers.transient((where, "a"), torch.uint8, 1024) is a and buffers.transient((where, "b"), torch.uint8, 1024) is b
    c = buffers.transient((where, "c"), torch.uint8, 1024)  # past the total: a and b let go, c kept
    assert buffers.transient((where, "c"), torch.uint8, 1024) is c
    assert buffers.transient((where, "a"), torch.uint8, 1024) is not a
    monkeypatch.setattr(buffers, "TRANSIENT_POOL_BYTES", 0)  # keep none
    buffers.clear()
    d = buffers.transient((where, "d"), torch.uint8, 16)
    assert buffers.transient((where, "d"), torch.uint8, 16) is not d and not buffers._transient


@pytest.mark.cuda
def test_nothing_kept_under_capture(empty_pool):
    x = torch.zeros(1, device="cuda")
    eager = buffers.transient((buffers.transient_stream(x), "grad"), torch.float32, 8)
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            where = buffers.transient_stream(x)
            assert where[1] is None
            a = buffers.transient((where, "grad"), torch.float32, 8)
            b = buffers.transient((where, "grad"), torch.float32, 8)
            a.fill_(1.0)
            b.fill_(2.0)
    assert a is not b and a.data_ptr() != b.data_ptr() and eager.data_ptr() not in (a.data_ptr(), b.data_ptr())
    # after the capture: the side stream has buffers of its own, the default stream its kept one
    with torch.cuda.stream(stream):
        assert buffers.transient((buffers.transient_stream(x), "grad"), torch.float32, 8) is not eager
    assert buffers.transient((buffers.transient_stream(x), "grad"), torch.float32, 8) is eager


@pytest.mark.parametrize("device", _devices())
def test_threads_never_share(device, empty_pool):
    """Two threads on one stream interleave their launches: each has its own
    buffers (deterministic: the keys), and FP8 Linear forwards run from two
    threads at once give the single-threaded outputs."""
    x = torch.zeros(1, device=device)
    mine = buffers.transient((buffers.transient_stream(x), "grad"), torch.float32, 8)
    theirs = []
    t = threading.Thread(target=lambda: theirs.append(
        buffers.transient((buffers.transient_stream(x), "grad"), torch.float32, 8)))
    t.start()
    t.join()
    assert theirs[0] is not mine and theirs[0].data_ptr() != mine.data_ptr()

    torch.manual_seed(0)
    mods = [te.Linear(256, 256, params_dtype=torch.bfloat16, device=device) for _ in range(2)]
    xs = [torch.randn(512, 256, device=device).bfloat16() for _ in range(2)]

    def forward(i):
        with torch.no_grad(), te.autocast(recipe=Float8CurrentScaling()):
            return mods[i](xs[i])

    want = [forward(0), forward(1)]
    wrong = []

    def worker(i):
        for _ in range(20):
            y = forward(i)
            if device == "cuda":
                torch.cuda.current_stream().synchronize()
            wrong.append(not torch.equal(y, want[i]))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wrong) == 40 and not any(wrong)


@needs_fp8
@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_stack_of_mixed_shapes_trains_as_without_kept_buffers(device, recipe, seed, empty_pool):
    """Places shared by requests of other shapes and dtypes (FFN widths 384
    and 256, a gated activation, a 128 -> 256 projection) at token counts
    that change every step, some padded, some growing a place's buffer: every
    output and gradient bit for bit those of a copy trained with no buffer kept."""
    kw = dict(params_dtype=torch.bfloat16, device=device)
    model = torch.nn.Sequential(te.LayerNormLinear(128, 256, **kw), te.Linear(256, 128, **kw),
                                te.LayerNormMLP(128, 384, activation="gelu", bias=True, **kw),
                                te.LayerNormMLP(128, 256, activation="swiglu", bias=False, **kw),
                                te.Linear(128, 128, **kw))
    ref = copy.deepcopy(model)
    rows = [40, 72, 23, 130, 40, 96]
    xs = [torch.randn(r, 128, device=device).bfloat16() for r in rows]
    dys = [torch.randn(r, 128, device=device).bfloat16() for r in rows]
    got = _train(model, xs, dys, RECIPES[recipe]())
    assert buffers._places
    buffers.clear()
    saved = buffers.TRANSIENT_POOL_BYTES
    buffers.TRANSIENT_POOL_BYTES = 0  # nothing kept: every buffer new
    try:
        want = _train(ref, xs, dys, RECIPES[recipe]())
    finally:
        buffers.TRANSIENT_POOL_BYTES = saved
    assert not buffers._transient and not buffers._places
    for step, ((y, dx, grads), (y_ref, dx_ref, grads_ref)) in enumerate(zip(got, want)):
        assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref), step
        for i, (g, g_ref) in enumerate(zip(grads, grads_ref)):
            assert torch.equal(g, g_ref), (step, i)


def _stack(device, h=128):
    kw = dict(params_dtype=torch.bfloat16, device=device)
    layers = []
    for _ in range(2):  # two layers of one shape: their casts share every view
        layers += [te.LayerNormLinear(h, h, normalization="LayerNorm", **kw),
                   te.LayerNormMLP(h, h, activation="gelu", bias=False, **kw),  # FC1 and FC2 gradients: one view
                   te.Linear(h, h, **kw)]
    return torch.nn.Sequential(*layers)


def _train(model, xs, dys, recipe):
    out = []
    opt = torch.optim.SGD(model.parameters(), lr=0.005)
    for x, dy in zip(xs, dys):
        x = x.detach().requires_grad_(True)
        with te.autocast(recipe=recipe):
            y = model(x)
        y.backward(dy)
        out.append((y.detach(), x.grad, [p.grad.clone() for p in model.parameters()]))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out


@needs_fp8
@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_stack_trains_as_without_kept_buffers(device, recipe, monkeypatch, seed, empty_pool):
    """Four steps (delayed scaling's fused activation-gradient cast from the
    second) at 40 rows (padded to 48 in the casts): every output and gradient
    bit for bit those of a copy trained with no buffer kept."""
    model = _stack(device)
    ref = copy.deepcopy(model)
    xs = [torch.randn(40, 128, device=device).bfloat16() for _ in range(4)]
    dys = [torch.randn(40, 128, device=device).bfloat16() for _ in range(4)]
    got = _train(model, xs, dys, RECIPES[recipe]())
    # every site keeps its buffers: the forward's row-wise inputs (LayerNormMLP's two roles apart), the
    # backward's gradient copies, scale inverse and bias sums (the stack's Linears and norms have biases)
    purposes = {key[0][1] for key in buffers._transient}  # (keys: ((stream, purpose), dtype, shape))
    want = {("input", 0), ("input", 3)}
    want |= {"grad", "grad_t", "grad_sums"}
    if recipe == "block":  # (the 1x128 blocks' scales beside each copy)
        want |= {(("input", 0), "scale_inv"), (("input", 3), "scale_inv"), ("grad", "scale_inv"),
                 ("grad_t", "scale_inv")}
    else:
        want.add("grad_scale_inv")
    assert want <= purposes, want - purposes
    buffers.clear()
    monkeypatch.setattr(buffers, "TRANSIENT_MAX_BYTES", -1)  # nothing kept: every buffer new
    want = _train(ref, xs, dys, RECIPES[recipe]())
    assert not buffers._transient
    for step, ((y, dx, grads), (y_ref, dx_ref, grads_ref)) in enumerate(zip(got, want)):
        assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref), step
        for i, (g, g_ref) in enumerate(zip(grads, grads_ref)):
            assert torch.equal(g, g_ref), (step, i)


def _grad_cast(device, recipe_cls=DelayedScaling, rows=40, bias=True):
    """One Linear's output-gradient cast as its backward makes it (quantize_grad, transient=True)."""
    from seqfuse.quantization.gemm_quantizers import quantizers_for

    m = te.Linear(64, 32, bias=bias, params_dtype=torch.bfloat16, device=device)
    q = quantizers_for(m, recipe_cls(), torch.device(device))
    dy = torch.randn(rows, 32, dtype=torch.bfloat16, device=device)
    return lambda: q.grads[0].quantize_grad(dy, torch.bfloat16 if bias else None, transient=True)[0]


@pytest.mark.parametrize("device", _devices())
def test_gradient_cast_reuses_its_kept_set_of_transient_views(device, empty_pool):
    """A repeated gradient cast gets its four buffers from one kept set: the
    very views transient() keeps for them (so the same memory as before)."""
    needs_fp8(device)
    cast = _grad_cast(device)
    g1 = cast()
    g2 = cast()
    assert g2.data is g1.data and g2.data_t is g1.data_t and g2.scale_inv is g1.scale_inv
    where = buffers.transient_stream(g1.data)
    assert buffers.transient((where, "grad"), g1.data.dtype, *g1.data.shape) is g1.data
    assert buffers.transient((where, "grad_t"), g1.data.dtype, *g1.data_t.shape) is g1.data_t


@pytest.mark.parametrize("device", _devices())
def test_gradient_cast_keeps_no_set_of_buffers_the_pool_does_not_keep(device, monkeypatch, empty_pool):
    """Buffers transient() makes without keeping them (over TRANSIENT_MAX_BYTES,
    the pool off) are never kept in a set either: each cast gets new ones,
    which go back to the allocator after the backward."""
    needs_fp8(device)
    cast = _grad_cast(device)
    for name, value in (("TRANSIENT_MAX_BYTES", 64), ("TRANSIENT_POOL_BYTES", 0)):
        with monkeypatch.context() as mp:
            mp.setattr(buffers, name, value)
            buffers.clear()
            g1, g2 = cast(), cast()
            assert g1.data is not g2.data and g1.data_t is not g2.data_t, name
            assert not buffers._sets, name


@pytest.mark.parametrize("device", _devices())
def test_letting_a_view_go_lets_every_kept_set_go(device, empty_pool):
    """clear(), or a place grown past a kept view, drops the kept sets: none
    keeps memory the pool let go, and the next cast gets the pool's views."""
    needs_fp8(device)
    cast = _grad_cast(device)
    g1 = cast()
    assert buffers._sets
    buffers.clear()
    assert not buffers._sets
    g2 = cast()
    assert g2.data is not g1.data and buffers._sets
    big = _grad_cast(device, rows=400)()  # the 'grad' place grows: its old views are let go, and g2's set
    assert len(buffers._sets) == 1 and next(iter(buffers._sets.values()))[2] is big.data


def test_kept_sets_past_max_are_let_go_and_kept_anew(monkeypatch, empty_pool):
    """Past MAX_SETS sets every kept set goes (none is kept without bound),
    and the set being kept is kept."""
    monkeypatch.setattr(buffers, "MAX_SETS", 2)
    where = buffers.transient_stream(torch.zeros(1))
    views = {}
    for i in range(3):
        request = ((where, "grad"), torch.float32, (4, 3 - i))  # (largest first: no place grows)
        views[i] = buffers.transient(*request[:2], *request[2])
        buffers.keep_set(("k", i), (views[i],), (request,))
    assert buffers.kept_set(("k", 0)) is None and buffers.kept_set(("k", 1)) is None
    assert buffers.kept_set(("k", 2)) == (views[2],)
