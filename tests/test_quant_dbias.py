"""The bias gradient in the cast's own C call: the ``dbias`` output of
cast_fp8_dbias, cast_fp8_current (with ``col_sums``) and
quantize_block_fp8_rowcol, against the separate calls it replaces (the cast,
then column_sums over its block sums) bit for bit on the CPU, against the CPU
on CUDA (outputs poisoned), and its argument rules (refused before anything
is written)."""
import pytest
import torch

import seqfuse
from seqfuse import ops
from helpers import needs_fp8

pytestmark = needs_fp8

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FLOATS = [torch.float32, torch.float16, torch.bfloat16]
SUMS = [torch.float32, torch.bfloat16, torch.float16]
C = seqfuse._C


def bits(t):
    return t.view(torch.uint8)


def one(v, device="cpu"):
    return torch.tensor([v], dtype=torch.float32, device=device)


def fp8_buf(shape, fp8, device="cpu"):
    """An FP8 output filled with 0xFF bytes (NaN in either format): a byte the
    kernel forgot to write cannot pass."""
    return torch.full(shape, 255, dtype=torch.uint8, device=device).view(fp8)


def nan_buf(shape, dtype=torch.float32, device="cpu"):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def blocks(rows, k):
    return (rows + 127) // 128, k


def delayed_case(x, fp8, rows, sum_dtype, device):
    """cast_fp8_dbias with dbias: (data, data_t, scale_inv, amax, sums, dbias)."""
    m, k = x.shape
    out, out_t = fp8_buf((rows, k), fp8, device), fp8_buf((k, rows), fp8, device)
    si, amax = nan_buf((1,), device=device), one(0.0, device)
    sums, db = nan_buf(blocks(rows, k), device=device), nan_buf((k,), sum_dtype, device)
    C.cast_fp8_dbias(x, one(0.625, device), amax, out, out_t, si, sums, None, db)
    return out, out_t, si, amax, sums, db


def current_case(x, fp8, rows, sum_dtype, device, margin=0):
    """cast_fp8_current with col_sums and dbias: (data, data_t, scale_inv, amax, scale, sums, dbias)."""
    m, k = x.shape
    out, out_t = fp8_buf((rows, k), fp8, device), fp8_buf((k, rows), fp8, device)
    si, amax, scale = nan_buf((1,), device=device), nan_buf((1,), device=device), nan_buf((1,), device=device)
    sums, db = nan_buf(blocks(rows, k), device=device), nan_buf((k,), sum_dtype, device)
    C.cast_fp8_current(x, amax, scale, si, out, out_t, margin, None, sums, db)
    return out, out_t, si, amax, scale, sums, db


@pytest.mark.parametrize("sum_dtype", SUMS)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("m,k,rows", [(16, 8, 16), (144, 24, 144), (40, 64, 48), (300, 16, 304)])
def test_cast_fp8_dbias_total_equals_the_separate_calls(m, k, rows, dtype, sum_dtype, seed):
    """Delayed scaling: the one call's FP8 copies, amax and block sums equal
    the cast without dbias, and its dbias equals column_sums over those
    sums (padded rows counting as zeros), bit for bit."""
    x = (torch.randn(m, k) * 4).to(dtype)
    out, out_t, si, amax, sums, db = delayed_case(x, E5M2, rows, sum_dtype, "cpu")
    ref_out, ref_t = fp8_buf((rows, k), E5M2), fp8_buf((k, rows), E5M2)
    ref_si, ref_amax, ref_sums = nan_buf((1,)), one(0.0), nan_buf(blocks(rows, k))
    C.cast_fp8_dbias(x, one(0.625), ref_amax, ref_out, ref_t, ref_si, ref_sums, None)
    for got, ref in ((out, ref_out), (out_t, ref_t)):
        assert torch.equal(bits(got), bits(ref))
    assert torch.equal(si, ref_si) and torch.equal(amax, ref_amax) and torch.equal(sums, ref_sums)
    assert db.dtype == sum_dtype and torch.equal(db, ops.quant.column_sums(ref_sums, sum_dtype))
    assert torch.allclose(db.double(), x.double().sum(0), rtol=2 ** -7, atol=2 ** -7 * x.double().abs().sum(0).max())


