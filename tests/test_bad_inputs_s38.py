"""Bad inputs an audit found accepted or answered with a foreign error (a
ZeroDivisionError, an AttributeError, torch's own RuntimeError): each is a
TypeError (wrong kind of object or dtype) or a ValueError (shape, value)
naming the argument and the rule it broke.  CPU only, tiny shapes."""
import math

import pytest
import torch

import seqfuse.pytorch as te
from seqfuse import ops as o
from seqfuse.modules import CrossEntropyLoss, cross_entropy, linear_cross_entropy, parallel_cross_entropy

R = torch.randn


# ---- 1. gemm's empty products get the non-empty path's checks ----------------------------------------------------

def test_gemm_empty_inner_dims_differ():
    with pytest.raises(ValueError, match="inner dimensions differ"):
        o.gemm(R(8, 0), R(3, 4))
    with pytest.raises(ValueError, match="inner dimensions differ"):
        o.gemm(R(0, 5), R(3, 4))


def test_gemm_empty_mixed_dtypes():
    with pytest.raises(TypeError, match="arguments 'a' .* and 'b' .* must have the same dtype"):
        o.gemm(R(0, 5), R(5, 4).half())


def test_gemm_empty_b_dtype():
    with pytest.raises(TypeError, match="argument 'b' must have dtype"):
        o.gemm(R(0, 5), torch.zeros(5, 4, dtype=torch.int32))


def test_gemm_empty_out_dtype():
    with pytest.raises(TypeError, match="argument 'out' must have dtype"):
        o.gemm(R(8, 0), R(0, 4), out=torch.zeros(8, 4, dtype=torch.int64))


def test_gemm_empty_out_shape():
    with pytest.raises(ValueError, match=r"argument 'out' must have shape \[m, n\] = \[8, 4\]"):
        o.gemm(R(8, 0), R(0, 4), out=torch.zeros(8, 5))


def test_gemm_empty_dgelu_needs_aux():
    with pytest.raises(ValueError, match="epilogue 'dgelu' needs argument 'aux'"):
        o.gemm(R(8, 0), R(0, 4), epilogue="dgelu")


def test_gemm_empty_bias_length():
    with pytest.raises(ValueError, match="argument 'bias' must be 1-D of length 4"):
        o.gemm(R(8, 0), R(0, 4), bias=R(7))


def test_gemm_empty_bias_dtype():
    with pytest.raises(TypeError, match="argument 'bias' must have dtype float32"):
        o.gemm(R(8, 0), R(0, 4), bias=R(4).half())


def test_gemm_empty_aux_shape():
    with pytest.raises(ValueError, match=r"argument 'aux' must have shape \[m, n\] = \[8, 4\]"):
        o.gemm(R(8, 0), R(0, 4), epilogue="dgelu", aux=R(8, 3))


def test_gemm_empty_scales_on_float_operands():
    with pytest.raises(ValueError, match="scale inverses and scaling modes apply to float8 operands only"):
        o.gemm(R(8, 0), R(0, 4), a_scale_inv=torch.ones(1), b_scale_inv=torch.ones(1))


def test_gemm_empty_valid_products_still_work():
    out = o.gemm(R(8, 0), R(0, 4), bias=torch.arange(4.0))
    assert torch.equal(out, torch.arange(4.0).expand(8, 4))
    assert o.gemm(R(0, 5), R(5, 4)).shape == (0, 4)
    out, db = o.gemm(R(0, 3), R(0, 4), transa=True, epilogue="bgrad")
    assert out.shape == (3, 4) and torch.equal(db, torch.zeros(3))


# ---- 2. ignore_index / label_smoothing / chunk_size are parsed strictly -----------------------------------------

def _ce_inputs():
    torch.manual_seed(0)
    return R(4, 6), torch.tensor([1, 2, 1, 5])


