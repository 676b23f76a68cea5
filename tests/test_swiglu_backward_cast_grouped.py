"""The SwiGLU's backward of a grouped FP8 MLP fused with its weight-gradient
operand and its input gradient's FP8 copies for the gate-up layer
(seqfuse.ops.moe.swiglu_backward_cast_fp8_grouped).

On the CPU the op is the two reference ops group by group, so it must equal
them bit for bit: swiglu_backward of the real rows (dx, dprobs),
swiglu_cast_fp8_grouped with rowwise=False (the transposed FP8 bytes and the
scale inverses) and cast_fp8_grouped of dx (bytes, scale inverses, the amax
folded into strided slots), with dout given as the real rows or in the padded blocks a
grouped GEMM writes (their padding rows poisoned with NaN: never read).  On
CUDA against the CPU with every output poisoned first: dx and the FP8 bytes
bit for bit (the same expressions and rounding), dprobs within float
rounding (another summation order), at shapes with partial 128-row blocks,
K not a multiple of 128, empty groups and more than 64 groups (two launches);
dx and dprobs also against a float64 reference.  Bad inputs against their
messages."""
import pytest
import torch

from seqfuse import _C
from seqfuse.ops import moe as moe_ops

from helpers import needs_fp8

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _inputs(splits, k, dtype, with_probs, gen, device="cpu"):
    m = sum(splits)
    padded = moe_ops.padded_splits(splits)
    x = torch.randn(m, 2 * k, generator=gen).to(dtype)
    dout = torch.randn(m, k, generator=gen).to(dtype)
    probs = torch.rand(m, generator=gen) if with_probs else None
    dout_p = torch.full((sum(padded), k), float("nan"), dtype=dtype)
    r = p = 0
    for mg, pg in zip(splits, padded):
        dout_p[p:p + mg] = dout[r:r + mg]
        r, p = r + mg, p + pg
    scale = torch.rand(len(splits), generator=gen) * 4 + 0.25
    mv = lambda t: None if t is None else t.to(device)  # noqa: E731
    return mv(x), mv(dout), mv(dout_p), mv(probs), mv(scale)


def _reference(x, dout, probs, splits, fp8_dtype, scale, grad=None):
    """The unfused ops; ``grad``: (fp8 dtype, scale, amax[, rowwise, transpose]) of dx's casts (amax updated
    in place)."""
    dx, dprobs = moe_ops.swiglu_backward(dout, x, probs)
    data_t = si = g = None
    if fp8_dtype is not None:
        _, data_t, si = moe_ops.swiglu_cast_fp8_grouped(x, probs, splits, fp8_dtype, scale=scale, rowwise=False)
    if grad is not None:
        rowwise, transpose = grad[3:5] if len(grad) > 3 else (True, True)
        g = moe_ops.cast_fp8_grouped(dx, splits, grad[0], scale=grad[1], amax=grad[2], rowwise=rowwise,
                                     transpose=transpose)
    return dx, dprobs, data_t, si, g


def _grad_state(G, gen, device="cpu"):
    """(scale, amax) as strided slot views, some amaxes already holding a value."""
    buf = torch.zeros(2, 3 * G)
    buf[0] = torch.rand(3 * G, generator=gen) * 3 + 0.25
    buf[1, ::2] = 2.0
    buf[1, 2] = -0.0  # (a start of -0 loses to any amax: fp8.h's fold compares the bits signed)
    buf = buf.to(device)
    return buf[0, 2::3], buf[1, 2::3]


def _bytes(t):
    return None if t is None else t.view(torch.uint8)


def _same_grad(got, want, what=""):
    assert (got is None) == (want is None), what
    if got is not None:
        for u, v in zip(got[:2], want[:2]):
            assert (u is None) == (v is None), what
            assert u is None or (u.dtype == v.dtype and torch.equal(_bytes(u).cpu(), _bytes(v).cpu())), what
        assert torch.equal(got[2].cpu(), want[2].cpu()), what


