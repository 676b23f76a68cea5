"""LayerNorm / RMSNorm kernels (seqfuse.ops.norm) against float64 torch
references on the CPU, and the CUDA kernels against the CPU backend and torch
with poisoned outputs (cuda marker)."""
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import seqfuse
from seqfuse import _C
from seqfuse.ops import norm as norm_ops

from helpers import assert_close_rel, fp8_steps, needs_fp8, poisoned_like

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CPU_SHAPES = [(1, 8), (7, 37), (3, 5, 64), (16, 1280), (2, 4096)]


def make_inputs(shape, dtype, device, w_dtype=None, zc=False, bias=True):
    hidden = shape[-1]
    w_dtype = w_dtype or dtype
    x = (torch.randn(shape, device=device) * 2 + 0.5).to(dtype)
    w = (torch.randn(hidden, device=device) * (0.1 if zc else 1.0) + (0.0 if zc else 1.0)).to(w_dtype)
    b = (torch.randn(hidden, device=device) * 0.5).to(w_dtype) if bias else None
    dy = torch.randn(shape, device=device).to(dtype)
    return x, w, b, dy


def reference(rms, x, w, b, dy, eps, zc):
    """float64 torch: y, mean, rstd and the gradients of sum(y * dy)."""
    xd = x.double().cpu().requires_grad_()
    wd = w.double().cpu().requires_grad_()
    bd = b.double().cpu().requires_grad_() if b is not None else None
    weff = 1 + wd if zc else wd
    if rms:
        mean = torch.zeros(xd.shape[:-1], dtype=torch.float64)
        var = (xd * xd).mean(-1)
    else:
        mean = xd.mean(-1)
        var = ((xd - mean[..., None]) ** 2).mean(-1)
    rstd = 1 / torch.sqrt(var + eps)
    y = (xd - mean[..., None]) * rstd[..., None] * weff
    if bd is not None:
        y = y + bd
    y.backward(dy.double().cpu())
    return (y.detach(), mean.detach().flatten(), rstd.detach().flatten(), xd.grad, wd.grad,
            bd.grad if bd is not None else None)


def run_ops(rms, x, w, b, dy, eps, zc):
    if rms:
        y, rstd = norm_ops.rmsnorm_forward(x, w, eps, zc)
        dx, dg = norm_ops.rmsnorm_backward(dy, x, rstd, w, zc)
        return y, None, rstd, dx, dg, None
    y, mean, rstd = norm_ops.layernorm_forward(x, w, b, eps, zc)
    dx, dg, db = norm_ops.layernorm_backward(dy, x, mean, rstd, w, zc, b is not None)
    return y, mean, rstd, dx, dg, db


def check_against_reference(got, ref, dtype, rms, grad_factor=1.0):
    y, mean, rstd, dx, dg, db = got
    ry, rmean, rrstd, rdx, rdg, rdb = ref
    assert_close_rel(y, ry, dtype)
    assert_close_rel(rstd, rrstd, torch.float32, factor=10)
    if not rms:
        assert_close_rel(mean, rmean, torch.float32, factor=10)
    assert_close_rel(dx, rdx, dtype, factor=grad_factor)
    assert_close_rel(dg, rdg, dg.dtype if dg.dtype != torch.float32 else dtype, factor=grad_factor)
    if db is not None:
        assert_close_rel(db, rdb, db.dtype if db.dtype != torch.float32 else dtype, factor=grad_factor)


@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", CPU_SHAPES)
@pytest.mark.parametrize("zc", [False, True], ids=["gamma", "zc_gamma"])
def test_norm_cpu_matches_float64(rms, dtype, shape, zc, seed):
    x, w, b, dy = make_inputs(shape, dtype, "cpu", zc=zc, bias=not rms)
    eps = 1e-5
    got = run_ops(rms, x, w, b, dy, eps, zc)
    check_against_reference(got, reference(rms, x, w, b, dy, eps, zc), dtype, rms)


