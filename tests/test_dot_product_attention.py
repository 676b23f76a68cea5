"""DotProductAttention (TE's names and signature) on the CPU against the
float64 reference: layouts, TE-style boolean padding masks, GQA, output
shape [.., h*d], and the features it refuses.  test_attn_cuda.py runs the
module on the GPU."""
import pytest
import torch

import seqfuse
import seqfuse.pytorch as te
from attn_ref import cu_seqlens, pack, reference
from helpers import assert_close_rel


def test_exported_under_te_name():
    assert te.DotProductAttention is not None


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("mask", ["no_mask", "causal"])
def test_module_matches_reference(fmt, mask, seed):
    b, s, h, hk, d = 2, 10, 4, 2, 16
    shape_q = (s, b, h, d) if fmt == "sbhd" else (b, s, h, d)
    shape_k = (s, b, hk, d) if fmt == "sbhd" else (b, s, hk, d)
    q = torch.randn(shape_q, requires_grad=True)
    k = torch.randn(shape_k, requires_grad=True)
    v = torch.randn(shape_k, requires_grad=True)
    attn = te.DotProductAttention(h, d, num_gqa_groups=hk, qkv_format=fmt, attn_mask_type=mask)
    out = attn(q, k, v)
    assert out.shape == shape_q[:2] + (h * d,)
    ref = reference(q.detach(), k.detach(), v.detach(), qkv_format=fmt, attn_mask_type=mask)
    assert_close_rel(out, ref.reshape(out.shape), torch.float32)
    out.sum().backward()
    assert q.grad is not None and k.grad.shape == k.shape


def test_boolean_padding_mask_and_thd_agree(seed):
    b, s, h, d = 3, 9, 2, 16
    lengths = [9, 4, 6]
    q, k, v = (torch.randn(b, s, h, d) for _ in range(3))
    mask = torch.ones(b, 1, 1, s, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, ..., :n] = False  # TE: True = masked out
    attn = te.DotProductAttention(h, d, qkv_format="bshd", attn_mask_type="padding_causal")
    out = attn(q, k, v, attention_mask=mask)
    ref = reference(q, k, v, qkv_format="bshd", attn_mask_type="padding_causal", seqlens_q=lengths,
                    seqlens_kv=lengths)
    assert_close_rel(out, ref.reshape(out.shape), torch.float32)
    thd = te.DotProductAttention(h, d, qkv_format="thd", attn_mask_type="padding_causal")
    cu = cu_seqlens(lengths)
    out_t = thd(pack(q, lengths), pack(k, lengths), pack(v, lengths), cu_seqlens_q=cu, cu_seqlens_kv=cu,
                max_seqlen_q=9, max_seqlen_kv=9)
    assert out_t.shape == (sum(lengths), h * d)
    assert torch.equal(out_t, pack(out.view(b, s, h, d), lengths).reshape(-1, h * d))


def test_refusals():
    q = torch.randn(4, 1, 2, 8)
    attn = te.DotProductAttention(2, 8)
    with pytest.raises(NotImplementedError, match="attention biases"):
        attn(q, q, q, core_attention_bias_type="post_scale_bias", core_attention_bias=torch.zeros(1))
    with pytest.raises(ValueError, match="query_layer has 2 heads of dim 8; the module was built for 4 heads of dim 8"):
        te.DotProductAttention(4, 8)(q, q, q)
    with pytest.raises(ValueError, match="needs an attention_mask or cu_seqlens"):
        te.DotProductAttention(2, 8, attn_mask_type="padding")(q, q, q)
    with pytest.raises(ValueError, match="must be a multiple of num_gqa_groups"):
        te.DotProductAttention(4, 8, num_gqa_groups=3)


@pytest.mark.parametrize("qkv_format", ["sbhd", "bshd", "thd"])
def test_attention_dropout_training_only(qkv_format):
    """attention_dropout acts in training mode only, in every layout: the
    training output equals the op with the same (seed, offset) drawn from
    torch's generator, eval equals no dropout, and gradients flow."""
    torch.manual_seed(0)
    h, d, lengths = 2, 8, [6, 9]
    attn = te.DotProductAttention(h, d, attention_dropout=0.3, qkv_format=qkv_format, attn_mask_type="causal")
    if qkv_format == "thd":
        shape, kw = (sum(lengths), h, d), dict(cu_seqlens_q=cu_seqlens(lengths), cu_seqlens_kv=cu_seqlens(lengths),
                                               max_seqlen_q=9, max_seqlen_kv=9)
    else:
        shape, kw = ((9, 2, h, d) if qkv_format == "sbhd" else (2, 9, h, d)), {}
    q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
    torch.manual_seed(7)
    out = attn(q, k, v, **kw)
    torch.manual_seed(7)
    state = seqfuse.ops.attn.dropout_rng_state(q, qkv_format, kw.get("cu_seqlens_q"))
    op_kw = {key: val for key, val in kw.items()}
    want = seqfuse.ops.attention(q, k, v, qkv_format=qkv_format, attn_mask_type="causal", dropout_p=0.3,
                                 rng_state=state, **op_kw)
    assert torch.equal(out, want.reshape(out.shape))
    plain = seqfuse.ops.attention(q, k, v, qkv_format=qkv_format, attn_mask_type="causal", **op_kw)
    assert not torch.equal(out, plain.reshape(out.shape))
    out.sum().backward()
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in (q, k, v))
    attn.eval()
    assert torch.equal(attn(q, k, v, **kw), plain.reshape(out.shape))


def test_transformer_layer_default_attention_dropout_trains():
    """TransformerLayer defaults to attention_dropout=0.1 as TE does: a
    training step with default arguments runs."""
    torch.manual_seed(0)
    layer = te.TransformerLayer(32, 64, 4, params_dtype=torch.float32, fuse_qkv_params=True)
    assert layer.training
    x = torch.randn(5, 2, 32, requires_grad=True)
    layer(x).sum().backward()
    assert torch.isfinite(x.grad).all()
