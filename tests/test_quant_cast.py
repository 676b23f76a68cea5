"""FP8 conversions and the per-tensor casts (seqfuse.ops.cast_fp8,
cast_transpose_fp8, dequantize_fp8, transpose_fp8) against float64 references and torch's
float8 casts on the CPU, and the CUDA backend against the CPU bit for bit."""
import pytest
import torch

import seqfuse
from seqfuse import ops
from helpers import needs_fp8

pytestmark = needs_fp8

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = [E4M3, E5M2]
FLOATS = [torch.float32, torch.float16, torch.bfloat16]
MAXV = {E4M3: 448.0, E5M2: 57344.0}
NAN_BYTE = 0x7F


def bits(t):
    return t.view(torch.uint8)


def one(v, device="cpu"):
    return torch.tensor([v], dtype=torch.float32, device=device)


def grid(fp8):
    """Every finite value of the format, as float64, with its code."""
    codes = torch.arange(256, dtype=torch.uint8)
    vals = codes.view(fp8).to(torch.float64)
    keep = torch.isfinite(vals)
    return vals[keep], codes[keep]


def rne_reference(x, fp8):
    """float64 model of RNE with saturation: the nearest finite value of the
    format, ties to the even code, beyond max -> +-max, NaN -> 0x7f."""
    vals, codes = grid(fp8)
    x64 = x.to(torch.float64)
    clamped = x64.clamp(-MAXV[fp8], MAXV[fp8])
    d = (clamped[:, None] - vals[None, :]).abs()
    best = d.min(dim=1, keepdim=True).values
    cand = d == best
    # among equally near codes: prefer the even one (mantissa LSB 0), then
    # the one with x's sign (+0 / -0)
    same_sign = (codes[None, :] >= 128) == torch.signbit(x64)[:, None]
    score = cand.to(torch.int64) * 4 + ((codes[None, :] & 1) == 0).to(torch.int64) * 2 \
        + same_sign.to(torch.int64)
    out = codes[score.argmax(dim=1)]
    out[torch.isnan(x64) | torch.isinf(x64)] = NAN_BYTE  # (infinities: NaN, not saturated)
    return out


def cast_cpu(x, fp8):
    return ops.cast_fp8(x, one(1.0), None, fp8)


@pytest.mark.parametrize("fp8", FP8)
def test_every_bf16_and_fp16_value_matches_torch_where_finite(fp8):
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype)
        ours = bits(cast_cpu(x, fp8))
        theirs = x.to(fp8)
        finite = torch.isfinite(theirs.float()) & torch.isfinite(x.float())
        assert torch.equal(ours[finite], bits(theirs)[finite])
        # where torch overflows (NaN / inf) we saturate with the sign
        over = ~finite & torch.isfinite(x.float())
        sat = torch.where(x.float()[over] > 0, MAXV[fp8], -MAXV[fp8])
        assert torch.equal(ours[over].view(fp8).float(), sat)
        assert (ours[torch.isnan(x.float())] == NAN_BYTE).all()
        # an infinity becomes NaN, not the largest finite value: a non-finite input stays non-finite
        assert (ours[torch.isinf(x.float())] == NAN_BYTE).all()


@pytest.mark.parametrize("fp8", FP8)
def test_float32_against_float64_rne_model(fp8, seed):
    vals, _ = grid(fp8)
    v = vals.unique().sort().values
    mids = (v[1:] + v[:-1]) / 2  # exact ties
    near = torch.cat([mids, torch.nextafter(mids.float(), torch.tensor(float("inf"))).double(),
                      torch.nextafter(mids.float(), torch.tensor(-float("inf"))).double()])
    rand_bits = torch.randint(-2**31, 2**31 - 1, (20000,), dtype=torch.int64).to(torch.int32)
    x = torch.cat([near.float(), v.float(), rand_bits.view(torch.float32),
                   torch.randn(5000) * MAXV[fp8] / 8, torch.randn(5000) * 1e-3,
                   torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"),
                                 MAXV[fp8] * 1.03, 1e-45, -1e-45, 3e38])])
    ours = bits(cast_cpu(x, fp8))
    ref = rne_reference(x, fp8)
    bad = (ours != ref).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} mismatches, first x={x[bad[0]].item()!r} ours={ours[bad[0]]} ref={ref[bad[0]]}"
    theirs = x.to(fp8)
    finite = torch.isfinite(theirs.float()) & torch.isfinite(x)
    assert torch.equal(ours[finite], bits(theirs)[finite])


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("shape", [(1,), (7, 13), (16, 8), (130, 264), (3, 5, 16), (0, 8)])
def test_cast_transpose_cpu(shape, dtype, fp8, seed):
    x = (torch.randn(shape) * 30).to(dtype)
    scale = one(3.5)
    amax = one(0.0)
    si = one(float("nan"))
    data, data_t = ops.cast_transpose_fp8(x, scale, amax, fp8, scale_inv=si)
    ref = rne_reference((x.float() * 3.5).flatten(), fp8).view(x.shape)
    assert data.shape == x.shape and data.dtype == fp8
    assert torch.equal(bits(data), ref)
    k = shape[-1]
    assert torch.equal(bits(data_t), ref.reshape(-1, k).t())
    expect = x.float().abs().max().item() if x.numel() else 0.0
    assert amax.item() == expect
    assert si.item() == (1 / torch.tensor(3.5)).item() and si.dtype == torch.float32
    plain = ops.cast_fp8(x, scale, None, fp8)
    assert torch.equal(bits(plain), ref)



