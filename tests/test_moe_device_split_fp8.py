"""The device-split route in FP8: GroupedLinear / GroupedMLP under
Float8CurrentScaling (E4M3) with the routing counts on the GPU.

Its pieces: the row-wise cast (ops.quant.quantize_rowwise_fp8, one scale
per row, in C with a CPU reference), the stacked weights' per-expert cast
(ops.moe.cast_fp8_current_stacked, quantization.grouped.stacked_weights_fp8)
and torch's row-wise scaled grouped GEMM (ops.moe.grouped_gemm_device_fp8).
The CPU tests pin the cast's values bit for bit against plain torch, the
argument checks, the recipes the route refuses, which FP8 weight copies
each mode makes and keeps (GroupedLinear._device_fp8_weights), and the
autograd function's lean mode with the grouped GEMMs emulated on the CPU
(the same results as the cached mode, the forward's copy freed, the
version check); the cuda-marked ones compare the products with float64
references computed from the very FP8 operands, the layer with its
bfloat16 result, the lean mode with the cached one (bits and memory), and
check that a GroupedMLP FP8 step never waits on the host."""
import logging

import pytest
import torch

from seqfuse.common import notes as notes_module
from seqfuse.common.recipe import DelayedScaling, Float8CurrentScaling, Format
from seqfuse.modules import GroupedLinear
from seqfuse.ops import moe
from seqfuse.ops import quant
from seqfuse.quantization import fp8_autocast
from seqfuse.quantization.grouped import stacked_weights_fp8

from helpers import REL_TOL, grouped_mlp_pair, needs_fp8, no_host_sync, rel_error

pytestmark = needs_fp8

E4M3 = Float8CurrentScaling(fp8_format=Format.E4M3)


def rowwise_ref(x, fp8_dtype=torch.float8_e4m3fn):
    """quantize_rowwise_fp8 in plain torch (float32 arithmetic, as the C
    backends): s = fp8_max / row amax (1 for an all-zero row, or one whose
    amax is NaN or infinite)."""
    fmax = torch.finfo(fp8_dtype).max
    xf = x.float()
    amax = xf.abs().amax(-1)
    s = torch.where((amax == 0) | ~torch.isfinite(amax), torch.ones_like(amax), torch.tensor(fmax) / amax)
    y = xf * s[:, None]
    q = torch.where(y.isinf(), float("nan"), y.clamp(-fmax, fmax)).to(fp8_dtype)  # (infinities: NaN)
    return q, 1.0 / s


def rowwise_input(m, k, dtype, device="cpu", nonfinite=False):
    """Rows spread over binades, one all-zero row and one of a single value
    (with ``nonfinite``: a row holding a NaN and one holding an infinity)."""
    x = torch.randn(m, k, device=device) * torch.logspace(-6, 6, m, base=2.0, device=device)[:, None]
    x[1] = 0.0
    x[2] = 0.0
    x[2, 5] = -3.0
    if nonfinite:
        x[3, 7] = float("nan")
        x[4, 0] = float("-inf")
    return x.to(dtype)


# ---- the row-wise cast ------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("k", [16, 48, 272])
def test_rowwise_cast_matches_plain_torch(dtype, fp8_dtype, k, seed):
    x = rowwise_input(37, k, dtype)
    q, si = quant.quantize_rowwise_fp8(x, fp8_dtype)
    rq, rsi = rowwise_ref(x, fp8_dtype)
    assert q.dtype == fp8_dtype and si.shape == (37,) and si.dtype == torch.float32
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(si, rsi)
    assert si[1] == 1.0  # the all-zero row
    # dequantized, every row within the format's relative step of x
    deq = q.double() * si.double()[:, None]
    step = 2.0 ** -4 if fp8_dtype == torch.float8_e4m3fn else 2.0 ** -3
    err = (deq - x.double()).abs()
    assert (err <= step * x.double().abs().amax(-1, keepdim=True) + 1e-30).all()


def test_rowwise_cast_nonfinite_rows_take_scale_one():
    x = rowwise_input(8, 32, torch.bfloat16, nonfinite=True)
    q, si = quant.quantize_rowwise_fp8(x)
    rq, rsi = rowwise_ref(x)
    assert si[3] == 1.0 and si[4] == 1.0
    nan = torch.isnan(rq.float())  # (NaN's code: seqfuse writes 0x7f, torch keeps the sign)
    assert torch.equal(torch.isnan(q.float()), nan)
    assert torch.equal(q.view(torch.uint8)[~nan], rq.view(torch.uint8)[~nan])
    assert torch.isnan(q[3, 7].float()) and torch.isnan(q[4, 0].float())  # (an infinity stays non-finite)
    assert torch.equal(si, rsi)


def test_rowwise_cast_c_entry_checks():
    """The C entry's own checks (what the Python wrapper always gets right)."""
    from seqfuse import _C

    x = torch.randn(4, 16)
    q, si = torch.empty(4, 16, dtype=torch.float8_e4m3fn), torch.empty(4)
    with pytest.raises(TypeError, match="quantize_rowwise_fp8: argument 'out'"):
        _C.quantize_rowwise_fp8(x, torch.empty(4, 16), si, 0)
    with pytest.raises(ValueError, match="quantize_rowwise_fp8: argument 'scale_inv'"):
        _C.quantize_rowwise_fp8(x, q, torch.empty(5), 0)
    with pytest.raises(TypeError, match="quantize_rowwise_fp8: argument 'scale_inv'"):
        _C.quantize_rowwise_fp8(x, q, torch.empty(4, dtype=torch.float16), 0)
    with pytest.raises(ValueError, match="quantize_rowwise_fp8: argument 'out'"):
        _C.quantize_rowwise_fp8(x, torch.empty(65, dtype=torch.float8_e4m3fn)[1:].view(4, 16), si, 0)


