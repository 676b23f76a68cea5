"""``PerTensorCache``: a result computed from a few tensors, kept while those
very tensor objects are alive and unmodified, so that a model's layers,
which share one mask, cu_seqlens or position tensor per batch, compute (or
check, or read to the host) what follows from it once per batch instead of
once per layer.  Used by attention's padding layouts and routes, the device
checks of cu_seqlens, context parallelism's plans and the HF integration.
"""
import weakref


class PerTensorCache:
    """The results last computed from a few tensors (plus an extra key), each
    reused while those very tensor objects are alive and unmodified (same
    ``_version``).  ``cache(t, *extra)``: ``t`` is a tensor or a tuple of
    tensors (matched by identity), ``extra`` hashable values compared with
    ``==``.  A few entries, not one: models that alternate sliding-window and
    full-attention layers hand their layers two masks in turn.  Never used
    under CUDA graph capture (callers recompute then: a replay reads new
    contents of the same tensors)."""

    SIZE = 4

    def __init__(self, compute):
        self.compute = compute
        self.entries = []  # (weakrefs, versions, extra, result), newest first

    @staticmethod
    def _alive(refs, versions):
        ts = tuple(r() for r in refs)
        return ts if all(t is not None and t._version == v for t, v in zip(ts, versions)) else None

    def __call__(self, t, *extra):
        ts = t if isinstance(t, tuple) else (t,)
        for refs, versions, key, result in self.entries:
            alive = self._alive(refs, versions)
            if alive is not None and len(alive) == len(ts) and all(a is b for a, b in zip(alive, ts)) \
                    and key == extra:
                return result
        result = self.compute(t, *extra)
        # keep the entries that can still match: not a dead tensor's, not an older version's
        live = [e for e in self.entries if self._alive(e[0], e[1]) is not None]
        self.entries = [(tuple(weakref.ref(x) for x in ts), tuple(x._version for x in ts), extra, result)] + \
            live[:self.SIZE - 1]
        return result
