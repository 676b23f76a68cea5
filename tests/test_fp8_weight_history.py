"""Delayed scaling's weight casts with the scale of the weight's amax history.

Under DelayedScaling a weight that only optimizer steps changed since its
last cast is cast with the scale of its amax history, as Transformer Engine
casts it: one pass over the weight, where a cast from its own amax needs
two (the amax, then the cast).  Its first cast, and a cast after any other
write (an in-place rescale here), take the weight's own amax; so does every
cast of a module with ``fp8_weight_history = False`` (GroupedLinear's
rule).  A resumed run casts the bytes the uninterrupted run casts, and a
validation pass under snapshot_scaling / restore_scaling changes nothing
in training.

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
from seqfuse.quantization import init_fp8_state

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
@pytest.mark.parametrize("history", [None, False], ids=["default", "own_amax"])
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
        if step == 0 or history is False:  # the first cast, or the own-amax rule
            _check_cast(q, m.weight, _scale_of(amaxes[-1]), f"step {step}")
        else:  # the largest amax in the history: the weights cast before this step's
            _check_cast(q, m.weight, _scale_of(max(amaxes[:-1])), f"step {step}")
        _double_by_optimizer(m)
    weight_current = [s for s in current_casts if s == (48, 64)]
    # the own-amax rule casts with the one-launch current cast at every step; the default at the first alone
    assert len(weight_current) == (3 if history is False else 1), current_casts


@needs_fp8
@pytest.mark.parametrize("device", _devices())
def test_a_write_outside_the_optimizer_takes_its_own_amax(device, seed):
    """A weight rescaled in place (no optimizer step) is cast from its own
    amax: the history does not describe it."""
    m = _linear(None, seed, device=device)
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
@pytest.mark.parametrize("write", ["before_the_step", "after_the_step", "skipped_by_the_step"])
def test_a_write_beside_an_optimizer_step_takes_its_own_amax(write, seed):
    """An optimizer step and another write since the last cast (before or
    after the step; or a parameter the step skipped, its gradient None):
    the history does not describe the weight, so the cast takes its own
    amax (the history's scale would saturate the 16x weight)."""
    m = _linear(None, seed)
    recipe = DelayedScaling(amax_history_len=4)
    x = torch.randn(32, 64)
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    _step(m, recipe, x)
    m.weight.grad = None if write == "skipped_by_the_step" else torch.ones_like(m.weight)
    if write == "before_the_step":
        with torch.no_grad():
            m.weight.mul_(16.0)
    opt.step()
    if write != "before_the_step":
        with torch.no_grad():
            m.weight.mul_(16.0)
    m.weight.grad = None
    _check_cast(_step(m, recipe, x), m.weight, _scale_of(_amax(m)), write)


@needs_fp8
@pytest.mark.parametrize("device", _devices())
def test_history_scale_saturates_a_grown_weight(device, seed):
    """The step after the weight doubled: values past the old amax saturate
    at E4M3's largest finite value, never inf or NaN."""
    m = _linear(None, seed, device=device)
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
    for history in (None, False):
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


def _train(m, xs, recipe, opt, validate_after=()):
    """Training steps on ``xs``; after the steps in ``validate_after`` a
    no_grad validation forward between snapshot_scaling and restore_scaling
    (the recipes' trainers do the same).  Returns each step's output."""
    from seqfuse.quantization import restore_scaling, snapshot_scaling

    out = []
    for i, x in enumerate(xs):
        with te.autocast(recipe=recipe):
            y = m(x)
        y.square().mean().backward()
        opt.step()
        opt.zero_grad()
        out.append(y.detach())
        if i in validate_after:
            saved = snapshot_scaling(m)
            with torch.no_grad(), te.autocast(recipe=recipe):
                m(x * 3)
            restore_scaling(saved)
    return out


@needs_fp8
@pytest.mark.parametrize("resume_at", [1, 2])
def test_a_resumed_run_casts_the_uninterrupted_runs_bytes(resume_at, seed):
    """Weights, optimizer and scaling state saved after ``resume_at`` steps
    and loaded into a new module: its first cast takes the history's scale
    where the uninterrupted run's re-cast does, and the outputs stay equal
    bit for bit."""
    recipe = DelayedScaling(amax_history_len=4)
    xs = [torch.randn(32, 64, generator=torch.Generator().manual_seed(seed + i)) for i in range(4)]
    m = _linear(None, seed)
    opt = torch.optim.AdamW(m.parameters(), lr=0.05)
    whole = _train(m, xs, recipe, opt)
    m = _linear(None, seed)
    opt = torch.optim.AdamW(m.parameters(), lr=0.05)
    first = _train(m, xs[:resume_at], recipe, opt)
    saved = (m.state_dict(), opt.state_dict())
    m = _linear(None, seed + 1)  # (other initial weights: the load must bring everything)
    opt = torch.optim.AdamW(m.parameters(), lr=0.05)
    init_fp8_state(m, recipe)  # (the module's scaling state, made for the load to fill, as a resume does)
    m.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    rest = _train(m, xs[resume_at:], recipe, opt)
    for i, (a, b) in enumerate(zip(whole, first + rest)):
        assert torch.equal(a, b), f"step {i}"


@needs_fp8
def test_validation_passes_leave_training_unchanged(seed):
    """A no_grad validation forward between steps (its weight casts then
    reused by the next training call) under snapshot_scaling /
    restore_scaling: the training outputs and the final scaling state equal
    the run's without validation, bit for bit."""
    recipe = DelayedScaling(amax_history_len=4, amax_compute_algo="most_recent")
    xs = [torch.randn(32, 64, generator=torch.Generator().manual_seed(seed + i)) for i in range(5)]
    runs = []
    for validate_after in ((), (0, 2, 3)):
        m = _linear(None, seed)
        opt = torch.optim.AdamW(m.parameters(), lr=0.05)
        runs.append((_train(m, xs, recipe, opt, validate_after), m.fp8_state.amax_history.clone(),
                     m.fp8_state.scale.clone()))
    for i, (a, b) in enumerate(zip(runs[0][0], runs[1][0])):
        assert torch.equal(a, b), f"step {i}"
    assert torch.equal(runs[0][1], runs[1][1]) and torch.equal(runs[0][2], runs[1][2])


def test_a_step_whose_pre_hook_did_not_run_is_not_counted():
    """The post-step hook of an optimizer its pre-step hook never saw (the
    hooks registered while that step ran) does nothing: no error, no count,
    and the optimizer's next full step registers and counts it."""
    from seqfuse.quantization import gemm_quantizers as gq

    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p], lr=0.1)
    gq._after_optimizer_step(opt, (), {})
    assert opt not in gq._optimizer_counters
    p.grad = torch.ones(4)
    opt.step()
    assert gq._optimizer_counters[opt][0] == [1]
    assert gq._stamp(p)[2] == 1