def test_rowwise_cast_leading_dims_and_checks():
    x = torch.randn(2, 3, 32)
    q, si = quant.quantize_rowwise_fp8(x)
    assert q.shape == (2, 3, 32) and si.shape == (6,)
    with pytest.raises(ValueError, match="K = 20.*multiple of 16"):
        quant.quantize_rowwise_fp8(torch.randn(4, 20))
    with pytest.raises(ValueError, match="'x' must be 16-byte aligned"):
        quant.quantize_rowwise_fp8(torch.randn(65)[1:].view(4, 16))
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        quant.quantize_rowwise_fp8(torch.ones(4, 16, dtype=torch.int32))


# ---- the stacked weights' cast ---------------------------------------------------------

def test_stacked_cast_entry_checks_its_stacks():
    """The C entry the stacked cast calls checks its own stacks (the list
    entry it hands the matrices to checks the rest)."""
    from seqfuse import _C

    w = torch.randn(2, 32, 48)
    si, slots = torch.empty(2), torch.empty(2, 2)
    out = torch.empty(2, 32, 48, dtype=torch.uint8).view(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="'w' must be a \\[G, N, K\\] stack"):
        _C.cast_fp8_current_stacked(w[0], out, None, slots[0], slots[1], si, 0, 0)
    with pytest.raises(ValueError, match=r"'out_t' must have shape \[2, 48, 32\]"):
        _C.cast_fp8_current_stacked(w, None, out, slots[0], slots[1], si, 0, 0)
    with pytest.raises(ValueError, match="'w'.*contiguous|contiguous.*'w'"):
        _C.cast_fp8_current_stacked(w.transpose(1, 2), None, out, slots[0], slots[1], si, 0, 0)


def test_stacked_cast_equals_the_list_cast(seed):
    w = torch.randn(3, 32, 48) * torch.tensor([1.0, 1e-3, 50.0])[:, None, None]
    data, data_t, si = moe.cast_fp8_current_stacked(w, torch.float8_e4m3fn)
    ldata, ldata_t, lsi, _, _ = moe.cast_fp8_current_list(list(w.unbind(0)), torch.float8_e4m3fn)
    assert data.shape == (3, 32, 48) and data_t.shape == (3, 48, 32) and si.is_contiguous()
    for g in range(3):
        assert torch.equal(data[g].view(torch.uint8), ldata[g].view(torch.uint8))
        assert torch.equal(data_t[g].view(torch.uint8), ldata_t[g].view(torch.uint8))
        assert si[g] == lsi[g]
    ops = stacked_weights_fp8(w)
    assert torch.equal(ops.row_scale_inv, si[:, None].expand(3, 32))
    assert torch.equal(ops.row_scale_inv_t, si[:, None].expand(3, 48))
    with pytest.raises(ValueError, match="\\[G, N, K\\] stack"):
        moe.cast_fp8_current_stacked(torch.randn(32, 48), torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="cast_fp8_current_stacked: argument 'w' must have N and K multiples of 16"):
        moe.cast_fp8_current_stacked(torch.randn(2, 32, 40), torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="cast_fp8_current_stacked: argument 'w' must be contiguous"):
        moe.cast_fp8_current_stacked(torch.randn(2, 48, 32).transpose(1, 2), torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="cast_fp8_current_stacked: argument 'w' must be float32"):
        moe.cast_fp8_current_stacked(torch.randn(2, 32, 48, dtype=torch.float64), torch.float8_e4m3fn)


# ---- the GEMM's argument checks (shapes first: reachable on the CPU) ---------------------

def test_grouped_gemm_device_fp8_checks():
    f8 = torch.float8_e4m3fn
    a, b = torch.zeros(8, 32).to(f8), torch.zeros(2, 16, 32).to(f8)
    sa, sb = torch.ones(8), torch.ones(2, 16)
    offs = torch.tensor([4, 8], dtype=torch.int32)
    with pytest.raises(TypeError, match="'offsets' must be a 1-D int32"):
        moe.grouped_gemm_device_fp8(a, sa, b, sb, offs.long())
    with pytest.raises(ValueError, match="b \\[G, N, K\\] with G = 3"):
        moe.grouped_gemm_device_fp8(a, sa, b, sb, torch.tensor([2, 4, 8], dtype=torch.int32))
    with pytest.raises(ValueError, match="a has 32 columns but each group of b has 16"):
        moe.grouped_gemm_device_fp8(a, sa, torch.zeros(2, 32, 16).to(f8), torch.ones(2, 32), offs)
    with pytest.raises(ValueError, match="multiples of 16, got K = 32, N = 8"):
        moe.grouped_gemm_device_fp8(a, sa, torch.zeros(2, 8, 32).to(f8), torch.ones(2, 8), offs)
    with pytest.raises(ValueError, match="'a_scale_inv' must have shape \\[M\\] = \\[8\\]"):
        moe.grouped_gemm_device_fp8(a, torch.ones(8, 1), b, sb, offs)
    with pytest.raises(ValueError, match="'b_scale_inv' must have shape \\[G, N\\] = \\[2, 16\\]"):
        moe.grouped_gemm_device_fp8(a, sa, b, torch.ones(2), offs)
    with pytest.raises(TypeError, match="'a_scale_inv' must be float32"):
        moe.grouped_gemm_device_fp8(a, sa.double(), b, sb, offs)
    with pytest.raises(TypeError, match="'b_scale_inv' must be float32"):
        moe.grouped_gemm_device_fp8(a, sa, b, sb.half(), offs)
    with pytest.raises(TypeError, match="'a' must be a float8_e4m3fn CUDA tensor"):
        moe.grouped_gemm_device_fp8(a.to(torch.float8_e5m2), sa, b, sb, offs)
    with pytest.raises(TypeError, match="'a' must be a float8_e4m3fn CUDA tensor"):
        moe.grouped_gemm_device_fp8(a, sa, b, sb, offs)  # on the CPU


