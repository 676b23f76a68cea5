"""seqfuse.ops.moe.grouped_gemm (csrc/grouped/): G GEMMs of different row
counts in one call.  On the CPU the grouped GEMM is, group by group, the
reference GEMM itself, so it must equal per-group seqfuse.ops.gemm bit for
bit, and torch.matmul bit for bit where the products are exact (small
integers); other dtypes and FP8 are held to the float64 reference.  The
cuda-marked tests compare the cuBLASLt route with the CPU one, outputs
poisoned first."""
import pytest
import torch

from seqfuse import ops
from seqfuse.ops import moe

from helpers import REL_TOL, needs_fp8, pair_tol, poisoned_like, rel_error

SPLITS = {
    "balanced": [8, 8, 8, 8],
    "empty_groups": [0, 5, 0, 11, 0],
    "single": [13],
    "unbalanced": [0, 1, 45, 0, 2, 0, 0, 1],
}


def _offsets(splits):
    out, o = [], 0
    for m in splits:
        out.append((o, o + m))
        o += m
    return out


def _inputs(splits, k, n, dtype, device="cpu", integer=False):
    M, G = sum(splits), len(splits)
    if integer:  # exact products and sums: any summation order gives the same float32
        x = torch.randint(-4, 5, (M, k), device=device).to(dtype)
        w = torch.randint(-4, 5, (G, n, k), device=device).to(dtype)
        dy = torch.randint(-4, 5, (M, n), device=device).to(dtype)
    else:
        x = torch.randn(M, k, device=device).to(dtype)
        w = torch.randn(G, n, k, device=device).to(dtype)
        dy = torch.randn(M, n, device=device).to(dtype)
    return x, w, dy


@pytest.mark.parametrize("case", sorted(SPLITS))
def test_fp32_equals_per_group_gemm_bit_for_bit(case, seed):
    splits = SPLITS[case]
    x, w, dy = _inputs(splits, 24, 40, torch.float32)
    ws = list(w.unbind(0))
    y = moe.grouped_gemm(x, ws, splits, transb=True)
    dx = moe.grouped_gemm(dy, ws, splits)
    dw = moe.grouped_gemm(dy, x, splits, transa=True)
    for g, (lo, hi) in enumerate(_offsets(splits)):
        if hi > lo:
            assert torch.equal(y[lo:hi], ops.gemm(x[lo:hi], ws[g], transb=True))
            assert torch.equal(dx[lo:hi], ops.gemm(dy[lo:hi], ws[g]))
            assert torch.equal(dw[g], ops.gemm(dy[lo:hi], x[lo:hi], transa=True))
        else:
            assert torch.equal(dw[g], torch.zeros_like(dw[g]))  # an expert with no tokens
    assert y.shape == (sum(splits), 40) and dx.shape == x.shape and dw.shape == w.shape


@pytest.mark.parametrize("case", sorted(SPLITS))
def test_fp32_equals_torch_matmul_bit_for_bit_on_exact_products(case, seed):
    splits = SPLITS[case]
    x, w, dy = _inputs(splits, 32, 16, torch.float32, integer=True)
    y = moe.grouped_gemm(x, w, splits, transb=True)  # stacked [G, n, k] weights
    dx = moe.grouped_gemm(dy, w, splits)
    dw = moe.grouped_gemm(dy, x, splits, transa=True)
    for g, (lo, hi) in enumerate(_offsets(splits)):
        assert torch.equal(y[lo:hi], x[lo:hi] @ w[g].T)
        assert torch.equal(dx[lo:hi], dy[lo:hi] @ w[g])
        assert torch.equal(dw[g], dy[lo:hi].T @ x[lo:hi])