@pytest.mark.parametrize("sum_dtype", SUMS)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("m,k,rows,margin", [(16, 8, 16, 0), (144, 24, 144, 1), (40, 64, 48, 0)])
def test_cast_fp8_current_with_sums_equals_its_four_steps(m, k, rows, margin, fp8, dtype, sum_dtype, seed):
    """Current scaling with col_sums and dbias: amax, the scale, the cast
    with its block sums and their total, each equal to the separate calls it
    replaces (amax, fp8_compute_scale, cast_fp8_dbias, column_sums) bit for
    bit, and the copies equal to cast_fp8_current's own without sums."""
    x = (torch.randn(m, k) * 3).to(dtype)
    out, out_t, si, amax, scale, sums, db = current_case(x, fp8, rows, sum_dtype, "cpu", margin)
    r_amax, r_scale, r_si = nan_buf((1,)), nan_buf((1,)), nan_buf((1,))
    ops.amax(x, out=r_amax)
    ops.fp8_compute_scale(r_amax, r_scale, r_si, ops.quant.FP8_MAX[fp8], margin)
    r_out, r_t, r_sums = fp8_buf((rows, k), fp8), fp8_buf((k, rows), fp8), nan_buf(blocks(rows, k))
    C.cast_fp8_dbias(x, r_scale, None, r_out, r_t, nan_buf((1,)), r_sums, None)
    assert torch.equal(amax, r_amax) and torch.equal(scale, r_scale) and torch.equal(si, r_si)
    assert torch.equal(bits(out), bits(r_out)) and torch.equal(bits(out_t), bits(r_t))
    assert torch.equal(sums, r_sums) and torch.equal(db, ops.quant.column_sums(r_sums, sum_dtype))
    plain_out, plain_t = fp8_buf((rows, k), fp8), fp8_buf((k, rows), fp8)
    C.cast_fp8_current(x, nan_buf((1,)), nan_buf((1,)), nan_buf((1,)), plain_out, plain_t, margin, None)
    assert torch.equal(bits(out), bits(plain_out)) and torch.equal(bits(out_t), bits(plain_t))


@pytest.mark.parametrize("sum_dtype", SUMS)
@pytest.mark.parametrize("m,k", [(128, 128), (40, 256), (300, 128)])
def test_block_rowcol_dbias_equals_the_separate_calls(m, k, sum_dtype, seed):
    x = (torch.randn(m, k) * 2).to(torch.bfloat16)
    outs = ops.quant.rowcol_outputs(x, m, k, E4M3, None, True, True)
    sums, db = nan_buf(blocks(m, k)), nan_buf((k,), sum_dtype)
    ops.quant.quantize_block_fp8_rowcol_into(x, *outs, sums, db)
    ref = ops.quant.rowcol_outputs(x, m, k, E4M3, None, True, True)
    ref_sums = nan_buf(blocks(m, k))
    ops.quant.quantize_block_fp8_rowcol_into(x, *ref, ref_sums)
    for got, want in zip(outs, ref):
        assert torch.equal(got.view(torch.uint8) if got.element_size() == 1 else got,
                           want.view(torch.uint8) if want.element_size() == 1 else want)
    assert torch.equal(sums, ref_sums) and torch.equal(db, ops.quant.column_sums(ref_sums, sum_dtype))


def test_dbias_rules_are_checked_before_anything_is_written():
    """A dbias that breaks a rule is refused by name, and neither the FP8
    copies, the amax nor the sums were written."""
    x = torch.randn(32, 16)

    def fresh():
        return fp8_buf((32, 16), E4M3), fp8_buf((16, 32), E4M3), one(0.0), nan_buf((1, 16))

    cases = [
        (nan_buf((15,)), ValueError, r"argument 'dbias' must have 16 element\(s\), got 15"),
        (torch.zeros(16, dtype=torch.float64), TypeError, "argument 'dbias'"),
        (nan_buf((16, 2))[:, 0], ValueError, "argument 'dbias' must be contiguous"),
    ]
    for db, exc, match in cases:
        out, out_t, amax, sums = fresh()
        with pytest.raises(exc, match=match):
            C.cast_fp8_dbias(x, one(1.0), amax, out, out_t, None, sums, None, db)
        assert (bits(out) == 255).all() and (bits(out_t) == 255).all() and amax.item() == 0.0
        assert torch.isnan(sums).all()
        out, out_t, amax, sums = fresh()
        with pytest.raises(exc, match=match):
            C.cast_fp8_current(x, amax, one(1.0), one(1.0), out, out_t, 0, None, sums, db)
        assert (bits(out) == 255).all() and amax.item() == 0.0 and torch.isnan(sums).all()
    # dbias over the cast's own outputs: refused (the sum would overwrite what the cast wrote)
    out, out_t, amax, sums = fresh()
    with pytest.raises(ValueError, match="outputs 'col_sums' and 'dbias' share memory"):
        C.cast_fp8_dbias(x, one(1.0), amax, out, out_t, None, sums, None, sums[0])
    assert torch.isnan(sums).all() and (bits(out_t) == 255).all()
    xb = torch.randn(128, 128)
    outs = ops.quant.rowcol_outputs(xb, 128, 128, E4M3, None, True, True)
    with pytest.raises(ValueError, match="outputs 'scale_inv_t' and 'dbias' share memory"):
        C.quantize_block_fp8_rowcol(xb, *outs, None, nan_buf((1, 128)), outs[3].reshape(-1)[:128])
    # dbias needs the block sums it totals
    with pytest.raises(ValueError, match="argument 'dbias' comes with 'col_sums'"):
        C.cast_fp8_current(x, one(0.0), one(1.0), one(1.0), *fresh()[:2], 0, None, None, nan_buf((16,)))
    with pytest.raises(ValueError, match="argument 'dbias' comes with 'col_sums'"):
        C.quantize_block_fp8_rowcol(xb, *outs, None, None, nan_buf((128,)))
    with pytest.raises(ValueError, match=r"argument 'dbias' must have 128 element\(s\), got 64"):
        C.quantize_block_fp8_rowcol(xb, *outs, None, nan_buf((1, 128)), nan_buf((64,)))


