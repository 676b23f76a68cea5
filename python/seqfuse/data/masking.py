"""Masked-language-model corruption (BERT / ESM style) with per-sample seeds.

Each sample gets its own torch.Generator seeded from ``(seed, epoch, index)``
(``sample_seed``), so the masks a sample receives depend on nothing else: not
on the batch it lands in, the rank that reads it, the number of loader
workers, or how many batches came before. That is what makes a resumed run
reproduce the uninterrupted one exactly, and the packed and padded layouts
carry identical labels. A new epoch gives new masks (dynamic masking).

Rule (``mlm_mask``): every non-special token is selected independently with
probability ``mask_prob`` (0.15); a selected token becomes <mask> with
probability ``mask_token_frac`` (0.8), a random token drawn uniformly from
``random_token_ids`` (the 20 standard amino acids for ESM) with probability
``random_token_frac`` (0.1), and stays unchanged otherwise (0.1). Labels hold
the original id at selected positions and -100 elsewhere. Special tokens
(<cls>, <eos>, <pad>, <unk>, <mask>, ...) are never selected.
"""
from __future__ import annotations

import math
import numbers

import numpy as np
import torch

from ._checks import as_int, as_seed, integer_ids

__all__ = ["sample_seed", "mix_seed", "sample_generator", "mlm_mask", "mask_numpy", "check_mask_settings",
           "IGNORE_INDEX"]

#: Label value the loss ignores (torch.nn.CrossEntropyLoss's default).
IGNORE_INDEX = -100

_M64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    z = x
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A well-mixed 63-bit seed for sample ``index`` of ``epoch`` under the
    run seed ``seed`` (splitmix64 chained over the three integers). Each
    is an integer (Python, numpy or a 0-d integer tensor; never a float or
    a bool) in [0, 2**64 - 1]."""
    return _checked_seed("sample_seed", seed, epoch, index)


def _checked_seed(caller: str, seed, epoch, index) -> int:
    """mix_seed of the three after as_seed's checks, named for ``caller``."""
    return mix_seed(as_seed(caller, "seed", seed), as_seed(caller, "epoch", epoch), as_seed(caller, "index", index))


def mix_seed(seed: int, epoch: int, index: int) -> int:
    """sample_seed without its checks: three Python ints in [0, 2**64)
    already checked (MLMDataset's per-sample path, which checks once)."""
    h = _splitmix64(seed)
    h = _splitmix64(h ^ epoch)
    h = _splitmix64(h ^ index)
    return h >> 1


def sample_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    """A CPU torch.Generator seeded for one sample of one epoch."""
    g = torch.Generator()
    g.manual_seed(_checked_seed("sample_generator", seed, epoch, index))
    return g