def test_cross_entropy_fractional_ignore_index():
    lg, lb = _ce_inputs()
    with pytest.raises(ValueError, match="argument 'ignore_index' must be a whole number"):
        cross_entropy(lg, lb, ignore_index=1.5)
    with pytest.raises(ValueError, match="argument 'ignore_index' must be a whole number"):
        CrossEntropyLoss(ignore_index=1.9)(lg, lb)
    # a whole float is the int it spells
    assert torch.equal(cross_entropy(lg, lb, ignore_index=1.0), cross_entropy(lg, lb, ignore_index=1))


def test_cross_entropy_non_number_args():
    lg, lb = _ce_inputs()
    with pytest.raises(TypeError, match="argument 'ignore_index' must be an integer"):
        cross_entropy(lg, lb, ignore_index="a")
    with pytest.raises(TypeError, match="argument 'label_smoothing' must be a real number"):
        cross_entropy(lg, lb, label_smoothing="a")


def test_linear_cross_entropy_bad_scalars():
    h, w, lb = R(4, 8), R(6, 8), torch.tensor([1, 2, 1, 5])
    with pytest.raises(ValueError, match="argument 'ignore_index' must be a whole number"):
        linear_cross_entropy(h, w, lb, ignore_index=1.5)
    with pytest.raises(TypeError, match="argument 'label_smoothing' must be a real number"):
        linear_cross_entropy(h, w, lb, label_smoothing="a")
    with pytest.raises(ValueError, match="argument 'chunk_size' must be a whole number"):
        linear_cross_entropy(h, w, lb, chunk_size=2.5)
    with pytest.raises(TypeError, match="argument 'chunk_size' must be an integer"):
        linear_cross_entropy(h, w, lb, chunk_size="4")
    with pytest.raises(ValueError, match="argument 'chunk_size' must be"):
        linear_cross_entropy(h, w, lb, chunk_size=0)


def test_parallel_cross_entropy_fractional_ignore_idx():
    with pytest.raises(ValueError, match="argument 'ignore_idx' must be a whole number"):
        parallel_cross_entropy(R(2, 3, 10), torch.randint(0, 10, (6,)), ignore_idx=1.5)
    with pytest.raises(TypeError, match="argument 'label_smoothing' must be a real number"):
        parallel_cross_entropy(R(2, 3, 10), torch.randint(0, 10, (6,)), label_smoothing="a")


# ---- 3. GroupedLinear m_splits -----------------------------------------------------------------------------------

def test_grouped_linear_fractional_m_splits():
    m = te.GroupedLinear(3, 16, 8, device="cpu")
    with pytest.raises(ValueError, match="m_splits.*whole number"):
        m(R(10, 16), [3.5, 0, 7.4])
    assert m(R(10, 16), [3.0, 0, 7.0]).shape == (10, 8)  # whole floats are the ints they spell


def test_grouped_linear_shrunk_m_splits_storage():
    m = te.GroupedLinear(3, 16, 8, device="cpu")
    s = torch.tensor([3, 0, 7])
    s.untyped_storage().resize_(8)
    with pytest.raises(ValueError, match="m_splits.*storage"):
        m(R(10, 16), s)


# ---- 4. fp8_scale_update's fp8_max -------------------------------------------------------------------------------

def _scale_state(n=3):
    return torch.rand(4, n) + 0.5, torch.ones(n), torch.ones(n)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_fp8_scale_update_bad_fp8_max_tensor(bad):
    h, s, si = _scale_state()
    fm = torch.tensor([448.0, bad, 448.0])
    with pytest.raises(ValueError, match="argument 'fp8_max' must .*positive finite"):
        o.fp8_scale_update(h, s, si, fm)
    assert torch.equal(s, torch.ones(3))  # nothing written


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, -math.inf])
def test_fp8_scale_update_bad_fp8_max_any_cpu_vector(bad):
    """The C entry reads a CPU fp8_max of any producer (a numpy array here; torch tensors in the test
    above) and names the element; scale and scale_inv over each other are refused as overlapping outputs."""
    import numpy as np
    h, s, si = _scale_state()
    fm = np.array([448.0, 448.0, bad], dtype=np.float32)
    with pytest.raises(ValueError, match=r"fp8_scale_update: argument 'fp8_max' must hold positive finite "
                                         r"numbers, got .* at element 2"):
        o.fp8_scale_update(h, s, si, fm)
    assert torch.equal(s, torch.ones(3))
    with pytest.raises(ValueError, match="fp8_scale_update: outputs 'scale' and 'scale_inv' share memory"):
        o.fp8_scale_update(h, s, s, torch.full((3,), 448.0))


