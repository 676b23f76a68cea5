"""Block-scaled formats: FP8 with 1x128 / 128x128 fp32 scales (cuBLASLt's
Hopper layout), MXFP8 (E8M0 per 32) and NVFP4 (E2M1, E4M3 per 16, fp32 per
tensor) against float32/float64 torch references on the CPU, dimension
errors, and the CUDA backend bit for bit against the CPU."""
import pytest
import torch

import seqfuse
from seqfuse import ops
from helpers import needs_fp8
from seqfuse.quantization import quantize_block, quantize_mxfp8, quantize_nvfp4

pytestmark = needs_fp8

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FLOATS = [torch.float32, torch.float16, torch.bfloat16]
MAXV = {E4M3: 448.0, E5M2: 57344.0}
FLT_MAX = torch.finfo(torch.float32).max


def bits(t):
    return t.view(torch.uint8)


def scale_of(amax, fmax):
    """fp32 fp8_max / amax, 1 for 0 or non-finite, FLT_MAX on overflow."""
    s = torch.tensor(fmax, dtype=torch.float32) / amax
    s = torch.where(torch.isinf(s), torch.tensor(FLT_MAX), s)
    return torch.where((amax == 0) | ~torch.isfinite(amax), torch.ones_like(s), s)


def sat_cast(v, fp8):
    return v.clamp(-MAXV[fp8], MAXV[fp8]).to(fp8)


def sample(shape, dtype):
    x = torch.randn(shape) * torch.logspace(-3, 3, shape[-1])  # wide dynamic range across blocks
    x[..., :128] = 0.0 if shape[-1] >= 256 else x[..., :128]  # an all-zero block
    return x.to(dtype)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("m", [1, 5, 128, 200])
