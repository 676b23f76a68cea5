"""Replacing a method of one model instance by a wrapper of it (used by
seqfuse.hf.accelerate for the forward under autocast and the gradient
checkpointing setter, by seqfuse.hf.fused_loss for the labels path and by
seqfuse.hf.positions for the derived-positions mark), and a library
function process-wide (seqfuse.hf.positions' packed-sequence shortcut).

``wrap_method(model, name, make, *args)`` sets ``model.<name>`` to a
MethodWrapper that calls ``make(inner, *args)(model, ...)``, where
``inner(self, ...)`` runs what ``model.<name>`` ran before (the class's
method, or an earlier wrapper).  ``make`` is a module-level function and
``args`` plain values, so the wrapper survives what copies a model:

- ``copy.deepcopy(model)``: the copy's wrapper calls the copy (its forward
  runs the copy, its checkpointing setter changes the copy's layers);
- ``torch.save(model)`` / ``torch.load``: the wrapper is rebuilt around the
  loaded model (a bound method would come back as the class's own method,
  silently dropping the wrapping).

``inspect.signature(model.<name>)`` is the wrapped method's (Trainer and
generate() read forward's parameters).

``wrap_function(original, make)`` is ``make(original)`` marked with its
maker, naming ``original`` as ``__wrapped__``.

``wrapped_with(fn, make)`` is how every wrapper here tells that it is in
place already (so a second accelerate() does not wrap again): it follows
``fn``'s chain (a method wrapper's ``previous``, a function's
``__wrapped__``) looking for a wrapper built by ``make``.
``wrap_method_once`` is wrap_method guarded by it.
"""
import functools
import inspect
import types


@functools.lru_cache(maxsize=None)
def forward_signature(cls):
    """(signature of cls.forward, the name of its **kwargs or None), read once
    per class: how a forward wrapper finds an argument however it was passed."""
    sig = inspect.signature(cls.forward)
    return sig, next((p.name for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD), None)


class MethodWrapper:
    """``model.<name>`` after wrap_method (see the module note)."""

    def __init__(self, model, name, make, args, previous):
        self.model, self.name, self.make, self.args, self.previous = model, name, make, tuple(args), previous
        if isinstance(previous, MethodWrapper):  # an earlier wrapper of ours: chain through it, re-bound
            inner = previous.call
        elif previous is not None:  # a callable someone else set on the instance: called as it is
            def inner(self, *a, **kw):
                return previous(*a, **kw)
        else:
            inner = getattr(type(model), name)
        self.fn = make(inner, *self.args)

    def call(self, model, *args, **kwargs):
        """The wrapped method run on ``model`` (the chain's own self)."""
        return self.fn(model, *args, **kwargs)

    def __call__(self, *args, **kwargs):
        return self.fn(self.model, *args, **kwargs)

    @property
    def __signature__(self):
        return inspect.signature(types.MethodType(getattr(type(self.model), self.name), self.model))

    @property
    def __func__(self):
        return self.fn

    @property
    def __self__(self):
        return self.model

    def __reduce__(self):
        return MethodWrapper, (self.model, self.name, self.make, self.args, self.previous)

    def __repr__(self):
        return f"<seqfuse wrapper {self.make.__name__} of {type(self.model).__name__}.{self.name}>"


def wrap_method(model, name, make, *args):
    """Set ``model.<name>`` to ``make(inner, *args)`` bound to the model (see
    the module note).  A callable someone else set on the instance is called
    by the wrapper as it is (a copy of the model then carries that callable)."""
    current = model.__dict__.get(name)
    if isinstance(current, types.MethodType) and current.__self__ is model \
            and current.__func__ is getattr(type(model), name, None):
        current = None  # the class's own method, bound: the same as none set
    setattr(model, name, MethodWrapper(model, name, make, args, current))


def wrap_method_once(model, name, make, *args):
    """wrap_method unless ``model.<name>`` holds a wrapper built by ``make``
    with equal ``args`` already (wrapped_with); returns whether it wrapped."""
    if wrapped_with(model.__dict__.get(name), make, *args):
        return False
    wrap_method(model, name, make, *args)
    return True


def wrap_function(original, make):
    """``make(original)``, marked as built by ``make`` (wrapped_with reads
    the mark) and naming ``original`` as its ``__wrapped__``, with its docstring."""
    fn = make(original)
    fn.__wrapped__ = original
    fn.__doc__ = original.__doc__
    fn._seqfuse_make = make
    return fn


def _chain(fn):
    """``fn`` and what it wraps, outermost first: a method wrapper's
    ``previous``, a function's ``__wrapped__`` (a wrapper of ours under
    someone else's functools.wraps is reached too)."""
    seen = set()
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        yield fn
        fn = fn.previous if isinstance(fn, MethodWrapper) else getattr(fn, "__wrapped__", None)


def wrapped_with(fn, make, *args):
    """Whether ``fn`` is or wraps a wrapper built by ``make`` (given ``args``,
    with arguments equal to them), along ``fn``'s chain (see _chain)."""
    for f in _chain(fn):
        if isinstance(f, MethodWrapper):
            if f.make is make and (not args or f.args == args):
                return True
        elif getattr(f, "_seqfuse_make", None) is make and not args:
            return True
    return False
