"""make_graphed_callables' first-step rule, the checkpoint's noted choices
and gradient accumulation over graphs whose replays overwrite their
gradient buffers, on the CPU.

Delayed scaling's first casts take their scale from their own amax, a host
choice a CUDA graph replay cannot make, so a graphed module runs eagerly
until its FP8 tensors have an amax history and then hands its forward to
the graphs.  CUDA graphs need a GPU; here torch.cuda.make_graphed_callables
is replaced by a stand-in that runs the warm-up eagerly and installs a
forward that counts its "replays", which is all the rule looks at.  The
GPU test of the real graphs is tests/test_fp8_any_rows.py::
test_graphed_layer_equals_eager.
"""
import logging

import pytest
import torch

import seqfuse.pytorch as te
from seqfuse.common.recipe import DelayedScaling
from seqfuse.ops import device_checks
from seqfuse.quantization import recompute


@pytest.fixture
def fake_graphs(monkeypatch):
    """torch.cuda.make_graphed_callables' stand-in; returns the replay log."""
    replays = []
    real_capturing = device_checks.capturing

    def make_graphed_callables(callables, args, num_warmup_iters=3, allow_unused_input=False, pool=None):
        out = []
        for c, a in zip(callables, args):
            for _ in range(num_warmup_iters):
                c(*a).float().sum().backward()
            # the capture: one forward seen as captured by seqfuse's casts (its weight casts are then the
            # graph's own: the eager calls after it cast again, as after a real capture)
            monkeypatch.setattr(device_checks, "capturing", lambda where=None: True)
            try:
                c(*a).float().sum().backward()
            finally:
                monkeypatch.setattr(device_checks, "capturing", real_capturing)
            eager = c.forward if isinstance(c, torch.nn.Module) else c

            def replay(*x, _eager=eager):
                replays.append(1)
                return _eager(*x)
            if isinstance(c, torch.nn.Module):
                c.forward = replay
                out.append(c)
            else:
                out.append(replay)
        return tuple(out)

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", make_graphed_callables)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return replays


def _layer():
    torch.manual_seed(0)
    return te.Linear(64, 64, params_dtype=torch.float32, device="cpu")


def test_graphed_module_runs_eagerly_until_history_then_replays(fake_graphs, caplog):
    lin = _layer()
    r = DelayedScaling()
    with caplog.at_level(logging.INFO, logger="seqfuse"):
        g = te.make_graphed_callables(lin, (torch.randn(8, 64, requires_grad=True),), fp8_enabled=True,
                                      fp8_recipe=r)
        seen = []
        for _ in range(4):
            with te.autocast(recipe=r):
                y = g(torch.randn(8, 64))
            y.sum().backward()
            seen.append(len(fake_graphs))
    # the forward's casts get a history at step 0's exit, the gradient's at step 1's: two eager steps
    assert seen == [0, 0, 1, 2], seen
    assert lin.forward.__name__ == "replay"  # the check is gone from the forward once replays start
    assert "runs eagerly until its delayed-scaling tensors have an amax history" in caplog.text


def test_a_graphed_module_still_eager_after_eight_calls_says_why(fake_graphs, caplog):
    lin = _layer()
    g = te.make_graphed_callables(lin, (torch.randn(8, 64, requires_grad=True),), fp8_enabled=True,
                                  fp8_recipe=DelayedScaling())
    with caplog.at_level(logging.WARNING, logger="seqfuse"):
        for _ in range(8):
            g(torch.randn(8, 64))  # outside autocast: nothing is cast, no history comes
    assert fake_graphs == []
    assert "has run eagerly 8 times" in caplog.text and "call it inside autocast" in caplog.text


def test_a_graphed_plain_callable_under_delayed_scaling_warns(fake_graphs, caplog):
    lin = _layer()
    with caplog.at_level(logging.WARNING, logger="seqfuse"):
        te.make_graphed_callables(lambda x: lin(x), (torch.randn(8, 64, requires_grad=True),),
                                  fp8_enabled=True, fp8_recipe=DelayedScaling())
    assert "not an nn.Module gets no first-step protection" in caplog.text


def test_a_recompute_choice_the_forward_did_not_make_raises():
    with recompute._replaying(recompute.autocast_state().settings(), {}):
        with pytest.raises(RuntimeError, match=r"made a choice \(fused_cast\) the forward did not"):
            recompute.choice_for(("fused_cast", 1, 0), True)
    # a choice the forward noted is returned as noted, whatever the recompute computes now
    casts = {}
    with recompute._recording(casts):
        assert recompute.choice_for(("fused_cast", 1, 0), False) is False
    with recompute._replaying(recompute.autocast_state().settings(), casts):
        assert recompute.choice_for(("fused_cast", 1, 0), True) is False


@pytest.fixture
def buffered_graphs(monkeypatch):
    """A stand-in for torch.cuda.make_graphed_callables with the memory
    behaviour of real graphs: the backward hands out each gradient as a
    detached alias of a static buffer of its own, and every forward "replay"
    of any graph overwrites all of those buffers (NaN), as the forward
    graphs' temporaries, which share the capture's pool, do on a GPU."""
    pool = []  # every graph's gradient buffers

    def graph(c):
        params = list(c.parameters())
        eager = c.forward
        buffers = [torch.empty_like(p) for p in params]
        pool.extend(buffers)

        class Graphed(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, *ps):
                for b in pool:
                    b.fill_(float("nan"))
                ctx.save_for_backward(x)
                with torch.no_grad():
                    return eager(x)

            @staticmethod
            def backward(ctx, dy):
                x, = ctx.saved_tensors
                with torch.enable_grad():
                    xx = x.detach().requires_grad_(True)
                    grads = torch.autograd.grad(eager(xx), [xx, *params], dy)
                for b, g in zip(buffers, grads[1:]):
                    b.copy_(g)
                return (grads[0],) + tuple(b.detach() for b in buffers)

        c.forward = lambda x: Graphed.apply(x, *params)
        return c

    def make_graphed_callables(callables, args, num_warmup_iters=3, allow_unused_input=False, pool=None):
        return tuple(graph(c) for c in callables)

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", make_graphed_callables)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_graphed_gradients_survive_replays_and_accumulate(buffered_graphs, micro_batches):
    """Over several steps of ``micro_batches`` backward passes each, two
    graphed layers' gradients equal an eager copy's although every forward
    replay overwrites the gradient buffers the backward handed out (a
    design that keeps the buffer as .grad must copy it out before then)."""
    torch.manual_seed(0)
    eager = torch.nn.Sequential(te.Linear(32, 32, params_dtype=torch.float32, device="cpu"),
                                te.Linear(32, 32, params_dtype=torch.float32, device="cpu"))
    graphed_model = torch.nn.Sequential(*[te.Linear(32, 32, params_dtype=torch.float32, device="cpu")
                                          for _ in range(2)])
    graphed_model.load_state_dict(eager.state_dict())
    layers = te.make_graphed_callables(tuple(graphed_model), tuple((torch.randn(4, 32),) for _ in range(2)))
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    opt_g = torch.optim.SGD(graphed_model.parameters(), lr=0.1)
    for step in range(3):
        for _ in range(micro_batches):
            x = torch.randn(4, 32)
            eager(x).square().sum().backward()
            y = x
            for layer in layers:
                y = layer(y)
            y.square().sum().backward()
        for p, q in zip(eager.parameters(), graphed_model.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-5)
        opt_e.step(), opt_g.step()
        opt_e.zero_grad(), opt_g.zero_grad()
