"""The CUDA attention kernels against the float64 reference (attn_ref.py, run
on the GPU), the C CPU reference and torch's scaled_dot_product_attention:
forward and gradients for every layout, mask, window, GQA ratio and head
dim (16, 24, 32, 64, 128; the small ones, ESM-2 8M/35M/150M's, on a smaller
grid), at lengths that are and are not multiples of the tiles (128 query
rows forward, 64 keys, 128 for head dims <= 32; backward 128 keys, 64 at head
dim 128, x 32 rows, 64 x 64 for deterministic dQ), on fresh random inputs with outputs poisoned
(NaN) before each run.  Also: packed == padded on the real tokens,
deterministic backward reproducible, current-stream use and CUDA graphs, and
head dim 24 (run as a 32-wide tile) neither reading nor writing past its 24
columns."""
import itertools
import logging
import random

import pytest
import torch
import torch.nn.functional as F

import seqfuse
from attn_ref import PADDING, cu_seqlens, pack, reference, unpack
from helpers import BACKWARD_FACTOR, rel_error, rel_tol, seqfuse_attention_only, torch_bound

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def _seqfuse_kernels(monkeypatch):
    """ops.attention calls here test seqfuse's kernels, not the cuDNN route."""
    seqfuse_attention_only(monkeypatch)

MASKS = ["no_mask", "padding", "causal", "padding_causal", "causal_bottom_right",
         "padding_causal_bottom_right"]
# (sq, sk): tile multiples, ragged, sq > sk, sq < sk, tiny
LENGTHS = [(128, 128), (77, 150), (200, 65), (256, 256), (1, 9)]
GQA = [(4, 4), (4, 2), (6, 1)]
DIMS = [16, 24, 32, 64, 128]
SMALL_DIMS = [16, 24, 32]  # ESM-2 8M, 35M, 150M

# Head dims 64 and 128: every layout, mask, GQA ratio and length.  The small
# dims: every layout and mask at one GQA ratio and two lengths (a tile
# multiple and a ragged sq < sk), the rest of the grid is shared code.
REFERENCE_CASES = (
    list(itertools.product(["bshd", "sbhd", "thd"], MASKS, [64, 128], GQA, LENGTHS)) +
    list(itertools.product(["bshd", "sbhd", "thd"], MASKS, SMALL_DIMS, [(4, 2)], [(128, 128), (77, 150)])))


def poisoned(shape, dtype, device="cuda"):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def make_case(fmt, mask, b, sq, sk, h, hk, d, dtype, rng):
    """Random q, k, v, dout and the lengths: padded tensors in fmt, or packed
    (thd) with a few tail tokens past the last sequence."""
    lq = lk = None
    if mask in PADDING or fmt == "thd":
        lq = [sq] + [rng.randint(0, sq) for _ in range(b - 1)]
        lk = [sk] + [rng.randint(1, sk) for _ in range(b - 1)]
    if fmt == "thd":
        shape_q, shape_k = (sum(lq) + 3, h, d), (sum(lk) + 2, hk, d)
    elif fmt == "bshd":
        shape_q, shape_k = (b, sq, h, d), (b, sk, hk, d)
    else:
        shape_q, shape_k = (sq, b, h, d), (sk, b, hk, d)
    q = torch.randn(shape_q, device="cuda").to(dtype)
    k = torch.randn(shape_k, device="cuda").to(dtype)
    v = torch.randn(shape_k, device="cuda").to(dtype)
    dout = torch.randn(shape_q, device="cuda").to(dtype)
    return q, k, v, dout, lq, lk


def attention_kwargs(fmt, mask, lq, lk, window=None, device="cuda"):
    """The keyword arguments of ops.attention_forward / _backward for one case."""
    kw = dict(qkv_format=fmt, attn_mask_type=mask, window_size=window)
    if lq is not None:
        kw.update(cu_seqlens_q=cu_seqlens(lq, device), cu_seqlens_kv=cu_seqlens(lk, device))
        if fmt == "thd":
            kw.update(max_seqlen_q=max(lq), max_seqlen_kv=max(lk))
    return kw


def run_forward(q, k, v, fmt, mask, lq, lk, window=None):
    """ops.attention_forward into NaN-poisoned out and lse."""
    lse_shape = (q.shape[1], q.shape[0]) if fmt == "thd" else \
        ((q.shape[0], q.shape[2], q.shape[1]) if fmt == "bshd" else (q.shape[1], q.shape[2], q.shape[0]))
    return seqfuse.ops.attention_forward(q, k, v, out=poisoned(q.shape, q.dtype),
                                     lse=poisoned(lse_shape, torch.float32),
                                     **attention_kwargs(fmt, mask, lq, lk, window))


