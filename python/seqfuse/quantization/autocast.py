"""autocast: where FP8 (or FP4) is on, with which recipe, and the end-of-step
work of delayed scaling.

    with seqfuse.pytorch.autocast(enabled=True, recipe=DelayedScaling(),
                                  amax_reduction_group=group):
        y = model(x)
    y.sum().backward()

Modules ask ``is_fp8_enabled()`` / ``get_recipe()`` (or ``autocast_state()``)
in their forward.  When the outermost autocast region exits, seqfuse runs
the step's update for its DelayedScaling recipe and for every other one a
region inside it ran with (each distinct setting once):

  1. one all-reduce (MAX) of the flat row-0 amax buffer of each state chunk
     across ``amax_reduction_group`` (default: the default process group when
     torch.distributed is initialized with more than one rank and
     recipe.reduce_amax), and
  2. one fp8_scale_update launch per chunk over every state in it.

Forward amaxes (inputs, weights) of this step are in row 0 by then.  The
backward amaxes (output gradients) of a step are accumulated during its
backward, after the region has exited; they sit in row 0 until the next
step's exit folds them in with that step's forward amaxes.  So the backward
of step t+1 uses scales computed from amaxes up to the backward of step t --
what Transformer Engine's end-of-backward update gives -- with one update
launch and one collective per step instead of two, and no hook on autograd.
Nothing here synchronizes the host.

quantized_model_init (alias fp8_model_init) is TE's context for FP8-only
weights; seqfuse's modules keep their weights in high precision and cast them
once per weight update, so it records its setting
(``quantized_model_init_state()``) and says so in a WARNING, once.
"""
import contextlib
import logging
import threading

import torch

from ..common.recipe import DelayedScaling, Recipe
from ..ops import quant as qops
from . import stats
from ._autocast_state import (AutocastState, autocast_state, get_amax_reduction_group, get_recipe,
                              is_fp8_enabled)
from .state import FIRST_CASTS, POOL

__all__ = ["AutocastState", "autocast_state", "is_fp8_enabled", "get_recipe", "get_amax_reduction_group",
           "reduce_and_update", "autocast", "fp8_autocast", "quantized_model_init", "fp8_model_init",
           "quantized_model_init_state"]


#: (fixed for the process: asked once, not at every step's update)
_DISTRIBUTED = torch.distributed.is_available()


def _default_group(recipe, group):
    if group is not None:
        return group
    if (getattr(recipe, "reduce_amax", True) and _DISTRIBUTED
            and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1):
        return torch.distributed.group.WORLD
    return None


def reduce_and_update(recipe, group=None, *, nested=()):
    """The end-of-step work of delayed scaling for every state made under a
    recipe with these settings: one all-reduce of the amaxes per chunk (if a
    group applies) and one fused update launch per chunk.  ``nested``: the
    (recipe, group) pairs of regions opened inside with recipes of their
    own, whose states are updated too (each distinct setting once).  autocast
    calls it at the outermost exit; call it yourself when running without
    autocast."""
    seen, updated = set(), []
    for r, g in ((recipe, group), *nested):
        if not isinstance(r, DelayedScaling):
            continue
        g = _default_group(r, g)
        algo, margin, history_len = r.amax_compute_algo, int(r.margin), int(r.amax_history_len)
        key = (algo, margin, history_len, id(g))
        if key in seen:
            continue
        seen.add(key)
        for chunk in POOL.chunks_for(algo, margin):
            if chunk.key[1] != history_len or chunk in updated:  # (key: device, history length, algo, margin)
                continue
            updated.append(chunk)
            history, scale, scale_inv, fp8_max = chunk.used_views()
            if g is not None:
                torch.distributed.all_reduce(history[0], op=torch.distributed.ReduceOp.MAX, group=g)
            stats.before_update(chunk)
            qops.fp8_scale_update(history, scale, scale_inv, fp8_max, algo, margin)
    if not seen:
        return
    if FIRST_CASTS:  # empty in steady state
        for state in list(FIRST_CASTS):
            if any(state.pooled_in(c) for c in updated):
                state.updated()
    stats.end_step()


#: per thread: the (recipe, group) of each region opened inside the outermost enabled one with a recipe or
#: group of its own (its states need the update at the outermost exit too)
_nested = threading.local()


def _nested_regions():
    regions = getattr(_nested, "regions", None)
    if regions is None:
        regions = _nested.regions = []
    return regions


def _check_context_args(op, recipe, or_none, flags, recipe_goes_in):
    """The argument checks autocast and quantized_model_init share: ``recipe``
    a seqfuse recipe or None, each of ``flags`` ((name, value) pairs) a bool;
    a recipe passed as a flag is told where it goes (``recipe_goes_in``)."""
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(f"{op}: argument 'recipe' must be a seqfuse.common.recipe recipe{or_none}, "
                        f"got {type(recipe).__name__}")
    for name, flag in flags:
        if isinstance(flag, Recipe) or not isinstance(flag, (bool, int)):
            raise TypeError(f"{op}: argument '{name}' must be a bool, got {type(flag).__name__}"
                            + (f" (a recipe goes in {recipe_goes_in})" if isinstance(flag, Recipe) else ""))


