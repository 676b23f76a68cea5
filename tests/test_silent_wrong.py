"""No silent wrong answers, no crashes (issue 23): inputs that seqfuse used
to read as something else (torch's negative bit), memory that is not there
(storage resized to 0, a NULL DLPack pointer), NaN and Inf against torch for
every activation, an amax buffer that starts below zero, accumulation into
nothing, and the errors that did not say which argument broke which rule."""
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import seqfuse.pytorch as te
from seqfuse import _C, ops
from seqfuse.common.recipe import DelayedScaling

from dlpack_forge import ForgedTensor
from helpers import dlpack_path, needs_fp8

TESTS = os.path.dirname(os.path.abspath(__file__))


path = dlpack_path  # both DLPack import paths (helpers)


# ---- 1. torch's negative bit ------------------------------------------------

NEG = "has torch's negative bit set; call .resolve_neg\\(\\) first"


def test_neg_view_is_what_seqfuse_would_misread():
    x = torch.randn(4, 8)
    n = torch._neg_view(x)
    assert n.is_neg() and torch.equal(n, -x)
    assert n.data_ptr() == x.data_ptr()  # same memory: reading it unresolved gives x


def test_neg_view_refused_at_import(path):
    n = torch._neg_view(torch.randn(4, 8))
    with pytest.raises(ValueError, match="describe: argument 'x' " + NEG):
        _C.describe(n)
    with pytest.raises(ValueError, match="argument 'b' " + NEG):
        _C.probe(torch.randn(2), n, torch.randn(2))
    # the same tensor resolved is fine, and so is a plain negation
    assert _C.describe(n.resolve_neg())["shape"] == (4, 8)
    assert _C.describe(-n)["shape"] == (4, 8)


def test_neg_view_from_conj_imag_refused(path):
    # the other way a real tensor gets the bit: the imaginary part of a conjugate view
    z = torch.complex(torch.randn(4, 8), torch.randn(4, 8)).conj()
    im = z.imag
    assert im.is_neg()
    with pytest.raises(ValueError, match=NEG):
        _C.describe(im)


def test_conj_view_refused(path):
    # complex tensors (the only ones torch gives a conjugate bit) are not seqfuse's dtypes
    z = torch.complex(torch.randn(4), torch.randn(4)).conj()
    assert z.is_conj()
    with pytest.raises((TypeError, ValueError)):
        _C.describe(z)


def _neg_cases():
    x = torch.randn(4, 8)
    w = torch.randn(8)
    b = torch.randn(8)
    n = torch._neg_view
    return {
        "act_forward": (lambda: ops.act_forward(n(x), "relu"), F.relu(-x)),
        "gemm_a": (lambda: ops.gemm(n(x), x.t().contiguous()), (-x) @ x.t()),
        "gemm_b": (lambda: ops.gemm(x, n(x.t().contiguous())), x @ (-x.t())),
        "layernorm_forward": (lambda: ops.layernorm_forward(n(x), w, b)[0],
                          F.layer_norm(-x, (8,), w, b)),
        "layernorm_weight": (lambda: ops.layernorm_forward(x, n(w), b)[0],
                             F.layer_norm(x, (8,), -w, b)),
    }


@pytest.mark.parametrize("case", sorted(_neg_cases()))
def test_neg_view_ops_refuse(path, case):
    run, expected = _neg_cases()[case]
    with pytest.raises(ValueError, match=NEG):
        got = run()
        # on failure, say what came back instead
        print("returned", got, "expected", expected)