@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("shape", [(1,), (7, 13), (16, 8), (130, 264), (3, 5, 16), (0, 8)])
def test_transpose_fp8_cpu(shape, fp8, seed):
    codes = torch.randint(0, 256, shape, dtype=torch.uint8)
    data = codes.view(fp8)
    k = shape[-1]
    out = ops.transpose_fp8(data)
    assert out.dtype == fp8 and out.shape == (k, data.numel() // k)
    assert torch.equal(bits(out), codes.reshape(-1, k).t())


def test_transpose_fp8_errors():
    data = torch.zeros(32, 16, dtype=E4M3)
    with pytest.raises(TypeError, match="argument 'data' must have dtype float8"):
        ops.transpose_fp8(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="argument 'data' must be contiguous"):
        ops.transpose_fp8(data.t())
    with pytest.raises(ValueError, match="at least 1 dimension"):
        ops.transpose_fp8(torch.zeros((), dtype=E4M3))
    with pytest.raises(ValueError, match=r"argument 'out_t' must have shape \[16, 32\]"):
        ops.transpose_fp8(data, out=torch.empty(16, 31, dtype=E4M3))
    with pytest.raises(TypeError, match="argument 'out_t' must have data's dtype float8_e4m3fn"):
        ops.transpose_fp8(data, out=torch.empty(16, 32, dtype=E5M2))
    with pytest.raises(ValueError, match="argument 'out_t' must be contiguous"):
        ops.transpose_fp8(data, out=torch.empty(32, 16, dtype=E4M3).t())



def dbias_order_reference(x):
    """The kernel's summation order, in float32, in Python (cast_cuda.cu):
    per 128-row block, thread (warp w, half h) adds rows 2w+h, 2w+h+16, ...;
    the halves are added, then the 8 warps in order."""
    m, k = x.shape
    x = x.float()
    out = torch.empty(((m + 127) // 128, k), dtype=torch.float32)
    for b in range(out.shape[0]):
        total = None
        for w in range(8):
            half = []
            for h in range(2):
                acc = torch.zeros(k, dtype=torch.float32)
                for i in range(8):
                    r = b * 128 + 2 * w + h + 16 * i
                    if r < m:
                        acc = acc + x[r]
                half.append(acc)
            pair = half[0] + half[1]
            total = pair if total is None else total + pair
        out[b] = total
    return column_sums_reference(out)


def column_sums_reference(parts, dtype=torch.float32):
    """sf_column_sums' order in Python: eight interleaved slices of the rows
    (p = i, i + 8, ...), each added left to right in float32, then the
    slices in turn; rounded once to ``dtype``."""
    total = torch.zeros(parts.shape[1], dtype=torch.float32)
    for i in range(8):
        acc = torch.zeros(parts.shape[1], dtype=torch.float32)
        for p in range(i, parts.shape[0], 8):
            acc = acc + parts[p]
        total = total + acc
    return total.to(dtype)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(1, 8), (3, 24), (17, 40), (40, 1), (0, 16), (5, 0)])
def test_column_sums_cpu(shape, dtype, seed):
    """The per-block sums' total in the fixed order, bit for bit, and close to
    the float64 sum."""
    parts = torch.randn(shape) * 7
    out = ops.quant.column_sums(parts, dtype)
    assert out.dtype == dtype and out.shape == (shape[1],)
    assert torch.equal(out, column_sums_reference(parts, dtype))
    ref = parts.double().sum(0)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}[dtype]
    assert torch.allclose(out.double(), ref, rtol=tol, atol=tol * parts.double().abs().sum(0).max().item()
                          if parts.numel() else 0.0)


@pytest.mark.parametrize("recipe", ["delayed", "current", "block"])
def test_quantize_grad_bias_gradient_dtype(recipe, seed):
    """GradQuantizer.quantize_grad: the bias gradient comes back in the
    bias's dtype, rounded once from the float32 total of the cast's block
    sums (a float64 bias: that float32 total converted), at aligned and
    unaligned rows, close to the float64 column sum."""
    import seqfuse.pytorch as te
    from seqfuse.common.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling
    from seqfuse.quantization import gemm_quantizers as gq

    rec = {"delayed": DelayedScaling, "current": Float8CurrentScaling, "block": Float8BlockScaling}[recipe]()
    m = te.Linear(128, 256, device="cpu", params_dtype=torch.bfloat16)
    grad = gq.quantizers_for(m, rec, torch.device("cpu")).grads[0]
    for rows in (48, 40):
        dy = (torch.randn(rows, 256) * 3).to(torch.bfloat16)
        got = {dt: grad.quantize_grad(dy, dt)[1] for dt in (torch.float32, torch.bfloat16, torch.float64)}
        for dt, db in got.items():
            assert db.dtype == dt and db.shape == (256,)
        assert torch.equal(got[torch.bfloat16], got[torch.float32].to(torch.bfloat16))  # one rounding
        assert torch.equal(got[torch.float64], got[torch.float32].double())
        ref = dy.double().sum(0)
        assert torch.allclose(got[torch.float32].double(), ref, rtol=1e-5,
                              atol=1e-5 * dy.double().abs().sum(0).max().item())


