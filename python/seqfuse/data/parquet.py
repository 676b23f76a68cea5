"""Parquet storage of sequence records (columns ``id``, ``sequence``,
``description``; ``write_rows`` for other schemas, such as the genome windows
of genome.py, with file metadata), through pyarrow.

pyarrow is imported lazily, so the rest of seqfuse.data works without it;
calling these functions without pyarrow raises an ImportError that says what
to install. Reading streams record batches, so a large file is never loaded
whole unless asked (``load_sequences``).
"""
from __future__ import annotations

import os
from typing import Iterable, Iterator, Mapping

from ._checks import as_int, exact_int
from ._files import replacing
from .fasta import SequenceRecord, check_record, check_records, read_fasta

__all__ = ["write_parquet", "write_rows", "read_metadata", "read_parquet", "iter_records", "load_sequences"]

_COLUMNS = ("id", "sequence", "description")


def _pyarrow():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "seqfuse.data Parquet support needs pyarrow: pip install pyarrow"
        ) from e
    return pa, pq


def write_parquet(
    records: Iterable[SequenceRecord],
    path,
    row_group_size: int = 4096,
    compression: str = "zstd",
    compression_level: int | None = None,
) -> int:
    """Write records to a Parquet file in row groups of ``row_group_size``;
    returns the number written. Streams: at most one row group is in memory.
    ``id``, ``sequence`` and ``description`` must be strings (read_parquet
    refuses a null id or sequence); like ``write_rows``, an error leaves an
    existing file as it was."""
    check_records("write_parquet", records)
    pa, _ = _pyarrow()
    schema = pa.schema([(c, pa.string()) for c in _COLUMNS])
    rows = (_record_row(k, r) for k, r in enumerate(records))
    # No dictionary encoding for sequences: they are almost all distinct strings.
    return write_rows(
        rows, path, schema, row_group_size=row_group_size, compression=compression,
        compression_level=compression_level, use_dictionary=["id"], caller="write_parquet",
    )


def _record_row(k: int, rec) -> dict:
    check_record("write_parquet", k, rec, fasta=False)
    return {"id": rec.id, "sequence": rec.sequence, "description": rec.description}


def write_rows(
    rows: Iterable[dict],
    path,
    schema,
    *,
    row_group_size: int = 4096,
    compression: str = "zstd",
    compression_level: int | None = None,
    use_dictionary=True,
    metadata: dict[str, str] | None = None,
    caller: str = "write_rows",
) -> int:
    """Write dict rows (one key per column of the pyarrow ``schema``) to a
    Parquet file in row groups of ``row_group_size``, streaming; returns the
    number written. ``metadata`` (str -> str) goes into the file's schema
    metadata (read back with ``read_metadata``).

    Each row is a dict; an integer column takes integers only (pyarrow
    would truncate a float, 5.5 -> 5); a value pyarrow cannot convert is
    named by row and column.

    The rows stream into a temporary file next to ``path`` that replaces
    ``path`` once all are written: an error (a bad row) leaves an existing
    file as it was."""
    pa, pq = _pyarrow()
    row_group_size = as_int(caller, "row_group_size", row_group_size, 1)
    if metadata:
        schema = schema.with_metadata({str(k): str(v) for k, v in metadata.items()})
    names = schema.names
    # pyarrow truncates a float written to an integer column (5.5 -> 5): those are checked row by row
    int_cols = [c for c in names if pa.types.is_integer(schema.field(c).type)]
    n = 0
    buf = {c: [] for c in names}

    def flush(writer):
        try:
            table = pa.table(buf, schema=schema)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as e:
            raise _bad_value(pa, caller, schema, buf, n - len(buf[names[0]]), e) from None
        writer.write_table(table, row_group_size=row_group_size)
        for c in names:
            buf[c].clear()

    with replacing(path, caller) as tmp, pq.ParquetWriter(
        tmp, schema, compression=compression, compression_level=compression_level,
        use_dictionary=use_dictionary,
    ) as writer:
        for row in rows:
            if not isinstance(row, Mapping):
                raise TypeError(f"{caller}: row {n} must be a dict (one key per column), got {type(row).__name__}")
            if row.keys() != buf.keys():
                raise ValueError(f"{caller}: row {n} has columns {sorted(row)}, the schema {sorted(names)}")
            for c in int_cols:
                v = row[c]
                if v is not None and exact_int(v) is None:
                    raise TypeError(f"{caller}: row {n}: column {c!r} must hold integers ({schema.field(c).type}), "
                                    f"got {type(v).__name__} ({v!r:.40})")
            for c in names:
                buf[c].append(row[c])
            n += 1
            if len(buf[names[0]]) == row_group_size:
                flush(writer)
        if buf[names[0]] or n == 0:
            flush(writer)
    return n


