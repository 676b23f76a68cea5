"""Replacing a method of one model instance by a wrapper of it, so that a
copy of the model re-binds the wrapper to the copy (used by
seqfuse.hf.accelerate for the forward under autocast and the gradient
checkpointing setter, and by seqfuse.hf.fused_loss for the labels path)."""
import functools
import types


def wrap_method(model, name, wrap):
    """Replace ``model.<name>`` by ``wrap(inner)``, bound to the model, where
    ``inner(self, ...)`` runs what ``model.<name>`` ran.

    Both are functions of ``self`` rather than closures over this model's
    bound method, so ``copy.deepcopy(model)`` re-binds the wrapper to the
    copy (deepcopy copies a bound method by binding its function to the copy
    of its object): the copy's forward runs the copy, and its checkpointing
    setter changes the copy's layers, not the original's."""
    current = getattr(model, name)
    if isinstance(current, types.MethodType) and current.__self__ is model:
        inner = current.__func__  # the class's method, or an earlier wrapper of ours: re-bound on each call
    else:  # a callable set on the instance by someone else (not bound to model): called as it is

        def inner(self, *args, **kwargs):
            return current(*args, **kwargs)

    wrapper = functools.wraps(inner)(wrap(inner))  # keeps inner's signature (Trainer reads forward's)
    wrapper._seqfuse = True
    setattr(model, name, types.MethodType(wrapper, model))