def test_column_sums_errors():
    with pytest.raises(TypeError, match="argument 'col_sums' must be a torch.Tensor"):
        ops.quant.column_sums([1.0, 2.0])
    with pytest.raises(TypeError, match="argument 'dtype' must be torch.float32, torch.bfloat16 or torch.float16"):
        ops.quant.column_sums(torch.zeros(2, 3), torch.float64)
    with pytest.raises(TypeError, match="argument 'col_sums' must have dtype float32"):
        ops.quant.column_sums(torch.zeros(2, 3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="argument 'col_sums' must be 2-D"):
        ops.quant.column_sums(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="argument 'col_sums' must be contiguous"):
        ops.quant.column_sums(torch.zeros(3, 2).t())
    with pytest.raises(ValueError, match=r"argument 'out' must have 3 element\(s\), got 4"):
        seqfuse._C.column_sums(torch.zeros(2, 3), torch.empty(4), None)
    x, amax = torch.randn(32, 16), one(0.0)
    with pytest.raises(TypeError, match="argument 'dbias_dtype' must be torch.float32"):
        ops.cast_transpose_fp8(x, one(1.0), amax, E4M3, dbias=True, dbias_dtype=torch.float64)
    assert amax.item() == 0.0  # refused before the cast ran


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(1, 8), (3, 24), (17, 40), (128, 5120), (9, 1000), (0, 16)])
def test_cuda_column_sums_bit_identical(shape, dtype, seed):
    parts = torch.randn(shape) * 7
    out = torch.full((shape[1],), float("nan"), dtype=dtype, device="cuda")
    seqfuse._C.column_sums(parts.cuda(), out, None)
    assert torch.equal(out.cpu(), ops.quant.column_sums(parts, dtype))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(16, 8), (144, 24), (256, 64), (2, 8, 16), (0, 8)])
def test_cast_transpose_dbias_cpu(shape, dtype, seed):
    x = (torch.randn(shape) * 3).to(dtype)
    amax = one(0.0)
    data, data_t, db = ops.cast_transpose_fp8(x, one(1.5), amax, E5M2, dbias=True)
    ref_data, ref_t = ops.cast_transpose_fp8(x, one(1.5), None, E5M2)
    assert torch.equal(bits(data), bits(ref_data)) and torch.equal(bits(data_t), bits(ref_t))
    assert amax.item() == (x.float().abs().max().item() if x.numel() else 0.0)
    x2 = x.reshape(-1, shape[-1])
    assert db.dtype == torch.float32 and db.shape == (shape[-1],)
    assert torch.equal(db, dbias_order_reference(x2))  # the kernel's order, bit for bit
    ref = x2.double().sum(0)
    assert torch.allclose(db.double(), ref, rtol=1e-5, atol=1e-5 * x2.double().abs().sum(0).max().item())


def test_cast_transpose_dbias_errors():
    x = torch.randn(32, 16)
    with pytest.raises(ValueError, match=r"K % 8 == 0 and M % 16 == 0"):
        ops.cast_transpose_fp8(torch.randn(20, 16), one(1.0), None, E4M3, dbias=True)
    with pytest.raises(ValueError, match=r"K % 8 == 0 and M % 16 == 0"):
        ops.cast_transpose_fp8(torch.randn(32, 12), one(1.0), None, E4M3, dbias=True)
    assert ops.quant.dbias_fusable(x) and not ops.quant.dbias_fusable(x[:20])
    assert not ops.quant.dbias_fusable(torch.randn(16, 32).t())
    with pytest.raises(ValueError, match="'col_sums' must have shape \\[1, 16\\]"):
        seqfuse._C.cast_fp8_dbias(x, one(1.0), None, None, torch.empty(16, 32, dtype=E4M3), None,
                                  torch.empty(2, 16), None)
    with pytest.raises(TypeError, match="argument 'out_t' must be a tensor"):
        seqfuse._C.cast_fp8_dbias(x, one(1.0), None, torch.empty(32, 16, dtype=E4M3), None, None,
                                  torch.empty(1, 16), None)
    with pytest.raises(ValueError, match="needs transpose=True"):
        from seqfuse.quantization import quantize
        quantize(x, one(1.0), None, E4M3, dbias=True)


