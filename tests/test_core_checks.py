"""The shared C argument checks of csrc/core/tensor.c, seen through the entries
that use them: sf_check_like (an argument shaped like a reference: its dtype,
contiguous, its shape, its device, writable when an output) through the
dropout entries, and sf_check_fp8_scaling (the float32 one-element scale,
amax and scale_inv of an FP8 output) through act_forward.  Each case breaks
one rule and expects the exception type and message that name the argument
and the rule; one case breaks two rules to pin the order of the checks."""
import pytest
import torch

from seqfuse import _C

X = torch.randn(4, 8)
E4M3 = torch.float8_e4m3fn


def _bias_dropout_add(residual=X, out=None):
    out = torch.empty(4, 8) if out is None else out
    return _C.bias_dropout_add(X, None, residual, 0.1, 0, 0, out)


def _act_fp8(scale=None, amax=None, scale_inv=None):
    scale = torch.ones(1) if scale is None else scale
    return _C.act_forward(0, X, torch.empty(4, 8, dtype=E4M3), scale, amax, scale_inv)


CASES = [
    # sf_check_like, an input (residual) and an output (out) against x
    ("residual_dtype", lambda: _bias_dropout_add(residual=X.half()), TypeError,
     "bias_dropout_add: argument 'residual' must have dtype float32, got float16"),
    ("residual_shape", lambda: _bias_dropout_add(residual=X[:2]), ValueError,
     "bias_dropout_add: arguments 'x' and 'residual' must have the same shape"),
    ("out_dtype", lambda: _bias_dropout_add(out=torch.empty(4, 8, dtype=torch.float16)), TypeError,
     "bias_dropout_add: argument 'out' must have dtype float32, got float16"),
    ("out_contiguous", lambda: _bias_dropout_add(out=torch.empty(8, 4).t()), ValueError,
     "bias_dropout_add: argument 'out' must be contiguous"),
    # dtype is checked before shape
    ("out_dtype_before_shape", lambda: _bias_dropout_add(out=torch.empty(2, 8, dtype=torch.float16)),
     TypeError, "bias_dropout_add: argument 'out' must have dtype float32, got float16"),
    # sf_check_fp8_scaling: each of the three vectors, dtype and element count
    ("scale_numel", lambda: _act_fp8(scale=torch.ones(2)), ValueError,
     "act_forward: argument 'scale' must have 1 element\\(s\\), got 2"),
    ("amax_dtype", lambda: _act_fp8(amax=torch.zeros(1, dtype=torch.float16)), TypeError,
     "act_forward: argument 'amax' must have dtype float32, got float16"),
    ("scale_inv_numel", lambda: _act_fp8(amax=torch.zeros(1), scale_inv=torch.zeros(3)), ValueError,
     "act_forward: argument 'scale_inv' must have 1 element\\(s\\), got 3"),
]


@pytest.mark.parametrize("name,call,exc,message", CASES, ids=[c[0] for c in CASES])
def test_shared_check_names_argument_and_rule(name, call, exc, message):
    with pytest.raises(exc, match=message):
        call()


def test_shared_checks_pass_good_arguments():
    out = torch.empty(4, 8)
    _C.bias_dropout_add(X, None, X, 0.0, 0, 0, out)
    torch.testing.assert_close(out, X + X)
    y = torch.empty(4, 8, dtype=E4M3)
    amax, scale_inv = torch.zeros(1), torch.zeros(1)
    _C.act_forward(3, X, y, torch.ones(1), amax, scale_inv)  # 3: relu
    assert amax.item() == X.clamp(min=0).abs().max().item()
    assert scale_inv.item() == 1.0
