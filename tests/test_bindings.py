"""The declared bindings of seqfuse._C (csrc/python/py_call.h): every op
binding is one argument table driven by one parser, so keywords, defaults,
the generated signatures and the argument errors behave the same for all of
them.  CPU only, milliseconds."""
import inspect

import pytest
import torch

from seqfuse import _C


def test_keywords_match_positional():
    x = torch.randn(5)
    out_pos, out_kw = torch.empty(()), torch.empty(())
    _C.amax(x, out_pos)
    _C.amax(out=out_kw, x=x)
    assert out_pos.item() == out_kw.item() == x.abs().max().item()

    x = torch.randn(3, 8)
    gamma = torch.rand(8) + 0.5
    y_pos, y_kw = torch.empty_like(x), torch.empty_like(x)
    _C.rmsnorm_forward(x, gamma, 1e-5, False, y_pos, None, None, None, None)
    _C.rmsnorm_forward(x, gamma, eps=1e-5, zero_centered_gamma=False, y=y_kw, rstd=None, scale=None,
                   amax=None, scale_inv=None, stream=None)
    assert torch.equal(y_pos, y_kw)


def test_argument_errors_name_the_binding_and_the_argument():
    x, out = torch.randn(3), torch.empty(())
    with pytest.raises(TypeError, match=r"amax\(\) takes from 2 to 3 positional arguments \(4 given\)"):
        _C.amax(x, out, None, None)
    with pytest.raises(TypeError, match=r"amax\(\) got an unexpected keyword argument 'y'"):
        _C.amax(x, out, y=1)
    with pytest.raises(TypeError, match=r"amax\(\) got multiple values for argument 'x'"):
        _C.amax(x, out, x=x)
    with pytest.raises(TypeError, match="amax: argument 'x' is missing"):
        _C.amax(out=out)
    with pytest.raises(TypeError, match="rmsnorm_forward: argument 'eps' must be a float, got str"):
        _C.rmsnorm_forward(x, x, eps="1", zero_centered_gamma=False, y=x, rstd=None, scale=None,
                       amax=None, scale_inv=None)
    with pytest.raises(ValueError, match="fp8_compute_scale: argument 'margin' must fit in a C int"):
        _C.fp8_compute_scale(torch.ones(1), torch.ones(1), torch.ones(1), 448.0, 2**40)


def test_signatures_come_from_the_tables():
    assert list(inspect.signature(_C.amax).parameters) == ["x", "out", "stream"]
    assert inspect.signature(_C.amax).parameters["stream"].default is None
    rowcol = inspect.signature(_C.quantize_block_fp8_rowcol).parameters
    assert list(rowcol)[-3:] == ["stream", "col_sums", "dbias"] and rowcol["col_sums"].default is None
    assert rowcol["dbias"].default is None
    # outputs added after an entry's first form follow its stream, so positional calls keep their meaning
    for name, added in (("cast_fp8_dbias", ["dbias"]), ("cast_fp8_current", ["col_sums", "dbias"])):
        params = inspect.signature(getattr(_C, name)).parameters
        assert list(params)[-len(added) - 1:] == ["stream", *added], name
        assert all(params[a].default is None for a in added), name
    # the dequantize bindings name their first tensor as the Python ops do
    for name in ("dequantize_fp8", "dequantize_block_fp8", "dequantize_mxfp8", "dequantize_nvfp4"):
        assert next(iter(inspect.signature(getattr(_C, name)).parameters)) == "data", name


def test_every_op_binding_takes_keywords_and_a_stream():
    """Every function with a generated signature accepts its arguments by
    name; every one that imports tensors takes a stream."""
    declared = [f for f in vars(_C).values() if getattr(f, "__text_signature__", None)]
    assert len(declared) >= 45
    for f in declared:
        params = inspect.signature(f).parameters
        assert all(p.kind == p.POSITIONAL_OR_KEYWORD for p in params.values()), f.__name__
        if not f.__name__.startswith("attn_set_"):
            assert "stream" in params, f.__name__


def test_list_item_refused_once_keeps_the_first_refusal():
    """A list's item is imported under the list's bare name and, where that fails, again under its
    indexed name for the message; a producer that refuses the first time and not the second still fails
    the call, with its first refusal (the retry happened: two __dlpack__ calls), and one that never
    refuses passes."""
    np = pytest.importorskip("numpy")

    class Flaky:
        def __init__(self, refusals):
            self.calls, self.refusals, self.a = 0, refusals, np.ones(4, dtype=np.float32)

        def __dlpack_device__(self):
            return self.a.__dlpack_device__()

        def __dlpack__(self, **kw):
            self.calls += 1
            if self.calls <= self.refusals:
                raise RuntimeError("refused the first time")
            return self.a.__dlpack__(**kw)

    out = torch.zeros(())
    flaky = Flaky(1)
    with pytest.raises(RuntimeError, match="refused the first time"):
        _C.multi_tensor_l2norm([torch.ones(4), flaky], out, out, None)
    assert flaky.calls == 2
    _C.multi_tensor_l2norm([torch.ones(4), Flaky(0)], out, out, None)
    assert out.item() == pytest.approx(8 ** 0.5)
