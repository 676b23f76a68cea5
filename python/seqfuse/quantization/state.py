"""GPU-resident delayed-scaling state, and the pool that lets one kernel
update every module's state in one launch.

ScalingState is an nn.Module holding, for N tensors (the FP8 operands of a
module's GEMMs):
    amax_history [H, N]   row 0 accumulates this step's amaxes (the casts
                          fold max|x| into it); rows 1.. the previous steps
    scale        [N]      what the casts multiply by
    scale_inv    [N]      1 / scale (what the GEMM multiplies back by)
as buffers, so they are saved and restored with the module's state_dict.

Those buffers are views into a few large pooled tensors ("chunks", one per
device and recipe settings).  Every state on a chunk is updated by one
fp8_scale_update launch over the chunk's used columns, and its row 0 is one
contiguous buffer, so the amax all-reduce of a step is one collective on a
flat buffer.  The views never move while the state stays on its device
(autograd may hold them across the step); moving the module (``.to()``,
``.cuda()``, ``.half()``...) re-homes the state into a chunk of the new
device, keeping its values in float32.

A state saved to a state_dict is cloned out of its chunk, so checkpoints hold
only the state's own columns.
"""
import weakref

import torch
from torch import nn

from ..common.recipe import DelayedScaling, Format
from . import recompute

#: Column capacity of a new chunk is about this many history floats.
_CHUNK_FLOATS = 1 << 20


class _Chunk:
    __slots__ = ("history", "scale", "scale_inv", "fp8_max", "used", "_live", "key", "_used_views", "pool",
                 "__weakref__")

    def __init__(self, key, h, cap, device, pool):
        self.key = key
        self.pool = pool  # (the _Pool whose chunks_for answers this chunk's live count changes)
        self.history = torch.zeros(h, cap, dtype=torch.float32, device=device)
        self.scale = torch.ones(cap, dtype=torch.float32, device=device)
        self.scale_inv = torch.ones(cap, dtype=torch.float32, device=device)
        self.fp8_max = torch.full((cap,), 448.0, dtype=torch.float32, device=device)
        self.used = 0   # columns handed out (bump allocation)
        self._live = 0   # columns of states that still live here
        self._used_views = None

    @property
    def live(self):
        return self._live

    @live.setter
    def live(self, n):
        # whether a chunk holds live states changes what its pool's chunks_for answers: the count is
        # written first, then the kept answers dropped (a chunks_for running meanwhile on another
        # thread stores its answer in the dictionary changed() replaces)
        was = self._live > 0
        self._live = n
        if (n > 0) != was:
            self.pool.changed()

    @property
    def capacity(self):
        return self.scale.numel()

    def used_views(self):
        """(history, scale, scale_inv, fp8_max) over the used columns: what
        the step's update (and its amax all-reduce, row 0 of history) reads.
        Made again only when ``used`` has moved (a view costs about a
        microsecond; the update runs at every step)."""
        v = self._used_views
        if v is None or v[0] != self.used:
            n = self.used
            v = self._used_views = (n, (self.history[:, :n], self.scale[:n], self.scale_inv[:n],
                                        self.fp8_max[:n]))
        return v[1]


