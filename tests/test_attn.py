"""seqfuse.ops.attention on the CPU (the C reference backend) against an
independent float64 torch reference (tests/attn_ref.py) and torch's
scaled_dot_product_attention: every layout, mask, window, GQA ratio, forward
and gradients; packed (thd) against padded (bshd) on the same sequences; and
every bad input's error.  The CUDA kernel is tested in test_attn_cuda.py."""
import random

import ctypes
from ctypes import c_int64

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import seqfuse
from attn_ref import PADDING, cu_seqlens, pack, reference, unpack
from dlpack_forge import (KDL_CUDA, VERSIONED_DELETER, DLDataType, DLDevice, DLManagedTensorVersioned,
                          DLPackVersion, DLTensor, _capsule_new)
from helpers import assert_close_rel

attention = seqfuse.ops.attention

MASKS = ["no_mask", "padding", "causal", "padding_causal", "causal_bottom_right",
         "padding_causal_bottom_right"]


def make(shape_q, shape_kv, dtype, requires_grad=False):
    q = torch.randn(shape_q).to(dtype).requires_grad_(requires_grad)
    k = torch.randn(shape_kv).to(dtype).requires_grad_(requires_grad)
    v = torch.randn(shape_kv).to(dtype).requires_grad_(requires_grad)
    return q, k, v


def grads(out_fn, inputs, dout):
    for x in inputs:
        x.grad = None
    out = out_fn()
    out.backward(dout)
    return out.detach(), [x.grad.clone() for x in inputs]


def padded_case(fmt, mask, b, sq, sk, h, hk, d, dtype, window=None, seed_lengths=0):
    rng = random.Random(seed_lengths)
    q, k, v = make((b, sq, h, d), (b, sk, hk, d), dtype, requires_grad=True)
    if fmt == "sbhd":
        q, k, v = (x.detach().transpose(0, 1).contiguous().requires_grad_() for x in (q, k, v))
    lq = lk = None
    kw = {}
    if mask in PADDING:
        lq = [rng.randint(0, sq) for _ in range(b)]
        lk = [rng.randint(1, sk) for _ in range(b)]
        lq[0], lk[0] = sq, sk  # one full row
        kw = dict(cu_seqlens_q=cu_seqlens(lq), cu_seqlens_kv=cu_seqlens(lk))
    return q, k, v, lq, lk, kw


@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("sq,sk", [(7, 7), (13, 5), (5, 17)])
@pytest.mark.parametrize("h,hk", [(4, 4), (4, 2), (3, 1)])
def test_padded_forward_backward_float32(fmt, mask, sq, sk, h, hk, seed):
    d = 16
    q, k, v, lq, lk, kw = padded_case(fmt, mask, 3, sq, sk, h, hk, d, torch.float32, seed_lengths=seed)
    dout = torch.randn(q.shape)
    out, (dq, dk, dv) = grads(lambda: attention(q, k, v, qkv_format=fmt, attn_mask_type=mask, **kw),
                              [q, k, v], dout)
    qr, kr, vr = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = reference(qr, kr, vr, qkv_format=fmt, attn_mask_type=mask, seqlens_q=lq, seqlens_kv=lk)
    ref.backward(dout.double())
    assert_close_rel(out, ref, torch.float32)
    assert_close_rel(dq, qr.grad, torch.float32)
    assert_close_rel(dk, kr.grad, torch.float32)
    assert_close_rel(dv, vr.grad, torch.float32)