def test_1x128_against_reference(m, fp8, dtype, seed):
    k = 384
    x = sample((m, k), dtype)
    data, si = ops.quantize_block_fp8(x, 1, fp8)
    assert si.shape == (k // 128, (m + 3) // 4 * 4) and si.dtype == torch.float32
    xf = x.float().view(m, k // 128, 128)
    s = scale_of(xf.abs().amax(-1), MAXV[fp8])  # [m, kb]
    ref = sat_cast(xf * s[..., None], fp8).view(m, k)
    assert torch.equal(bits(data), bits(ref))
    assert torch.equal(si[:, :m], (1 / s).t())
    assert (si[:, m:] == 0).all()
    # dequantized: exactly q * scale_inv, within half a step of x
    deq = ops.dequantize_block_fp8(data, si, 1)
    assert torch.equal(deq, (ref.float().view(m, k // 128, 128) * (1 / s)[..., None]).view(m, k))
    err = (deq.double() - x.double()).abs()
    rel = {E4M3: 2.0 ** -4, E5M2: 2.0 ** -3}[fp8]
    sub = {E4M3: 2.0 ** -10, E5M2: 2.0 ** -17}[fp8]
    bound = torch.maximum(x.double().abs() * rel, (sub / s.double()).repeat_interleave(128, 1))
    assert (err <= bound * 1.0001).all()


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(128, 128), (200, 384), (3, 2, 256)])
def test_128x128_against_reference(shape, dtype, seed):
    x = sample(shape, dtype)
    k = shape[-1]
    m = x.numel() // k
    data, si = ops.quantize_block_fp8(x, 128, E4M3)
    mb, kb = (m + 127) // 128, k // 128
    assert si.shape == (mb, (kb + 3) // 4 * 4)
    xf = torch.nn.functional.pad(x.float().view(m, k), (0, 0, 0, mb * 128 - m))
    blocks = xf.view(mb, 128, kb, 128)
    s = scale_of(blocks.abs().amax(dim=(1, 3)), 448.0)  # [mb, kb]
    ref = sat_cast(blocks * s[:, None, :, None], E4M3).view(mb * 128, k)[:m].view(shape)
    assert torch.equal(bits(data), bits(ref))
    assert torch.equal(si[:, :kb], 1 / s) and (si[:, kb:] == 0).all()
    deq = ops.dequantize_block_fp8(data, si, 128, torch.float32)
    rel = (deq.double() - x.double()).abs() / x.double().abs().clamp_min(1e-30)
    big = x.double().abs() * s.repeat_interleave(128, 0)[:m].repeat_interleave(128, 1).view(shape).double() >= 2 ** -6
    assert (rel[big] <= 2.0 ** -4 * 1.0001).all()


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
def test_mxfp8_against_reference(fp8, dtype, seed):
    x = sample((7, 256), dtype)
    x[0, 32:64] = 0.0
    data, scales = ops.quantize_mxfp8(x, fp8)
    assert scales.shape == (7, 8)
    xf = x.float().view(7, 8, 32)
    amax = xf.abs().amax(-1)
    ratio = amax / MAXV[fp8]
    e = torch.ceil(torch.log2(ratio.double())).clamp(-127, 127) + 127
    e = torch.where(amax == 0, torch.full_like(e, 127), e).to(torch.uint8)
    assert torch.equal(scales.view(torch.uint8), e)
    mult = torch.exp2(127 - e.double()).float()
    ref = sat_cast(xf * mult[..., None], fp8).view(7, 256)
    assert torch.equal(bits(data), bits(ref))
    assert (xf.abs() * mult[..., None] <= MAXV[fp8]).all()  # the scale rounds up: no saturation
    deq = ops.dequantize_mxfp8(data, scales)
    assert torch.equal(deq, (ref.float().view(7, 8, 32) * torch.exp2(e.double() - 127).float()[..., None]).view(7, 256))


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def e2m1_reference(v):
    """Nearest E2M1 code of float64 values, ties to the even code, saturating."""
    a = v.abs().clamp(max=6.0)
    d = (a[..., None] - E2M1).abs()
    best = d.min(-1, keepdim=True).values
    score = (d == best).to(torch.int64) * 2 + (torch.arange(8) % 2 == 0).to(torch.int64)
    code = score.argmax(-1)
    return code | (torch.signbit(v).to(torch.int64) << 3)


@pytest.mark.parametrize("dtype", FLOATS)
def test_nvfp4_against_reference(dtype, seed):
    x = sample((6, 64), dtype)
    x[1, 16:32] = 0
    data, bs, gsi = ops.quantize_nvfp4(x)
    assert data.shape == (6, 32) and data.dtype == torch.uint8 and bs.shape == (6, 4)
    xf = x.float()
    amax = xf.abs().max()
    S = torch.tensor(448.0 * 6.0) / amax
    assert gsi.item() == (1 / S).item()
    bam = xf.view(6, 4, 16).abs().amax(-1)
    d = sat_cast((bam / 6) * S, E4M3)
    assert torch.equal(bits(bs), bits(d))
    df = d.float()
    mult = torch.where(df == 0, torch.zeros_like(df), S / df)
    codes = e2m1_reference((xf.view(6, 4, 16) * mult[..., None]).double()).view(6, 64)
    ref = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    assert torch.equal(data, ref)
    deq = ops.dequantize_nvfp4(data, bs, gsi)
    vals = E2M1.float()[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    assert torch.equal(deq, (vals.view(6, 4, 16) * df[..., None] * gsi).view(6, 64))
    # where the E4M3 block scale is a normal number (relative error <= 2^-4),
    # the error is within half the widest E2M1 step (1.0, between 4 and 6)
    # plus the saturation that scale rounding can cause (6 * 2^-4)
    unit = (df * gsi).repeat_interleave(16, 1)
    normal = (df >= 2.0 ** -6).repeat_interleave(16, 1)
    assert ((deq - xf).abs() <= unit * (1.0 + 6 / 16) + 1e-6 * xf.abs())[normal].all()


def test_quantized_tensor_types_roundtrip():
    x = torch.randn(128, 256)
    for q in (quantize_block(x, 1), quantize_block(x, 128), quantize_mxfp8(x), quantize_nvfp4(x)):
        y = q.dequantize()
        assert y.shape == x.shape and (y - x).norm() / x.norm() < 0.2


def test_block_dimension_errors():
    with pytest.raises(ValueError, match=r"quantize_block_fp8: the last dimension of 'x' \(K = 100\) must be a multiple of 128 for 1x128 blocks"):
        ops.quantize_block_fp8(torch.randn(4, 100), 1)
    with pytest.raises(ValueError, match="must be a multiple of 128 for 128x128 blocks"):
        ops.quantize_block_fp8(torch.randn(4, 200), 128)
    with pytest.raises(ValueError, match="block_rows' must be 1"):
        ops.quantize_block_fp8(torch.randn(4, 128), 64)
    with pytest.raises(ValueError, match=r"quantize_mxfp8: the last dimension of 'x' \(K = 48\) must be a multiple of 32"):
        ops.quantize_mxfp8(torch.randn(4, 48))
    with pytest.raises(ValueError, match=r"quantize_nvfp4: the last dimension of 'x' \(K = 24\) must be a multiple of 16"):
        ops.quantize_nvfp4(torch.randn(4, 24))
    # the C entry says the same to a direct caller
    with pytest.raises(ValueError, match="must be a multiple of 32 for MXFP8"):
        seqfuse._C.quantize_mxfp8(torch.randn(2, 40), torch.empty(2, 40, dtype=E4M3),
                                  torch.empty(2, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"argument 'scale_inv' must have shape \[2, 4\]"):
        seqfuse._C.quantize_block_fp8(torch.randn(3, 256), torch.empty(3, 256, dtype=E4M3),
                                      torch.empty(3, 2), 1)
    with pytest.raises(TypeError, match="quantize_block_fp8: argument 'x' must have dtype float32"):
        ops.quantize_block_fp8(torch.ones(4, 128, dtype=torch.int32))
    with pytest.raises(TypeError, match="argument 'block_scales' must have dtype float8_e4m3fn or uint8"):
        seqfuse._C.quantize_nvfp4(torch.randn(2, 16), torch.ones(1), torch.empty(2, 8, dtype=torch.uint8),
                                  torch.empty(2, 1), torch.empty(1))


# ---- CUDA against the CPU, bit for bit ------------------------------------

def poison(t):
    t.view(torch.uint8).fill_(0xFF)
    return t


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(1, 128), (200, 384), (1000, 1024), (4096, 4096), (3, 5, 256)])
def test_cuda_blocks_bit_identical(shape, dtype, seed):
    x = sample(shape, dtype)
    k = shape[-1]
    m = x.numel() // k
    xc = x.cuda()
    for block_rows in (1, 128):
        for fp8 in (E4M3, E5M2):
            ref, ref_si = ops.quantize_block_fp8(x, block_rows, fp8)
            out = poison(torch.empty(shape, dtype=fp8, device="cuda"))
            si = poison(torch.empty(ref_si.shape, device="cuda"))
            seqfuse._C.quantize_block_fp8(xc, out, si, block_rows)
            assert torch.equal(bits(out).cpu(), bits(ref)), (block_rows, fp8)
            assert torch.equal(si.cpu().view(torch.int32), ref_si.view(torch.int32))
            deq = ops.dequantize_block_fp8(out, si, block_rows, dtype)
            assert torch.equal(deq.cpu(), ops.dequantize_block_fp8(ref, ref_si, block_rows, dtype))
    for fp8 in (E4M3, E5M2):
        ref, ref_sc = ops.quantize_mxfp8(x, fp8)
        out = poison(torch.empty(shape, dtype=fp8, device="cuda"))
        sc = poison(torch.empty(ref_sc.shape, dtype=torch.uint8, device="cuda"))
        seqfuse._C.quantize_mxfp8(xc, out, sc)
        assert torch.equal(bits(out).cpu(), bits(ref)) and torch.equal(sc.cpu(), ref_sc.view(torch.uint8))
        deq = ops.dequantize_mxfp8(out, sc, dtype)
        assert torch.equal(deq.cpu(), ops.dequantize_mxfp8(ref, ref_sc, dtype))
    ref, ref_bs, ref_g = ops.quantize_nvfp4(x)
    out = poison(torch.empty(ref.shape, dtype=torch.uint8, device="cuda"))
    bs = poison(torch.empty(ref_bs.shape, dtype=torch.uint8, device="cuda"))
    g = poison(torch.empty(1, device="cuda"))
    amax = seqfuse.ops.amax(xc).reshape(1)
    seqfuse._C.quantize_nvfp4(xc, amax, out, bs, g)
    assert torch.equal(out.cpu(), ref) and torch.equal(bs.cpu(), bits(ref_bs)) and g.item() == ref_g.item()
    deq = ops.dequantize_nvfp4(out, bs, g, dtype)
    assert torch.equal(deq.cpu(), ops.dequantize_nvfp4(ref, ref_bs, ref_g, dtype))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
def test_rowcol_1x128_against_separate_quantizations(fp8, dtype, seed):
    x = sample((256, 384), dtype)
    x[128:, 5] = 0  # a zero column block
    data, si, data_t, si_t = ops.quantize_block_fp8_rowcol(x, fp8)
    ref, ref_si = ops.quantize_block_fp8(x, 1, fp8)
    assert torch.equal(bits(data), bits(ref)) and torch.equal(si, ref_si)
    ref_t, ref_si_t = ops.quantize_block_fp8(x.t().contiguous(), 1, fp8)
    assert data_t.shape == (384, 256) and si_t.shape == (2, 384)
    assert torch.equal(bits(data_t), bits(ref_t)) and torch.equal(si_t, ref_si_t)
    only_t = ops.quantize_block_fp8_rowcol(x, fp8, rowwise=False)
    assert only_t[0] is None and torch.equal(bits(only_t[2]), bits(ref_t))
    q = quantize_block(x, 1, fp8, columnwise=True)
    assert torch.equal(q.dequantize(), ops.dequantize_block_fp8(ref, ref_si, 1, dtype))
    with pytest.raises(ValueError, match="must be a multiple of 128 for 1x128 blocks"):
        ops.quantize_block_fp8_rowcol(torch.randn(128, 130))
    with pytest.raises(ValueError, match=r"'out_t' must have shape \[K, round_up\(M, 128\)\] = \[128, 256\]"):
        seqfuse._C.quantize_block_fp8_rowcol(torch.randn(144, 128), None, None,
                                             torch.empty(128, 144, dtype=fp8),
                                             torch.empty(2, 128))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("m", [1, 16, 144, 300])
def test_rowcol_partial_row_blocks(m, fp8, dtype, seed):
    """M not a multiple of 128: the row-wise copy as quantize_block_fp8, the
    column-wise copy zero-padded to round_up(M, 128) columns, its last block's
    scale from the real rows only (the reference: x zero-padded, quantized
    separately)."""
    x = sample((m, 256), dtype)
    mt = (m + 127) // 128 * 128
    data, si, data_t, si_t = ops.quantize_block_fp8_rowcol(x, fp8)
    ref, ref_si = ops.quantize_block_fp8(x, 1, fp8)
    assert torch.equal(bits(data), bits(ref)) and torch.equal(si, ref_si)
    padded = torch.nn.functional.pad(x, (0, 0, 0, mt - m))
    ref_t, ref_si_t = ops.quantize_block_fp8(padded.t().contiguous(), 1, fp8)
    assert data_t.shape == (256, mt) and si_t.shape == (mt // 128, 256)
    assert torch.equal(bits(data_t), bits(ref_t)) and torch.equal(si_t, ref_si_t)
    assert (bits(data_t)[:, m:] == 0).all()
    q = quantize_block(x, 1, fp8, columnwise=True, rowwise=False)
    assert q.shape == (m, 256)
    assert torch.equal(q.dequantize(), ops.dequantize_block_fp8(ref_t, ref_si_t, 1, dtype).t()[:m])


def col_sums_in_order(x):
    """seqfuse_quant.h's col_sums, float32 adds in its fixed order, in torch:
    rows 128 mb + g + 16 i summed over i left to right, paired over g, the 8
    pairs added left to right."""
    k = x.shape[-1]
    xf = x.float().reshape(-1, k)
    m = xf.shape[0]
    xb = torch.nn.functional.pad(xf, (0, 0, 0, (-m) % 128)).view(-1, 8, 16, k)  # [mb, i, g, k]
    acc = xb[:, 0]
    for i in range(1, 8):
        acc = acc + xb[:, i]
    p = acc[:, 0::2] + acc[:, 1::2]  # [mb, w, k]
    total = p[:, 0]
    for w in range(1, 8):
        total = total + p[:, w]
    return total


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("m", [16, 128, 200])
def test_rowcol_col_sums(m, dtype, seed):
    x = sample((m, 256), dtype)
    *q, sums = ops.quantize_block_fp8_rowcol(x, E4M3, col_sums=True)
    assert sums.shape == ((m + 127) // 128, 256) and sums.dtype == torch.float32
    assert torch.equal(sums.view(torch.int32), col_sums_in_order(x).view(torch.int32))
    ref = x.double().sum(0)
    assert ((sums.double().sum(0) - ref).abs() <= 1e-5 * x.double().abs().sum(0) + 1e-30).all()
    plain = ops.quantize_block_fp8_rowcol(x, E4M3, rowwise=False)  # the copies are unchanged
    assert torch.equal(bits(q[2]), bits(plain[2])) and torch.equal(q[3], plain[3])
    with pytest.raises(ValueError, match="col_sums=True needs columnwise=True"):
        ops.quantize_block_fp8_rowcol(x, E4M3, columnwise=False, col_sums=True)
    with pytest.raises(ValueError, match="'col_sums' comes with the column-wise copy"):
        seqfuse._C.quantize_block_fp8_rowcol(x, q[0], q[1], None, None, None,
                                             torch.empty(sums.shape))
    with pytest.raises(ValueError, match=r"'col_sums' must have shape \[round_up\(M, 128\)/128, K\]"):
        seqfuse._C.quantize_block_fp8_rowcol(x, None, None, q[2], q[3], None, torch.empty(3, 256))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(128, 128), (256, 384), (4096, 4096), (2, 128, 1024), (1, 128),
                                   (144, 256), (1040, 1024), (3, 50, 384)])
def test_cuda_rowcol_bit_identical(shape, dtype, seed):
    x = sample(shape, dtype)
    k = shape[-1]
    m = x.numel() // k
    for fp8 in (E4M3, E5M2):
        ref = ops.quantize_block_fp8_rowcol(x, fp8)
        out = poison(torch.empty(shape, dtype=fp8, device="cuda"))
        si = poison(torch.empty(ref[1].shape, device="cuda"))
        out_t = poison(torch.empty((k, (m + 127) // 128 * 128), dtype=fp8, device="cuda"))
        si_t = poison(torch.empty(ref[3].shape, device="cuda"))
        seqfuse._C.quantize_block_fp8_rowcol(x.cuda(), out, si, out_t, si_t)
        assert torch.equal(bits(out).cpu(), bits(ref[0])) and torch.equal(bits(out_t).cpu(), bits(ref[2]))
        assert torch.equal(si.cpu().view(torch.int32), ref[1].view(torch.int32))
        assert torch.equal(si_t.cpu().view(torch.int32), ref[3].view(torch.int32))
        only = ops.quantize_block_fp8_rowcol(x.cuda(), fp8, rowwise=False)
        assert torch.equal(bits(only[2]).cpu(), bits(ref[2]))
        # the fused column sums: the fixed add order, bit for bit
        sums = ops.quantize_block_fp8_rowcol(x.cuda(), fp8, col_sums=True)[4]
        assert torch.equal(sums.cpu().view(torch.int32), col_sums_in_order(x).view(torch.int32))


# ---- token padding: the row-wise copy with more rows than x ---------------

#: (M, rows): padded to the next 16 and further; rows not a multiple of 4 (the scale tensor's padding
#: past rows: 0) and rows == round_up(M, 128)
PADDED = [(1, 16), (1, 3), (5, 6), (7, 32), (40, 64), (129, 160), (130, 131), (129, 256)]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("m, mp", PADDED)
def test_padded_rows_equal_the_hand_padded_input(m, mp, fp8, dtype, seed):
    """rows=Mp > M: the row-wise copy and its scales are the quantization of
    x with Mp - M zero rows appended, bit for bit (data 0, scale 1 for those
    rows, 0 for the scale tensor's padding past Mp), from x itself; the
    column-wise copy and column sums are x's."""
    k = 256
    x = sample((m, k), dtype)
    padded = torch.nn.functional.pad(x, (0, 0, 0, mp - m))
    data, si = ops.quantize_block_fp8(x, 1, fp8, rows=mp)
    ref, ref_si = ops.quantize_block_fp8(padded, 1, fp8)
    assert data.shape == (mp, k) and torch.equal(bits(data), bits(ref)) and torch.equal(si, ref_si)
    assert (si[:, m:mp] == 1).all() and (si[:, mp:] == 0).all()
    q = quantize_block(x, 1, fp8, rows=mp)
    assert q.shape == (m, k) and torch.equal(q.dequantize(), ops.dequantize_block_fp8(ref, ref_si, 1, dtype)[:m])
    got = ops.quantize_block_fp8_rowcol(x, fp8, col_sums=True, rows=mp)
    want = ops.quantize_block_fp8_rowcol(padded, fp8, col_sums=True)
    for a, b in zip(got, want):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_padded_rows_refusals():
    x = torch.randn(20, 128)
    with pytest.raises(ValueError, match=r"argument 'rows' \(16\) must be at least x's row count 20"):
        ops.quantize_block_fp8(x, 1, rows=16)
    with pytest.raises(ValueError, match="'rows' \\(token padding\\) is for 1x128 blocks"):
        ops.quantize_block_fp8(x, 128, rows=32)
    with pytest.raises(ValueError, match=r"'rows' must be at most round_up\(M, 128\) = 128, got 144"):
        ops.quantize_block_fp8_rowcol(x, rows=144)
    with pytest.raises(ValueError, match=r"'out' must have M x K = 20 x 128 elements, or shape \[Mp, K\]"):
        seqfuse._C.quantize_block_fp8(x, torch.empty(16, 128, dtype=E4M3), torch.empty(1, 16), 1)
    with pytest.raises(ValueError, match=r"'scale_inv' must have shape \[1, 32\]"):
        seqfuse._C.quantize_block_fp8(x, torch.empty(32, 128, dtype=E4M3), torch.empty(1, 20), 1)
    with pytest.raises(ValueError, match=r"'out' has 144 rows; padded rows go up to round_up\(M, 128\) = 128"):
        seqfuse._C.quantize_block_fp8_rowcol(x, torch.empty(144, 128, dtype=E4M3), torch.empty(1, 144),
                                             None, None)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m, mp", PADDED + [(4097, 4112), (1000, 1008)])
def test_cuda_padded_rows_bit_identical(m, mp, dtype, seed):
    """The CUDA kernels write the zero rows and the scale padding (into
    poisoned outputs) as the CPU does."""
    k = 512
    x = sample((m, k), dtype)
    for fp8 in (E4M3, E5M2):
        ref, ref_si = ops.quantize_block_fp8(x, 1, fp8, rows=mp)
        out = poison(torch.empty(mp, k, dtype=fp8, device="cuda"))
        si = poison(torch.empty(ref_si.shape, device="cuda"))
        seqfuse._C.quantize_block_fp8(x.cuda(), out, si, 1)
        assert torch.equal(bits(out).cpu(), bits(ref)) and torch.equal(si.cpu().view(torch.int32),
                                                                         ref_si.view(torch.int32))
        want = ops.quantize_block_fp8_rowcol(x, fp8, rows=mp, col_sums=True)
        outs = [poison(torch.empty(t.shape, dtype=t.dtype, device="cuda")) for t in want]
        seqfuse._C.quantize_block_fp8_rowcol(x.cuda(), *outs[:4], None, outs[4])
        for a, b in zip(outs, want):
            assert torch.equal(a.cpu().view(torch.uint8), b.view(torch.uint8))


# ---- a weight's two 128x128 operands in one call ------------------------------

WEIGHT_SHAPES = [(128, 128), (384, 256), (256, 640), (640, 384)]  # scale rows padded to 4 blocks or not


def _weight_reference(w, fp8):
    """What the one call must equal: W's blocks, and W^T's blocks quantized on their own."""
    return (*ops.quantize_block_fp8(w, 128, fp8), *ops.quantize_block_fp8(w.t().contiguous(), 128, fp8))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("shape", WEIGHT_SHAPES)
def test_weight_operands_equal_two_quantizations(shape, fp8, dtype, seed):
    """data / scale_inv are quantize_block_fp8(w, 128)'s and data_t /
    scale_inv_t quantize_block_fp8(w.t(), 128)'s, bit for bit (padding
    included), into poisoned outputs."""
    w = sample(shape, dtype)
    want = _weight_reference(w, fp8)
    got = ops.quantize_block_fp8_weight(w, fp8)
    for g, r in zip(got, want):
        assert g.shape == r.shape and g.dtype == r.dtype
        assert torch.equal(bits(g), bits(r))
    outs = [poison(torch.empty_like(t)) for t in want]
    ops.quant.quantize_block_fp8_weight_into(w, *outs)
    for g, r in zip(outs, want):
        assert torch.equal(bits(g), bits(r))


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("shape", WEIGHT_SHAPES)
def test_block_transpose_equals_the_transposes_quantization(shape, fp8, seed):
    """block_transpose_fp8 of W's 128x128 operand is quantize_block_fp8(W^T,
    128)'s, bit for bit, padding included (what the weight entry writes
    beside W), into poisoned outputs through the C entry too."""
    w = sample(shape, torch.bfloat16)
    data, si, want_t, want_si_t = _weight_reference(w, fp8)
    got_t, got_si_t = ops.block_transpose_fp8(data, si)
    assert torch.equal(bits(got_t), bits(want_t)) and torch.equal(bits(got_si_t), bits(want_si_t))
    outs = [poison(torch.empty_like(want_t)), poison(torch.empty_like(want_si_t))]
    seqfuse._C.block_transpose_fp8(data, si, *outs)
    assert torch.equal(bits(outs[0]), bits(want_t)) and torch.equal(bits(outs[1]), bits(want_si_t))


def test_block_transpose_refusals():
    data, si = ops.quantize_block_fp8(sample((256, 384), torch.bfloat16), 128, E4M3)
    with pytest.raises(ValueError, match="argument 'data' must be 2-D"):
        ops.block_transpose_fp8(data.view(2, 128, 384), si)
    with pytest.raises(TypeError, match="argument 'data' must have dtype float8"):
        ops.block_transpose_fp8(data.view(torch.uint8), si)
    small, small_si = ops.quantize_block_fp8(sample((200, 384), torch.bfloat16), 128, E4M3)
    with pytest.raises(ValueError, match=r"dimensions of 'data' \(\[M, K\] = \[200, 384\]\) must be multiples of 128"):
        ops.block_transpose_fp8(small, small_si)
    with pytest.raises(ValueError, match="argument 'scale_inv' must have shape"):
        ops.block_transpose_fp8(data, si[:1])
    out_t, si_t = ops.block_transpose_fp8(data, si)
    with pytest.raises(ValueError, match="arguments 'data' and 'out_t' overlap in memory"):
        seqfuse._C.block_transpose_fp8(data, si, data.view(384, 256), si_t)
    with pytest.raises(TypeError, match="arguments 'data' and 'out_t' must have the same FP8 dtype"):
        seqfuse._C.block_transpose_fp8(data, si, torch.empty(384, 256, dtype=E5M2), si_t)
    with pytest.raises(ValueError, match="argument 'scale_inv_t' must have shape"):
        seqfuse._C.block_transpose_fp8(data, si, out_t, torch.empty(3, 8))
    with pytest.raises(ValueError, match="argument 'scale_inv' must have shape"):  # a larger scale tensor
        ops.block_transpose_fp8(data, torch.ones(4, 8))


def test_weight_operands_refusals():
    w = sample((256, 256), torch.bfloat16)
    with pytest.raises(ValueError, match=r"rows of 'w' \(M = 200\) must be a multiple of 128"):
        ops.quantize_block_fp8_weight(sample((200, 256), torch.bfloat16))
    with pytest.raises(ValueError, match=r"last dimension of 'w' \(K = 200\) must be a multiple of 128"):
        ops.quantize_block_fp8_weight(sample((256, 200), torch.bfloat16))
    with pytest.raises(TypeError, match="argument 'w' must have dtype float32, float16 or bfloat16"):
        ops.quantize_block_fp8_weight(torch.zeros(128, 128, dtype=torch.int32))
    with pytest.raises(ValueError, match="argument 'w' must be 2-D"):  # the C entry's own rule
        seqfuse._C.quantize_block_fp8_weight(sample((1, 128, 128), torch.bfloat16),
                                             *ops.quant.block_weight_outputs(128, 128, E4M3, w.device))
    with pytest.raises(ValueError, match="must be 2-D"):
        ops.quantize_block_fp8_weight(sample((2, 128, 256), torch.bfloat16))
    good = ops.quant.block_weight_outputs(256, 256, E4M3, w.device)
    with pytest.raises(ValueError, match=r"'out_t' must have shape \[K, M\] = \[256, 256\]"):
        seqfuse._C.quantize_block_fp8_weight(w, good[0], good[1], torch.empty(128, 512, dtype=E4M3), good[3])
    with pytest.raises(TypeError, match="'out' and 'out_t' must have the same FP8 dtype"):
        seqfuse._C.quantize_block_fp8_weight(w, good[0], good[1], torch.empty(256, 256, dtype=E5M2), good[3])
    with pytest.raises(ValueError, match="scale_inv_t"):
        seqfuse._C.quantize_block_fp8_weight(w, good[0], good[1], good[2], torch.empty(2, 2))
    # out_t over out's bytes: out_t is written from out, so the call must refuse
    with pytest.raises(ValueError, match="arguments 'out' and 'out_t' overlap in memory"):
        seqfuse._C.quantize_block_fp8_weight(w, good[0], good[1], good[0], good[3])
    both = torch.empty(2 * good[1].numel(), dtype=torch.float32)
    si, si_t = both[:good[1].numel()].view(good[1].shape), both[1:good[3].numel() + 1].view(good[3].shape)
    with pytest.raises(ValueError, match="arguments 'scale_inv' and 'scale_inv_t' overlap in memory"):
        seqfuse._C.quantize_block_fp8_weight(w, good[0], si, good[2], si_t)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", WEIGHT_SHAPES + [(4096, 4096), (1024, 4096)])
def test_cuda_weight_operands_bit_identical(shape, dtype, seed):
    """The CUDA call (quantize, byte transpose, scale transpose) equals the
    CPU's bit for bit, into poisoned outputs; so does block_transpose_fp8
    from the CPU's forward operand."""
    w = sample(shape, dtype)
    for fp8 in (E4M3, E5M2):
        want = ops.quantize_block_fp8_weight(w, fp8)
        outs = [poison(torch.empty(t.shape, dtype=t.dtype, device="cuda")) for t in want]
        seqfuse._C.quantize_block_fp8_weight(w.cuda(), *outs)
        torch.cuda.synchronize()
        for g, r in zip(outs, want):
            assert torch.equal(bits(g.cpu()), bits(r))
        got_t = [poison(torch.empty(t.shape, dtype=t.dtype, device="cuda")) for t in want[2:]]
        seqfuse._C.block_transpose_fp8(want[0].cuda(), want[1].cuda(), *got_t)
        torch.cuda.synchronize()
        for g, r in zip(got_t, want[2:]):
            assert torch.equal(bits(g.cpu()), bits(r))


@pytest.mark.cuda
def test_cuda_empty_input_with_padded_rows_writes_them():
    """No real rows, 16 padded ones: the zero rows and their scales are
    written on CUDA as on the CPU (the launch is not skipped as empty)."""
    x = torch.empty(0, 256, dtype=torch.bfloat16)
    want = ops.quantize_block_fp8(x, 1, E4M3, rows=16)
    got = ops.quantize_block_fp8(x.cuda(), 1, E4M3, rows=16)
    for g, r in zip(got, want):
        assert torch.equal(bits(g.cpu()), bits(r))