@needs_fp8
@pytest.mark.parametrize("padded_dout", [True, False])
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2, None])
@pytest.mark.parametrize("with_probs", [True, False])
@pytest.mark.parametrize("grad_dtype", [E5M2, E4M3, None])
def test_cpu_equals_the_reference_ops(padded_dout, fp8_dtype, with_probs, grad_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    for dtype, splits, k in ((torch.bfloat16, [5, 0, 17, 33], 32), (torch.float32, [16, 1], 48),
                             (torch.float16, [0, 0, 7], 16)):
        x, dout, dout_p, probs, scale = _inputs(splits, k, dtype, with_probs, gen)
        gs, ga = _grad_state(len(splits), gen)
        ga_ref = ga.clone()
        got = moe_ops.swiglu_backward_cast_fp8_grouped(dout_p if padded_dout else dout, x, probs, splits,
                                                       fp8_dtype, scale=scale if fp8_dtype else None,
                                                       grad_fp8_dtype=grad_dtype,
                                                       grad_scale=gs if grad_dtype else None,
                                                       grad_amax=ga if grad_dtype else None)
        want = _reference(x, dout, probs, splits, fp8_dtype, scale, (grad_dtype, gs, ga_ref) if grad_dtype else None)
        _same_grad(got[4], want[4])
        assert torch.equal(ga, ga_ref)
        assert torch.equal(got[0], want[0])
        assert (got[1] is None) == (want[1] is None) and (got[1] is None or torch.equal(got[1], want[1]))
        if fp8_dtype is None:
            assert got[2] is None and got[3] is None
        else:
            assert got[2].dtype == fp8_dtype and torch.equal(_bytes(got[2]), _bytes(want[2]))
            assert torch.equal(got[3], want[3])


def test_need_dprobs_false_gives_none(seed):
    gen = torch.Generator().manual_seed(seed)
    x, dout, _, probs, _ = _inputs([3, 5], 16, torch.float32, True, gen)
    dx, dprobs, data_t, si, grad = moe_ops.swiglu_backward_cast_fp8_grouped(dout, x, probs, [3, 5],
                                                                            need_dprobs=False)
    assert dprobs is None and data_t is None and si is None and grad is None
    assert torch.equal(dx, moe_ops.swiglu_backward(dout, x, probs)[0])


def test_without_dx_something_must_be_asked(seed):
    """want_dx=False with no dprobs and neither FP8 cast leaves the call nothing to compute: a ValueError
    naming the rule, not a call that writes nothing."""
    x, dout, probs = torch.randn(8, 32), torch.randn(8, 16), torch.rand(8)
    for kw in (dict(probs=None), dict(probs=probs, need_dprobs=False)):
        p = kw.pop("probs")
        with pytest.raises(ValueError, match="want_dx=False with no dprobs, no fp8_dtype and no grad_fp8_dtype "
                                             "leaves nothing to compute"):
            moe_ops.swiglu_backward_cast_fp8_grouped(dout, x, p, [3, 5], want_dx=False, **kw)
    # dprobs alone is something: dx's scratch stays inside the call
    _, dprobs, *_ = moe_ops.swiglu_backward_cast_fp8_grouped(dout, x, probs, [3, 5], want_dx=False)
    assert torch.allclose(dprobs, moe_ops.swiglu_backward(dout, x, probs)[1])


def _call_poisoned(dout, x, probs, splits, fp8_dtype, scale, grad=None, want_dx=True):
    """The C entry with every output poisoned first (NaN / 0xFF bytes);
    ``grad``: (fp8 dtype, scale, amax) of dx's casts; ``want_dx`` False:
    no dx passed (None returned in its place)."""
    m, k = x.shape[0], x.shape[1] // 2
    mp = sum(moe_ops.padded_splits(splits))
    dx = torch.full_like(x, float("nan")) if want_dx else None
    dprobs = None if probs is None else torch.full_like(probs, float("nan"))
    data_t = si = None
    if fp8_dtype is not None:
        data_t = torch.full((k, mp), 255, dtype=torch.uint8, device=x.device).view(fp8_dtype)
        si = moe_ops._spaced_scale_inv(len(splits), x.device)
        si.fill_(float("nan"))
    g = g_args = None
    if grad is not None:
        poison = lambda *shape: torch.full(shape, 255, dtype=torch.uint8, device=x.device).view(grad[0])  # noqa
        rowwise, transpose = grad[3:5]
        g = (poison(mp, 2 * k) if rowwise else None, poison(2 * k, mp) if transpose else None,
             moe_ops._spaced_scale_inv(len(splits), x.device).fill_(float("nan")))
        g_args = (grad[1], grad[2], *g)
    _C.swiglu_backward_cast_fp8_grouped(dout, x, probs, torch.tensor(splits, dtype=torch.int64), 16, dx, dprobs,
                                        scale if fp8_dtype is not None else None, data_t, si,
                                        *(g_args or (None,) * 5), torch.cuda.current_stream().cuda_stream)
    assert dx is None or m == dx.shape[0]
    return dx, dprobs, data_t, si, g


def _float64_reference(x, dout, probs):
    x, d = x.double(), dout.double()
    k = x.shape[1] // 2
    g, u = x[:, :k], x[:, k:]
    p = torch.ones(x.shape[0], dtype=torch.float64, device=x.device) if probs is None else probs.double()
    sig = torch.sigmoid(g)
    dx = torch.cat([d * p[:, None] * u * sig * (1 + g * (1 - sig)), d * p[:, None] * g * sig], 1)
    return dx, (d * g * sig * u).sum(1)


@needs_fp8
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_equals_the_unfused_cuda_ops_and_the_cpu(seed):
    gen = torch.Generator().manual_seed(seed)
    many = [int(v) for v in torch.randint(0, 40, (70,), generator=gen)]  # 70 groups: two launches
    many[3] = 0
    cases = [([5, 0, 17, 33], 32, torch.bfloat16, True, E4M3), ([300, 129, 0, 1], 176, torch.bfloat16, True, E4M3),
             ([128, 256], 3584, torch.bfloat16, True, E4M3), ([40, 90], 48, torch.float32, False, E5M2),
             ([17], 64, torch.float16, True, None), (many, 96, torch.bfloat16, True, E4M3),
             ([0, 0], 32, torch.bfloat16, True, E4M3),
             # without probs the kernel splits K among CTAs: runs of several tiles, the last one partial
             ([300, 129, 0, 1], 2320, torch.bfloat16, False, E4M3), ([1000], 1040, torch.bfloat16, False, E4M3)]
    cu = lambda t: None if t is None else t.cuda()  # noqa: E731
    for n, (splits, k, dtype, with_probs, fp8_dtype) in enumerate(cases):
        for padded_dout in (True, False):
            x, dout, dout_p, probs, scale = _inputs(splits, k, dtype, with_probs, gen)
            d_in = dout_p if padded_dout else dout
            # dx's FP8 copies: formats and which copies vary across the cases (both layouts of dout)
            grad_dtype = (E5M2, E4M3, None)[(n + padded_dout) % 3]
            copies = ((True, True), (True, False), (False, True))[(n + 2 * padded_dout) % 3]
            gs, ga = _grad_state(len(splits), gen, "cuda")
            ga_ref, ga_before = ga.clone(), ga.clone()
            got = _call_poisoned(cu(d_in), cu(x), cu(probs), splits, fp8_dtype, cu(scale),
                                 (grad_dtype, gs, ga, *copies) if grad_dtype else None)
            what = (f"splits {splits[:6]} k {k} {dtype} probs {with_probs} {fp8_dtype} padded {padded_dout} "
                    f"grad {grad_dtype} {copies}")
            # the unfused CUDA ops (the same expressions and rounding): bit for bit but dprobs' order
            want = _reference(cu(x), cu(dout), cu(probs), splits, fp8_dtype, cu(scale),
                              (grad_dtype, gs, ga_ref, *copies) if grad_dtype else None)
            assert torch.equal(got[0], want[0]), what
            _same_grad(got[4], want[4], what)
            assert torch.equal(ga, ga_ref), what
            if grad_dtype is not None:
                # without dx (GroupedMLP's one-node backward): the same copies, dprobs and value cast, bit for bit
                ga2 = _grad_state(len(splits), gen, "cuda")[1].copy_(ga_before)
                alone = _call_poisoned(cu(d_in), cu(x), cu(probs), splits, fp8_dtype, cu(scale),
                                       (grad_dtype, gs, ga2, *copies), want_dx=False)
                assert alone[0] is None, what
                _same_grad(alone[4], got[4], what)
                assert torch.equal(ga2, ga), what
                assert (alone[1] is None) == (got[1] is None) and (got[1] is None or torch.equal(alone[1], got[1]))
                if fp8_dtype is not None:
                    assert torch.equal(_bytes(alone[2]), _bytes(got[2])) and torch.equal(alone[3], got[3]), what
            if fp8_dtype is not None:
                assert torch.equal(_bytes(got[2]), _bytes(want[2])), what
                assert torch.equal(got[3], want[3]), what
            # the CPU reference and float64
            cpu = _reference(x, dout, probs, splits, fp8_dtype, scale)
            tol = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10, torch.float32: 1e-5}[dtype]
            torch.testing.assert_close(got[0].cpu(), cpu[0], rtol=tol, atol=tol, msg=what)
            dx64, dp64 = _float64_reference(x, dout, probs)
            torch.testing.assert_close(got[0].cpu().double(), dx64, rtol=tol, atol=tol, msg=what)
            if with_probs:
                torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5 * k ** 0.5, msg=what)
                torch.testing.assert_close(got[1].cpu(), cpu[1], rtol=1e-5, atol=1e-5 * k ** 0.5, msg=what)
                torch.testing.assert_close(got[1].cpu().double(), dp64, rtol=1e-4, atol=1e-4 * k ** 0.5, msg=what)