def run_ours(q, k, v, dout, fmt, mask, lq, lk, window=None, deterministic=False):
    kw = attention_kwargs(fmt, mask, lq, lk, window)
    out, lse = run_forward(q, k, v, fmt, mask, lq, lk, window)
    dq, dk, dv = seqfuse.ops.attention_backward(dout, q, k, v, out, lse, deterministic=deterministic,
                                           dq=poisoned(q.shape, q.dtype), dk=poisoned(k.shape, k.dtype),
                                           dv=poisoned(v.shape, v.dtype), **kw)
    return out, lse, (dq, dk, dv)


def run_reference(q, k, v, dout, fmt, mask, lq, lk, window=None):
    qr, kr, vr = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = reference(qr, kr, vr, qkv_format=fmt, attn_mask_type=mask, seqlens_q=lq, seqlens_kv=lk,
                    window_size=window)
    ref.backward(dout.double())
    return ref, (qr.grad, kr.grad, vr.grad)


def check(out, grads, ref, ref_grads, dtype, what):
    e = rel_error(out, ref)
    assert e <= rel_tol(dtype), f"{what}: out rel error {e:.2e}"
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        e = rel_error(g, r)
        assert e <= rel_tol(dtype, BACKWARD_FACTOR), f"{what}: {name} rel error {e:.2e}"


@pytest.mark.parametrize(
    "fmt,mask,d,h,hk,sq,sk",
    [(f, m, d, h, hk, sq, sk) for f, m, d, (h, hk), (sq, sk) in REFERENCE_CASES
     if f != "thd" or m in PADDING],  # thd always delimits sequences: the padding masks cover it
    ids=lambda x: str(x))
def test_cuda_matches_reference(fmt, mask, d, h, hk, sq, sk, seed):
    rng = random.Random(seed)
    dtype = torch.bfloat16
    q, k, v, dout, lq, lk = make_case(fmt, mask, 3, sq, sk, h, hk, d, dtype, rng)
    out, lse, grads = run_ours(q, k, v, dout, fmt, mask, lq, lk)
    ref, ref_grads = run_reference(q, k, v, dout, fmt, mask, lq, lk)
    check(out, grads, ref, ref_grads, dtype, f"{fmt} {mask} d={d} h={h}/{hk} {sq}x{sk} lq={lq} lk={lk}")
    assert not torch.isnan(lse).any()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("mask", ["no_mask", "causal", "padding_causal_bottom_right"])
@pytest.mark.parametrize("sq,sk", [(64, 64), (191, 333), (500, 129)])
def test_cuda_dtypes_and_longer(dtype, d, mask, sq, sk, seed):
    rng = random.Random(seed)
    q, k, v, dout, lq, lk = make_case("bshd", mask, 2, sq, sk, 4, 2, d, dtype, rng)
    out, lse, grads = run_ours(q, k, v, dout, "bshd", mask, lq, lk)
    ref, ref_grads = run_reference(q, k, v, dout, "bshd", mask, lq, lk)
    check(out, grads, ref, ref_grads, dtype, f"{dtype} {mask} d={d} {sq}x{sk}")


