"""Delayed scaling: the fused update kernel against a plain Python model of
the algorithm over 50 steps with spikes, zeros, infinities and NaN; the
state's pooling, state_dict round trip and device/dtype moves; autocast's
one-update-per-step; the per-layer stats log; CUDA against CPU."""
import copy

import numpy as np
import pytest
import torch

import seqfuse
import seqfuse.pytorch as te
from seqfuse import ops
from seqfuse.common.recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling,
                                   Format, MXFP8BlockScaling, NVFP4BlockScaling)
from seqfuse.quantization import (GRAD_OUTPUT, INPUT, WEIGHT, ScalingState, autocast_state,
                                  get_recipe, is_fp8_enabled, quantize_with_state)
from helpers import needs_fp8, no_host_sync, rel_error


class ModelState:
    """The algorithm written plainly (Transformer Engine's semantics) in
    float32: amax = max(history) or history[0]; scale = fp8_max / amax /
    2^margin unless amax is 0 or not finite (then keep); inf -> FLT_MAX;
    history = roll(history, -1); history[0] = 0."""

    def __init__(self, h, n, fp8_max, algo, margin):
        self.hist = np.zeros((h, n), np.float32)
        self.scale = np.ones(n, np.float32)
        self.fp8_max = np.asarray(fp8_max, np.float32)
        self.algo, self.margin = algo, margin

    def step(self, amax_now):
        self.hist[0] = np.maximum(self.hist[0], amax_now) if False else amax_now
        for j in range(self.hist.shape[1]):
            col = self.hist[:, j]
            if self.algo == "max":
                a = np.float32(np.nan) if np.isnan(col).any() else col.max()
            else:
                a = col[0]
            if a > 0 and np.isfinite(a):
                with np.errstate(over="ignore"):
                    s = np.float32(self.fp8_max[j] / a) * np.float32(2.0 ** -self.margin)
                if not np.isfinite(s):
                    s = np.float32(np.finfo(np.float32).max)
                self.scale[j] = s
        self.hist = np.roll(self.hist, -1, axis=0)
        self.hist[0] = 0
        with np.errstate(divide="ignore"):
            return self.scale.copy(), (np.float32(1) / self.scale).astype(np.float32)


def amax_sequence(steps, n, rng):
    a = (rng.random((steps, n)) * 10).astype(np.float32)
    a[5, :] *= 1000        # spike
    a[10, 0] = 0           # zero
    a[11:14, 1] = 0
    a[20, 2] = np.inf
    a[30, 3] = np.nan
    a[35, :] = 1e-38       # tiny: scale overflows to FLT_MAX
    a[40, 4] = 3e38
    return a


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("h", [1, 4, 16])
@pytest.mark.parametrize("margin", [0, 2])
def test_update_matches_python_model_50_steps(algo, h, margin, seed):
    rng = np.random.default_rng(seed)
    n = 6
    fmax = [448.0, 448.0, 57344.0, 448.0, 57344.0, 448.0]
    model = ModelState(h, n, fmax, algo, margin)
    hist = torch.zeros(h, n)
    scale, scale_inv = torch.ones(n), torch.ones(n)
    fp8_max = torch.tensor(fmax)
    seq = amax_sequence(50, n, rng)
    for t in range(50):
        hist[0] = torch.from_numpy(seq[t])
        ops.fp8_scale_update(hist, scale, scale_inv, fp8_max, algo, margin)
        ms, msi = model.step(seq[t])
        assert np.array_equal(scale.numpy(), ms), f"step {t}"
        assert np.array_equal(scale_inv.numpy(), msi), f"step {t}"
        assert np.array_equal(hist.numpy(), model.hist, equal_nan=True), f"step {t}"


def test_update_roll_is_transformer_engines():
    h = torch.tensor([[1.0], [2.0], [3.0], [4.0]])
    ops.fp8_scale_update(h, torch.ones(1), torch.ones(1), torch.tensor([448.0]), "max", 0)
    expect = torch.roll(torch.tensor([[1.0], [2.0], [3.0], [4.0]]), -1, 0)
    expect[0] = 0
    assert torch.equal(h, expect)