def test_cast_fp8_current_refuses_scalar_shapes_before_writing_amax():
    """amax / scale / scale_inv of shape [1, 1] (one element, two dimensions):
    refused by name before the amax pass writes anything, on the three-kernel
    path the column sums take as on the others."""
    x = torch.randn(32, 16)
    for bad in ("amax", "scale", "scale_inv"):
        args = {"amax": one(-1.0), "scale": one(-1.0), "scale_inv": one(-1.0)}
        args[bad] = args[bad].reshape(1, 1)
        for sums in (None, nan_buf((1, 16))):
            out_t = fp8_buf((16, 32), E4M3)
            with pytest.raises(ValueError, match=f"argument '{bad}' must be a contiguous 1-D tensor"):
                C.cast_fp8_current(x, args["amax"], args["scale"], args["scale_inv"], None, out_t, 0, None, sums)
            assert all(t.item() == -1.0 for t in args.values()) and (bits(out_t) == 255).all()


def test_block_rowcol_refuses_overlapping_outputs_with_or_without_dbias():
    xb = torch.randn(128, 128)
    outs = list(ops.quant.rowcol_outputs(xb, 128, 128, E4M3, None, True, True))
    outs[3] = outs[1]  # the transposed copy's scales over the row-wise copy's
    with pytest.raises(ValueError, match="outputs 'scale_inv' and 'scale_inv_t' share memory"):
        C.quantize_block_fp8_rowcol(xb, *outs, None)


@pytest.mark.cuda
@pytest.mark.parametrize("sum_dtype", SUMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,k,rows", [(16, 8, 16), (4096, 1280, 4096), (4097, 1024, 4112), (40, 5120, 48)])
def test_cuda_dbias_in_the_cast_call_equals_the_cpu(m, k, rows, dtype, sum_dtype, seed):
    """Both per-tensor entries on CUDA against the CPU backend, bit for bit
    (outputs poisoned): the FP8 copies, amax, scale, block sums and dbias."""
    x = (torch.randn(m, k) * 5).to(dtype)
    got = delayed_case(x.cuda(), E4M3, rows, sum_dtype, "cuda")
    want = delayed_case(x, E4M3, rows, sum_dtype, "cpu")
    for g, w in zip(got, want):
        g = g.cpu()
        assert torch.equal(bits(g), bits(w)) if g.element_size() == 1 else torch.equal(g, w)
    got = current_case(x.cuda(), E5M2, rows, sum_dtype, "cuda", margin=1)
    want = current_case(x, E5M2, rows, sum_dtype, "cpu", margin=1)
    for g, w in zip(got, want):
        g = g.cpu()
        assert torch.equal(bits(g), bits(w)) if g.element_size() == 1 else torch.equal(g, w)


@pytest.mark.cuda
@pytest.mark.parametrize("m,k", [(128, 128), (4097, 1024), (40, 5120)])
def test_cuda_block_rowcol_dbias_equals_the_cpu(m, k, seed):
    x = (torch.randn(m, k) * 2).to(torch.bfloat16)
    res = []
    for dev in ("cuda", "cpu"):
        xd = x.to(dev)
        outs = ops.quant.rowcol_outputs(xd, m, k, E4M3, None, True, True)
        sums, db = nan_buf(blocks(m, k), device=dev), nan_buf((k,), torch.bfloat16, dev)
        ops.quant.quantize_block_fp8_rowcol_into(xd, *outs, sums, db)
        res.append((sums.cpu(), db.cpu()))
    assert torch.equal(res[0][0], res[1][0]) and torch.equal(res[0][1], res[1][1])
