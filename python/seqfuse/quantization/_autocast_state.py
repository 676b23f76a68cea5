"""The autocast settings of this thread (enabled, recipe, amax reduction
group, calibrating), kept apart from autocast.py so that what reads them --
the modules, the checkpoint's recompute (recompute.py) -- does not import
the end-of-step machinery (autocast imports state, which imports recompute).
autocast.py sets them; everything here is re-exported there.
"""
import threading

from ..common.recipe import DelayedScaling


class AutocastState:
    """What a module sees: enabled, recipe, amax_reduction_group, calibrating."""

    # recomputing: checkpoint recomputes open on this thread (an autocast
    # left inside one must not run the step's scale update again)
    __slots__ = ("enabled", "recipe", "amax_reduction_group", "calibrating", "recomputing")

    def __init__(self):
        self.enabled = False
        self.recipe = None
        self.amax_reduction_group = None
        self.calibrating = False
        self.recomputing = 0

    def settings(self):
        """(enabled, recipe, amax_reduction_group, calibrating): what a region
        sets and restores (and a checkpoint recompute re-enters)."""
        return self.enabled, self.recipe, self.amax_reduction_group, self.calibrating

    def restore(self, settings):
        self.enabled, self.recipe, self.amax_reduction_group, self.calibrating = settings

    def __repr__(self):
        return (f"AutocastState(enabled={self.enabled}, recipe={self.recipe}, "
                f"calibrating={self.calibrating})")


_local = threading.local()


def autocast_state():
    """The current AutocastState of this thread."""
    s = getattr(_local, "state", None)
    if s is None:
        s = _local.state = AutocastState()
    return s


def is_fp8_enabled():
    """True inside an enabled autocast region (any quantized recipe)."""
    return autocast_state().enabled


def get_recipe():
    """The recipe of the current autocast region (DelayedScaling() outside one)."""
    r = autocast_state().recipe
    return r if r is not None else DelayedScaling()


def get_amax_reduction_group():
    return autocast_state().amax_reduction_group
