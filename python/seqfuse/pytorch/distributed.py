"""te.distributed's names: ``checkpoint`` (seqfuse.quantization's) and
``CudaRNGStatesTracker``, the named random-number streams that Megatron-style
code hands to TE modules as ``get_rng_state_tracker``.

A tracker keeps named generator states.  ``add(name, seed)`` creates one,
``fork(name)`` runs a block with the generator set to that state and keeps
where the block left it (the next fork continues the stream), restoring the
caller's state afterwards.  seqfuse's modules draw their initial weights
(Linear, LayerNormLinear, LayerNormMLP and the layers built of them) and
their attention-dropout seeds inside ``get_rng_state_tracker().fork()``.

Unlike TE's, which forks the CUDA generator only, this tracker forks torch's
CPU generator too: seqfuse's modules also run on the CPU backend, where the
weights are drawn from the CPU generator.  On a machine with CUDA each state
holds both the CPU and the current CUDA device's generator state.

``get_states()`` gives {name: (cpu state, CUDA state or None)};
``set_states`` takes that form back, or TE's {name: CUDA state} (one uint8
tensor per stream, on a machine with CUDA: such a stream then forks the
CUDA generator only, as TE's does).  Anything else is refused naming the
stream.  Seeds are integers (int, numpy or 0-d torch integers; not bool or
float), compared as torch.manual_seed uses them (modulo 2**64), so two
streams never share one.
"""
import collections.abc
import contextlib

import torch

from ..ops.args import exact_int
from ..quantization import checkpoint

__all__ = ["CudaRNGStatesTracker", "checkpoint"]


def _cuda():
    return torch.cuda.is_available()


def _get_state():
    return (torch.get_rng_state(), torch.cuda.get_rng_state() if _cuda() else None)


def _set_state(state):
    cpu, cuda = state
    if cpu is not None:
        torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


def _check_generator_state(who, key, part, t, reference):
    """``t`` as a generator state like ``reference`` (uint8 tensor of its size)."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 1:
        got = f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{who}: states[{key!r}]: the {part} generator state must be a 1-D torch.uint8 tensor "
                         f"(as get_rng_state returns it), got {got}")
    if t.numel() != reference.numel():
        raise ValueError(f"{who}: states[{key!r}]: the {part} generator state has {t.numel()} bytes, this "
                         f"machine's has {reference.numel()}")
    return t.cpu()


def _stream_state(key, value):
    """A set_states value as (cpu state or None, cuda state or None)."""
    who = "CudaRNGStatesTracker.set_states"
    cuda = _cuda()
    if isinstance(value, torch.Tensor):  # TE's form: the CUDA generator's state
        if not cuda:
            raise ValueError(f"{who}: states[{key!r}] is a single tensor, Transformer Engine's CUDA generator "
                             f"state, but CUDA is not available here (pass the (cpu state, cuda state) pairs "
                             f"get_states returns)")
        return None, _check_generator_state(who, key, "CUDA", value, torch.cuda.get_rng_state())
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ValueError(f"{who}: states[{key!r}] must be a (cpu state, cuda state or None) pair as get_states "
                         f"returns it, or one CUDA state tensor (Transformer Engine's form), got "
                         f"{type(value).__name__}" + (f" of {len(value)} items" if isinstance(value, (tuple, list))
                                                      else ""))
    cpu_state, cuda_state = value
    if cpu_state is None and cuda_state is None:
        raise ValueError(f"{who}: states[{key!r}] holds no generator state (both are None)")
    if cpu_state is not None:
        cpu_state = _check_generator_state(who, key, "CPU", cpu_state, torch.get_rng_state())
    if cuda_state is None and cuda:
        raise ValueError(f"{who}: states[{key!r}] has no CUDA generator state (saved where CUDA was not "
                         f"available) but this machine has CUDA: its modules would draw from the default "
                         f"CUDA stream, not this one")
    if cuda_state is not None:
        if not cuda:
            raise ValueError(f"{who}: states[{key!r}] holds a CUDA generator state but CUDA is not available here")
        cuda_state = _check_generator_state(who, key, "CUDA", cuda_state, torch.cuda.get_rng_state())
    return cpu_state, cuda_state


def _seed(seed):
    """``seed`` as an int (torch.manual_seed's range), refusing bool, floats and strings."""
    value = exact_int(seed)
    if value is None:
        raise TypeError(f"CudaRNGStatesTracker.add: argument 'seed' must be an integer (int, numpy or 0-d torch "
                        f"integer), got {type(seed).__name__} {seed!r}")
    if not -(1 << 63) <= value < (1 << 64):
        raise ValueError(f"CudaRNGStatesTracker.add: argument 'seed' must be in [-2**63, 2**64), got {value}")
    return value


class CudaRNGStatesTracker:
    """Named random-number streams (TE's / Megatron's tracker); see the
    module note."""

    def __init__(self):
        self.reset()

    def is_initialized(self):
        """Whether any stream was added."""
        return self._is_initialized

    def reset(self):
        """Forget every stream."""
        self.states_ = {}
        self.seeds_ = set()
        self._is_initialized = False

    def get_states(self):
        """{name: state} (a copy of the mapping; the states are tensors)."""
        return dict(self.states_)

    def set_states(self, states):
        """Replace the streams by ``states``: {name: state} as get_states
        returned it, or TE's {name: CUDA state tensor} (module note).
        ValueError naming the stream for anything else; nothing is changed
        then."""
        if not isinstance(states, collections.abc.Mapping):
            raise TypeError(f"CudaRNGStatesTracker.set_states: argument 'states' must be a mapping "
                            f"{{name: state}} (as get_states returns it), got {type(states).__name__}")
        self.states_ = {name: _stream_state(name, value) for name, value in states.items()}

    def add(self, name, seed):
        """A new stream ``name`` starting from ``seed`` (an integer)."""
        seed = _seed(seed)
        key = seed % (1 << 64)  # torch.manual_seed maps negative seeds to seed + 2**64
        if key in self.seeds_:
            raise ValueError(f"CudaRNGStatesTracker.add: seed {seed} is already used by another stream")
        if name in self.states_:
            raise ValueError(f"CudaRNGStatesTracker.add: a stream named {name!r} already exists")
        saved = _get_state()
        try:
            torch.manual_seed(seed)  # seeds the CPU generator and every CUDA device's
            state = _get_state()
        finally:
            _set_state(saved)
        self.states_[name] = state
        self.seeds_.add(key)
        self._is_initialized = True

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        """Run the block on stream ``name``; the stream continues from where
        the block left it; the caller's generator state is restored."""
        if name not in self.states_:
            raise KeyError(f"CudaRNGStatesTracker.fork: no stream named {name!r} (add it first)")
        saved = _get_state()
        state = self.states_[name]
        _set_state(state)
        try:
            yield
        finally:
            cpu, cuda = _get_state()
            # a stream set from TE's form (no CPU state) forks the CUDA generator only
            self.states_[name] = (cpu if state[0] is not None else None, cuda)
            _set_state(saved)