def test_quantize_grad_fuses_the_bias_gradient_or_says_it_does_not(caplog):
    """GradQuantizer.quantize_grad: the sums come from the cast where its
    kernel takes dy; a dy it does not take (not contiguous here) gets a
    separate column sum, with one WARNING."""
    import logging

    import seqfuse.pytorch as te
    from seqfuse.common.recipe import Float8CurrentScaling, Format
    from seqfuse.quantization import gemm_quantizers as gq

    m = te.Linear(16, 48, device="cpu", params_dtype=torch.bfloat16)
    grad = gq.quantizers_for(m, Float8CurrentScaling(fp8_format=Format.HYBRID), torch.device("cpu")).grads[0]
    assert grad.fp8_dtype == E5M2
    dy = torch.randn(32, 48).to(torch.bfloat16)
    gq.GradQuantizer._fallback_logged.clear()
    with caplog.at_level(logging.WARNING, logger="seqfuse"):
        g, db = grad.quantize_grad(dy, torch.bfloat16)
        g2, db2 = grad.quantize_grad(dy.t().contiguous().t(), torch.bfloat16)
        grad.quantize_grad(dy.t().contiguous().t(), torch.bfloat16)
    warned = [r for r in caplog.records if "separate pass" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
    ref = dy.double().sum(0)
    for d in (db, db2):
        assert d.dtype == torch.bfloat16 and torch.allclose(d.double(), ref, rtol=1e-2, atol=1e-2)
    assert torch.equal(bits(g.data), bits(g2.data)) and torch.equal(bits(g.data_t), bits(g2.data_t))
    assert grad.quantize_grad(dy, None)[1] is None


def test_amax_accumulates():
    x = torch.tensor([[1.0, -3.0]])
    amax = one(5.0)
    ops.cast_fp8(x, one(1.0), amax, E4M3)
    assert amax.item() == 5.0
    amax.fill_(2.0)
    ops.cast_transpose_fp8(x, one(1.0), amax, E4M3)
    assert amax.item() == 3.0
    x[0, 0] = float("nan")
    ops.cast_fp8(x, one(1.0), amax, E4M3)
    assert torch.isnan(amax).all()


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("fp8", FP8)
def test_dequantize_against_float64(dtype, fp8, seed):
    x = torch.randn(37, 29) * 100
    q = ops.cast_fp8(x, one(0.5), None, fp8)
    si = one(2.0)
    y = ops.dequantize_fp8(q, si, dtype)
    ref = (q.to(torch.float64) * 2.0).to(dtype)
    assert y.dtype == dtype and torch.equal(y, ref)
    # dequantized error within half an FP8 step (relative 2^-4 / 2^-3) in the normal range
    rel = {E4M3: 2.0 ** -4, E5M2: 2.0 ** -3}[fp8]
    xs = x.double()
    normal = (xs.abs() * 0.5 >= {E4M3: 2.0 ** -6, E5M2: 2.0 ** -14}[fp8]) & (xs.abs() * 0.5 <= MAXV[fp8])
    err = ((q.double() * 2.0 - xs).abs() / xs.abs())[normal]
    assert err.max().item() <= rel + 1e-3 * rel + (2 ** -8 if dtype != torch.float32 else 0)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("fp8", FP8)
def test_dequantize_nan_codes_give_the_defined_nan_bits(dtype, fp8):
    """Every NaN code, either sign, becomes the positive default quiet NaN
    (fp8.h SF_DEQUANT_NAN_*): the bits the CUDA kernel writes too."""
    codes = [0x7F, 0xFF] if fp8 == E4M3 else [0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF]
    q = torch.tensor(codes, dtype=torch.uint8).view(fp8)
    y = ops.dequantize_fp8(q, one(0.37), dtype)
    bits = {torch.float32: (torch.int32, 0x7FC00000), torch.float16: (torch.int16, 0x7E00),
            torch.bfloat16: (torch.int16, 0x7FC0)}[dtype]
    assert (y.view(bits[0]) == bits[1]).all(), y.view(bits[0])
    if fp8 == E5M2:  # the infinities stay infinities
        inf = ops.dequantize_fp8(torch.tensor([0x7C, 0xFC], dtype=torch.uint8).view(fp8), one(0.37), dtype)
        assert inf.tolist() == [float("inf"), float("-inf")]


def test_cast_errors():
    x = torch.randn(4, 8)
    with pytest.raises(TypeError, match="cast_fp8: argument 'x' must have dtype float32, float16 or bfloat16, got torch.int32"):
        ops.cast_fp8(torch.ones(3, dtype=torch.int32), one(1.0), None, E4M3)
    with pytest.raises(TypeError, match="argument 'fp8_dtype' must be torch.float8_e4m3fn"):
        ops.cast_fp8(x, one(1.0), None, torch.float16)
    with pytest.raises(TypeError, match="cast_fp8: argument 'scale' must have dtype float32, got float16"):
        ops.cast_fp8(x, torch.ones(1, dtype=torch.float16), None, E4M3)
    with pytest.raises(ValueError, match="cast_fp8: argument 'scale' must have 1 element\\(s\\), got 2"):
        ops.cast_fp8(x, torch.ones(2), None, E4M3)
    with pytest.raises(ValueError, match="cast_fp8: argument 'amax' must have 1 element"):
        ops.cast_fp8(x, one(1.0), torch.zeros(3), E4M3)
    with pytest.raises(ValueError, match=r"cast_fp8: argument 'out_t' must have shape \[8, Mp\] with Mp >= 4"):
        ops.cast_transpose_fp8(x, one(1.0), None, E4M3, out_t=torch.empty(4, 8, dtype=E4M3))
    with pytest.raises(TypeError, match="cast_fp8: argument 'out' must have dtype float8_e4m3fn or float8_e5m2, got float32"):
        seqfuse._C.cast_fp8(x, one(1.0), None, torch.empty(4, 8), None, None)
    with pytest.raises(ValueError, match="at least one of 'out' and 'out_t'"):
        seqfuse._C.cast_fp8(x, one(1.0), None, None, None, None)
    with pytest.raises(TypeError, match="must have the same FP8 dtype"):
        seqfuse._C.cast_fp8(x, one(1.0), None, torch.empty(4, 8, dtype=E4M3),
                            torch.empty(8, 4, dtype=E5M2), None)
    with pytest.raises(TypeError, match="dequantize_fp8: argument 'data' must have dtype float8"):
        ops.dequantize_fp8(torch.ones(3), one(1.0))


# ---- CUDA against the CPU, bit for bit ------------------------------------

def poisoned(shape, dtype, device="cuda"):
    t = torch.empty(shape, dtype=dtype, device=device)
    t.view(torch.uint8).fill_(0xFF)
    return t


CUDA_SHAPES = [(16, 16), (128, 128), (256, 384), (4096, 4096), (1000, 8), (48, 1032),
               (7, 13), (1, 1), (33, 17), (130, 264), (2, 64, 96)]


@pytest.mark.cuda
@pytest.mark.parametrize("shape", CUDA_SHAPES)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("fp8", FP8)
def test_cuda_cast_transpose_bit_identical(shape, dtype, fp8, seed):
    x = (torch.randn(shape, device="cuda") * 200).to(dtype)
    x.view(-1)[:: 97] *= 1e-6  # some subnormal results
    k = shape[-1]
    m = x.numel() // k
    scale = one(1.7, "cuda")
    out, out_t = poisoned(shape, fp8), poisoned((k, m), fp8)
    amax, si = one(0.0, "cuda"), one(float("nan"), "cuda")
    ops.cast_transpose_fp8(x, scale, amax, fp8, out=out, out_t=out_t, scale_inv=si)
    amax_c, si_c = one(0.0), one(float("nan"))
    ref, ref_t = ops.cast_transpose_fp8(x.cpu(), scale.cpu(), amax_c, fp8, scale_inv=si_c)
    assert torch.equal(bits(out).cpu(), bits(ref))
    assert torch.equal(bits(out_t).cpu(), bits(ref_t))
    assert amax.item() == amax_c.item() and si.item() == si_c.item()
    out2 = poisoned(shape, fp8)
    amax2 = one(0.0, "cuda")
    ops.cast_fp8(x, scale, amax2, fp8, out=out2)
    assert torch.equal(bits(out2).cpu(), bits(ref)) and amax2.item() == amax_c.item()


@pytest.mark.cuda
@pytest.mark.parametrize("fp8", FP8)
def test_cuda_all_bf16_values_and_specials(fp8):
    x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).view(256, 256)
    ref, ref_t = ops.cast_transpose_fp8(x, one(1.0), None, fp8)
    out, out_t = ops.cast_transpose_fp8(x.cuda(), one(1.0, "cuda"), None, fp8)
    assert torch.equal(bits(out).cpu(), bits(ref)) and torch.equal(bits(out_t).cpu(), bits(ref_t))
    xf = torch.randint(-2**31, 2**31 - 1, (1 << 20,), dtype=torch.int64).to(torch.int32).view(torch.float32)
    for s in (1.0, 3.0e-5, 1.0e5):
        a = ops.cast_fp8(xf, one(s), None, fp8)
        b = ops.cast_fp8(xf.cuda(), one(s, "cuda"), None, fp8)
        assert torch.equal(bits(a), bits(b).cpu())


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", FLOATS)
def test_cuda_unaligned_inputs(dtype, seed):
    base = torch.randn(64 * 136 + 3, device="cuda").to(dtype)
    x = base[3:].view(64, 136)  # not 16-byte aligned: the generic kernel
    ref, ref_t = ops.cast_transpose_fp8(x.cpu(), one(2.0), None, E4M3)
    out, out_t = ops.cast_transpose_fp8(x, one(2.0, "cuda"), None, E4M3)
    assert torch.equal(bits(out).cpu(), bits(ref)) and torch.equal(bits(out_t).cpu(), bits(ref_t))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("fp8", FP8)
