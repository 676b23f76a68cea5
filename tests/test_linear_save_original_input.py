"""Linear's save_original_input (Transformer Engine's argument): under FP8 the
backward keeps the input in its own precision instead of its FP8 transposed
copy, and makes that copy again for the weight gradient.

The copy made again must be the bytes the forward's cast would have made,
so every output and gradient equals the default module's bit for bit, over
several steps (delayed scaling: the backward runs after the step's scale
update, so the copy is made with the forward's scale, not the state's), at
aligned and padded row counts, with a margin, with the weight gradient
accumulated over micro-batches (is_first_microbatch, main_grad) and inside
seqfuse's checkpoint too; the delayed-scaling state (amax history, scales)
ends each model's steps the same (the backward's cast records nothing).  What the backward keeps is checked
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


def _state(m):
    """The module's delayed-scaling buffers (amax history, scale, scale
    inverse) as they are now, copied; {} for other recipes."""
    return {n: b.detach().clone() for n, b in m.named_buffers() if n.startswith("fp8_state")}


def _steps(m, xs, dys, recipe, use_checkpoint=False):
    """Outputs, input gradients and the parameters' gradients of one
    optimizer-free step per (x, dy), the weights moved between steps as an
    optimizer would (the FP8 weights cast again); the last entry is the
    scaling state right after them."""
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
    out.append(_state(m))
    return out


def _inputs(device, rows, n=3, h=128, f=256):
    g = torch.Generator().manual_seed(rows)
    xs = [(torch.randn(rows, h, generator=g) * (1 + i)).to(device, torch.bfloat16) for i in range(n)]
    dys = [(torch.randn(rows, f, generator=g) * 1e-2).to(device, torch.bfloat16) for i in range(n)]
    return xs, dys


def _assert_same(a, b):
    state_a, state_b = a[-1], b[-1]
    assert state_a.keys() == state_b.keys()
    for n in state_a:
        assert torch.equal(state_a[n], state_b[n]), n
    for (ya, dxa, ga), (yb, dxb, gb) in zip(a[:-1], b[:-1]):
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
    equal to the default module's, at an aligned and two padded row counts."""
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


@needs_fp8
@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_save_original_input_with_a_margin(recipe, device):
    """A recipe margin (scales 2**-margin smaller): the copy made again takes
    the same scale, so the same bits."""
    plain, kept = _pair(device, bias=True)
    xs, dys = _inputs(device, 40)
    _assert_same(_steps(plain, xs, dys, RECIPES[recipe](margin=2)), _steps(kept, xs, dys, RECIPES[recipe](margin=2)))


@needs_fp8
@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("fuse", [False, True])
def test_save_original_input_accumulating_micro_batches(recipe, fuse, device):
    """Two optimizer steps of three micro-batches each, is_first_microbatch
    True then False (the weight cast once per step), the weight gradient
    accumulated in the parameters' grads or, with fuse_wgrad_accumulation, in
    a float32 main_grad: the same bits as the default module."""
    kept = te.Linear(128, 256, bias=False, params_dtype=torch.bfloat16, device=device, save_original_input=True,
                     fuse_wgrad_accumulation=fuse)
    plain = te.Linear(128, 256, bias=False, params_dtype=torch.bfloat16, device=device,
                      fuse_wgrad_accumulation=fuse)
    plain.load_state_dict(kept.state_dict())
    xs, dys = _inputs(device, 24, n=6)
    results = []
    for m in (plain, kept):
        if fuse:
            m.weight.main_grad = torch.zeros(m.weight.shape, dtype=torch.float32, device=device)
        outs = []
        for step in range(2):
            for i in range(3):
                x = xs[3 * step + i].detach().requires_grad_(True)
                with te.autocast(recipe=RECIPES[recipe]()):
                    y = m(x, is_first_microbatch=i == 0)
                y.backward(dys[3 * step + i])
                outs += [y.detach(), x.grad]
            g = m.weight.main_grad if fuse else m.weight.grad
            outs.append(g.clone())
            with torch.no_grad():
                m.weight.add_(g.to(m.weight.dtype), alpha=-1e-2)
                g.zero_() if fuse else setattr(m.weight, "grad", None)
        results.append((outs, _state(m)))
    (outs_a, state_a), (outs_b, state_b) = results
    assert len(outs_a) == len(outs_b) == 14
    for a, b in zip(outs_a, outs_b):
        assert torch.equal(a, b)
    assert state_a.keys() == state_b.keys() and all(torch.equal(state_a[n], state_b[n]) for n in state_a)


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
    rows, h = 512, 128  # (rows * h apart from the weight's 256 x 128 elements)
    plain, kept = _pair(device, bias=False)
    x = torch.randn(rows, h, device=device, dtype=torch.bfloat16, requires_grad=True)

    _, saved_plain = _saved(plain, x, RECIPES[recipe]())
    y, saved_kept = _saved(kept, x, RECIPES[recipe]())
    assert any(t.dtype in FP8_DTYPES and t.numel() == rows * h for t in saved_plain)
    assert not [t for t in saved_kept if t.dtype in FP8_DTYPES and t.numel() == rows * h]
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
