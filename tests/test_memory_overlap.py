"""Outputs that share memory with another argument are refused by the C entries
(sf_check_apart): a partial overlap would give wrong numbers, since the kernels
read their inputs while they write their outputs in no promised order.  The
exact in-place calls the kernels support stay allowed (an element-wise
activation, RoPE, the cross-entropy gradient over the logits, a norm
backward's dx over dres) and give the out-of-place answer."""
import pytest
import torch

import seqfuse.ops as o

R = torch.randn


def _refused(match, fn):
    with pytest.raises(ValueError, match=match):
        fn()


def test_activation_partial_overlap_refused_exact_in_place_allowed():
    x = R(64)
    _refused(r"act_forward: output 'y' shares memory with input 'x'.*in-place call",
             lambda: o.act_forward(x[:32], "gelu", out=x[1:33]))
    y = R(40)
    want = o.act_forward(y.clone(), "gelu")
    o.act_forward(y, "gelu", out=y)
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    g = R(8 * 16)  # a gated activation's output is half its input: never the same view
    _refused("output 'y' shares memory with input 'x'",
             lambda: o.act_forward(g.view(8, 16), "swiglu", out=g[:64].view(8, 8)))
    dy, xx = R(32), R(32)
    _refused("act_backward: output 'dx' shares memory with input 'dy'",
             lambda: o.act_backward(dy, xx, "gelu", out=dy))


def test_rope_partial_overlap_refused_exact_in_place_allowed():
    freqs = R(8, 1, 1, 16)
    b = R(8 * 2 * 3 * 16 + 16)
    _refused(r"rope: output 'out' shares memory with input 't'",
             lambda: o.rope_forward(b[:768].view(8, 2, 3, 16), freqs, out=b[16:].view(8, 2, 3, 16)))
    _refused("output 'out' shares memory with input 'freqs'",
             lambda: o.rope_forward(R(8, 1, 1, 16), freqs, out=freqs))
    t = R(8, 2, 3, 16)
    want = o.rope_forward(t.clone(), freqs)
    o.rope_forward(t, freqs, out=t)
    torch.testing.assert_close(t, want, rtol=0, atol=0)


def test_cross_entropy_outputs_apart():
    b = R(70)
    logits, labels = b[:60].view(6, 10), torch.randint(0, 10, (6,))
    _, lse = o.cross_entropy_forward(logits, labels)
    _refused("cross_entropy_backward: output 'dlogits' shares memory with input 'logits'",
             lambda: o.cross_entropy_backward(logits, labels, lse, 1.0, out=b[10:].view(6, 10)))
    want = o.cross_entropy_backward(logits.clone(), labels, lse, 1.0)
    o.cross_entropy_backward(logits, labels, lse, 1.0, out=logits)
    torch.testing.assert_close(logits, want, rtol=0, atol=0)


def test_norm_outputs_apart():
    buf = R(4, 16)
    _refused("layernorm_forward: output 'y' shares memory with input 'gamma'",
             lambda: o.layernorm_forward(R(4, 16), buf[0], None, out=buf))
    x = R(4, 16)
    _refused("output 'y' shares memory with input 'x'", lambda: o.rmsnorm_forward(x, torch.ones(16), out=x))


def test_attention_outputs_apart():
    q, k, v = R(2, 8, 4, 16), R(2, 8, 4, 16), R(2, 8, 4, 16)
    for name, t in (("v", v), ("k", k), ("q", q)):
        _refused(f"attention_forward: output 'out' shares memory with input '{name}'",
                 lambda t=t: o.attention_forward(q, k, v, out=t))
    out, lse = o.attention_forward(q, k, v)
    both = torch.empty(2, 8, 4, 16)
    _refused("attention_backward: outputs 'dq' and 'dk' share memory",
             lambda: o.attention_backward(R(2, 8, 4, 16), q, k, v, out, lse, dq=both, dk=both))
    dout = R(2, 8, 4, 16)
    _refused("output 'dv' shares memory with input 'dout'",
             lambda: o.attention_backward(dout, q, k, v, out, lse, dv=dout))


def test_fp8_casts_outputs_apart():
    fp8 = torch.float8_e4m3fn
    buf = torch.empty(16, 16, dtype=fp8)
    _refused("outputs 'out' and 'out_t' share memory",
             lambda: o.cast_transpose_fp8(R(16, 16), torch.ones(1), None, fp8, out=buf, out_t=buf))
    d = R(16, 16).to(fp8)
    _refused("transpose_fp8: output 'out_t' shares memory with input 'data'", lambda: o.transpose_fp8(d, out=d))
    s = torch.ones(1)
    _refused("output 'amax' shares memory with input 'scale'", lambda: o.cast_fp8(R(16, 16), s, s, fp8))


def test_adamw_moments_apart():
    m, p, g = torch.zeros(10), R(10), R(10)
    _refused(r"multi_tensor_adamw: outputs 'exp_avg\[0\]' and 'exp_avg_sq\[0\]' share memory",
             lambda: o.multi_tensor_adamw([p], [g], [m], [m], None, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1))
    _refused(r"output 'params\[0\]' shares memory with input 'grads\[0\]'",
             lambda: o.multi_tensor_adamw([p], [p], [torch.zeros(10)], [torch.zeros(10)], None, 1e-3, 0.9,
                                          0.999, 1e-8, 0.0, 1))