@pytest.mark.parametrize("bad", [0, -448.0, math.nan, math.inf])
def test_fp8_scale_update_bad_fp8_max_number(bad):
    h, s, si = _scale_state()
    with pytest.raises(ValueError, match="argument 'fp8_max' must be a positive finite number"):
        o.fp8_scale_update(h, s, si, bad)


def test_fp8_scale_update_fp8_max_number_and_tensor_agree():
    h, s, si = _scale_state()
    h2, s2, si2 = h.clone(), s.clone(), si.clone()
    o.fp8_scale_update(h, s, si, 448.0)
    o.fp8_scale_update(h2, s2, si2, torch.full((3,), 448.0))
    assert torch.equal(s, s2) and torch.equal(si, si2) and torch.equal(h, h2)
    with pytest.raises(TypeError, match="argument 'fp8_max' must be a real number"):
        o.fp8_scale_update(h, s, si, "448")


# ---- 5. clear errors instead of foreign ones ---------------------------------------------------------------------

def test_attention_thd_cu_seqlens_list():
    q = R(10, 2, 8)
    with pytest.raises(TypeError, match="cu_seqlens_q"):
        o.attention(q, q, q, qkv_format="thd", cu_seqlens_q=[0, 4, 10], cu_seqlens_kv=[0, 4, 10])
    with pytest.raises(TypeError, match="cu_seqlens_q"):
        te.DotProductAttention(2, 8, qkv_format="thd")(q, q, q, cu_seqlens_q=[0, 4, 10],
                                                         cu_seqlens_kv=[0, 4, 10])