def test_update_strided_history_and_errors():
    big = torch.zeros(3, 10)
    big[0, :4] = torch.tensor([1.0, 2.0, 4.0, 8.0])
    s, si = torch.ones(4), torch.ones(4)
    ops.fp8_scale_update(big[:, :4], s, si, torch.full((4,), 448.0), "max", 0)
    assert torch.equal(s, 448.0 / torch.tensor([1.0, 2.0, 4.0, 8.0]))
    assert torch.equal(big[2, :4], torch.tensor([1.0, 2.0, 4.0, 8.0])) and big[:, 4:].abs().sum() == 0
    with pytest.raises(ValueError, match="'algo' must be 'max' or 'most_recent'"):
        ops.fp8_scale_update(big[:, :4], s, si, torch.full((4,), 448.0), "mean", 0)
    with pytest.raises(ValueError, match="fp8_scale_update: argument 'scale' must have 4 element"):
        ops.fp8_scale_update(big[:, :4], torch.ones(5), si, torch.full((4,), 448.0), "max", 0)
    with pytest.raises(TypeError, match="fp8_scale_update: argument 'amax_history' must have dtype float32"):
        ops.fp8_scale_update(big[:, :4].half(), s, si, torch.full((4,), 448.0), "max", 0)
    with pytest.raises(ValueError, match="must be 2-D"):
        ops.fp8_scale_update(torch.zeros(4), s, si, torch.full((4,), 448.0), "max", 0)
    with pytest.raises(ValueError, match="margin' must be in"):
        ops.fp8_scale_update(big[:, :4], s, si, torch.full((4,), 448.0), "max", 100)


def test_compute_scale_current():
    amax = torch.tensor([2.0, 0.0, float("inf"), float("nan"), 1e-39])
    s, si = torch.empty(5), torch.empty(5)
    ops.fp8_compute_scale(amax, s, si, 448.0, 1)
    expect = torch.tensor([448.0 / 2 / 2, 1.0, 1.0, 1.0, torch.finfo(torch.float32).max])
    assert torch.equal(s, expect) and torch.equal(si, 1 / expect)


# ---- recipes and autocast ----------------------------------------------------

def test_recipes_named_as_transformer_engine():
    r = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16, amax_compute_algo="max", margin=1)
    assert r.delayed() and not r.float8_current_scaling()
    assert Format.HYBRID.forward_dtype == torch.float8_e4m3fn and Format.HYBRID.backward_dtype == torch.float8_e5m2
    assert Format.E4M3.max_fwd == 448 and Format.E5M2.max_bwd == 57344
    assert Float8CurrentScaling().float8_current_scaling()
    assert Float8BlockScaling().w_block_scaling_dim == 2
    assert MXFP8BlockScaling().mxfp8() and NVFP4BlockScaling().nvfp4()
    with pytest.raises(ValueError, match="amax_compute_algo"):
        DelayedScaling(amax_compute_algo="mean")
    with pytest.raises(TypeError, match="Format"):
        DelayedScaling(fp8_format="E4M3")
    assert te.recipe.DelayedScaling is DelayedScaling


def test_autocast_state_and_nesting():
    assert not is_fp8_enabled()
    r = DelayedScaling(amax_history_len=2)
    with te.autocast(enabled=True, recipe=r):
        assert is_fp8_enabled() and get_recipe() is r
        with te.autocast(enabled=False):
            assert not is_fp8_enabled()
        assert is_fp8_enabled()
        with te.fp8_autocast(enabled=True):
            assert get_recipe() is r  # inherited
    assert not is_fp8_enabled() and autocast_state().recipe is None
    with pytest.raises(TypeError, match="recipe"):
        with te.autocast(recipe="delayed"):
            pass
    with te.fp8_model_init(enabled=True):
        assert seqfuse.quantization.quantized_model_init_state().enabled
    assert not seqfuse.quantization.quantized_model_init_state().enabled