def test_neg_view_linear_input_refused(path):
    lin = te.Linear(8, 4)
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match=NEG):
        lin(torch._neg_view(x))
    y = lin(torch._neg_view(x).resolve_neg())
    torch.testing.assert_close(y, F.linear(-x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


def test_neg_view_output_refused(path):
    # writing through the bit would store x where -x is read back
    x = torch.randn(4, 8)
    out = torch._neg_view(torch.empty(4, 4))
    with pytest.raises(ValueError, match="argument 'out' " + NEG):
        ops.gemm(x, x.t().contiguous(), out=out)


# ---- 2. memory that is not there --------------------------------------------

def _run_isolated(code):
    """Run code in a fresh interpreter (a segfault fails the test instead of
    killing pytest); returns its stdout."""
    env = dict(os.environ, PYTHONPATH=TESTS + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                       text=True, timeout=120, env=env)
    assert r.returncode == 0, f"exit {r.returncode}\nstdout: {r.stdout}\nstderr: {r.stderr[-3000:]}"
    return r.stdout


_FREED = """
import torch
from seqfuse import _C, ops
import seqfuse.pytorch as te
_C.set_exchange_api({exchange})

def expect(fn, what):
    try:
        fn()
    except ValueError as e:
        assert "{arg}" in str(e) and "no memory" in str(e), str(e)
        print(what, "refused:", e)
    else:
        raise SystemExit(what + ": no error")
"""


@pytest.mark.parametrize("exchange", [True, False])
def test_freed_storage_input_refused(exchange):
    out = _run_isolated(_FREED.format(exchange=exchange, arg="argument 'x'") + """
x = torch.randn(64, 64)
x.untyped_storage().resize_(0)
assert x.data_ptr() == 0 and x.numel() > 0
expect(lambda: ops.act_forward(x, "gelu"), "act_forward")
expect(lambda: ops.layernorm_forward(x, torch.ones(64), torch.zeros(64)), "layernorm_forward")
expect(lambda: _C.describe(x), "describe")
""")
    assert out.count("refused") == 3


@pytest.mark.parametrize("exchange", [True, False])
def test_freed_storage_module_weight_refused(exchange):
    out = _run_isolated(_FREED.format(exchange=exchange, arg="argument 'b'") + """
lin = te.Linear(64, 64)
lin.weight.data.untyped_storage().resize_(0)
expect(lambda: lin(torch.randn(8, 64)), "Linear")
""")
    assert "Linear refused" in out


def test_forged_null_data_refused():
    out = _run_isolated(_FREED.format(exchange=True, arg="argument 'x'") + """
import numpy as np
from dlpack_forge import ForgedTensor
t = ForgedTensor(np.ones((16, 16), dtype=np.float32), data=0)
y = torch.empty(16, 16)
expect(lambda: _C.describe(t), "describe")
expect(lambda: _C.act_forward(0, t, y, None, None, None, None), "act_forward")
assert t.deleted == t.exported, (t.deleted, t.exported)  # given back, refused or not
""")
    assert out.count("refused") == 2


def test_null_data_of_an_empty_tensor_is_fine(path):
    t = ForgedTensor(torch.ones(0, 4).numpy(), data=0)
    assert _C.describe(t)["shape"] == (0, 4)
    x = torch.empty(0, 4)
    x.untyped_storage().resize_(0)
    assert ops.act_forward(x, "relu").shape == (0, 4)


# ---- 6d. a __dlpack__ that cannot be called ---------------------------------

class _NotCallableDlpack:
    __dlpack__ = 5

    def __dlpack_device__(self):
        return (1, 0)


class _NotCallableDevice:
    __dlpack_device__ = 5

    def __dlpack__(self, **kw):
        raise AssertionError("not reached")


def test_dlpack_not_callable_named():
    with pytest.raises(TypeError, match="describe: argument 'x': __dlpack__ must be callable, got int"):
        _C.describe(_NotCallableDlpack())
    with pytest.raises(TypeError, match="describe: argument 'x': __dlpack_device__ must be callable, "
                                        "got int"):
        _C.describe(_NotCallableDevice())


# ---- 3. NaN and Inf through every activation, against torch ------------------

_SPECIAL = [math.nan, math.inf, -math.inf, 0.0, -0.0, 1.0, -1.0, 30.0, -30.0, 100.0, -100.0]
class _GeluErf(torch.autograd.Function):
    """torch's erf-GELU, its value at +Inf taken as +Inf: torch 2.15's vectorized float32 CPU kernel returns
    NaN there (its scalar path, earlier releases and the limit give +Inf); the backward is torch's own."""

    @staticmethod
    def forward(ctx, v):
        ctx.save_for_backward(v)
        return torch.where(torch.isposinf(v), v, F.gelu(v))

    @staticmethod
    def backward(ctx, dy):
        (v,) = ctx.saved_tensors
        return torch.ops.aten.gelu_backward(dy, v)


_BASE = {"gelu": lambda v: F.gelu(v, approximate="tanh"), "gelu_erf": _GeluErf.apply, "silu": F.silu,
         "relu": F.relu}
_GATE_OF = {"geglu": "gelu", "geglu_erf": "gelu_erf", "swiglu": "silu", "reglu": "relu"}


def _torch_act(name, x):
    if name in _BASE:
        return _BASE[name](x)
    n = x.shape[-1] // 2
    return _BASE[_GATE_OF[name]](x[..., :n]) * x[..., n:]


def _grid(name):
    """(x, dy), float32 [1, n]: every pair of special values (x, dy), or for
    a gated activation every triple (a, g, dy) with x = [a | g] (the first
    half is activated, the second gates)."""
    s = torch.tensor(_SPECIAL)
    k = len(_SPECIAL)
    if name in _GATE_OF:
        a, g, dy = s.repeat_interleave(k * k), s.repeat_interleave(k).repeat(k), s.repeat(k * k)
        return torch.cat([a, g])[None], dy[None]
    return s.repeat_interleave(k)[None], s.repeat(k)[None]


def _assert_same_specials(got, want, what):
    """NaN where torch has NaN, the same infinities, finite values close."""
    got, want = got.double(), want.double()
    assert torch.equal(got.isnan(), want.isnan()), f"{what}: NaN at {got.isnan().nonzero().tolist()}, torch " \
        f"{want.isnan().nonzero().tolist()}"
    inf = want.isinf()
    assert torch.equal(got.isinf(), inf) and torch.equal(got[inf], want[inf]), f"{what}: infinities differ"
    fin = want.isfinite()
    torch.testing.assert_close(got[fin], want[fin], rtol=1e-4, atol=1e-6, msg=what)


@pytest.mark.parametrize("name", ["gelu", "gelu_erf", "silu", "relu", "geglu", "geglu_erf",
                                  "swiglu", "reglu"])
def test_activation_nan_inf_like_torch(name):
    x, dy = _grid(name)
    xr = x.clone().requires_grad_(True)
    yr = _torch_act(name, xr)  # float32, as seqfuse computes
    (dxr,) = torch.autograd.grad(yr, xr, dy)
    want = yr.detach()
    _assert_same_specials(ops.act_forward(x, name), want, f"{name} forward")
    _assert_same_specials(ops.act_backward(dy, x, name), dxr, f"{name} backward")


def test_relu_propagates_nan():
    x = torch.tensor([[math.nan, -1.0, 2.0]])
    y = ops.act_forward(x, "relu")
    assert y[0, 0].isnan() and y[0, 1] == 0 and y[0, 2] == 2
    # torch's backward: dy passes where x is NaN; 0 (not dy * 0) where x <= 0
    dx = ops.act_backward(torch.tensor([[5.0, math.inf, 3.0]]), x, "relu")
    assert dx.tolist() == [[5.0, 0.0, 3.0]]


def test_layernorm_mlp_relu_propagates_nan():
    torch.manual_seed(0)
    m = te.LayerNormMLP(8, 16, activation="relu")
    with torch.no_grad():
        m.fc1_weight[3, :] = math.nan  # one hidden unit is NaN for every token
    x = torch.randn(4, 8)
    ref = torch.nn.functional.layer_norm(x, (8,), m.layer_norm_weight, m.layer_norm_bias, m.eps)
    ref = F.relu(F.linear(ref, m.fc1_weight, m.fc1_bias))
    ref = F.linear(ref, m.fc2_weight, m.fc2_bias)
    assert ref.isnan().all()
    assert m(x).isnan().all()


# ---- 4. an amax buffer that starts below zero ---------------------------------

@needs_fp8
@pytest.mark.parametrize("start", [-0.0, -1.0, -1e30, -math.inf])
def test_cast_fp8_amax_from_negative_start(start):
    x = torch.randn(64, 32)
    amax = torch.tensor([start])
    ops.cast_fp8(x, torch.ones(1), amax, torch.float8_e4m3fn)
    assert amax.item() == x.abs().max().item()


@needs_fp8
def test_cast_fp8_amax_start_minus_zero_all_zero_input():
    amax = torch.tensor([-0.0])
    ops.cast_fp8(torch.zeros(16), torch.ones(1), amax, torch.float8_e4m3fn)
    assert amax.item() == 0.0 and not math.copysign(1.0, amax.item()) < 0  # +0.0, the true max


@needs_fp8
def test_cast_fp8_amax_keeps_larger_start_and_nan():
    x = torch.randn(64)
    amax = torch.tensor([1e6])
    ops.cast_fp8(x, torch.ones(1), amax, torch.float8_e4m3fn)
    assert amax.item() == 1e6
    x[5] = math.nan
    amax = torch.tensor([-2.0])
    ops.cast_fp8(x, torch.ones(1), amax, torch.float8_e4m3fn)
    assert amax.isnan().item()


@needs_fp8
def test_cast_fp8_amax_empty_input_leaves_start():
    amax = torch.tensor([-3.0])  # no element: no fold, on the CPU as on the GPU
    ops.cast_fp8(torch.empty(0, 16), torch.ones(1), amax, torch.float8_e4m3fn)
    assert amax.item() == -3.0


@needs_fp8
def test_fused_amax_from_negative_start():
    # the activation and norm kernels fold the same way
    x = torch.randn(8, 32)
    for run, v in (
        (lambda amax: ops.act_forward(x, "gelu", out_dtype=torch.float8_e4m3fn, scale=torch.ones(1),
                                  amax=amax), F.gelu(x, approximate="tanh")),
        (lambda amax: ops.layernorm_forward(x, torch.ones(32), torch.zeros(32), out_dtype=torch.float8_e4m3fn,
                                        scale=torch.ones(1), amax=amax),
         F.layer_norm(x, (32,), torch.ones(32), torch.zeros(32))),
    ):
        amax = torch.tensor([-1.0])
        run(amax)
        torch.testing.assert_close(amax, v.abs().max().reshape(1), rtol=1e-5, atol=1e-6)


# ---- 5. accumulate into nothing -----------------------------------------------

def test_gemm_accumulate_needs_out():
    a, b = torch.randn(4, 8), torch.randn(8, 4)
    with pytest.raises(ValueError, match="gemm: accumulate=True .* requires out"):
        ops.gemm(a, b, accumulate=True)
    out = torch.ones(4, 4)
    ops.gemm(a, b, out=out, accumulate=True)
    torch.testing.assert_close(out, a @ b + 1, rtol=1e-5, atol=1e-5)


# ---- 6. errors that name the argument and the rule ------------------------------

def test_attention_max_seqlen_beyond_32_bits_named():
    q = torch.randn(6, 2, 8)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    for name in ("max_seqlen_q", "max_seqlen_kv"):
        with pytest.raises(ValueError, match=rf"argument '{name}' must be in \[0, 2\*\*31 - 1\].*got 4294967296"):
            ops.attention_forward(q, q, q, qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                              **{"max_seqlen_q": 6, "max_seqlen_kv": 6, name: 2**32})


def test_attention_window_beyond_32_bits_named():
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match=r"argument 'window_size\[0\]' must be in \[-1, 2\*\*31 - 1\]"):
        ops.attention_forward(q, q, q, window_size=(2**40, 0))


@pytest.mark.parametrize("kw,exc,rule", [
    (dict(margin=math.nan), ValueError, "margin must be finite"),
    (dict(margin=math.inf), ValueError, "margin must be finite"),
    (dict(margin=0.5), ValueError, "margin must be a whole number"),
    (dict(margin=65), ValueError, r"margin must be in \[-64, 64\]"),
    (dict(margin="1"), TypeError, "margin must be an integer"),
    (dict(amax_history_len=0), ValueError, "amax_history_len must be >= 1"),
    (dict(amax_history_len=2.5), ValueError, "amax_history_len must be a whole number"),
    (dict(amax_history_len=math.nan), ValueError, "amax_history_len must be finite"),
    (dict(amax_history_len=None), TypeError, "amax_history_len must be an integer"),
    (dict(reduce_amax="yes"), TypeError, "reduce_amax must be a bool"),
])
def test_delayed_scaling_fields_checked(kw, exc, rule):
    with pytest.raises(exc, match="DelayedScaling: " + rule):
        DelayedScaling(**kw)


@pytest.mark.parametrize("fmt,bound", [("E4M3", 14), ("HYBRID", 14), ("E5M2", 29)])
def test_recipe_margin_bounded_by_the_format(fmt, bound):
    """A margin past the format's binades casts every tensor to (nearly) all zeros or saturates it: refused
    with the format's range; the bound itself still maps a tensor's largest value to a normal number."""
    from seqfuse.common.recipe import Float8CurrentScaling, Format
    f = Format[fmt]
    for cls in (DelayedScaling, Float8CurrentScaling):
        for m in (bound + 1, -bound - 1, 40):
            with pytest.raises(ValueError, match=rf"{cls.__name__}: margin must be in \[-{bound}, {bound}\] "
                                                 rf"with fp8_format={fmt} .*got {m}"):
                cls(fp8_format=f, margin=m)
        assert cls(fp8_format=f, margin=bound).margin == bound
    x = torch.linspace(-3.0, 3.0, 64)
    scale = f.max_fwd / 3.0 / 2.0 ** bound
    q = (x * scale).to(f.forward_dtype).float() / scale
    top = x.abs() > 1.5
    assert (q[top] != 0).all() and ((q - x)[top].abs() <= 0.1 * x[top].abs()).all()
    r = DelayedScaling(fp8_format=Format.E5M2, margin=20)
    with pytest.raises(ValueError, match=r"margin must be in \[-14, 14\] with fp8_format=HYBRID"):
        r.fp8_format = Format.HYBRID  # the pair is checked whichever field changes
    assert r.fp8_format is Format.E5M2


def test_recipe_checked_on_assignment():
    r = DelayedScaling(amax_history_len=4)
    with pytest.raises(ValueError, match="DelayedScaling: amax_history_len must be >= 1, got 0"):
        r.amax_history_len = 0
    assert r.amax_history_len == 4  # left as it was
    with pytest.raises(ValueError, match="DelayedScaling: margin must be finite"):
        r.margin = math.nan
    assert r.margin == 0
    r.margin = 2
    assert r.margin == 2
    from seqfuse.common.recipe import Float8BlockScaling, Float8CurrentScaling
    with pytest.raises(ValueError, match="Float8CurrentScaling: margin must be finite"):
        Float8CurrentScaling().margin = math.nan
    with pytest.raises(ValueError, match="Float8BlockScaling: w_block_scaling_dim must be 1"):
        Float8BlockScaling().w_block_scaling_dim = 3


def test_recipe_mutated_history_len_reaches_no_state():
    # used to surface as a ZeroDivisionError inside the scaling state, steps later
    from seqfuse.quantization import autocast
    r = DelayedScaling(amax_history_len=2)
    with pytest.raises(ValueError, match="amax_history_len"):
        r.amax_history_len = 0
    if not needs_fp8.args[0]:
        lin = te.Linear(16, 16)
        for _ in range(3):
            with autocast(enabled=True, recipe=r):
                lin(torch.randn(16, 16)).sum().backward()


# ---- numerics: the scale keeps its value where amax is 0 or not finite ---------

@needs_fp8
@pytest.mark.parametrize("bad", [0.0, math.inf, math.nan])
def test_scale_kept_where_amax_zero_or_not_finite(bad):
    scale = torch.tensor([3.0, 5.0])
    scale_inv = 1 / scale
    amax = torch.tensor([bad, 2.0])
    ops.fp8_compute_scale(amax, scale, scale_inv, 448.0)
    assert scale.tolist() == [1.0, 224.0]  # current scaling has no previous scale: 1
    hist = torch.tensor([[bad, 7.0], [0.0, 0.0]])
    scale = torch.tensor([3.0, 5.0])
    scale_inv = 1 / scale
    ops.fp8_scale_update(hist, scale, scale_inv, torch.tensor([448.0, 448.0]), "most_recent", 0)
    assert scale.tolist() == [3.0, 64.0]  # delayed scaling keeps the previous scale
    torch.testing.assert_close(scale_inv, 1 / scale)


# ---- the same rules on the GPU -------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("name", ["gelu", "gelu_erf", "silu", "relu", "geglu", "geglu_erf",
                                  "swiglu", "reglu"])
