"""benchmarks/bench_fp8_host.py: the kernel stubs are in place only inside the
measurement (seqfuse works normally afterwards, even when the measured code
raises), and a layer's host time comes out for bf16 and each FP8 recipe."""
import os
import sys

import pytest
import torch

import seqfuse
from helpers import needs_fp8

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench_fp8_host  # noqa: E402


def test_stubs_restored_even_on_error():
    real = seqfuse._C.gemm
    with pytest.raises(RuntimeError, match="inside"):
        with bench_fp8_host.stubbed_kernels():
            assert seqfuse._C.gemm is not real and seqfuse._C.gemm(1, 2, x=3) is None
            raise RuntimeError("inside")
    assert seqfuse._C.gemm is real
    a, b = torch.randn(16, 32), torch.randn(8, 32)
    assert torch.allclose(seqfuse.ops.gemm(a, b, transb=True), a @ b.t(), rtol=1e-5, atol=1e-5)


@needs_fp8
def test_host_time_per_recipe():
    from seqfuse.common.recipe import DelayedScaling, Float8BlockScaling

    runners = [bench_fp8_host.layer_runner(recipe, torch.device("cpu"), update)
               for recipe in (None, DelayedScaling(), Float8BlockScaling()) for update in (True, False)]
    times = bench_fp8_host.host_us(runners, iters=3, rounds=2)
    assert len(times) == 6 and all(0 < us < 1e6 for us in times)


@needs_fp8
def test_every_entry_the_layer_calls_is_stubbed(monkeypatch):
    """An entry of seqfuse._C that the measured layer calls but STUBBED
    leaves out would run its kernel inside the host measurement (on the
    CPU: a whole quantization per call): none may be reached, under any
    recipe and weight setting."""
    from seqfuse import _C
    from seqfuse.common.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling

    reached = set()

    def recorder(name):
        def call(*args, **kwargs):
            reached.add(name)
        return call

    for name in dir(_C):
        if not name.startswith("_") and callable(getattr(_C, name)) and name not in bench_fp8_host.STUBBED:
            monkeypatch.setattr(_C, name, recorder(name))
    for recipe in (None, DelayedScaling(), Float8CurrentScaling(), Float8BlockScaling()):
        for update in (True, False):
            run = bench_fp8_host.layer_runner(recipe, torch.device("cpu"), update)
            with bench_fp8_host.stubbed_kernels():
                run(2)
    assert not reached


