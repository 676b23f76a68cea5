"""Character-level tokenizers: the shared CharTokenizer and ESM-2 proteins
(DNA nucleotides: nucleotide.py, a CharTokenizer too).

Every one maps one character to one id through a 256-entry lookup table over ASCII
bytes, so encoding a protein is a numpy gather, not a Python loop.

``EsmTokenizer`` reproduces the ids of transformers' EsmTokenizer for the
ESM-2 vocabulary (33 tokens, <cls>=0 <pad>=1 <eos>=2 <unk>=3 ... <mask>=32):
``encode(seq)`` gives ``<cls> residues <eos>``, and ``max_length`` truncates
the residues so the total, specials included, is at most ``max_length`` (as
transformers does with ``truncation=True``).

Characters outside the vocabulary (policy, argument ``unknown``):
  * ``"error"`` (default): ValueError naming the character and its position.
    Silent <unk>s in training data are usually a data bug (lower case input,
    a stray '*' stop codon), so the default refuses them.
  * ``"unk"``: exactly transformers' behaviour: a maximal run of consecutive
    unknown characters becomes ONE <unk> (transformers splits the text on the
    vocabulary's tokens and maps each leftover piece to <unk>). Note this
    shortens the sequence by the run length minus one.
  * a one-character token of the vocabulary (``"N"`` for DNA): every unknown
    character becomes that token, one for one (lengths are kept).
ASCII whitespace inside a sequence is skipped (as transformers does); it also
ends an unknown run. Special tokens written literally in the text (``<mask>``)
are recognised when ``parse_special_tokens=True`` (transformers always does).
Non-ASCII characters are unknown characters.
"""
from __future__ import annotations

import os
import re
from typing import Iterable, Sequence

import numpy as np
import torch

from ._checks import as_bool, as_int, integer_ids
from ._files import replacing

__all__ = ["CharTokenizer", "EsmTokenizer", "ESM2_VOCAB"]

#: ESM-2's vocabulary in id order (fair-esm's Alphabet "ESM-1b", as shipped in
#: facebook/esm2_* vocab.txt files).
ESM2_VOCAB = (
    ["<cls>", "<pad>", "<eos>", "<unk>"]
    + list("LAGVSERTIDPKQNFYMHWCXBUZO")
    + [".", "-", "<null_1>", "<mask>"]
)

_WS = -2  # lookup-table code: skip
_UNK = -1  # lookup-table code: not in the vocabulary


def _residue_char(c: str) -> bool:
    """Can ``c`` be a one-character token: printable ASCII, not whitespace
    (the lookup table reads ASCII bytes and skips whitespace)."""
    return c.isascii() and c.isprintable() and not c.isspace()


def _check_vocab(name: str, vocab) -> None:
    """A vocabulary is a sequence of distinct tokens: one printable ASCII
    character (a residue) or a special token written ``<...>``."""
    if isinstance(vocab, (str, bytes, dict)) or not hasattr(vocab, "__len__") or not hasattr(vocab, "__iter__"):
        what = "one str" if isinstance(vocab, str) else type(vocab).__name__
        raise TypeError(f"{name}: argument 'vocab' must be a sequence of tokens, got {what}")
    for t in vocab:
        if not isinstance(t, str) or not t:
            raise TypeError(f"{name}: argument 'vocab': every token must be a non-empty str, got {t!r}")
        if len(t) == 1 and not _residue_char(t):
            raise ValueError(f"{name}: argument 'vocab': token {t!r} is not a printable ASCII character (the lookup "
                             "table reads ASCII bytes and skips whitespace)")
        if len(t) > 1 and not (t.startswith("<") and t.endswith(">")):
            raise ValueError(f"{name}: argument 'vocab': token {t!r} has several characters but is not a special "
                             "token written <...> (one token is one character, or a special token)")


