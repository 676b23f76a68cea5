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
"""
import contextlib

import torch

from ..quantization import checkpoint

__all__ = ["CudaRNGStatesTracker", "checkpoint"]


def _cuda():
    return torch.cuda.is_available()


def _get_state():
    return (torch.get_rng_state(), torch.cuda.get_rng_state() if _cuda() else None)


def _set_state(state):
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


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
        """Replace the streams by ``states`` (as get_states returned them)."""
        self.states_ = dict(states)

    def add(self, name, seed):
        """A new stream ``name`` starting from ``seed``."""
        if seed in self.seeds_:
            raise ValueError(f"CudaRNGStatesTracker.add: seed {seed} is already used by another stream")
        if name in self.states_:
            raise ValueError(f"CudaRNGStatesTracker.add: a stream named {name!r} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        saved = _get_state()
        try:
            torch.manual_seed(seed)  # seeds the CPU generator and every CUDA device's
            self.states_[name] = _get_state()
        finally:
            _set_state(saved)

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        """Run the block on stream ``name``; the stream continues from where
        the block left it; the caller's generator state is restored."""
        if name not in self.states_:
            raise KeyError(f"CudaRNGStatesTracker.fork: no stream named {name!r} (add it first)")
        saved = _get_state()
        _set_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _get_state()
            _set_state(saved)