def test_profile_prints_one_row_and_counts_factory_calls(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench_fp8_host.py", "--profile", "bf16", "--iters", "2"])
    bench_fp8_host.main()
    out = capsys.readouterr().out
    head = next(line for line in out.splitlines() if line.startswith("== bf16"))
    count = float(head.split("cProfile; ")[1].split()[0])
    assert count > 0, head  # bf16 allocates its outputs through torch.empty: a name cProfile no longer matches reads 0
    assert "ncalls" in out and "tottime" in out


@pytest.mark.parametrize("flags", [["--iters", "0"], ["--rounds", "0"]])
def test_iters_and_rounds_below_one_refused(monkeypatch, capsys, flags):
    monkeypatch.setattr(sys, "argv", ["bench_fp8_host.py", *flags])
    with pytest.raises(SystemExit) as e:
        bench_fp8_host.main()
    assert e.value.code == 2 and "--iters and --rounds must be at least 1" in capsys.readouterr().err


def test_step_work_none_drops_gradients_and_bumps_versions_without_a_kernel(monkeypatch):
    """--step-work none (the default): after each iteration every gradient
    is gone (zero_grad's effect) and, with updated weights, each weight's
    version has moved though no in-place kernel ran on it; 'kernels' keeps
    the earlier definition (gradients accumulate, a multiply per weight)."""
    muls = []
    real_mul_ = torch.Tensor.mul_
    monkeypatch.setattr(torch.Tensor, "mul_", lambda t, *a: (muls.append(t.shape), real_mul_(t, *a))[1])
    run = bench_fp8_host.layer_runner(None, torch.device("cpu"), True)
    cells = {c.cell_contents for c in run.__closure__ if isinstance(c.cell_contents, torch.nn.Module)}
    weights = [p for m in cells for p in m.parameters() if p.dim() == 2]
    before = [w._version for w in weights]
    with bench_fp8_host.stubbed_kernels():
        run(2)
    assert not muls and all(w._version > v for w, v in zip(weights, before))
    assert all(p.grad is None for m in cells for p in m.parameters())
    run = bench_fp8_host.layer_runner(None, torch.device("cpu"), True, step_work="kernels")
    cells = {c.cell_contents for c in run.__closure__ if isinstance(c.cell_contents, torch.nn.Module)}
    with bench_fp8_host.stubbed_kernels():
        run(2)
    assert len(muls) == 8 and all(p.grad is not None for m in cells for p in m.parameters())
    with pytest.raises(ValueError, match="step_work must be 'none' or 'kernels'"):
        bench_fp8_host.layer_runner(None, torch.device("cpu"), True, step_work="optimizer")


def test_rounds_rotate_the_order(monkeypatch):
    """Each round starts one runner later, so no row is always the one timed
    right after another precision's (cold code) and each is timed once a round."""
    order = []
    runners = [lambda n, i=i: order.append(i) for i in range(3)]
    times = bench_fp8_host.host_us(runners, iters=10, rounds=3)
    assert len(times) == 3
    assert order[3:] == [0, 1, 2, 1, 2, 0, 2, 0, 1]  # (after the warm-up call of each)


def test_parts_replace_each_part_only_inside_its_rows_and_restore_it():
    """--parts: every variant row runs with its part replaced by a lookup of
    the part's first result (the real method called once per key, not per
    step) and the real methods are back afterwards, also for the autocast
    exit's update."""
    from seqfuse.common.recipe import DelayedScaling
    from seqfuse.quantization import gemm_quantizers as gq
    import importlib

    autocast_mod = importlib.import_module("seqfuse.quantization.autocast")
    real = (gq.WeightQuantizer.get, gq.GradQuantizer.quantize_grad, gq._Role.quantize,
            autocast_mod.reduce_and_update)
    calls = []

    class Probe:
        def get(self, w):
            calls.append(w)
            return w * 2

    stand_in = bench_fp8_host._memoized(Probe, "get", lambda probe, w: w)
    probe = Probe()
    assert [stand_in(probe, 3), stand_in(probe, 3), stand_in(probe, 4)] == [6, 6, 8] and calls == [3, 4]

    rows = bench_fp8_host.parts_us("fp8_delayed", DelayedScaling(), torch.device("cpu"), iters=2, rounds=1)
    labels = [label for label, _ in rows]
    assert labels[:2] == ["bf16", "fp8_delayed"] and len(labels) == 6
    assert all(label.startswith("fp8_delayed without ") for label in labels[2:])
    assert all(us > 0 for _, us in rows)
    assert (gq.WeightQuantizer.get, gq.GradQuantizer.quantize_grad, gq._Role.quantize,
            autocast_mod.reduce_and_update) == real


def test_layers_below_one_refused(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench_fp8_host.py", "--layers", "0"])
    with pytest.raises(SystemExit) as e:
        bench_fp8_host.main()
    assert e.value.code == 2 and "--layers must be at least 1, got 0" in capsys.readouterr().err


def test_layers_stack_runs_every_layer_inside_one_region(monkeypatch):
    """--layers N: each iteration runs N layers (every layer's weights get a
    gradient and a version bump) inside one autocast region (one delayed-
    scaling update per iteration, not one per layer)."""
    from seqfuse.common.recipe import DelayedScaling
    import importlib
    autocast_mod = importlib.import_module("seqfuse.quantization.autocast")
    updates = []
    real = autocast_mod.reduce_and_update
    monkeypatch.setattr(autocast_mod, "reduce_and_update", lambda *a, **k: (updates.append(1), real(*a, **k))[1])
    torch.manual_seed(0)
    run = bench_fp8_host.layer_runner(DelayedScaling(), torch.device("cpu"), update=True, layers=3)
    from seqfuse.modules import Linear
    seen = []
    orig = Linear.forward
    monkeypatch.setattr(Linear, "forward", lambda self, *a, **k: (seen.append(id(self)), orig(self, *a, **k))[1])
    with bench_fp8_host.stubbed_kernels():
        run(2)
    assert len(set(seen)) == 3 and len(seen) == 6  # three layers' projections, each once an iteration
    assert len(updates) == 2  # one update per region (per iteration)


def test_real_kernels_mode_runs_the_kernels_and_labels_its_rows(monkeypatch):
    """--kernels real: nothing is stubbed (the C entries are called) and each
    row says so in the JSON's 'kernels' column."""
    from seqfuse import _C

    calls = []
    real_gemm = _C.gemm
    monkeypatch.setattr(_C, "gemm", lambda *a: (calls.append(1), real_gemm(*a))[1])
    monkeypatch.setattr(sys, "argv", ["bench_fp8_host.py", "--kernels", "real", "--iters", "1", "--rounds", "1"])
    saved = {}
    monkeypatch.setattr(bench_fp8_host.Table, "save", lambda self, extra=None: saved.setdefault("rows", self.rows))
    bench_fp8_host.main()
    assert calls and all(r["kernels"] == "real" for r in saved["rows"]) and len(saved["rows"]) == 8


@needs_fp8
def test_c_calls_per_layer_step(monkeypatch):
    """The C calls a layer step makes (each a launch or more on the GPU): the
    counter restores every entry, and the FP8 rows make the calls their
    design says -- the bias gradients come out of the gradient casts' own
    calls (no column_sums call), current scaling's biased gradient casts are
    one call each (not amax, scale, cast and sum).  The scaling states live
    in a pool of their own here: delayed scaling's update makes one call per
    pool chunk holding live states, so states other tests of this process
    keep alive would add calls."""
    from seqfuse import _C
    from seqfuse.common.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling
    import importlib

    state_mod = importlib.import_module("seqfuse.quantization.state")
    autocast_mod = importlib.import_module("seqfuse.quantization.autocast")  # (the package's autocast is the function)
    pool = type(state_mod.POOL)()
    monkeypatch.setattr(state_mod, "POOL", pool)
    monkeypatch.setattr(autocast_mod, "POOL", pool)

    real = _C.gemm
    counts = {}
    for name, recipe in (("bf16", None), ("delayed", DelayedScaling()), ("current", Float8CurrentScaling()),
                         ("block", Float8BlockScaling())):
        for update in (True, False):
            counts[name, update] = bench_fp8_host.c_calls_per_layer(
                bench_fp8_host.layer_runner(recipe, torch.device("cpu"), update))
    assert _C.gemm is real
    assert counts["bf16", True] == {"gemm": 12, "layernorm_backward": 2, "layernorm_forward": 4}
    for name in ("delayed", "current", "block"):
        assert "column_sums" not in counts[name, True] and "amax" not in counts[name, True]
        assert counts[name, True]["gemm"] == 12
    assert counts["current", True]["cast_fp8_current"] == 12  # 4 weights, 4 activations, 4 gradients
    assert sum(counts["delayed", True].values()) == 31 and sum(counts["current", True].values()) == 30
    assert sum(counts["block", True].values()) == 30
    # unchanged weights: the four weight casts are not made
    for name in ("delayed", "current", "block"):
        assert sum(counts[name, False].values()) == sum(counts[name, True].values()) - 4