@pytest.mark.parametrize("window", [(0, 0), (16, 0), (100, 0), (33, 17), (-1, 5), (64, -1)])
@pytest.mark.parametrize("mask", ["no_mask", "causal", "padding_causal_bottom_right"])
@pytest.mark.parametrize("fmt", ["bshd", "thd"])
@pytest.mark.parametrize("d", DIMS)
def test_cuda_sliding_window(window, mask, fmt, d, seed):
    rng = random.Random(seed)
    if fmt == "thd" and mask not in PADDING:
        mask = "padding" if mask == "no_mask" else "padding_causal"
    q, k, v, dout, lq, lk = make_case(fmt, mask, 3, 300, 270, 4, 2, d, torch.bfloat16, rng)
    out, lse, grads = run_ours(q, k, v, dout, fmt, mask, lq, lk, window=window)
    ref, ref_grads = run_reference(q, k, v, dout, fmt, mask, lq, lk, window=window)
    check(out, grads, ref, ref_grads, torch.bfloat16, f"{fmt} {mask} window={window} d={d}")


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("mask", ["padding", "padding_causal_bottom_right"])
def test_cuda_matches_c_reference_and_lse(d, mask, seed):
    """Against the C CPU backend on the same inputs, lse included."""
    rng = random.Random(seed)
    q, k, v, dout, lq, lk = make_case("bshd", mask, 2, 70, 90, 2, 1, d, torch.bfloat16, rng)
    out, lse, grads = run_ours(q, k, v, dout, "bshd", mask, lq, lk)
    kw = dict(qkv_format="bshd", attn_mask_type=mask, cu_seqlens_q=cu_seqlens(lq), cu_seqlens_kv=cu_seqlens(lk))
    out_c, lse_c = seqfuse.ops.attention_forward(q.cpu(), k.cpu(), v.cpu(), **kw)
    grads_c = seqfuse.ops.attention_backward(dout.cpu(), q.cpu(), k.cpu(), v.cpu(), out_c, lse_c, **kw)
    assert rel_error(out, out_c) <= rel_tol(torch.bfloat16)
    finite = torch.isfinite(lse_c)
    assert torch.equal(finite, torch.isfinite(lse.cpu()))
    assert (lse.cpu()[finite] - lse_c[finite]).abs().max().item() < 2e-3
    for g, gc in zip(grads, grads_c):
        assert rel_error(g, gc) <= rel_tol(torch.bfloat16, BACKWARD_FACTOR)