@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_norm_cpu_float32_weight(rms, dtype, seed):
    x, w, b, dy = make_inputs((9, 96), dtype, "cpu", w_dtype=torch.float32, bias=not rms)
    got = run_ops(rms, x, w, b, dy, 1e-6, False)
    assert got[4].dtype == torch.float32
    check_against_reference(got, reference(rms, x, w, b, dy, 1e-6, False), dtype, rms)


def test_layernorm_cpu_without_bias(seed):
    x, w, _, dy = make_inputs((5, 48), torch.float32, "cpu", bias=False)
    got = run_ops(False, x, w, None, dy, 1e-5, False)
    assert got[5] is None
    check_against_reference(got, reference(False, x, w, None, dy, 1e-5, False), torch.float32, False)


def test_norm_cpu_large_eps_and_constant_rows():
    x = torch.full((4, 32), 3.0)
    w = torch.ones(32)
    y, mean, rstd = norm_ops.layernorm_forward(x, w, torch.zeros(32), eps=0.25)
    assert torch.equal(y, torch.zeros_like(y))
    assert torch.allclose(mean, torch.full((4,), 3.0)) and torch.allclose(rstd, torch.full((4,), 2.0))


def test_norm_cpu_empty_rows():
    x = torch.empty(0, 64)
    w = torch.ones(64)
    y, mean, rstd = norm_ops.layernorm_forward(x, w, torch.zeros(64))
    assert y.shape == (0, 64)
    dx, dg, db = norm_ops.layernorm_backward(torch.empty(0, 64), x, mean, rstd, w)
    assert torch.equal(dg, torch.zeros(64)) and torch.equal(db, torch.zeros(64))


@needs_fp8
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_norm_cpu_fp8_output(rms, fmt, seed):
    x, w, b, _ = make_inputs((12, 160), torch.float32, "cpu", bias=not rms)
    scale = torch.tensor([37.5])
    amax = torch.zeros(1)
    scale_inv = torch.zeros(1)
    if rms:
        y_hp, _ = norm_ops.rmsnorm_forward(x, w, 1e-5)
        y8, _ = norm_ops.rmsnorm_forward(x, w, 1e-5, out_dtype=fmt, scale=scale, amax=amax, scale_inv=scale_inv)
    else:
        y_hp, _, _ = norm_ops.layernorm_forward(x, w, b, 1e-5)
        y8, _, _ = norm_ops.layernorm_forward(x, w, b, 1e-5, out_dtype=fmt, scale=scale, amax=amax,
                                   scale_inv=scale_inv)
    assert y8.dtype == fmt
    fmax = torch.finfo(fmt).max
    # torch's own rounding (RNE) of the same float32 values, saturated first
    expected = (y_hp * scale).clamp(-fmax, fmax).to(fmt)
    assert torch.equal(y8.view(torch.uint8), expected.view(torch.uint8))
    assert amax.item() == y_hp.abs().max().item()
    assert scale_inv.item() == pytest.approx(1 / 37.5, rel=1e-7)


@needs_fp8
def test_norm_cpu_fp8_saturates():
    x = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    y, _, _ = norm_ops.layernorm_forward(x, torch.ones(4), torch.zeros(4), 0.0,
                              out_dtype=torch.float8_e4m3fn, scale=torch.tensor([1e6]))
    assert y.float().abs().max().item() == 448.0


# ---- errors ------------------------------------------------------------------

def test_norm_error_int_input():
    with pytest.raises(TypeError, match="layernorm_forward: argument 'x' must have dtype float32, float16 or bfloat16"):
        norm_ops.layernorm_forward(torch.ones(2, 4, dtype=torch.int32), torch.ones(4))


def test_norm_error_gamma_numel():
    with pytest.raises(ValueError, match="layernorm_forward: argument 'gamma' must have 8 element\\(s\\), got 7"):
        norm_ops.layernorm_forward(torch.ones(2, 8), torch.ones(7), torch.zeros(8))