# ---- which recipes take the route ----------------------------------------------------------

@pytest.mark.parametrize("recipe, words", [
    (DelayedScaling(), "sm90 grouped kernel: the tensors are not on a CUDA device"),  # (its own route)
    (Float8CurrentScaling(), "fp8_format=HYBRID"),
    (Float8CurrentScaling(fp8_format=Format.E4M3, margin=1), "margin=1"),
    (E4M3, "not on a CUDA device"),  # accepted by the recipe: the device check speaks next
])
def test_fp8_device_split_refusals(recipe, words):
    gl = GroupedLinear(2, 32, 32, bias=False, device="cpu")
    with fp8_autocast(fp8_recipe=recipe):
        assert words in gl.device_split_refusal(torch.randn(4, 32))


def test_fp8_device_split_refused_while_statistics_are_on():
    """Every step while FP8 statistics are on, not only the steps that record."""
    from seqfuse.quantization import stats

    gl = GroupedLinear(2, 32, 32, bias=False, device="cpu")
    stats.enable_stats(every=100)
    try:
        with fp8_autocast(fp8_recipe=E4M3):
            assert "FP8 statistics are on" in gl.device_split_refusal(torch.randn(4, 32))
    finally:
        stats.disable_stats()
    assert "FP8 statistics" not in gl.device_split_refusal(torch.randn(4, 32), E4M3)


def test_grouped_mlp_device_splits_off_is_a_refusal():
    from seqfuse.modules import GroupedMLP

    mlp = GroupedMLP(32, 32, 4, 2, device="cpu", device_splits=False)
    assert mlp.device_split_refusal(torch.randn(4, 32), E4M3) == "device_splits is off"
    mlp.device_splits = True
    assert mlp.device_split_refusal(torch.randn(4, 32), E4M3) == "the input is not on a CUDA device"


def test_torch_without_scaled_grouped_mm(monkeypatch):
    """A torch without torch._scaled_grouped_mm: the FP8 device-split route
    is refused with the reason, and the product raises saying what is
    missing (nothing runs a missing kernel)."""
    monkeypatch.delattr(torch, "_scaled_grouped_mm", raising=False)
    x = torch.zeros(4, 32, dtype=torch.bfloat16)
    assert "no torch._scaled_grouped_mm" in moe.device_split_refusal(x, torch.bfloat16, (32, 16), fp8=True)
    q = torch.zeros(4, 32, dtype=torch.float8_e4m3fn)
    w = torch.zeros(2, 16, 32, dtype=torch.float8_e4m3fn)
    with pytest.raises(NotImplementedError, match="grouped_gemm_device_fp8: .* no torch._scaled_grouped_mm"):
        moe.grouped_gemm_device_fp8(q, torch.ones(4), w, torch.ones(2, 16), torch.tensor([2, 4]))


def test_fp8_device_split_needs_features_of_16():
    x = torch.randn(4, 24)
    assert "multiples of 16" in moe.device_split_refusal(x, torch.bfloat16, (24, 32), fp8=True)
    assert moe.device_split_refusal(x, torch.bfloat16, (24, 32)) == "the input is not on a CUDA device"


def test_stacked_cast_copies_on_request(seed):
    """Either copy alone (what the device-split route's forward and backward
    cast in training): the same bytes and scales as the cast of both, the
    scales coming from the values alone."""
    w = torch.randn(3, 32, 48) * torch.tensor([1.0, 1e-3, 50.0])[:, None, None]
    data, data_t, si = moe.cast_fp8_current_stacked(w, torch.float8_e4m3fn)
    rdata, none_t, rsi = moe.cast_fp8_current_stacked(w, torch.float8_e4m3fn, transpose=False)
    none, tdata_t, tsi = moe.cast_fp8_current_stacked(w, torch.float8_e4m3fn, rowwise=False)
    assert none_t is None and none is None
    assert torch.equal(rdata.view(torch.uint8), data.view(torch.uint8))
    assert torch.equal(tdata_t.view(torch.uint8), data_t.view(torch.uint8))
    assert torch.equal(rsi, si) and torch.equal(tsi, si)
    row_ops, t_ops = stacked_weights_fp8(w, transpose=False), stacked_weights_fp8(w, rowwise=False)
    assert row_ops.data_t is None and row_ops.row_scale_inv_t is None
    assert t_ops.data is None and t_ops.row_scale_inv is None
    assert torch.equal(row_ops.row_scale_inv, si[:, None].expand(3, 32))
    assert torch.equal(t_ops.row_scale_inv_t, si[:, None].expand(3, 48))
    with pytest.raises(ValueError, match="cast_fp8_current_stacked: at least one of 'rowwise' and 'transpose'"):
        moe.cast_fp8_current_stacked(w, torch.float8_e4m3fn, rowwise=False, transpose=False)


