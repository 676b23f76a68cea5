"""Attention dropout's random state.

P = softmax(S) is multiplied by keep / (1 - p) before P V (``dropout_p`` in
[0, 1), as flash-attn and TE's ``attention_dropout``); the mask is never
stored, both halves regenerate it from Philox4x32-10 keyed by ``rng_state =
(seed, offset)`` and each element's (sequence, head, query, key) coordinates
(csrc/attn/attn_philox.h), so the CPU and CUDA backends draw the same mask.
Without an explicit ``rng_state`` it comes from torch's default generator of
q's device: on CUDA (seed, offset) = (initial_seed(), get_offset()) and the
generator's offset advances by the call's use, batch * heads rounded up to a
multiple of 4, as flash-attn's philox_args do, so ``torch.manual_seed`` makes
runs repeatable; on the CPU (whose generator has no offset) a fresh seed is
drawn with offset 0.  Drawing reads and sets the generator's offset on the
host, so a forward with dropout and without ``rng_state`` is NOT capturable in
a CUDA graph (pass ``rng_state`` from outside the graph, or use dropout_p=0).
The autograd function saves the pair for its backward.  On CUDA dropout runs
in the sm80 forward and backward kernels (on Hopper a dropout call leaves the
wgmma kernels for them, logged once, see _routing.py), checked on an H200
against the CPU backend's identical Philox mask.
"""
import torch

from .._call import as_float, as_int


def _num_sequences(q, qkv_format, cu_seqlens_q):
    if qkv_format == "thd":
        return max(int(cu_seqlens_q.numel()) - 1, 0) if cu_seqlens_q is not None else 0
    return q.shape[0] if qkv_format == "bshd" else q.shape[1]


def dropout_rng_state(q, qkv_format="bshd", cu_seqlens_q=None):
    """(seed, offset) for one attention call with dropout on q's device,
    drawn from torch's default generator (see this file's docstring); the
    CUDA generator's offset advances by the call's use."""
    used = _num_sequences(q, qkv_format, cu_seqlens_q) * q.shape[-2]
    if q.is_cuda:
        index = q.device.index if q.device.index is not None else torch.cuda.current_device()
        gen = torch.cuda.default_generators[index]
        seed, offset = gen.initial_seed(), gen.get_offset()
        gen.set_offset(offset + (used + 3) // 4 * 4)  # torch keeps offsets multiples of 4
        return seed, offset
    return int(torch.randint(0, 2**62, (), dtype=torch.int64).item()), 0


def rng_cfg(dropout_p, rng_state):
    """The (dropout_p, seed, offset) tail of the C config."""
    p = as_float("attention", "dropout_p", dropout_p)
    if p == 0.0 or rng_state is None:
        return (p, 0, 0)
    if not isinstance(rng_state, (tuple, list)) or len(rng_state) != 2:
        raise TypeError(f"attention: argument 'rng_state' must be a (seed, offset) pair, got {rng_state!r}")
    seed, offset = (as_int("attention", "rng_state", x) if not isinstance(x, int) else x for x in rng_state)
    if not (0 <= seed < 2**64 and 0 <= offset < 2**64):
        raise ValueError(f"attention: rng_state must be two integers in [0, 2**64), got {rng_state!r}")
    return (p, seed, offset)


def wants_rng(dropout_p):
    p = as_float("attention", "dropout_p", dropout_p)
    return 0.0 < p < 1.0  # anything else is 0 (no mask) or an error C reports naming dropout_p