@pytest.mark.parametrize("d", [24, 32, 64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("h,hk", [(8, 8), (8, 2)])
def test_cuda_vs_torch_sdpa(d, causal, h, hk, seed):
    """Our error against float64 is no worse than torch SDPA's (bf16)."""
    b, s = 2, 1000
    q, k, v = (torch.randn(b, s, n, d, device="cuda").to(torch.bfloat16) for n in (h, hk, hk))
    dout = torch.randn(b, s, h, d, device="cuda").to(torch.bfloat16)
    mask = "causal" if causal else "no_mask"
    out, _, grads = run_ours(q, k, v, dout, "bshd", mask, None, None)
    ref, ref_grads = run_reference(q, k, v, dout, "bshd", mask, None, None)
    qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
    o_t = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=hk != h)
    o_t.backward(dout.transpose(1, 2))
    torch_err = [rel_error(o_t.transpose(1, 2), ref)] + \
        [rel_error(g.transpose(1, 2), r) for g, r in zip((qt.grad, kt.grad, vt.grad), ref_grads)]
    ours = [rel_error(out, ref)] + [rel_error(g, r) for g, r in zip(grads, ref_grads)]
    for name, a, t in zip(("out", "dq", "dk", "dv"), ours, torch_err):
        # 1.5 times torch's error: tighter than the policy's TORCH_FACTOR, and it holds
        assert a <= torch_bound(t, factor=1.5, floor=4e-3), f"{name}: ours {a:.2e} vs torch {t:.2e}"


@pytest.mark.parametrize("mask", ["padding", "padding_causal", "padding_causal_bottom_right"])
@pytest.mark.parametrize("d", DIMS)
def test_cuda_thd_equals_bshd(mask, d, seed):
    """Packed and padded batches of the same sequences give the same outputs
    and (deterministic) gradients on the real tokens, bit for bit."""
    rng = random.Random(seed)
    b, s, h, hk = 5, 300, 4, 2
    lq = [rng.randint(1, s) for _ in range(b)]
    lk = lq if "bottom_right" not in mask else [rng.randint(1, s) for _ in range(b)]
    qp, kp, vp, dp = (torch.randn(b, s, n, d, device="cuda").to(torch.bfloat16) for n in (h, hk, hk, h))
    cq, ck = cu_seqlens(lq, "cuda"), cu_seqlens(lk, "cuda")
    kw = dict(attn_mask_type=mask, cu_seqlens_q=cq, cu_seqlens_kv=ck)
    out_p, lse_p = seqfuse.ops.attention_forward(qp, kp, vp, qkv_format="bshd", **kw)
    g_p = seqfuse.ops.attention_backward(dp, qp, kp, vp, out_p, lse_p, qkv_format="bshd", deterministic=True, **kw)
    qt, kt, vt, dt = pack(qp, lq), pack(kp, lk), pack(vp, lk), pack(dp, lq)
    kw_t = dict(kw, max_seqlen_q=max(lq), max_seqlen_kv=max(lk))
    out_t, lse_t = seqfuse.ops.attention_forward(qt, kt, vt, qkv_format="thd", **kw_t)
    g_t = seqfuse.ops.attention_backward(dt, qt, kt, vt, out_t, lse_t, qkv_format="thd", deterministic=True, **kw_t)
    assert torch.equal(unpack(out_t, lq, s), out_p)
    assert torch.equal(unpack(g_t[0], lq, s), g_p[0])
    assert torch.equal(unpack(g_t[1], lk, s), g_p[1])
    assert torch.equal(unpack(g_t[2], lk, s), g_p[2])
    # atomic-dQ path: equal up to the order of float additions
    g_a = seqfuse.ops.attention_backward(dt, qt, kt, vt, out_t, lse_t, qkv_format="thd", **kw_t)
    assert rel_error(g_a[0], g_t[0]) < 1e-2
    assert torch.equal(g_a[1], g_t[1]) and torch.equal(g_a[2], g_t[2])


def test_cuda_deterministic_backward_is_reproducible(seed):
    q, k, v, dout = (torch.randn(2, 700, 8, 128, device="cuda").to(torch.bfloat16) for _ in range(4))
    out, lse = seqfuse.ops.attention_forward(q, k, v, attn_mask_type="causal")
    runs = [seqfuse.ops.attention_backward(dout, q, k, v, out, lse, attn_mask_type="causal", deterministic=True)
            for _ in range(3)]
    for r in runs[1:]:
        for a, b in zip(runs[0], r):
            assert torch.equal(a, b)


def test_cuda_module_matches_cpu_module(seed):
    import seqfuse.pytorch as te  # (not imported by `import seqfuse`; a lone xdist worker has no other import)

    attn = te.DotProductAttention(8, 64, num_gqa_groups=2, qkv_format="sbhd", attn_mask_type="causal")
    q = torch.randn(130, 2, 8, 64).to(torch.bfloat16)
    k, v = (torch.randn(130, 2, 2, 64).to(torch.bfloat16) for _ in range(2))
    out_cpu = attn(q, k, v)
    qc, kc, vc = (x.cuda().requires_grad_() for x in (q, k, v))
    out = attn(qc, kc, vc)
    assert out.shape == (130, 2, 512)
    assert rel_error(out, out_cpu) <= rel_tol(torch.bfloat16)
    out.float().sum().backward()
    assert qc.grad.shape == qc.shape and not torch.isnan(kc.grad).any()


def test_cuda_runs_on_current_stream_and_in_graph(seed):
    q, k, v, dout = (torch.randn(2, 256, 4, 64, device="cuda").to(torch.bfloat16) for _ in range(4))
    ref_out, ref_lse = seqfuse.ops.attention_forward(q, k, v, attn_mask_type="causal")
    ref_g = seqfuse.ops.attention_backward(dout, q, k, v, ref_out, ref_lse, attn_mask_type="causal", deterministic=True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out, lse = seqfuse.ops.attention_forward(q, k, v, attn_mask_type="causal")
        g = seqfuse.ops.attention_backward(dout, q, k, v, out, lse, attn_mask_type="causal", deterministic=True)
        seqfuse.ops.attention_backward(dout, q, k, v, out, lse, attn_mask_type="causal")  # warm-up before capture
    torch.cuda.current_stream().wait_stream(s)
    assert torch.equal(out, ref_out) and all(torch.equal(a, b) for a, b in zip(g, ref_g))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_g, lse_g = seqfuse.ops.attention_forward(q, k, v, attn_mask_type="causal")
        g_g = seqfuse.ops.attention_backward(dout, q, k, v, out_g, lse_g, attn_mask_type="causal")
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    new_out, new_lse = seqfuse.ops.attention_forward(q, k, v, attn_mask_type="causal")
    assert torch.equal(out_g, new_out)
    # the replayed backward too (dQ by atomics: equal within the backward's tolerance, not bitwise)
    new_g = seqfuse.ops.attention_backward(dout, q, k, v, new_out, new_lse, attn_mask_type="causal")
    for name, a, b in zip(("dq", "dk", "dv"), g_g, new_g):
        assert rel_error(a, b) <= rel_tol(q.dtype, BACKWARD_FACTOR), name


def test_cuda_bad_inputs():
    q = torch.randn(1, 8, 2, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="takes float16 or bfloat16 inputs, got float32"):
        seqfuse.ops.attention(q.float(), q.float(), q.float())
    for bad in (40, 96, 8):
        x = q[..., :bad].contiguous() if bad < 64 else torch.randn(1, 8, 2, bad, device="cuda", dtype=torch.bfloat16)
        with pytest.raises(NotImplementedError, match=f"supports head dims 16, 24, 32, 64 and 128, got {bad}"):
            seqfuse.ops.attention(x, x, x)
    big = torch.randn(1, 8, 2, 65, device="cuda", dtype=torch.bfloat16)[..., :64]
    cfg = (0, 0, -1, -1, 0.125, 8, 8, 0, 0.0, 0, 0)
    lse = torch.empty(1, 2, 8, device="cuda")
    with pytest.raises(ValueError, match="argument 'q' must have strides that are multiples of 8 elements"):
        seqfuse._C.attn_forward(big, q, q, None, None, torch.empty_like(q), lse, cfg)
    with pytest.raises(ValueError, match="argument 'k' must start at a 16-byte aligned address"):
        shifted = torch.randn(2049, device="cuda", dtype=torch.bfloat16)[1:].view(1, 8, 4, 64)[:, :, :2]
        seqfuse._C.attn_forward(q, shifted, q, None, None, torch.empty_like(q), lse, cfg)
    # the op copies such views once instead of failing
    out = seqfuse.ops.attention(big, big, big)
    assert torch.equal(out, seqfuse.ops.attention(big.contiguous(), big.contiguous(), big.contiguous()))
    with pytest.raises(ValueError, match="must be on the same device"):
        seqfuse.ops.attention(q[0], q[0], q[0], qkv_format="thd", cu_seqlens_q=cu_seqlens([8]),
                              cu_seqlens_kv=cu_seqlens([8]), max_seqlen_q=8, max_seqlen_kv=8)


@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "thd"])
@pytest.mark.parametrize("d", [24, 64])
def test_cuda_strided_qkv_views(fmt, d, seed):
    """q, k, v as views into one fused QKV projection output (no copy): the
    same numbers as contiguous inputs, bit for bit (head dim 24: ESM-2 35M's
    fused QKV, rows of 48 bytes)."""
    h = 4
    shape = {"bshd": (2, 150, 3, h, d), "sbhd": (150, 2, 3, h, d), "thd": (300, 3, h, d)}[fmt]
    qkv = torch.randn(shape, device="cuda").to(torch.bfloat16)
    q, k, v = qkv.unbind(-3)
    kw = dict(qkv_format=fmt, attn_mask_type="padding_causal" if fmt == "thd" else "causal")
    if fmt == "thd":
        cu = cu_seqlens([100, 130, 70], "cuda")
        kw.update(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=130, max_seqlen_kv=130)
    dout = torch.randn(q.shape, device="cuda").to(torch.bfloat16)
    out, lse = seqfuse.ops.attention_forward(q, k, v, **kw)
    out_c, lse_c = seqfuse.ops.attention_forward(q.contiguous(), k.contiguous(), v.contiguous(), **kw)
    assert torch.equal(out, out_c) and torch.equal(lse, lse_c)
    g = seqfuse.ops.attention_backward(dout, q, k, v, out, lse, deterministic=True, **kw)
    g_c = seqfuse.ops.attention_backward(dout, q.contiguous(), k.contiguous(), v.contiguous(), out_c, lse_c,
                                    deterministic=True, **kw)
    assert all(torch.equal(a, b) for a, b in zip(g, g_c))