@pytest.mark.parametrize("cols", [1, 8])  # the element-wise and the vector kernels
def test_cuda_activation_nan_inf_like_cpu(name, cols):
    x, dy = _grid(name)
    if name in _GATE_OF:  # rows of [a | g] pairs
        n = x.shape[1] // 2
        pad = -n % cols
        a, g = (F.pad(h, (0, pad)).reshape(-1, cols) for h in (x[:, :n], x[:, n:]))
        x, dy = torch.cat([a, g], dim=1), F.pad(dy, (0, pad)).reshape(-1, cols)
    else:
        pad = -x.shape[1] % cols
        x, dy = F.pad(x, (0, pad)).reshape(-1, cols), F.pad(dy, (0, pad)).reshape(-1, cols)
    for fn, args in ((ops.act_forward, (x, name)), (ops.act_backward, (dy, x, name))):
        want = fn(*args)
        got = fn(*(t.cuda() if isinstance(t, torch.Tensor) else t for t in args)).cpu()
        _assert_same_specials(got, want, f"{name} {fn.__name__} cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("start", [-0.0, -1.0, 5.0])
def test_cuda_amax_folds_like_cpu(start):
    x = torch.randn(256, 128)
    x[3, 7] = -7.5
    for kind in ("cast", "act", "norm"):
        amaxes = []
        for dev in ("cpu", "cuda"):
            amax = torch.tensor([start], device=dev)
            xd, one = x.to(dev), torch.ones(1, device=dev)
            if kind == "cast":
                ops.cast_fp8(xd, one, amax, torch.float8_e4m3fn)
            elif kind == "act":
                ops.act_forward(xd, "relu", out_dtype=torch.float8_e4m3fn, scale=one, amax=amax)
            else:
                ops.layernorm_forward(xd, torch.ones(128, device=dev), torch.zeros(128, device=dev),
                                  out_dtype=torch.float8_e4m3fn, scale=one, amax=amax)
            amaxes.append(amax.cpu())
        assert amaxes[0].item() >= 0 and amaxes[1].item() >= 0, (kind, amaxes)
        if kind == "norm":  # the CPU normalizes in double, the GPU in float32
            torch.testing.assert_close(amaxes[1], amaxes[0], rtol=1e-5, atol=0)
        else:
            assert torch.equal(amaxes[0], amaxes[1]), (kind, amaxes)
    zeros = torch.zeros(64, device="cuda")
    amax = torch.tensor([-0.0], device="cuda")
    ops.cast_fp8(zeros, torch.ones(1, device="cuda"), amax, torch.float8_e4m3fn)
    assert math.copysign(1.0, amax.item()) == 1.0


@pytest.mark.parametrize("recipe_name", ["DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling"])
def test_fp8_linear_infinity_stays_non_finite(recipe_name):
    """An infinity in the input, the weight or the output gradient of an FP8
    Linear reaches the results as a non-finite value (the casts make it NaN:
    saturating it to the format's largest value would hide an overflow that a
    loss scaler or the user must see)."""
    import seqfuse.pytorch as te
    from seqfuse.common import recipe as rc

    recipe = getattr(rc, recipe_name)()
    m = te.Linear(128, 128, device="cpu")
    x = torch.randn(16, 128)
    x[3, 5] = float("inf")
    x.requires_grad_(True)
    with te.autocast(recipe=recipe):
        y = m(x)
    assert (~torch.isfinite(y)).any(1).nonzero().flatten().tolist() == [3]
    g = torch.ones_like(y)
    g[7, 1] = float("inf")
    y.backward(g)
    assert not torch.isfinite(x.grad).all() and not torch.isfinite(m.weight.grad).all()
    with torch.no_grad():
        m.weight[0, 0] = float("-inf")
    with te.autocast(recipe=recipe):
        y = m(torch.randn(16, 128))
    assert not torch.isfinite(y[:, 0]).any()


def test_nvfp4_infinity_makes_its_block_nan():
    """NVFP4 (emulated on Hopper): an infinity's 16-value block decodes as NaN
    (its E4M3 block scale is NaN, the cast rule); the other blocks stay finite
    values near x (within half FP4's largest step, amax / 6)."""
    torch.manual_seed(0)
    x = torch.randn(2, 32)
    x[0, 3] = float("inf")
    got = ops.quant.dequantize_nvfp4(*ops.quant.quantize_nvfp4(x))
    assert torch.isnan(got[0, :16]).all() and not torch.isnan(got[0, 16:]).any()
    others = torch.cat([got[0, 16:], got[1]])
    want = torch.cat([x[0, 16:], x[1]])
    assert ((others - want).abs() <= want.abs().max() / 6).all()


def test_autocast_and_model_init_name_a_recipe_passed_as_a_flag():
    """A recipe in a flag's place (TE's positional fp8_autocast(True, recipe) puts it in 'calibrating')
    is refused naming the flag and where a recipe goes; the same shared check serves quantized_model_init."""
    import seqfuse.pytorch as te
    from seqfuse.common.recipe import DelayedScaling as DS
    with pytest.raises(TypeError, match=r"autocast: argument 'calibrating' must be a bool, got DelayedScaling "
                                        r"\(a recipe goes in 'recipe', fp8_autocast's 'fp8_recipe'\)"):
        with te.fp8_autocast(True, DS()):
            pass
    with pytest.raises(TypeError, match=r"quantized_model_init: argument 'preserve_high_precision_init_val' must "
                                        r"be a bool, got DelayedScaling \(a recipe goes in 'recipe'\)"):
        with te.quantized_model_init(True, None, DS()):
            pass
    with pytest.raises(TypeError, match=r"autocast: argument 'recipe' must be a seqfuse.common.recipe recipe, got int"):
        with te.autocast(recipe=3):
            pass