def test_norm_error_gamma_dtype():
    with pytest.raises(TypeError, match="rmsnorm_forward: argument 'gamma' must have dtype bfloat16 \\(the input's\\) or float32, got float16"):
        norm_ops.rmsnorm_forward(torch.ones(2, 8, dtype=torch.bfloat16), torch.ones(8, dtype=torch.float16))


def test_norm_error_beta_dtype():
    with pytest.raises(TypeError, match="argument 'beta' must have gamma's dtype float32, got bfloat16"):
        norm_ops.layernorm_forward(torch.ones(2, 8, dtype=torch.bfloat16), torch.ones(8),
                        torch.zeros(8, dtype=torch.bfloat16))


def test_norm_error_hidden_too_large():
    with pytest.raises(ValueError, match="hidden size \\(last dimension\\) 16385; it must be between 1 and 16384"):
        norm_ops.rmsnorm_forward(torch.ones(1, 16385), torch.ones(16385))


def test_norm_error_bad_eps():
    with pytest.raises(ValueError, match="argument 'eps' must be finite and >= 0"):
        norm_ops.layernorm_forward(torch.ones(2, 8), torch.ones(8), None, eps=-1.0)


@needs_fp8
def test_norm_error_fp8_without_scale():
    with pytest.raises(ValueError, match="argument 'scale' is required when 'y' is float8_e4m3fn"):
        norm_ops.layernorm_forward(torch.ones(2, 8), torch.ones(8), None, out_dtype=torch.float8_e4m3fn)


def test_norm_error_scale_without_fp8():
    with pytest.raises(ValueError, match="apply only to an FP8 'y'"):
        norm_ops.rmsnorm_forward(torch.ones(2, 8), torch.ones(8), scale=torch.ones(1))


def test_norm_error_bad_out_dtype():
    with pytest.raises(TypeError, match="argument 'out_dtype'"):
        norm_ops.rmsnorm_forward(torch.ones(2, 8), torch.ones(8), out_dtype=torch.float16)


def test_norm_error_from_c_y_shape():
    x = torch.ones(2, 8)
    with pytest.raises(ValueError, match="layernorm_forward: arguments 'x' and 'y' must have the same shape"):
        _C.layernorm_forward(x, torch.ones(8), None, 1e-5, False, torch.empty(2, 9), None, None,
                         None, None, None)


def test_norm_error_from_c_rstd_size():
    x = torch.ones(3, 8)
    with pytest.raises(ValueError, match="rmsnorm_forward: argument 'rstd' must have 3 element\\(s\\), got 2"):
        _C.rmsnorm_forward(x, torch.ones(8), 1e-5, False, torch.empty(3, 8), torch.empty(2), None,
                       None, None)


def test_norm_error_from_c_dy_dtype():
    x = torch.ones(3, 8)
    with pytest.raises(TypeError, match="layernorm_backward: argument 'dy' must have dtype float32, got bfloat16"):
        _C.layernorm_backward(x.bfloat16(), x, torch.zeros(3), torch.ones(3), torch.ones(8), False,
                         torch.empty(3, 8), torch.empty(8), None, None)


def test_norm_error_from_c_eps_type():
    with pytest.raises(TypeError, match="rmsnorm_forward: argument 'eps' must be a float"):
        _C.rmsnorm_forward(torch.ones(1, 8), torch.ones(8), "x", False, torch.empty(1, 8), None,
                       None, None, None)


def test_norm_error_non_contiguous_from_c():
    x = torch.ones(8, 4).t()
    with pytest.raises(ValueError, match="argument 'x' must be contiguous"):
        _C.rmsnorm_forward(x, torch.ones(8), 1e-5, False, torch.empty(4, 8), None, None, None, None)