@pytest.mark.parametrize("fmt", ["bshd", "thd"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_cuda_head_dim_24_stays_in_its_columns(fmt, deterministic, seed):
    """Head dim 24 runs as a 32-wide tile: q, k, v, dout given as views
    [..., :24] of 32-wide buffers whose last 8 columns are NaN (a load past
    column 24 would spread NaN everywhere), out, dq, dk, dv as views of
    32-wide buffers whose last 8 columns hold a sentinel (a store past column
    24 would change it).  The numbers equal those of contiguous inputs, bit
    for bit, and the scale is the user's (default 1/sqrt(24))."""
    rng = random.Random(seed)
    mask = "padding_causal" if fmt == "thd" else "causal"
    q0, k0, v0, dout0, lq, lk = make_case(fmt, mask, 3, 150, 150, 4, 2, 24, torch.bfloat16, rng)

    def wide(x, fill):
        buf = torch.full(x.shape[:-1] + (32,), fill, dtype=x.dtype, device="cuda")
        buf[..., :24] = x
        return buf

    q, k, v, dout = (wide(x, float("nan"))[..., :24] for x in (q0, k0, v0, dout0))
    outs = {n: wide(torch.zeros_like(x), 7.0) for n, x in (("out", q0), ("dq", q0), ("dk", k0), ("dv", v0))}
    kw = dict(qkv_format=fmt, attn_mask_type=mask)
    if fmt == "thd":
        kw.update(cu_seqlens_q=cu_seqlens(lq, "cuda"), cu_seqlens_kv=cu_seqlens(lk, "cuda"),
                  max_seqlen_q=max(lq), max_seqlen_kv=max(lk))
    out, lse = seqfuse.ops.attention_forward(q, k, v, out=outs["out"][..., :24], **kw)
    grads = seqfuse.ops.attention_backward(dout, q, k, v, out, lse, deterministic=deterministic,
                                      dq=outs["dq"][..., :24], dk=outs["dk"][..., :24],
                                      dv=outs["dv"][..., :24], **kw)
    assert out.data_ptr() == outs["out"].data_ptr()  # written in place, not copied
    for name, buf in outs.items():
        assert torch.all(buf[..., 24:] == 7.0), f"{name}: columns 24..31 were written"
    out_c, lse_c = seqfuse.ops.attention_forward(q0, k0, v0, **kw)
    g_c = seqfuse.ops.attention_backward(dout0, q0, k0, v0, out_c, lse_c, deterministic=True, **kw)
    assert torch.equal(out, out_c) and torch.equal(lse, lse_c)
    if deterministic:
        assert all(torch.equal(a, b) for a, b in zip(grads, g_c))
    ref, ref_grads = run_reference(q0, k0, v0, dout0, fmt, mask, lq, lk)
    check(out, grads, ref, ref_grads, torch.bfloat16, f"{fmt} d=24 views")
    # a scale of 1/sqrt(32) (the tile's width) would be a different function
    out_32, _ = seqfuse.ops.attention_forward(q0, k0, v0, softmax_scale=32 ** -0.5, **kw)
    assert rel_error(out_32, ref) > 2 * rel_tol(torch.bfloat16)


# ---- attention dropout ---------------------------------------------------------------------------
# The CUDA kernels regenerate the Philox mask of csrc/attn/attn_philox.h; the CPU backend and the numpy
# reimplementation (tests/attn_philox.py) draw the same one, so outputs and gradients are compared
# directly, for fixed (seed, offset).

from attn_philox import keep_mask  # noqa: E402


DROPOUT_CASES = (
    [("bshd", "no_mask", d, 4, 2, 77, 150, torch.bfloat16) for d in DIMS] +
    [("sbhd", "causal", d, 6, 1, 200, 65, torch.float16) for d in (24, 64, 128)] +
    [("bshd", "padding_causal", 64, 4, 4, 128, 128, torch.float16),
     ("bshd", "causal_bottom_right", 128, 4, 2, 64, 190, torch.bfloat16),
     ("thd", "padding", 64, 4, 2, 150, 150, torch.bfloat16),
     ("thd", "padding_causal", 128, 2, 2, 130, 130, torch.float16),
     ("thd", "padding_causal", 32, 4, 1, 100, 100, torch.bfloat16)])


def run_ours_dropout(q, k, v, dout, fmt, mask, lq, lk, p, rng_state, deterministic=False):
    dev = q.device  # the CUDA kernels, or the CPU backend on CPU copies of the case
    kw = attention_kwargs(fmt, mask, lq, lk, device=dev)
    lse_shape = (q.shape[1], q.shape[0]) if fmt == "thd" else \
        ((q.shape[0], q.shape[2], q.shape[1]) if fmt == "bshd" else (q.shape[1], q.shape[2], q.shape[0]))
    out, lse = seqfuse.ops.attention_forward(q, k, v, out=poisoned(q.shape, q.dtype, dev),
                                         lse=poisoned(lse_shape, torch.float32, dev),
                                         dropout_p=p, rng_state=rng_state, **kw)
    grads = seqfuse.ops.attention_backward(dout, q, k, v, out, lse, deterministic=deterministic, dropout_p=p,
                                      rng_state=rng_state, dq=poisoned(q.shape, q.dtype, dev),
                                      dk=poisoned(k.shape, k.dtype, dev), dv=poisoned(v.shape, v.dtype, dev), **kw)
    return out, lse, grads


@pytest.mark.parametrize("fmt,mask,d,h,hk,sq,sk,dtype", DROPOUT_CASES, ids=lambda x: str(x))
@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("deterministic", [False, True])
def test_cuda_dropout_matches_cpu_backend_and_reference(fmt, mask, d, h, hk, sq, sk, dtype, p, deterministic, seed):
    """Same (seed, offset): the CUDA forward and backward equal the CPU
    backend's (the same mask) and the float64 reference with the numpy mask,
    within the dtype's tolerances; lse is the undropped one."""
    rng = random.Random(seed)
    q, k, v, dout, lq, lk = make_case(fmt, mask, 3, sq, sk, h, hk, d, dtype, rng)
    rng_state = (rng.getrandbits(64), 4 * rng.randint(0, 1000))
    out, lse, grads = run_ours_dropout(q, k, v, dout, fmt, mask, lq, lk, p, rng_state, deterministic)
    what = f"{fmt} {mask} d={d} h={h}/{hk} {sq}x{sk} p={p} det={deterministic}"
    cpu = [x.cpu() for x in (q, k, v, dout)]
    cpu_out, cpu_lse, cpu_grads = run_ours_dropout(*cpu, fmt, mask, lq, lk, p, rng_state)
    check(out, grads, cpu_out, cpu_grads, dtype, what + " vs CPU backend")
    ref_kw = dict(qkv_format=fmt, attn_mask_type=mask, seqlens_q=lq, seqlens_kv=lk, dropout=(p, *rng_state))
    qr, kr, vr = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = reference(qr, kr, vr, **ref_kw)
    ref.backward(dout.double())
    check(out, grads, ref, (qr.grad, kr.grad, vr.grad), dtype, what + " vs float64 reference")
    _, lse_plain = run_forward(q, k, v, fmt, mask, lq, lk)
    # dropout leaves the log-sum-exp alone: to 1e-6 against the same (sm80) kernel without dropout;
    # where the plain call takes the wgmma forward (Hopper), test_attn_sm90_cuda's bound between the two
    same_kernel = seqfuse.ops.attention_forward_kernel(d, q.device)[0] == 80
    torch.testing.assert_close(lse, lse_plain, rtol=0, atol=1e-6 if same_kernel else 2e-3)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("p", [0.1, 0.3, 0.5])
def test_cuda_dropout_mask_elementwise(d, p):
    """V = identity over the keys (sk = head dim): the CUDA forward returns
    dropout(P) itself, so every keep decision is compared with the numpy
    Philox mask and every kept value with P / (1 - p)."""
    torch.manual_seed(d)
    b, sq, h, hk = 2, 200, 4, 2
    sk = d
    q = torch.randn(b, sq, h, d, device="cuda").half()
    k = torch.randn(b, sk, hk, d, device="cuda").half()
    v = torch.eye(sk, device="cuda").half().expand(b, hk, sk, sk).permute(0, 2, 1, 3).contiguous()
    rng_state = (0xDEADBEEF12345678, 4 * 37)
    out, _ = seqfuse.ops.attention_forward(q, k, v, dropout_p=p, rng_state=rng_state)
    plain, _ = seqfuse.ops.attention_forward(q, k, v)
    out, plain = out.float().cpu(), plain.float().cpu()
    for i in range(b):
        keep = keep_mask(*rng_state, i, h, sq, sk, p).permute(1, 0, 2)  # [sq, h, sk]
        assert torch.equal(out[i] != 0, keep), f"batch {i}: keep pattern differs"
        want = torch.where(keep, plain[i] / (1 - p), torch.zeros(()))
        assert rel_error(out[i], want) < 2e-3


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5])
def test_cuda_dropout_keep_rate(p):
    """q = 0 makes P uniform (1/sk) and v = ones makes out_r = kept_r / (sk (1-p)):
    over 4*8*1024 rows x 1024 keys (33.5M decisions) the kept fraction is
    within 1e-3 of 1 - p (5 standard deviations are < 5e-4 at p = 0.5)."""
    b, s, h, d = 4, 1024, 8, 64
    q = torch.zeros(b, s, h, d, device="cuda", dtype=torch.float16)
    k = torch.randn(b, s, h, d, device="cuda", dtype=torch.float16)
    v = torch.ones(b, s, h, d, device="cuda", dtype=torch.float16)
    out, _ = seqfuse.ops.attention_forward(q, k, v, dropout_p=p, rng_state=(2024, 0))
    kept = out[..., 0].double().mean().item() * (1 - p)
    assert abs(kept - (1 - p)) < 1e-3, (kept, 1 - p)