@pytest.mark.parametrize("mask", ["no_mask", "causal", "causal_bottom_right", "padding_causal"])
@pytest.mark.parametrize("window", [(3, 0), (2, 2), (0, -1), (-1, 1), (5, -1)])
@pytest.mark.parametrize("sq,sk", [(9, 9), (6, 11), (11, 6)])
def test_sliding_window(mask, window, sq, sk, seed):
    q, k, v, lq, lk, kw = padded_case("bshd", mask, 2, sq, sk, 2, 1, 8, torch.float32, seed_lengths=seed)
    dout = torch.randn(q.shape)
    out, (dq, dk, dv) = grads(lambda: attention(q, k, v, qkv_format="bshd", attn_mask_type=mask,
                                                window_size=window, **kw), [q, k, v], dout)
    qr, kr, vr = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = reference(qr, kr, vr, qkv_format="bshd", attn_mask_type=mask, seqlens_q=lq, seqlens_kv=lk,
                    window_size=window)
    ref.backward(dout.double())
    for a, b in ((out, ref), (dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        assert_close_rel(a, b, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [32, 64])
def test_half_dtypes_forward_backward(dtype, d, seed):
    q, k, v = make((2, 19, 4, d), (2, 19, 2, d), dtype, requires_grad=True)
    dout = torch.randn(q.shape).to(dtype)
    out, (dq, dk, dv) = grads(lambda: attention(q, k, v, attn_mask_type="causal"), [q, k, v], dout)
    assert out.dtype == dtype and dq.dtype == dtype
    qr, kr, vr = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = reference(qr, kr, vr, qkv_format="bshd", attn_mask_type="causal")
    ref.backward(dout.double())
    for a, b in ((out, ref), (dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        assert_close_rel(a, b, dtype)


@pytest.mark.parametrize("mask", ["no_mask", "causal"])
@pytest.mark.parametrize("h,hk", [(4, 4), (4, 1)])
def test_matches_torch_sdpa(mask, h, hk, seed):
    q, k, v = make((2, 23, h, 32), (2, 23, hk, 32), torch.float32, requires_grad=True)
    dout = torch.randn(q.shape)
    out, g = grads(lambda: attention(q, k, v, attn_mask_type=mask), [q, k, v], dout)
    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
    ref = F.scaled_dot_product_attention(qt, kt.repeat_interleave(h // hk, 1), vt.repeat_interleave(h // hk, 1),
                                         is_causal=mask == "causal")
    ref.backward(dout.transpose(1, 2))
    assert_close_rel(out, ref.transpose(1, 2), torch.float32)
    for a, b in zip(g, (qt.grad, kt.grad, vt.grad)):
        assert_close_rel(a, b.transpose(1, 2), torch.float32)


@pytest.mark.parametrize("mask", ["padding", "padding_causal", "padding_causal_bottom_right"])
@pytest.mark.parametrize("h,hk", [(2, 2), (4, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_thd_equals_bshd(mask, h, hk, dtype, seed):
    """Packed and padded batches of the same sequences: same outputs and
    gradients on the real tokens; zeros elsewhere."""
    rng = random.Random(seed)
    b, s, d = 4, 12, 16
    lq = [rng.randint(1, s) for _ in range(b)]
    lk = lq if "bottom_right" not in mask else [rng.randint(1, s) for _ in range(b)]
    qp, kp, vp = make((b, s, h, d), (b, s, hk, d), dtype)
    for i in range(b):  # padding content must not matter: fill it with noise
        qp[i, lq[i]:] = 100
        kp[i, lk[i]:] = -100
        vp[i, lk[i]:] = float("nan")
    dout = torch.randn(qp.shape).to(dtype)
    cq, ck = cu_seqlens(lq), cu_seqlens(lk)
    padded = [x.clone().requires_grad_() for x in (qp, kp, vp)]
    out_p, g_p = grads(lambda: attention(*padded, qkv_format="bshd", attn_mask_type=mask,
                                         cu_seqlens_q=cq, cu_seqlens_kv=ck), padded, dout)
    tail = 3  # tokens past the last sequence in the packed buffer
    packed = [torch.cat([pack(x, n), torch.randn((tail,) + x.shape[2:]).to(dtype)]).requires_grad_()
              for x, n in ((qp, lq), (kp, lk), (vp, lk))]
    dout_t = torch.cat([pack(dout, lq), torch.randn((tail,) + dout.shape[2:]).to(dtype)])
    out_t, g_t = grads(lambda: attention(*packed, qkv_format="thd", attn_mask_type=mask,
                                         cu_seqlens_q=cq, cu_seqlens_kv=ck), packed, dout_t)
    assert torch.equal(unpack(out_t[:-tail], lq, s), out_p)
    assert torch.equal(out_t[-tail:], torch.zeros_like(out_t[-tail:]))
    assert torch.equal(unpack(g_t[0][:-tail], lq, s), g_p[0])
    assert torch.equal(unpack(g_t[1][:-tail], lk, s), g_p[1])
    assert torch.equal(unpack(g_t[2][:-tail], lk, s), g_p[2])
    for g in g_t:
        assert torch.equal(g[-tail:], torch.zeros_like(g[-tail:]))
    ref = reference(qp, kp, vp, qkv_format="bshd", attn_mask_type=mask, seqlens_q=lq, seqlens_kv=lk)
    assert_close_rel(out_p, ref, dtype)


def test_lse_and_empty_rows():
    """lse = logsumexp of the scaled scores; a row that sees no key gets
    out 0 and lse +inf; padded rows too."""
    q, k, v = make((1, 6, 1, 8), (1, 4, 1, 8), torch.float32)
    out, lse = seqfuse.ops.attention_forward(q, k, v, attn_mask_type="padding_causal",
                                         cu_seqlens_q=cu_seqlens([5]), cu_seqlens_kv=cu_seqlens([3]),
                                         window_size=(0, 0))
    assert lse.shape == (1, 1, 6)
    s = (q[0, :, 0] @ k[0, :, 0].T).double() / 8 ** 0.5
    for r in range(3):  # top-left window (0, 0): row r sees only key r
        assert abs(lse[0, 0, r].item() - s[r, r].item()) < 1e-5
        assert torch.allclose(out[0, r, 0], v[0, r, 0], atol=1e-6)
    assert torch.isinf(lse[0, 0, 3:]).all()  # rows 3, 4 see no key (3 keys); row 5 is padding
    assert torch.equal(out[0, 3:], torch.zeros_like(out[0, 3:]))


def test_deterministic_flag_same_result_on_cpu(seed):
    q, k, v = make((2, 9, 2, 16), (2, 9, 2, 16), torch.float32, requires_grad=True)
    dout = torch.randn(q.shape)
    _, g1 = grads(lambda: attention(q, k, v, attn_mask_type="causal"), [q, k, v], dout)
    _, g2 = grads(lambda: attention(q, k, v, attn_mask_type="causal", deterministic=True), [q, k, v], dout)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


def test_no_grad_path_returns_plain_tensor():
    q, k, v = make((1, 4, 2, 8), (1, 4, 2, 8), torch.float32)
    out = attention(q, k, v)
    assert out.grad_fn is None and out.shape == q.shape


# ---- bad inputs -----------------------------------------------------------

def test_bad_dtype():
    q, k, v = make((1, 4, 2, 8), (1, 4, 2, 8), torch.float32)
    with pytest.raises(TypeError, match="attention_forward: argument 'k' must have dtype float32, got bfloat16"):
        attention(q, k.bfloat16(), v)
    with pytest.raises(TypeError, match="argument 'q' must have dtype float32, float16 or bfloat16, got int32"):
        attention(q.int(), k.int(), v.int())


def test_bad_head_dims():
    q, k, v = make((1, 4, 2, 8), (1, 4, 2, 16), torch.float32)
    with pytest.raises(ValueError, match="'q' and 'k' must have the same head dim, got 8 and 16"):
        attention(q, k, v)
    q, k, v = make((1, 4, 3, 8), (1, 4, 2, 8), torch.float32)
    with pytest.raises(ValueError, match=r"query heads \(3\) must be a positive multiple of the number of key/value heads \(2\)"):
        attention(q, k, v)
    q, k, v = make((1, 4, 2, 8), (1, 4, 2, 8), torch.float32)
    with pytest.raises(ValueError, match="'k' and 'v' must have the same shape"):
        attention(q, k, v[:, :3])
    with pytest.raises(ValueError, match=r"must have 3 dimensions for qkv_format thd \(\[t, h, d\]\), got 4"):
        attention(q, k, v, qkv_format="thd", cu_seqlens_q=cu_seqlens([4]), cu_seqlens_kv=cu_seqlens([4]))


def test_bad_cu_seqlens():
    q, k, v = make((8, 2, 8), (8, 2, 8), torch.float32)
    good = cu_seqlens([3, 5])
    with pytest.raises(ValueError, match="'thd' needs cu_seqlens_q and cu_seqlens_kv"):
        attention(q, k, v, qkv_format="thd")
    with pytest.raises(TypeError, match="argument 'cu_seqlens_q' must have dtype int32, got int64"):
        attention(q, k, v, qkv_format="thd", cu_seqlens_q=good.long(), cu_seqlens_kv=good, max_seqlen_q=5)
    with pytest.raises(ValueError, match=r"'cu_seqlens_q' and 'cu_seqlens_kv' must have the same number of elements \(b\+1\), got 3 and 4"):
        attention(q, k, v, qkv_format="thd", cu_seqlens_q=good, cu_seqlens_kv=cu_seqlens([3, 2, 3]))
    with pytest.raises(ValueError, match="'cu_seqlens_kv' must be non-decreasing"):
        attention(q, k, v, qkv_format="thd", cu_seqlens_q=good,
                  cu_seqlens_kv=torch.tensor([0, 5, 4], dtype=torch.int32), max_seqlen_kv=5)
    with pytest.raises(ValueError, match="'cu_seqlens_q' ends at 9, beyond the 8 tokens"):
        attention(q, k, v, qkv_format="thd", cu_seqlens_q=cu_seqlens([4, 5]), cu_seqlens_kv=good)
    with pytest.raises(ValueError, match="holds a sequence of length 5, longer than the max_seqlen 4"):
        attention(q, k, v, qkv_format="thd", cu_seqlens_q=good, cu_seqlens_kv=good, max_seqlen_q=4,
                  max_seqlen_kv=5)
    qb, kb, vb = make((2, 4, 2, 8), (2, 4, 2, 8), torch.float32)
    with pytest.raises(ValueError, match=r"'cu_seqlens_q' must have b\+1 = 3 elements, got 2"):
        attention(qb, kb, vb, attn_mask_type="padding", cu_seqlens_q=cu_seqlens([4]),
                  cu_seqlens_kv=cu_seqlens([4, 4]))
    with pytest.raises(ValueError, match="padding' in bshd needs cu_seqlens_q and cu_seqlens_kv"):
        attention(qb, kb, vb, attn_mask_type="padding")


def test_bad_options():
    q, k, v = make((1, 4, 2, 8), (1, 4, 2, 8), torch.float32)
    with pytest.raises(ValueError, match="qkv_format must be 'bshd', 'sbhd' or 'thd', got 'bhsd'"):
        attention(q, k, v, qkv_format="bhsd")
    with pytest.raises(ValueError, match="attn_mask_type must be one of"):
        attention(q, k, v, attn_mask_type="arbitrary")
    with pytest.raises(ValueError, match="window_size entries must be -1 or >= 0"):
        attention(q, k, v, window_size=(-2, 0))
    with pytest.raises(TypeError, match="argument 'v' must be a torch.Tensor"):
        attention(q, k, None)


def test_c_entry_checks_outputs():
    q, k, v = make((1, 4, 2, 8), (1, 4, 2, 8), torch.float32)
    cfg = (0, 0, -1, -1, 0.35, 4, 4, 0, 0.0, 0, 0)
    lse = torch.empty(1, 2, 4)
    with pytest.raises(ValueError, match=r"attention_forward: argument 'lse' must have shape \[b, h, s_q\] = \[1, 2, 4\]"):
        seqfuse._C.attn_forward(q, k, v, None, None, torch.empty_like(q), torch.empty(1, 2, 5), cfg)
    with pytest.raises(TypeError, match="attention_forward: argument 'out' must have dtype float32, got bfloat16"):
        seqfuse._C.attn_forward(q, k, v, None, None, torch.empty_like(q, dtype=torch.bfloat16), lse, cfg)
    with pytest.raises(ValueError, match="must be contiguous in its last \\(head\\) dimension"):
        seqfuse._C.attn_forward(q, k, v, None, None, torch.empty(1, 4, 8, 2).transpose(2, 3), lse, cfg)
    with pytest.raises(ValueError, match="cu_seqlens are only taken with qkv_format thd or a padding mask"):
        seqfuse._C.attn_forward(q, k, v, cu_seqlens([4]), cu_seqlens([4]), torch.empty_like(q), lse, cfg)
    with pytest.raises(TypeError, match="argument 'cfg' must be a tuple of 11 numbers"):
        seqfuse._C.attn_forward(q, k, v, None, None, torch.empty_like(q), lse, cfg[:8])
    with pytest.raises(ValueError, match=r"config entry 9 \(dropout_seed\) must be in \[0, 2\*\*64\)"):
        seqfuse._C.attn_forward(q, k, v, None, None, torch.empty_like(q), lse, cfg[:9] + (-1, 0))
    with pytest.raises(ValueError, match=r"config entry 10 \(dropout_offset\) must be in \[0, 2\*\*64\)"):
        seqfuse._C.attn_forward(q, k, v, None, None, torch.empty_like(q), lse, cfg[:9] + (0, 2**64))


@pytest.mark.cuda
def test_cuda_unsupported_inputs_raise(monkeypatch):
    """seqfuse's own kernels refuse float32 and head dim 96 (in auto, the
    float32 route and cuDNN take those calls: test_attn_routes*)."""
    monkeypatch.setenv("SEQFUSE_ATTN_BACKEND", "seqfuse")
    monkeypatch.setattr(seqfuse.ops.attn._routing, "_backend", None)
    monkeypatch.setattr(seqfuse.ops.attn._routing, "_choices", {})
    q, k, v = (torch.randn(1, 8, 2, 64, device="cuda") for _ in range(3))
    with pytest.raises(NotImplementedError, match="takes float16 or bfloat16 inputs, got float32"):
        attention(q, k, v)
    q, k, v = (torch.randn(1, 8, 2, 96, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with pytest.raises(NotImplementedError, match="supports head dims 16, 24, 32, 64 and 128, got 96"):
        attention(q, k, v)


class _ForgedCuda16:
    """A bfloat16 tensor that claims to live on cuda:0 (DLPack capsule made
    by hand, host memory behind it, 16-byte aligned): lets the C entry's CUDA
    checks run without a GPU.  Nothing may launch on it, so every call below
    fails in a check after the head-dim one."""

    def __init__(self, shape, dtype_code=4, bits=16):
        n = int(np.prod(shape)) * bits // 8
        self._raw = np.zeros(n + 16, dtype=np.uint8)
        off = (-self._raw.ctypes.data) % 16
        self.array = self._raw[off:off + n]
        self.shape, self.code, self.bits = tuple(shape), dtype_code, bits
        self._keep = []

    def __dlpack_device__(self):
        return (KDL_CUDA, 0)

    def __dlpack__(self, stream=None, max_version=None):
        nd = len(self.shape)
        shape = (c_int64 * nd)(*self.shape)
        strides = (c_int64 * nd)(*[int(np.prod(self.shape[i + 1:])) for i in range(nd)])
        m = DLManagedTensorVersioned()
        m.version = DLPackVersion(1, 0)
        m.deleter = VERSIONED_DELETER(lambda ptr: None)
        m.flags = 0
        m.dl_tensor = DLTensor(self.array.ctypes.data, DLDevice(KDL_CUDA, 0), nd,
                               DLDataType(self.code, self.bits, 1), shape, strides, 0)
        self._keep.append((m, shape, strides))
        return _capsule_new(ctypes.addressof(m), b"dltensor_versioned", None)


@pytest.mark.parametrize("d", [16, 24, 32, 64, 128, 8, 40, 96])
def test_cuda_entry_head_dims(d):
    """The C entry's CUDA rules, checked on forged CUDA tensors: head dims 16,
    24, 32, 64 and 128 pass the head-dim check (the call then stops at the
    deliberately wrong lse shape), others are rejected with a message that
    names the supported dims."""
    q, k, v, out = (_ForgedCuda16((1, 8, 2, d)) for _ in range(4))
    bad_lse = _ForgedCuda16((1, 2, 5), dtype_code=2, bits=32)
    cfg = (0, 0, -1, -1, d ** -0.5, 8, 8, 0, 0.0, 0, 0)
    if d in (16, 24, 32, 64, 128):
        with pytest.raises(ValueError, match=r"argument 'lse' must have shape \[b, h, s_q\] = \[1, 2, 8\]"):
            seqfuse._C.attn_forward(q, k, v, None, None, out, bad_lse, cfg, 0)
    else:
        with pytest.raises(NotImplementedError,
                           match=f"attention_forward: the CUDA kernel supports head dims 16, 24, 32, 64 and 128, got {d}"):
            seqfuse._C.attn_forward(q, k, v, None, None, out, bad_lse, cfg, 0)


def test_cuda_entry_head_dim_24_alignment():
    """Head dim 24 rows are 48 bytes, three 16-byte loads: strides that are
    multiples of 8 elements keep every row 16-byte aligned; a stride of 12
    (say [..., :12] of 24-wide rows) is refused on CUDA."""
    q = _ForgedCuda16((1, 8, 2, 24))
    bad_lse = _ForgedCuda16((1, 2, 5), dtype_code=2, bits=32)
    cfg = (0, 0, -1, -1, 24 ** -0.5, 8, 8, 0, 0.0, 0, 0)

    class Strided(_ForgedCuda16):
        def __dlpack__(self, stream=None, max_version=None):
            cap = super().__dlpack__(stream, max_version)
            self._keep[-1][2][2] = 12  # head stride 12 elements = 24 bytes
            return cap

    odd = Strided((1, 8, 2, 24))
    with pytest.raises(ValueError, match="argument 'k' must have strides that are multiples of 8 elements"):
        seqfuse._C.attn_forward(q, odd, q, None, None, q, bad_lse, cfg, 0)


def test_strided_qkv_views_cpu(seed):
    qkv = torch.randn(2, 11, 3, 2, 8)
    q, k, v = qkv.unbind(2)
    out = attention(q, k, v, attn_mask_type="causal")
    ref = attention(q.contiguous(), k.contiguous(), v.contiguous(), attn_mask_type="causal")
    assert torch.equal(out, ref)


# ---- attention dropout ---------------------------------------------------------------------------
# The mask is regenerated from Philox4x32-10 (csrc/attn/attn_philox.h); tests/attn_philox.py writes
# the same rule again in numpy, so the C mask is checked element by element.

from attn_philox import keep_mask, philox4x32_10  # noqa: E402


def test_philox_known_answers():
    """The numpy Philox4x32-10 reproduces Random123's known-answer vectors."""
    kat = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
           ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
           ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for ctr, key, want in kat:
        got = tuple(int(w) for w in philox4x32_10(*ctr, *key))
        assert got == want, [hex(w) for w in got]


def _identity_v_case(fmt, b, sq, sk, h, hk):
    """q, k random; v = identity over the keys (head dim = sk), so
    out[r, c] = P_rc * keep_rc / (1 - p): the output IS the dropped P."""
    q = torch.randn(b, sq, h, sk)
    k = torch.randn(b, sk, hk, sk)
    v = torch.eye(sk).expand(b, hk, sk, sk).permute(0, 2, 1, 3).contiguous()
    if fmt == "sbhd":
        q, k, v = (x.transpose(0, 1).contiguous() for x in (q, k, v))
    return q, k, v


@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
@pytest.mark.parametrize("p", [0.1, 0.25, 0.5])
def test_dropout_mask_elementwise_and_rate(fmt, p):
    """With V = identity the forward returns dropout(P) itself: every element's
    keep decision and 1/(1-p) scale equal the numpy Philox mask, and the kept
    fraction over 2*4*48*64 = 24576 elements is within 5 standard deviations
    of 1 - p."""
    torch.manual_seed(0)
    b, sq, sk, h, hk = 2, 48, 64, 4, 2
    q, k, v = _identity_v_case(fmt, b, sq, sk, h, hk)
    seed, offset = 0x1234_5678_9ABC_DEF0, 40
    out = attention(q, k, v, qkv_format=fmt, dropout_p=p, rng_state=(seed, offset))
    plain = attention(q, k, v, qkv_format=fmt)  # P itself (v = identity)
    if fmt == "sbhd":
        out, plain = out.transpose(0, 1), plain.transpose(0, 1)
    kept = 0
    for i in range(b):
        keep = keep_mask(seed, offset, i, h, sq, sk, p).permute(1, 0, 2)  # [sq, h, sk]
        want = torch.where(keep, plain[i].double() / (1 - p), torch.zeros((), dtype=torch.float64))
        assert torch.equal(out[i] != 0, keep)
        torch.testing.assert_close(out[i].double(), want, rtol=2e-6, atol=1e-9)
        kept += int(keep.sum())
    n = b * h * sq * sk
    sigma = (p * (1 - p) / n) ** 0.5
    assert abs(kept / n - (1 - p)) < 5 * sigma, (kept / n, 1 - p)


@pytest.mark.parametrize("mask", ["no_mask", "causal", "padding_causal_bottom_right"])
def test_dropout_thd_mask_coordinates(mask):
    """thd: sequence i's mask uses stream i and rows/keys counted from the
    sequence start (the same mask as its bshd row)."""
    torch.manual_seed(1)
    lengths = [5, 33, 17]
    s, h = 40, 2
    q, k, v = _identity_v_case("bshd", len(lengths), s, s, h, h)
    cu = cu_seqlens(lengths)
    rng_state = (987654321, 8)
    packed = [pack(x, lengths) for x in (q, k, v)]
    out_t = attention(*packed, qkv_format="thd", attn_mask_type=mask, cu_seqlens_q=cu,
                      cu_seqlens_kv=cu, dropout_p=0.3, rng_state=rng_state)
    ref = reference(*packed, qkv_format="thd", attn_mask_type=mask, seqlens_q=lengths,
                    seqlens_kv=lengths, dropout=(0.3, *rng_state))
    assert_close_rel(out_t, ref, torch.float32)
    padded_mask = {"no_mask": "padding", "causal": "padding_causal"}.get(mask, mask)
    out_p = attention(q, k, v, qkv_format="bshd", attn_mask_type=padded_mask, cu_seqlens_q=cu,
                      cu_seqlens_kv=cu, dropout_p=0.3, rng_state=rng_state)
    assert torch.equal(unpack(out_t, lengths, s), out_p)


@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "thd"])
@pytest.mark.parametrize("mask", ["no_mask", "causal", "padding_causal"])
@pytest.mark.parametrize("h,hk", [(4, 4), (4, 2)])
@pytest.mark.parametrize("p", [0.2, 0.6])
def test_dropout_gradients_float64_reference(fmt, mask, h, hk, p, seed):
    """Output and gradients of the dropout op against torch autograd of the
    explicit float64 reference (softmax, times the regenerated mask / (1-p),
    matmul)."""
    b, sq, sk, d = 3, 21, 37, 16
    rng_state = (seed * 7919 + 3, 4 * seed)
    if fmt == "thd":
        rng = random.Random(seed)
        lq = [rng.randint(1, sq) for _ in range(b)]
        lk = [rng.randint(1, sk) for _ in range(b)]
        q, k, v = make((sum(lq), h, d), (sum(lk), hk, d), torch.float32, requires_grad=True)
        kw = dict(cu_seqlens_q=cu_seqlens(lq), cu_seqlens_kv=cu_seqlens(lk))
    else:
        q, k, v, lq, lk, kw = padded_case(fmt, mask, b, sq, sk, h, hk, d, torch.float32, seed_lengths=seed)
    dout = torch.randn(q.shape)
    out, (dq, dk, dv) = grads(lambda: attention(q, k, v, qkv_format=fmt, attn_mask_type=mask, dropout_p=p,
                                                rng_state=rng_state, **kw), [q, k, v], dout)
    qr, kr, vr = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = reference(qr, kr, vr, qkv_format=fmt, attn_mask_type=mask, seqlens_q=lq, seqlens_kv=lk,
                    dropout=(p, *rng_state))
    ref.backward(dout.double())
    assert_close_rel(out, ref, torch.float32)
    assert_close_rel(dq, qr.grad, torch.float32)
    assert_close_rel(dk, kr.grad, torch.float32)
    assert_close_rel(dv, vr.grad, torch.float32)
    # and the dropout really acted: without it the output differs
    assert not torch.allclose(out, attention(q.detach(), k.detach(), v.detach(), qkv_format=fmt,
                                             attn_mask_type=mask, **kw))


def test_dropout_determinism_and_rng_draws():
    """Same (seed, offset): bitwise the same output; another offset or seed:
    another mask; without rng_state the pair comes from torch's CPU generator,
    so torch.manual_seed repeats it; the autograd backward reuses the forward's
    pair (its gradients equal an explicit call with the same pair)."""
    torch.manual_seed(3)
    q, k, v = make((2, 16, 2, 16), (2, 24, 2, 16), torch.float32)
    run = lambda st: attention(q, k, v, dropout_p=0.4, rng_state=st)  # noqa: E731
    a = run((11, 0))
    assert torch.equal(a, run((11, 0)))
    assert not torch.equal(a != 0, run((11, 4)) != 0) or not torch.equal(a, run((11, 4)))
    assert not torch.equal(a, run((11, 4)))
    assert not torch.equal(a, run((12, 0)))
    torch.manual_seed(5)
    x = attention(q, k, v, dropout_p=0.4)
    y = attention(q, k, v, dropout_p=0.4)
    torch.manual_seed(5)
    assert torch.equal(x, attention(q, k, v, dropout_p=0.4))
    assert not torch.equal(x, y)  # a fresh draw per call
    # autograd: forward and backward share the drawn pair
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    dout = torch.randn(q.shape)
    torch.manual_seed(9)
    state = seqfuse.ops.attn.dropout_rng_state(q)
    torch.manual_seed(9)
    out, (dq, dk, dv) = grads(lambda: attention(qg, kg, vg, dropout_p=0.4), [qg, kg, vg], dout)
    ref_out, (rdq, rdk, rdv) = grads(lambda: attention(qg, kg, vg, dropout_p=0.4, rng_state=state),
                                     [qg, kg, vg], dout)
    for got, want in ((out, ref_out), (dq, rdq), (dk, rdk), (dv, rdv)):
        assert torch.equal(got, want)


def test_dropout_zero_is_plain_attention():
    q, k, v = make((2, 9, 2, 16), (2, 9, 2, 16), torch.float32)
    assert torch.equal(attention(q, k, v, dropout_p=0.0, rng_state=(5, 0)), attention(q, k, v))


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5, float("nan")])
def test_dropout_bad_probability(p):
    q, k, v = make((1, 4, 2, 8), (1, 4, 2, 8), torch.float32)
    with pytest.raises(ValueError, match=r"attention_forward: dropout_p must be in \[0, 1\)"):
        attention(q, k, v, dropout_p=p)
    out, lse = seqfuse.ops.attention_forward(q, k, v)
    with pytest.raises(ValueError, match=r"attention_backward: dropout_p must be in \[0, 1\)"):
        seqfuse.ops.attention_backward(out, q, k, v, out, lse, dropout_p=p, rng_state=(1, 0))
    with pytest.raises(ValueError, match="needs the forward's rng_state"):
        seqfuse.ops.attention_backward(out, q, k, v, out, lse, dropout_p=0.5)
    with pytest.raises(ValueError, match=r"rng_state must be two integers in \[0, 2\*\*64\)"):
        attention(q, k, v, dropout_p=0.5, rng_state=(-1, 0))


def test_cuda_dropout_reaches_the_shape_checks_at_the_c_entry():
    """On CUDA tensors (forged: nothing launches) a dropout call goes through
    the C entry's checks like any other (here it stops at the wrong lse shape):
    CUDA dropout needs no switch since its kernels passed on an H200."""
    q = _ForgedCuda16((1, 8, 2, 64))
    out = _ForgedCuda16((1, 8, 2, 64))
    bad_lse = _ForgedCuda16((1, 2, 9), dtype_code=2, bits=32)
    cfg = (0, 0, -1, -1, 0.125, 8, 8, 0, 0.1, 1, 0)
    with pytest.raises(ValueError, match=r"argument 'lse' must have shape"):
        seqfuse._C.attn_forward(q, q, q, None, None, out, bad_lse, cfg, 0)
