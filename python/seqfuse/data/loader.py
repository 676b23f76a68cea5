"""A data loader whose position can be saved and restored exactly.

ResumableDataLoader wraps torch.utils.data.DataLoader. Each ``iter()`` runs
the rest of the current epoch: it asks the TokenBudgetBatchSampler for this
rank's batches, skips the ones already consumed, and feeds the others to a
DataLoader as lists of ``(epoch, index)`` keys (so the dataset knows which
epoch's crops and masks to draw). Its position is counted here, in the
process that consumes the batches, after each batch is handed out; worker
prefetching therefore never moves it.

``state_dict()`` after consuming batch k of epoch e says "k + 1 batches of
epoch e done"; ``load_state_dict`` on a fresh loader built with the same data
and settings makes the next batch the one an uninterrupted run would have
produced (samples, crops, masks: all are functions of the seed, the epoch and
the sample index). The position is stored as global batches (this rank's
count x world_size), so a run can resume on a different number of ranks when
that number divides it. A state from different data or settings (sample
count, lengths, budget, seeds) raises ValueError instead of resuming into
different batches.
"""
from __future__ import annotations

import warnings

import torch

from ._checks import as_bool, as_int, as_optional_int, exact_int
from .batching import TokenBudgetBatchSampler

__all__ = ["ResumableDataLoader", "build_mlm_loader", "build_causal_lm_loader"]

_FORMAT = "seqfuse.data.ResumableDataLoader/1"


def _dataset_fingerprint(dataset):
    fp = getattr(dataset, "fingerprint", None)
    return fp() if callable(fp) else None


