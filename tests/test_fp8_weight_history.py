"""The opt-in history scale of delayed scaling's weight re-casts.

By default a weight is cast from its own amax, under delayed scaling too.
A module with ``fp8_weight_history = True`` casts a weight that only
optimizer steps changed since its last cast with the scale of the weight's
amax history, as Transformer Engine does: one pass over the weight, where
a cast from its own amax needs two (the amax, then the cast).  Its first
cast, and a cast after any other write (an in-place rescale here), take
the weight's own amax.  A cast keeps its own scale inverse.

Here an optimizer step doubles a Linear's weight between steps, so its amax
outgrows the history: the next step takes the older, smaller amax's scale
(the doubled values past the E4M3 range saturate, as TE's casts do).  The
bytes are compared with the CPU reference cast of the weight under the
expected scale, the scale inverses with the library's 1 / that scale.
"""
import pytest
import torch

import seqfuse.pytorch as te
from seqfuse.common.recipe import DelayedScaling, Float8CurrentScaling
from seqfuse.ops import quant as qops

from helpers import needs_fp8

E4M3_MAX = 448.0


def _devices():
    return ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _linear(history, seed, fin=64, fout=48, device="cpu"):
    torch.manual_seed(seed)
    m = te.Linear(fin, fout, bias=False, params_dtype=torch.float32, device="cpu").to(device)
    if history is not None:
        m.fp8_weight_history = history
    return m


def _step(m, recipe, x):
    with te.autocast(recipe=recipe):
        y = m(x)
    y.square().mean().backward()
    m.weight.grad = None
    return m._fp8_quantizers.weights[0].pair[1]  # (the cached pair's W^T operand: its bytes and scale inverse)


def _double_by_optimizer(m):
    """weight += weight through an SGD step (lr 1, gradient -weight)."""
    opt = torch.optim.SGD([m.weight], lr=1.0)
    m.weight.grad = -m.weight.detach().clone()
    opt.step()
    m.weight.grad = None


def _scale_of(amax):
    """(scale, scale inverse) of ``amax`` as the library computes them (E4M3, no margin)."""
    scale, scale_inv = torch.empty(1), torch.empty(1)
    qops.fp8_compute_scale(amax.reshape(1).float(), scale, scale_inv, E4M3_MAX)
    return scale, scale_inv


def _check_cast(q, w, scales, what):
    """q's transposed bytes and scale inverse are the CPU reference cast of
    w under ``scales`` (the library's scale of an amax, on the CPU)."""
    scale, scale_inv = scales
    want_t = torch.empty(w.shape[1], w.shape[0], dtype=torch.float8_e4m3fn)
    qops.cast_fp8_into(w.detach().cpu().contiguous(), scale, None, None, want_t, torch.empty(1))
    assert torch.equal(q.data_t.cpu().view(torch.uint8), want_t.view(torch.uint8)), f"{what}: bytes"
    assert torch.equal(q.scale_inv.cpu(), scale_inv), f"{what}: scale inverse {q.scale_inv} vs {scale_inv}"


def _amax(m):
    return m.weight.detach().abs().max().float().cpu()


@needs_fp8
@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("history", [True, None], ids=["opted_in", "default"])
def test_weight_scale_follows_the_history(history, device, seed, monkeypatch):
    m = _linear(history, seed, device=device)
    recipe = DelayedScaling(amax_history_len=4)
    x = torch.randn(32, 64, device=device)
    current_casts = []
    real = qops.cast_fp8_current_into

    def spy(w, *args, **kwargs):
        current_casts.append(tuple(w.shape))
        return real(w, *args, **kwargs)

    monkeypatch.setattr(qops, "cast_fp8_current_into", spy)
    amaxes = []
    for step in range(3):
        amaxes.append(_amax(m))
        q = _step(m, recipe, x)
        if step == 0 or history is None:  # the first cast, or the default: its own amax
            _check_cast(q, m.weight, _scale_of(amaxes[-1]), f"step {step}")
        else:  # the largest amax in the history: the weights cast before this step's
            _check_cast(q, m.weight, _scale_of(max(amaxes[:-1])), f"step {step}")
        _double_by_optimizer(m)
    weight_current = [s for s in current_casts if s == (48, 64)]
    # the default casts from the weight's own amax (the one-launch current cast) at every step; the opt-in
    # at the first step alone
    assert len(weight_current) == (1 if history else 3), current_casts