def test_norm_op_makes_input_contiguous(seed):
    x = torch.randn(16, 8).t()
    y, _ = norm_ops.rmsnorm_forward(x, torch.ones(16))
    ref = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-5)
    assert_close_rel(y, ref, torch.float32)


# ---- CUDA --------------------------------------------------------------------

# Every launch shape of norm_cuda.cu's pick_config: a warp per row (8..512),
# several warps per row with idle slots (320, 480, 640, 1000), exact splits
# (1280, 2560, 4096, 5120, 8192), the register-heavy long rows (16384), the
# element-wide path (37, 1001, 16383: rows not a multiple of 16 bytes), and
# row counts that leave persistent blocks with unequal shares (20000 x 256).
CUDA_SHAPES = [(1, 8), (3, 37), (5, 7, 64), (300, 320), (129, 480), (2000, 640), (77, 1000),
               (9, 1001), (64, 1280), (65, 2560), (1000, 4096), (4096, 1024), (40, 5120),
               (257, 8192), (33, 16384), (5, 16383), (20000, 256)]


def run_c_poisoned(rms, x, w, b, dy, eps, zc, out_dtype=None, scale=None):
    """Call _C directly with NaN/0xFF-poisoned outputs and workspace."""
    rows = x.numel() // x.shape[-1]
    y = poisoned_like(torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device))
    mean = poisoned_like(torch.empty(rows, device=x.device))
    rstd = poisoned_like(torch.empty(rows, device=x.device))
    amax = torch.zeros(1, device=x.device)  # accumulates: starts at 0
    dx = poisoned_like(x)
    dg = poisoned_like(w)
    db = poisoned_like(w) if b is not None else None
    n = _C.norm_backward_workspace_numel(x)
    ws = poisoned_like(torch.empty(n, device=x.device)) if n else None
    if rms:
        _C.rmsnorm_forward(x, w, eps, zc, y, rstd, scale, amax, None)
        _C.rmsnorm_backward(dy, x, rstd, w, zc, dx, dg, ws)
        mean = None
    else:
        _C.layernorm_forward(x, w, b, eps, zc, y, mean, rstd, scale, amax, None)
        _C.layernorm_backward(dy, x, mean, rstd, w, zc, dx, dg, db, ws)
    return (y, mean, rstd, dx, dg, db), amax