class CharTokenizer:
    """One character, one token; multi-character entries of the vocabulary
    (``<...>``) are special tokens. Subclasses set the vocabulary and which
    specials frame a sequence; the end, padding, unknown and mask tokens
    default to ESM's spellings, which every vocabulary here uses.

    Rules (ValueError / TypeError naming the argument): ``vocab`` is a
    sequence of distinct tokens, each one printable ASCII character (a
    residue; not whitespace, which encoding skips) or a special token
    written ``<...>``; the begin, end, padding, unknown and mask tokens are
    special tokens of the vocabulary (a residue there would give padding or
    <mask> a real token's id); ``random_tokens`` are residues of it;
    ``extra_char_map`` maps one ASCII character to a residue."""

    def __init__(
        self,
        vocab: Sequence[str],
        *,
        bos_token: str | None,
        eos_token: str | None = "<eos>",
        pad_token: str = "<pad>",
        unk_token: str = "<unk>",
        mask_token: str | None = "<mask>",
        random_tokens: Sequence[str],
        unknown: str = "error",
        parse_special_tokens: bool = True,
        extra_char_map: dict[str, str] | None = None,
    ):
        name = type(self).__name__
        _check_vocab(name, vocab)
        vocab = [str(t) for t in vocab]
        if len(set(vocab)) != len(vocab):
            raise ValueError(f"{name}: vocabulary holds duplicates")
        if not isinstance(unknown, str) or (unknown not in ("error", "unk") and not (len(unknown) == 1 and unknown in vocab)):
            raise ValueError(
                f"{name}: argument 'unknown' must be 'error' or 'unk' (or a one-character token "
                f"of the vocabulary that replaces unknown characters), got {unknown!r}"
            )
        self.vocab = list(vocab)
        self.token_to_id = {t: i for i, t in enumerate(self.vocab)}
        self.unknown = unknown
        self.parse_special_tokens = as_bool(name, "parse_special_tokens", parse_special_tokens)
        self.special_tokens = [t for t in self.vocab if len(t) > 1]

        def special_id(arg, token, optional=False):
            """The id of a framing / padding / unknown / mask token: a special
            token of the vocabulary (a residue's id would make padding or
            <mask> indistinguishable from real tokens)."""
            if token is None and optional:
                return None
            if token not in self.token_to_id:
                raise ValueError(f"{name}: argument '{arg}' ({token!r}) is not in the vocabulary")
            if len(token) == 1:
                raise ValueError(
                    f"{name}: argument '{arg}' must be a special token (<...>) of the vocabulary, got {token!r}, "
                    "a residue (its id would be a real token's)"
                )
            return self.token_to_id[token]

        self.pad_token_id = special_id("pad_token", pad_token)
        self.unk_token_id = special_id("unk_token", unk_token)
        self.bos_token_id = special_id("bos_token", bos_token, optional=True)
        self.eos_token_id = special_id("eos_token", eos_token, optional=True)
        self.mask_token_id = special_id("mask_token", mask_token, optional=True)
        if isinstance(random_tokens, str):
            random_tokens = list(random_tokens)
        for t in random_tokens:
            if t not in self.token_to_id:
                raise ValueError(f"{name}: argument 'random_tokens': {t!r} is not in the vocabulary")
            if len(t) != 1:
                raise ValueError(f"{name}: argument 'random_tokens': {t!r} is a special token; random "
                                 "replacements must be residues")
        #: ids a masking step may substitute at random (real residues only).
        self.random_token_ids = torch.tensor([self.token_to_id[t] for t in random_tokens], dtype=torch.long)
        #: ids never chosen as masking targets (every <...> token).
        self.special_token_ids = sorted(self.token_to_id[t] for t in self.special_tokens)
        extra_char_map = dict(extra_char_map or {})
        for src, dst in extra_char_map.items():
            if not (isinstance(src, str) and len(src) == 1 and _residue_char(src)):
                raise ValueError(f"{name}: argument 'extra_char_map': key {src!r} must be one ASCII character "
                                 "(printable, not whitespace)")
            if not (isinstance(dst, str) and len(dst) == 1 and dst in self.token_to_id):
                raise ValueError(f"{name}: argument 'extra_char_map': {src!r} -> {dst!r}, which is not a residue "
                                 "(one-character token) of the vocabulary")

        lut = np.full(256, _UNK, dtype=np.int16)
        for t, i in self.token_to_id.items():
            if len(t) == 1:
                lut[ord(t)] = i
        for src, dst in extra_char_map.items():
            lut[ord(src)] = self.token_to_id[dst]
        for c in " \t\n\r\v\f":
            lut[ord(c)] = _WS
        self._lut = lut
        self._special_re = re.compile("(" + "|".join(re.escape(t) for t in self.special_tokens) + ")")

    # -- properties -----------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def __len__(self) -> int:
        return len(self.vocab)

    @property
    def num_special_tokens_added(self) -> int:
        """Tokens ``encode(..., add_special_tokens=True)`` adds around a sequence."""
        return (self.bos_token_id is not None) + (self.eos_token_id is not None)

    # -- encoding -------------------------------------------------------
    def _encode_piece(self, text: str, start: int) -> np.ndarray:
        if text.isascii():
            codes = self._lut[np.frombuffer(text.encode("ascii"), dtype=np.uint8)]
        else:  # rare: a slow path that marks every non-ASCII character unknown
            codes = np.array([self._lut[ord(c)] if ord(c) < 128 else _UNK for c in text], dtype=np.int16)
        return self._resolve(codes, text.__getitem__, start).astype(np.int64)

    def _resolve(self, codes: np.ndarray, char_at, start: int) -> np.ndarray:
        """Apply the unknown policy to lookup-table codes and drop whitespace;
        ``char_at(pos)`` names the character for the error message."""
        unk = codes == _UNK
        if unk.any():
            if self.unknown == "error":
                pos = int(np.flatnonzero(unk)[0])
                raise ValueError(
                    f"{type(self).__name__}.encode: character {char_at(pos)!r} at position {start + pos} is not in "
                    f"the vocabulary (unknown='error'; pass unknown='unk' to map it to "
                    f"{self.vocab[self.unk_token_id]})"
                )
            if self.unknown != "unk":  # a replacement token: one for one
                codes = np.where(unk, self.token_to_id[self.unknown], codes)
            else:  # transformers: a maximal run of unknown characters is one <unk>.
                prev_unk = np.concatenate(([False], unk[:-1]))
                keep = ~(unk & prev_unk)
                codes = np.where(unk, self.unk_token_id, codes)[keep]
        return codes[codes != _WS]

    def encode_bytes(self, data, dtype=np.int64) -> np.ndarray:
        """Ids of raw bytes (``bytes``, ``bytearray``, ``memoryview`` or a
        uint8 numpy array) through the lookup table: the bulk path for whole
        genomes, one gather over the buffer. Same rules as ``encode`` without
        specials: whitespace skipped, the ``unknown`` policy, bytes >= 128
        unknown, and no special-token parsing (``<`` is an ordinary
        character). ``dtype`` of the result (uint8 fits every vocabulary
        here and takes an eighth of int64's memory)."""
        if isinstance(data, np.ndarray):
            if data.dtype != np.uint8 or data.ndim != 1:
                raise ValueError(
                    f"{type(self).__name__}.encode_bytes: argument 'data' must be 1-D uint8, got "
                    f"{data.dtype} of shape {data.shape}"
                )
            buf = data
        elif isinstance(data, (bytes, bytearray, memoryview)):
            buf = np.frombuffer(data, dtype=np.uint8)
        else:
            raise TypeError(
                f"{type(self).__name__}.encode_bytes: argument 'data' must be bytes or a uint8 array, got "
                f"{type(data).__name__}"
            )
        if np.iinfo(dtype).max < self.vocab_size - 1:
            raise ValueError(f"{type(self).__name__}.encode_bytes: dtype {np.dtype(dtype)} cannot hold {self.vocab_size} ids")
        lut = np.where(np.arange(256) < 128, self._lut, _UNK).astype(np.int16)
        return self._resolve(lut[buf], lambda pos: chr(buf[pos]) if buf[pos] < 128 else bytes(buf[pos : pos + 1]), 0).astype(dtype)

    def encode_residues(self, text: str) -> np.ndarray:
        """Token ids of ``text`` without specials or truncation (int64 numpy)."""
        if not isinstance(text, str):
            raise TypeError(f"{type(self).__name__}.encode: expected a str, got {type(text).__name__}")
        if self.parse_special_tokens and "<" in text:
            parts, pos = [], 0
            for piece in self._special_re.split(text):
                if piece in self.token_to_id and len(piece) > 1:
                    parts.append(np.array([self.token_to_id[piece]], dtype=np.int64))
                elif piece:
                    parts.append(self._encode_piece(piece, pos))
                pos += len(piece)
            return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return self._encode_piece(text, 0)

    def add_special_tokens(self, residue_ids: torch.Tensor) -> torch.Tensor:
        """Frame residue ids (a 1-D integer tensor) with the tokenizer's begin
        and end tokens."""
        residue_ids = integer_ids(f"{type(self).__name__}.add_special_tokens", "residue_ids", residue_ids)
        return self._frame(residue_ids)

    def _frame(self, residue_ids: torch.Tensor) -> torch.Tensor:
        """add_special_tokens without its check (encode's own ids)."""
        parts = []
        if self.bos_token_id is not None:
            parts.append(torch.tensor([self.bos_token_id], dtype=torch.long))
        parts.append(residue_ids.to(torch.long))
        if self.eos_token_id is not None:
            parts.append(torch.tensor([self.eos_token_id], dtype=torch.long))
        return torch.cat(parts)

    def encode(self, text: str, add_special_tokens: bool = True, max_length: int | None = None) -> torch.Tensor:
        """Ids of ``text`` as a 1-D int64 tensor. ``max_length`` keeps the
        first residues so the result, specials included, has at most
        ``max_length`` tokens."""
        add_special_tokens = as_bool(f"{type(self).__name__}.encode", "add_special_tokens", add_special_tokens)
        ids = self.encode_residues(text)
        n_spec = self.num_special_tokens_added if add_special_tokens else 0
        if max_length is not None:
            max_length = as_int(f"{type(self).__name__}.encode", "max_length", max_length)
            if max_length < n_spec + 1:
                raise ValueError(
                    f"{type(self).__name__}.encode: argument 'max_length' must be >= {n_spec + 1} "
                    f"(room for the specials and one residue), got {max_length}"
                )
            ids = ids[: max_length - n_spec]
        t = torch.from_numpy(np.ascontiguousarray(ids))
        return self._frame(t) if add_special_tokens else t

    def __call__(self, texts, add_special_tokens: bool = True, max_length: int | None = None):
        if isinstance(texts, str):
            return self.encode(texts, add_special_tokens, max_length)
        return [self.encode(t, add_special_tokens, max_length) for t in texts]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; specials are written as ``<...>`` unless skipped."""
        skip_special_tokens = as_bool(f"{type(self).__name__}.decode", "skip_special_tokens", skip_special_tokens)
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        special = set(self.special_token_ids)
        out = []
        for i in ids:
            i = as_int(f"{type(self).__name__}.decode", "ids", i)
            if not 0 <= i < len(self.vocab):
                raise ValueError(f"{type(self).__name__}.decode: id {i} is outside [0, {len(self.vocab)})")
            if skip_special_tokens and i in special:
                continue
            out.append(self.vocab[i])
        return "".join(out)

    def special_tokens_mask(self, ids: torch.Tensor) -> torch.Tensor:
        """Boolean mask, True where ``ids`` (an integer tensor) holds a special
        (``<...>``) token."""
        ids = integer_ids(f"{type(self).__name__}.special_tokens_mask", "ids", ids)
        return torch.isin(ids, torch.tensor(self.special_token_ids, dtype=ids.dtype, device=ids.device))

    def save_vocabulary(self, directory) -> str:
        """Write ``vocab.txt`` (one token per line, in id order; the format
        transformers' EsmTokenizer reads); returns its path. An existing
        vocab.txt is replaced (as transformers' save_vocabulary does), whole:
        the new file is written next to it and renamed onto it."""
        directory = check_directory(f"{type(self).__name__}.save_vocabulary", directory)
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, "vocab.txt")
        with replacing(path, f"{type(self).__name__}.save_vocabulary") as tmp:
            with open(tmp, "w", encoding="ascii", newline="\n") as f:
                f.write("\n".join(self.vocab) + "\n")
        return path


def check_directory(caller: str, directory) -> str:
    """``directory`` as a str path that is a directory or does not exist
    yet; NotADirectoryError naming it when it is a file."""
    directory = os.fspath(directory)
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise NotADirectoryError(f"{caller}: argument 'directory' {directory!r} is a file, not a directory")
    return directory


class EsmTokenizer(CharTokenizer):
    """ESM-2 protein tokenizer: ``<cls> residues <eos>``, ids identical to
    transformers.EsmTokenizer with the ESM-2 vocab.txt. Masking substitutes
    random tokens among the 20 standard amino acids."""

    STANDARD_AMINO_ACIDS = "LAGVSERTIDPKQNFYMHWC"

    def __init__(self, unknown: str = "error", parse_special_tokens: bool = True):
        super().__init__(
            ESM2_VOCAB,
            bos_token="<cls>",
            random_tokens=list(self.STANDARD_AMINO_ACIDS),
            unknown=unknown,
            parse_special_tokens=parse_special_tokens,
        )
        self.cls_token_id = self.bos_token_id