@needs_fp8
@pytest.mark.parametrize("device", _devices())
def test_a_write_outside_the_optimizer_takes_its_own_amax(device, seed):
    """An opted-in module whose weight was rescaled in place (no optimizer
    step) casts it from its own amax: the history does not describe it."""
    m = _linear(True, seed, device=device)
    recipe = DelayedScaling(amax_history_len=4)
    x = torch.randn(32, 64, device=device)
    old = _amax(m)
    _step(m, recipe, x)
    _double_by_optimizer(m)
    _check_cast(_step(m, recipe, x), m.weight, _scale_of(old), "after the optimizer step")
    with torch.no_grad():
        m.weight.mul_(2.0)
    _check_cast(_step(m, recipe, x), m.weight, _scale_of(_amax(m)), "after the in-place write")


@needs_fp8
@pytest.mark.parametrize("device", _devices())
def test_history_scale_saturates_a_grown_weight(device, seed):
    """The step after the weight doubled: values past the old amax saturate
    at E4M3's largest finite value, never inf or NaN."""
    m = _linear(True, seed, device=device)
    recipe = DelayedScaling(amax_history_len=4)
    x = torch.randn(32, 64, device=device)
    _step(m, recipe, x)
    _double_by_optimizer(m)
    t = _step(m, recipe, x).data_t.float().cpu()
    assert torch.isfinite(t).all()
    assert t.abs().max() == E4M3_MAX
    # a cast from the weight's own amax puts only its largest values at E4M3's maximum; the history's
    # half-size scale the doubled weight's whole top half
    own_t = torch.empty(t.shape, dtype=torch.float8_e4m3fn)
    qops.cast_fp8_into(m.weight.detach().cpu().contiguous(), _scale_of(_amax(m))[0], None, None, own_t, torch.empty(1))
    saturated, own_saturated = int((t.abs() == E4M3_MAX).sum()), int((own_t.float().abs() == E4M3_MAX).sum())
    assert saturated > 4 * max(own_saturated, 1), (saturated, own_saturated)


@needs_fp8
def test_current_scaling_ignores_the_attribute(seed):
    """fp8_weight_history concerns delayed scaling only: current scaling
    casts the weight from its own amax either way, the same bytes."""
    recipe = Float8CurrentScaling()
    outs = []
    for history in (None, True):
        m = _linear(history, seed, 64, 48)
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(seed))
        for _ in range(2):
            with te.autocast(recipe=recipe):
                y = m(x)
            y.square().mean().backward()
            _double_by_optimizer(m)
        outs.append(y.detach())
    assert torch.equal(outs[0], outs[1])


@needs_fp8
def test_grouped_linear_keeps_its_own_amax(seed, monkeypatch):
    """GroupedLinear takes each expert's own amax whatever the attribute: its
    one-launch cast of every expert's weight computes each scale.  One expert
    goes through the per-expert cast (WeightQuantizer.get), which follows the
    module's rule: the own-amax cast at every step, after optimizer steps too."""
    torch.manual_seed(seed)
    gl = te.GroupedLinear(1, 64, 48, bias=False, params_dtype=torch.float32, device="cpu")
    gl.fp8_weight_history = True
    opt = torch.optim.SGD(gl.parameters(), lr=0.1)
    casts = []
    real = qops.cast_fp8_current_into
    monkeypatch.setattr(qops, "cast_fp8_current_into",
                        lambda w, *a, **k: (casts.append(tuple(w.shape)), real(w, *a, **k))[1])
    x = torch.randn(32, 64)
    for _ in range(3):
        with te.autocast(recipe=DelayedScaling()):
            y = gl(x, [32], is_first_microbatch=True)  # (the module keeps its cast's key between steps)
        y.square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert casts.count((48, 64)) == 3, casts
