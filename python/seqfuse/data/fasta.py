"""FASTA reading and writing, plain or gzip-compressed (reading: xz too, as
Debian ships some genome assemblies), streaming.

Records are read one at a time so a file of millions of sequences never has to
fit in memory. A record's ``id`` is the header up to the first whitespace,
``description`` the rest of the header line; sequence lines are joined with
all whitespace removed. Nothing is upper-cased or validated here: what counts
as a valid residue is the tokenizer's business (see tokenizers.py).
"""
from __future__ import annotations

import gzip
import io
import os
from dataclasses import dataclass
from typing import Iterable, Iterator

__all__ = ["SequenceRecord", "read_fasta", "write_fasta", "open_text"]


@dataclass(frozen=True)
class SequenceRecord:
    """One named sequence: ``id`` (no whitespace), free-text ``description``,
    and the residues as one string."""

    id: str
    sequence: str
    description: str = ""


def _magic(path) -> bytes:
    with open(path, "rb") as f:
        return f.read(6)


def open_text(path, mode: str = "rt"):
    """Open ``path`` as text; gzip (and, reading only, xz) is detected from
    the magic bytes when reading, gzip from a ``.gz`` suffix when writing."""
    if mode not in ("rt", "wt"):
        raise ValueError(f"open_text: argument 'mode' must be 'rt' or 'wt', got {mode!r}")
    path = os.fspath(path)
    if mode == "rt":
        magic = _magic(path)
        if magic == b"\xfd7zXZ\x00":
            import lzma

            return lzma.open(path, "rt", encoding="ascii")
        gz = magic[:2] == b"\x1f\x8b"
    else:
        gz = path.endswith(".gz")
    if gz:
        # mtime=0 makes written archives byte-identical run to run.
        if mode == "wt":
            raw = gzip.GzipFile(path, "wb", mtime=0)
            return io.TextIOWrapper(raw, encoding="ascii", newline="\n")
        return gzip.open(path, "rt", encoding="ascii")
    return open(path, mode, encoding="ascii", newline="\n" if mode == "wt" else None)


def read_fasta(path) -> Iterator[SequenceRecord]:
    """Yield the records of a FASTA file (plain or .gz) one by one.

    Raises ValueError for sequence lines before the first header, for an
    empty header, and (with the line number) for a record without residues.
    """
    with open_text(path, "rt") as f:
        header = None
        header_line = 0
        chunks: list[str] = []
        for lineno, line in enumerate(f, 1):
            if line.startswith(">"):
                if header is not None:
                    yield _make_record(header, chunks, path, header_line)
                header = line[1:].strip()
                header_line = lineno
                if not header:
                    raise ValueError(f"read_fasta: {path}:{lineno}: empty header line")
                chunks = []
            elif line.startswith(";"):
                continue  # old-style FASTA comment
            else:
                stripped = "".join(line.split())
                if not stripped:
                    continue
                if header is None:
                    raise ValueError(
                        f"read_fasta: {path}:{lineno}: sequence data before the first '>' header"
                    )
                chunks.append(stripped)
        if header is not None:
            yield _make_record(header, chunks, path, header_line)


def _make_record(header: str, chunks: list[str], path, lineno: int) -> SequenceRecord:
    parts = header.split(None, 1)
    seq = "".join(chunks)
    if not seq:
        raise ValueError(f"read_fasta: {path}:{lineno}: record {parts[0]!r} has no sequence")
    return SequenceRecord(id=parts[0], sequence=seq, description=parts[1] if len(parts) > 1 else "")


def write_fasta(records: Iterable[SequenceRecord], path, line_width: int = 60) -> int:
    """Write records to ``path`` (gzip when it ends in .gz); returns how many.

    ``line_width`` wraps sequence lines (0 = one line per sequence).
    """
    if line_width < 0:
        raise ValueError(f"write_fasta: argument 'line_width' must be >= 0, got {line_width}")
    n = 0
    with open_text(path, "wt") as f:
        for rec in records:
            if not rec.id or any(c.isspace() for c in rec.id):
                raise ValueError(f"write_fasta: record id must be non-empty without whitespace, got {rec.id!r}")
            f.write(">" + rec.id + (" " + rec.description if rec.description else "") + "\n")
            seq = rec.sequence
            if line_width == 0:
                f.write(seq + "\n")
            else:
                for i in range(0, len(seq), line_width):
                    f.write(seq[i : i + line_width] + "\n")
            n += 1
    return n
