"""Token-budget batching: group samples so each batch holds at most
``max_tokens`` tokens, and deal the batches out to data-parallel ranks.

Cost of a batch (what must stay <= max_tokens):
  * packed (THD): the sum of the sample lengths, rounded up to
    ``pad_to_multiple_of`` when given (the tokens the collator will emit);
  * padded (BSHD): batch size x the longest length (rounded up likewise).
Batches are formed greedily in epoch order: a sample that would push the
current batch over budget (or over ``max_sequences``) starts the next one.

Epoch order: a permutation seeded by ``(seed, epoch)`` when ``shuffle``, else
file order. With ``bucket_size`` the order is cut into windows of that many
samples, each window is sorted by length before batching (less padding in
the padded layout, more even batches in the packed one), and the batches are
then shuffled so lengths do not drift through the epoch.

Data parallelism: every rank builds the same global batch list (same seed)
and takes batches ``rank, rank + world_size, ...``. The list is first cut to
a multiple of ``world_size`` (at most ``world_size - 1`` tail batches of the
epoch are dropped; with shuffling, different ones each epoch) so every rank
runs the same number of steps and collectives never hang.

Balancing (``balance_ranks=True``, world_size > 1): ranks wait for each
other at every collective, so a step lasts as long as its most expensive
rank.  The ``world_size`` batches of each step are then re-dealt: their
samples, most expensive first, each go to the rank with the least cost so
far that still has room (the same budget rules), where a sample's cost is
its tokens plus its attention, ``L + L**2 / attention_tokens`` (attention
grows with the square of the length; ``attention_tokens`` ~ 6 x hidden
size x the matmul-to-attention efficiency ratio, 4096 suits ESM-2 650M).
A step whose samples do not fit that way keeps its greedy batches.  Same
samples per step, same step count; only their split between ranks moves.

A sample longer than the budget can never be batched: the constructor raises
ValueError naming it (crop sequences with MLMDataset's ``max_length``).
"""
from __future__ import annotations

import copy
import zlib

import numpy as np
import torch

from ._checks import as_bool, as_int, as_optional_int, as_seed
from .masking import sample_seed

__all__ = ["TokenBudgetBatchSampler"]


def _round_up(n, m):
    return (n + m - 1) // m * m