@contextlib.contextmanager
def autocast(enabled=True, *, recipe=None, amax_reduction_group=None, calibrating=False):
    """Run the region with quantized GEMMs under ``recipe`` (default
    DelayedScaling()).  Nested regions inherit and restore; the delayed-
    scaling update runs when the outermost enabled region exits, for its
    recipe and for every other DelayedScaling recipe (or amax reduction
    group) a region inside it ran with."""
    # (fp8_autocast(True, SomeRecipe()) puts the recipe in 'calibrating', TE's second argument)
    _check_context_args("autocast", recipe, "", (("enabled", enabled), ("calibrating", calibrating)),
                        "'recipe', fp8_autocast's 'fp8_recipe'")
    s = autocast_state()
    saved = s.settings()
    inside = saved[0] or saved[3]  # an enclosing region is on: this one is not the outermost
    # where the nested regions this one may update at its exit begin (an enabled region inside a
    # disabled one inside an enabled one takes only its own: the outer region's stay for the outer exit)
    mark = len(_nested_regions())
    s.enabled = bool(enabled)
    if recipe is None:
        if saved[0]:  # inherited from the enclosing enabled region
            recipe = saved[1]
        elif enabled or calibrating:
            recipe = DelayedScaling()
        # else None: get_recipe() answers DelayedScaling() for a disabled region, which builds and
        # checks no recipe (the common `autocast(enabled=use_fp8)` with FP8 off)
    s.recipe = recipe
    s.amax_reduction_group = amax_reduction_group if amax_reduction_group is not None else saved[2]
    s.calibrating = bool(calibrating)
    if inside and (enabled or calibrating) and (recipe is not saved[1] or s.amax_reduction_group is not saved[2]):
        _nested_regions().append((recipe, s.amax_reduction_group))
    ok = False
    try:
        yield s
        ok = True
    finally:
        recipe_now, group_now = s.recipe, s.amax_reduction_group
        was_enabled = s.enabled or s.calibrating
        s.restore(saved)
        outermost_exit = was_enabled and not (s.enabled or s.calibrating)
        # a region inside a checkpointed function is left again in its
        # recompute (the backward): the step's update ran at the forward's exit
        if outermost_exit:
            regions = _nested_regions()
            nested = tuple(regions[mark:])
            del regions[mark:]
            if ok and not s.recomputing:
                reduce_and_update(recipe_now, group_now, nested=nested)


def fp8_autocast(enabled=True, calibrating=False, fp8_recipe=None, fp8_group=None, _graph=False):
    """Transformer Engine's older spelling of :func:`autocast`."""
    return autocast(enabled=enabled, recipe=fp8_recipe, amax_reduction_group=fp8_group,
                    calibrating=calibrating)


class _InitState:
    __slots__ = ("enabled", "recipe", "preserve_high_precision_init_val")

    def __init__(self):
        self.enabled, self.recipe, self.preserve_high_precision_init_val = False, None, False


_init_local = threading.local()


def quantized_model_init_state():
    """(enabled, recipe, preserve_high_precision_init_val) for modules being
    constructed now."""
    s = getattr(_init_local, "state", None)
    if s is None:
        s = _init_local.state = _InitState()
    return s


_logged_high_precision_weights = False


@contextlib.contextmanager
def quantized_model_init(enabled=True, recipe=None, preserve_high_precision_init_val=False):
    """TE's context for building modules whose weights live only in FP8.
    seqfuse's modules keep their weights in high precision and cast them to
    FP8 once per weight update under autocast (the same forward values as
    FP8 weights cast from them; the high-precision copy's memory is not
    saved): with enabled=True this says so in a log line, once per process,
    and records the setting (quantized_model_init_state())."""
    global _logged_high_precision_weights
    _check_context_args("quantized_model_init", recipe, " or None",
                        (("enabled", enabled), ("preserve_high_precision_init_val", preserve_high_precision_init_val)),
                        "'recipe'")
    if enabled and not _logged_high_precision_weights:
        _logged_high_precision_weights = True
        logging.getLogger("seqfuse").warning(
            "quantized_model_init: seqfuse keeps module weights in high precision and casts them to FP8 once per "
            "weight update under autocast (the weights' memory is not reduced to FP8)")
    s = quantized_model_init_state()
    saved = (s.enabled, s.recipe, s.preserve_high_precision_init_val)
    s.enabled = bool(enabled)
    s.recipe = recipe if recipe is not None else DelayedScaling()
    s.preserve_high_precision_init_val = bool(preserve_high_precision_init_val)
    try:
        yield s
    finally:
        s.enabled, s.recipe, s.preserve_high_precision_init_val = saved


def fp8_model_init(enabled=True, recipe=None, preserve_high_precision_init_val=False):
    """Transformer Engine's older spelling of :func:`quantized_model_init`."""
    return quantized_model_init(enabled, recipe, preserve_high_precision_init_val)