@pytest.mark.cuda
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", CUDA_SHAPES)
@pytest.mark.parametrize("w32", [False, True], ids=["w_same", "w_fp32"])
def test_norm_cuda_matches_cpu_and_float64(rms, dtype, shape, w32, seed):
    zc = shape[0] % 2 == 1
    x, w, b, dy = make_inputs(shape, dtype, "cuda", w_dtype=torch.float32 if w32 else None, zc=zc,
                              bias=not rms)
    eps = 1e-5
    got, amax = run_c_poisoned(rms, x, w, b, dy, eps, zc)
    ref = reference(rms, x, w, b, dy, eps, zc)
    # gradients of long rows carry float32 sums of many terms: a looser bound
    check_against_reference(got, ref, dtype, rms, grad_factor=2.0)
    cpu = run_ops(rms, x.cpu(), w.cpu(), None if b is None else b.cpu(), dy.cpu(), eps, zc)
    check_against_reference(got, [None if t is None else t.double() for t in cpu], dtype, rms,
                            grad_factor=2.0)
    # amax is max |v| of the float32 values before rounding to y's dtype
    # (seqfuse_norm.h): float32 rounding of the float64 reference's max, not
    # the 2^-9-coarse max of a 16-bit y
    if dtype == torch.float32:
        assert amax.item() == got[0].abs().max().item()
    assert amax.item() == pytest.approx(ref[0].abs().max().item(), rel=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_norm_cuda_backward_deterministic(rms, seed):
    x, w, b, dy = make_inputs((8192, 2048), torch.bfloat16, "cuda", w_dtype=torch.float32, bias=not rms)
    first = run_ops(rms, x, w, b, dy, 1e-5, False)
    for _ in range(3):
        again = run_ops(rms, x, w, b, dy, 1e-5, False)
        for a, c in zip(first, again):
            if a is not None:
                assert torch.equal(a, c)


@pytest.mark.cuda
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 40), (512, 4096), (17, 1000)])
def test_norm_cuda_fp8_output(rms, fmt, dtype, shape, seed):
    x, w, b, dy = make_inputs(shape, dtype, "cuda", bias=not rms)
    scale = torch.tensor([3.7], device="cuda")
    (y8, *_), amax = run_c_poisoned(rms, x, w, b, dy, 1e-5, False, out_dtype=fmt, scale=scale)
    (y_hp, *_), _ = run_c_poisoned(rms, x.float(), w.float(), None if b is None else b.float(),
                                   dy.float(), 1e-5, False)
    fmax = torch.finfo(fmt).max
    expected = (y_hp * scale).clamp(-fmax, fmax).to(fmt)
    # the float32 value before rounding differs by an ulp or so between the
    # dtype-specialized kernels: codes may differ by one step, rarely
    diff = fp8_steps(y8, expected)
    assert diff.max().item() <= 1
    assert (diff > 0).float().mean().item() < 0.02
    assert amax.item() == pytest.approx(y_hp.abs().max().item(), rel=1e-5)
    cpu8, _, _ = (norm_ops.rmsnorm_forward(x.cpu(), w.cpu(), 1e-5, out_dtype=fmt, scale=scale.cpu()) + (None,)
                  if rms else norm_ops.layernorm_forward(x.cpu(), w.cpu(), b.cpu(), 1e-5, out_dtype=fmt,
                                              scale=scale.cpu()))
    diff = fp8_steps(y8.cpu(), cpu8)
    assert diff.max().item() <= 1 and (diff > 0).float().mean().item() < 0.02


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_cuda_unaligned_rows(dtype, seed):
    # an offset view: contiguous but not 16-byte aligned -> the element-wide kernels
    base = torch.randn(65 * 128 + 1, device="cuda").to(dtype)
    x = base[1:].view(65, 128)
    w = torch.randn(128, device="cuda").to(dtype)
    b = torch.randn(128, device="cuda").to(dtype)
    dy = torch.randn(65, 128, device="cuda").to(dtype)
    got, _ = run_c_poisoned(False, x, w, b, dy, 1e-5, False)
    check_against_reference(got, reference(False, x, w, b, dy, 1e-5, False), dtype, False)


@pytest.mark.cuda
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_norm_cuda_threads_share_launch_caches(rms, seed):
    """Launches from eight host threads at once, each on its own stream, read
    and fill the launch caches together (blocks per SM, and the shared-memory
    opt-in, which grows past 48 KB for the wider rows): every result equals
    the same call made alone afterwards."""
    hiddens = [16384, 12288, 9216, 6144, 3072, 1536]
    inputs = [make_inputs((64, h), torch.bfloat16, "cuda", w_dtype=torch.float32, bias=not rms)
              for h in hiddens]
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream() for _ in range(8)]

    def run(k):
        stream = streams[k % len(streams)]
        with torch.cuda.stream(stream):
            out = run_ops(rms, *inputs[k % len(hiddens)], 1e-5, False)
        stream.synchronize()
        return out

    with ThreadPoolExecutor(max_workers=8) as pool:
        got = list(pool.map(run, range(48)))
    for k, together in enumerate(got):
        alone = run_ops(rms, *inputs[k % len(hiddens)], 1e-5, False)
        for a, c in zip(together, alone):
            if a is not None:
                assert torch.equal(a, c)