class ResumableDataLoader:
    """Iterable over collated batches, one epoch per ``for`` loop, with
    ``state_dict`` / ``load_state_dict`` (see the module note).

    ``fixed_epoch`` (for validation): every ``for`` loop runs that whole
    epoch from its start (same order, crops and masks each time, so
    validation losses are comparable between evaluations) and the position
    never moves. ``num_workers``, ``pin_memory`` and ``prefetch_factor``
    pass through to torch's DataLoader.
    """

    def __init__(
        self,
        dataset,
        batch_sampler: TokenBudgetBatchSampler,
        collate_fn,
        *,
        num_workers: int = 0,
        pin_memory: bool = False,
        prefetch_factor: int | None = None,
        fixed_epoch: int | None = None,
    ):
        if not isinstance(batch_sampler, TokenBudgetBatchSampler):
            raise TypeError(
                "ResumableDataLoader: argument 'batch_sampler' must be a TokenBudgetBatchSampler, got "
                f"{type(batch_sampler).__name__}"
            )
        name = "ResumableDataLoader"
        if collate_fn is not None and not callable(collate_fn):
            raise TypeError(f"{name}: argument 'collate_fn' must be callable, got {type(collate_fn).__name__}")
        num_workers = as_int(name, "num_workers", num_workers, 0)
        pin_memory = as_bool(name, "pin_memory", pin_memory)
        fixed_epoch = as_optional_int(name, "fixed_epoch", fixed_epoch, 0)
        if len(dataset) != batch_sampler.lengths.size:
            raise ValueError(
                f"ResumableDataLoader: dataset has {len(dataset)} samples but the batch sampler "
                f"was built for {batch_sampler.lengths.size}"
            )
        self.dataset = dataset
        self.batch_sampler = batch_sampler
        self.collate_fn = collate_fn
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.prefetch_factor = prefetch_factor
        self.fixed_epoch = fixed_epoch
        self.epoch = 0 if fixed_epoch is None else int(fixed_epoch)
        self.batches_consumed = 0  # of this rank, in self.epoch

    @property
    def rank(self) -> int:
        return self.batch_sampler.rank

    @property
    def world_size(self) -> int:
        return self.batch_sampler.world_size

    def __len__(self) -> int:
        """This rank's batches in the current epoch (all of it, not the rest)."""
        return len(self.batch_sampler.rank_batches(self.epoch))

    def __iter__(self):
        if self.fixed_epoch is not None:
            yield from self._run(self.fixed_epoch, self.batch_sampler.rank_batches(self.fixed_epoch))
            return
        batches = self.batch_sampler.rank_batches(self.epoch)
        if self.batches_consumed >= len(batches):  # stopped right at an epoch's end
            self.epoch += 1
            self.batches_consumed = 0
            batches = self.batch_sampler.rank_batches(self.epoch)
        epoch = self.epoch
        for batch in self._run(epoch, batches[self.batches_consumed :]):
            if self.epoch != epoch:
                raise RuntimeError("ResumableDataLoader: the position was changed during iteration")
            self.batches_consumed += 1
            yield batch
        self.epoch = epoch + 1
        self.batches_consumed = 0

    def _run(self, epoch, batches):
        self.batch_sampler.set_epoch(epoch)
        keys = [[(epoch, i) for i in b] for b in batches]
        kwargs = {}
        if self.num_workers > 0 and self.prefetch_factor is not None:
            kwargs["prefetch_factor"] = self.prefetch_factor
        dl = torch.utils.data.DataLoader(
            self.dataset,
            batch_sampler=keys,
            collate_fn=self.collate_fn,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            **kwargs,
        )
        yield from dl

    # -- position -------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "format": _FORMAT,
            "epoch": self.epoch,
            "global_batches_consumed": self.batches_consumed * self.world_size,
            "world_size": self.world_size,
            "sampler": self.batch_sampler.fingerprint(),
            "dataset": _dataset_fingerprint(self.dataset),
        }

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("format") != _FORMAT:
            raise ValueError(f"ResumableDataLoader.load_state_dict: not a {_FORMAT} state")
        missing = [k for k in ("epoch", "global_batches_consumed", "sampler") if k not in state]
        if missing:
            raise ValueError(
                f"ResumableDataLoader.load_state_dict: argument 'state' lacks the key(s) {missing} "
                f"(a {_FORMAT} state holds {sorted(self.state_dict())})"
            )
        if not isinstance(state["sampler"], dict):
            raise ValueError(
                "ResumableDataLoader.load_state_dict: argument 'state' field 'sampler' must be a dict "
                f"(the sampler's fingerprint), got {type(state['sampler']).__name__}"
            )
        g = _state_count(state, "global_batches_consumed")
        epoch = _state_count(state, "epoch")
        mine = self.batch_sampler.fingerprint()
        diff = {k: (state["sampler"].get(k), v) for k, v in mine.items() if state["sampler"].get(k) != v}
        if diff:
            raise ValueError(
                "ResumableDataLoader.load_state_dict: the saved position belongs to other data or settings "
                f"(saved, now): {diff}"
            )
        mine = _dataset_fingerprint(self.dataset)
        saved = state.get("dataset")
        if saved is None and mine is not None:
            # saved while the dataset had no fingerprint (a subclass of
            # FramedDataset before it had one): its settings cannot be
            # compared; the sampler's lengths and settings were, above
            warnings.warn(
                "ResumableDataLoader.load_state_dict: the saved position has no dataset fingerprint "
                f"(saved before {type(self.dataset).__name__} had one); its settings are not checked, "
                "only the sampler's (sample lengths, token budget, seed)", stacklevel=2)
        elif saved != mine:
            diff = {k: ((saved or {}).get(k), v) for k, v in (mine or {}).items() if (saved or {}).get(k) != v}
            raise ValueError(
                f"ResumableDataLoader.load_state_dict: the dataset settings differ (saved, now): {diff or (saved, mine)}"
            )
        if g % self.world_size:
            raise ValueError(
                f"ResumableDataLoader.load_state_dict: {g} global batches consumed (saved with "
                f"world_size={state.get('world_size')}) cannot be split evenly over world_size={self.world_size}"
            )
        step = g // self.world_size
        if step > len(self.batch_sampler.rank_batches(epoch)):
            raise ValueError(
                f"ResumableDataLoader.load_state_dict: position {step} is past the end of epoch {epoch}"
            )
        self.epoch = epoch
        self.batches_consumed = step