def test_cuda_dropout_determinism_and_generator():
    """Same (seed, offset): bitwise the same outputs and deterministic-mode
    gradients; another offset: another mask; without rng_state the pair comes
    from the CUDA generator, whose offset advances by batch * heads rounded up
    to 4, and torch.manual_seed repeats the draws."""
    rng = random.Random(0)
    q, k, v, dout, lq, lk = make_case("bshd", "causal", 2, 150, 150, 6, 2, 64, torch.bfloat16, rng)
    a = run_ours_dropout(q, k, v, dout, "bshd", "causal", lq, lk, 0.2, (7, 0), deterministic=True)
    b_ = run_ours_dropout(q, k, v, dout, "bshd", "causal", lq, lk, 0.2, (7, 0), deterministic=True)
    assert torch.equal(a[0], b_[0])
    for x, y in zip(a[2], b_[2]):
        assert torch.equal(x, y)
    c = run_ours_dropout(q, k, v, dout, "bshd", "causal", lq, lk, 0.2, (7, 12))
    assert not torch.equal(a[0], c[0])
    gen = torch.cuda.default_generators[torch.cuda.current_device()]
    torch.manual_seed(11)
    start = gen.get_offset()
    x = seqfuse.ops.attention(q, k, v, attn_mask_type="causal", dropout_p=0.2)
    assert gen.get_offset() == start + 12  # 2 sequences x 6 heads
    y = seqfuse.ops.attention(q, k, v, attn_mask_type="causal", dropout_p=0.2)
    assert not torch.equal(x, y)
    torch.manual_seed(11)
    assert torch.equal(x, seqfuse.ops.attention(q, k, v, attn_mask_type="causal", dropout_p=0.2))
    assert torch.equal(x, seqfuse.ops.attention_forward(q, k, v, attn_mask_type="causal", dropout_p=0.2,
                                                    rng_state=(gen.initial_seed(), start))[0])


