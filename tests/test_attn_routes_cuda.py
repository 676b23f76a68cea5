"""The "flash" and "torch_fp32" routes of ops.attention on the GPU
(python/seqfuse/ops/attn/_torch_routes.py), against the float64 reference
of attn_ref.py, forward and gradients, with the tolerances by dtype of
helpers.py:

- flash (forced, so a call it cannot take raises instead of running
  seqfuse's kernels): packed thd with tail tokens past the last sequence,
  empty sequences, top-left causal with one cu_seqlens tensor, bottom-right
  causal at unequal lengths, windows; padded bshd/sbhd with empty and full
  rows (padding positions exactly 0, gradients too); padding-free bshd/sbhd
  with GQA, causal and windows; head dims 16 to 256, GQA 1:1, 2:1 and 6:1,
  bfloat16 and float16; CUDA graph capture.
- dropout on the flash and cudnn routes: the backward uses the forward's
  mask (for dout = out, <v, dV> equals <out, out> only when the backward
  drops what the forward dropped), every attention weight is either dropped
  or scaled by exactly 1 / (1 - p), the drop rate is p within 5 standard
  deviations (and FlashAttention's 1/256, its 8-bit keep threshold),
  torch.manual_seed repeats the mask, a CUDA graph's replays draw new
  masks, and a TransformerLayer with TE's default attention_dropout=0.1
  runs on the cudnn route in auto (padding-free; packed calls with dropout
  take the flash route).
- torch_fp32 (auto): float32 bshd/sbhd/thd, every mask, windows, GQA,
  padding, deterministic, dropout's same-mask check.
Run on an H200: `python3 -m pytest -q tests/test_attn_routes_cuda.py`."""
import itertools
import random

import pytest
import torch

import seqfuse
from attn_ref import cu_seqlens, reference
from helpers import BACKWARD_FACTOR, rel_error, rel_tol
from seqfuse.ops.attn import _routing as routing
from seqfuse.ops.attn import _torch_routes as routes

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def restore_backend(monkeypatch):
    monkeypatch.setattr(routing, "_backend", routing._backend)
    monkeypatch.setattr(routing, "_choices", {})
    monkeypatch.setattr(routing, "_cudnn_picked", {})
    monkeypatch.setattr(routing, "_route_failed", {})
    monkeypatch.setattr(routing, "_logged", set())