def test_disabled_autocast_builds_no_recipe(monkeypatch):
    """A disabled region without a recipe keeps none (get_recipe() still
    answers a DelayedScaling), inherits an enclosing enabled region's, and an
    enabled or calibrating region without one gets DelayedScaling()."""
    import importlib
    ac = importlib.import_module("seqfuse.quantization.autocast")  # (the package re-exports a function of its name)
    made = []

    class Counted(DelayedScaling):
        def __init__(self, *args, **kwargs):
            made.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(ac, "DelayedScaling", Counted)
    with te.autocast(enabled=False) as s:
        assert s.recipe is None and isinstance(get_recipe(), DelayedScaling) and not made
    r = Float8CurrentScaling()
    with te.autocast(enabled=True, recipe=r):
        with te.autocast(enabled=False) as s:
            assert s.recipe is r and get_recipe() is r
    assert not made
    with te.autocast(enabled=False, calibrating=True) as s:
        assert isinstance(s.recipe, DelayedScaling)
    with te.autocast(enabled=True) as s:
        assert isinstance(s.recipe, DelayedScaling)
    assert len(made) == 2


@needs_fp8
def test_one_update_launch_per_step_for_many_states(monkeypatch, seed):
    r = DelayedScaling(amax_history_len=8, margin=3)  # a key of its own
    states = [ScalingState.for_linear(r) for _ in range(20)]
    calls = []
    real = ops.quant.fp8_scale_update
    monkeypatch.setattr(ops.quant, "fp8_scale_update", lambda *a, **k: (calls.append(a), real(*a, **k)))
    xs = [torch.randn(16, 32) * (i + 1) for i in range(20)]
    with te.autocast(enabled=True, recipe=r):
        for st, x in zip(states, xs):
            quantize_with_state(x, st, INPUT)
            quantize_with_state(x * 2, st, WEIGHT, transpose=True)
    assert len(calls) == 1
    for st, x in zip(states, xs):
        assert st.amax_history[-1, INPUT].item() == x.abs().max().item()
        assert st.scale[WEIGHT].item() == np.float32(448.0) / np.float32((x * 2).abs().max().item()) / 8
        assert st.scale[GRAD_OUTPUT].item() == 1.0  # no amax yet: kept


@pytest.mark.parametrize("outer", ["delayed", "current"])
def test_nested_region_with_its_own_recipe_is_updated_at_the_outermost_exit(monkeypatch, outer):
    """A region inside the outermost one with a DelayedScaling recipe of other settings (or inside a
    current-scaling region) has its states updated at the outermost exit, once per setting, with one
    statistics step; an inner region inheriting the outer recipe adds nothing."""
    inner_r = DelayedScaling(amax_history_len=6, margin=2)
    outer_r = DelayedScaling(amax_history_len=7, margin=1) if outer == "delayed" else Float8CurrentScaling()
    inner_st = ScalingState.for_linear(inner_r)
    outer_st = ScalingState.for_linear(outer_r) if outer == "delayed" else None
    calls = []
    real = ops.quant.fp8_scale_update
    monkeypatch.setattr(ops.quant, "fp8_scale_update", lambda *a, **k: (calls.append(a[0].shape[0]), real(*a, **k)))
    for step in range(2):
        calls.clear()
        with te.autocast(recipe=outer_r):
            if outer_st is not None:
                quantize_with_state(torch.full((4, 4), 5.0), outer_st, WEIGHT)
            with te.autocast(recipe=inner_r):
                quantize_with_state(torch.full((4, 4), 3.0 + step), inner_st, WEIGHT)
            with te.autocast(recipe=inner_r):  # the same setting again: one update
                pass
            with te.autocast():  # inherits the outer recipe
                pass
        assert calls.count(6) == 1 and calls.count(7) == (1 if outer == "delayed" else 0)
        assert inner_st.scale[WEIGHT].item() == np.float32(448.0) / np.float32(3.0 + step) / 4


def test_nested_region_update_survives_an_enabled_region_inside_a_disabled_one(monkeypatch):
    """outer(enabled) > inner A (own recipe) > disabled > enabled B: B's exit (an outermost exit of its
    own) takes only what was opened inside it; A's states are still updated at the outer exit."""
    a_r, b_r, outer_r = (DelayedScaling(amax_history_len=n, margin=1) for n in (9, 10, 11))
    a_st = ScalingState.for_linear(a_r)
    calls = []
    real = ops.quant.fp8_scale_update
    monkeypatch.setattr(ops.quant, "fp8_scale_update", lambda *a, **k: (calls.append(a[0].shape[0]), real(*a, **k)))
    with te.autocast(recipe=outer_r):
        with te.autocast(recipe=a_r):
            quantize_with_state(torch.full((4, 4), 3.0), a_st, WEIGHT)
        with te.autocast(enabled=False):
            with te.autocast(recipe=b_r):
                pass
        assert 9 not in calls
    assert calls.count(9) == 1