def _bad_value(pa, caller, schema, buf, first_row, err):
    """The error for a row group pyarrow could not convert: the first value
    that does not convert on its own, by row and column (pyarrow's own
    message names neither): a TypeError for a value of the wrong kind, a
    ValueError for one out of the column's range."""
    for c in schema.names:
        typ = schema.field(c).type
        for k, v in enumerate(buf[c]):
            try:
                pa.array([v], type=typ)
            except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as e:
                kind = TypeError if isinstance(e, pa.ArrowTypeError) else ValueError
                return kind(f"{caller}: row {first_row + k}: column {c!r} ({typ}) cannot hold {v!r:.60} "
                            f"({type(v).__name__})")
    return type(err)(f"{caller}: rows {first_row} to {first_row + len(buf[schema.names[0]]) - 1}: {err}")


def read_metadata(path) -> dict[str, str]:
    """The schema metadata of a Parquet file (str -> str; pyarrow's own
    ``ARROW:schema`` entry left out)."""
    _, pq = _pyarrow()
    meta = pq.read_schema(os.fspath(path)).metadata or {}
    return {k.decode(): v.decode() for k, v in meta.items() if k != b"ARROW:schema"}


def read_parquet(path, batch_size: int = 4096) -> Iterator[SequenceRecord]:
    """Yield the records of a Parquet file written by ``write_parquet`` (or
    any file with string columns ``id`` and ``sequence``; ``description`` is
    optional)."""
    pa, pq = _pyarrow()
    batch_size = as_int("read_parquet", "batch_size", batch_size, 1)
    pf = pq.ParquetFile(os.fspath(path))
    names = set(pf.schema_arrow.names)
    missing = {"id", "sequence"} - names
    if missing:
        raise ValueError(f"read_parquet: {path} lacks column(s) {sorted(missing)}; has {sorted(names)}")
    cols = [c for c in _COLUMNS if c in names]
    for c in cols:
        typ = pf.schema_arrow.field(c).type
        if not (pa.types.is_string(typ) or pa.types.is_large_string(typ)
                or getattr(pa.types, "is_string_view", lambda t: False)(typ)):
            raise ValueError(f"read_parquet: {path}: column {c!r} must hold strings, got {typ}")
    row = 0
    for batch in pf.iter_batches(batch_size=batch_size, columns=cols):
        d = batch.to_pydict()
        descs = d.get("description") or [""] * len(d["id"])
        for i, s, desc in zip(d["id"], d["sequence"], descs):
            if s is None or i is None:
                raise ValueError(f"read_parquet: {path}: row {row} has a null id or sequence")
            yield SequenceRecord(id=i, sequence=s, description=desc or "")
            row += 1


def iter_records(path) -> Iterator[SequenceRecord]:
    """Records from a FASTA (.fa/.fasta/.faa/.fna, optionally .gz or .xz) or Parquet
    file, chosen by suffix."""
    p = os.fspath(path).lower()
    if p.endswith(".parquet") or p.endswith(".pq"):
        return read_parquet(path)
    base = p[:-3] if p.endswith((".gz", ".xz")) else p
    if base.endswith((".fa", ".fasta", ".faa", ".fna", ".fas")):
        return read_fasta(path)
    raise ValueError(
        f"iter_records: cannot tell the format of {path!r}: expected .parquet or .fasta/.fa/.faa/.fna[.gz|.xz]"
    )


def load_sequences(path) -> tuple[list[str], list[str]]:
    """All ``(ids, sequences)`` of a FASTA or Parquet file, in file order."""
    ids, seqs = [], []
    for rec in iter_records(path):
        ids.append(rec.id)
        seqs.append(rec.sequence)
    return ids, seqs
