"""The ops' ``out=`` tensors follow torch's out= rules.

seqfuse.ops write through DLPack, outside autograd.  A tensor that requires
grad is refused as ``out`` while grad mode is on (torch's out= functions
refuse it: the write would replace values autograd goes on using), taken
under torch.no_grad() (as optimizers write parameters), and every given
``out`` has its version counter bumped, so that autograd raises at backward
when a tensor it saved was overwritten, as it does for torch's own in-place
writes, instead of computing gradients from the new values.
"""
import pytest
import torch

from seqfuse import ops
from seqfuse.ops import act as act_ops
from seqfuse.ops import moe as moe_ops

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _gemm(dev, out):
    a, b = torch.randn(4, 3, device=dev), torch.randn(3, 5, device=dev)
    return ops.gemm(a, b, out=out), a @ b


def _act(dev, out):
    x = torch.randn(4, 8, device=dev)
    return act_ops.act_forward(x, "gelu", out=out), None


def _act_backward(dev, out):
    x, dy = torch.randn(4, 8, device=dev), torch.randn(4, 8, device=dev)
    return act_ops.act_backward(dy, x, "gelu", out=out), None


def _layernorm(dev, out):
    x = torch.randn(4, 8, device=dev)
    y, _, _ = ops.layernorm_forward(x, torch.ones(8, device=dev), torch.zeros(8, device=dev), out=out)
    return y, torch.nn.functional.layer_norm(x, (8,), eps=1e-5)


def _rmsnorm(dev, out):
    x = torch.randn(4, 8, device=dev)
    y, _ = ops.rmsnorm_forward(x, torch.ones(8, device=dev), out=out)
    return y, None


def _rope(dev, out):
    t = torch.randn(4, 5, 2, 8, device=dev)
    freqs = torch.randn(4, 1, 1, 8, device=dev)
    return ops.rope_forward(t, freqs, out=out), None


def _ce_backward(dev, out):
    logits = torch.randn(4, 8, device=dev)
    labels = torch.tensor([1, 2, 3, 0], device=dev)
    _, lse = ops.cross_entropy_forward(logits, labels)
    return ops.cross_entropy_backward(logits, labels, lse, 1.0, out=out), None


def _gemm_aux(dev, out):
    # (8 columns: cuBLASLt's aux epilogue on CUDA takes a row stride that is a multiple of 8 elements)
    a, b = torch.randn(4, 3, device=dev), torch.randn(3, 8, device=dev)
    return ops.gemm(a, b, epilogue="gelu_aux", aux=out)[1], a @ b  # aux: the pre-GELU values


def _gemm_bgrad(dev, out):
    a, b = torch.randn(6, 4, device=dev), torch.randn(6, 5, device=dev)
    return ops.gemm(a, b, transa=True, epilogue="bgrad", bias=out)[1], a.sum(0)


def _amax(dev, out):
    x = torch.randn(4, 8, device=dev)
    return ops.amax(x, out=out), x.abs().max()


def _l2norm(dev, out):
    from seqfuse.ops import optim as optim_ops
    xs = [torch.randn(5, device=dev), torch.randn(3, device=dev)]
    return optim_ops.multi_tensor_l2norm(xs, out=out), torch.cat(xs).norm()


def _attention_dq(dev, out):
    dt = out.dtype  # (bfloat16 on CUDA, whose attention kernels take fp16 / bf16: _out_dtype)
    q, k, v = (torch.randn(1, 6, 2, 16, device=dev, dtype=dt) for _ in range(3))  # (head dim 16: CUDA's smallest)
    o_, lse = ops.attention_forward(q, k, v)
    dq, _, _ = ops.attention_backward(torch.randn(1, 6, 2, 16, device=dev, dtype=dt), q, k, v, o_, lse, dq=out)
    return dq, None


OPS = {"gemm": (_gemm, (4, 5)), "gemm(aux)": (_gemm_aux, (4, 8)), "gemm(bias)": (_gemm_bgrad, (4,)),
       "amax": (_amax, ()), "multi_tensor_l2norm": (_l2norm, ()), "attention_backward(dq)": (_attention_dq, (1, 6, 2, 16)), "act_forward": (_act, (4, 8)), "act_backward": (_act_backward, (4, 8)),
       "layernorm_forward": (_layernorm, (4, 8)), "rmsnorm_forward": (_rmsnorm, (4, 8)),
       "rope": (_rope, (4, 5, 2, 8)), "cross_entropy_backward": (_ce_backward, (4, 8))}


