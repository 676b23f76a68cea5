"""Tokenized sequence storage, the masked-LM dataset and the causal-LM dataset.

``TokenizedSequences`` encodes every sequence once and keeps the ids in one
flat uint8 array with offsets (1 byte per residue: the 20,000 UniProt
proteins of the ESM-2 recipe take about 8 MB), so workers get a compact copy
and per-sample token lengths are known up front for token-budget batching.

``MLMDataset`` turns one stored sequence into a training sample: crop to
``max_length`` (a random window, as ESM-2 was trained, or the start, as
transformers truncates), frame with <cls> ... <eos>, then mask (masking.py).
It is indexed by ``(epoch, index)`` pairs (a plain int means epoch 0) because
crops and masks change per epoch; ResumableDataLoader passes those pairs.

``CausalLMDataset`` (next-token prediction, e.g. Llama on DNA windows) crops
and frames the same way (``FramedDataset`` holds that shared part) and sets
``labels`` to the ids themselves, Hugging Face style: the model shifts them
(logits at t predict labels[t + 1]). ``labels[0]`` is -100: the first token
is never a target, so when samples are packed one after another (THD), the
shifted loss never asks the last token of one sequence to predict the first
of the next; padded (BSHD) results are unchanged by it (position 0 is never a
target after the shift), and the collators put -100 on padding.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import torch

from ._checks import as_bool, as_int, as_seed
from .masking import IGNORE_INDEX, check_mask_settings, mask_numpy, mix_seed
from .tokenizers import CharTokenizer

__all__ = ["TokenizedSequences", "FramedDataset", "MLMDataset", "CausalLMDataset"]


def check_tokenizer(caller: str, tokenizer) -> CharTokenizer:
    """``tokenizer`` if it is one of seqfuse.data's (the datasets read its
    lookup table, specials and ids), else a TypeError naming it."""
    if not isinstance(tokenizer, CharTokenizer):
        raise TypeError(
            f"{caller}: argument 'tokenizer' must be a seqfuse.data CharTokenizer (EsmTokenizer, "
            f"NucleotideTokenizer), got {type(tokenizer).__name__}"
        )
    return tokenizer


class TokenizedSequences:
    """Residue ids (no specials) of many sequences, stored flat.

    ``sequences``: a list (or any collection or iterable, read once) of
    str. One str is refused (its characters would each become a
    one-residue sequence), so are bytes and a dict (its keys, the ids,
    would be read as sequences)."""

    def __init__(self, sequences: Sequence[str], tokenizer: CharTokenizer):
        name = "TokenizedSequences"
        check_tokenizer(name, tokenizer)
        if isinstance(sequences, str):
            raise TypeError(
                f"{name}: argument 'sequences' must be a collection of sequences (str), got one str of "
                f"{len(sequences)} characters; pass [sequence] for a single sequence"
            )
        if isinstance(sequences, (bytes, bytearray, memoryview)):
            raise TypeError(f"{name}: argument 'sequences' must be a collection of sequences (str), got "
                            f"{type(sequences).__name__}")
        if isinstance(sequences, Mapping):
            raise TypeError(f"{name}: argument 'sequences' is a {type(sequences).__name__}: pass its values "
                            "(the sequences), not the mapping, whose keys would be read as sequences")
        if not hasattr(sequences, "__len__"):
            sequences = list(sequences)
        if tokenizer.vocab_size > 256:
            raise ValueError(f"{name}: vocabulary of {tokenizer.vocab_size} tokens does not fit uint8")
        lengths = np.zeros(len(sequences), dtype=np.int64)
        chunks = []
        for i, s in enumerate(sequences):
            try:
                ids = tokenizer.encode_residues(s)
            except (TypeError, ValueError) as e:
                raise type(e)(f"{name}: sequence {i}: {e}") from None
            lengths[i] = ids.size
            chunks.append(ids.astype(np.uint8))
        self.tokenizer = tokenizer
        self.lengths = lengths
        self.offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
        self.flat = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.uint8)

    def __len__(self) -> int:
        return len(self.lengths)

    def residues(self, i: int) -> torch.Tensor:
        """The residue ids of sequence ``i`` (0 <= i < len; IndexError otherwise)."""
        i = as_int("TokenizedSequences.residues", "i", i)
        if not 0 <= i < len(self.lengths):
            raise IndexError(f"TokenizedSequences.residues: index {i} out of range [0, {len(self.lengths)})")
        a, b = self.offsets[i], self.offsets[i + 1]
        return torch.from_numpy(self.flat[a:b].astype(np.int64))


class FramedDataset(torch.utils.data.Dataset):
    """Samples cropped to ``max_length`` tokens (specials included) and framed
    with the tokenizer's begin / end tokens; subclasses add the labels.

    ``crop`` is ``"random"`` (a window drawn from the per-sample generator of
    ``(seed, epoch, index)``) or ``"start"``. ``framed(key)`` gives
    ``(index, ids, generator)``; the generator has drawn the crop offset (only
    when a crop was needed) and goes on to the subclass.
    """

    def __init__(self, sequences, tokenizer: CharTokenizer, *, max_length: int, seed: int, crop: str,
                 add_special_tokens: bool = True):
        name = type(self).__name__
        check_tokenizer(name, tokenizer)
        if crop not in ("random", "start"):
            raise ValueError(f"{name}: argument 'crop' must be 'random' or 'start', got {crop!r}")
        add_special_tokens = as_bool(name, "add_special_tokens", add_special_tokens)
        n_spec = tokenizer.num_special_tokens_added if add_special_tokens else 0
        max_length = as_int(name, "max_length", max_length, n_spec + 1)
        seed = as_seed(name, "seed", seed)  # (sample_seed's range: [0, 2**64 - 1])
        self.store = sequences if isinstance(sequences, TokenizedSequences) else TokenizedSequences(sequences, tokenizer)
        if self.store.tokenizer is not tokenizer and self.store.tokenizer.vocab != tokenizer.vocab:
            raise ValueError(f"{name}: the TokenizedSequences were made with a different vocabulary")
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.seed = seed
        self.crop = crop
        self.add_special_tokens = add_special_tokens
        self._n_spec = n_spec
        self._max_residues = max_length - n_spec
        self._gen = None  # one torch.Generator per process, re-seeded per sample
        #: Tokens per sample after cropping, specials included (int64 numpy).
        self.lengths = np.minimum(self.store.lengths, self._max_residues) + n_spec
        if n_spec == 0 and (self.lengths == 0).any():
            i = int(np.flatnonzero(self.lengths == 0)[0])
            why = "add_special_tokens=False adds" if not add_special_tokens else "the tokenizer adds"
            raise ValueError(
                f"{name}: sequence {i} is empty and {why} no special tokens, so its sample would have no "
                f"token; every sample needs at least one ({int((self.lengths == 0).sum())} empty sequence(s))"
            )

    def __len__(self) -> int:
        return len(self.store)

    def fingerprint(self) -> dict:
        """The settings a saved loader position depends on (subclasses add
        their own)."""
        return {
            "num_samples": len(self.store),
            "max_length": self.max_length,
            "seed": self.seed,
            "crop": self.crop,
            "vocab_size": self.tokenizer.vocab_size,
        }

    def __getstate__(self):  # workers build their own generator
        state = dict(self.__dict__)
        state["_gen"] = None
        return state

    def _key(self, key) -> tuple[int, int]:
        """``(epoch, index)`` of a key: an index (epoch 0) or an
        ``(epoch, index)`` pair of integers (never floats: 1.7 is no index)."""
        name = type(self).__name__
        if isinstance(key, tuple):
            if len(key) != 2:
                raise ValueError(f"{name}: key must be an index or an (epoch, index) pair, got {key!r:.80}")
            epoch, index = key
        else:
            epoch, index = 0, key
        i = as_int(name, "index", index)
        if not 0 <= i < len(self.store):
            raise IndexError(f"{name}: index {i} out of range [0, {len(self.store)})")
        return as_seed(name, "epoch", epoch), i  # (the epoch is mixed into the seed: a seed's range)

    def framed(self, key) -> tuple[int, np.ndarray, torch.Generator]:
        epoch, index = self._key(key)
        if self._gen is None:
            self._gen = torch.Generator()
        g = self._gen
        g.manual_seed(mix_seed(self.seed, epoch, index))  # sample_seed of values checked already
        a, b = int(self.store.offsets[index]), int(self.store.offsets[index + 1])
        n = b - a
        keep = self._max_residues
        if n > keep:
            if self.crop == "random":
                a += int(torch.randint(n - keep + 1, (1,), generator=g))
            n = keep
        tok = self.tokenizer
        bos = self.add_special_tokens and tok.bos_token_id is not None
        ids = np.empty(n + self._n_spec, dtype=np.int64)
        if bos:
            ids[0] = tok.bos_token_id
        ids[bos : bos + n] = self.store.flat[a : a + n]
        if self.add_special_tokens and tok.eos_token_id is not None:
            ids[-1] = tok.eos_token_id
        return index, ids, g


class MLMDataset(FramedDataset):
    """Masked-LM samples ``{"input_ids", "labels", "index"}`` (1-D int64).

    ``max_length`` counts the specials (as transformers does); ``crop`` is
    ``"random"`` (a window drawn from the per-sample generator) or
    ``"start"``. ``seed`` seeds crops and masks; ``mask_prob=0`` gives
    uncorrupted samples with every label -100.
    """

    def __init__(
        self,
        sequences,
        tokenizer: CharTokenizer,
        *,
        max_length: int = 1024,
        seed: int = 0,
        mask_prob: float = 0.15,
        mask_token_frac: float = 0.8,
        random_token_frac: float = 0.1,
        crop: str = "random",
    ):
        mask_prob, mask_token_frac, random_token_frac = check_mask_settings(
            "MLMDataset", mask_prob, mask_token_frac, random_token_frac)
        check_tokenizer("MLMDataset", tokenizer)
        if tokenizer.mask_token_id is None and mask_prob > 0:
            raise ValueError("MLMDataset: the tokenizer has no mask token; use mask_prob=0")
        if tokenizer.random_token_ids.numel() == 0 and mask_prob > 0 and random_token_frac > 0:
            raise ValueError(
                "MLMDataset: the tokenizer has no random_token_ids, so 'random_token_frac' must be 0 "
                f"(got {random_token_frac})"
            )
        super().__init__(sequences, tokenizer, max_length=max_length, seed=seed, crop=crop)
        self.mask_prob = mask_prob
        self.mask_token_frac = mask_token_frac
        self.random_token_frac = random_token_frac
        self._special_lut = np.zeros(tokenizer.vocab_size, dtype=bool)
        self._special_lut[tokenizer.special_token_ids] = True
        self._random_ids = tokenizer.random_token_ids.numpy().astype(np.int64)

    def fingerprint(self) -> dict:
        """The settings a saved loader position depends on."""
        return {
            **super().fingerprint(),
            "mask_prob": self.mask_prob,
            "mask_token_frac": self.mask_token_frac,
            "random_token_frac": self.random_token_frac,
        }

    def __getitem__(self, key):
        index, ids, g = self.framed(key)
        if self.mask_prob > 0:
            ids, labels = mask_numpy(
                ids, self._special_lut, self.tokenizer.mask_token_id, self._random_ids, g,
                self.mask_prob, self.mask_token_frac, self.random_token_frac,
            )
        else:
            labels = np.full(ids.size, IGNORE_INDEX, dtype=np.int64)
        ids, labels = torch.from_numpy(ids), torch.from_numpy(labels)
        return {"input_ids": ids, "labels": labels, "index": index}


class CausalLMDataset(FramedDataset):
    """Next-token samples ``{"input_ids", "labels", "index"}`` (1-D int64):
    ``labels`` = ``input_ids`` with ``labels[0] = -100`` (module note).

    ``max_length`` counts the specials; ``crop`` ``"random"`` draws a new
    window per epoch from ``(seed, epoch, index)`` (``"start"``: the first
    tokens, for validation); ``add_special_tokens`` frames with the
    tokenizer's <bos> ... <eos> (for DNA windows: ``<bos> bases <eos>``).
    """

    def __init__(self, sequences, tokenizer: CharTokenizer, *, max_length: int = 8192, seed: int = 0,
                 crop: str = "random", add_special_tokens: bool = True):
        super().__init__(sequences, tokenizer, max_length=max_length, seed=seed, crop=crop,
                         add_special_tokens=add_special_tokens)

    def fingerprint(self) -> dict:
        """The settings a saved loader position depends on."""
        return {"objective": "causal_lm", **super().fingerprint(), "add_special_tokens": self.add_special_tokens}

    def __getitem__(self, key):
        index, ids, _ = self.framed(key)
        labels = ids.copy()
        labels[0] = IGNORE_INDEX
        return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels), "index": index}