@pytest.fixture
def flash_calls(monkeypatch):
    """Counts the calls of torch's FlashAttention forward made by the route."""
    calls = []
    real = routes._flash_forward

    def counted(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(routes, "_flash_forward", counted)
    return calls


def _randn(shape, dtype):
    return torch.randn(shape, device="cuda").to(dtype)


def _run(q, k, v, dout, kw):
    qs, ks, vs = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = seqfuse.ops.attention(qs, ks, vs, **kw)
    out.backward(dout)
    return out.detach(), (qs.grad, ks.grad, vs.grad)


def _reference(q, k, v, dout, fmt, mask, lq, lk, window, scale=None):
    qr, kr, vr = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = reference(qr, kr, vr, qkv_format=fmt, attn_mask_type=mask, seqlens_q=lq, seqlens_kv=lk,
                    window_size=window, softmax_scale=scale)
    ref.backward(dout.double())
    return ref, (qr.grad, kr.grad, vr.grad)


def _check(out, grads, ref, ref_grads, dtype, what):
    assert torch.isfinite(out.float()).all(), what
    e = rel_error(out, ref)
    assert e <= rel_tol(dtype), f"{what}: out rel error {e:.2e}"
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert torch.isfinite(g.float()).all(), f"{what}: {name}"
        e = rel_error(g, r)
        assert e <= rel_tol(dtype, BACKWARD_FACTOR), f"{what}: {name} rel error {e:.2e}"


def _thd(rng, b, sq, sk, h, hk, d, dtype, mask):
    """Packed q, k, v, dout with tail tokens, and the call's keywords; one
    cu_seqlens tensor where the mask is top-left causal."""
    lq = [sq] + [rng.randint(0, sq) for _ in range(b - 1)]
    if mask == "padding_causal":
        lk = lq
    else:
        lk = [sk] + [rng.randint(1, sk) for _ in range(b - 1)]
    q, dout = _randn((sum(lq) + 5, h, d), dtype), _randn((sum(lq) + 5, h, d), dtype)
    k, v = _randn((sum(lk) + 3, hk, d), dtype), _randn((sum(lk) + 3, hk, d), dtype)
    cu_q = cu_seqlens(lq, "cuda")
    cu_k = cu_q if lk is lq else cu_seqlens(lk, "cuda")
    kw = dict(qkv_format="thd", attn_mask_type=mask, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k, max_seqlen_q=max(lq),
              max_seqlen_kv=max(lk))
    return q, k, v, dout, lq, lk, kw


THD_MASKS = ["padding", "padding_causal", "padding_causal_bottom_right"]
GQA = [(4, 4), (4, 2), (6, 1)]
LENGTHS = [(128, 128), (77, 150), (300, 65)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("d", [16, 24, 32, 64, 128, 256])
@pytest.mark.parametrize("h,hk", GQA)
@pytest.mark.parametrize("mask", THD_MASKS)
def test_cuda_flash_thd(mask, h, hk, d, dtype, seed, flash_calls):
    rng = random.Random(seed)
    seqfuse.ops.set_attention_backend("flash")
    for sq, sk in LENGTHS:
        q, k, v, dout, lq, lk, kw = _thd(rng, 3, sq, sk, h, hk, d, dtype, mask)
        out, grads = _run(q, k, v, dout, kw)
        ref, ref_grads = _reference(q, k, v, dout, "thd", mask, lq, lk, None)
        _check(out, grads, ref, ref_grads, dtype, f"thd {mask} {h}/{hk} d={d} {sq}x{sk}")
        assert torch.equal(out[-5:], torch.zeros_like(out[-5:]))  # the tail: exactly 0, gradients too
        assert torch.equal(grads[0][-5:], torch.zeros_like(grads[0][-5:]))
        assert torch.equal(grads[1][-3:], torch.zeros_like(grads[1][-3:]))
    assert len(flash_calls) == len(LENGTHS)


@pytest.mark.parametrize("window", [(16, 0), (32, 8), (-1, 4)])
@pytest.mark.parametrize("mask", ["padding", "padding_causal", "padding_causal_bottom_right"])
def test_cuda_flash_thd_window(mask, window, seed):
    rng = random.Random(seed)
    seqfuse.ops.set_attention_backend("flash")
    q, k, v, dout, lq, lk, kw = _thd(rng, 4, 200, 150, 4, 2, 64, torch.bfloat16, mask)
    kw["window_size"] = window
    out, grads = _run(q, k, v, dout, kw)
    ref, ref_grads = _reference(q, k, v, dout, "thd", mask, lq, lk, window)
    _check(out, grads, ref, ref_grads, torch.bfloat16, f"thd {mask} window {window}")


def _padded(rng, fmt, b, sq, sk, h, hk, d, dtype, mask):
    lq = [sq, 0] + [rng.randint(0, sq) for _ in range(b - 2)]
    same = mask == "padding_causal"
    lk = lq if same else [sk, rng.randint(1, sk)] + [rng.randint(0, sk) for _ in range(b - 2)]
    shape = (lambda s, n: (b, s, n, d)) if fmt == "bshd" else (lambda s, n: (s, b, n, d))
    q, dout = _randn(shape(sq, h), dtype), _randn(shape(sq, h), dtype)
    k, v = _randn(shape(sk, hk), dtype), _randn(shape(sk, hk), dtype)
    cu_q = cu_seqlens(lq, "cuda")
    kw = dict(qkv_format=fmt, attn_mask_type=mask, cu_seqlens_q=cu_q,
              cu_seqlens_kv=cu_q if same else cu_seqlens(lk, "cuda"))
    return q, k, v, dout, lq, lk, kw


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("mask", ["padding", "padding_causal", "padding_causal_bottom_right"])
@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
def test_cuda_flash_padded(fmt, mask, d, dtype, seed, flash_calls):
    rng = random.Random(seed)
    seqfuse.ops.set_attention_backend("flash")
    for sq, sk in [(128, 128), (200, 200)] if mask == "padding_causal" else LENGTHS:
        q, k, v, dout, lq, lk, kw = _padded(rng, fmt, 4, sq, sk, 4, 2, d, dtype, mask)
        out, grads = _run(q, k, v, dout, kw)
        ref, ref_grads = _reference(q, k, v, dout, fmt, mask, lq, lk, None)
        _check(out, grads, ref, ref_grads, dtype, f"{fmt} {mask} d={d} {sq}x{sk}")
        rows, drows = (out, grads[0]) if fmt == "bshd" else (out.transpose(0, 1), grads[0].transpose(0, 1))
        for i, n in enumerate(lq):  # padding queries: exactly 0, and their gradient
            assert torch.equal(rows[i, n:], torch.zeros_like(rows[i, n:]))
            assert torch.equal(drows[i, n:], torch.zeros_like(drows[i, n:]))
    assert flash_calls


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("mask,window,sq,sk", [("causal", None, 300, 300), ("causal_bottom_right", None, 200, 333),
                                               ("no_mask", (64, 64), 257, 257), ("causal", (100, 0), 256, 256)])
@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
def test_cuda_flash_dense_gqa(fmt, mask, window, sq, sk, d, seed):
    torch.manual_seed(seed)
    seqfuse.ops.set_attention_backend("flash")
    b, h, hk, dtype = 2, 8, 2, torch.bfloat16
    shape = (lambda s, n: (b, s, n, d)) if fmt == "bshd" else (lambda s, n: (s, b, n, d))
    q, dout = _randn(shape(sq, h), dtype), _randn(shape(sq, h), dtype)
    k, v = _randn(shape(sk, hk), dtype), _randn(shape(sk, hk), dtype)
    kw = dict(qkv_format=fmt, attn_mask_type=mask, window_size=window)
    out, grads = _run(q, k, v, dout, kw)
    assert out.shape == q.shape and out.is_contiguous()
    ref, ref_grads = _reference(q, k, v, dout, fmt, mask, None, None, window)
    _check(out, grads, ref, ref_grads, dtype, f"{fmt} {mask} {window} d={d}")


def test_cuda_auto_sends_packed_padded_windowed_to_flash(flash_calls):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("auto takes the flash route on compute capability 9.0 only")
    seqfuse.ops.set_attention_backend("auto")
    rng = random.Random(0)
    q, k, v, dout, _, _, kw = _thd(rng, 3, 128, 128, 4, 4, 64, torch.bfloat16, "padding")
    assert seqfuse.ops.attention_backend(q.requires_grad_(), k, v, **kw)[0] == "flash"
    with torch.no_grad():  # forward only: seqfuse's forward (measured faster)
        assert seqfuse.ops.attention_backend(q, k, v, **kw)[0] == "seqfuse"
    q, k, v, dout, _, _, kw = _padded(rng, "bshd", 3, 128, 128, 4, 4, 64, torch.bfloat16, "padding_causal")
    assert seqfuse.ops.attention_backend(q.requires_grad_(), k, v, **kw)[0] == "flash"
    x = _randn((2, 128, 4, 64), torch.bfloat16)
    xg = x.detach().requires_grad_()
    assert seqfuse.ops.attention_backend(xg, x, x, dropout_p=0.1)[0] == "cudnn"  # padding-free: cuDNN's dropout
    assert seqfuse.ops.attention_backend(x, x, x, dropout_p=0.1)[0] == "cudnn"  # no grad: the same route
    x32 = _randn((2, 128, 4, 32), torch.bfloat16).requires_grad_()
    assert seqfuse.ops.attention_backend(x32, x32, x32, dropout_p=0.1)[0] == "flash"  # below head dim 64
    assert seqfuse.ops.attention_backend(xg, x, x, dropout_p=0.1, rng_state=(1, 0))[0] == "seqfuse"  # Philox
    assert seqfuse.ops.attention_backend(xg, x[:, :, :2], x[:, :, :2], window_size=(16, 0),
                                         attn_mask_type="causal")[0] == "flash"  # GQA with a window
    assert seqfuse.ops.attention_backend(xg, x[:, :, :2], x[:, :, :2])[0] == "cudnn"  # GQA alone: cuDNN
    assert seqfuse.ops.attention_backend(xg, x, x)[0] == "cudnn"  # padding-free MHA stays on cuDNN


def test_cuda_flash_thd_in_a_cuda_graph(seed):
    rng = random.Random(seed)
    seqfuse.ops.set_attention_backend("flash")
    q, k, v, _, lq, lk, kw = _thd(rng, 3, 128, 128, 4, 4, 64, torch.bfloat16, "padding")
    eager = seqfuse.ops.attention(q, k, v, **kw)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        seqfuse.ops.attention(q, k, v, **kw)  # warm-up on the side stream
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = seqfuse.ops.attention(q, k, v, **kw)
    q.copy_(torch.randn_like(q))
    g.replay()
    torch.cuda.synchronize()
    assert not torch.equal(captured, eager)
    assert torch.equal(captured, seqfuse.ops.attention(q, k, v, **kw))


# ------------------------------------------------------------------ dropout on the flash route
def _same_mask_ratio(q, k, v, kw, p):
    """<v, dV> / <out, out> for dout = out: 1 when the backward drops what
    the forward dropped."""
    qs, ks, vs = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = seqfuse.ops.attention(qs, ks, vs, dropout_p=p, **kw)
    out.backward(out.detach())
    num = (vs.detach().double() * vs.grad.double()).sum()
    return (num / out.detach().double().pow(2).sum()).item()


@pytest.mark.parametrize("layout", ["thd", "bshd padded", "sbhd gqa"])
def test_cuda_flash_dropout_backward_uses_the_forwards_mask(layout, seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    seqfuse.ops.set_attention_backend("flash")
    dtype = torch.float16
    if layout == "thd":
        q, k, v, _, _, _, kw = _thd(rng, 4, 256, 256, 4, 4, 64, dtype, "padding")
    elif layout == "bshd padded":
        q, k, v, _, _, _, kw = _padded(rng, "bshd", 4, 256, 256, 4, 4, 64, dtype, "padding_causal")
    else:
        q, k, v = _randn((256, 2, 8, 64), dtype), _randn((256, 2, 2, 64), dtype), _randn((256, 2, 2, 64), dtype)
        kw = dict(qkv_format="sbhd", attn_mask_type="causal")
    for p in (0.1, 0.3):
        assert abs(_same_mask_ratio(q, k, v, kw, p) - 1.0) < 5e-3, (layout, p)


@pytest.mark.parametrize("layout", ["bshd", "sbhd causal gqa", "thd of equal lengths"])
@pytest.mark.parametrize("d", [16, 64, 128])
def test_cuda_cudnn_dropout_backward_uses_the_forwards_mask(layout, d, seed, cudnn_calls):
    torch.manual_seed(seed)
    seqfuse.ops.set_attention_backend("cudnn")
    dtype = torch.bfloat16 if d == 64 else torch.float16
    if layout == "bshd":
        q, k, v = (_randn((2, 256, 4, d), dtype) for _ in range(3))
        kw = dict(qkv_format="bshd")
    elif layout == "sbhd causal gqa":
        q, k, v = _randn((256, 2, 8, d), dtype), _randn((256, 2, 2, d), dtype), _randn((256, 2, 2, d), dtype)
        kw = dict(qkv_format="sbhd", attn_mask_type="causal")
    else:
        q, k, v = (_randn((3 * 128, 4, d), dtype) for _ in range(3))
        cu = cu_seqlens([128] * 3, "cuda")
        kw = dict(qkv_format="thd", attn_mask_type="padding", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=128,
                  max_seqlen_kv=128)
    for p in (0.1, 0.3):
        assert abs(_same_mask_ratio(q, k, v, kw, p) - 1.0) < 1e-2, (layout, d, p)
    assert [c[1]["dropout_p"] for c in cudnn_calls] == [0.1, 0.3]


def _one_hot_values(lengths, h, d, dtype):
    """v one-hot over each sequence's keys, packed [t, h, d]: the attention
    output is then the (dropped, rescaled) attention matrix itself."""
    v = torch.zeros(sum(lengths), h, d, device="cuda", dtype=dtype)
    start = 0
    for n in lengths:
        v[start:start + n] = torch.eye(n, d, device="cuda", dtype=dtype)[:, None, :]
        start += n
    return v


@pytest.mark.parametrize("route", ["flash", "cudnn"])
def test_cuda_dropout_drops_or_scales_each_weight(route, seed):
    """v one-hot over a sequence's keys makes the output the dropped and
    rescaled attention matrix itself: each weight is 0 or P / (1 - p), at a
    drop rate of p."""
    torch.manual_seed(seed)
    seqfuse.ops.set_attention_backend(route)
    h, d, p, dtype = 4, 64, 0.2, torch.float16
    if route == "flash":
        lengths = [64, 50, 33, 64, 64]
        t = sum(lengths)
        q, k = _randn((t, h, d), dtype), _randn((t, h, d), dtype)
        v = _one_hot_values(lengths, h, d, dtype)
        cu = cu_seqlens(lengths, "cuda")
        kw = dict(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=64, max_seqlen_kv=64)
    else:  # padding-free bshd: 3 sequences of 64 keys
        q, k = _randn((3, 64, h, d), dtype), _randn((3, 64, h, d), dtype)
        v = _one_hot_values([64] * 3, h, d, dtype).view(3, 64, h, d)
        kw = dict(qkv_format="bshd")
    weights = seqfuse.ops.attention(q, k, v, **kw).float()            # P
    dropped = seqfuse.ops.attention(q, k, v, dropout_p=p, **kw).float()  # P * keep / (1 - p)
    seen = weights > 1e-3
    kept = (dropped - weights / (1 - p)).abs() <= 0.01 * weights / (1 - p) + 2e-4
    zero = dropped.abs() <= 2e-4
    assert (kept | zero)[seen].all()
    n = int(seen.sum())
    rate = float((zero & seen).sum()) / n
    # FlashAttention keeps a weight when an 8-bit random draw is at most floor((1 - p) * 255): a drop rate
    # within 1/256 of p (0.1992 for p = 0.2), the kept ones scaled by exactly 1 / (1 - p)
    assert abs(rate - p) <= 5 * (p * (1 - p) / n) ** 0.5 + 1 / 256, (rate, n)
    torch.manual_seed(seed + 1)
    a = seqfuse.ops.attention(q, k, v, dropout_p=p, **kw)
    b = seqfuse.ops.attention(q, k, v, dropout_p=p, **kw)
    torch.manual_seed(seed + 1)
    assert not torch.equal(a, b) and torch.equal(a, seqfuse.ops.attention(q, k, v, dropout_p=p, **kw))


@pytest.mark.parametrize("route", ["flash", "cudnn"])
def test_cuda_dropout_in_a_cuda_graph_draws_a_new_mask_each_replay(route):
    """A captured dropout call replays with fresh random numbers (torch's
    generator hands the graph a new offset per replay), never one mask for
    every step."""
    torch.manual_seed(0)
    seqfuse.ops.set_attention_backend(route)
    q, k, v = (_randn((2, 128, 4, 64), torch.bfloat16) for _ in range(3))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        seqfuse.ops.attention(q, k, v, dropout_p=0.2)  # warm-up on the side stream
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = seqfuse.ops.attention(q, k, v, dropout_p=0.2)
    g.replay()
    first = captured.clone()
    g.replay()
    torch.cuda.synchronize()
    plain = seqfuse.ops.attention(q, k, v)
    assert not torch.equal(first, captured)
    for out in (first, captured):  # both dropped something, and kept the scale: the mean of P v is kept
        assert not torch.equal(out, plain)
        assert rel_error(out.float().mean(dim=(0, 1)), plain.float().mean(dim=(0, 1))) < 0.25


def test_cuda_te_default_transformer_layer_takes_a_torch_route(flash_calls, cudnn_calls):
    """TE's default attention_dropout=0.1 in training, padding-free: the
    cudnn route with cuDNN's dropout (eval: the same route, no dropout)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("auto takes the torch routes on compute capability 9.0 only")
    import seqfuse.pytorch as te
    seqfuse.ops.set_attention_backend("auto")
    layer = te.TransformerLayer(256, 512, 4, params_dtype=torch.bfloat16, device="cuda")  # attention_dropout=0.1
    x = torch.randn(128, 2, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    y.float().pow(2).mean().backward()
    assert [(c[2], c[1]["dropout_p"]) for c in cudnn_calls] == [("op", 0.1)] and not flash_calls
    assert torch.isfinite(x.grad.float()).all()
    layer.eval()
    with torch.no_grad():
        layer(x)
    assert [(c[2], c[1]["dropout_p"]) for c in cudnn_calls[1:]] == [("op", 0.0)]  # eval: no dropout


# ------------------------------------------------------------------ float32 (torch_fp32, auto)
FP32_CASES = list(itertools.product(
    ["bshd", "sbhd"], ["no_mask", "causal", "causal_bottom_right", "padding", "padding_causal_bottom_right"],
    [None, (32, 16)], [(4, 4), (4, 2)]))


@pytest.mark.parametrize("fmt,mask,window,heads", FP32_CASES, ids=str)
def test_cuda_fp32_route(fmt, mask, window, heads, seed, flash_calls):
    rng = random.Random(seed)
    seqfuse.ops.set_attention_backend("auto")
    h, hk = heads
    if "padding" in mask:
        q, k, v, dout, lq, lk, kw = _padded(rng, fmt, 3, 150, 100, h, hk, 64, torch.float32, mask)
    else:
        shape = (lambda s, n: (3, s, n, 64)) if fmt == "bshd" else (lambda s, n: (s, 3, n, 64))
        q, dout = _randn(shape(150, h), torch.float32), _randn(shape(150, h), torch.float32)
        k, v = _randn(shape(100, hk), torch.float32), _randn(shape(100, hk), torch.float32)
        lq = lk = None
        kw = dict(qkv_format=fmt, attn_mask_type=mask)
    kw["window_size"] = window
    assert seqfuse.ops.attention_backend(q, k, v, **kw)[0] == "torch_fp32"
    out, grads = _run(q, k, v, dout, kw)
    ref, ref_grads = _reference(q, k, v, dout, fmt, mask, lq, lk, window)
    _check(out, grads, ref, ref_grads, torch.float32, f"fp32 {fmt} {mask} {window} {heads}")
    assert not flash_calls


@pytest.mark.parametrize("mask", THD_MASKS)
@pytest.mark.parametrize("deterministic", [False, True])
def test_cuda_fp32_route_thd(mask, deterministic, seed):
    rng = random.Random(seed)
    seqfuse.ops.set_attention_backend("auto")
    q, k, v, dout, lq, lk, kw = _thd(rng, 4, 130, 90, 4, 2, 32, torch.float32, mask)
    kw.update(window_size=(40, 8), deterministic=deterministic)
    assert seqfuse.ops.attention_backend(q, k, v, **kw)[0] == "torch_fp32"
    out, grads = _run(q, k, v, dout, kw)
    ref, ref_grads = _reference(q, k, v, dout, "thd", mask, lq, lk, (40, 8))
    _check(out, grads, ref, ref_grads, torch.float32, f"fp32 thd {mask}")
    if deterministic:
        again = _run(q, k, v, dout, kw)
        assert torch.equal(out, again[0]) and all(torch.equal(a, b) for a, b in zip(grads, again[1]))


def test_cuda_fp32_route_dropout_backward_uses_the_forwards_mask(seed):
    torch.manual_seed(seed)
    seqfuse.ops.set_attention_backend("auto")
    q, k, v = (_randn((2, 200, 4, 64), torch.float32) for _ in range(3))
    assert abs(_same_mask_ratio(q, k, v, dict(attn_mask_type="causal"), 0.3) - 1.0) < 1e-4


@pytest.mark.parametrize("mask,groups", [("padding", 20), ("padding_causal", 4)])
def test_cuda_packed_dot_product_attention_trains_on_the_flash_route(mask, groups, seed, flash_calls):
    """A packed (thd) DotProductAttention in training: auto on an H200 takes
    the flash route; output and gradients as seqfuse's kernels give them."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("auto takes the flash route on compute capability 9.0 only")
    import seqfuse.pytorch as te
    torch.manual_seed(seed)
    lengths = [300, 17, 512, 129, 64]
    t, h, d = sum(lengths), 20, 64
    attn = te.DotProductAttention(h, d, num_gqa_groups=groups, qkv_format="thd", attn_mask_type=mask)
    q = _randn((t, h, d), torch.bfloat16)
    k, v = _randn((t, groups, d), torch.bfloat16), _randn((t, groups, d), torch.bfloat16)
    dout = _randn((t, h * d), torch.bfloat16)
    cu = cu_seqlens(lengths, "cuda")
    results = {}
    for backend in ("auto", "seqfuse"):
        seqfuse.ops.set_attention_backend(backend)
        xs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        out = attn(*xs, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=512, max_seqlen_kv=512)
        out.backward(dout.view(out.shape))
        results[backend] = (out.detach(), [x.grad for x in xs])
    assert len(flash_calls) == 1
    (out, grads), (ref, ref_grads) = results["auto"], results["seqfuse"]
    assert rel_error(out, ref) <= 2 * rel_tol(torch.bfloat16)  # two bf16 results, each within rel_tol
    for g, r in zip(grads, ref_grads):
        assert rel_error(g, r) <= 2 * rel_tol(torch.bfloat16, BACKWARD_FACTOR)


@pytest.mark.parametrize("fmt,causal,hk,p,dtype", [("bshd", False, 8, 0.0, torch.bfloat16),
                                                  ("sbhd", True, 2, 0.0, torch.float16),
                                                  ("bshd", True, 4, 0.1, torch.bfloat16)])
def test_cuda_cudnn_route_calls_the_op_sdpa_calls(fmt, causal, hk, p, dtype, cudnn_calls):
    """The cudnn route hands torch's cuDNN op what SDPA restricted to cuDNN
    hands it: the same output bit for bit (dropout: the same mask from the
    same seed) and the same gradients, through the op itself on an H200."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the cudnn route is measured and taken on compute capability 9.0")
    from torch.nn.attention import SDPBackend, sdpa_kernel
    seqfuse.ops.set_attention_backend("cudnn")
    b, s, h, d = 2, 384, 8, 64
    shape = (b, s) if fmt == "bshd" else (s, b)
    q = _randn((*shape, h, d), dtype).requires_grad_()
    k, v = (_randn((*shape, hk, d), dtype).requires_grad_() for _ in range(2))
    dout = _randn((*shape, h, d), dtype)
    torch.manual_seed(5)
    out = seqfuse.ops.attention(q, k, v, qkv_format=fmt, attn_mask_type="causal" if causal else "no_mask",
                                dropout_p=p)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert [(c[2], c[1]["dropout_p"]) for c in cudnn_calls] == [("op", p)]
    to = (0, 2, 1, 3) if fmt == "bshd" else (1, 2, 0, 3)
    back = (0, 2, 1, 3) if fmt == "bshd" else (2, 0, 1, 3)
    torch.manual_seed(5)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        ref = torch.nn.functional.scaled_dot_product_attention(q.permute(to), k.permute(to), v.permute(to),
                                                               is_causal=causal, dropout_p=p,
                                                               enable_gqa=hk != h).permute(back)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    assert torch.equal(out, ref)
    for g, r in zip(grads, ref_grads):  # the same kernels (dQ's float32 atomics may order sums differently)
        assert rel_error(g, r) < 1e-3


def test_cuda_cudnn_op_under_autocast_and_without_grad(cudnn_calls):
    """On the direct op, as on SDPA with autocast off: bfloat16 inputs under
    a float16 torch.autocast stay bfloat16 and give the same output; a call
    without gradients (no log-sum-exp asked for) gives the training call's
    output."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the cudnn route is measured and taken on compute capability 9.0")
    seqfuse.ops.set_attention_backend("cudnn")
    q, k, v = (_randn((2, 256, 8, 64), torch.bfloat16) for _ in range(3))
    out = seqfuse.ops.attention(q, k, v, attn_mask_type="causal")
    with torch.autocast("cuda", dtype=torch.float16):
        out_autocast = seqfuse.ops.attention(q, k, v, attn_mask_type="causal")
    qg = q.clone().requires_grad_()
    out_grad = seqfuse.ops.attention(qg, k, v, attn_mask_type="causal")
    assert out_autocast.dtype == torch.bfloat16 and torch.equal(out_autocast, out)
    assert out_grad.grad_fn is not None and rel_error(out_grad, out) < 1e-3
    assert [c[2] for c in cudnn_calls] == ["op"] * 3