def test_cuda_dropout_module_training_and_eval():
    """DotProductAttention with TE's default attention_dropout=0.1: training
    drops (and trains), eval does not; thd too."""
    torch.manual_seed(0)
    lengths = [100, 37, 256]
    h, d = 4, 64
    cu = cu_seqlens(lengths, "cuda")
    import seqfuse.pytorch as te

    attn = te.DotProductAttention(h, d, attention_dropout=0.1, qkv_format="thd",
                                               attn_mask_type="padding_causal")
    q, k, v = (torch.randn(sum(lengths), h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    kw = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=256, max_seqlen_kv=256)
    out = attn(q, k, v, **kw)
    out.float().square().sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))
    attn.eval()
    plain = seqfuse.ops.attention(q, k, v, qkv_format="thd", attn_mask_type="padding_causal", **kw)
    assert torch.equal(attn(q, k, v, **kw), plain.reshape(out.shape))
    assert not torch.equal(out, plain.reshape(out.shape))


def test_cuda_dropout_forward_kernel_choice_logged(monkeypatch, caplog):
    """On Hopper a dropout forward runs the sm80 kernel (the wgmma kernel has
    no dropout): the kernel query says so with a reason naming dropout, and
    the first such forward logs it (logger "seqfuse")."""
    from seqfuse.ops.attn import _routing as routing

    arch, why = seqfuse.ops.attention_forward_kernel(64, dropout=True)
    assert arch == 80
    if torch.cuda.get_device_capability() != (9, 0) or why.startswith("sm80 kernel chosen"):
        return
    assert "dropout" in why
    monkeypatch.setattr(routing, "_forward_kernel_checked", set())
    monkeypatch.setattr(routing, "_forward_reasons_logged", set())
    monkeypatch.setattr(routing, "_backend", "seqfuse")  # auto would send this call to a torch route
    q = torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="seqfuse"):
        seqfuse.ops.attention(q, q, q, dropout_p=0.1)
        seqfuse.ops.attention(q, q, q, dropout_p=0.1)
    hits = [r for r in caplog.records if "dropout" in r.getMessage()]
    assert len(hits) == 1, [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("p", [-0.5, 1.0, float("nan")])
def test_cuda_dropout_bad_probability(p):
    q = torch.randn(1, 8, 2, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\)"):
        seqfuse.ops.attention(q, q, q, dropout_p=p)