def cached(gl):
    """The device-split FP8 weights' cache entry (None where there is none)."""
    entry = gl.__dict__.get("_fp8_device_weights")
    return None if entry is None else entry[2]


def test_fp8_device_weights_training_keeps_no_copy(seed):
    """is_first_microbatch None with gradients: every call casts the
    forward's copy alone, caches nothing and drops what another mode
    cached; the backward is told to cast the transposed copy (counted)."""
    gl = GroupedLinear(3, 32, 16, bias=False, device="cpu")
    first = gl._device_fp8_weights(None)
    assert first.data.shape == (3, 16, 32) and first.row_scale_inv.shape == (3, 16)
    assert first.data_t is None and first.row_scale_inv_t is None
    assert first.on_transpose_cast is not None and cached(gl) is None
    second = gl._device_fp8_weights(None)
    assert second is not first and gl.fp8_device_weight_casts == 2
    assert torch.equal(second.data.view(torch.uint8), first.data.view(torch.uint8))
    second.on_transpose_cast()
    assert gl.fp8_device_weight_transpose_casts == 1
    kept = gl._device_fp8_weights(True)  # gradient accumulation caches both copies
    assert cached(gl) is kept
    # the same bytes and scales whichever copies a call makes
    assert torch.equal(kept.data.view(torch.uint8), first.data.view(torch.uint8))
    assert torch.equal(kept.row_scale_inv, first.row_scale_inv)
    gl._device_fp8_weights(None)
    assert cached(gl) is None and gl.fp8_device_weight_casts == 4  # the stale entry is dropped


def test_fp8_device_weights_microbatches_cache_both_copies(seed):
    """is_first_microbatch True casts both copies and caches them, False
    reuses them (even after a weight changed: TE's contract), True recasts."""
    gl = GroupedLinear(3, 32, 16, bias=False, device="cpu")
    first = gl._device_fp8_weights(True)
    assert first.data_t.shape == (3, 32, 16) and first.row_scale_inv_t.shape == (3, 32)
    assert first.on_transpose_cast is None and cached(gl) is first
    assert gl._device_fp8_weights(False) is first
    with torch.no_grad():
        gl.weight1.mul_(2.0)
    assert gl._device_fp8_weights(False) is first and gl.fp8_device_weight_casts == 1
    second = gl._device_fp8_weights(True)
    assert second is not first and gl.fp8_device_weight_casts == 2
    assert torch.equal(second.row_scale_inv[1], first.row_scale_inv[1] * 2)
    assert torch.equal(second.row_scale_inv_t[1], first.row_scale_inv_t[1] * 2)


def test_fp8_device_weights_inference_caches_the_forward_copy(seed):
    """Without gradients the forward's copy alone is cast, once per weight
    version (reused while every weight is the same parameter with the same
    storage and version); a training call with is_first_microbatch False
    finds no transposed copy there and casts both."""
    gl = GroupedLinear(3, 32, 16, bias=False, device="cpu")
    with torch.no_grad():
        first = gl._device_fp8_weights(None)
        assert first.data_t is None and cached(gl) is first
        assert gl._device_fp8_weights(None) is first and gl.fp8_device_weight_casts == 1
        gl.weight2.add_(1.0)  # a new version
        second = gl._device_fp8_weights(None)
        assert second is not first and second.data_t is None and gl.fp8_device_weight_casts == 2
        assert gl._device_fp8_weights(False) is second
        assert gl._device_fp8_weights(True) is not second and gl.fp8_device_weight_casts == 3
    third = cached(gl)
    both = gl._device_fp8_weights(False)  # gradients on: the backward needs the transposed copy
    assert both is not third and both.data_t is not None and gl.fp8_device_weight_casts == 4
    with torch.no_grad():
        assert gl._device_fp8_weights(None) is both  # a cached pair serves inference too
        gl.to(torch.bfloat16)  # new storage
        gl._device_fp8_weights(None)
    assert gl.fp8_device_weight_casts == 5


def test_fp8_device_weights_cast_again_after_a_fused_optimizer_step(seed):
    """torch's AdamW(fused=True) writes the expert weights without moving
    their version counters: the inference cache must still cast the
    updated weights (the key counts the optimizer steps that covered each
    parameter), and an optimizer over other parameters leaves it cached."""
    gl = GroupedLinear(3, 32, 16, bias=False, device="cpu")
    with torch.no_grad():
        first = gl._device_fp8_weights(None)
    other = torch.nn.Parameter(torch.randn(4))
    other.grad = torch.randn(4)
    torch.optim.AdamW([other], lr=1e-2, fused=True).step()
    with torch.no_grad():
        assert gl._device_fp8_weights(None) is first and gl.fp8_device_weight_casts == 1
    opt = torch.optim.AdamW(gl.parameters(), lr=1e-1, fused=True)
    for w in gl.parameters():
        w.grad = torch.randn_like(w)
    versions = [w._version for w in gl.parameters()]
    opt.step()
    assert [w._version for w in gl.parameters()] == versions
    with torch.no_grad():
        second = gl._device_fp8_weights(None)
    assert second is not first and gl.fp8_device_weight_casts == 2


