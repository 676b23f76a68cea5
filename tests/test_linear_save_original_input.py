"""Linear's save_original_input (Transformer Engine's argument): under FP8 the
backward keeps the input in its own precision instead of its FP8 transposed
copy, and makes that copy again for the weight gradient.

The copy made again must be the bytes the forward's cast would have made,
so every output and gradient equals the default module's bit for bit, over
several steps (delayed scaling: the backward runs after the step's scale
update, so the copy is made with the forward's scale, not the state's), at
aligned and padded row counts; with a gradient accumulated over micro-batches
and inside seqfuse's checkpoint too.  What the backward keeps is checked
with saved-tensor hooks: the input itself (its storage) and no FP8 tensor of
the input's size.
"""
import copy

import pytest
import torch

import seqfuse.pytorch as te
from seqfuse.common.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling
from seqfuse.quantization import checkpoint

from helpers import needs_fp8

RECIPES = {"delayed": DelayedScaling, "current": Float8CurrentScaling, "block": Float8BlockScaling}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _devices():
    return ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _pair(device, bias, kept=None, h=128, f=256):
    """(a default Linear, ``kept`` or a Linear with save_original_input) with
    the same parameters."""
    torch.manual_seed(0)
    plain = te.Linear(h, f, bias=bias, params_dtype=torch.bfloat16, device=device)
    if kept is None:
        kept = te.Linear(h, f, bias=bias, params_dtype=torch.bfloat16, device=device, save_original_input=True)
    kept.load_state_dict(plain.state_dict())
    if bias:
        with torch.no_grad():  # (a non-zero bias: its gradient comes out of the gradient's cast)
            plain.bias.normal_()
            kept.bias.copy_(plain.bias)
    return plain, kept


def _steps(m, xs, dys, recipe, use_checkpoint=False):
    """Outputs, input gradients and the parameters' gradients of one
    optimizer-free step per (x, dy), the weights moved between steps as an
    optimizer would (the FP8 weights cast again)."""
    out = []
    for x, dy in zip(xs, dys):
        x = x.detach().requires_grad_(True)
        with te.autocast(recipe=recipe):
            y = checkpoint(m, x) if use_checkpoint else m(x)
        y.backward(dy)
        out.append((y.detach(), x.grad, {n: p.grad.clone() for n, p in m.named_parameters()}))
        with torch.no_grad():
            for p in m.parameters():
                p.add_(p.grad, alpha=-1e-2)
                p.grad = None
    return out


def _inputs(device, rows, n=3, h=128, f=256):
    g = torch.Generator().manual_seed(rows)
    xs = [(torch.randn(rows, h, generator=g) * (1 + i)).to(device, torch.bfloat16) for i in range(n)]
    dys = [(torch.randn(rows, f, generator=g) * 1e-2).to(device, torch.bfloat16) for i in range(n)]
    return xs, dys


def _assert_same(a, b):
    for (ya, dxa, ga), (yb, dxb, gb) in zip(a, b):
        assert torch.equal(ya, yb)
        assert torch.equal(dxa, dxb)
        assert ga.keys() == gb.keys()
        for n in ga:
            assert torch.equal(ga[n], gb[n]), n


@needs_fp8
@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("rows", [7, 128, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_save_original_input_gives_the_same_bits(recipe, rows, bias, device):
    """Three steps, weights moved between them: every output and gradient
    equal to the default module's (block scaling: 128-multiple rows only,
    its features' rule)."""
    kept = te.Linear(128, 256, bias=bias, params_dtype=torch.bfloat16, device=device, save_original_input=True)
    plain, kept = _pair(device, bias, kept)
    xs, dys = _inputs(device, rows)
    _assert_same(_steps(plain, xs, dys, RECIPES[recipe]()), _steps(kept, xs, dys, RECIPES[recipe]()))


@needs_fp8
@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_save_original_input_under_checkpoint(recipe, device):
    """seqfuse's checkpoint recomputes the forward after the step's update:
    the same bits as the default module under the same checkpoint."""
    plain, kept = _pair(device, bias=False)
    xs, dys = _inputs(device, 40)
    _assert_same(_steps(plain, xs, dys, RECIPES[recipe](), True), _steps(kept, xs, dys, RECIPES[recipe](), True))


def _saved(m, x, recipe):
    """The tensors autograd keeps for m's backward (saved-tensor hooks)."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with te.autocast(recipe=recipe):
            y = m(x)
    return y, saved


@needs_fp8
@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_save_original_input_keeps_the_input_not_an_fp8_copy(recipe, device):
    """The default keeps an FP8 copy of x's size (its transposed copy); with
    save_original_input the backward keeps x's own storage and no FP8 tensor
    of that size (the weight's FP8 copy is the only FP8 tensor kept)."""
    rows, h = 256, 128
    plain, kept = _pair(device, bias=False)
    x = torch.randn(rows, h, device=device, dtype=torch.bfloat16, requires_grad=True)

    _, saved_plain = _saved(plain, x, RECIPES[recipe]())
    y, saved_kept = _saved(kept, x, RECIPES[recipe]())
    assert any(t.dtype in FP8_DTYPES and t.numel() == rows * h for t in saved_plain)
    assert not [t for t in saved_kept if t.dtype in FP8_DTYPES and t.numel() == rows * h
                and t.shape != kept.weight.shape and t.shape != kept.weight.t().shape]
    assert any(t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for t in saved_kept)
    y.sum().backward()  # (the kept input still gives the weight gradient)
    assert kept.weight.grad is not None and torch.isfinite(kept.weight.grad.float()).all()


def test_save_original_input_without_fp8_is_the_plain_module():
    """Outside FP8 autocast the argument changes nothing: the same bits."""
    plain, kept = _pair("cpu", bias=True)
    x = torch.randn(9, 128, dtype=torch.bfloat16)
    dy = torch.randn(9, 256, dtype=torch.bfloat16)
    outs = []
    for m in (plain, kept):
        xi = x.clone().requires_grad_(True)
        y = m(xi)
        y.backward(dy)
        outs.append((y.detach(), xi.grad, m.weight.grad, m.bias.grad))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    assert kept.save_original_input and not plain.save_original_input
    assert copy.deepcopy(kept).save_original_input
