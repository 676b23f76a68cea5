"""The grouped GEMM's own Hopper kernel (csrc/grouped/grouped_sm90_cuda.cu,
``seqfuse.ops.moe.grouped_gemm(kernel=...)``): every group's output tiles in
one persistent launch.  On the CPU: the kernel argument and its environment
variable are checked, and kernel="sm90" refuses a call it cannot take with
the rule.  On a Hopper GPU: the kernel against the CPU reference and the
cuBLASLt route at row counts on and off the 128-row tile, empty groups, k
with a partial block, n off the 256-column tile, bf16 and e4m3 with
per-group scales; FP8 with fast_accum=False (the promoted 128 x 128 shape),
e4m3 x e4m3 and the HYBRID input gradient's e5m2 x e4m3, against cuBLASLt's
fast_accum=False and over a long k of positive operands, where fast
accumulation loses bits; outputs poisoned, padding columns of out left
alone; a side stream, a CUDA graph, the caller's earlier work; auto choosing
it and naming why not when it does not (logger "seqfuse")."""
import logging

import pytest
import torch

from seqfuse.ops import moe

from helpers import needs_fp8, pair_tol, poisoned_like, rel_error, rel_tol, torch_bound

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)
needs_hopper = pytest.mark.skipif(not HOPPER, reason="the sm90 grouped kernel runs on compute capability 9.0")


def _inputs(splits, k, n, device="cpu", dtype=torch.bfloat16):
    x = torch.randn(sum(splits), k, device=device).to(dtype)
    w = (torch.randn(len(splits), n, k, device=device) * 0.1).to(dtype)
    return x, w


# ---- arguments (CPU) ------------------------------------------------------

@pytest.mark.parametrize("kernel,error,match", [
    ("fast", ValueError, "argument 'kernel' must be one of 'auto', 'cublaslt', 'sm90', got 'fast'"),
    (2, ValueError, "argument 'kernel' must be one of 'auto', 'cublaslt', 'sm90', got 2")])
def test_kernel_argument_is_checked(kernel, error, match):
    x, w = _inputs([4, 4], 16, 8)
    with pytest.raises(error, match=match):
        moe.grouped_gemm(x, w, [4, 4], transb=True, kernel=kernel)


def test_kernel_environment_variable_is_checked(monkeypatch):
    x, w = _inputs([4, 4], 16, 8)
    for bad in ("cutlass", "sm90"):  # (sm90 only per call: the variable reaches the backward's products too)
        monkeypatch.setenv("SEQFUSE_GROUPED_KERNEL", bad)
        with pytest.raises(ValueError, match="environment variable SEQFUSE_GROUPED_KERNEL must be 'auto' or "
                                             f"'cublaslt' \\(kernel='sm90' is a per-call argument\\), got '{bad}'"):
            moe.grouped_gemm(x, w, [4, 4], transb=True)
    monkeypatch.setenv("SEQFUSE_GROUPED_KERNEL", "cublaslt")
    assert torch.equal(moe.grouped_gemm(x, w, [4, 4], transb=True),
                       moe.grouped_gemm(x, w, [4, 4], transb=True, kernel="auto"))


def test_forced_sm90_refuses_cpu_tensors():
    x, w = _inputs([4, 4], 16, 8)
    with pytest.raises(ValueError, match="kernel='sm90' cannot take this call: the tensors are on the CPU"):
        moe.grouped_gemm(x, w, [4, 4], transb=True, kernel="sm90")


def test_c_entry_checks_kernel():
    from seqfuse import _C

    x, w = _inputs([4, 4], 16, 8, dtype=torch.float32)
    with pytest.raises(ValueError, match="argument 'kernel' must be 0 \\(auto\\), 1 \\(cuBLASLt\\) or 2 "
                                         "\\(sm90\\), got 3"):
        _C.grouped_gemm(x, list(w.unbind(0)), torch.empty(8, 8), [4, 4], 0, 1, None, None, 0, 0, None, 0, 0,
                        0, 1, None, 0, 3)


def test_c_entry_notes_nothing_on_the_cpu():
    """The note explains a CUDA call of the kernel's form that did not take it; CPU calls have none."""
    from seqfuse import _C

    x, w = _inputs([4, 4], 16, 8, dtype=torch.float32)
    for kernel in (0, 1):
        assert _C.grouped_gemm(x, list(w.unbind(0)), torch.empty(8, 8), [4, 4], 0, 1, None, None, 0, 0, None, 0,
                               0, 0, 1, None, 0, kernel) is None