@needs_fp8
def test_backward_amax_folds_in_at_next_exit():
    r = DelayedScaling(amax_history_len=4, margin=4)
    st = ScalingState.for_linear(r)
    with te.autocast(recipe=r):
        quantize_with_state(torch.full((4, 4), 2.0), st, INPUT)
    # the "backward" of step 1: a gradient cast after the region; no history yet, so its own amax
    # gives its scale (with the initial scale 1 a step's small gradients underflow E5M2)
    quantize_with_state(torch.full((4, 4), 8.0), st, GRAD_OUTPUT)
    assert st.fp8_dtype(GRAD_OUTPUT) == torch.float8_e5m2
    assert st.scale[GRAD_OUTPUT].item() == 57344.0 / 8.0 / 16
    with te.autocast(recipe=r):
        pass
    assert st.scale[GRAD_OUTPUT].item() == 57344.0 / 8.0 / 16
    # step 2's gradient: delayed scaling now; its amax folds in at the next exit
    quantize_with_state(torch.full((4, 4), 32.0), st, GRAD_OUTPUT)
    assert st.scale[GRAD_OUTPUT].item() == 57344.0 / 8.0 / 16
    with te.autocast(recipe=r):
        pass
    assert st.scale[GRAD_OUTPUT].item() == 57344.0 / 32.0 / 16


@needs_fp8
def test_first_step_gradients_do_not_underflow():
    """Delayed scaling's first step: output gradients of a mean loss over
    many tokens (~1e-6) cast with the initial scale 1 fall under E5M2's
    range and the weight gradient came out all zero; the first cast takes
    its scale from its own amax instead.  Steps after it: delayed scaling."""
    from seqfuse.quantization.state import FIRST_CASTS
    torch.manual_seed(0)
    lin = te.Linear(256, 256, bias=False, params_dtype=torch.float32)
    x, dy = torch.randn(64, 256), torch.randn(64, 256) * 1e-6
    want = dy.t() @ x
    for step in range(3):
        lin.weight.grad = None
        with te.fp8_autocast(fp8_recipe=DelayedScaling()):
            y = lin(x)
        y.backward(dy)
        assert rel_error(lin.weight.grad, want) < 0.1, step  # E5M2 gradients: a few % off
        mine = [m for m in lin.modules() if isinstance(m, ScalingState)]
        # the gradient's first cast (after step 0's update) is pending until step 1's update;
        # after it nothing is: steady-state steps skip the first-step bookkeeping
        assert mine and any(m in FIRST_CASTS for m in mine) == (step == 0), step


def test_snapshot_restore_keeps_the_first_step_rule():
    """A pass between snapshot_scaling and restore_scaling (a validation
    pass, a CUDA-graph warm-up) before the first training step: restoring
    puts back the initial scales and also the note that no tensor has a
    history, so the first training step's casts still take their scale from
    their own amax (with the note left behind, the gradient's cast used
    scale 1 and the weight gradient came out zero)."""
    from seqfuse.quantization import init_fp8_state, restore_scaling, snapshot_scaling
    torch.manual_seed(0)
    lin = te.Linear(256, 256, bias=False, params_dtype=torch.float32)
    x, dy = torch.randn(64, 256), torch.randn(64, 256) * 1e-6
    assert init_fp8_state(lin, DelayedScaling()) == 1
    saved = snapshot_scaling(lin)
    for _ in range(2):  # passes that must not move training state (the second updates the gradient's)
        with te.fp8_autocast(fp8_recipe=DelayedScaling()):
            y = lin(x)
        y.backward(dy)
    restore_scaling(saved)
    states = [m for m in lin.modules() if isinstance(m, ScalingState)]
    assert states and not any(m.has_history(i) for m in states for i in range(m.num_tensors))
    lin.weight.grad = None
    with te.fp8_autocast(fp8_recipe=DelayedScaling()):
        y = lin(x)
    y.backward(dy)
    assert rel_error(lin.weight.grad, dy.t() @ x) < 0.1