@needs_fp8
def test_bad_inputs_name_their_rule():
    x = torch.randn(8, 32)
    dout = torch.randn(8, 16)
    op = moe_ops.swiglu_backward_cast_fp8_grouped
    none5 = (None,) * 5
    with pytest.raises(ValueError, match=r"'dout' must have shape \[8, 16\] \(the real rows\) or \[32, 16\]"):
        op(torch.randn(9, 16), x, None, [3, 5])
    with pytest.raises(TypeError, match="dout"):
        op(dout.double(), x, None, [3, 5])
    with pytest.raises(ValueError, match="m_splits"):
        op(dout, x, None, [3, 4])
    with pytest.raises(ValueError, match="'scale'.*goes with fp8_dtype"):
        op(dout, x, None, [3, 5], scale=torch.ones(2))
    with pytest.raises(ValueError, match="'scale'"):
        op(dout, x, None, [3, 5], E4M3)
    with pytest.raises(ValueError, match="even last dimension|gate and up"):
        op(dout, torch.randn(8, 31), None, [3, 5])
    with pytest.raises(ValueError, match="'scale' must"):
        op(dout, x, None, [3, 5], E4M3, scale=torch.ones(3))
    with pytest.raises(ValueError, match="'dprobs' goes with 'probs'"):
        _C.swiglu_backward_cast_fp8_grouped(dout, x, None, torch.tensor([3, 5]), 16, torch.empty_like(x),
                                            torch.empty(8), None, None, None, *none5, 0)
    with pytest.raises(ValueError, match="go together"):
        _C.swiglu_backward_cast_fp8_grouped(dout, x, None, torch.tensor([3, 5]), 16, torch.empty_like(x), None,
                                            torch.ones(2), None, None, *none5, 0)
    with pytest.raises(ValueError, match="output 'dx' shares memory with input 'x'"):
        _C.swiglu_backward_cast_fp8_grouped(dout, x, None, torch.tensor([3, 5]), 16, x, None, None, None, None,
                                            *none5, 0)
    with pytest.raises(ValueError, match="want_dx=False with no dprobs, no fp8_dtype and no grad_fp8_dtype"):
        op(dout, x, None, [3, 5], want_dx=False)
    with pytest.raises(TypeError, match="argument 'want_dx' must be a bool"):
        op(dout, x, None, [3, 5], want_dx=None)
    with pytest.raises(ValueError, match="'grad_scale'.*goes with grad_fp8_dtype|grad_fp8_dtype"):
        op(dout, x, None, [3, 5], grad_scale=torch.ones(2))
    with pytest.raises(ValueError, match="'grad_scale'"):
        op(dout, x, None, [3, 5], grad_fp8_dtype=E5M2)
    with pytest.raises(ValueError, match="'grad_scale' must"):
        op(dout, x, None, [3, 5], grad_fp8_dtype=E5M2, grad_scale=torch.ones(3))
    with pytest.raises(ValueError, match="grad_rowwise"):
        op(dout, x, None, [3, 5], grad_fp8_dtype=E5M2, grad_scale=torch.ones(2), grad_rowwise=False,
           grad_transpose=False)
    with pytest.raises(ValueError, match="'grad_scale_inv'"):
        _C.swiglu_backward_cast_fp8_grouped(dout, x, None, torch.tensor([3, 5]), 16, torch.empty_like(x), None,
                                            None, None, None, torch.ones(2), None, None,
                                            torch.empty(32, 32, dtype=torch.uint8).view(E5M2), None, 0)