# ---- the kernel (Hopper) ---------------------------------------------------

CASES = {  # splits, k, n
    "one_tile": ([128], 64, 256),
    "one_row": ([1], 8, 8),
    "ragged": ([0, 200, 57], 40, 264),
    "empty_middle": ([129, 0, 0, 383], 192, 520),
    "eight": ([16, 300, 128, 0, 1, 255, 640, 7], 160, 1024),
    "long_k": ([700, 300], 1024, 72),
    "mostly_empty": ([0, 0, 0, 0, 33], 3584, 512),
}


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize("case", sorted(CASES))
def test_cuda_sm90_bf16_matches_cpu_and_cublaslt(case, seed):
    splits, k, n = CASES[case]
    x, w = _inputs(splits, k, n)
    ends = torch.tensor(splits).cumsum(0).tolist()
    ref = torch.cat([x[lo:hi].double() @ w[g].double().T for g, (lo, hi) in enumerate(zip([0] + ends[:-1], ends))])
    xc, wl = x.cuda(), list(w.cuda().unbind(0))
    pad = torch.full((sum(splits) + 2, n + 8), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = pad[:sum(splits), :n]  # row stride n + 8: the padding columns must stay NaN
    moe.grouped_gemm(xc, wl, splits, transb=True, out=out, kernel="sm90")
    lt = moe.grouped_gemm(xc, wl, splits, transb=True, kernel="cublaslt")
    assert rel_error(out, ref) <= pair_tol(torch.bfloat16) / 2
    assert rel_error(out, lt) <= pair_tol(torch.bfloat16)
    assert torch.isnan(pad[:, n:]).all() and torch.isnan(pad[sum(splits):]).all()


@pytest.mark.cuda
@needs_hopper
@needs_fp8
@pytest.mark.parametrize("splits,k,n", [([0, 208, 64], 48, 272), ([16, 304, 128, 0, 16, 256, 640, 32], 160, 1024),
                                         ([704, 304], 1024, 80)], ids=["ragged", "eight", "long_k"])
def test_cuda_sm90_fp8_matches_cpu_with_per_group_scales(splits, k, n, seed):
    """Multiples of 16 (sf_gemm's FP8 rule, which every group is held to);
    rows off the tile in FP8: bin/check_grouped_sm90."""
    G = len(splits)
    xq = torch.randn(sum(splits), k).to(torch.float8_e4m3fn)
    wq = torch.randn(G, n, k).to(torch.float8_e4m3fn)
    sx, sw = torch.rand(G) + 0.5, torch.rand(G) + 0.5
    ends = torch.tensor(splits).cumsum(0).tolist()
    bounds = list(zip([0] + ends[:-1], ends))
    ref = torch.cat([(xq[lo:hi].double() @ wq[g].double().T) * sx[g].item() * sw[g].item()
                     for g, (lo, hi) in enumerate(bounds)])
    out = poisoned_like(torch.empty(sum(splits), n, dtype=torch.bfloat16, device="cuda"))
    moe.grouped_gemm(xq.cuda(), wq.cuda(), splits, transb=True, a_scale_inv=sx.cuda(), b_scale_inv=sw.cuda(),
                     fast_accum=True, out=out, kernel="sm90")
    assert rel_error(out, ref) <= pair_tol(torch.bfloat16) / 2
    # one scale shared by every group
    out1 = poisoned_like(out)
    moe.grouped_gemm(xq.cuda(), wq.cuda(), splits, transb=True, a_scale_inv=sx[:1].cuda(),
                     b_scale_inv=sw[:1].cuda(), fast_accum=True, out=out1, kernel="sm90")
    ref1 = ref.clone()
    for g, (lo, hi) in enumerate(bounds):
        ref1[lo:hi] *= (sx[0] * sw[0]).item() / (sx[g] * sw[g]).item()
    assert rel_error(out1, ref1) <= pair_tol(torch.bfloat16) / 2


FP8_SHAPES = {  # splits (multiples of 16: sf_gemm's FP8 rule, which every group is held to), k, n
    "ragged": ([0, 208, 64], 48, 272),
    "eight": ([16, 304, 128, 0, 16, 256, 640, 32], 160, 1024),
    "long_k": ([704, 304], 1024, 80),
}


def _fp8_operands(splits, k, n, a_dtype, positive=False):
    """a [rows, k] in a_dtype and w [G, n, k] in e4m3 (b of the forward form:
    the input gradient's transposed weights), with per-group scale inverses;
    positive: uniform in [0.5, 3.5], else normal."""
    G = len(splits)
    draw = (lambda *shape: torch.rand(*shape) * 3 + 0.5) if positive else torch.randn
    xq = draw(sum(splits), k).to(a_dtype)
    wq = draw(G, n, k).to(torch.float8_e4m3fn)
    sx, sw = torch.rand(G) + 0.5, torch.rand(G) + 0.5
    ends = torch.tensor(splits).cumsum(0).tolist()
    bounds = list(zip([0] + ends[:-1], ends))
    ref = torch.cat([(xq[lo:hi].double() @ wq[g].double().T) * sx[g].item() * sw[g].item()
                     for g, (lo, hi) in enumerate(bounds)])
    return xq.cuda(), wq.cuda(), sx.cuda(), sw.cuda(), ref


def _fp8_call(xq, wq, splits, sx, sw, fast_accum, kernel, out=None):
    return moe.grouped_gemm(xq, wq, splits, transb=True, a_scale_inv=sx, b_scale_inv=sw, fast_accum=fast_accum,
                            out=out, kernel=kernel)


@pytest.mark.cuda
@needs_hopper
@needs_fp8
@pytest.mark.parametrize("a_dtype", [torch.float8_e5m2, torch.float8_e4m3fn], ids=["e5m2", "e4m3"])
@pytest.mark.parametrize("shape", sorted(FP8_SHAPES))
def test_cuda_sm90_fp8_split_accumulation_matches_cpu_and_cublaslt(a_dtype, shape, seed):
    """fast_accum=False (the input gradient's: under HYBRID the output
    gradient in e5m2 times the transposed e4m3 weights) runs the kernel's
    promoted shape: against the float64 product it holds the rule of twice
    cuBLASLt's fast_accum=False error (at least a quarter of bf16's REL_TOL,
    its output rounding's order), and the two routes agree within half the
    bf16 pair bound; the poisoned output is written everywhere."""
    splits, k, n = FP8_SHAPES[shape]
    xq, wq, sx, sw, ref = _fp8_operands(splits, k, n, a_dtype)
    out = poisoned_like(torch.empty(sum(splits), n, dtype=torch.bfloat16, device="cuda"))
    _fp8_call(xq, wq, splits, sx, sw, False, "sm90", out=out)
    lt = _fp8_call(xq, wq, splits, sx, sw, False, "cublaslt")
    assert rel_error(out, ref) <= torch_bound(rel_error(lt, ref), floor=rel_tol(torch.bfloat16) / 4)
    assert rel_error(out, lt) <= pair_tol(torch.bfloat16) / 2
    # one scale shared by every group (per-tensor scaling)
    out1 = poisoned_like(out)
    _fp8_call(xq, wq, splits, sx[:1], sw[:1], False, "sm90", out=out1)
    assert rel_error(out1, _fp8_call(xq, wq, splits, sx[:1], sw[:1], False, "cublaslt")) <= pair_tol(torch.bfloat16) / 2


@pytest.mark.cuda
@needs_hopper
@needs_fp8
@pytest.mark.parametrize("a_dtype", [torch.float8_e5m2, torch.float8_e4m3fn], ids=["e5m2", "e4m3"])
def test_cuda_sm90_split_accumulation_keeps_a_long_positive_sum(a_dtype, seed):
    """Positive operands over k = 7,168 (Mixtral-small fc1's input
    gradient): the running sum grows with k, and Hopper's FP8 accumulator
    (about 13 mantissa bits) drops the low bits of what is added to it when
    it accumulates all of k (fast_accum=True).  The promoted kernel keeps
    to bf16 output rounding's error: at most half bf16's REL_TOL (rounding
    alone is about 2^-9 rms), twice cuBLASLt's fast_accum=False error, and
    no more than the fast kernel's on the same operands (5 % for the
    sampling of 60,000 outputs)."""
    splits, k, n = [160, 0, 64], 7168, 272  # (n a multiple of 16: sf_gemm's FP8 rule, which the route keeps)
    xq, wq, sx, sw, ref = _fp8_operands(splits, k, n, a_dtype, positive=True)
    split = _fp8_call(xq, wq, splits, sx, sw, False, "sm90")
    fast = _fp8_call(xq, wq, splits, sx, sw, True, "sm90")
    lt = _fp8_call(xq, wq, splits, sx, sw, False, "cublaslt")
    err = rel_error(split, ref)
    assert err <= rel_tol(torch.bfloat16) / 2
    assert err <= torch_bound(rel_error(lt, ref), floor=rel_tol(torch.bfloat16) / 4)
    assert err <= 1.05 * rel_error(fast, ref)


@pytest.mark.cuda
@needs_hopper
@needs_fp8
@pytest.mark.parametrize("n,k,kernel_taken", [(3584, 1024, True), (1024, 7168, False)], ids=["fc2", "fc1"])
def test_cuda_auto_takes_sm90_for_the_hybrid_input_gradient(n, k, kernel_taken, caplog, monkeypatch, seed):
    """The FP8 backward's input-gradient product under HYBRID at Mixtral-
    small's shapes (8 experts, uneven counts): auto takes the kernel at
    fc2's (n = 3,584, k = 1,024: no cuBLASLt plan asked for, nothing noted)
    and cuBLASLt at fc1's (k = 7,168, where the promoted kernel measured
    0.78-0.90x: plans asked for, nothing noted either, cuBLASLt being the
    faster route there); either holds twice cuBLASLt's fast_accum=False
    error against the float64 product (computed on the GPU)."""
    import importlib

    from seqfuse.common import notes

    monkeypatch.setattr(notes, "_noted", set())
    monkeypatch.delenv("SEQFUSE_GROUPED_KERNEL", raising=False)
    gemm_mod = importlib.import_module("seqfuse.ops.gemm")  # the module (seqfuse.ops.gemm is the op)
    draw = torch.multinomial(torch.ones(8), 128, replacement=True)
    splits = [16 * int(c) for c in torch.bincount(draw, minlength=8)]
    dy = torch.randn(sum(splits), k, device="cuda").to(torch.float8_e5m2)
    w_t = (torch.randn(8, n, k, device="cuda") * 4).to(torch.float8_e4m3fn)
    sx, sw = torch.rand(8, device="cuda") + 0.5, torch.rand(8, device="cuda") + 0.5
    gemm_mod.plan_cache_clear()
    q0 = gemm_mod.heuristic_queries()
    with caplog.at_level(logging.INFO, logger="seqfuse"):
        y = _fp8_call(dy, w_t, splits, sx, sw, False, None)
    assert (gemm_mod.heuristic_queries() == q0) == kernel_taken
    assert not [r for r in caplog.records if "not the sm90 kernel" in r.getMessage()]
    lt = _fp8_call(dy, w_t, splits, sx, sw, False, "cublaslt")
    ends = torch.tensor(splits).cumsum(0).tolist()
    ref = torch.cat([(dy[lo:hi].double() @ w_t[g].double().T) * (sx[g] * sw[g]).double()
                     for g, (lo, hi) in enumerate(zip([0] + ends[:-1], ends))])
    assert rel_error(y, ref) <= torch_bound(rel_error(lt, ref), floor=rel_tol(torch.bfloat16) / 4)


@pytest.mark.cuda
@needs_hopper
@needs_fp8
def test_cuda_forced_sm90_refuses_e4m3_times_e5m2():
    """e5m2 is taken as a (the gradient), not as b: the rule is named."""
    splits = [32, 16]
    xq = torch.randn(48, 64, device="cuda").to(torch.float8_e4m3fn)
    wq = torch.randn(2, 32, 64, device="cuda").to(torch.float8_e5m2)
    s = torch.ones(2, device="cuda")
    with pytest.raises(ValueError, match="kernel='sm90' cannot take this call: it takes bfloat16 x bfloat16, "
                                         "float8_e4m3fn x float8_e4m3fn or float8_e5m2 x float8_e4m3fn"):
        _fp8_call(xq, wq, splits, s, s, False, "sm90")


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize("why,call", [
    ("it takes no bias and no accumulate",
     lambda x, w, s: moe.grouped_gemm(x, w, s, transb=True, bias=torch.zeros(len(s), w.shape[1], device="cuda",
                                                                           dtype=x.dtype), kernel="sm90")),
    ("it takes transa=0 and transb=1 only",
     lambda x, w, s: moe.grouped_gemm(x, w.transpose(1, 2).contiguous(), s, kernel="sm90")),
    ("it takes bfloat16 x bfloat16, float8_e4m3fn x float8_e4m3fn or float8_e5m2 x float8_e4m3fn operands "
     "\\(a x b\\) and a bfloat16 out",
     lambda x, w, s: moe.grouped_gemm(x.half(), w.half(), s, transb=True, kernel="sm90")),
    ("the kernel needs k a positive multiple of 8",
     lambda x, w, s: moe.grouped_gemm(x[:, :12], w[:, :, :12], s, transb=True, kernel="sm90")),
    ("it takes a and out with unit column stride",
     lambda x, w, s: moe.grouped_gemm(x.t().contiguous().t(), w, s, transb=True, kernel="sm90")),
    ("its groups' b are not all 2-D of one dtype",
     lambda x, w, s: moe.grouped_gemm(x, [w[0], w[1].half()], s, transb=True, kernel="sm90")),
    ("the product is empty",
     lambda x, w, s: moe.grouped_gemm(x[:0], w, [0, 0], transb=True, kernel="sm90")),
    ("it takes at most 64 groups",
     lambda x, w, s: moe.grouped_gemm(x, w[:1].expand(65, -1, -1), [0] * 64 + [sum(s)], transb=True,
                                      kernel="sm90")),
])
def test_cuda_forced_sm90_names_the_rule(why, call):
    splits = [32, 16]
    x, w = _inputs(splits, 64, 32, device="cuda")
    with pytest.raises(ValueError, match=f"kernel='sm90' cannot take this call: {why}"):
        call(x, w, splits)


@pytest.mark.cuda
@needs_hopper
def test_cuda_sm90_refuses_a_bad_group_as_cublaslt_does():
    splits = [64, 64, 64]
    x, w = _inputs(splits, 64, 32, device="cuda")
    bad = list(w.unbind(0))
    bad[1] = torch.randn(32, 48, dtype=torch.bfloat16, device="cuda")
    for kernel in ("sm90", "auto", "cublaslt"):
        with pytest.raises(ValueError, match="group 1 \\(m_splits\\[1\\] = 64\\)"):
            moe.grouped_gemm(x, bad, splits, transb=True, kernel=kernel)


@pytest.mark.cuda
@needs_hopper
@needs_fp8
def test_cuda_auto_fp8_takes_sm90_and_says_nothing_of_an_empty_call(caplog, monkeypatch, seed):
    """e4m3 calls of the kernel's form take it under auto, whatever their
    groups' sizes (no cuBLASLt plan asked for); a call with no rows at all
    (an idle expert-parallel rank) has nothing to run and logs nothing."""
    import importlib

    from seqfuse.common import notes

    monkeypatch.setattr(notes, "_noted", set())
    gemm_mod = importlib.import_module("seqfuse.ops.gemm")  # the module (seqfuse.ops.gemm is the op)
    splits = [4096, 0, 4096]  # 32 x 16 tiles of 128 x 256 a group: more than two waves, bf16 would take cuBLASLt
    k, n = 64, 4096
    xq = torch.randn(sum(splits), k, device="cuda").to(torch.float8_e4m3fn)
    wq = torch.randn(len(splits), n, k, device="cuda").to(torch.float8_e4m3fn)
    s = torch.ones(len(splits), device="cuda")
    q0 = gemm_mod.heuristic_queries()
    with caplog.at_level(logging.INFO, logger="seqfuse"):
        y = moe.grouped_gemm(xq, wq, splits, transb=True, a_scale_inv=s, b_scale_inv=s, fast_accum=True)
        empty = moe.grouped_gemm(xq[:0], wq, [0, 0, 0], transb=True, a_scale_inv=s, b_scale_inv=s, fast_accum=True)
    assert gemm_mod.heuristic_queries() == q0 and y.shape == (8192, n) and empty.shape == (0, n)
    ref = moe.grouped_gemm(xq, wq, splits, transb=True, a_scale_inv=s, b_scale_inv=s, fast_accum=True,
                           kernel="cublaslt")
    assert rel_error(y, ref) <= pair_tol(torch.bfloat16)
    assert not [r for r in caplog.records if "not the sm90 kernel" in r.getMessage()]


@pytest.mark.cuda
@needs_hopper
def test_cuda_auto_takes_sm90_and_logs_why_not_once(caplog, monkeypatch):
    from seqfuse import _C
    from seqfuse.common import notes

    monkeypatch.setattr(notes, "_noted", set())
    monkeypatch.delenv("SEQFUSE_GROUPED_KERNEL", raising=False)
    splits = [32, 16]
    x, w = _inputs(splits, 64, 32, device="cuda")
    out = torch.empty(48, 32, dtype=torch.bfloat16, device="cuda")
    args = (x, list(w.unbind(0)), out, splits, 0, 1, None, None, 0, 0, None, 0, 0, 0, 1, None, 0)
    import importlib

    gemm_mod = importlib.import_module("seqfuse.ops.gemm")  # the module (seqfuse.ops.gemm is the op)
    gemm_mod.plan_cache_clear()
    q0 = gemm_mod.heuristic_queries()
    assert _C.grouped_gemm(*args, 0) is None  # auto, small groups: the kernel ran (no cuBLASLt plan asked for)
    assert _C.grouped_gemm(*args, 2) is None
    assert gemm_mod.heuristic_queries() == q0
    # bf16, 32 x 16 tiles of 128 x 256 a group: more than two waves of an H100's or H200's 132 SMs each, where
    # one cuBLASLt call a group is the faster route
    big = [4096, 4096]
    xb, wb = _inputs(big, 64, 4096, device="cuda")
    moe.grouped_gemm(xb, wb, big, transb=True, kernel="auto")
    assert gemm_mod.heuristic_queries() > q0  # auto chose cuBLASLt
    # of the kernel's form but not its rules (k = 12 is not a multiple of 8): cuBLASLt, said once
    x12, w12 = x[:, :12].contiguous(), w[:, :, :12].contiguous()
    assert _C.grouped_gemm(x12, list(w12.unbind(0)), out, splits, 0, 1, None, None, 0, 0, None, 0, 0, 0, 1, None,
                           0, 0).startswith("the kernel needs k a positive multiple of 8")
    with caplog.at_level(logging.INFO, logger="seqfuse"):
        for _ in range(2):
            moe.grouped_gemm(x12, w12, splits, transb=True)
            moe.grouped_gemm(torch.randn_like(out), w, splits)  # dgrad form: cuBLASLt is its route, nothing to say
    lines = [r.getMessage() for r in caplog.records if "not the sm90 kernel" in r.getMessage()]
    assert len(lines) == 1 and "multiple of 8" in lines[0]


@pytest.mark.cuda
@needs_hopper
def test_cuda_sm90_on_a_side_stream_in_a_graph_and_after_earlier_work(seed):
    splits = [96, 0, 300, 17, 64]
    k, n = 128, 264
    x, w = _inputs(splits, k, n)
    xc, wl = x.cuda(), list(w.cuda().unbind(0))
    ref = moe.grouped_gemm(x, w, splits, transb=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y_side = moe.grouped_gemm(xc, wl, splits, transb=True, kernel="sm90")
    torch.cuda.current_stream().wait_stream(side)
    assert rel_error(y_side, ref) <= pair_tol(torch.bfloat16)

    static_x, static_y = xc.clone(), torch.empty(sum(splits), n, dtype=torch.bfloat16, device="cuda")
    moe.grouped_gemm(static_x, wl, splits, transb=True, out=static_y, kernel="sm90")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe.grouped_gemm(static_x, wl, splits, transb=True, out=static_y, kernel="sm90")
    x2 = torch.randn_like(x)
    static_x.copy_(x2.cuda())
    static_y.fill_(float("nan"))
    graph.replay()
    assert rel_error(static_y, moe.grouped_gemm(x2, w, splits, transb=True)) <= pair_tol(torch.bfloat16)

    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)  # the caller's stream busy, then the input rewritten
    x3 = torch.randn_like(x)
    xc.copy_(x3.cuda(), non_blocking=True)
    y = moe.grouped_gemm(xc, wl, splits, transb=True, kernel="sm90")
    assert rel_error(y, moe.grouped_gemm(x3, w, splits, transb=True)) <= pair_tol(torch.bfloat16)


@pytest.mark.cuda
@needs_hopper
def test_cuda_sm90_at_mixtral_small_shapes_matches_cublaslt(seed):
    """The benchmark's shapes (8 experts, uneven counts), against cuBLASLt."""
    torch.manual_seed(0)
    draw = torch.multinomial(torch.ones(8), 512, replacement=True)
    splits = [16 * int(c) for c in torch.bincount(draw, minlength=8)]
    for n, k in ((7168, 1024), (1024, 3584)):
        x, w = _inputs(splits, k, n, device="cuda")
        wl = list(w.unbind(0))
        y = moe.grouped_gemm(x, wl, splits, transb=True, kernel="sm90")
        lt = moe.grouped_gemm(x, wl, splits, transb=True, kernel="cublaslt")
        assert rel_error(y, lt) <= pair_tol(torch.bfloat16)


# ---- the groups' ends in a tensor (_C.grouped_gemm_device_ends) ---------------------------------------

def _ends_call(x, w, ends, out, sx=None, sw=None):
    from seqfuse import _C

    return _C.grouped_gemm_device_ends(x, w, torch.tensor(ends, dtype=torch.int32, device=x.device), sx, sw, out)


@pytest.mark.parametrize("splits,extra", [([0, 200, 57], 0), ([16, 30, 0, 1, 64], 40), ([0, 0], 9)],
                         ids=["ragged", "rows_past_the_ends", "all_empty"])
def test_device_ends_cpu_is_the_host_split_product(splits, extra, seed):
    """On the CPU the ends are read on the host: the product equals
    grouped_gemm over host splits bit for bit, and rows past the last end
    stay as they were."""
    k, n = 24, 40
    x, w = _inputs(splits, k, n)
    x = torch.cat([x, torch.randn(extra, k).bfloat16()])
    out = torch.full((x.shape[0], n), float("nan"), dtype=torch.bfloat16)
    ends = torch.tensor(splits).cumsum(0).tolist()
    _ends_call(x, w, ends, out)
    rows = sum(splits)
    if rows:
        assert torch.equal(out[:rows], moe.grouped_gemm(x[:rows], w, splits, transb=True))
    assert torch.isnan(out[rows:]).all()


@needs_fp8
def test_device_ends_cpu_fp8_takes_any_row_count_and_n(seed):
    """The kernel takes FP8 groups of any row count and n a multiple of 8;
    so does the CPU path (each group padded to sf_gemm's 16 internally): the
    float64 product within bf16 rounding, rows past the last end untouched."""
    splits = [8, 0, 19, 5]
    k, n = 32, 24
    xq = torch.randn(sum(splits) + 7, k).to(torch.float8_e4m3fn)
    wq = torch.randn(len(splits), n, k).to(torch.float8_e4m3fn)
    sx, sw = torch.rand(len(splits)) + 0.5, torch.rand(1) + 0.5
    out = torch.full((xq.shape[0], n), float("nan"), dtype=torch.bfloat16)
    _ends_call(xq, wq, torch.tensor(splits).cumsum(0).tolist(), out, sx, sw)
    ends = torch.tensor(splits).cumsum(0).tolist()
    ref = torch.cat([(xq[lo:hi].double() @ wq[g].double().T) * sx[g].item() * sw[0].item()
                     for g, (lo, hi) in enumerate(zip([0] + ends[:-1], ends))])
    assert rel_error(out[:sum(splits)], ref) <= pair_tol(torch.bfloat16) / 2
    assert torch.isnan(out[sum(splits):]).all()


@needs_fp8
def test_device_ends_cpu_fp8_is_the_host_split_product(seed):
    splits = [48, 0, 16, 32]
    k, n = 32, 48
    xq = torch.randn(sum(splits), k).to(torch.float8_e4m3fn)
    wq = torch.randn(len(splits), n, k).to(torch.float8_e4m3fn)
    sx, sw = torch.rand(len(splits)) + 0.5, torch.rand(len(splits)) + 0.5
    out = torch.empty(sum(splits), n, dtype=torch.bfloat16)
    _ends_call(xq, wq, torch.tensor(splits).cumsum(0).tolist(), out, sx, sw)
    ref = moe.grouped_gemm(xq, wq, splits, transb=True, a_scale_inv=sx, b_scale_inv=sw, fast_accum=True)
    assert torch.equal(out, ref)


def test_device_ends_are_clamped_as_the_kernel_clamps_them(seed):
    """An end below the previous one is the previous one (an empty group);
    one past a's rows is a's rows."""
    k, n = 16, 16
    x, w = _inputs([10, 10, 10], k, n)
    out = torch.zeros(30, n, dtype=torch.bfloat16)
    _ends_call(x, w, [20, 5, 99], out)
    assert torch.equal(out, moe.grouped_gemm(x, w, [20, 0, 10], transb=True))


@pytest.mark.parametrize("change,error,match", [
    (dict(ends=torch.tensor([1, 2], dtype=torch.int64)), TypeError, "row_end"),
    (dict(ends=torch.tensor([1, 2, 3], dtype=torch.int32)), ValueError, "one end row per group \\(2\\)"),
    (dict(w=torch.zeros(2, 8, 24).bfloat16()), ValueError, "do not agree"),
    (dict(x=torch.zeros(16, 16)), TypeError, "a and b must both be bfloat16 or both float8_e4m3fn"),
    (dict(sx=torch.ones(2)), ValueError, "bfloat16 ones neither"),
    (dict(out=torch.zeros(16, 8)), TypeError, "argument 'out'"),
    (dict(x=torch.zeros(16, 32).bfloat16()[:, ::2]), ValueError, "argument 'a' must have unit stride"),
    (dict(x=torch.zeros(16, 8).to(torch.float8_e4m3fn), w=torch.zeros(2, 8, 8).to(torch.float8_e4m3fn),
          sx=torch.ones(2), sw=torch.ones(2)), ValueError, "float8 operands need K a multiple of 16"),
    (dict(sx=torch.ones(3), sw=torch.ones(3), x=torch.zeros(16, 16).to(torch.float8_e4m3fn),
          w=torch.zeros(2, 8, 16).to(torch.float8_e4m3fn)), ValueError,
     "grouped_gemm_device_ends: argument 'a_scale_inv' must hold one scale inverse per group"),
    (dict(w=torch.zeros(65, 8, 16).bfloat16(), ends=torch.arange(65, dtype=torch.int32)), ValueError,
     "1 to 64 groups"),
])
def test_device_ends_bad_inputs(change, error, match):
    from seqfuse import _C

    args = dict(x=torch.zeros(16, 16).bfloat16(), w=torch.zeros(2, 8, 16).bfloat16(),
                ends=torch.tensor([8, 16], dtype=torch.int32), sx=None, sw=None,
                out=torch.zeros(16, 8).bfloat16())
    args.update(change)
    with pytest.raises(error, match=match):
        _C.grouped_gemm_device_ends(args["x"], args["w"], args["ends"], args["sx"], args["sw"], args["out"])


def test_device_ends_out_must_be_its_own_memory():
    """out may not be an input (it is written while they are read) nor an
    expanded view (elements sharing memory)."""
    from seqfuse import _C

    x, w = torch.zeros(16, 16).bfloat16(), torch.zeros(2, 16, 16).bfloat16()
    ends = torch.tensor([8, 16], dtype=torch.int32)
    with pytest.raises(ValueError, match="output 'out' shares memory with input 'a'"):
        _C.grouped_gemm_device_ends(x, w, ends, None, None, x)
    with pytest.raises(ValueError, match="argument 'out' is an output whose elements may overlap"):
        _C.grouped_gemm_device_ends(x, w, ends, None, None, torch.zeros(1, 16).bfloat16().expand(16, 16))


def test_grouped_gemm_device_kernel_argument():
    x, w = torch.zeros(16, 16).bfloat16(), torch.zeros(2, 8, 16).bfloat16()
    offs = torch.tensor([8, 16], dtype=torch.int32)
    with pytest.raises(ValueError, match="argument 'kernel' must be None, 'torch' or 'sm90', got 'fast'"):
        moe.grouped_gemm_device(x, w, offs, transb=True, kernel="fast")
    with pytest.raises(ValueError, match="kernel='sm90' takes the forward form only"):
        moe.grouped_gemm_device(x, w, offs, kernel="sm90")


@pytest.mark.cuda
@needs_hopper
@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="the reference is torch._grouped_mm")
@pytest.mark.parametrize("splits", [[0, 200, 57, 1000], [4096] * 8], ids=["ragged", "eight_full_groups"])
def test_cuda_device_ends_sm90_matches_torch_grouped_mm(splits, seed):
    """kernel='sm90' reads the offsets on the device: the product equals
    torch._grouped_mm's within bf16 rounding, and torch sees no host
    synchronization in the call (a CUDA call of seqfuse's own would not be
    seen by this check: the C entry makes none)."""
    from helpers import no_host_sync

    k, n = 256, 512
    x, w = _inputs(splits, k, n, device="cuda")
    counts = torch.tensor(splits, device="cuda")
    offs = moe.device_split_offsets(counts, x.shape[0])
    with no_host_sync():
        y = moe.grouped_gemm_device(x, w, offs, transb=True, kernel="sm90")
    ref = moe.grouped_gemm_device(x, w, offs, transb=True)
    assert rel_error(y, ref) <= pair_tol(torch.bfloat16)
