"""The delayed-scaling grouped FP8 cast with the groups' ends on the device
(seqfuse.ops.moe.cast_fp8_grouped_ends), plain and SwiGLU.

Checked against the host-count grouped cast (cast_fp8_grouped /
swiglu_cast_fp8_grouped, themselves held to the per-tensor casts in
test_fp8_grouped_cast.py) with its padding rows taken out, bit for bit:
the bytes, the amaxes folded into the strided scaling slots and the scale
inverses; ends that undershoot, overshoot or go backwards are clamped as
the grouped GEMM clamps them; on CUDA against the CPU with the output
poisoned first; bad inputs against their messages."""
import pytest
import torch

from seqfuse import _C
from seqfuse.ops import moe as moe_ops

from helpers import needs_fp8

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _slots(G, device, gen):
    """Scale and amax as the every-third-column views a ScalingState hands out."""
    buf = torch.zeros(2, 3 * G)
    buf[0] = torch.rand(3 * G, generator=gen) * 2 + 0.25
    buf[1, ::2] = 3.0  # some groups already hold an amax this step (delayed scaling folds into it)
    buf = buf.to(device)
    return buf[0, 1::3], buf[1, 1::3]


def _clamped(ends, m):
    out, prev = [], 0
    for e in ends:
        prev = min(max(e, prev), m)
        out.append(prev)
    return out