def _state_count(state: dict, key: str) -> int:
    """``state[key]`` as an int >= 0 (a saved count), or a ValueError naming the field."""
    v = state[key]
    n = exact_int(v)
    if n is None:
        raise ValueError(
            f"ResumableDataLoader.load_state_dict: argument 'state' field {key!r} must be an integer >= 0, "
            f"got {v!r} ({type(v).__name__})"
        )
    if n < 0:
        raise ValueError(
            f"ResumableDataLoader.load_state_dict: argument 'state' field {key!r} must be an integer >= 0, got {n}"
        )
    return n


def build_mlm_loader(
    sequences,
    tokenizer,
    *,
    max_tokens: int,
    max_length: int = 1024,
    packed: bool = True,
    pad_to_multiple_of: int | None = None,
    max_sequences: int | None = None,
    shuffle: bool = True,
    bucket_size: int | None = None,
    seed: int = 0,
    mask_prob: float = 0.15,
    crop: str = "random",
    rank: int | None = None,
    world_size: int | None = None,
    num_workers: int = 0,
    pin_memory: bool = False,
    evaluation: bool = False,
    balance_ranks: bool = False,
) -> ResumableDataLoader:
    """The usual ESM-style pipeline in one call: MLMDataset ->
    TokenBudgetBatchSampler -> PackedTHDCollator (``packed``) or
    PaddedBSHDCollator -> ResumableDataLoader. ``sequences`` is a list of
    strings or a TokenizedSequences (to share one encoding between loaders).

    ``rank`` / ``world_size`` default to torch.distributed's when a process
    group is initialised, else 0 / 1. ``evaluation=True`` gives a validation
    loader: file order, crops from the start, and the same masks every pass
    (``fixed_epoch=0``).  ``balance_ranks``: re-deal each step's samples over
    the ranks by cost (TokenBudgetBatchSampler; training loaders only)."""
    from .dataset import MLMDataset
    from .masking import check_mask_settings

    mask_prob = check_mask_settings("build_mlm_loader", mask_prob)[0]
    max_length, max_tokens, pad_to_multiple_of = _check_fits("build_mlm_loader", max_length, max_tokens,
                                                             pad_to_multiple_of)
    packed, shuffle, pin_memory, evaluation, balance_ranks = _flags(
        "build_mlm_loader", packed=packed, shuffle=shuffle, pin_memory=pin_memory, evaluation=evaluation,
        balance_ranks=balance_ranks)
    if evaluation:
        crop = "start"
    ds = MLMDataset(sequences, tokenizer, max_length=max_length, seed=seed, mask_prob=mask_prob, crop=crop)
    return _loader(ds, tokenizer, max_tokens=max_tokens, packed=packed, pad_to_multiple_of=pad_to_multiple_of,
                   max_sequences=max_sequences, shuffle=shuffle, bucket_size=bucket_size, seed=seed, rank=rank,
                   world_size=world_size, num_workers=num_workers, pin_memory=pin_memory, evaluation=evaluation,
                   balance_ranks=balance_ranks)


