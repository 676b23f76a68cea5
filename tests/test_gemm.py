"""seqfuse.ops.gemm: the CPU reference against float64 torch for every
precision, layout and epilogue; FP8 (per tensor and block scaled) against the
dequantized product; every bad input's error; and (cuda marker) cuBLASLt
against the CPU reference and torch, plan caching and graph capture."""
import importlib

import pytest
import torch

import seqfuse
from gemm_helpers import E4M3, E5M2, QUANTIZERS, dgelu_tanh, op, reference
from helpers import assert_close_rel, needs_fp8, pair_tol, rel_error

gemm = seqfuse.ops.gemm
gemm_mod = importlib.import_module("seqfuse.ops.gemm")  # the module; seqfuse.ops.gemm is the op

CPU_SHAPES = [(16, 32, 48), (5, 7, 3), (33, 17, 65), (1, 9, 1)]
FLOATS = [torch.float32, torch.float16, torch.bfloat16]


def make(shape, dtype, device="cpu", trans=False):
    """A random operand of logical shape `shape` (of op(x)), stored as
    op(x)^T when trans, scaled so the product stays near unit size."""
    r, c = shape
    x = torch.randn((c, r) if trans else (r, c), device=device) / max(1, min(r, c)) ** 0.25
    return x.to(dtype)


# ---- CPU reference -------------------------------------------------------