def test_fp8_device_weights_share_the_version_key(seed):
    """The cache key is quantization.gemm_quantizers.weight_key's (the
    host route's WeightQuantizer computes its own with it), kept in the
    module, not in expert 0's WeightQuantizer."""
    from seqfuse.quantization import gemm_quantizers as gq

    gl = GroupedLinear(3, 32, 16, bias=False, device="cpu")
    with torch.no_grad():
        gl._device_fp8_weights(None)
    key, ws, _ = gl.__dict__["_fp8_device_weights"]
    assert key == gq.weight_key(gl.weights(), *(w.dtype for w in gl.weights()))
    assert gq.same_weights(key, gl.weights(), key, ws)
    assert not gq.same_weights(key, [torch.nn.Parameter(w.detach().clone()) for w in ws], key, ws)
    # a host-route call with is_first_microbatch=False after the device route's casts is not handed
    # the stacked operands: it casts its own per-expert weights and equals a host call that must cast
    splits = [5, 0, 11]
    x = torch.randn(sum(splits), 32)
    with torch.no_grad(), fp8_autocast(fp8_recipe=E4M3):
        gl._device_fp8_weights(True)
        reused = gl(x, splits, is_first_microbatch=False)
        cast = gl(x, splits, is_first_microbatch=True)
    assert torch.equal(reused, cast)


# ---- the autograd function's copies, on the CPU (the GEMMs emulated in float32) ---------------

def emulate_grouped_gemms(monkeypatch):
    """torch's grouped kernels (CUDA only) replaced by float32 loops over
    the groups, so DeviceSplitGroupedLinearFunction runs on the CPU; each
    FP8 product records its weight operand's shape."""
    seen = []

    def groups(offsets):
        ends = offsets.tolist()
        return list(zip([0] + ends[:-1], ends))

    def fp8(a, a_si, b, b_si, offsets, fast_accum=True):
        seen.append(tuple(b.shape))
        out = torch.zeros(a.shape[0], b.shape[1], dtype=torch.bfloat16)
        for g, (s, e) in enumerate(groups(offsets)):
            out[s:e] = ((a[s:e].float() * a_si[s:e, None]) @ (b[g].float() * b_si[g][:, None]).t()).bfloat16()
        return out

    def bf16(a, b, offsets, transa=False, transb=False):
        if transa:
            return torch.stack([(a[s:e].float().t() @ b[s:e].float()).bfloat16() for s, e in groups(offsets)])
        out = torch.zeros(a.shape[0], b.shape[1] if transb else b.shape[2], dtype=torch.bfloat16)
        for g, (s, e) in enumerate(groups(offsets)):
            out[s:e] = (a[s:e].float() @ (b[g].float().t() if transb else b[g].float())).bfloat16()
        return out

    monkeypatch.setattr(moe, "grouped_gemm_device_fp8", fp8)
    monkeypatch.setattr(moe, "grouped_gemm_device", bf16)
    return seen


def device_split_step(gl, x, counts, dy, first, between=None):
    """One FP8 forward and backward on the device-split route (called
    directly: the CPU counts would take the host route); ``between`` is
    called between the two, the graph alive."""
    x = x.clone().requires_grad_()
    for w in gl.weights():
        w.grad = None
    with fp8_autocast(fp8_recipe=E4M3):
        y = gl._device_split(x, counts, is_first_microbatch=first)
    if between is not None:
        between()
    y.backward(dy)
    return y.detach(), x.grad, [w.grad for w in gl.weights()]


def test_device_split_fp8_lean_matches_cached(monkeypatch, seed):
    """The lean mode (None) and the cached one (True) give the same output
    and gradients bit for bit: the backward's transpose-only cast has the
    forward's scales.  The lean forward's FP8 copy is freed when the call
    returns (nothing, ctx included, holds it), the backward casts the
    transposed copy once."""
    import weakref

    import seqfuse.modules.grouped_linear as gl_module

    seen = emulate_grouped_gemms(monkeypatch)
    made = []
    real = gl_module.stacked_weights_fp8

    def recording(*args, **kw):
        ops = real(*args, **kw)
        made.append(weakref.ref(ops.data) if ops.data is not None else None)
        return ops

    monkeypatch.setattr(gl_module, "stacked_weights_fp8", recording)
    splits = [5, 0, 19, 8]
    gl = GroupedLinear(4, 32, 48, bias=False, params_dtype=torch.bfloat16, device="cpu")
    x = torch.randn(sum(splits), 32).bfloat16()
    dy = torch.randn(sum(splits), 48).bfloat16()
    counts = torch.tensor(splits)

    def forward_copy_freed():
        assert len(made) == 1 and made[0]() is None

    lean = device_split_step(gl, x, counts, dy, None, forward_copy_freed)
    assert len(made) == 2 and made[1] is None  # the backward's cast: the transposed copy alone
    assert seen == [(4, 48, 32), (4, 32, 48)]
    assert gl.fp8_device_weight_casts == 1 and gl.fp8_device_weight_transpose_casts == 1
    assert cached(gl) is None
    kept = device_split_step(gl, x, counts, dy, True)
    assert cached(gl) is not None and gl.fp8_device_weight_transpose_casts == 1
    for a, b in zip(lean[:2] + tuple(lean[2]), kept[:2] + tuple(kept[2])):
        assert torch.equal(a, b)