@pytest.mark.cuda
def test_norm_cuda_workspace_too_small():
    x = torch.randn(1024, 256, device="cuda")
    n = _C.norm_backward_workspace_numel(x)
    assert n > 0
    with pytest.raises(ValueError, match=f"layernorm_backward: argument 'workspace' must have at least {n}"):
        _C.layernorm_backward(x, x, torch.zeros(1024, device="cuda"), torch.ones(1024, device="cuda"),
                         torch.ones(256, device="cuda"), False, torch.empty_like(x),
                         torch.empty(256, device="cuda"), None, torch.empty(n - 1, device="cuda"))


@pytest.mark.cuda
def test_norm_cuda_empty_rows():
    x = torch.empty(0, 512, device="cuda")
    w = torch.ones(512, device="cuda")
    y, mean, rstd = norm_ops.layernorm_forward(x, w, torch.zeros(512, device="cuda"))
    dx, dg, db = norm_ops.layernorm_backward(torch.empty_like(x), x, mean, rstd, w)
    assert y.shape == (0, 512) and torch.equal(dg, torch.zeros_like(dg)) and torch.equal(db, torch.zeros_like(db))


@pytest.mark.cuda
def test_norm_cuda_graph_capture_and_stream(seed):
    x = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, device="cuda", dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y, rstd = norm_ops.rmsnorm_forward(x, w)  # warm up (and fills the workspace-size cache)
        dx, dg = norm_ops.rmsnorm_backward(y, x, rstd, w)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y, rstd = norm_ops.rmsnorm_forward(x, w)
        dx, dg = norm_ops.rmsnorm_backward(y, x, rstd, w)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    ref = run_ops(True, x, w, None, y.clone(), 1e-5, False)
    assert torch.equal(y, ref[0]) and torch.equal(dx, ref[3]) and torch.equal(dg, ref[4])


@needs_fp8
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_norm_amax_accumulates(device, seed):
    x = torch.randn(64, 256, device=device)
    w = torch.ones(256, device=device)
    y, _ = norm_ops.rmsnorm_forward(x, w)
    big = torch.full((1,), 1e4, device=device)
    norm_ops.rmsnorm_forward(x, w, amax=big)
    assert big.item() == 1e4  # a larger earlier amax stays
    small = torch.full((1,), 1e-3, device=device)
    norm_ops.rmsnorm_forward(x, w, out_dtype=torch.float8_e4m3fn, scale=torch.ones(1, device=device), amax=small)
    assert small.item() == y.abs().max().item()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_norm_amax_of_16bit_output_is_before_rounding(device, rms, dtype, seed):
    """A 16-bit y's amax is max |v| of the float32 values before rounding to
    y's dtype (seqfuse_norm.h): on the CPU exactly the max of the float32
    output for the same (exactly widened) inputs; on CUDA within float32
    arithmetic of it (the 16-bit max is 2^-9 coarse and would fail)."""
    x, w, b, _ = make_inputs((48, 1000), dtype, device, bias=not rms)
    amax = torch.zeros(1, device=device)
    if rms:
        norm_ops.rmsnorm_forward(x, w, 1e-5, amax=amax)
        y32, _ = norm_ops.rmsnorm_forward(x.cpu().float(), w.cpu().float(), 1e-5)
    else:
        norm_ops.layernorm_forward(x, w, b, 1e-5, amax=amax)
        y32, _, _ = norm_ops.layernorm_forward(x.cpu().float(), w.cpu().float(), b.cpu().float(), 1e-5)
    if device == "cpu":
        assert amax.item() == y32.abs().max().item()
    else:
        assert amax.item() == pytest.approx(y32.abs().max().item(), rel=1e-5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(7, 37), (300, 320), (4096, 2048), (5, 7, 64)])
