"""make_graphed_callables: CUDA graphs of seqfuse modules, FP8 included
(Transformer Engine's name and arguments).

torch.cuda.make_graphed_callables captures a callable's forward and
backward into two CUDA graphs; this wraps it so the capture runs under
seqfuse's FP8 autocast.  What makes FP8 graphable is already in the design:
every scale, scale inverse and amax lives in GPU memory at an address that
does not move (the ScalingState pools), the casts read scales and fold
amaxes on the device, and nothing in a step synchronizes the host.  So the
graphs hold every cast of the layer, the weight casts included (a captured
weight cast runs at each replay, from the weight's values then, into the
same buffers), and every amax they record lands in this step's row of the
amax history.

The delayed-scaling update (roll the history, new scales; one launch per
pool chunk for the whole model) is once per step, not once per layer, so it
is not inside a layer's graph: call the graphed callables inside
``autocast(recipe=...)`` as the eager ones, and the update runs at the
region's exit exactly as in eager mode.

Before the capture the caching allocator's free blocks are handed back to
the driver (torch.cuda.empty_cache): the graphs' private memory pool cannot
reuse them, so blocks cached by eager steps before graphing would otherwise
stay reserved beside it for the whole run.

Warm-up and capture run the callables a few times; the FP8 scaling state
(amax history, scales) is put back afterwards, so graphing leaves training
where it was.

The first step of a fresh model: under delayed scaling a tensor with no
amax history yet takes its scale from its own amax (quantize_with_state),
a choice the host makes per step and a replay cannot repeat (the graph
holds the initial scale 1, where small gradients underflow E5M2).  So a
graphed module whose FP8 tensors have no history yet runs eagerly (logged
once) until they have one: the forward's casts get it at the first
autocast exit, the gradients' (cast in the backward, after that exit) at
the second, so the first two forwards run eagerly; the graphs replay from
then on.  A module warmed up eagerly before graphing never takes this
route.  The eager steps' activations sit beside the graphs' private memory
pool, which already holds the graphed steps' own, so those two steps peak
higher than any graphed step; a model graphed after two eager training
steps never takes this route (the ESM-2 peak memory row in full,
benchmarks/results/PERFORMANCE_HISTORY.md, has the figures).  A graphed
plain callable (not an nn.Module) has no such guard: its
first replays run at scale 1, and a warning says so.

Gradient accumulation: torch's graphed backward hands each parameter's
gradient out as a detached view of the graph's static output buffer, and
autograd, finding the parameter's .grad empty, keeps that very tensor as
.grad (it "steals" a gradient nobody else references).  The next replay
then overwrites the buffer, so a second micro-batch's backward would
replace the first one's gradient and add itself to it.  So every parameter of a graphed module gets a hook
that hands autograd a copy when .grad is still empty (the first
micro-batch of a step; later ones add in place and need none).  Keeping
the buffer itself as .grad would save that copy, but it is not the
backward graph's alone: the graphs of a capture share one memory pool,
and the next forward replay of any of them writes its temporaries where
the backward's buffers lie.  Such a design must copy .grad out before any
replay in the pool and before a second backward through one forward
(tests/test_graphs_first_step.py has a stand-in of that behaviour).
"""
import logging

import torch

from ..common.recipe import DelayedScaling
from .autocast import autocast
from .gemm_quantizers import init_fp8_state
from .state import ScalingState, restore_scaling, snapshot_scaling

_log = logging.getLogger("seqfuse")
_first_step_logged = []

__all__ = ["make_graphed_callables"]


def _one_of(old_name, old, new_name, new, default):
    """The value of an argument TE 2.20 renamed (``old_name`` -> ``new_name``):
    whichever of the two was given, else ``default``; both given is a
    ValueError naming both (as in TE)."""
    if old is not None and new is not None:
        raise ValueError(f"make_graphed_callables: give '{new_name}' or its older name '{old_name}', not both")
    return old if old is not None else (new if new is not None else default)


