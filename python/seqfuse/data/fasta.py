"""FASTA reading and writing, plain or gzip-compressed (reading: xz too, as
Debian ships some genome assemblies), streaming.

Records are read one at a time so a file of millions of sequences never has to
fit in memory. A record's ``id`` is the header up to the first whitespace,
``description`` the rest of the header line; sequence lines are joined with
all whitespace removed. Nothing is upper-cased and no residue is validated
here: what counts as a valid residue is the tokenizer's business (see
tokenizers.py). Writing refuses a record that would not read back as it was
(``check_record``) and replaces an existing file only with a complete new one.
"""
from __future__ import annotations

import gzip
import io
import os
import re
from dataclasses import dataclass
from typing import Iterable, Iterator

from ._checks import as_int
from ._files import replacing

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
    if mode == "wt":
        return _open_write(path, path.endswith(".gz"))
    return _open_read(path, "strict")


def _open_read(path, errors: str):
    """``path`` opened for reading ASCII text (gzip / xz by magic bytes);
    ``errors`` as in ``open``."""
    magic = _magic(path)
    if magic == b"\xfd7zXZ\x00":
        import lzma

        return lzma.open(path, "rt", encoding="ascii", errors=errors)
    if magic[:2] == b"\x1f\x8b":
        return gzip.open(path, "rt", encoding="ascii", errors=errors)
    return open(path, "rt", encoding="ascii", errors=errors)


def _not_ascii(path, lineno: int, line: str) -> ValueError:
    """The error for a line holding a byte >= 128 (read as a surrogate
    escape): the file, the line, the byte and its column."""
    col = next(k for k, c in enumerate(line) if not c.isascii())
    c = line[col]
    byte = ord(c) - 0xDC00 if 0xDC80 <= ord(c) <= 0xDCFF else ord(c)
    return ValueError(
        f"read_fasta: {path}:{lineno}: byte 0x{byte:02x} at column {col + 1} is not ASCII (FASTA files are read as "
        "ASCII text; is this a FASTA file?)"
    )


class _OwningGzipFile(gzip.GzipFile):
    """A GzipFile that closes the file object it writes to when it closes."""

    def close(self):
        raw = self.fileobj
        try:
            super().close()
        finally:
            if raw is not None:
                raw.close()


def _open_write(path, gz: bool, name=None):
    """``path`` opened for writing ASCII text, gzip-compressed when ``gz``;
    ``name`` is the file name the gzip header stores (default ``path``)."""
    if gz:
        # mtime=0 makes written archives byte-identical run to run (the
        # header stores the name, the final one when writing a temporary file).
        raw = _OwningGzipFile(filename=os.fspath(name if name is not None else path), mode="wb", mtime=0,
                              fileobj=open(path, "wb"))
        return io.TextIOWrapper(raw, encoding="ascii", newline="\n")
    return open(path, "wt", encoding="ascii", newline="\n")


def read_fasta(path) -> Iterator[SequenceRecord]:
    """Yield the records of a FASTA file (plain or .gz) one by one.

    Raises ValueError for sequence lines before the first header, for an
    empty header, and (with the line number) for a record without residues
    or a byte that is not ASCII (with its column).
    """
    with _open_read(path, "surrogateescape") as f:
        header = None
        header_line = 0
        chunks: list[str] = []
        for lineno, line in enumerate(f, 1):
            if not line.isascii():
                raise _not_ascii(path, lineno, line)
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


_SEQ_FORBIDDEN = re.compile(r"[\s>;]")


def check_record(caller: str, k: int, rec, *, fasta: bool) -> SequenceRecord:
    """Record ``k`` checked against what the readers give back: ``id``,
    ``sequence`` and ``description`` strings (no None); for FASTA (``fasta``)
    also: ASCII only, an id non-empty without whitespace, a description
    without line breaks or whitespace at either end (read_fasta strips it),
    a sequence non-empty without whitespace (read_fasta drops it), '>' or
    ';' (a wrapped line starting with one reads as a header or a comment)."""
    try:
        fields = {"id": rec.id, "sequence": rec.sequence, "description": rec.description}
    except AttributeError:
        raise TypeError(f"{caller}: record {k} must be a SequenceRecord, got {type(rec).__name__}") from None
    for f, v in fields.items():
        if not isinstance(v, str):
            raise TypeError(f"{caller}: record {k}: field '{f}' must be a str, got {type(v).__name__} ({v!r:.60})")
    if not fasta:
        return rec
    rid, seq, desc = fields["id"], fields["sequence"], fields["description"]
    where = f"{caller}: record {k} ({rid!r:.60})"
    for f, v in fields.items():
        if not v.isascii():
            c = next(c for c in v if not c.isascii())
            raise ValueError(f"{where}: field '{f}' must be ASCII (FASTA files are read as ASCII), got {c!r}")
    if not rid or any(c.isspace() for c in rid):
        raise ValueError(f"{caller}: record {k}: field 'id' must be non-empty without whitespace, got {rid!r}")
    if "\n" in desc or "\r" in desc:
        raise ValueError(f"{where}: field 'description' must not hold a line break (it would end the header), "
                         f"got {desc!r:.80}")
    if desc != desc.strip():
        raise ValueError(f"{where}: field 'description' must not begin or end with whitespace "
                         f"(read_fasta strips it), got {desc!r:.80}")
    if not seq:
        raise ValueError(f"{where}: field 'sequence' must be non-empty (read_fasta refuses a record without residues)")
    bad = _SEQ_FORBIDDEN.search(seq)
    if bad:
        raise ValueError(
            f"{where}: field 'sequence' must not hold whitespace, '>' or ';' (read_fasta drops whitespace and "
            f"reads a line starting with '>' as a header, with ';' as a comment), got {bad.group()!r} at "
            f"position {bad.start()}"
        )
    return rec


def check_records(caller: str, records) -> None:
    """A writer's ``records`` must be an iterable of records, not one record
    (whose fields are not records either)."""
    if isinstance(records, SequenceRecord):
        raise TypeError(f"{caller}: argument 'records' must be an iterable of SequenceRecord, got one SequenceRecord; "
                        "pass [record]")


def write_fasta(records: Iterable[SequenceRecord], path, line_width: int = 60) -> int:
    """Write records to ``path`` (gzip when it ends in .gz); returns how many.

    ``line_width`` wraps sequence lines (0 = one line per sequence).

    Only records read_fasta gives back unchanged are written (``check_record``
    names the record and the rule it breaks). The records stream into a
    temporary file next to ``path`` that replaces ``path`` once all are
    written: an error leaves an existing file as it was.
    """
    check_records("write_fasta", records)
    line_width = as_int("write_fasta", "line_width", line_width, 0)
    gz = os.fspath(path).endswith(".gz")
    n = 0
    with replacing(path, "write_fasta") as tmp:
        with _open_write(tmp, gz, name=path) as f:
            for rec in records:
                check_record("write_fasta", n, rec, fasta=True)
                f.write(">" + rec.id + (" " + rec.description if rec.description else "") + "\n")
                seq = rec.sequence
                if line_width == 0:
                    f.write(seq + "\n")
                else:
                    for i in range(0, len(seq), line_width):
                        f.write(seq[i : i + line_width] + "\n")
                n += 1
    return n