def test_norm_backward_adds_a_residual_gradient(device, rms, dtype, shape, seed):
    """dres: dx = norm'(dy) + dres in the backward's own pass, rounded once:
    against float64 (dx + dres) within the dtype's tolerance, dgamma / dbeta
    unchanged, dres untouched; the vector and the element paths (hidden 37)."""
    if device == "cpu" and shape[0] * shape[-1] > 1 << 20:
        pytest.skip("the CPU reference at Llama's shape is slow; cuda covers it")
    x = torch.randn(*shape, device=device).to(dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], device=device)).to(dtype)
    b = None if rms else (0.1 * torch.randn(shape[-1], device=device)).to(dtype)
    dy, dres = torch.randn_like(x), torch.randn_like(x)
    keep = dres.clone()
    ref = reference(rms, x, w, b, dy, 1e-5, False)
    if rms:
        _, rstd = norm_ops.rmsnorm_forward(x, w, 1e-5, False)
        dx, dg = norm_ops.rmsnorm_backward(dy, x, rstd, w, False, dres=dres)
        plain_dx, plain_dg = norm_ops.rmsnorm_backward(dy, x, rstd, w, False)
    else:
        _, mean, rstd = norm_ops.layernorm_forward(x, w, b, 1e-5, False)
        dx, dg, db = norm_ops.layernorm_backward(dy, x, mean, rstd, w, False, True, dres=dres)
        plain_dx, plain_dg, plain_db = norm_ops.layernorm_backward(dy, x, mean, rstd, w, False, True)
        assert torch.equal(db, plain_db)
    assert torch.equal(dres, keep) and torch.equal(dg, plain_dg)
    assert_close_rel(dx, ref[3].to(dx.device) + dres.double(), dtype)
    assert (dx.double() - (plain_dx.double() + dres.double())).abs().max() <= \
        2 * torch.finfo(dtype).eps * (plain_dx.double().abs() + dres.double().abs()).max()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("shape", [(7, 37), (300, 320)])
def test_norm_backward_dx_may_be_dres(device, rms, shape, seed):
    """dx may be dres itself (the C entry's overlap rule lets it: each
    element of dres is read before dx's is written, by the same thread):
    the in-place result is the out-of-place one bit for bit, on the
    element path (hidden 37) and the vector path."""
    x = torch.randn(*shape, device=device).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(shape[-1], device=device)).to(torch.bfloat16)
    dy, dres = torch.randn_like(x), torch.randn_like(x)
    inplace, dg = dres.clone(), torch.empty_like(w)
    work = norm_ops._workspace(x)
    stream = seqfuse.ops._call.stream_for(x)
    if rms:
        _, rstd = norm_ops.rmsnorm_forward(x, w, 1e-5, False)
        dx, _ = norm_ops.rmsnorm_backward(dy, x, rstd, w, False, dres=dres)
        _C.rmsnorm_backward(dy, x, rstd, w, False, inplace, dg, work, inplace, stream)
    else:
        _, mean, rstd = norm_ops.layernorm_forward(x, w, None, 1e-5, False)
        dx, _, _ = norm_ops.layernorm_backward(dy, x, mean, rstd, w, False, False, dres=dres)
        _C.layernorm_backward(dy, x, mean, rstd, w, False, inplace, dg, None, work, inplace, stream)
    assert torch.equal(inplace, dx)


def test_norm_backward_residual_gradient_rules():
    x, w = torch.randn(4, 8), torch.ones(8)
    _, rstd = norm_ops.rmsnorm_forward(x, w, 1e-5, False)
    with pytest.raises(TypeError, match="rmsnorm_backward: argument 'dres' must have dtype float32, got bfloat16"):
        norm_ops.rmsnorm_backward(torch.ones_like(x), x, rstd, w, dres=torch.ones(4, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="rmsnorm_backward: arguments 'x' and 'dres' must have the same shape"):
        norm_ops.rmsnorm_backward(torch.ones_like(x), x, rstd, w, dres=torch.ones(4, 9))
    big = torch.randn(5, 8)
    with pytest.raises(ValueError, match="rmsnorm_backward: output 'dx' shares memory with input 'dres'"):
        _C.rmsnorm_backward(torch.ones_like(x), x, rstd, w, False, big[1:], torch.empty(8), None, big[:4])