@needs_fp8
def test_state_dict_round_trip_continues_identically(seed):
    r = DelayedScaling(amax_history_len=5, margin=5)
    torch.manual_seed(seed)
    a = torch.nn.Module()
    a.fp8_state = ScalingState.for_linear(r)
    xs = [torch.randn(8, 8) * (1 + 10 * (t % 3)) for t in range(10)]
    for t in range(6):
        with te.autocast(recipe=r):
            quantize_with_state(xs[t], a.fp8_state, INPUT)
    sd = a.state_dict()
    assert set(sd) == {"fp8_state.amax_history", "fp8_state.scale", "fp8_state.scale_inv"}
    assert sd["fp8_state.amax_history"].shape == (5, 3)
    assert sd["fp8_state.amax_history"].untyped_storage().nbytes() == 5 * 3 * 4  # not the chunk
    b = torch.nn.Module()
    b.fp8_state = ScalingState.for_linear(r)
    b.load_state_dict(sd)
    for t in range(6, 10):
        with te.autocast(recipe=r):  # one step updates every state of the recipe
            for m in (a, b):
                quantize_with_state(xs[t], m.fp8_state, INPUT)
    for k in sd:
        assert torch.equal(a.state_dict()[k], b.state_dict()[k])
    # a checkpoint made with another history length is adopted
    c = ScalingState.for_linear(DelayedScaling(amax_history_len=3, margin=5))
    c.load_state_dict({k.split(".", 1)[1]: v for k, v in sd.items()})
    assert c.amax_history.shape == (5, 3)


@needs_fp8
def test_module_moves_keep_float32_and_pooling():
    r = DelayedScaling(amax_history_len=3, margin=6)
    m = torch.nn.Module()
    m.fp8_state = ScalingState.for_linear(r)
    m.fp8_state.scale.fill_(4.0)
    m.half()
    assert m.fp8_state.scale.dtype == torch.float32 and m.fp8_state.scale[0].item() == 4.0
    d = copy.deepcopy(m)
    d.fp8_state.ensure_pooled()
    assert d.fp8_state.scale.data_ptr() != m.fp8_state.scale.data_ptr()
    with te.autocast(recipe=r):
        quantize_with_state(torch.ones(2, 2), d.fp8_state, INPUT)
    assert d.fp8_state.scale[0].item() == 448.0 / 64 and m.fp8_state.scale[0].item() == 4.0


def test_steady_cast_args_follow_pooling_format_and_history():
    """The steady-state answer of a cast's (scale, amax slot, FP8 dtype) is
    scale_of / amax_of / fp8_dtype's: None before the tensor has a history,
    then the live views; a format changed in place on the recipe changes
    the dtype; a state that re-pooled (a dtype move) answers with views of
    its new columns; a buffer replaced by assignment is seen by the next
    ensure_pooled, which quantize_with_state runs before every cast."""
    r = DelayedScaling(amax_history_len=2, margin=0)
    st = ScalingState.for_linear(r)
    st.ensure_pooled()
    assert st.steady_cast_args(GRAD_OUTPUT) is None  # no history yet: the first-step rule applies
    st.note_first_cast(INPUT)
    st.note_first_cast(GRAD_OUTPUT)
    st.updated()
    for i in (INPUT, GRAD_OUTPUT):
        scale, amax, dtype = st.steady_cast_args(i)
        assert scale.data_ptr() == st.scale_of(i).data_ptr() and amax.data_ptr() == st.amax_of(i).data_ptr()
        assert dtype == st.fp8_dtype(i)
    assert st.steady_cast_args(GRAD_OUTPUT)[2] == torch.float8_e5m2  # HYBRID: gradients in E5M2
    r.fp8_format = Format.E4M3
    assert st.steady_cast_args(GRAD_OUTPUT)[2] == torch.float8_e4m3fn
    r.fp8_format = Format.HYBRID
    before = st.steady_cast_args(INPUT)[0].data_ptr()
    st.half()  # a dtype move leaves the chunk; the next use re-homes
    st.ensure_pooled()
    after = st.steady_cast_args(INPUT)
    assert after[0].data_ptr() == st.scale_of(INPUT).data_ptr() != before
    st.scale = torch.full((3,), 2.0)  # a replaced buffer: seen at the next ensure_pooled
    with te.autocast(recipe=r):
        q = quantize_with_state(torch.ones(4, 16), st, INPUT)
    assert torch.equal(q.data.float(), torch.full((4, 16), 2.0))  # cast with the new buffer's scale
    assert st.steady_cast_args(INPUT)[0].data_ptr() == st.scale.data_ptr() == st.scale_of(INPUT).data_ptr()