def test_cuda_dequantize_bit_identical(dtype, fp8, seed):
    # every code, NaN codes included (E4M3 0x7f/0xff, E5M2 0x7d-0x7f/0xfd-0xff):
    # both backends write the NaN bits fp8.h defines; compared as bits (NaN != NaN)
    q = torch.randint(0, 256, (1000, 33), dtype=torch.uint8)
    q[0, :] = torch.tensor([0x7C, 0x7D, 0x7E, 0x7F, 0xFC, 0xFD, 0xFE, 0xFF] * 4 + [0x80], dtype=torch.uint8)
    q = q.view(fp8)
    si = one(0.37)
    ref = ops.dequantize_fp8(q, si, dtype)
    out = torch.full((1000, 33), float("nan"), dtype=dtype, device="cuda")
    ops.dequantize_fp8(q.cuda(), si.cuda(), dtype, out=out)
    assert torch.equal(out.cpu().view(torch.uint8), ref.view(torch.uint8))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("offset", [0, 1, 3])
def test_cuda_dequantize_vector_and_tail_paths(dtype, offset, seed):
    """The kernel's 8-at-a-time path (aligned data and output), its tail (a
    length that is no multiple of 8) and its one-at-a-time path (data starting
    off an 8-byte boundary): every element bit-identical to the CPU backend."""
    n = 8 * 4099 + 5
    codes = torch.randint(0, 256, (n + offset,), dtype=torch.uint8)
    q = codes.view(torch.float8_e4m3fn)[offset:]
    si = one(1.7)
    ref = ops.dequantize_fp8(q, si, dtype)
    out = torch.full((n,), float("nan"), dtype=dtype, device="cuda")
    ops.dequantize_fp8(codes.cuda().view(torch.float8_e4m3fn)[offset:], si.cuda(), dtype, out=out)
    assert torch.equal(out.cpu().view(torch.uint8), ref.view(torch.uint8))