def make_graphed_callables(modules, sample_args, num_warmup_iters=3, allow_unused_input=False,
                           sample_kwargs=None, fp8_enabled=None, fp8_calibrating=None,
                           fp8_recipe=None, fp8_group=None, fp8_weight_caching=None, enabled=None,
                           calibrating=None, recipe=None, amax_reduction_group=None, cache_quantized_params=None,
                           *, pool=None, _order=None, retain_graph_in_backward=False):
    """Graphed versions of ``modules`` (a module or callable, or a tuple of
    them with a tuple of sample-argument tuples), as
    torch.cuda.make_graphed_callables returns them, captured with FP8 on
    when ``enabled`` (``recipe``, default DelayedScaling()).

    TE 2.20's names and their older ones are both taken, in TE's order:
    ``enabled`` / ``fp8_enabled``, ``calibrating`` / ``fp8_calibrating``,
    ``recipe`` / ``fp8_recipe``, ``amax_reduction_group`` / ``fp8_group``,
    ``cache_quantized_params`` / ``fp8_weight_caching`` (one of each pair).
    Run the result inside ``seqfuse.pytorch.autocast`` with the same recipe
    (the delayed-scaling update runs at that region's exit).
    ``cache_quantized_params`` is accepted for TE's signature: weights are
    cast at every replay (a graph cannot know whether the optimizer stepped).
    TE's pipeline-schedule arguments (``_order``) and keyword sample
    arguments are not supported and raise."""
    fp8_enabled = _one_of("fp8_enabled", fp8_enabled, "enabled", enabled, False)
    fp8_calibrating = _one_of("fp8_calibrating", fp8_calibrating, "calibrating", calibrating, False)
    fp8_recipe = _one_of("fp8_recipe", fp8_recipe, "recipe", recipe, None)
    fp8_group = _one_of("fp8_group", fp8_group, "amax_reduction_group", amax_reduction_group, None)
    _one_of("fp8_weight_caching", fp8_weight_caching, "cache_quantized_params", cache_quantized_params, False)
    if _order is not None:
        raise NotImplementedError("make_graphed_callables: argument '_order' (pipeline-parallel capture "
                                  "order) is not supported")
    if sample_kwargs:
        raise NotImplementedError("make_graphed_callables: argument 'sample_kwargs' is not supported: "
                                  "pass every input positionally in sample_args")
    if retain_graph_in_backward:
        raise NotImplementedError("make_graphed_callables: argument 'retain_graph_in_backward' is not "
                                  "supported")
    if not torch.cuda.is_available():
        raise RuntimeError("make_graphed_callables: CUDA graphs need a CUDA device")
    single = not isinstance(modules, tuple)
    callables = (modules,) if single else modules
    args = (sample_args,) if single else sample_args
    if len(callables) != len(args):
        raise ValueError(f"make_graphed_callables: {len(callables)} callables but {len(args)} sample "
                         f"argument tuples")
    recipe = (fp8_recipe if fp8_recipe is not None else DelayedScaling()) if fp8_enabled else None
    modules_in = torch.nn.ModuleList(c for c in callables if isinstance(c, torch.nn.Module))
    if recipe is not None:
        init_fp8_state(modules_in, recipe)
    saved = snapshot_scaling(modules_in)
    eager_forwards = [c.forward if isinstance(c, torch.nn.Module) else None for c in callables]
    # the graphs' private pool cannot reuse blocks the caching allocator keeps for eager work (earlier
    # training steps' activations): handed back first, they do not sit beside the pool for the run
    torch.cuda.empty_cache()
    try:
        with autocast(enabled=bool(fp8_enabled), recipe=recipe, amax_reduction_group=fp8_group,
                      calibrating=fp8_calibrating):
            graphed = torch.cuda.make_graphed_callables(
                callables, tuple(args), num_warmup_iters=num_warmup_iters,
                allow_unused_input=allow_unused_input, pool=pool)
        # the tensors first cast while graphing: they have no history once the snapshot is back
        cast_while_graphing = {id(st): set().union(*st.history_note()) for st, *_ in saved}
    finally:
        restore_scaling(saved)  # in place: the graphs hold these addresses
    for c, eager_forward in zip(callables, eager_forwards):
        if eager_forward is None:
            if isinstance(recipe, DelayedScaling):
                _log.warning("seqfuse make_graphed_callables: a graphed callable that is not an nn.Module "
                             "gets no first-step protection: under delayed scaling its first replays cast "
                             "with the initial scale 1 (small gradients underflow E5M2); run one eager step "
                             "before graphing it")
            continue
        pending = [(st, i) for st in c.modules() if isinstance(st, ScalingState)
                   for i in sorted(cast_while_graphing.get(id(st), set()) - st.history_note()[0])]
        if pending:
            c.forward = _eager_until_history(c, c.forward, eager_forward, pending)
    for p in modules_in.parameters():
        if p.requires_grad and not getattr(p, "_seqfuse_graph_grad_copy", False):
            p.register_hook(_grad_copy_hook(p))
            p._seqfuse_graph_grad_copy = True
    return graphed[0] if single else graphed


def _eager_until_history(module, graphed_forward, eager_forward, pending):
    """A graphed module's forward that runs eagerly while any of its
    ``pending`` (state, index) FP8 tensors lacks an amax history (the first
    step: see the module note), then hands ``module.forward`` back to the
    graphs for good (replays then pay nothing for this check)."""
    eager_calls = [0]

    def forward(*args, **kwargs):
        if any(not st.has_history(i) for st, i in pending):
            if not _first_step_logged:
                _first_step_logged.append(True)
                _log.info("seqfuse make_graphed_callables: a graphed module runs eagerly until its "
                          "delayed-scaling tensors have an amax history (the first two forwards: the "
                          "first cast takes its scale from its own amax, which a replay cannot); its "
                          "graphs replay from then on.  Those eager steps keep their activations beside "
                          "the graphs' memory pool, so they peak above the graphed steps; two eager training "
                          "steps before graphing avoid that")
            eager_calls[0] += 1
            if eager_calls[0] == _EAGER_CALLS_WARN:
                _log.warning("seqfuse make_graphed_callables: a graphed module has run eagerly %d times "
                             "and its FP8 tensors still have no amax history, so its graphs are not "
                             "replayed: call it inside autocast with the recipe it was graphed with",
                             eager_calls[0])
            return eager_forward(*args, **kwargs)
        module.forward = graphed_forward
        return graphed_forward(*args, **kwargs)
    return forward


#: eager calls of a graphed module, still without history, after which a warning says why
_EAGER_CALLS_WARN = 8


def _grad_copy_hook(param):
    """The hook of the module note's "gradient accumulation": a copy of the
    incoming gradient while ``param.grad`` is empty (autograd would keep the
    graph's buffer itself), the gradient as it is otherwise."""
    def hook(grad):
        return grad.clone() if param.grad is None else grad
    return hook