def mlm_mask(
    input_ids: torch.Tensor,
    *,
    special_token_ids,
    mask_token_id: int,
    random_token_ids: torch.Tensor,
    generator: torch.Generator,
    mask_prob: float = 0.15,
    mask_token_frac: float = 0.8,
    random_token_frac: float = 0.1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Corrupt a 1-D sequence of ids; returns ``(masked_ids, labels)``.

    ``input_ids``: a 1-D integer CPU tensor of ids >= 0 (a float or bool
    tensor, or a list, is refused: ids are never rounded).
    ``special_token_ids``: integers >= 0 (a list, tuple or tensor);
    ``mask_token_id``: an integer >= 0; ``random_token_ids``: a non-empty
    integer tensor (or sequence) of ids >= 0; ``generator``: a CPU
    ``torch.Generator`` (``sample_generator(seed, epoch, index)``; None is
    refused, as it would draw from torch's global generator and no seed of
    this module would reproduce the masks).

    The generator draws, in this order, 2L uniforms (L for selection, L for
    the action) and L random token choices, whatever the outcome, so the
    stream layout is fixed by the length alone. Runs on the CPU (it is a
    data-loading step).
    """
    input_ids = integer_ids("mlm_mask", "input_ids", input_ids)
    if input_ids.dim() != 1:
        raise ValueError(f"mlm_mask: argument 'input_ids' must be 1-D, got shape {tuple(input_ids.shape)}")
    mask_prob, mask_token_frac, random_token_frac = check_mask_settings(
        "mlm_mask", mask_prob, mask_token_frac, random_token_frac)
    if input_ids.device.type != "cpu":
        raise ValueError(f"mlm_mask: argument 'input_ids' must be on the CPU (data loading), got {input_ids.device}")
    if isinstance(special_token_ids, torch.Tensor):
        special_token_ids = special_token_ids.reshape(-1).tolist()  # (a float tensor's floats are refused below)
    special_token_ids = [as_int("mlm_mask", "special_token_ids", i, 0) for i in special_token_ids]
    mask_token_id = as_int("mlm_mask", "mask_token_id", mask_token_id, 0)
    random_token_ids = integer_ids("mlm_mask", "random_token_ids", random_token_ids, allow_sequence=True)
    if random_token_ids.numel() == 0:
        raise ValueError("mlm_mask: argument 'random_token_ids' is empty")
    if not isinstance(generator, torch.Generator):
        raise TypeError(
            "mlm_mask: argument 'generator' must be a torch.Generator (sample_generator(seed, epoch, index) gives "
            f"one per sample), got {type(generator).__name__}"
        )
    ids = input_ids.to(torch.long).numpy()
    special = np.zeros(int(max(ids.max(initial=0), max(special_token_ids, default=0))) + 1, dtype=bool)
    special[special_token_ids] = True
    out, labels = mask_numpy(
        ids, special, mask_token_id, random_token_ids.reshape(-1).to(torch.long).numpy(), generator,
        mask_prob, mask_token_frac, random_token_frac,
    )
    return torch.from_numpy(out), torch.from_numpy(labels)


def _fraction(caller: str, name: str, value) -> float:
    """``value`` as a float in [0, 1] (NaN refused), or the error naming it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{caller}: argument '{name}' must be a real number in [0, 1], got {type(value).__name__}")
    v = float(value)
    if math.isnan(v) or not 0.0 <= v <= 1.0:
        raise ValueError(f"{caller}: argument '{name}' must be in [0, 1], got {value}")
    return v


def check_mask_settings(caller: str, mask_prob, mask_token_frac=None, random_token_frac=None):
    """The masking rule's settings checked (mlm_mask, MLMDataset and
    build_mlm_loader share this): each a real number in [0, 1] (NaN
    refused), ``mask_token_frac + random_token_frac <= 1``. Returns them
    as floats; an argument given as None is not checked and stays None."""
    mask_prob = _fraction(caller, "mask_prob", mask_prob)
    if mask_token_frac is not None:
        mask_token_frac = _fraction(caller, "mask_token_frac", mask_token_frac)
    if random_token_frac is not None:
        random_token_frac = _fraction(caller, "random_token_frac", random_token_frac)
    if mask_token_frac is not None and random_token_frac is not None and mask_token_frac + random_token_frac > 1.0:
        raise ValueError(
            f"{caller}: arguments 'mask_token_frac' and 'random_token_frac' must be >= 0 with a sum <= 1, "
            f"got {mask_token_frac} and {random_token_frac}"
        )
    return mask_prob, mask_token_frac, random_token_frac


def mask_numpy(ids, special_lut, mask_token_id, random_ids, generator, mask_prob, mask_token_frac, random_token_frac):
    """mlm_mask's core on an int64 numpy array, without argument checks
    (MLMDataset calls it once per sample with validated settings).
    ``special_lut[id]`` is True for special ids."""
    n = ids.size
    # Draw order is fixed by the length alone: 2n uniforms (selection,
    # action), then n choices of a random token.
    u = torch.rand(2 * n, generator=generator).numpy()
    # (a vocabulary without random tokens draws none: then random_token_frac is 0)
    choice = (torch.randint(random_ids.size, (n,), generator=generator).numpy() if random_ids.size
              else np.zeros(n, dtype=np.int64))
    sel = np.flatnonzero((u[:n] < mask_prob) & ~special_lut[ids])
    action = u[n:][sel]
    orig = ids[sel]
    labels = np.full(n, IGNORE_INDEX, dtype=np.int64)
    labels[sel] = orig
    rep = orig.copy()
    rep[action < mask_token_frac] = mask_token_id
    rnd = (action >= mask_token_frac) & (action < mask_token_frac + random_token_frac)
    rep[rnd] = random_ids[choice[sel[rnd]]]
    out = ids.copy()
    out[sel] = rep
    return out, labels