@needs_fp8
def test_buffer_replaced_between_forward_and_backward_is_seen(monkeypatch):
    """A state buffer assigned between a module's forward and its backward:
    the backward's gradient cast reads the new buffer's scale (the kept
    steady answers see the replacement and the full path re-homes the
    state), exactly as with the steady path switched off."""
    grads = []
    for steady in (True, False):
        if not steady:
            monkeypatch.setattr(ScalingState, "steady_cast_args", lambda self, index: None)
        torch.manual_seed(0)
        lin = te.Linear(128, 128, bias=False, params_dtype=torch.float32)
        x = torch.randn(32, 128)
        for _ in range(2):  # steady state: every tensor has a history
            with te.autocast(recipe=DelayedScaling()):
                lin(x).sum().backward()
        xi = x.clone().requires_grad_()
        with te.autocast(recipe=DelayedScaling()):
            y = lin(xi)
        lin.fp8_state.scale = torch.full((3,), 2.0 ** -10)
        y.backward(torch.randn(32, 128, generator=torch.Generator().manual_seed(1)))
        grads.append(xi.grad)
    assert torch.equal(grads[0], grads[1])


def test_moved_or_dead_states_leave_their_chunk():
    from seqfuse.quantization.state import POOL
    r = DelayedScaling(amax_history_len=2, margin=11)
    a, b = ScalingState.for_linear(r), ScalingState.for_linear(r)
    assert a._chunk_ref is None  # pooled lazily, at first use
    a.amax_of(0), b.amax_of(0)
    chunk = a._chunk_ref()
    assert chunk is b._chunk_ref() and chunk.live == 6
    c = copy.deepcopy(a)
    c.ensure_pooled()
    assert chunk.live == 9 and c._chunk_ref() is chunk
    del b, c
    import gc
    gc.collect()
    assert chunk.live == 3
    a.half()  # a dtype move re-homes at the next use; the old columns stop counting
    assert chunk.live == 0 and chunk not in list(POOL.chunks_for("max", 11))
    a.scale_of(0)
    assert a._chunk_ref().live == 3


@needs_fp8
def test_stats_log(tmp_path):
    r = DelayedScaling(amax_history_len=2, margin=7)
    model = torch.nn.Module()
    model.layer = torch.nn.Module()
    model.layer.fp8_state = ScalingState.for_linear(r)
    seqfuse.quantization.name_states(model)
    path = tmp_path / "stats.jsonl"
    seqfuse.quantization.enable_stats(every=2, path=str(path))
    try:
        x = torch.tensor([[1e-9, 1.0, 1000.0, 0.0]])
        for _ in range(4):
            with te.autocast(recipe=r):
                quantize_with_state(x, model.layer.fp8_state, INPUT)
        recs = seqfuse.quantization.stats_records()
    finally:
        seqfuse.quantization.disable_stats()
    assert [rec["step"] for rec in recs] == [0, 2]
    assert recs[0]["layer"] == "layer.fp8_state" and recs[0]["index"] == INPUT
    scale2 = np.float32(448.0) / np.float32(1000.0) / np.float32(128)
    # step 0, no history yet: the cast's own amax (not the initial scale 1, which saturates 1000 > 448)
    assert recs[0]["amax"] == 1000.0 and recs[0]["scale"] == pytest.approx(float(scale2), rel=1e-7)
    assert recs[0]["underflow"] == 0.25 and recs[0]["saturated"] == 0.0  # 1e-9 -> 0
    assert recs[1]["scale"] == pytest.approx(float(scale2), rel=1e-7)
    assert len(path.read_text().splitlines()) == 2