@pytest.mark.parametrize("mnk", CPU_SHAPES)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("transa", [False, True])
@pytest.mark.parametrize("transb", [False, True])
def test_cpu_layouts(mnk, dtype, transa, transb, seed):
    m, n, k = mnk
    a, b = make((m, k), dtype, trans=transa), make((k, n), dtype, trans=transb)
    out = gemm(a, b, transa=transa, transb=transb)
    assert out.dtype == dtype and out.shape == (m, n)
    ref, _ = reference(a, b, transa, transb)
    assert_close_rel(out, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cpu_fp32_output(dtype, seed):
    a, b = make((24, 40), dtype), make((40, 8), dtype)
    out = gemm(a, b, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    assert rel_error(out, reference(a, b)[0]) < 1e-5  # no output rounding


def test_cpu_views_column_major_and_sliced(seed):
    base = torch.randn(40, 70)
    a = base[3:20, 5:37]            # [17, 32] with row stride 70
    b = torch.randn(50, 32)[:, :].t()  # [32, 50] column-major
    out = gemm(a, b)
    assert_close_rel(out, reference(a, b)[0], torch.float32)
    out_big = torch.full((17, 64), float("nan"))
    out_view = out_big[:, 7:57]     # row stride 64
    gemm(a, b, out=out_view)
    assert_close_rel(out_view, reference(a, b)[0], torch.float32)
    assert torch.isnan(out_big[:, :7]).all() and torch.isnan(out_big[:, 57:]).all()


def test_cpu_alpha_and_accumulate(seed):
    a, b = make((12, 20), torch.bfloat16), make((20, 16), torch.bfloat16)
    main_grad = torch.randn(12, 16)
    before = main_grad.clone()
    r = gemm(a, b, out=main_grad, accumulate=True, alpha=0.5)
    assert r is main_grad
    ref = 0.5 * reference(a, b)[0] + before.double()
    assert rel_error(main_grad, ref) < 1e-6


@pytest.mark.parametrize("epilogue", ["none", "gelu", "gelu_aux"])
@pytest.mark.parametrize("dtype", FLOATS)
def test_cpu_forward_epilogues(epilogue, dtype, seed):
    m, n, k = 20, 24, 36
    a, b = make((m, k), dtype), make((n, k), dtype, trans=False)
    bias = torch.randn(n).to(dtype)
    res = gemm(a, b, transb=True, bias=bias, epilogue=epilogue)
    ref, extra = reference(a, b, False, True, bias=bias, epilogue=epilogue)
    if epilogue == "gelu_aux":
        out, aux = res
        assert aux.dtype == dtype and aux.shape == (m, n)
        assert_close_rel(aux, extra, dtype)
    else:
        out = res
    assert_close_rel(out, ref, dtype)
    # without a bias too
    res = gemm(a, b, transb=True, epilogue=epilogue)
    out = res[0] if isinstance(res, tuple) else res
    assert_close_rel(out, reference(a, b, False, True, epilogue=epilogue)[0], dtype)


@pytest.mark.parametrize("dtype", FLOATS)
def test_cpu_backward_epilogues(dtype, seed):
    m, n, k = 18, 20, 28
    dy, w = make((m, k), dtype), make((k, n), dtype)
    pre = torch.randn(m, n).to(dtype)
    out = gemm(dy, w, epilogue="dgelu", aux=pre)
    assert_close_rel(out, reference(dy, w, epilogue="dgelu", aux=pre)[0], dtype)
    out, dbias = gemm(dy, w, epilogue="dgelu_bgrad", aux=pre)
    ref, ref_db = reference(dy, w, epilogue="dgelu_bgrad", aux=pre)
    assert_close_rel(out, ref, dtype)
    assert dbias.shape == (n,)
    assert_close_rel(dbias, ref_db, dtype)
    # bgrad: the weight-gradient GEMM dW = dy^T x with db = sum over tokens of dy
    x = make((k, n), dtype)
    dy_t = make((k, m), dtype)  # [tokens, out]
    dw, db = gemm(dy_t, x, transa=True, epilogue="bgrad")
    ref, ref_db = reference(dy_t, x, True, False, epilogue="bgrad")
    assert_close_rel(dw, ref, dtype)
    assert db.shape == (m,)
    assert_close_rel(db, ref_db, dtype)


def test_cpu_dgelu_matches_formula():
    x = torch.linspace(-6, 6, 101, dtype=torch.float64)
    g = dgelu_tanh(x)
    ones = torch.ones(101, 1)
    out = gemm(ones, torch.ones(1, 1), epilogue="dgelu", aux=x.float().view(101, 1))
    assert torch.allclose(out.double().view(-1), g, atol=1e-6)


def test_cpu_empty_products():
    a = torch.randn(0, 8)
    assert gemm(a, torch.randn(8, 5)).shape == (0, 5)
    a, b = torch.randn(4, 0), torch.randn(0, 3)
    assert torch.equal(gemm(a, b), torch.zeros(4, 3))
    bias = torch.randn(3)
    assert torch.allclose(gemm(a, b, bias=bias), bias.expand(4, 3))
    acc = torch.randn(4, 3)
    before = acc.clone()
    gemm(a, b, out=acc, accumulate=True)
    assert torch.equal(acc, before)
    dw, db = gemm(torch.randn(0, 6), torch.randn(0, 5), transa=True, epilogue="bgrad")
    assert torch.equal(dw, torch.zeros(6, 5)) and torch.equal(db, torch.zeros(6))


# ---- FP8 on the CPU reference -------------------------------------------

@pytest.mark.parametrize("fmts", [(E4M3, E4M3), (E4M3, E5M2), (E5M2, E4M3)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_cpu_fp8_tensor_scaled(fmts, out_dtype, seed):
    m, n, k = 32, 48, 64
    x, w = torch.randn(m, k), torch.randn(n, k) * 0.02
    qa, sa, da = QUANTIZERS["tensor"](x, fmts[0])
    qb, sb, db = QUANTIZERS["tensor"](w, fmts[1])
    out = gemm(qa, qb, transb=True, a_scale_inv=sa, b_scale_inv=sb, out_dtype=out_dtype)
    assert out.dtype == out_dtype
    ref, _ = reference(qa, qb, False, True, a_deq=da, b_deq=db)
    assert_close_rel(out, ref, torch.bfloat16 if out_dtype == torch.bfloat16 else torch.float32,
                     factor=1 if out_dtype == torch.bfloat16 else 10)
    # and bounded against the unquantized product
    assert rel_error(out, x.double() @ w.double().t()) < 0.1


@pytest.mark.parametrize("modes", [("block_1x128", "block_128x128"),
                                   ("block_1x128", "block_1x128"),
                                   ("block_128x128", "block_1x128")])
@pytest.mark.parametrize("mnk", [(32, 48, 256), (144, 16, 640)])
def test_cpu_fp8_block_scaled(modes, mnk, seed):
    m, n, k = mnk
    x = torch.randn(m, k) * torch.logspace(-2, 2, k)  # ranges that differ per block
    w = torch.randn(n, k) * 0.02
    qa, sa, da = QUANTIZERS[modes[0]](x)
    qb, sb, db = QUANTIZERS[modes[1]](w)
    out = gemm(qa, qb, transb=True, a_scale_inv=sa, b_scale_inv=sb, a_scaling=modes[0],
               b_scaling=modes[1], out_dtype=torch.float32)
    ref, _ = reference(qa, qb, False, True, a_deq=da, b_deq=db)
    assert rel_error(out, ref) < 1e-5
    # per-block scales are the point: a per-tensor scale would do far worse here
    assert rel_error(out, x.double() @ w.double().t()) < 0.08


def test_cpu_fp8_bias_and_accumulate(seed):
    m, n, k = 16, 32, 48
    qa, sa, da = QUANTIZERS["tensor"](torch.randn(m, k))
    qb, sb, db = QUANTIZERS["tensor"](torch.randn(n, k))
    bias = torch.randn(n).bfloat16()
    out = gemm(qa, qb, transb=True, a_scale_inv=sa, b_scale_inv=sb, bias=bias)
    assert_close_rel(out, reference(qa, qb, False, True, a_deq=da, b_deq=db, bias=bias)[0],
                     torch.bfloat16)
    acc = torch.randn(m, n)
    before = acc.clone()
    gemm(qa, qb, transb=True, a_scale_inv=sa, b_scale_inv=sb, out=acc, accumulate=True)
    ref = reference(qa, qb, False, True, a_deq=da, b_deq=db)[0] + before.double()
    assert rel_error(acc, ref) < 1e-6


@pytest.mark.parametrize("dtype", FLOATS)
def test_cpu_addend(dtype, seed):
    """out = op(a) @ op(b) (+ bias) + addend: the residual read in the epilogue
    (beta = 1 on another tensor), addend left as it was."""
    a, b = make((12, 20), dtype), make((20, 16), dtype, trans=True)
    c, bias = torch.randn(12, 16).to(dtype), torch.randn(16).to(dtype)
    before = c.clone()
    out = gemm(a, b, transb=True, bias=bias, addend=c)
    ref = reference(a, b, False, True, bias=bias)[0] + before.double()
    assert_close_rel(out, ref, dtype)
    assert torch.equal(c, before)


@needs_fp8
def test_fp8_addend_alignment_rule():
    """FP8 GEMMs take C 16-byte aligned (cuBLASLt's rule, checked on both backends)."""
    qa, sa, _ = QUANTIZERS["tensor"](torch.randn(32, 64))
    qb, sb, _ = QUANTIZERS["tensor"](torch.randn(48, 64))
    shifted = torch.empty(32 * 48 + 1, dtype=torch.bfloat16)[1:].view(32, 48)
    with pytest.raises(ValueError, match="gemm: argument 'addend' must be 16-byte aligned"):
        gemm_mod.fp8_gemm_nt(qa, sa, None, qb, sb, None, torch.empty(32, 48, dtype=torch.bfloat16), addend=shifted)


@needs_fp8
def test_cpu_fp8_addend(seed):
    m, n, k = 32, 48, 64
    qa, sa, da = QUANTIZERS["tensor"](torch.randn(m, k))
    qb, sb, db = QUANTIZERS["tensor"](torch.randn(n, k))
    c = torch.randn(m, n).bfloat16()
    out = gemm_mod.fp8_gemm_nt(qa, sa, None, qb, sb, None, torch.empty(m, n, dtype=torch.bfloat16), addend=c,
                               fast_accum=True)
    ref = reference(qa, qb, False, True, a_deq=da, b_deq=db)[0] + c.double()
    assert_close_rel(out, ref, torch.bfloat16)


def test_error_addend():
    a, b, c = torch.randn(5, 7), torch.randn(7, 3), torch.randn(5, 3)
    with pytest.raises(ValueError, match="gemm: arguments 'accumulate' and 'addend' exclude each other"):
        gemm(a, b, out=c.clone(), accumulate=True, addend=c)
    with pytest.raises(ValueError, match=r"gemm: arguments 'accumulate' and 'addend' exclude each other"):
        gemm(torch.randn(5, 0), torch.randn(0, 3), out=c.clone(), accumulate=True, addend=c)
    with pytest.raises(ValueError, match=r"gemm: argument 'addend' must have shape \[m, n\] = \[5, 3\]"):
        gemm(a, b, addend=torch.randn(5, 4))
    with pytest.raises(TypeError, match="gemm: argument 'addend' must have dtype float32, got bfloat16"):
        gemm(a, b, addend=c.bfloat16())
    with pytest.raises(ValueError, match=r"gemm: argument 'addend' must have out's row stride \(3 elements\), "
                                         r"got 6"):
        gemm(a, b, addend=torch.randn(5, 6)[:, :3])
    big = torch.randn(6, 3)
    for out, addend in ((big[1:], big[:5]), (c, c)):
        with pytest.raises(ValueError, match="gemm: argument 'addend' shares memory with 'out' .* pass "
                                             "accumulate=True"):
            gemm(a, b, out=out, addend=addend)
    # (an empty product gets the C entry's checks too, worded as for any product)
    with pytest.raises(ValueError, match=r"gemm: argument 'addend' must have shape \[m, n\] = \[5, 3\]"):
        gemm(torch.randn(5, 0), torch.randn(0, 3), addend=torch.randn(3, 5))
    aux = torch.empty(5, 3)
    with pytest.raises(ValueError, match="gemm: argument 'addend' shares memory with 'aux', which the epilogue writes"):
        gemm(a, b, epilogue="gelu_aux", aux=aux, addend=aux)
    grad_bias = torch.empty(20)  # bgrad writes op(a)'s row sums [m] into bias; the addend over its memory
    with pytest.raises(ValueError, match="gemm: argument 'addend' shares memory with 'bias', which the epilogue writes"):
        gemm(a, b, epilogue="bgrad", bias=grad_bias[:5], addend=grad_bias[2:17].view(5, 3))


# ---- errors ----------------------------------------------------------------

def test_error_dtypes():
    with pytest.raises(TypeError, match="gemm: argument 'a' must have dtype float32, float16, "
                                        "bfloat16, float8_e4m3fn or float8_e5m2, got int32"):
        gemm(torch.ones(2, 2, dtype=torch.int32), torch.ones(2, 2, dtype=torch.int32))
    with pytest.raises(TypeError, match=r"arguments 'a' \(float32\) and 'b' \(bfloat16\) must have "
                                        "the same dtype"):
        gemm(torch.ones(2, 2), torch.ones(2, 2, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="argument 'out' must have dtype bfloat16 \\(the operands'\\) "
                                        "or float32, got float16"):
        gemm(torch.ones(2, 2).bfloat16(), torch.ones(2, 2).bfloat16(), out_dtype=torch.float16)
    q = torch.zeros(16, 16, dtype=E5M2)
    s = torch.ones(1)
    with pytest.raises(TypeError, match="float8_e5m2 x float8_e5m2 is not supported"):
        gemm(q, q, transb=True, a_scale_inv=s, b_scale_inv=s)
    with pytest.raises(TypeError, match="argument 'a' must be a torch.Tensor, got list"):
        gemm([[1.0]], torch.ones(1, 1))
    with pytest.raises(TypeError, match="argument 'workspace' must be a contiguous 1-D uint8"):
        gemm(torch.ones(2, 2), torch.ones(2, 2), workspace=torch.ones(4))


def test_error_shapes_and_strides():
    with pytest.raises(ValueError, match=r"inner dimensions differ: op\(a\) is \[3, 4\] but "
                                         r"op\(b\) is \[5, 2\]"):
        gemm(torch.ones(3, 4), torch.ones(5, 2))
    with pytest.raises(ValueError, match=r"argument 'out' must have shape \[m, n\] = \[3, 2\]"):
        gemm(torch.ones(3, 4), torch.ones(4, 2), out=torch.empty(2, 3))
    with pytest.raises(ValueError, match="argument 'out' must be row-major"):
        gemm(torch.ones(3, 4), torch.ones(4, 2), out=torch.empty(2, 3).t())
    with pytest.raises(ValueError, match="argument 'a' must be row- or column-major"):
        gemm(torch.ones(6, 8)[::2, ::2], torch.ones(4, 2))
    with pytest.raises(ValueError, match="argument 'a' must be row- or column-major"):
        gemm(torch.ones(1, 4).expand(3, 4), torch.ones(4, 2))
    with pytest.raises(ValueError, match="arguments 'a' and 'b' must be 2-D"):
        gemm(torch.ones(2, 3, 4), torch.ones(4, 2))


def test_error_epilogue_arguments():
    a, b = torch.ones(3, 4), torch.ones(4, 2)
    with pytest.raises(ValueError, match="argument 'epilogue' must be one of"):
        gemm(a, b, epilogue="relu")
    with pytest.raises(ValueError, match="epilogue 'dgelu' needs argument 'aux'"):
        gemm(a, b, epilogue="dgelu")
    with pytest.raises(ValueError, match="argument 'bias' given but epilogue 'dgelu' takes none"):
        gemm(a, b, epilogue="dgelu", aux=torch.ones(3, 2), bias=torch.ones(2))
    with pytest.raises(ValueError, match="argument 'bias' must be 1-D of length 2"):
        gemm(a, b, bias=torch.ones(3))
    with pytest.raises(TypeError, match="argument 'bias' must have dtype float32, got bfloat16"):
        gemm(a, b, bias=torch.ones(2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"argument 'aux' must have shape \[m, n\] = \[3, 2\]"):
        gemm(a, b, epilogue="dgelu", aux=torch.ones(2, 3))
    with pytest.raises(ValueError, match="argument 'aux' given but epilogue 'none' takes none"):
        seqfuse._C.gemm(a, b, torch.empty(3, 2), 0, 0, None, None, 0, 0, None, torch.ones(3, 2),
                        0, 0, 0, 1, 1.0, None, 0, 0)


@needs_fp8
def test_error_fp8_rules():
    s = torch.ones(1)
    qa, qb = torch.zeros(32, 100, dtype=E4M3), torch.zeros(48, 100, dtype=E4M3)
    with pytest.raises(ValueError, match=r"multiples of 16 \(cuBLASLt's FP8 kernels\); got k = 100 "
                                         r"\(the inner dimension\); pad it to 112"):
        gemm(qa, qb, transb=True, a_scale_inv=s, b_scale_inv=s)
    qa, qb = torch.zeros(24, 64, dtype=E4M3), torch.zeros(48, 64, dtype=E4M3)
    with pytest.raises(ValueError, match="got m = 24 .*pad it to 32"):
        gemm(qa, qb, transb=True, a_scale_inv=s, b_scale_inv=s)
    qa, qb = torch.zeros(32, 64, dtype=E4M3), torch.zeros(64, 48, dtype=E4M3)
    with pytest.raises(ValueError, match="float8 operands must both be K-major .*'TN' layout"):
        gemm(qa, qb, a_scale_inv=s, b_scale_inv=s)
    qb = torch.zeros(48, 64, dtype=E4M3)
    with pytest.raises(ValueError, match="need 'a_scale_inv' and 'b_scale_inv'"):
        gemm(qa, qb, transb=True)
    with pytest.raises(NotImplementedError, match="128x128 block scales on both operands"):
        gemm(qa, qb, transb=True, a_scale_inv=torch.ones(1, 4), b_scale_inv=torch.ones(1, 4),
             a_scaling="block_128x128", b_scaling="block_128x128")
    with pytest.raises(NotImplementedError, match="fast_accum is not available with block scales"):
        gemm(qa, qb, transb=True, a_scale_inv=torch.ones(1, 32), b_scale_inv=torch.ones(1, 48),
             a_scaling="block_1x128", b_scaling="block_1x128", fast_accum=True)
    with pytest.raises(NotImplementedError, match="per-tensor scaled operand cannot meet a block"):
        gemm(qa, qb, transb=True, a_scale_inv=s, b_scale_inv=torch.ones(1, 48),
             b_scaling="block_1x128")
    with pytest.raises(ValueError, match=r"'b_scale_inv' \(1x128 block scales\) must have shape "
                                         r"\[ceil\(k/128\), rows\] = \[1, 48\]"):
        gemm(qa, qb, transb=True, a_scale_inv=torch.ones(1, 32), b_scale_inv=torch.ones(48, 1),
             a_scaling="block_1x128", b_scaling="block_1x128")
    with pytest.raises(ValueError, match=r"\(128x128 block scales\) must have shape "
                                         r"\[ceil\(rows/128\), roundup\(ceil\(k/128\), 4\)\] = \[1, 4\]"):
        gemm(qa, qb, transb=True, a_scale_inv=torch.ones(1, 32), b_scale_inv=torch.ones(1, 1),
             a_scaling="block_1x128", b_scaling="block_128x128")
    with pytest.raises(ValueError, match="not a single element; name its layout"):
        gemm(qa, qb, transb=True, a_scale_inv=torch.ones(1, 32), b_scale_inv=s)
    with pytest.raises(ValueError, match="scale inverses and scaling modes apply to float8"):
        gemm(torch.ones(2, 2), torch.ones(2, 2), a_scale_inv=s, b_scale_inv=s)
    with pytest.raises(ValueError, match="fast_accum applies to float8 operands only"):
        gemm(torch.ones(2, 2), torch.ones(2, 2), fast_accum=True)
    with pytest.raises(TypeError, match="argument 'out' must have dtype bfloat16, float16 or "
                                        "float32 for float8 operands"):
        gemm(qa, qb, transb=True, a_scale_inv=s, b_scale_inv=s, out=torch.empty(32, 48, dtype=E4M3))


def test_error_readonly_bias_grad_ok():
    # bgrad writes bias: a fresh one is allocated when none is given
    out, db = gemm(torch.ones(3, 4), torch.ones(4, 2), epilogue="bgrad")
    assert torch.equal(db, torch.full((3,), 4.0))


# ---- CUDA ------------------------------------------------------------------

CUDA_SHAPES = [(128, 256, 64), (1000, 1000, 1000), (257, 129, 65), (16, 48, 4096), (1, 1, 1)]


def poisoned(shape, dtype, device="cuda"):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def check_cuda_vs_cpu(out_gpu, out_cpu, ref, dtype, factor=1.0):
    assert_close_rel(out_gpu, ref, dtype, factor=factor)
    # the GPU and the CPU reference agree about as well as each with float64
    tol = pair_tol(dtype, factor)
    assert rel_error(out_gpu, out_cpu.double()) <= tol


@pytest.mark.cuda
@pytest.mark.parametrize("mnk", CUDA_SHAPES)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("layout", [(False, False), (False, True), (True, False), (True, True)])
def test_cuda_layouts(mnk, dtype, layout, seed):
    m, n, k = mnk
    ta, tb = layout
    a, b = make((m, k), dtype, "cuda", ta), make((k, n), dtype, "cuda", tb)
    out = poisoned((m, n), dtype)
    gemm(a, b, transa=ta, transb=tb, out=out)
    cpu = gemm(a.cpu(), b.cpu(), transa=ta, transb=tb) if m * n * k <= 1 << 24 else None
    ref, _ = reference(a, b, ta, tb)
    # float32 may run on TF32 tensor cores (torch.backends.cuda.matmul.allow_tf32): 10-bit mantissa products
    factor = 300.0 if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 else 1.0
    assert_close_rel(out, ref, dtype, factor=factor)
    if cpu is not None:
        assert rel_error(out, cpu.double()) <= pair_tol(dtype, factor)
    torch_out = op(a, ta) @ op(b, tb)
    assert rel_error(out, torch_out.double()) <= pair_tol(dtype, factor)


def test_tf32_follows_torchs_switch_unless_given():
    from seqfuse.ops.gemm import tf32_of
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        for flag in (False, True):
            torch.backends.cuda.matmul.allow_tf32 = flag
            assert tf32_of(None, torch.float32) is flag
            assert tf32_of(None, torch.bfloat16) is False  # only float32 operands read the switch
            assert tf32_of(True, torch.float32) is True and tf32_of(False, torch.float32) is False
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


@pytest.mark.cuda
def test_cuda_fp32_default_is_torchs_switch(seed):
    """allow_tf32=None (the default): exact float32 while torch's switch is
    off (its default), TF32 once it is on."""
    a, b = make((300, 200), torch.float32, "cuda"), make((200, 100), torch.float32, "cuda")
    ref = reference(a, b)[0]
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        assert_close_rel(gemm(a, b), ref, torch.float32)
        torch.backends.cuda.matmul.allow_tf32 = True
        assert torch.equal(gemm(a, b), gemm(a, b, allow_tf32=True))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


@pytest.mark.cuda
def test_cuda_fp32_without_tf32(seed):
    a, b = make((300, 200), torch.float32, "cuda"), make((200, 100), torch.float32, "cuda")
    out = gemm(a, b, allow_tf32=False)
    assert_close_rel(out, reference(a, b)[0], torch.float32)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_fp32_out_accumulate(dtype, seed):
    a, b = make((512, 384), dtype, "cuda", True), make((384, 256), dtype, "cuda")
    main_grad = torch.randn(512, 256, device="cuda")
    before = main_grad.clone()
    gemm(a, b, transa=True, out=main_grad, accumulate=True)
    gemm(a, b, transa=True, out=main_grad, accumulate=True)
    ref = 2 * reference(a, b, True)[0] + before.double()
    assert rel_error(main_grad, ref) < 1e-5


@pytest.mark.cuda
@pytest.mark.parametrize("epilogue", ["none", "gelu", "gelu_aux"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("mnk", [(256, 512, 128), (200, 136, 72)])
def test_cuda_forward_epilogues(epilogue, dtype, mnk, seed):
    m, n, k = mnk
    x, w = make((m, k), dtype, "cuda"), make((n, k), dtype, "cuda")
    bias = torch.randn(n, device="cuda").to(dtype)
    out, aux = poisoned((m, n), dtype), poisoned((m, n), dtype)
    gemm(x, w, transb=True, bias=bias, epilogue=epilogue, out=out,
         aux=aux if epilogue == "gelu_aux" else None)
    ref, extra = reference(x, w, False, True, bias=bias, epilogue=epilogue)
    factor = 300.0 if dtype == torch.float32 else 1.0
    cpu = gemm(x.cpu(), w.cpu(), transb=True, bias=bias.cpu(), epilogue=epilogue)
    cpu_out = cpu[0] if isinstance(cpu, tuple) else cpu
    check_cuda_vs_cpu(out, cpu_out, ref, dtype, factor)
    if epilogue == "gelu_aux":
        check_cuda_vs_cpu(aux, cpu[1], extra, dtype, factor)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_backward_epilogues(dtype, seed):
    m, n, k = 384, 256, 512
    dy, w = make((m, k), dtype, "cuda"), make((k, n), dtype, "cuda")
    pre = torch.randn(m, n, device="cuda").to(dtype)
    out = poisoned((m, n), dtype)
    gemm(dy, w, epilogue="dgelu", aux=pre, out=out)
    check_cuda_vs_cpu(out, gemm(dy.cpu(), w.cpu(), epilogue="dgelu", aux=pre.cpu()),
                      reference(dy, w, epilogue="dgelu", aux=pre)[0], dtype)
    db = poisoned((n,), dtype)
    out, _ = gemm(dy, w, epilogue="dgelu_bgrad", aux=pre, bias=db)
    ref, ref_db = reference(dy, w, epilogue="dgelu_bgrad", aux=pre)
    assert_close_rel(out, ref, dtype)
    assert_close_rel(db, ref_db, dtype)
    # weight gradient with the bias gradient: dW = dy^T x, db = sum_tokens dy
    tokens = 1000
    dy2, x = make((n, tokens), dtype, "cuda", True), make((tokens, k), dtype, "cuda")
    db2 = poisoned((n,), dtype)
    dw, _ = gemm(dy2, x, transa=True, epilogue="bgrad", bias=db2)
    ref, ref_db = reference(dy2, x, True, False, epilogue="bgrad")
    assert_close_rel(dw, ref, dtype)
    assert_close_rel(db2, ref_db, dtype)


FP8_CUDA_SHAPES = [(128, 256, 512), (4096, 1024, 2048), (16, 48, 1280), (272, 144, 384)]


@pytest.mark.cuda
@pytest.mark.parametrize("mnk", FP8_CUDA_SHAPES)
@pytest.mark.parametrize("fmts", [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fast_accum", [False, True])
def test_cuda_fp8_tensor_scaled(mnk, fmts, out_dtype, fast_accum, seed):
    m, n, k = mnk
    x, w = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda") * 0.02
    qa, sa, da = QUANTIZERS["tensor"](x, fmts[0])
    qb, sb, db = QUANTIZERS["tensor"](w, fmts[1])
    out = poisoned((m, n), out_dtype)
    gemm(qa, qb, transb=True, a_scale_inv=sa, b_scale_inv=sb, out=out, fast_accum=fast_accum)
    ref, _ = reference(qa, qb, False, True, a_deq=da, b_deq=db)
    tol = 1e-2 if out_dtype == torch.bfloat16 else 2e-3
    assert rel_error(out, ref) < tol
    if m * n * k <= 1 << 27:
        cpu = gemm(qa.cpu(), qb.cpu(), transb=True, a_scale_inv=sa.cpu(), b_scale_inv=sb.cpu(),
                   out_dtype=out_dtype)
        assert rel_error(out, cpu.double()) < 2 * tol


@pytest.mark.cuda
@pytest.mark.parametrize("mnk", [(256, 512, 1024), (4096, 2048, 2048), (208, 136, 72)])
@pytest.mark.parametrize("fp8", [False, True])
def test_cuda_addend(mnk, fp8, seed):
    """cuBLASLt with C = addend (beta = 1) against the CPU reference and
    float64, bf16 and FP8 (e4m3 x e4m3, fast accumulation: the forward
    GEMM the modules add their residual in), with and without a bias; the
    addend unchanged."""
    m, n, k = mnk
    if fp8 and (m % 16 or n % 16 or k % 16):
        pytest.skip("FP8 needs multiples of 16")
    c = torch.randn(m, n, device="cuda").bfloat16()
    bias = torch.randn(n, device="cuda").bfloat16()
    before = c.clone()
    for bb in (None, bias):
        out = poisoned((m, n), torch.bfloat16)
        if fp8:
            qa, sa, da = QUANTIZERS["tensor"](torch.randn(m, k, device="cuda"))
            qb, sb, db = QUANTIZERS["tensor"](torch.randn(n, k, device="cuda") * 0.1)
            gemm_mod.fp8_gemm_nt(qa, sa, None, qb, sb, None, out, bias=bb, addend=c, fast_accum=True)
            ref = reference(qa, qb, False, True, a_deq=da, b_deq=db, bias=bb)[0] + c.double()
            cpu = gemm_mod.fp8_gemm_nt(qa.cpu(), sa.cpu(), None, qb.cpu(), sb.cpu(), None,
                                       torch.empty(m, n, dtype=torch.bfloat16), bias=None if bb is None else bb.cpu(),
                                       addend=c.cpu())
        else:
            a, b = make((m, k), torch.bfloat16, "cuda"), make((k, n), torch.bfloat16, "cuda", trans=True)
            gemm(a, b, transb=True, bias=bb, out=out, addend=c)
            ref = reference(a, b, False, True, bias=bb)[0] + c.double()
            cpu = gemm(a.cpu(), b.cpu(), transb=True, bias=None if bb is None else bb.cpu(), addend=c.cpu())
        assert torch.equal(c, before)
        assert_close_rel(out, ref, torch.bfloat16, factor=2)
        assert rel_error(out, cpu.double().cuda()) < 2e-2


@pytest.mark.cuda
@pytest.mark.parametrize("mnk", [(256, 512, 1024), (128, 384, 1280), (4096, 4096, 4096)])
@pytest.mark.parametrize("modes", [("block_1x128", "block_128x128"),
                                   ("block_1x128", "block_1x128"),
                                   ("block_128x128", "block_1x128")])
def test_cuda_fp8_block_scaled(mnk, modes, seed):
    m, n, k = mnk
    x = torch.randn(m, k, device="cuda") * torch.logspace(-2, 2, k, device="cuda")
    w = torch.randn(n, k, device="cuda") * 0.02
    qa, sa, da = QUANTIZERS[modes[0]](x)
    qb, sb, db = QUANTIZERS[modes[1]](w)
    out = poisoned((m, n), torch.bfloat16)
    gemm(qa, qb, transb=True, a_scale_inv=sa, b_scale_inv=sb, a_scaling=modes[0],
         b_scaling=modes[1], out=out)
    ref, _ = reference(qa, qb, False, True, a_deq=da, b_deq=db)
    assert rel_error(out, ref) < 1e-2


@pytest.mark.cuda
def test_cuda_fp8_bias_gelu_aux(seed):
    m, n, k = 256, 512, 256
    qa, sa, da = QUANTIZERS["tensor"](torch.randn(m, k, device="cuda"))
    qb, sb, db = QUANTIZERS["tensor"](torch.randn(n, k, device="cuda") * 0.05)
    bias = torch.randn(n, device="cuda").bfloat16()
    out, aux = gemm(qa, qb, transb=True, a_scale_inv=sa, b_scale_inv=sb, bias=bias,
                    epilogue="gelu_aux", fast_accum=True)
    ref, extra = reference(qa, qb, False, True, a_deq=da, b_deq=db, bias=bias, epilogue="gelu_aux")
    assert_close_rel(out, ref, torch.bfloat16)
    assert_close_rel(aux, extra, torch.bfloat16)


@pytest.mark.cuda
def test_cuda_misaligned_views(seed):
    base = torch.randn(1 << 20, device="cuda").bfloat16()
    a = base[1:1 + 97 * 61].view(97, 61)     # 2-byte aligned, odd row stride
    b = base[3:3 + 61 * 33].view(61, 33)
    out = gemm(a, b)
    assert_close_rel(out, reference(a, b)[0], torch.bfloat16)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_plan_serves_a_size_class(seed, dtype):
    """Token counts that differ within one size class (an eighth of an
    octave above 128: 2^j (1 + i/8), so 481..512 here) reuse one plan, its
    layouts resized: one heuristic query for the class (at its upper bound,
    whatever the order of the calls), and every product still exact to the
    reference (the class algorithm runs each size; cublasLtMatmul refuses
    one it cannot run, and that size then takes the heuristic's own
    choice).  The token count is m of the forward (a not transposed) and k
    of the weight gradient (a transposed, b not).  A count in another class
    is a new plan."""
    b = make((448, 320), dtype, "cuda")
    gemm_mod.plan_cache_clear()
    q = gemm_mod.heuristic_queries()
    for m in (490, 511, 481, 500, 512, 489):
        a = make((m, 448), dtype, "cuda")
        assert_close_rel(gemm(a, b, allow_tf32=False), reference(a, b)[0], dtype)
    assert gemm_mod.heuristic_queries() == q + 1 and gemm_mod.plan_cache_size() == 1
    a_all, b_all = make((300, 512), dtype, "cuda", trans=True), make((512, 320), dtype, "cuda")
    for k in (481, 490, 500):  # the weight gradient's k: rows of both stored operands, as split operands are
        a, bk = a_all[:k], b_all[:k]
        assert_close_rel(gemm(a, bk, transa=True, allow_tf32=False), reference(a, bk, True)[0], dtype)
    assert gemm_mod.heuristic_queries() == q + 2
    for m in (100, 1000, 300):  # exact below 129; 1000 is the class 1024, 300 the class 320
        a = make((m, 448), dtype, "cuda")
        assert_close_rel(gemm(a, b, allow_tf32=False), reference(a, b)[0], dtype)
    assert gemm_mod.heuristic_queries() == q + 5


@pytest.mark.cuda
def test_cuda_plan_cache_queries_once(seed):
    a, b = make((192, 320), torch.bfloat16, "cuda"), make((320, 448), torch.bfloat16, "cuda")
    gemm(a, b)
    q = gemm_mod.heuristic_queries()
    size = gemm_mod.plan_cache_size()
    for _ in range(5):
        gemm(make((192, 320), torch.bfloat16, "cuda"), b)
    assert gemm_mod.heuristic_queries() == q
    assert gemm_mod.plan_cache_size() == size
    gemm(a, b, transb=False, out_dtype=torch.float32)  # a new problem: one more query
    assert gemm_mod.heuristic_queries() == q + 1
    gemm_mod.plan_cache_clear()
    assert gemm_mod.plan_cache_size() == 0
    out = gemm(a, b)
    assert_close_rel(out, reference(a, b)[0], torch.bfloat16)


@pytest.mark.cuda
def test_cuda_runs_on_current_stream(seed):
    s = torch.cuda.Stream()
    a, b = make((2048, 2048), torch.bfloat16, "cuda"), make((2048, 2048), torch.bfloat16, "cuda")
    with torch.cuda.stream(s):
        a2 = a * 2
        out = gemm(a2, b)
    s.synchronize()
    assert_close_rel(out, 2 * reference(a, b)[0], torch.bfloat16)


@pytest.mark.cuda
def test_cuda_graph_capture(seed):
    x = make((512, 256), torch.bfloat16, "cuda")
    w = make((384, 256), torch.bfloat16, "cuda")
    bias = torch.randn(384, device="cuda").bfloat16()
    out = torch.empty(512, 384, device="cuda", dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        gemm(x, w, transb=True, bias=bias, out=out)  # warm up: plan + workspace
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        gemm(x, w, transb=True, bias=bias, out=out)
    x.copy_(make((512, 256), torch.bfloat16, "cuda"))
    g.replay()
    torch.cuda.synchronize()
    assert_close_rel(out, reference(x, w, False, True, bias=bias)[0], torch.bfloat16)


@pytest.mark.cuda
def test_cuda_addend_alignment_is_part_of_the_plan(seed):
    """cuBLASLt is told C's alignment (the plan's key holds it): an addend
    2 bytes off a 16-byte boundary after a plan made for an aligned one of
    the same shape gets a plan of its own and the right sum."""
    a, b = make((64, 96), torch.bfloat16, "cuda"), make((96, 48), torch.bfloat16, "cuda", trans=True)
    base = torch.randn(64 * 48 + 8, device="cuda").to(torch.bfloat16)
    for offset in (0, 1, 0, 1):  # aligned, 2-byte aligned, and each again (cached plans)
        c = base[offset:offset + 64 * 48].view(64, 48)
        assert (c.data_ptr() % 16 == 0) == (offset == 0)
        out = gemm(a, b, transb=True, addend=c)
        assert_close_rel(out, reference(a, b, False, True)[0] + c.double(), torch.bfloat16)


@pytest.mark.cuda
def test_cuda_addend_on_another_device():
    a, b = torch.ones(4, 8, device="cuda"), torch.ones(8, 4, device="cuda")
    with pytest.raises(ValueError, match="addend.*same device|same device.*addend|addend.*must be on"):
        gemm(a, b, addend=torch.ones(4, 4))


@pytest.mark.cuda
def test_cuda_error_names_device_mismatch():
    with pytest.raises(ValueError, match="must be on the same device"):
        gemm(torch.ones(4, 4, device="cuda"), torch.ones(4, 4))


def test_cpu_fp8_through_uint8_views(monkeypatch, seed):
    """Where torch cannot export float8 through DLPack, the op passes uint8
    views and names the format; the result must be the same."""
    m, n, k = 16, 32, 48
    qa, sa, da = QUANTIZERS["tensor"](torch.randn(m, k), E5M2)
    qb, sb, db = QUANTIZERS["tensor"](torch.randn(n, k), E4M3)
    direct = gemm(qa, qb, transb=True, a_scale_inv=sa, b_scale_inv=sb)
    monkeypatch.setattr(gemm_mod, "FP8_DLPACK", False)
    viewed = gemm(qa, qb, transb=True, a_scale_inv=sa, b_scale_inv=sb)
    assert torch.equal(direct, viewed)
    with pytest.raises(TypeError, match="argument 'a_format' names an fp8 format"):
        seqfuse._C.gemm(torch.ones(2, 2), torch.ones(2, 2), torch.empty(2, 2), 0, 0, None, None,
                        0, 0, None, None, 0, 0, 0, 1, 1.0, None, 3, 0)


# ---- tuning: cuBLASLt's candidates timed, the fastest kept for the plan ----

def test_cpu_tune_times_nothing_and_leaves_out(seed):
    a, b = make((16, 32), torch.bfloat16, trans=True), make((32, 48), torch.bfloat16)
    out = torch.full((16, 48), 3.0, dtype=torch.bfloat16)
    assert gemm_mod.tune(a, b, out, transa=True, accumulate=True) is None
    assert torch.equal(out, torch.full_like(out, 3.0))


def test_tune_refuses_bad_arguments():
    a, b, out = torch.ones(4, 8), torch.ones(8, 4), torch.empty(4, 4)
    for bad in (0, 17):
        with pytest.raises(ValueError, match="argument 'candidates' must be within 1..16, got %d" % bad):
            gemm_mod.tune(a, b, out, candidates=bad)
    with pytest.raises(TypeError, match="gemm_tune: argument 'candidates' must be an int, got bool"):
        gemm_mod.tune(a, b, out, candidates=True)
    with pytest.raises(TypeError, match="gemm_tune: arguments 'a', 'b' and 'out' must be torch.Tensors"):
        gemm_mod.tune(a, b, None)
    with pytest.raises(ValueError, match="gemm_tune: arguments 'a' and 'b' must be 2-D"):
        gemm_mod.tune(a[0], b, out)
    with pytest.raises(ValueError, match="inner dimensions differ"):
        gemm_mod.tune(a, torch.ones(4, 8), out)
    rows = (None, None, 0, 0, None, None, 0, 0, 0, 1, 1.0, None, 0, 0, None)
    with pytest.raises(ValueError, match="argument 'timings' must be a contiguous tensor of 3 elements on the CPU"):
        seqfuse._C.gemm_tune(4, torch.empty(2), a, b, out, 0, 0, *rows)
    with pytest.raises(TypeError, match="argument 'timings' must be a float32 tensor"):
        seqfuse._C.gemm_tune(4, torch.empty(3, dtype=torch.int32), a, b, out, 0, 0, *rows)


def test_tuning_switch(monkeypatch, caplog):
    """The environment decides (on by default, off under deterministic
    algorithms, said once) until set_tuning does; set_tuning(None) hands the
    decision back, returning each previous setting."""
    assert gemm_mod.set_tuning(None) is None
    monkeypatch.delenv("SEQFUSE_GEMM_TUNE", raising=False)
    assert gemm_mod.tuning_enabled()  # (on by default)
    monkeypatch.setattr(gemm_mod, "_deterministic_seen", [False])
    before = torch.are_deterministic_algorithms_enabled()
    cleared = []
    monkeypatch.setattr(gemm_mod, "plan_cache_clear", lambda: cleared.append(True))
    torch.use_deterministic_algorithms(True)
    try:
        with caplog.at_level("INFO", logger="seqfuse"):
            assert not gemm_mod.tuning_enabled() and not gemm_mod.tuning_enabled()
        # said once, and the plans tuned before dropped once, each time deterministic algorithms turn on
        assert caplog.text.count("no GEMM tuning while torch.use_deterministic_algorithms(True)") == 1
        assert cleared == [True]
        monkeypatch.setenv("SEQFUSE_GEMM_TUNE", "1")
        assert gemm_mod.tuning_enabled()  # (the environment outranks the deterministic default)
    finally:
        torch.use_deterministic_algorithms(before)
    for value, want in (("TRUE", True), (" off ", False), ("yes", True), ("no", False), ("", True)):
        monkeypatch.setenv("SEQFUSE_GEMM_TUNE", value)
        assert gemm_mod.tuning_enabled() is want, value
    monkeypatch.setenv("SEQFUSE_GEMM_TUNE", "2")
    with pytest.raises(ValueError, match="SEQFUSE_GEMM_TUNE must be 1 / true / on / yes or 0 / false / off / no, "
                                         "got '2'"):
        gemm_mod.tuning_enabled()
    monkeypatch.setenv("SEQFUSE_GEMM_TUNE", "1")
    assert gemm_mod.tuning_enabled()
    monkeypatch.setenv("SEQFUSE_GEMM_TUNE", "0")
    assert not gemm_mod.tuning_enabled()
    try:
        assert gemm_mod.set_tuning(True) is None and gemm_mod.tuning_enabled()
        assert gemm_mod.set_tuning(False) is True and not gemm_mod.tuning_enabled()
        monkeypatch.setenv("SEQFUSE_GEMM_TUNE", "1")
        assert not gemm_mod.tuning_enabled()  # (the setting outranks the environment)
        for bad in (1, "1"):
            with pytest.raises(TypeError, match="set_tuning: argument 'enabled' must be True, False or None"):
                gemm_mod.set_tuning(bad)
        assert gemm_mod.set_tuning(None) is False and gemm_mod.tuning_enabled()
    finally:
        gemm_mod.set_tuning(None)


@pytest.mark.cuda
@pytest.mark.parametrize("accumulate", [False, True])
def test_cuda_tune_keeps_a_plan_that_computes_the_product(accumulate, seed):
    """The summing GEMM of a chunked loss's weight gradient ([V, H] +=
    dlogits^T h): tuned once per plan (a second tune times nothing and asks
    the heuristic nothing), with the heuristic's choice's time and the kept
    one's reported; the products after it (written anew, then added into)
    equal the reference at the tuned token count (500, inside the class
    (448, 512]), at the class's upper bound 512 and back at 500, and the
    product at the tuned size asks the heuristic nothing more."""
    gemm_mod.plan_cache_clear()
    v, h = 1000, 256
    dl, hs = make((500, v), torch.bfloat16, "cuda"), make((500, h), torch.bfloat16, "cuda")
    out = torch.empty(v, h, device="cuda", dtype=torch.bfloat16)
    got = gemm_mod.tune(dl, hs, out, transa=True, accumulate=accumulate)
    assert got is not None
    first, kept, rank = got
    assert first > 0 and 0 < kept <= first and rank >= 0 and (rank == 0 or kept <= 0.97 * first)
    queries = gemm_mod.heuristic_queries()
    assert gemm_mod.tune(dl, hs, out, transa=True, accumulate=accumulate) is None
    for rows in (500, 512, 500):
        dl, hs = make((rows, v), torch.bfloat16, "cuda"), make((rows, h), torch.bfloat16, "cuda")
        dl2, hs2 = make((rows, v), torch.bfloat16, "cuda"), make((rows, h), torch.bfloat16, "cuda")
        gemm(dl, hs, transa=True, out=out)
        gemm(dl2, hs2, transa=True, out=out, accumulate=True)
        ref = reference(dl, hs, True, False)[0] + reference(dl2, hs2, True, False)[0]
        assert_close_rel(out, ref, torch.bfloat16)
        if rows == 500:
            assert gemm_mod.heuristic_queries() == queries, "the tuned size asked the heuristic again"


@pytest.mark.cuda
def test_cuda_tune_refused_under_capture(seed):
    gemm_mod.plan_cache_clear()
    a, b = make((256, 128), torch.bfloat16, "cuda"), make((128, 64), torch.bfloat16, "cuda")
    out = torch.empty(256, 64, device="cuda", dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        gemm(a, b, out=out)  # warm up: plan + workspace
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with pytest.raises(ValueError, match="capturing a CUDA graph"):
        with torch.cuda.graph(g):
            gemm_mod.tune(a, b, out)