def build_causal_lm_loader(
    sequences,
    tokenizer,
    *,
    max_tokens: int,
    max_length: int = 8192,
    packed: bool = True,
    pad_to_multiple_of: int | None = None,
    max_sequences: int | None = None,
    shuffle: bool = True,
    bucket_size: int | None = None,
    seed: int = 0,
    crop: str = "random",
    add_special_tokens: bool = True,
    rank: int | None = None,
    world_size: int | None = None,
    num_workers: int = 0,
    pin_memory: bool = False,
    evaluation: bool = False,
    balance_ranks: bool = False,
) -> ResumableDataLoader:
    """The causal-LM pipeline (Llama on DNA windows) in one call:
    CausalLMDataset (crop to ``max_length`` tokens, ``<bos> ... <eos>``,
    labels = ids with -100 first) -> TokenBudgetBatchSampler ->
    PackedTHDCollator (``packed``: cu_seqlens, position_ids restarting per
    sequence) or PaddedBSHDCollator (labels -100 on padding) ->
    ResumableDataLoader. Same arguments and rules as ``build_mlm_loader``
    (``evaluation=True``: file order, crops from the start, one fixed epoch);
    no masking."""
    from .dataset import CausalLMDataset

    max_length, max_tokens, pad_to_multiple_of = _check_fits("build_causal_lm_loader", max_length, max_tokens,
                                                             pad_to_multiple_of)
    packed, shuffle, pin_memory, evaluation, balance_ranks, add_special_tokens = _flags(
        "build_causal_lm_loader", packed=packed, shuffle=shuffle, pin_memory=pin_memory, evaluation=evaluation,
        balance_ranks=balance_ranks, add_special_tokens=add_special_tokens)
    if evaluation:
        crop = "start"
    ds = CausalLMDataset(sequences, tokenizer, max_length=max_length, seed=seed, crop=crop,
                         add_special_tokens=add_special_tokens)
    return _loader(ds, tokenizer, max_tokens=max_tokens, packed=packed, pad_to_multiple_of=pad_to_multiple_of,
                   max_sequences=max_sequences, shuffle=shuffle, bucket_size=bucket_size, seed=seed, rank=rank,
                   world_size=world_size, num_workers=num_workers, pin_memory=pin_memory, evaluation=evaluation,
                   balance_ranks=balance_ranks)


def _check_fits(caller, max_length, max_tokens, pad_to_multiple_of):
    """The sizes read as integers (>= 1), then: one sequence of
    ``max_length`` tokens, padded, fits the budget. Returns the three."""
    max_length = as_int(caller, "max_length", max_length, 1)
    max_tokens = as_int(caller, "max_tokens", max_tokens, 1)
    pad_to_multiple_of = as_optional_int(caller, "pad_to_multiple_of", pad_to_multiple_of, 1)
    m = pad_to_multiple_of or 1
    if (max_length + m - 1) // m * m > max_tokens:
        raise ValueError(
            f"{caller}: max_length={max_length} (padded to a multiple of {m}) does not fit in "
            f"max_tokens={max_tokens}: one sequence must fit in one batch"
        )
    return max_length, max_tokens, pad_to_multiple_of


def _flags(caller, **flags):
    """The builders' on/off arguments, each a bool (``as_bool``), in order."""
    return tuple(as_bool(caller, k, v) for k, v in flags.items())


def _loader(ds, tokenizer, *, max_tokens, packed, pad_to_multiple_of, max_sequences, shuffle, bucket_size, seed,
            rank, world_size, num_workers, pin_memory, evaluation, balance_ranks) -> ResumableDataLoader:
    """Sampler, collator and loader around a dataset (both builders)."""
    from .collate import PackedTHDCollator, PaddedBSHDCollator

    if rank is None or world_size is None:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank() if rank is None else rank
            world_size = dist.get_world_size() if world_size is None else world_size
        else:
            rank = 0 if rank is None else rank
            world_size = 1 if world_size is None else world_size
    if evaluation:
        shuffle, bucket_size = False, None
    sampler = TokenBudgetBatchSampler(
        ds.lengths,
        max_tokens,
        padded=not packed,
        pad_to_multiple_of=pad_to_multiple_of,
        max_sequences=max_sequences,
        shuffle=shuffle,
        bucket_size=bucket_size,
        seed=seed,
        rank=rank,
        world_size=world_size,
        balance_ranks=balance_ranks and not evaluation,
    )
    if packed:
        collate = PackedTHDCollator(tokenizer.pad_token_id, pad_to_multiple_of=pad_to_multiple_of, max_tokens=max_tokens)
    else:
        collate = PaddedBSHDCollator(tokenizer.pad_token_id, pad_to_multiple_of=pad_to_multiple_of)
    return ResumableDataLoader(
        ds, sampler, collate, num_workers=num_workers, pin_memory=pin_memory, fixed_epoch=0 if evaluation else None
    )