def _out_dtype(name, dev):
    """The out= tensor's dtype: float32, but bfloat16 for attention on CUDA (its kernels take fp16 / bf16)."""
    return torch.bfloat16 if dev == "cuda" and name.startswith("attention") else torch.float32


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("name", sorted(OPS))
def test_out_requiring_grad_refused_under_grad_mode(dev, name):
    run, shape = OPS[name]
    out = torch.full(shape, 7.0, device=dev, dtype=_out_dtype(name, dev), requires_grad=True)
    op, _, arg = name.partition("(")
    arg = arg.rstrip(")") or "out"
    with pytest.raises(ValueError, match=rf"{op}: argument '{arg}' requires grad; seqfuse.ops write out= "
                                         r"tensors outside autograd .*torch.no_grad\(\)"):
        run(dev, out)
    assert (out.detach() == 7.0).all()  # nothing written


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("name", sorted(OPS))
def test_out_written_under_no_grad_and_version_bumped(dev, name):
    run, shape = OPS[name]
    for requires_grad in (False, True):
        out = torch.full(shape, 7.0, device=dev, dtype=_out_dtype(name, dev), requires_grad=requires_grad)
        before = out._version
        with torch.no_grad():
            got, want = run(dev, out)
        assert got is out  # the caller's tensor itself, as torch's out= returns it
        assert out._version > before
        assert not (out.detach() == 7.0).all()
        if want is not None:
            torch.testing.assert_close(out.detach(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dev", DEVICES)
def test_saved_tensor_overwritten_through_out_is_caught_by_autograd(dev):
    """A tensor autograd saved (x, for x * w's gradient) overwritten by an op's out=: backward raises
    torch's in-place error instead of computing the gradient from the new values."""
    x = torch.randn(4, 3, device=dev)
    w = torch.randn(4, 3, device=dev, requires_grad=True)
    y = (x * w).sum()
    ops.gemm(torch.randn(4, 2, device=dev), torch.randn(2, 3, device=dev), out=x)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


@pytest.mark.parametrize("dev", DEVICES)
def test_grouped_gemm_out_list_checked_and_bumped(dev):
    a = torch.randn(6, 4, device=dev)
    b = [torch.randn(4, 3, device=dev) for _ in range(2)]
    outs = [torch.zeros(2, 3, device=dev), torch.zeros(4, 3, device=dev, requires_grad=True)]
    with pytest.raises(ValueError, match=r"grouped_gemm: argument 'out\[1\]' requires grad"):
        moe_ops.grouped_gemm(a, b, [2, 4], out=outs)
    before = [t._version for t in outs]
    with torch.no_grad():
        got = moe_ops.grouped_gemm(a, b, [2, 4], out=outs)
    assert len(got) == 2 and all(g is o for g, o in zip(got, outs))  # the caller's own tensors, as torch's out=
    assert [t._version for t in outs] == [v + 1 for v in before]
    torch.testing.assert_close(outs[0], a[:2] @ b[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[1].detach(), a[2:] @ b[1], atol=1e-5, rtol=1e-5)


def test_cross_entropy_inplace_backward_under_create_graph_names_the_module_argument():
    """A double backward through cross_entropy(inplace_backward=True): the module's own message (not the
    op's out= rule), naming inplace_backward."""
    from seqfuse.modules.cross_entropy import cross_entropy
    x = torch.randn(4, 8, requires_grad=True)
    y = torch.tensor([1, 2, 3, 4])
    loss = cross_entropy(x * 1.0, y, inplace_backward=True)
    with pytest.raises(RuntimeError, match="cross_entropy: inplace_backward=True writes the gradient over the "
                                           "logits.*create_graph=True.*pass inplace_backward=False"):
        torch.autograd.grad(loss, x, create_graph=True)
    (g,) = torch.autograd.grad(cross_entropy(x * 1.0, y, inplace_backward=True), x)  # a plain backward: fine
    torch.testing.assert_close(g, torch.autograd.grad(torch.nn.functional.cross_entropy(x, y), x)[0])


def test_mark_written_bumps_tensors_among_other_dlpack_producers():
    """mark_written's fallback: a DLPack producer without a version counter
    (a numpy array) among the outputs is passed over, every tensor bumped."""
    import numpy as np
    from seqfuse.ops._call import mark_written

    a, b = torch.zeros(3), torch.zeros(2)
    va, vb = a._version, b._version
    mark_written(a, np.zeros(3), b)
    assert a._version > va and b._version > vb
    mark_written()  # nothing given: nothing to do