def test_device_split_fp8_lean_weight_changed_before_backward(monkeypatch, seed):
    """The lean mode saves the weights (each parameter, with its own version
    counter: the stacked view would carry expert 0's only): a weight changed
    in place between the forward and the backward raises autograd's error
    instead of a gradient from other weights than the forward's.  Without
    an input gradient nothing is saved and nothing is cast."""
    emulate_grouped_gemms(monkeypatch)
    splits = [6, 10]
    gl = GroupedLinear(2, 32, 16, bias=False, params_dtype=torch.bfloat16, device="cpu")
    x = torch.randn(sum(splits), 32).bfloat16().requires_grad_()
    counts = torch.tensor(splits)
    with fp8_autocast(fp8_recipe=E4M3):
        y = gl._device_split(x, counts)
    with torch.no_grad():
        gl.weight1.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    with fp8_autocast(fp8_recipe=E4M3):
        y = gl._device_split(x.detach(), counts)  # the weights' gradients only
    with torch.no_grad():
        gl.weight1.mul_(2.0)
    y.sum().backward()
    assert gl.weight1.grad is not None and "fp8_device_weight_transpose_casts" not in gl.__dict__


def test_device_split_bf16_weight_changed_before_backward(monkeypatch, seed):
    """The bfloat16 route's backward reads the experts' weights through a
    view of their one buffer: the parameters are what it saves, so a change
    to any expert (not only expert 0, whose version counter the view
    shares) between the forward and the backward raises autograd's error;
    unchanged, the input gradient is the plain per-group product."""
    emulate_grouped_gemms(monkeypatch)
    splits = [6, 0, 10]
    gl = GroupedLinear(3, 32, 16, bias=False, params_dtype=torch.bfloat16, device="cpu")
    counts = torch.tensor(splits)
    for expert in (1, 2):
        x = torch.randn(sum(splits), 32).bfloat16().requires_grad_()
        y = gl._device_split(x, counts)
        with torch.no_grad():
            getattr(gl, f"weight{expert}").mul_(2.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()
    y = gl._device_split(torch.randn(sum(splits), 32).bfloat16(), counts)  # the weights' gradients only
    with torch.no_grad():
        gl.weight1.mul_(2.0)
    y.sum().backward()  # nothing of the weights was saved: no error
    x = torch.randn(sum(splits), 32).bfloat16().requires_grad_()
    dy = torch.randn(sum(splits), 16).bfloat16()
    gl._device_split(x, counts).backward(dy)
    rows = torch.tensor(splits).cumsum(0).tolist()
    for g, (s, e) in enumerate(zip([0] + rows[:-1], rows)):
        want = (dy[s:e].float() @ getattr(gl, f"weight{g}").float()).bfloat16()
        assert torch.equal(x.grad[s:e], want)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("inputs_grad", [True, False], ids=["all_grads", "weights_only"])
def test_device_split_swiglu_probs_bit_identical_to_the_kept_swiglu_output(fp8, inputs_grad, monkeypatch, seed):
    """The device-split route's down-projection call (swiglu_probs: the
    SwiGLU in the route's autograd function; with a gradient to the gate|up
    rows or probabilities its bfloat16 output is not kept but made again in
    the backward for the bfloat16 weight gradient) against the route fed
    scaled_swiglu's output (which keeps it), in bfloat16 and in FP8 (current
    scaling, E4M3), the grouped GEMMs emulated on the CPU: the output and
    the gradients of the gate|up rows, the probabilities and the weights bit
    for bit; kept for the backward, the SwiGLU output [M, K] in bfloat16
    less, nothing else (with only the weights' gradients wanted it is kept,
    as the reference keeps it, instead of the larger gate|up rows)."""
    emulate_grouped_gemms(monkeypatch)
    splits, K, N = [5, 0, 19, 8], 32, 48
    M = sum(splits)
    gl = GroupedLinear(len(splits), K, N, bias=False, params_dtype=torch.bfloat16, device="cpu")
    h = torch.randn(M, 2 * K).bfloat16()
    probs = torch.rand(M)
    dy = torch.randn(M, N).bfloat16()
    counts = torch.tensor(splits)
    params = {w.untyped_storage().data_ptr() for w in gl.weights()}

    def step(fused):
        hh, pp = h.clone().requires_grad_(inputs_grad), probs.clone().requires_grad_(inputs_grad)
        for w in gl.weights():
            w.grad = None
        kept = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in params:
                kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with fp8_autocast(enabled=fp8, fp8_recipe=E4M3), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = gl._device_split(hh, counts, probs=pp) if fused else gl._device_split(moe.scaled_swiglu(hh, pp), counts)
        y.backward(dy)
        return [y.detach(), hh.grad, pp.grad] + [w.grad for w in gl.weights()], sum(kept.values())

    (got, kept), (ref, ref_kept) = step(True), step(False)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), i
    assert (got[1] is None) == (not inputs_grad)
    assert ref_kept - kept == (M * K * 2 if inputs_grad else 0)