@pytest.mark.cuda
@pytest.mark.parametrize("shape", CUDA_SHAPES + [(16384, 1280), (4096, 5120), (160, 48), (32, 2064)])
@pytest.mark.parametrize("fp8", FP8)
def test_cuda_transpose_fp8_bit_identical(shape, fp8, seed):
    """Every byte against the CPU backend, outputs poisoned: the tiled kernel
    (K, M multiples of 16, partial 128-tiles at the edges) and the generic one."""
    codes = torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda")
    data = codes.view(fp8)
    k = shape[-1]
    out = poisoned((k, data.numel() // k), fp8)
    ops.transpose_fp8(data, out=out)
    assert torch.equal(bits(out).cpu(), bits(ops.transpose_fp8(data.cpu())))


@pytest.mark.cuda
def test_cuda_transpose_fp8_unaligned_and_on_current_stream():
    base = torch.randint(0, 256, (64 * 48 + 1,), dtype=torch.uint8, device="cuda")
    data = base[1:].view(64, 48).view(E4M3)  # not 16-byte aligned: the generic kernel
    assert torch.equal(bits(ops.transpose_fp8(data)).cpu(), base[1:].view(64, 48).t().cpu())
    s = torch.cuda.Stream()
    big = torch.randint(0, 256, (2048, 1024), dtype=torch.uint8, device="cuda").view(E5M2)
    with torch.cuda.stream(s):
        out = ops.transpose_fp8(big)
    s.synchronize()
    assert torch.equal(bits(out), bits(big).t())


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(16, 8), (144, 24), (4096, 1280), (16384, 5120), (1040, 136), (2, 64, 96)])
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("fp8", FP8)
def test_cuda_cast_transpose_dbias_bit_identical(shape, dtype, fp8, seed):
    """Data, transposed copy, amax and the bias gradient (the block sums in
    the kernel's order, then column_sums over the blocks) against the CPU
    backend; outputs poisoned."""
    x = (torch.randn(shape, device="cuda") * 5).to(dtype)
    k = shape[-1]
    m = x.numel() // k
    out, out_t = poisoned(shape, fp8), poisoned((k, m), fp8)
    amax = one(0.0, "cuda")
    data, data_t, db = ops.cast_transpose_fp8(x, one(0.75, "cuda"), amax, fp8, out=out, out_t=out_t, dbias=True)
    amax_c = one(0.0)
    ref, ref_t, ref_db = ops.cast_transpose_fp8(x.cpu(), one(0.75), amax_c, fp8, dbias=True)
    assert torch.equal(bits(data).cpu(), bits(ref)) and torch.equal(bits(data_t).cpu(), bits(ref_t))
    assert amax.item() == amax_c.item()
    sums = torch.full(((m + 127) // 128, k), float("nan"), device="cuda")
    seqfuse._C.cast_fp8_dbias(x, one(0.75, "cuda"), None, None, poisoned((k, m), fp8), None, sums, None)
    sums_c = torch.empty(((m + 127) // 128, k))
    seqfuse._C.cast_fp8_dbias(x.cpu(), one(0.75), None, None, torch.empty((k, m), dtype=fp8), None, sums_c, None)
    assert torch.equal(sums.cpu(), sums_c)  # the kernel's fixed order, bit for bit
    assert torch.equal(db.cpu(), ref_db)  # and the total over the blocks
    assert torch.allclose(db.double().cpu(), x.double().reshape(m, k).sum(0).cpu(), rtol=1e-5, atol=1e-3)


@pytest.mark.cuda
def test_cuda_cast_dbias_refuses_unaligned():
    base = torch.randn(64 * 32 + 8, device="cuda", dtype=torch.bfloat16)
    x = base[1:2049].view(64, 32)  # 2 bytes past an allocation's start
    assert not ops.quant.dbias_fusable(x)
    with pytest.raises(ValueError, match="argument 'x' must be 16-byte aligned"):
        ops.cast_transpose_fp8(x, one(1.0, "cuda"), None, E4M3, dbias=True)
    ok = torch.randn(64, 32, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(64 * 32 + 1, dtype=torch.uint8, device="cuda")[1:].view(E4M3).view(64, 32)
    with pytest.raises(ValueError, match="argument 'out' must be 8-byte aligned"):
        ops.cast_transpose_fp8(ok, one(1.0, "cuda"), None, E4M3, out=out, dbias=True)

@pytest.mark.cuda
def test_cuda_cast_graph_capturable_and_on_current_stream():
    x = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16)
    scale, amax = one(2.0, "cuda"), one(0.0, "cuda")
    out, out_t = torch.empty(1024, 512, dtype=E4M3, device="cuda"), torch.empty(512, 1024, dtype=E4M3, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ops.cast_transpose_fp8(x, scale, amax, E4M3, out=out, out_t=out_t)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ops.cast_transpose_fp8(x, scale, amax, E4M3, out=out, out_t=out_t)
    x.mul_(3)
    amax.zero_()
    g.replay()
    torch.cuda.synchronize()
    ref, ref_t = ops.cast_transpose_fp8(x.cpu(), one(2.0), None, E4M3)
    assert torch.equal(bits(out).cpu(), bits(ref)) and torch.equal(bits(out_t).cpu(), bits(ref_t))
    assert amax.item() == x.float().abs().max().item()


# ---- padded token rows (rows=): the FP8 GEMMs' zero padding written by the cast ----

def padded_reference(x, rows, fp8, scale=1.5, dbias=False):
    """The cast of x padded by hand with zero rows: what rows= must equal bit for bit."""
    x2 = x.reshape(-1, x.shape[-1])
    xp = torch.cat((x2, x2.new_zeros(rows - x2.shape[0], x2.shape[1])))
    return ops.cast_transpose_fp8(xp, one(scale, x.device), None, fp8, dbias=dbias)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("shape,rows", [((7, 13), 16), ((1, 16), 16), ((20, 24), 32), ((130, 264), 144),
                                        ((3, 5, 16), 16), ((0, 8), 16), ((16, 8), 48)])
def test_cast_rows_pads_with_zeros_cpu(shape, rows, dtype, fp8, seed):
    x = (torch.randn(shape) * 30).to(dtype)
    k, m = shape[-1], x.numel() // shape[-1]
    amax, si = one(0.0), one(float("nan"))
    data, data_t = ops.cast_transpose_fp8(x, one(1.5), amax, fp8, scale_inv=si, rows=rows)
    ref, ref_t = padded_reference(x, rows, fp8)
    assert data.shape == (rows, k) and data_t.shape == (k, rows)
    assert torch.equal(bits(data), bits(ref)) and torch.equal(bits(data_t), bits(ref_t))
    assert not bits(data)[m:].any() and not bits(data_t)[:, m:].any()
    assert amax.item() == (x.float().abs().max().item() if x.numel() else 0.0)
    assert si.item() == (1 / torch.tensor(1.5)).item()
    plain = ops.cast_fp8(x, one(1.5), None, fp8, rows=rows)  # the row-wise copy alone
    assert plain.shape == (rows, k) and torch.equal(bits(plain), bits(ref))
    cur, cur_t = ops.quant.cast_fp8_current(x, fp8, amax=one(0.0), scale=one(0.0), scale_inv=one(0.0),
                                            transpose=True, rows=rows)
    assert cur.shape == (rows, k) and cur_t.shape == (k, rows) and not bits(cur_t)[:, m:].any()


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape,rows", [((7, 8), 16), ((130, 24), 144), ((100, 64), 112), ((1, 8), 16)])
def test_cast_rows_dbias_cpu(shape, rows, dtype, seed):
    x = (torch.randn(shape) * 3).to(dtype)
    assert ops.quant.dbias_fusable(x, rows=rows) and not ops.quant.dbias_fusable(x)
    data, data_t, db = ops.cast_transpose_fp8(x, one(1.5), None, E5M2, dbias=True, rows=rows)
    ref, ref_t, ref_db = padded_reference(x, rows, E5M2, dbias=True)
    assert torch.equal(bits(data), bits(ref)) and torch.equal(bits(data_t), bits(ref_t))
    assert torch.equal(db, ref_db)


def test_cast_rows_errors():
    x = torch.randn(20, 16)
    with pytest.raises(ValueError, match=r"cast_transpose_fp8: argument 'rows' \(16\) must be at least x's row count 20"):
        ops.cast_transpose_fp8(x, one(1.0), None, E4M3, rows=16)
    with pytest.raises(ValueError, match=r"argument 'rows' \(8\) must be at least"):
        ops.cast_fp8(x, one(1.0), None, E4M3, rows=8)
    with pytest.raises(ValueError, match="cast_fp8: argument 'rows' must be a whole number, got 16.5"):
        ops.cast_fp8(x, one(1.0), None, E4M3, rows=16.5)
    with pytest.raises(ValueError, match=r"'out_t' must have shape \[16, Mp\] with Mp >= 20"):
        seqfuse._C.cast_fp8(x, one(1.0), None, None, torch.empty(16, 19, dtype=E4M3), None, None)
    with pytest.raises(ValueError, match=r"'out' must have x's 320 elements or shape \[32, 16\]"):
        seqfuse._C.cast_fp8(x, one(1.0), None, torch.empty(48, 16, dtype=E4M3),
                            torch.empty(16, 32, dtype=E4M3), None, None)
    with pytest.raises(ValueError, match=r"cast_fp8: argument 'out' must have shape \[32, 16\] for rows=32, got \(20, 16\)"):
        ops.cast_fp8(x, one(1.0), None, E4M3, out=torch.empty(20, 16, dtype=E4M3), rows=32)
    with pytest.raises(ValueError, match=r"cast_fp8_current: argument 'out_t' must have shape \[16, 32\] for rows=32"):
        ops.quant.cast_fp8_current(x, E4M3, amax=one(0.0), scale=one(0.0), scale_inv=one(0.0),
                                   out_t=torch.empty(16, 20, dtype=E4M3), transpose=True, rows=32)
    with pytest.raises(ValueError, match="cast_fp8_current: outputs 'amax' and 'scale' share memory"):
        shared = one(0.0)
        ops.quant.cast_fp8_current(x, E4M3, amax=shared, scale=shared, scale_inv=one(0.0))
    with pytest.raises(ValueError, match=r"M % 16 == 0, M counting the outputs' 24 padded rows"):
        ops.cast_transpose_fp8(x, one(1.0), None, E4M3, dbias=True, rows=24)


@pytest.mark.cuda
@pytest.mark.parametrize("shape,rows", [((7, 16), 16), ((1, 64), 16), ((4097, 1280), 4112), ((1000, 8), 1008),
                                        ((33, 17), 48), ((130, 264), 144), ((2, 9, 96), 32), ((16, 128), 64),
                                        ((0, 32), 16)])
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("fp8", FP8)
def test_cuda_cast_rows_bit_identical(shape, rows, dtype, fp8, seed):
    """Padded outputs (poisoned first) against the CPU backend and against
    the cast of a hand-padded x: the tiled, the plain and the generic kernels."""
    x = (torch.randn(shape, device="cuda") * 200).to(dtype)
    k, m = shape[-1], x.numel() // shape[-1]
    out, out_t = poisoned((rows, k), fp8), poisoned((k, rows), fp8)
    amax = one(0.0, "cuda")
    ops.cast_transpose_fp8(x, one(1.7, "cuda"), amax, fp8, out=out, out_t=out_t, rows=rows)
    amax_c = one(0.0)
    ref, ref_t = ops.cast_transpose_fp8(x.cpu(), one(1.7), amax_c, fp8, rows=rows)
    assert torch.equal(bits(out).cpu(), bits(ref)) and torch.equal(bits(out_t).cpu(), bits(ref_t))
    assert amax.item() == amax_c.item()
    hand, hand_t = padded_reference(x, rows, fp8, scale=1.7)
    assert torch.equal(bits(out), bits(hand)) and torch.equal(bits(out_t), bits(hand_t))
    plain = poisoned((rows, k), fp8)
    ops.cast_fp8(x, one(1.7, "cuda"), None, fp8, out=plain, rows=rows)
    assert torch.equal(bits(plain).cpu(), bits(ref))
    if k % 8 == 0 and rows % 16 == 0:
        data, data_t, db = ops.cast_transpose_fp8(x, one(1.7, "cuda"), None, fp8, dbias=True, rows=rows)
        assert torch.equal(bits(data_t).cpu(), bits(ref_t))
        blocks = (rows + 127) // 128  # the kernel's block sums bit for bit; torch's sum over blocks differs by device
        sums = torch.full((blocks, k), float("nan"), device="cuda")
        seqfuse._C.cast_fp8_dbias(x, one(1.7, "cuda"), None, None, poisoned((k, rows), fp8), None, sums, None)
        sums_c = torch.empty((blocks, k))
        seqfuse._C.cast_fp8_dbias(x.cpu(), one(1.7), None, None, torch.empty((k, rows), dtype=fp8), None, sums_c, None)
        assert torch.equal(sums.cpu(), sums_c)
        # fp32 sums of 128-row blocks, then of the blocks: each addition rounds
        # at most 2**-24 of the running |sum|, so the error is below
        # (127 + blocks) * 2**-24 * sum |x| per column
        xd = x.double().reshape(-1, k)
        bound = (127 + blocks) * 2.0**-24 * xd.abs().sum(0)
        assert ((db.double() - xd.sum(0)).abs() <= bound).all()


# ---- current scaling in one call (ops.quant.cast_fp8_current; one cooperative launch on CUDA) ----

def current_reference(x, fp8, margin=0, rows=None):
    """amax, scale, cast in turn through the separate ops: what the one call must equal."""
    amax, scale, si = one(0.0), one(0.0), one(0.0)
    ops.amax(x.cpu(), out=amax)
    ops.quant.fp8_compute_scale(amax, scale, si, ops.quant.FP8_MAX[fp8], margin)
    data, data_t = ops.cast_transpose_fp8(x.cpu(), scale, None, fp8, rows=rows)
    return amax, scale, si, data, data_t


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("shape,rows,margin", [((64, 32), None, 0), ((7, 16), 16, 1), ((130, 264), 144, 0),
                                               ((0, 16), None, 0), ((33, 17), 48, 2)])
def test_cast_fp8_current_equals_the_three_ops_cpu(shape, rows, margin, dtype, fp8, seed):
    x = (torch.randn(shape) * 40).to(dtype)
    amax, scale, si = one(1e9), one(float("nan")), one(float("nan"))  # amax is written, not folded
    data, data_t = ops.quant.cast_fp8_current(x, fp8, amax=amax, scale=scale, scale_inv=si, transpose=True,
                                              margin=margin, rows=rows)
    r_amax, r_scale, r_si, r_data, r_t = current_reference(x, fp8, margin, rows)
    assert amax.item() == r_amax.item() and scale.item() == r_scale.item() and si.item() == r_si.item()
    assert torch.equal(bits(data), bits(r_data)) and torch.equal(bits(data_t), bits(r_t))


def test_cast_fp8_current_errors():
    x = torch.randn(32, 16)
    with pytest.raises(ValueError, match=r"cast_fp8_current: argument 'margin' must be in \[-64, 64\], got 99"):
        ops.quant.cast_fp8_current(x, E4M3, amax=one(0.0), scale=one(0.0), scale_inv=one(0.0), margin=99)
    with pytest.raises(TypeError, match="cast_fp8_current: argument 'amax' must have dtype float32"):
        ops.quant.cast_fp8_current(x, E4M3, amax=torch.zeros(1, dtype=torch.float16), scale=one(0.0),
                                   scale_inv=one(0.0))
    with pytest.raises(ValueError, match="cast_fp8_current: argument 'scale' must have 1 element"):
        ops.quant.cast_fp8_current(x, E4M3, amax=one(0.0), scale=torch.zeros(2), scale_inv=one(0.0))


@pytest.mark.cuda
@pytest.mark.parametrize("shape,rows", [((5120, 1280), None), ((1280, 5120), None), ((3840, 1280), None),
                                        ((4097, 1280), 4112), ((16, 16), None), ((7, 16), 16),
                                        ((33, 17), 48), ((100, 12), None), ((1, 128), 16)])
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("fp8", FP8)
def test_cuda_cast_fp8_current_bit_identical(shape, rows, dtype, fp8, seed):
    """The one-launch current cast (and the three-kernel path for the shapes
    it does not take) against the CPU's amax, scale and cast, outputs poisoned."""
    x = (torch.randn(shape, device="cuda") * 40).to(dtype)
    k = shape[-1]
    mp = rows or x.numel() // k
    out, out_t = poisoned((mp, k), fp8), poisoned((k, mp), fp8)
    amax, scale, si = one(1e9, "cuda"), one(float("nan"), "cuda"), one(float("nan"), "cuda")
    for margin in (0, 1):
        ops.quant.cast_fp8_current(x, fp8, amax=amax, scale=scale, scale_inv=si, out=out, out_t=out_t,
                                   transpose=True, margin=margin, rows=rows)
        r_amax, r_scale, r_si, r_data, r_t = current_reference(x, fp8, margin, rows)
        assert amax.item() == r_amax.item() and scale.item() == r_scale.item() and si.item() == r_si.item()
        assert torch.equal(bits(out).cpu(), bits(r_data)) and torch.equal(bits(out_t).cpu(), bits(r_t))
    only_t = poisoned((k, mp), fp8)
    ops.quant.cast_fp8_current(x, fp8, amax=amax, scale=scale, scale_inv=si, out_t=only_t, rowwise=False,
                               rows=rows)
    assert torch.equal(bits(only_t).cpu(), bits(current_reference(x, fp8, 0, rows)[4]))


@pytest.mark.cuda
def test_cuda_cast_fp8_current_nan_and_zero():
    """NaN anywhere: amax NaN, the scale falls back to 1 (as fp8_compute_scale); all zeros: scale 1."""
    for fill in (float("nan"), 0.0):
        x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
        x[17, 3] = fill
        if fill == 0.0:
            x.zero_()
        amax, scale, si = one(5.0, "cuda"), one(0.0, "cuda"), one(0.0, "cuda")
        data, data_t = ops.quant.cast_fp8_current(x, E4M3, amax=amax, scale=scale, scale_inv=si, transpose=True)
        r_amax, r_scale, r_si, r_data, r_t = current_reference(x, E4M3)
        assert (amax.isnan().item() and r_amax.isnan().item()) or amax.item() == r_amax.item()
        assert scale.item() == r_scale.item() == 1.0
        assert torch.equal(bits(data).cpu(), bits(r_data)) and torch.equal(bits(data_t).cpu(), bits(r_t))