class TokenBudgetBatchSampler(torch.utils.data.Sampler):
    """Yields lists of sample indices for this rank, one epoch per iteration
    (``set_epoch`` picks the epoch). ``batches(epoch)`` gives the global
    list, ``rank_batches(epoch)`` this rank's share."""

    def __init__(
        self,
        lengths,
        max_tokens: int,
        *,
        padded: bool = False,
        pad_to_multiple_of: int | None = None,
        max_sequences: int | None = None,
        shuffle: bool = True,
        bucket_size: int | None = None,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        balance_ranks: bool = False,
        attention_tokens: int = 4096,
    ):
        name = "TokenBudgetBatchSampler"
        if isinstance(lengths, torch.Tensor):
            lengths = lengths.detach().cpu().numpy()
        lengths = np.asarray(lengths)
        if lengths.ndim != 1 or lengths.size == 0:
            raise ValueError(f"TokenBudgetBatchSampler: 'lengths' must be a non-empty 1-D sequence, got shape {lengths.shape}")
        if lengths.dtype.kind not in "iu":  # a float length would be truncated, a bool read as 0 / 1
            raise TypeError(
                f"TokenBudgetBatchSampler: argument 'lengths' must hold integers (token counts), got dtype {lengths.dtype}"
            )
        lengths = lengths.astype(np.int64)
        if (lengths < 1).any():
            i = int(np.flatnonzero(lengths < 1)[0])
            raise ValueError(f"TokenBudgetBatchSampler: sample {i} has length {lengths[i]}; lengths must be >= 1")
        max_tokens = as_int(name, "max_tokens", max_tokens, 1)
        pad_to_multiple_of = as_optional_int(name, "pad_to_multiple_of", pad_to_multiple_of, 1)
        max_sequences = as_optional_int(name, "max_sequences", max_sequences, 1)
        bucket_size = as_optional_int(name, "bucket_size", bucket_size, 1)
        attention_tokens = as_int(name, "attention_tokens", attention_tokens, 1)
        seed = as_seed(name, "seed", seed)
        padded = as_bool(name, "padded", padded)
        shuffle = as_bool(name, "shuffle", shuffle)
        balance_ranks = as_bool(name, "balance_ranks", balance_ranks)
        rank = as_int(name, "rank", rank)
        world_size = as_int(name, "world_size", world_size)
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"TokenBudgetBatchSampler: need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        m = pad_to_multiple_of or 1
        single = _round_up(lengths, m)
        over = np.flatnonzero(single > max_tokens)
        if over.size:
            i = int(over[0])
            raise ValueError(
                f"TokenBudgetBatchSampler: sample {i} needs {int(single[i])} tokens"
                f"{' after padding to a multiple of %d' % m if m > 1 else ''}, more than max_tokens={max_tokens}"
                f" ({over.size} sample(s) too long); crop sequences to at most max_tokens"
            )
        self.lengths = lengths
        self.max_tokens = int(max_tokens)
        self.padded = padded
        self.pad_to_multiple_of = pad_to_multiple_of
        self.max_sequences = max_sequences
        self.shuffle = shuffle
        self.bucket_size = bucket_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.balance_ranks = balance_ranks
        self.attention_tokens = int(attention_tokens)
        self.epoch = 0
        self._cache: tuple[int, list[list[int]]] | None = None
        self._balanced_cache: tuple[int, list[list[int]]] | None = None

    # -- identity, for checking a restored loader state --------------------
    def fingerprint(self) -> dict:
        """What must match for a saved position to mean the same batches."""
        fp = {
            "num_samples": int(self.lengths.size),
            "lengths_crc32": zlib.crc32(self.lengths.tobytes()),
            "max_tokens": self.max_tokens,
            "padded": self.padded,
            "pad_to_multiple_of": self.pad_to_multiple_of,
            "max_sequences": self.max_sequences,
            "shuffle": self.shuffle,
            "bucket_size": self.bucket_size,
            "seed": self.seed,
        }
        if self.balance_ranks:  # only when on: positions saved before the option existed still load
            fp["balance_ranks"] = True
            fp["attention_tokens"] = self.attention_tokens
        return fp

    def set_epoch(self, epoch: int) -> None:
        self.epoch = as_int("TokenBudgetBatchSampler.set_epoch", "epoch", epoch, 0)

    # -- batch construction -------------------------------------------------
    def _generator(self, epoch: int, stream: int) -> torch.Generator:
        g = torch.Generator()
        g.manual_seed(sample_seed(self.seed, epoch, stream))
        return g

    def _order(self, epoch: int) -> np.ndarray:
        n = self.lengths.size
        if self.shuffle:
            return torch.randperm(n, generator=self._generator(epoch, 0)).numpy()
        return np.arange(n)

    def _greedy(self, order: np.ndarray) -> list[list[int]]:
        m = self.pad_to_multiple_of or 1
        lens = self.lengths
        budget = self.max_tokens
        cap = self.max_sequences or len(order)
        batches, cur, tot, longest = [], [], 0, 0
        for i in order.tolist():
            li = int(lens[i])
            if self.padded:
                new_longest = max(longest, li)
                cost = (len(cur) + 1) * _round_up(new_longest, m)
            else:
                cost = _round_up(tot + li, m)
            if cur and (cost > budget or len(cur) == cap):
                batches.append(cur)
                cur, tot, longest = [], 0, 0
            cur.append(i)
            tot += li
            longest = max(longest, li)
        if cur:
            batches.append(cur)
        return batches

    def batches(self, epoch: int) -> list[list[int]]:
        """Every batch of ``epoch``, for all ranks together (cached)."""
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        order = self._order(epoch)
        if self.bucket_size is None:
            out = self._greedy(order)
        else:
            out = []
            for a in range(0, order.size, self.bucket_size):
                window = order[a : a + self.bucket_size]
                window = window[np.argsort(self.lengths[window], kind="stable")]
                out.extend(self._greedy(window))
            if self.shuffle:
                perm = torch.randperm(len(out), generator=self._generator(epoch, 1)).tolist()
                out = [out[k] for k in perm]
        self._cache = (epoch, out)
        return out

    def batches_added_by_cap(self, epoch: int) -> tuple[int, int]:
        """(batches, of which the ``max_sequences`` cap adds): ``epoch``'s
        global batch count and how many more it has than without the cap
        (0 without one).  A cap below what the token budget packs cuts
        batches of many short samples in two, which a run should be told.
        Counted on copies: this sampler's cached epoch stays as it was (one
        greedy pass over the epoch each, about a second per 2M samples)."""
        def count(max_sequences):
            c = copy.copy(self)  # (the lengths array is shared and only read)
            c.max_sequences, c._cache, c._balanced_cache = max_sequences, None, None
            return len(c.batches(epoch))

        n = count(self.max_sequences)
        return n, (n - count(None) if self.max_sequences is not None else 0)

    def _fits(self, tot, longest, count, li):
        """Would a sample of length ``li`` fit a batch of ``count`` samples,
        ``tot`` tokens, longest ``longest``? (the greedy packer's rules)"""
        m = self.pad_to_multiple_of or 1
        if self.max_sequences is not None and count >= self.max_sequences:
            return False
        if self.padded:
            return (count + 1) * _round_up(max(longest, li), m) <= self.max_tokens
        return _round_up(tot + li, m) <= self.max_tokens

    def _balance(self, group: list[list[int]]) -> list[list[int]]:
        """The samples of one step's batches re-dealt over the ranks by cost
        (longest-processing-time first); the group unchanged if they do not fit."""
        w = len(group)
        samples = [i for b in group for i in b]
        lens = self.lengths
        cost = {i: float(lens[i]) + float(lens[i]) ** 2 / self.attention_tokens for i in samples}
        order = sorted(samples, key=lambda i: (-cost[i], i))
        bins = [[] for _ in range(w)]
        load, tot, longest = [0.0] * w, [0] * w, [0] * w
        for i in order:
            li = int(lens[i])
            fit = [r for r in range(w) if self._fits(tot[r], longest[r], len(bins[r]), li)]
            if not fit:
                return group
            r = min(fit, key=lambda k: (load[k], k))
            bins[r].append(i)
            load[r] += cost[i]
            tot[r] += li
            longest[r] = max(longest[r], li)
        pos = {i: k for k, i in enumerate(samples)}  # keep the epoch's order inside each batch
        return [sorted(b, key=pos.__getitem__) for b in bins]

    def rank_batches(self, epoch: int) -> list[list[int]]:
        """This rank's batches of ``epoch`` (same count on every rank)."""
        glob = self.batches(epoch)
        usable = len(glob) // self.world_size * self.world_size
        if usable == 0:
            raise ValueError(
                f"TokenBudgetBatchSampler: epoch {epoch} has {len(glob)} batch(es), fewer than "
                f"world_size={self.world_size}; use more data or a smaller max_tokens"
            )
        if self.balance_ranks and self.world_size > 1:
            if self._balanced_cache is None or self._balanced_cache[0] != epoch:
                w = self.world_size
                out = []
                for a in range(0, usable, w):
                    out.extend(self._balance(glob[a : a + w]))
                self._balanced_cache = (epoch, out)
            glob = self._balanced_cache[1]
        return glob[self.rank : usable : self.world_size]

    def __iter__(self):
        return iter(self.rank_batches(self.epoch))

    def __len__(self) -> int:
        return len(self.rank_batches(self.epoch))