# ---- CUDA: the products against float64 of their own FP8 operands ----------------------

CUDA_SPLITS = [[128, 256, 64, 512], [0, 300, 0, 1, 77, 0], [1000], [0, 0, 0, 5]]


def dequant(q, si):
    return q.double() * si.double()[..., None]


@pytest.mark.cuda
@pytest.mark.parametrize("splits", CUDA_SPLITS, ids=["balanced", "empty", "single", "mostly_empty"])
@pytest.mark.parametrize("fast_accum", [True, False])
def test_grouped_gemm_device_fp8_matches_float64(splits, fast_accum, seed):
    k, n, G, M = 256, 192, len(splits), sum(splits)
    x = torch.randn(M, k, device="cuda").bfloat16()
    w = torch.randn(G, n, k, device="cuda").bfloat16()
    xq, xs = quant.quantize_rowwise_fp8(x)
    wq, wt, wsi = moe.cast_fp8_current_stacked(w, torch.float8_e4m3fn)
    offsets = moe.device_split_offsets(torch.tensor(splits, device="cuda"), M)
    torch.full((4 * M * max(k, n),), float("nan"), dtype=torch.bfloat16, device="cuda")  # poison freed blocks
    y = moe.grouped_gemm_device_fp8(xq, xs, wq, wsi[:, None].expand(G, n), offsets, fast_accum=fast_accum)
    assert y.shape == (M, n) and y.dtype == torch.bfloat16
    xd, o = dequant(xq, xs), 0
    for g, m in enumerate(splits):
        if m:
            ref = xd[o:o + m] @ (wq[g].double() * wsi[g].double()).t()
            assert rel_error(y[o:o + m], ref) <= REL_TOL[torch.bfloat16]
        o += m
    # the input-gradient form: b = the transposed copies
    dy = torch.randn(M, n, device="cuda").bfloat16()
    dq, ds = quant.quantize_rowwise_fp8(dy)
    dx = moe.grouped_gemm_device_fp8(dq, ds, wt, wsi[:, None].expand(G, k), offsets, fast_accum=fast_accum)
    dd, o = dequant(dq, ds), 0
    for g, m in enumerate(splits):
        if m:
            assert rel_error(dx[o:o + m], dd[o:o + m] @ (wq[g].double() * wsi[g].double())) <= REL_TOL[torch.bfloat16]
        o += m


def fp8_layer_ref(x, w, dy, splits):
    """float64 forward and input gradient of the route from its own FP8
    operands (row-wise x and dy, per-expert W), and the bfloat16-input
    weight gradient."""
    xq, xs = rowwise_ref(x)
    dq, ds = rowwise_ref(dy)
    y, dx, dw, o = [], [], [], 0
    for g, m in enumerate(splits):
        amax = w[g].float().abs().amax()
        s = torch.tensor(448.0, device=w.device) / amax
        wd = (w[g].float() * s).to(torch.float8_e4m3fn).double() / s.double()
        y.append(dequant(xq[o:o + m], xs[o:o + m]) @ wd.t())
        dx.append(dequant(dq[o:o + m], ds[o:o + m]) @ wd)
        dw.append(dy[o:o + m].double().t() @ x[o:o + m].double())
        o += m
    return torch.cat(y), torch.cat(dx), dw