def _reference(x, ends, fp8_dtype, scale, amax, swiglu, probs):
    """(bytes [M, K], scale_inv, amax after) from the host-count cast of the
    clamped groups, padding rows removed, zero rows past the last end."""
    m = x.shape[0]
    k = x.shape[1] // 2 if swiglu else x.shape[1]
    e = _clamped(ends, m)
    splits = [b - a for a, b in zip([0] + e[:-1], e)]
    amax = amax.clone()
    rows = e[-1]
    if swiglu:
        data, _, si = moe_ops.swiglu_cast_fp8_grouped(x[:rows], None if probs is None else probs[:rows], splits,
                                                      fp8_dtype, scale=scale, amax=amax, transpose=False)
    else:
        data, _, si = moe_ops.cast_fp8_grouped(x[:rows], splits, fp8_dtype, scale=scale, amax=amax, transpose=False)
    out = torch.zeros((m, k), dtype=torch.uint8, device=x.device)
    p = 0
    for g, (a, n) in enumerate(zip([0] + e[:-1], splits)):
        out[a:a + n] = data.view(torch.uint8)[p:p + n]
        p += -(-n // 16) * 16
    return out, si, amax


def _run(x, ends, fp8_dtype, scale, amax, swiglu, probs, poison=False):
    """cast_fp8_grouped_ends, or (``poison``) its C call into an output filled with 0x7e first."""
    ends_t = torch.tensor(ends, dtype=torch.int32, device=x.device)
    if not poison:
        data, si = moe_ops.cast_fp8_grouped_ends(x, ends_t, fp8_dtype, scale=scale, amax=amax, swiglu=swiglu,
                                                 probs=probs)
        return data.view(torch.uint8), si
    k = x.shape[1] // 2 if swiglu else x.shape[1]
    data = torch.full((x.shape[0], k), 0x7E, dtype=torch.uint8, device=x.device).view(fp8_dtype)
    si = torch.full((len(ends), 64), float("nan"), device=x.device)[:, 0]
    _C.cast_fp8_grouped_ends(x, probs, int(swiglu), ends_t, scale, amax, data, si, torch.cuda.current_stream().cuda_stream)
    return data.view(torch.uint8), si


CASES = [  # (rows, ends): ragged, empty groups, short of the rows, past them, going backwards
    (90, [5, 5, 42, 90]),
    (64, [0, 0, 64]),
    (50, [20, 20, 31]),
    (40, [10, 55, 60]),
    (70, [30, 12, 70]),
    (1, [1]),
]


def _check(device, dtype, fp8_dtype, swiglu, probs_dtype, m, ends, k, gen, poison=False):
    width = 2 * k if swiglu else k
    x = (torch.randn(m, width, generator=gen) * torch.linspace(0.1, 40, m)[:, None]).to(dtype).to(device)
    probs = None
    if swiglu and probs_dtype is not None:
        probs = torch.rand(m, generator=gen).to(probs_dtype).to(device)
    scale, amax = _slots(len(ends), device, gen)
    want, want_si, want_amax = _reference(x, ends, fp8_dtype, scale, amax, swiglu, probs)
    got, si = _run(x, ends, fp8_dtype, scale, amax, swiglu, probs, poison)
    assert torch.equal(got, want)
    assert torch.equal(si, want_si) and si.stride(0) == 64
    assert torch.equal(amax, want_amax)


@needs_fp8
@pytest.mark.parametrize("m,ends", CASES)
def test_ends_cast_equals_host_count_cast(m, ends, seed):
    gen = torch.Generator().manual_seed(seed)
    for dtype, fp8_dtype in ((torch.float32, E4M3), (torch.bfloat16, E5M2), (torch.float16, E4M3)):
        _check("cpu", dtype, fp8_dtype, False, None, m, ends, 48, gen)


@needs_fp8
@pytest.mark.parametrize("m,ends", CASES[:4])
def test_swiglu_ends_cast_equals_host_count_swiglu_cast(m, ends, seed):
    gen = torch.Generator().manual_seed(seed)
    for dtype, fp8_dtype, pd in ((torch.bfloat16, E4M3, torch.float32), (torch.float32, E5M2, torch.bfloat16),
                                 (torch.bfloat16, E4M3, None)):
        _check("cpu", dtype, fp8_dtype, True, pd, m, ends, 32, gen)


@needs_fp8
def test_ends_cast_without_amax(seed):
    """amax None: the same bytes and scale inverses (nothing folded anywhere)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(40, 32, generator=gen)
    scale, _ = _slots(2, "cpu", gen)
    data, si = moe_ops.cast_fp8_grouped_ends(x, torch.tensor([25, 40], dtype=torch.int32), E4M3, scale=scale)
    want, want_si, _ = _reference(x, [25, 40], E4M3, scale, torch.zeros(2), False, None)
    assert torch.equal(data.view(torch.uint8), want) and torch.equal(si, want_si)


@needs_fp8
def test_ends_cast_bad_inputs(seed):
    x = torch.randn(40, 32)
    scale, amax = _slots(2, "cpu", torch.Generator().manual_seed(seed))
    ends = torch.tensor([20, 40], dtype=torch.int32)
    cast = moe_ops.cast_fp8_grouped_ends
    with pytest.raises(TypeError, match="'row_end' must be a 1-D int32 tensor"):
        cast(x, ends.long(), E4M3, scale=scale, amax=amax)
    with pytest.raises(ValueError, match="'x' must have K .* multiple of 16"):
        cast(torch.randn(40, 24), ends, E4M3, scale=scale, amax=amax)
    with pytest.raises(ValueError, match="'probs' goes with swiglu=True"):
        cast(x, ends, E4M3, scale=scale, amax=amax, probs=torch.rand(40))
    with pytest.raises(ValueError, match="even last dimension"):
        cast(torch.randn(40, 33), ends, E4M3, scale=scale, swiglu=True)
    with pytest.raises(ValueError, match="'scale' must be a 1-D float32 tensor of 3 elements"):
        cast(x, torch.tensor([10, 20, 40], dtype=torch.int32), E4M3, scale=scale, amax=amax)
    with pytest.raises(ValueError, match="'row_end' must be a contiguous 1-D int32 tensor of 1 to 64"):
        cast(x, torch.arange(1, 66, dtype=torch.int32), E4M3, scale=torch.ones(65), amax=torch.zeros(65))
    with pytest.raises(ValueError, match="'probs' must be a contiguous 1-D tensor of one entry per row"):
        cast(torch.randn(40, 64), ends, E4M3, scale=scale, amax=amax, swiglu=True, probs=torch.rand(39))
    with pytest.raises(ValueError, match="'x' must be 2-D"):
        cast(x.view(2, 20, 32), ends, E4M3, scale=scale, amax=amax)


@pytest.mark.cuda
@needs_fp8
def test_ends_cast_cuda_equals_cpu(seed):
    """The kernel against the CPU reference (the host-count CUDA cast, padding
    removed), bit for bit, the output poisoned first: 16-bit and float32
    inputs, both formats, plain and SwiGLU, ragged / empty / short /
    overshooting ends, 64 groups, and rows spanning many CTAs."""
    gen = torch.Generator().manual_seed(seed)
    many = torch.bincount(torch.multinomial(torch.rand(64, generator=gen) ** 2, 3000, replacement=True,
                                            generator=gen), minlength=64).cumsum(0).tolist()
    for dtype, fp8_dtype in ((torch.bfloat16, E4M3), (torch.float16, E5M2), (torch.float32, E4M3)):
        for m, ends in CASES + [(3000, many), (4100, [1000, 1000, 4100])]:
            for k in (48, 1024):
                _check("cuda", dtype, fp8_dtype, False, None, m, ends, k, gen, poison=True)
            _check("cuda", dtype, fp8_dtype, True, torch.float32, m, ends, 64, gen, poison=True)
    _check("cuda", torch.bfloat16, E4M3, True, None, 3000, many, 3584, gen, poison=True)