class _Pool:
    """Chunks by (device, history_len, algo, margin); bump allocation."""

    def __init__(self):
        self.chunks = {}  # key -> [chunk, ...]
        self._live_chunks = {}  # chunks_for's answers, (algo, margin) -> tuple, until changed() empties it

    def changed(self):
        """A chunk was added, or came to hold live states or stopped holding any."""
        self._live_chunks = {}

    def allocate(self, key, n):
        device, h = key[0], key[1]
        chunks = self.chunks.setdefault(key, [])
        if not chunks or chunks[-1].capacity - chunks[-1].used < n:
            cap = max(n, min(65536, max(256, _CHUNK_FLOATS // h)))
            chunks.append(_Chunk(key, h, cap, device, self))
            self.changed()
        c = chunks[-1]
        off = c.used
        c.used += n
        return c, off

    def chunks_for(self, algo=None, margin=None):
        """A tuple of the chunks that hold live states (a chunk whose states
        all moved to another device or died is left out, and dropped once it
        is not the one new states are allocated from).  Read at every
        delayed-scaling update: one pass over a snapshot of the keys (a state
        pooled meanwhile by another thread adds one), kept until a chunk is
        added or starts or stops holding live states (changed())."""
        kept = self._live_chunks
        live = kept.get((algo, margin))
        if live is not None:
            return live
        live = []
        for key, chunks in list(self.chunks.items()):
            if (algo is None or key[2] == algo) and (margin is None or key[3] == margin):
                for c in chunks:
                    if c.live > 0:
                        live.append(c)
                if len(chunks) > 1 and any(c.live <= 0 for c in chunks[:-1]):
                    chunks[:-1] = [c for c in chunks[:-1] if c.live > 0]
        live = kept[(algo, margin)] = tuple(live)
        return live

    def clear(self):
        self.chunks.clear()
        self.changed()


POOL = _Pool()

#: Every ScalingState alive (for stats and naming), weakly.
STATES = weakref.WeakSet()

#: The states with tensors cast before they had an amax history (first
#: steps), weakly: the delayed-scaling update visits only these, so a
#: training step in steady state pays nothing for the first-step rule.
FIRST_CASTS = weakref.WeakSet()

#: Index convention of a Linear's state (ScalingState.for_linear).
INPUT, WEIGHT, GRAD_OUTPUT = 0, 1, 2


class ScalingState(nn.Module):
    """Delayed-scaling state of ``num_tensors`` FP8 tensors.

    recipe: a DelayedScaling (default DelayedScaling()); any other recipe
    gets a history of 1 (current and block scaling keep no history, but the
    state still serves as the place casts put their amax).
    backward_indices: the indices that hold backward tensors (output
    gradients): they use the recipe's backward format (E5M2 under HYBRID).
    """

    def __init__(self, num_tensors, recipe=None, *, backward_indices=(), device=None, name=None):
        super().__init__()
        if int(num_tensors) < 1:
            raise ValueError(f"ScalingState: num_tensors must be >= 1, got {num_tensors}")
        self.num_tensors = int(num_tensors)
        self.backward_indices = tuple(sorted(set(int(i) for i in backward_indices)))
        for i in self.backward_indices:
            if not 0 <= i < self.num_tensors:
                raise ValueError(f"ScalingState: backward index {i} out of range(0, {self.num_tensors})")
        self.name = name
        self.recipe = recipe if recipe is not None else DelayedScaling()
        h = self._history_len(self.recipe)
        device = torch.device(device) if device is not None else torch.device("cpu")
        self.register_buffer("amax_history", torch.zeros(h, self.num_tensors, device=device))
        self.register_buffer("scale", torch.ones(self.num_tensors, device=device))
        self.register_buffer("scale_inv", torch.ones(self.num_tensors, device=device))
        self._chunk_ref = None   # weakref: a deepcopy must not copy the pool
        self._ptrs = None
        self._views = None
        self._steady = None  # steady_cast_args' answers: (views, format, scale, amax_history, {index: args})
        self._role_views = {}  # role_slots' views, keyed on (first, step), with the _ptrs they view
        self._offset = 0
        # host-side: which tensors were cast since the last delayed-scaling
        # update, and which have an amax history (an update ran after their
        # first cast, or a checkpoint brought one); quantize_with_state reads it
        self._cast_since_update = set()
        self._with_history = set()
        STATES.add(self)
        # pooled at first use (amax_of / scale_of / ensure_pooled), so a
        # module built on the CPU and moved to the GPU never holds CPU columns

    @classmethod
    def for_linear(cls, recipe=None, **kwargs):
        """The state of one GEMM module: index 0 input, 1 weight, 2 output
        gradient (a backward tensor)."""
        return cls(3, recipe, backward_indices=(GRAD_OUTPUT,), **kwargs)

    # ---- recipe ---------------------------------------------------------
    @staticmethod
    def _history_len(recipe):
        return int(recipe.amax_history_len) if isinstance(recipe, DelayedScaling) else 1

    def _format(self):
        fmt = getattr(self.recipe, "fp8_format", Format.HYBRID)
        return fmt if isinstance(fmt, Format) else Format.HYBRID

    def fp8_dtype(self, index):
        """The FP8 dtype of tensor ``index`` under the state's recipe (read at
        every cast: through the member's ``_value_``, Format's dtype
        attributes being properties over the Enum member's value)."""
        return self._format()._value_.dtypes[index in self.backward_indices]

    def fp8_max(self, index):
        fmt = self._format()
        return fmt.max_bwd if index in self.backward_indices else fmt.max_fwd

    def _key(self, device):
        r = self.recipe
        algo = getattr(r, "amax_compute_algo", "max")
        return (device, self._history_len(r), algo, int(getattr(r, "margin", 0)))

    def set_recipe(self, recipe):
        """Adopt ``recipe``: a different history length, algorithm or margin
        moves the state to a matching chunk (the newest amaxes and the
        scales are kept); a format change only changes the FP8 maxima."""
        old_key = self._key(self.amax_history.device)
        self.recipe = recipe
        if self._key(self.amax_history.device) != old_key:
            h = self._history_len(recipe)
            old = self.amax_history.detach()
            hist = torch.zeros(h, self.num_tensors, device=old.device)
            rows = min(h, old.shape[0])
            hist[:rows] = old[:rows]
            self._buffers["amax_history"] = hist
        self._rehome()
        c = self._chunk_ref() if self._chunk_ref is not None else None
        if c is not None:  # not pooled yet: pooling writes the maxima
            self._write_fp8_max(c, self._offset)
        return self

    def _write_fp8_max(self, c, off):
        # fills with Python scalars: kernel launches, no host-to-device copy
        fmt = self._format()
        c.fp8_max[off:off + self.num_tensors].fill_(fmt.max_fwd)
        for i in self.backward_indices:
            c.fp8_max[off + i:off + i + 1].fill_(fmt.max_bwd)

    # ---- views the casts use ---------------------------------------------
    @property
    def amax(self):
        """Row 0 of the history [N]: where this step's casts accumulate."""
        return self.amax_history[0]

    def _pooled_views(self):
        v = self._views
        if v is None:
            self.ensure_pooled()
            v = self._views
        return v

    def amax_of(self, index):
        """A one-element view of tensor ``index``'s amax for this step (pools
        the state on first use)."""
        v = self._pooled_views()
        amax = v[0][index] if v is not None else self.amax_history[0, index:index + 1]
        # (the hot path: no call into recompute unless a checkpoint is open)
        return recompute.amax_for(amax) if recompute.open_contexts else amax

    def steady_cast_args(self, index):
        """(scale, amax slot, FP8 dtype) of a cast of tensor ``index`` in
        steady state -- the state pooled, the tensor with an amax history, no
        checkpoint recompute open (the caller's check) -- what scale_of,
        amax_of and fp8_dtype then answer, kept per pooling and format (the
        casts of a training step ask it several times per layer).  None
        where the pooling or the first-step rule still applies, or a buffer
        was replaced (assigned, loaded with assign=True) since the answers
        were kept: the full path's ensure_pooled then re-homes the state.  A
        buffer's storage swapped in place (``.data =``) is seen only by
        ensure_pooled, which GemmQuantizers.adopt runs at each module call
        and quantize_with_state at each cast."""
        v = self._views
        if v is None or index not in self._with_history:
            return None
        # the recipe's format attribute as it is (_format's answer, kept with it, follows from it)
        fmt = getattr(self.recipe, "fp8_format", None)
        kept = self._steady
        b = self._buffers
        if (kept is None or kept[0] is not v or kept[1] is not fmt or kept[2] is not b["scale"]
                or kept[3] is not b["amax_history"]):
            kept = self._steady = (v, fmt, b["scale"], b["amax_history"], {})
            if not self._in_chunk():  # (once per pooling: the buffers are the chunk's views)
                self._steady = None
                return None
        args = kept[4].get(index)
        if args is None:
            args = kept[4][index] = (v[1][index], v[0][index], self.fp8_dtype(index))
        return args

    def scale_of(self, index):
        """A one-element view of tensor ``index``'s scale (inside a
        checkpoint recompute: the copy its forward used)."""
        v = self._pooled_views()
        scale = v[1][index] if v is not None else self.scale[index:index + 1]
        return recompute.scale_for(self, index, scale) if recompute.open_contexts else scale

    def live_scale(self, index):
        """(scale, scale_inv): one-element views of tensor ``index``'s live
        slots, not the copies a checkpoint's recompute reads."""
        v = self._pooled_views()
        if v is not None:
            return v[1][index], v[2][index]
        return self.scale[index:index + 1], self.scale_inv[index:index + 1]

    def role_slots(self, first, step):
        """(scale, amax): strided views of the live scale and of this step's
        amax slots of tensors first, first + step, ... (one role of a
        grouped module: its experts' inputs are every third tensor), for a
        kernel that casts them all at once.  Pools the state on first use."""
        self.ensure_pooled()
        v = self._role_views.get((first, step))
        if v is None or v[0] != self._ptrs:  # made once per pooling (a view costs ~1-2 us)
            v = self._role_views[(first, step)] = (self._ptrs, (self.scale[first::step],
                                                                self.amax_history[0, first::step]))
        return v[1]

    def note_first_cast(self, index):
        """Tensor ``index``, which has no amax history yet, was cast this step
        (host bookkeeping only)."""
        self._cast_since_update.add(index)
        FIRST_CASTS.add(self)

    def has_history(self, index):
        """Whether tensor ``index`` has an amax history to take its scale
        from (host bookkeeping: no device read)."""
        return index in self._with_history

    def history_note(self):
        """The host bookkeeping of :meth:`has_history`, copied (for
        :func:`snapshot_scaling`)."""
        return frozenset(self._with_history), frozenset(self._cast_since_update)

    def restore_history_note(self, note):
        """Put a :meth:`history_note` back: a snapshot restored after a
        validation pass or a graph warm-up leaves tensors that had no amax
        history without one, so the next step's first casts still take their
        scale from their own amax."""
        with_history, cast_since_update = note
        self._with_history, self._cast_since_update = set(with_history), set(cast_since_update)
        if self._cast_since_update:
            FIRST_CASTS.add(self)
        else:
            FIRST_CASTS.discard(self)

    def pooled_in(self, chunk):
        """Whether this state's columns live in ``chunk``."""
        return self._chunk_ref is not None and self._chunk_ref() is chunk

    def updated(self):
        """A delayed-scaling update ran over this state's columns: the tensors
        first cast since the last one now have a history."""
        self._with_history |= self._cast_since_update
        self._cast_since_update = set()
        FIRST_CASTS.discard(self)

    def scale_inv_of(self, index):
        v = self._pooled_views()
        return v[2][index] if v is not None else self.scale_inv[index:index + 1]

    # ---- pooling ----------------------------------------------------------
    def _in_chunk(self):
        if self._ptrs is None or self._chunk_ref is None or self._chunk_ref() is None:
            return False
        b = self._buffers
        return (b["amax_history"].data_ptr(), b["scale"].data_ptr(),
                b["scale_inv"].data_ptr()) == self._ptrs

    def _rehome(self):
        """Make the buffers views of a chunk of their current device."""
        if self._in_chunk():
            return
        device = self.amax_history.device
        if device.type == "meta":
            return
        c, off = POOL.allocate(self._key(device), self.num_tensors)
        n = self.num_tensors
        self._leave_chunk()
        c.live += n
        hist = c.history[:, off:off + n]
        hist.copy_(self.amax_history.detach().float())
        scale = c.scale[off:off + n]
        scale.copy_(self.scale.detach().float())
        scale_inv = c.scale_inv[off:off + n]
        scale_inv.copy_(self.scale_inv.detach().float())
        self._write_fp8_max(c, off)
        self._buffers["amax_history"] = hist
        self._buffers["scale"] = scale
        self._buffers["scale_inv"] = scale_inv
        self._chunk_ref, self._offset = weakref.ref(c), off
        self._ptrs = (hist.data_ptr(), scale.data_ptr(), scale_inv.data_ptr())
        # one-element views the casts take, made once (a view costs ~1 us)
        self._views = ([hist[0, i:i + 1] for i in range(n)], [scale[i:i + 1] for i in range(n)],
                       [scale_inv[i:i + 1] for i in range(n)])
        # when the state dies, its columns stop counting as live
        self._finalizer = weakref.finalize(self, _release, weakref.ref(c), n)

    def _leave_chunk(self):
        old = self._chunk_ref() if self._chunk_ref is not None else None
        if old is not None:
            old.live -= self.num_tensors
        self._chunk_ref = None
        self._ptrs = None
        self._role_views = {}  # views of the chunk left behind: not kept alive
        self._steady = None
        if getattr(self, "_finalizer", None) is not None:
            self._finalizer.detach()
            self._finalizer = None

    def ensure_pooled(self):
        """Re-home the state if something replaced its buffers (cheap when not)."""
        if not self._in_chunk():
            self._views = None
            self._rehome()
        return self

    def _apply(self, fn, recurse=True):
        try:
            super()._apply(fn, recurse)
        except TypeError:  # torch without the recurse argument
            super()._apply(fn)
        for name in ("amax_history", "scale", "scale_inv"):
            b = self._buffers[name]
            if b.dtype != torch.float32:
                self._buffers[name] = b.float()
        if not self._in_chunk():
            # moved: leave the old chunk now, join one on the new device at
            # first use
            self._leave_chunk()
            self._views = None
        return self

    def __getstate__(self):
        # a copy (deepcopy, pickle) owns its buffers and joins the pool on
        # its own first use; it must not carry this state's pool bookkeeping
        d = dict(self.__dict__)
        d.update(_chunk_ref=None, _ptrs=None, _views=None, _steady=None, _finalizer=None, _role_views={})
        return d

    def __setstate__(self, d):
        super().__setstate__(d)
        STATES.add(self)

    # ---- state_dict -------------------------------------------------------
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for name in ("amax_history", "scale", "scale_inv"):
            b = self._buffers[name]
            destination[prefix + name] = b if keep_vars else b.detach().clone()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        hist = state_dict.get(prefix + "amax_history")
        if (isinstance(hist, torch.Tensor) and hist.dim() == 2
                and hist.shape[1] == self.num_tensors
                and hist.shape[0] != self.amax_history.shape[0]):
            # a checkpoint made with another amax_history_len: adopt its length
            self.set_recipe(DelayedScaling(
                margin=getattr(self.recipe, "margin", 0),
                fp8_format=self._format(),
                amax_history_len=hist.shape[0],
                amax_compute_algo=getattr(self.recipe, "amax_compute_algo", "max")))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        if isinstance(hist, torch.Tensor) and hist.dim() == 2 and hist.shape[1] == self.num_tensors:
            # a checkpoint's history: the tensors it has amaxes for keep delayed scaling from here
            seen = hist.detach().abs().amax(dim=0).cpu()
            self._with_history = {i for i in range(self.num_tensors) if float(seen[i]) > 0}

    def extra_repr(self):
        return (f"num_tensors={self.num_tensors}, history_len={self.amax_history.shape[0]}, "
                f"backward_indices={self.backward_indices}")


def _release(chunk_ref, n):
    c = chunk_ref()
    if c is not None:
        c.live -= n


def register_scaling_state(module, name, num_tensors, recipe=None, **kwargs):
    """Attach a ScalingState to ``module`` as child ``name`` (so it lands in
    the module's state_dict as ``name.amax_history`` ...) and return it."""
    device = kwargs.pop("device", None)
    if device is None:
        p = next(iter(module.parameters(recurse=False)), None)
        device = p.device if p is not None and p.device.type != "meta" else None
    state = ScalingState(num_tensors, recipe, device=device, **kwargs)
    module.add_module(name, state)
    return state


def snapshot_scaling(model):
    """Every delayed-scaling state under ``model`` (its amax_history, scale
    and scale_inv: what the FP8 casts read and the end-of-step update
    writes; and which of its tensors have a history, the host's note that
    decides the first step's scaling), copied, for :func:`restore_scaling`.
    Work that must not move training state (a validation pass, a CUDA-graph
    warm-up) runs between the two."""
    seen, out = set(), []
    for m in model.modules():
        if isinstance(m, ScalingState) and id(m) not in seen:
            seen.add(id(m))
            out.append((m, m.amax_history.detach().clone(), m.scale.detach().clone(),
                        m.scale_inv.detach().clone(), m.history_note()))
    return out


@torch.no_grad()
def restore_scaling(snapshot):
    """Put the values of :func:`snapshot_scaling` back, in place (the buffers
    are views of the pooled chunks, and CUDA graphs hold their addresses)."""
    for m, hist, scale, scale_inv, note in snapshot:
        m.amax_history.copy_(hist)
        m.scale.copy_(scale)
        m.scale_inv.copy_(scale_inv)
        m.restore_history_note(note)