# ---- CUDA ---------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("h, n", [(16, 1000), (1, 37), (2, 5), (129, 3), (130, 64), (1024, 300), (1500, 7)])
def test_cuda_update_bit_identical(algo, h, n, seed):
    """The CUDA update (one CTA per column, the roll in chunks of its
    threads) against the CPU loop, bit for bit, over three steps: history
    lengths around the chunk size (128), the default 1,024 and longer, with
    zeros, subnormals, infinities and NaNs in the columns."""
    rng = np.random.default_rng(seed)
    hist = torch.from_numpy((rng.random((h, n)) * 100).astype(np.float32))
    hist[:, ::7] = 0
    hist[min(3, h - 1), ::11] = float("inf")
    hist[min(5, h - 1), ::13] = float("nan")
    hist[0, ::17] = 1e-39
    fmax = torch.where(torch.rand(n) < 0.5, 448.0, 57344.0)
    scale = torch.from_numpy(rng.random(n).astype(np.float32) + 0.5)
    c = [hist.clone(), scale.clone(), torch.empty(n)]
    g = [hist.cuda(), scale.cuda(), torch.full((n,), float("nan"), device="cuda")]
    for _ in range(3):
        ops.fp8_scale_update(c[0], c[1], c[2], fmax, algo, 2)
        ops.fp8_scale_update(g[0], g[1], g[2], fmax.cuda(), algo, 2)
        for a, b in zip(c, g):
            assert torch.equal(a.view(torch.int32), b.cpu().view(torch.int32))


@pytest.mark.cuda
def test_cuda_update_strided_history_leaves_other_columns():
    """A history that is a column slice of a wider tensor (the pool's chunk
    views): the update writes its own columns only, as the CPU loop does."""
    torch.manual_seed(0)
    wide = torch.rand(300, 50) * 10
    wide[7, 3] = float("nan")
    c, g = wide.clone(), wide.cuda()
    fmax = torch.full((20,), 448.0)
    sc, sg = torch.ones(20), torch.ones(20, device="cuda")
    si_c, si_g = torch.empty(20), torch.empty(20, device="cuda")
    for _ in range(2):
        ops.fp8_scale_update(c[:, 10:30], sc, si_c, fmax, "max", 1)
        ops.fp8_scale_update(g[:, 10:30], sg, si_g, fmax.cuda(), "max", 1)
    assert torch.equal(c.view(torch.int32), g.cpu().view(torch.int32))
    assert torch.equal(sc.view(torch.int32), sg.cpu().view(torch.int32))
    bits = wide.view(torch.int32)  # (bit for bit: column 3 holds a NaN)
    assert torch.equal(g[:, :10].cpu().view(torch.int32), bits[:, :10])
    assert torch.equal(g[:, 30:].cpu().view(torch.int32), bits[:, 30:])


@pytest.mark.cuda
def test_cuda_states_autocast_no_sync():
    r = DelayedScaling(amax_history_len=4, margin=9)
    states = [ScalingState.for_linear(r, device="cuda") for _ in range(8)]
    x = torch.randn(64, 64, device="cuda")
    with no_host_sync(), te.autocast(recipe=r):
        for st in states:
            quantize_with_state(x, st, INPUT, transpose=True)
    expect = np.float32(448.0) / np.float32(x.abs().max().item()) / np.float32(512)
    assert all(st.scale[INPUT].item() == expect for st in states)


@needs_fp8
def test_quantize_current_and_float8tensor(seed):
    from seqfuse.quantization import Float8Tensor, quantize, quantize_current
    x = torch.randn(48, 32) * 7
    q = quantize_current(x, torch.float8_e4m3fn, transpose=True)
    assert isinstance(q, Float8Tensor) and q.data.shape == (48, 32) and q.data_t.shape == (32, 48)
    s = torch.tensor(448.0) / x.abs().max()
    assert torch.equal(q.data.view(torch.uint8), (x * s).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8))
    assert torch.equal(q.data_t.view(torch.uint8), q.data.view(torch.uint8).t())
    assert q.scale_inv.item() == (1 / s).item()
    assert torch.equal(q.dequantize(), q.data.float() * q.scale_inv)
    only_t = quantize(x, torch.ones(1), None, "e5m2", transpose=True, rowwise=False)
    assert only_t.data is None and only_t.shape == (48, 32) and only_t.fp8_dtype == torch.float8_e5m2
    assert torch.equal(only_t.dequantize(), x.to(torch.float8_e5m2).float())
    with pytest.raises(ValueError, match="rowwise=False needs transpose=True"):
        quantize(x, torch.ones(1), None, torch.float8_e4m3fn, rowwise=False)