def test_interleaved_views_of_one_buffer_are_apart():
    """dq, dk, dv written into one packed [b, s, 3, h, d] gradient (views whose
    byte spans meet but whose elements interleave) are accepted and equal the
    separate tensors' answer; views one element apart are not."""
    q, k, v = R(2, 8, 4, 16), R(2, 8, 4, 16), R(2, 8, 4, 16)
    out, lse = o.attention_forward(q, k, v)
    dout = R(2, 8, 4, 16)
    want = o.attention_backward(dout, q, k, v, out, lse)
    packed = torch.empty(2, 8, 3, 4, 16)
    got = o.attention_backward(dout, q, k, v, out, lse, dq=packed[:, :, 0], dk=packed[:, :, 1], dv=packed[:, :, 2])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    flat = torch.empty(2 * 8 * 4 * 16 + 1)
    shifted = (flat[:-1].view(2, 8, 4, 16), flat[1:].view(2, 8, 4, 16))
    _refused("outputs 'dq' and 'dk' share memory",
             lambda: o.attention_backward(dout, q, k, v, out, lse, dq=shifted[0], dk=shifted[1]))


def test_grouped_query_views_of_one_buffer_are_apart():
    """Under grouped-query attention dq [t, 4, d], dk and dv [t, 2, d] sliced out of one packed
    [t, 8, d] gradient have unequal shapes, yet no element in common: accepted, and equal to the
    separate tensors' answer; dk one element into dq's heads is refused."""
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    q, k, v = R(12, 4, 16), R(12, 2, 16), R(12, 2, 16)
    kw = dict(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=7, max_seqlen_kv=7)
    out, lse = o.attention_forward(q, k, v, **kw)
    dout = R(12, 4, 16)
    want = o.attention_backward(dout, q, k, v, out, lse, **kw)
    packed = torch.empty(12, 8, 16)
    got = o.attention_backward(dout, q, k, v, out, lse, dq=packed[:, :4], dk=packed[:, 4:6], dv=packed[:, 6:],
                               **kw)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    flat = packed.view(-1)
    dk_bad = flat[4 * 16 - 1:].as_strided((12, 2, 16), (128, 16, 1))
    _refused("outputs 'dq' and 'dk' share memory",
             lambda: o.attention_backward(dout, q, k, v, out, lse, dq=packed[:, :4], dk=dk_bad, dv=packed[:, 6:],
                                          **kw))


@pytest.mark.parametrize("shift,apart", [(64, True), (128, True), (1, False), (63, False), (129, False)])
def test_interleaved_views_apart_only_inside_the_gap(shift, apart):
    """Two [2, 8, 4, 16] views of one buffer with the packed layout's strides
    (dense chunks of 64 elements every 192): apart exactly when the second
    starts at least a chunk past the first and ends before the next chunk."""
    q, k, v = R(2, 8, 4, 16), R(2, 8, 4, 16), R(2, 8, 4, 16)
    out, lse = o.attention_forward(q, k, v)
    dout = R(2, 8, 4, 16)
    flat = torch.zeros(2 * 8 * 192 + 256)
    stride = (8 * 192, 192, 16, 1)
    dq = flat.as_strided((2, 8, 4, 16), stride, 0)
    dk = flat.as_strided((2, 8, 4, 16), stride, shift)
    call = lambda: o.attention_backward(dout, q, k, v, out, lse, dq=dq, dk=dk)  # noqa: E731
    if apart:
        got = call()
        want = o.attention_backward(dout, q, k, v, out, lse)
        for g, w in zip(got[:2], want[:2]):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
    else:
        _refused("outputs 'dq' and 'dk' share memory", call)


def test_grouped_fp8_casts_outputs_apart():
    """The grouped FP8 casts (the C entries seqfuse.ops.moe calls with outputs
    it makes) refuse an output over x or over another output, and scaling
    vectors that share elements; the interleaved vectors of one scaling
    state (every third column) stay apart."""
    from seqfuse import _C

    fp8 = torch.float8_e4m3fn
    splits = torch.tensor([16, 16], dtype=torch.int64)
    x = R(32, 16)
    chunk = torch.ones(6)  # one state's roles: scale at columns 0, 3; scale_inv at 1, 4; amax at 2, 5
    scale, scale_inv, amax = chunk[0::3], chunk[1::3], torch.zeros(6)[2::3]
    out, out_t = torch.empty(32, 16, dtype=fp8), torch.empty(16, 32, dtype=fp8)
    _C.cast_fp8_grouped(x, splits, 16, scale, amax, out, out_t, scale_inv, 0, 0, None)  # apart: runs
    buf = torch.empty(32 * 16, dtype=fp8)
    _refused("cast_fp8_grouped: outputs 'out' and 'out_t' share memory",
             lambda: _C.cast_fp8_grouped(x, splits, 16, scale, amax, buf.view(32, 16), buf.view(16, 32),
                                         scale_inv, 0, 0, None))
    _refused("cast_fp8_grouped: output 'scale_inv' shares memory with input 'scale'",
             lambda: _C.cast_fp8_grouped(x, splits, 16, scale, amax, out, out_t, scale, 0, 0, None))