@pytest.mark.cuda
def test_grouped_linear_fp8_device_split(monkeypatch, caplog, seed):
    """GroupedLinear with a CUDA m_splits under Float8CurrentScaling(E4M3):
    the FP8 route's output and input gradient equal float64 of its FP8
    operands, its weight gradients the bfloat16 ones; against the bfloat16
    layer the FP8 error stays at E4M3's size; the route is named once."""
    monkeypatch.setattr(notes_module, "_noted", set())
    caplog.set_level(logging.INFO, logger="seqfuse")
    splits = [40, 0, 300, 17, 123]
    G, fin, fout = len(splits), 128, 256
    gl = GroupedLinear(G, fin, fout, bias=False, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(sum(splits), fin, device="cuda").bfloat16().requires_grad_()
    dy = torch.randn(sum(splits), fout, device="cuda").bfloat16()
    counts = torch.tensor(splits, device="cuda")
    with fp8_autocast(fp8_recipe=E4M3):
        y = gl(x, counts)
    y.backward(dy)
    ry, rdx, rdw = fp8_layer_ref(x.detach(), gl.stacked_weights(), dy, splits)
    assert rel_error(y, ry) <= REL_TOL[torch.bfloat16]
    assert rel_error(x.grad, rdx) <= REL_TOL[torch.bfloat16]
    for g, w in enumerate(gl.weights()):
        if splits[g]:
            assert rel_error(w.grad, rdw[g]) <= REL_TOL[torch.bfloat16]
        else:
            assert torch.equal(w.grad, torch.zeros_like(w.grad))
    # against the bfloat16 layer: E4M3's error (a relative step of 2^-4 per operand), not more
    yb = gl(x.detach(), splits)
    assert rel_error(y, yb) <= 0.1
    lines = [r.getMessage() for r in caplog.records if "one scale per row" in r.getMessage()]
    assert len(lines) == 1
    # no is_first_microbatch: the forward cast its copy, the backward the transposed one; none is kept
    assert gl.fp8_device_weight_casts == gl.fp8_device_weight_transpose_casts == 1
    assert gl.__dict__["_fp8_device_weights"] is None
    assert sum("made per call and freed after use" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.cuda
def test_grouped_linear_fp8_device_split_keeps_no_weight_copy(seed):
    """Training without is_first_microbatch (no FP8 weight copy kept)
    against is_first_microbatch=True (both copies cached) on the GPU: the
    CUDA transpose-only cast has the full cast's bytes and scales; the
    output and gradients are equal bit for bit; the memory allocated after
    the forward holds both copies (G x N x K bytes each) when kept and no
    copy at all otherwise; a weight changed in place between the forward
    and its backward raises autograd's error."""
    splits = [96, 0, 300, 17, 123, 64, 200, 1]
    G, fin, fout = len(splits), 1024, 2048
    copy_bytes = G * fout * fin  # one E4M3 copy of the stacked weights
    gl = GroupedLinear(G, fin, fout, bias=False, params_dtype=torch.bfloat16, device="cuda")
    w = gl.stacked_weights()
    data, data_t, si = moe.cast_fp8_current_stacked(w, torch.float8_e4m3fn)
    _, t_only, t_si = moe.cast_fp8_current_stacked(w, torch.float8_e4m3fn, rowwise=False)
    assert torch.equal(t_only.view(torch.uint8), data_t.view(torch.uint8)) and torch.equal(t_si, si)
    del data, data_t, t_only
    x0 = torch.randn(sum(splits), fin, device="cuda").bfloat16()
    dy = torch.randn(sum(splits), fout, device="cuda").bfloat16()
    counts = torch.tensor(splits, device="cuda")

    def step(first):
        """(bytes the forward left allocated beyond its output, y, dx, dW)."""
        for p in gl.weights():
            p.grad = None
        x = x0.clone().requires_grad_()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        with fp8_autocast(fp8_recipe=E4M3):
            y = gl(x, counts, is_first_microbatch=first)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - base - y.numel() * y.element_size()
        y.backward(dy)
        return held, y.detach(), x.grad, [p.grad for p in gl.weights()]

    step(None)  # warm: what a first call makes once (workspaces, scratch) exists before either measurement
    lean = step(None)
    assert gl.__dict__["_fp8_device_weights"] is None
    kept = step(True)
    assert gl.__dict__["_fp8_device_weights"] is not None
    # each step's holding asserted on its own: kept both copies and little else, lean no copy (what lean holds
    # besides, under copy_bytes // 4, a kept step need not hold, so their difference may fall short of two copies)
    assert 2 * copy_bytes <= kept[0] <= 2 * copy_bytes + copy_bytes // 4, (lean[0], kept[0])
    assert lean[0] < copy_bytes // 4, lean[0]
    for a, b in zip(lean[1:3] + tuple(lean[3]), kept[1:3] + tuple(kept[3])):
        assert torch.equal(a, b)
    again = step(None)  # drops the cached pair: its forward frees both copies
    # (within the scraps' allowance: what the first step's scraps were depends on what earlier tests left
    # cached, e.g. scale scratch made once per process)
    assert gl.__dict__["_fp8_device_weights"] is None, "the cached pair was kept"
    assert again[0] <= lean[0] - 2 * copy_bytes + copy_bytes // 4, (again[0], lean[0])
    # the warm-up, lean and again steps cast per call (forward copy, backward transposed copy); kept cast both once
    assert gl.fp8_device_weight_casts == 4 and gl.fp8_device_weight_transpose_casts == 3
    x = x0.clone().requires_grad_()
    with fp8_autocast(fp8_recipe=E4M3):
        y = gl(x, counts)
    with torch.no_grad():
        gl.weight3.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward(dy)


@pytest.mark.cuda
def test_grouped_mlp_fp8_device_split_never_waits_on_the_host(seed):
    """A GroupedMLP step under Float8CurrentScaling(E4M3) takes the routing
    counts on the GPU (no synchronizing call in forward or backward, over
    two steps with a weight update between; no FP8 weight copy is kept, so
    each forward casts the experts' weights and each backward their
    transposed copies), and stays at E4M3's error from the bfloat16 block."""
    dev, ref, xd, xr, g = grouped_mlp_pair(256, 512, 8)
    with no_host_sync():
        for step in range(2):
            xd.grad = None
            dev.zero_grad(set_to_none=True)
            with fp8_autocast(fp8_recipe=E4M3):
                yd = dev(xd)
            (yd * g).sum().backward()
            if step == 0:
                with torch.no_grad():
                    for p in dev.parameters():
                        p.mul_(1.0)  # an optimizer-like update after the backward (no version error)
    assert dev.fc1.fp8_device_weight_casts == dev.fc2.fp8_device_weight_casts == 2
    assert dev.fc1.fp8_device_weight_transpose_casts == dev.fc2.fp8_device_weight_transpose_casts == 2
    yr = ref(xr)
    (yr * g).sum().backward()
    assert rel_error(yd, yr) <= 0.1
    assert rel_error(xd.grad, xr.grad) <= 0.1
    for (n, pd), (_, pr) in zip(dev.named_parameters(), ref.named_parameters()):
        assert rel_error(pd.grad, pr.grad) <= 0.1, n