def test_attention_thd_cu_seqlens_2d():
    q = R(10, 2, 8)
    cu = torch.tensor([[0, 4, 10]], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_q.*1-D"):
        o.attention(q, q, q, qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)


def test_attention_thd_cu_seqlens_meta():
    q = R(10, 2, 8)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        o.attention(q, q, q, qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)


def test_attention_head_dim_zero():
    x = R(2, 8, 4, 0)
    with pytest.raises(ValueError, match="head dim"):
        o.attention(x, x, x)


def test_dot_product_attention_bad_sizes():
    with pytest.raises(ValueError, match="num_attention_heads.*>= 1"):
        te.DotProductAttention(0, 16)
    with pytest.raises(ValueError, match="kv_channels.*>= 1"):
        te.DotProductAttention(4, 0)
    with pytest.raises(ValueError, match="num_attention_heads.*>= 1"):
        te.TransformerLayer(32, 64, 0)
    with pytest.raises(ValueError, match="num_gqa_groups.*>= 1"):
        te.DotProductAttention(4, 16, num_gqa_groups=-2)


def test_dot_product_attention_mask_type_none():
    q = R(2, 8, 4, 16)
    with pytest.raises(TypeError, match="attn_mask_type.*no_mask"):
        te.DotProductAttention(4, 16, attn_mask_type=None, qkv_format="bshd")(q, q, q)


def test_dropout_backward_bad_dbias():
    with pytest.raises(ValueError, match="dbias_dtype.*at least 1 dimension|dy.*at least 1 dimension"):
        o.dropout_backward(torch.tensor(1.0), 0.5, 1, dbias_dtype=torch.float32)
    with pytest.raises(TypeError, match="argument 'dbias_dtype'"):
        o.dropout_backward(R(4, 8), 0.5, 1, dbias_dtype="float32")


def test_parallel_cross_entropy_bad_target():
    with pytest.raises(ValueError, match="target"):
        parallel_cross_entropy(R(2, 3, 10), torch.randint(0, 10, (5,)))
    with pytest.raises(TypeError, match="target"):
        parallel_cross_entropy(R(2, 3, 10), [1, 2, 3, 4, 5, 6])


def test_layernorm_module_input_width():
    with pytest.raises(ValueError, match="last dimension must be .*16"):
        te.LayerNorm(16, device="cpu")(R(4, 15))
    with pytest.raises(ValueError, match="last dimension must be .*16"):
        te.RMSNorm(16, device="cpu")(R(4, 15))


def test_layernorm_module_bad_args():
    with pytest.raises(TypeError, match="eps"):
        te.LayerNorm(16, eps="x")
    with pytest.raises(ValueError, match="normalized_shape.*whole number"):
        te.LayerNorm(16.7)
    with pytest.raises(ValueError, match="normalized_shape.*whole number"):
        te.LayerNorm([16.7])


def test_module_sizes_must_be_whole():
    with pytest.raises(ValueError, match="in_features.*whole number"):
        te.Linear(16.9, 8, device="cpu")
    with pytest.raises(ValueError, match="num_attention_heads.*whole number"):
        te.DotProductAttention(4.5, 16)
    with pytest.raises(ValueError, match="kv_channels.*whole number"):
        te.DotProductAttention(4, 16.2)
    assert te.Linear(16.0, 8, device="cpu").in_features == 16


def test_linear_params_dtype_must_be_floating():
    with pytest.raises(TypeError, match="params_dtype"):
        te.Linear(16, 8, params_dtype=torch.int32, device="cpu")


def test_linear_family_takes_strided_and_expanded_inputs_and_refuses_integers():
    """Linear and GroupedLinear accept any input layout torch's modules accept
    (a strided, expanded or transposed view: copied where the GEMM cannot read
    it) with the contiguous input's answer, and refuse an integer input
    naming the rule (torch.nn.Linear raises too; it used to come out float)."""
    import seqfuse.pytorch as te
    from seqfuse.modules import GroupedLinear

    m = te.Linear(16, 8, device="cpu")
    for x in (torch.randn(4, 32)[:, ::2], torch.randn(1, 16).expand(4, 16), torch.randn(16, 4).t()):
        torch.testing.assert_close(m(x), m(x.contiguous()), rtol=0, atol=0)
    with pytest.raises(TypeError, match="Linear: input must be a floating-point tensor"):
        m(torch.ones(4, 16, dtype=torch.int64))
    g = GroupedLinear(2, 16, 8, device="cpu")
    e = torch.randn(1, 16).expand(6, 16)
    torch.testing.assert_close(g(e, [2, 4]), g(e.contiguous(), [2, 4]), rtol=0, atol=0)


def test_linear_cross_entropy_any_hidden_layout():
    """A transposed, expanded or strided ``hidden`` that requires grad gives the
    contiguous tensor's loss and gradient (its backward wrote the gradient
    into a buffer of hidden's layout and the GEMM refused it)."""
    w = torch.randn(10, 32, requires_grad=True)
    labels = torch.randint(0, 10, (6,))
    for h0 in (torch.randn(32, 6).t(), torch.randn(1, 32).expand(6, 32), torch.randn(6, 64)[:, ::2]):
        h = h0.detach().requires_grad_(True)
        hc = h0.detach().contiguous().requires_grad_(True)
        loss, want = linear_cross_entropy(h, w, labels), linear_cross_entropy(hc, w, labels)
        loss.backward()
        want.backward()
        torch.testing.assert_close(loss, want, rtol=0, atol=0)
        torch.testing.assert_close(h.grad, hc.grad, rtol=0, atol=0)