def test_stacked_and_listed_weights_agree(seed):
    splits = SPLITS["unbalanced"]
    x, w, _ = _inputs(splits, 16, 24, torch.float32)
    assert torch.equal(moe.grouped_gemm(x, w, splits, transb=True),
                       moe.grouped_gemm(x, list(w.unbind(0)), splits, transb=True))
    assert torch.equal(moe.grouped_gemm(x, w, torch.tensor(splits), transb=True),
                       moe.grouped_gemm(x, w, tuple(splits), transb=True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_against_float64(dtype, seed):
    splits = SPLITS["empty_groups"]
    x, w, dy = _inputs(splits, 64, 48, dtype)
    y = moe.grouped_gemm(x, w, splits, transb=True)
    dw = moe.grouped_gemm(dy, x, splits, transa=True, out_dtype=torch.float32)
    assert y.dtype == dtype and dw.dtype == torch.float32
    xd, wd, dyd = x.double(), w.double(), dy.double()
    ry = torch.cat([xd[lo:hi] @ wd[g].T for g, (lo, hi) in enumerate(_offsets(splits))])
    rdw = torch.stack([dyd[lo:hi].T @ xd[lo:hi] for lo, hi in _offsets(splits)])
    assert rel_error(y, ry) <= REL_TOL[dtype]
    assert rel_error(dw, rdw) <= REL_TOL[torch.float32] * 10  # fp32 output of exact half inputs


def test_bias_and_bias_gradient(seed):
    splits = SPLITS["empty_groups"]
    x, w, dy = _inputs(splits, 16, 24, torch.float32)
    G = len(splits)
    bias = torch.randn(G, 24)
    y = moe.grouped_gemm(x, w, splits, transb=True, bias=list(bias.unbind(0)))
    y2 = moe.grouped_gemm(x, w, splits, transb=True, bias=bias)
    assert torch.equal(y, y2)
    dw, db = moe.grouped_gemm(dy, x, splits, transa=True, bgrad=True)
    for g, (lo, hi) in enumerate(_offsets(splits)):
        assert torch.equal(y[lo:hi], ops.gemm(x[lo:hi], w[g], transb=True, bias=bias[g]))
        if hi > lo:
            ref_dw, ref_db = ops.gemm(dy[lo:hi], x[lo:hi], transa=True, epilogue="bgrad")
            assert torch.equal(dw[g], ref_dw) and torch.equal(db[g], ref_db)
        else:
            assert torch.equal(db[g], torch.zeros(24))


def test_accumulate_into_a_list_keeps_empty_groups(seed):
    splits = [4, 0, 9]
    x, w, dy = _inputs(splits, 16, 8, torch.float32, integer=True)
    main = [torch.randint(-3, 4, (8, 16)).float() for _ in splits]
    before = [m.clone() for m in main]
    moe.grouped_gemm(dy, x, splits, transa=True, out=main, accumulate=True)
    for g, (lo, hi) in enumerate(_offsets(splits)):
        assert torch.equal(main[g], before[g] + dy[lo:hi].T @ x[lo:hi])
    assert torch.equal(main[1], before[1])


def test_unwritten_outputs_are_caught(seed):
    """Every element of every output is written (poisoned buffers in)."""
    splits = SPLITS["unbalanced"]
    x, w, dy = _inputs(splits, 16, 8, torch.float32)
    y = poisoned_like(torch.empty(sum(splits), 8))
    moe.grouped_gemm(x, w, splits, transb=True, out=y)
    dw = poisoned_like(w)
    moe.grouped_gemm(dy, x, splits, transa=True, out=dw)
    assert not y.isnan().any() and not dw.isnan().any()


@needs_fp8
@pytest.mark.parametrize("per_group", [True, False])
def test_fp8_per_tensor_within_bounds(per_group, seed):
    splits = [16, 0, 48, 32]
    G, k, n = len(splits), 64, 32
    x = torch.randn(sum(splits), k)
    w = torch.randn(G, n, k)
    sx = torch.rand(G if per_group else 1) + 0.5  # scale inverses
    sw = torch.rand(G if per_group else 1) + 0.5
    xq = x.to(torch.float8_e4m3fn)
    wq = w.to(torch.float8_e4m3fn)
    y = moe.grouped_gemm(xq, list(wq.unbind(0)), splits, transb=True, a_scale_inv=sx, b_scale_inv=sw,
                         out_dtype=torch.float32)
    for g, (lo, hi) in enumerate(_offsets(splits)):
        if hi == lo:
            continue
        gx, gw = (sx[g], sw[g]) if per_group else (sx[0], sw[0])
        ref = (xq[lo:hi].double() * gx.double()) @ (wq[g].double() * gw.double()).T
        # the CPU reference dequantizes exactly and accumulates in float32
        assert rel_error(y[lo:hi], ref) <= REL_TOL[torch.float32]
        # and FP8 against the unquantized product: E4M3's 3 mantissa bits
        assert rel_error(y[lo:hi], (x[lo:hi] * gx) @ (w[g] * gw).T) <= 0.1


@needs_fp8
def test_fp8_block_scaled_equals_per_group_gemm(seed):
    """1x128 activations x 128x128 weights, scales given per group as lists:
    each group is seqfuse.ops.gemm's block-scaled product, bit for bit."""
    from seqfuse.ops import quant
    splits = [32, 0, 64, 16]
    G, k, n = len(splits), 256, 128
    x = torch.randn(sum(splits), k)
    w = torch.randn(G, n, k)
    xq, xs, wq, ws = [], [], [], []
    for g, (lo, hi) in enumerate(_offsets(splits)):
        d, s = quant.quantize_block_fp8(x[lo:hi], 1) if hi > lo else (torch.empty(0, k).to(torch.float8_e4m3fn),
                                                                      torch.ones(1))
        xq.append(d)
        xs.append(s)
        d, s = quant.quantize_block_fp8(w[g], 128)
        wq.append(d)
        ws.append(s)
    y = moe.grouped_gemm(xq, wq, splits, transb=True, a_scale_inv=xs, b_scale_inv=ws,
                         a_scaling="block_1x128", b_scaling="block_128x128", out_dtype=torch.float32,
                         out=torch.empty(sum(splits), n))
    for g, (lo, hi) in enumerate(_offsets(splits)):
        if hi > lo:
            ref = ops.gemm(xq[g], wq[g], transb=True, a_scale_inv=xs[g], b_scale_inv=ws[g],
                           a_scaling="block_1x128", b_scaling="block_128x128", out_dtype=torch.float32)
            assert torch.equal(y[lo:hi], ref)


def test_bad_inputs_are_named():
    x, w, dy = _inputs([4, 4], 16, 8, torch.float32)
    with pytest.raises(ValueError, match="sum\\(m_splits\\) = 7"):
        moe.grouped_gemm(x, w, [4, 3], transb=True)
    with pytest.raises(ValueError, match="m_splits.*>= 0"):
        moe.grouped_gemm(x, w, [10, -2], transb=True)
    with pytest.raises(ValueError, match=r"'m_splits' sums past 2\*\*63 - 1 at m_splits\[1\]"):
        moe.grouped_gemm(x, w, [2**62, 2**62], transb=True)
    with pytest.raises(ValueError, match="num_groups = 3"):
        moe.grouped_gemm(x, list(w.unbind(0)), [4, 4, 0], transb=True)
    with pytest.raises(ValueError, match="group 1"):
        moe.grouped_gemm(x, [w[0], torch.randn(8, 12)], [4, 4], transb=True)
    with pytest.raises(ValueError, match="block scales.*list"):
        moe.grouped_gemm(x, w, [4, 4], transb=True, a_scale_inv=torch.ones(2), a_scaling="block_1x128")
    with pytest.raises(NotImplementedError, match="device-side split"):
        moe.grouped_gemm(x, w, torch.tensor([4, 4], device="meta"), transb=True)
    with pytest.raises(ValueError, match="accumulate"):
        moe.grouped_gemm(dy, x, [4, 4], transa=True, accumulate=True)
    with pytest.raises(TypeError, match="must have the same dtype"):
        moe.grouped_gemm(x, w.double().float().half(), [4, 4], transb=True)


# ---- CUDA against the CPU reference ----------------------------------------

CUDA_SPLITS = [[128, 256, 64, 512], [0, 300, 0, 1, 77, 0], [1000], [0, 0, 0, 5]]


@pytest.mark.cuda
@pytest.mark.parametrize("splits", CUDA_SPLITS, ids=["balanced", "empty", "single", "mostly_empty"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_matches_cpu(splits, dtype, seed):
    k, n = 256, 192
    x, w, dy = _inputs(splits, k, n, dtype)
    bias = torch.randn(len(splits), n).to(dtype)
    xc, wc, dyc, bc = x.cuda(), w.cuda(), dy.cuda(), bias.cuda()
    y = poisoned_like(torch.empty(sum(splits), n, dtype=dtype, device="cuda"))
    moe.grouped_gemm(xc, list(wc.unbind(0)), splits, transb=True, bias=bc, out=y)
    dx = poisoned_like(xc)
    moe.grouped_gemm(dyc, wc, splits, out=dx)
    dw = poisoned_like(torch.empty(len(splits), n, k, dtype=torch.float32, device="cuda"))
    db = poisoned_like(torch.empty(len(splits), n, dtype=torch.float32, device="cuda"))
    moe.grouped_gemm(dyc, xc, splits, transa=True, out=dw, bias=db, bgrad=True)
    ry = moe.grouped_gemm(x, w, splits, transb=True, bias=bias)
    rdx = moe.grouped_gemm(dy, w, splits)
    rdw, rdb = moe.grouped_gemm(dy, x, splits, transa=True, bgrad=True, out_dtype=torch.float32)
    # fp32 may run on TF32 tensor cores (torch.backends.cuda.matmul.allow_tf32): bf16's bound
    tol = pair_tol(torch.bfloat16 if dtype == torch.float32 else dtype)
    assert rel_error(y, ry) <= tol
    assert rel_error(dx, rdx) <= tol
    assert rel_error(dw, rdw) <= tol
    assert rel_error(db, rdb) <= tol


@pytest.mark.cuda
@needs_fp8
@pytest.mark.parametrize("splits,lanes", [([32, 0, 128, 16], 1), ([32, 0, 128, 16, 64, 0, 16, 48], 4)],
                         ids=["one_stream", "lanes"])
def test_cuda_fp8_matches_cpu(splits, lanes, seed):
    G, k, n = len(splits), 256, 128
    xq = torch.randn(sum(splits), k).to(torch.float8_e4m3fn)
    wq = torch.randn(G, n, k).to(torch.float8_e4m3fn)
    sx, sw = torch.rand(G) + 0.5, torch.rand(G) + 0.5
    ref = moe.grouped_gemm(xq, wq, splits, transb=True, a_scale_inv=sx, b_scale_inv=sw)
    out = poisoned_like(torch.empty(sum(splits), n, dtype=torch.bfloat16, device="cuda"))
    moe.grouped_gemm(xq.cuda(), wq.cuda(), splits, transb=True, a_scale_inv=sx.cuda(),
                     b_scale_inv=sw.cuda(), out=out, lanes=lanes)
    assert rel_error(out, ref) <= pair_tol(torch.bfloat16)


def test_per_group_scales_are_laid_out_aligned():
    """The FP8 grouped GEMM hands cuBLASLt each group's scale at its own
    256-byte-aligned address: one tensor holding the values 256 bytes apart
    from an aligned base (the caching allocator's CUDA blocks are)."""
    from seqfuse.ops.moe import _aligned_scalars

    vals = torch.rand(5) + 0.5
    for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        spaced = _aligned_scalars(vals.to(device))
        assert spaced.dim() == 1 and spaced.stride(0) * 4 == 256 and spaced.tolist() == vals.tolist()
        if device == "cuda":  # (the caching allocator's blocks are 256-byte aligned)
            assert spaced.data_ptr() % 256 == 0


@pytest.mark.cuda
@needs_fp8
def test_cuda_fp8_misaligned_scales_are_realigned(seed):
    """Scale inverses 4 bytes into a buffer (one group, a list of one, a shared one): copied to aligned
    addresses, not refused by cuBLASLt's 16-byte rule."""
    xq = torch.randn(32, 64).to(torch.float8_e4m3fn)
    wq = torch.randn(1, 48, 64).to(torch.float8_e4m3fn)
    buf = torch.rand(3) + 0.5
    ref = moe.grouped_gemm(xq, wq, [32], transb=True, a_scale_inv=buf[1:2], b_scale_inv=buf[2:3])
    bc = buf.cuda()
    for sa, sb in ((bc[1:2], bc[2:3]), ([bc[1:2]], [bc[2:3]])):
        out = moe.grouped_gemm(xq.cuda(), wq.cuda(), [32], transb=True, a_scale_inv=sa, b_scale_inv=sb)
        assert rel_error(out, ref) <= pair_tol(torch.bfloat16)


@needs_fp8
@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_fp8_scales_of_another_dtype_are_refused_by_name(device):
    """Scale inverses must be float32, as one tensor or as a list (where a
    misaligned list on CUDA is left to C, not realigned): refused with the
    argument's name, listed ones with the group's."""
    xq = torch.randn(32, 32).to(torch.float8_e4m3fn).to(device)
    wq = torch.randn(2, 16, 32).to(torch.float8_e4m3fn).to(device)
    ok = [torch.ones(1, device=device)] * 2
    half = torch.ones(4, dtype=torch.float16, device=device)
    with pytest.raises(TypeError, match="grouped_gemm: argument 'a_scale_inv' must have dtype float32, got float16"):
        moe.grouped_gemm(xq, wq, [16, 16], transb=True, a_scale_inv=half[:2], b_scale_inv=ok, fast_accum=True)
    with pytest.raises(TypeError, match="group 0 .*'a_scale_inv' must have dtype float32, got float16"):
        moe.grouped_gemm(xq, wq, [16, 16], transb=True, a_scale_inv=[half[1:2], half[2:3]], b_scale_inv=ok,
                         fast_accum=True)


# ---- lanes: the groups' GEMMs on several CUDA streams ----------------------

@pytest.mark.parametrize("lanes,error,match", [
    (0, ValueError, "argument 'lanes' must be from 1 to 8.*got 0"),
    (9, ValueError, "argument 'lanes' must be from 1 to 8.*got 9"),
    (True, TypeError, "argument 'lanes' must be an int or None, got bool"),
    (2.0, TypeError, "argument 'lanes' must be an int or None, got float"),
    ("4", TypeError, "argument 'lanes' must be an int or None, got str")])
def test_lanes_are_checked(lanes, error, match):
    x, w, _ = _inputs([4, 4], 16, 8, torch.float32)
    with pytest.raises(error, match=match):
        moe.grouped_gemm(x, w, [4, 4], transb=True, lanes=lanes)


def test_lanes_take_integer_types():
    import numpy as np

    x, w, _ = _inputs([4, 4], 16, 8, torch.float32)
    assert torch.equal(moe.grouped_gemm(x, w, [4, 4], transb=True, lanes=np.int64(2)),
                       moe.grouped_gemm(x, w, [4, 4], transb=True, lanes=torch.tensor(2)))


@pytest.mark.parametrize("env,match", [("x", "SEQFUSE_GROUPED_LANES must be an integer from 0 to 8, got 'x'"),
                                       ("9", "SEQFUSE_GROUPED_LANES must be from 0 to 8, got 9"),
                                       ("-1", "SEQFUSE_GROUPED_LANES must be from 0 to 8, got -1")])
def test_lanes_environment_variable_is_checked(monkeypatch, env, match):
    x, w, _ = _inputs([4, 4], 16, 8, torch.float32)
    monkeypatch.setenv("SEQFUSE_GROUPED_LANES", env)
    with pytest.raises(ValueError, match=match):
        moe.grouped_gemm(x, w, [4, 4], transb=True)


def test_lanes_environment_variable_sets_the_default(monkeypatch):
    """lanes=None reads SEQFUSE_GROUPED_LANES at every call; an explicit lanes wins."""
    monkeypatch.setenv("SEQFUSE_GROUPED_LANES", "3")
    assert moe._lanes("op", None) == 3
    assert moe._lanes("op", 2) == 2
    monkeypatch.setenv("SEQFUSE_GROUPED_LANES", "0")
    assert moe._lanes("op", None) == 0
    monkeypatch.delenv("SEQFUSE_GROUPED_LANES")
    assert moe._lanes("op", None) == 0


def test_c_entry_checks_lanes():
    """The C entry's own bound (its callers are not only this module)."""
    from seqfuse import _C

    x, w, _ = _inputs([4, 4], 16, 8, torch.float32)
    out = torch.empty(8, 8)
    with pytest.raises(ValueError, match="argument 'lanes' must be 0 to 8"):
        _C.grouped_gemm(x, list(w.unbind(0)), out, [4, 4], 0, 1, None, None, 0, 0, None, 0, 0,
                        0, 1, None, 9, 0)


def test_lanes_leave_cpu_results_alone(seed):
    splits = SPLITS["unbalanced"]
    x, w, dy = _inputs(splits, 24, 16, torch.float32)
    for lanes in (2, 8):
        assert torch.equal(moe.grouped_gemm(x, w, splits, transb=True, lanes=lanes),
                           moe.grouped_gemm(x, w, splits, transb=True, lanes=1))


LANE_SPLITS = {"many": [0, 48, 16, 112, 0, 32, 208, 16, 64, 0, 96, 16, 128, 0, 32, 80],
               "two": [0, 0, 320, 0, 16], "mostly_empty": [0, 0, 0, 5]}


@pytest.mark.cuda
@pytest.mark.parametrize("lanes", [None, 2, 4, 8], ids=["auto", "2", "4", "8"])
@pytest.mark.parametrize("case", sorted(LANE_SPLITS))
def test_cuda_lanes_match_cpu_and_one_stream(case, lanes, seed):
    """Every product (bias, bias gradient, accumulation into a list) with
    the groups spread over `lanes` streams equals the one-stream route and
    the CPU reference; outputs poisoned and read on the caller's stream
    right after the call (the join orders them).  None: the C entry's own
    choice (groups of one or two output tiles: as many lanes as there are
    groups with rows, up to 4; "mostly_empty" has one such group in the
    forward and input gradient, which then run on the caller's stream)."""
    splits = LANE_SPLITS[case]
    G, k, n = len(splits), 128, 96
    x, w, dy = _inputs(splits, k, n, torch.bfloat16)
    bias = torch.randn(G, n).to(torch.bfloat16)
    xc, wc, dyc, bc = x.cuda(), w.cuda(), dy.cuda(), bias.cuda()
    got = {}
    for ln in (1, lanes):
        y = poisoned_like(torch.empty(sum(splits), n, dtype=torch.bfloat16, device="cuda"))
        moe.grouped_gemm(xc, list(wc.unbind(0)), splits, transb=True, bias=bc, out=y, lanes=ln)
        dx = poisoned_like(xc)
        moe.grouped_gemm(dyc, wc, splits, out=dx, lanes=ln)
        dw = poisoned_like(torch.empty(G, n, k, dtype=torch.float32, device="cuda"))
        db = poisoned_like(torch.empty(G, n, dtype=torch.float32, device="cuda"))
        moe.grouped_gemm(dyc, xc, splits, transa=True, out=dw, bias=db, bgrad=True, lanes=ln)
        mains = [torch.ones(n, k, device="cuda") for _ in range(G)]
        moe.grouped_gemm(dyc, xc, splits, transa=True, out=mains, accumulate=True, lanes=ln)
        got[ln] = (y.float().cpu(), dx.float().cpu(), dw.cpu(), db.cpu(), torch.stack(mains).cpu())
    ry = moe.grouped_gemm(x, w, splits, transb=True, bias=bias)
    rdx = moe.grouped_gemm(dy, w, splits)
    rdw, rdb = moe.grouped_gemm(dy, x, splits, transa=True, bgrad=True, out_dtype=torch.float32)
    tol = pair_tol(torch.bfloat16)
    for ours, one, ref in zip(got[lanes], got[1], (ry, rdx, rdw, rdb, rdw + 1)):
        assert rel_error(ours, ref) <= tol
        assert rel_error(ours, one) <= tol


@pytest.mark.cuda
def test_cuda_lanes_on_a_side_stream_and_in_a_graph(seed):
    """Forked from and joined into whatever stream is current: a user's side
    stream, and a CUDA graph's capture stream (replayed on new inputs)."""
    splits = LANE_SPLITS["many"]
    k, n = 128, 64
    x, w, _ = _inputs(splits, k, n, torch.bfloat16)
    xc, wl = x.cuda(), list(w.cuda().unbind(0))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y_side = moe.grouped_gemm(xc, wl, splits, transb=True, lanes=4, kernel="cublaslt")
        s_side = y_side.float().sum(dim=1)
    torch.cuda.current_stream().wait_stream(side)
    assert rel_error(y_side, moe.grouped_gemm(x, w, splits, transb=True)) <= pair_tol(torch.bfloat16)
    assert rel_error(s_side, y_side.float().sum(dim=1)) == 0

    static_x = xc.clone()
    static_y = torch.empty(sum(splits), n, dtype=torch.bfloat16, device="cuda")
    moe.grouped_gemm(static_x, wl, splits, transb=True, out=static_y, lanes=4, kernel="cublaslt")  # plans made before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe.grouped_gemm(static_x, wl, splits, transb=True, out=static_y, lanes=4, kernel="cublaslt")
    x2 = torch.randn_like(x)
    static_x.copy_(x2.cuda())
    static_y.fill_(float("nan"))
    graph.replay()
    assert rel_error(static_y, moe.grouped_gemm(x2, w, splits, transb=True)) <= pair_tol(torch.bfloat16)


@pytest.mark.cuda
def test_cuda_lanes_failing_group_joins_and_releases(seed):
    """A group refused after earlier groups went out on the lanes: the error
    names it, the lanes are joined and released (the next call, on the same
    lanes, runs and is right)."""
    splits = [64, 64, 64, 64]
    x, w, _ = _inputs(splits, 64, 32, torch.bfloat16, device="cuda")
    bad = list(w.unbind(0))
    bad[2] = torch.randn(32, 48, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="group 2"):
        moe.grouped_gemm(x, bad, splits, transb=True, lanes=4, kernel="cublaslt")
    y = moe.grouped_gemm(x, w, splits, transb=True, lanes=4, kernel="cublaslt")
    assert rel_error(y, moe.grouped_gemm(x.cpu(), w.cpu(), splits, transb=True)) <= pair_tol(torch.bfloat16)


@pytest.mark.cuda
def test_cuda_lanes_wait_for_the_callers_earlier_work(seed):
    """The fork: the caller's stream sleeps, then writes the input; lanes that
    did not wait for it would read the old values."""
    splits = LANE_SPLITS["many"]
    x, w, _ = _inputs(splits, 256, 128, torch.bfloat16)
    x2 = torch.randn_like(x)
    xc, x2c, wl = x.cuda(), x2.cuda(), list(w.cuda().unbind(0))
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)  # tens of ms of the caller's stream
    xc.copy_(x2c)
    y = moe.grouped_gemm(xc, wl, splits, transb=True, lanes=4, kernel="cublaslt")
    assert rel_error(y, moe.grouped_gemm(x2, w, splits, transb=True)) <= pair_tol(torch.bfloat16)


@pytest.mark.cuda
def test_cuda_lanes_open_with_their_share_of_the_sms(seed):
    """Lanes do open: groups this small fit side by side, so a call on 4
    lanes plans its GEMMs for a quarter of the SMs (new cuBLASLt heuristic
    queries after the one-stream call on the same shapes), once."""
    import importlib

    gemm_mod = importlib.import_module("seqfuse.ops.gemm")  # the module (seqfuse.ops.gemm is the op)
    splits = LANE_SPLITS["many"]
    x, w, _ = _inputs(splits, 160, 80, torch.bfloat16, device="cuda")  # (sizes no other test plans)
    wl = list(w.unbind(0))
    gemm_mod.plan_cache_clear()
    moe.grouped_gemm(x, wl, splits, transb=True, lanes=1, kernel="cublaslt")
    q1 = gemm_mod.heuristic_queries()
    moe.grouped_gemm(x, wl, splits, transb=True, lanes=1, kernel="cublaslt")
    assert gemm_mod.heuristic_queries() == q1
    moe.grouped_gemm(x, wl, splits, transb=True, lanes=4, kernel="cublaslt")
    q4 = gemm_mod.heuristic_queries()
    assert q4 > q1
    moe.grouped_gemm(x, wl, splits, transb=True, lanes=4, kernel="cublaslt")
    assert gemm_mod.heuristic_queries() == q4


@pytest.mark.cuda
def test_cuda_lanes_from_two_threads_on_their_own_streams(seed):
    """Two host threads, each on its own stream, each call on 4 lanes: both
    results right every time (the lane sets and their locks)."""
    import threading

    splits = LANE_SPLITS["many"]
    x, w, _ = _inputs(splits, 128, 64, torch.bfloat16)
    ref = moe.grouped_gemm(x, w, splits, transb=True)
    xc, wl = x.cuda(), list(w.cuda().unbind(0))
    errors = []

    def work():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(20):
                y = moe.grouped_gemm(xc, wl, splits, transb=True, lanes=4, kernel="cublaslt")
                err = rel_error(y, ref)
                if err > pair_tol(torch.bfloat16):
                    errors.append(err)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread did not finish (lanes' lock held?)"
    assert errors == []


@pytest.mark.cuda
def test_cuda_listed_outputs_sharing_memory_keep_their_order(seed):
    """Two groups accumulating into the same output: summed, as on one
    stream (outputs that share memory are not spread over lanes)."""
    splits = [64, 64, 64, 64]
    x, _, dy = _inputs(splits, 96, 32, torch.float32)
    shared = torch.zeros(32, 96)
    outs = [shared, torch.zeros(32, 96), shared, torch.zeros(32, 96)]
    moe.grouped_gemm(dy, x, splits, transa=True, out=outs, accumulate=True)
    sc = torch.zeros(32, 96, device="cuda")
    outs_c = [sc, torch.zeros(32, 96, device="cuda"), sc, torch.zeros(32, 96, device="cuda")]
    moe.grouped_gemm(dy.cuda(), x.cuda(), splits, transa=True, out=outs_c, accumulate=True, lanes=4,
                     allow_tf32=False)
    assert rel_error(sc, shared) <= pair_tol(torch.float32)
