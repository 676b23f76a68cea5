"""The FP8 weight cache's two ways through WeightQuantizer.get, and the
scaling-state pool's cached list of live chunks (issue 20's host work).

get() takes a short path (WeightQuantizer._steady) for a training loop's
steady call and the general path (lookup, _spare, _cast_weight, store) for
everything else; both must decide alike.  Here the same sequence of steps
(training steps with optimizer updates, gradient accumulation, no-grad
calls, TE's is_first_microbatch, the transpose cache switched off, a
backward left pending while the next forward runs) is run twice from the
same start, once with the short path switched off: the cast counts, the
outputs and the gradients must be equal bit for bit, and the short path
must have been taken.

_Pool.chunks_for keeps its answer until a chunk is added, starts or stops
holding live states, or the pool is cleared; a chunk tells its own pool.
"""
import copy

import pytest
import torch

import seqfuse.pytorch as te
from seqfuse.common.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling
from seqfuse.quantization import set_weight_transpose_cache, weight_casts
from seqfuse.quantization import state as state_mod
from seqfuse.quantization.gemm_quantizers import WeightQuantizer

from helpers import needs_fp8

RECIPES = {"delayed": DelayedScaling, "current": Float8CurrentScaling, "block": Float8BlockScaling}


def _module(kind):
    kw = dict(params_dtype=torch.bfloat16, device="cpu")
    if kind == "Linear":
        return te.Linear(128, 256, **kw)
    return te.LayerNormMLP(128, 256, activation="swiglu", **kw)


def _steps(m, recipe, xs):
    """The sequence; returns what each step gave (outputs, gradients, cast counts)."""
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    out = []

    def step(x, **kw):
        with te.autocast(recipe=recipe()):
            y = m(x, **kw)
        y.float().square().mean().backward()
        out.append((y.detach().clone(), [p.grad.clone() for p in m.parameters()], weight_casts(m)))

    it = iter(xs)
    for _ in range(2):  # training steps, each updating the weights
        step(next(it))
        opt.step()
        opt.zero_grad()
    step(next(it))  # gradient accumulation: the second micro-batch reuses the cast
    step(next(it))
    opt.step()
    opt.zero_grad()
    with torch.no_grad(), te.autocast(recipe=recipe()):  # a no-grad call after the update
        out.append((m(next(it)).clone(), [], weight_casts(m)))
    # a forward whose backward is still pending while the next forward runs: its buffers must not be rewritten
    with te.autocast(recipe=recipe()):
        y1 = m(next(it))
    opt.step()
    with te.autocast(recipe=recipe()):
        y2 = m(next(it))
    (y1.float().square().mean() + y2.float().square().mean()).backward()
    out.append((torch.cat([y1.detach(), y2.detach()]), [p.grad.clone() for p in m.parameters()], weight_casts(m)))
    opt.zero_grad()
    if isinstance(m, te.Linear):  # TE's is_first_microbatch
        step(next(it), is_first_microbatch=True)
        step(next(it), is_first_microbatch=False)
    previous = set_weight_transpose_cache(False)
    try:
        opt.step()
        opt.zero_grad()
        step(next(it))
    finally:
        set_weight_transpose_cache(previous)
    opt.step()
    opt.zero_grad()
    step(next(it))
    return out


@needs_fp8
@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP"])
def test_steady_path_decides_as_the_general_path(kind, recipe, seed, monkeypatch):
    torch.manual_seed(seed)
    m = _module(kind)
    twin = copy.deepcopy(m)
    xs = [torch.randn(24, 128, dtype=torch.bfloat16) for _ in range(14)]
    taken = []
    steady = WeightQuantizer._steady

    def counted(self, *args):
        pair = steady(self, *args)
        taken.append(pair is not None)
        return pair

    monkeypatch.setattr(WeightQuantizer, "_steady", counted)
    fast = _steps(m, RECIPES[recipe], xs)
    monkeypatch.setattr(WeightQuantizer, "_steady", lambda self, *args: None)
    general = _steps(twin, RECIPES[recipe], xs)
    assert any(taken), "the short path was never taken"
    assert len(fast) == len(general)
    for i, ((y, g, n), (y2, g2, n2)) in enumerate(zip(fast, general)):
        assert n == n2, f"step {i}: {n} weight casts against the general path's {n2}"
        assert torch.equal(y, y2), f"step {i}: outputs differ"
        assert len(g) == len(g2) and all(torch.equal(a, b) for a, b in zip(g, g2)), f"step {i}: gradients differ"


def test_chunks_for_follows_live_counts():
    pool, other = state_mod._Pool(), state_mod._Pool()
    key = (torch.device("cpu"), 4, "max", 0)
    c, _ = pool.allocate(key, 3)
    assert c.pool is pool and pool.chunks_for("max", 0) == ()
    c.live += 3  # (states pooled here: the kept answer is dropped)
    assert pool.chunks_for("max", 0) == (c,) and pool.chunks_for() == (c,)
    d, _ = other.allocate(key, 2)
    d.live += 2  # another pool's chunk leaves this pool's answer as it is
    assert pool.chunks_for("max", 0) == (c,) and other.chunks_for("max", 0) == (d,)
    c.live -= 1  # still live: the same answer
    assert pool.chunks_for("max", 0) == (c,)
    c2, _ = pool.allocate(key, c.capacity)  # (more than c has left: a new chunk, the answer made again)
    assert c2 is not c and pool.chunks_for("max", 0) == (c,)
    c2.live += 1
    assert pool.chunks_for("max", 0) == (c, c2)
    c.live -= 2  # c's states all died: left out, and dropped (c2 is the one allocated from)
    assert pool.chunks_for("max", 0) == (c2,) and pool.chunks[key] == [c2]
    assert pool.chunks_for("max", 1) == () and pool.chunks_for("most_recent") == ()
    pool.clear()
    assert pool.chunks_for("max", 0) == ()
