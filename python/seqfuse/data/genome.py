"""Genome windows: fixed-length pieces of whole assemblies, both strands, as
Parquet rows with their coordinates and the dataset's provenance.

A causal DNA model trains on windows (8,192 bases and more) cut from
chromosomes and plasmids. Rule (``window_spans``), for a record of length L,
window W and stride S:
  * L >= W: windows start at 0, S, 2S, ... while they fit (start + W <= L);
    if the last one ends before L, one more window is aligned to the record's
    end, [L - W, L), so no base at the end is lost (it overlaps its
    neighbour). S = W gives non-overlapping windows; S < W overlapping ones;
    S > W skips bases between windows.
  * L < W: the whole record is one shorter window if L >= ``min_length``,
    else it is left out (plasmids of a few kb are kept with the defaults).
Circular genomes are cut as linear sequences at the assembly's origin.

Strands: "+" is the window as the assembly writes it; "-" is the reverse
complement of the same interval. ``start`` / ``end`` are 0-based, end
exclusive, on the forward strand for both. Rows (``WINDOW_COLUMNS``):
  id        "<genome>/<record id>:<start>-<end><strand>"  (unique)
  sequence  the bases, as in the source (case kept; reverse complemented
            for "-")
  genome    the genome's name (the unit of the train/validation split)
  record_id the FASTA record (chromosome, plasmid) id
  strand    "+" or "-"
  start, end  int64
Files carry the dataset's description (sources, licences, settings, split)
as JSON under the schema metadata key ``seqfuse.dataset``
(``read_dataset_metadata``). read_parquet / load_sequences read these files
too (columns id, sequence).
"""
from __future__ import annotations

import json
from typing import Iterable, Iterator, Sequence

from ._checks import as_int
from .fasta import SequenceRecord
from .nucleotide import reverse_complement
from .parquet import read_metadata, write_rows

__all__ = ["WINDOW_COLUMNS", "METADATA_KEY", "window_spans", "genome_windows", "write_windows", "read_dataset_metadata"]

WINDOW_COLUMNS = ("id", "sequence", "genome", "record_id", "strand", "start", "end")
METADATA_KEY = "seqfuse.dataset"


def window_spans(length: int, window: int, stride: int, min_length: int = 1) -> list[tuple[int, int]]:
    """``(start, end)`` of the windows of a record of ``length`` bases (the
    module note states the rule)."""
    length, window, stride, min_length = (
        as_int("window_spans", name, v) for name, v in
        (("length", length), ("window", window), ("stride", stride), ("min_length", min_length)))
    if window < 1 or stride < 1 or min_length < 1 or length < 0:
        raise ValueError(
            f"window_spans: need window >= 1, stride >= 1, min_length >= 1, length >= 0; got window={window}, "
            f"stride={stride}, min_length={min_length}, length={length}"
        )
    if min_length > window:
        raise ValueError(f"window_spans: argument 'min_length' ({min_length}) must be <= 'window' ({window})")
    if length < window:
        return [(0, length)] if length >= min_length else []
    spans = [(s, s + window) for s in range(0, length - window + 1, stride)]
    if spans[-1][1] < length:
        spans.append((length - window, length))
    return spans


def genome_windows(
    genome: str,
    record: SequenceRecord,
    *,
    window: int,
    stride: int,
    strands: Sequence[str] = ("+", "-"),
    min_length: int = 1,
    offset: int = 0,
) -> Iterator[dict]:
    """The window rows of one record: for each span, one row per strand in
    ``strands`` order. ``offset`` is added to the coordinates (for a record
    that is a region of a larger one)."""
    if not isinstance(genome, str):
        raise TypeError(f"genome_windows: argument 'genome' must be a str, got {type(genome).__name__}")
    if not genome or "/" in genome or any(c.isspace() for c in genome):
        raise ValueError(f"genome_windows: argument 'genome' must be a non-empty name without '/' or spaces, got {genome!r}")
    if not strands or any(s not in ("+", "-") for s in strands) or len(set(strands)) != len(strands):
        raise ValueError(f"genome_windows: argument 'strands' must be distinct '+' / '-' entries, got {strands!r}")
    offset = as_int("genome_windows", "offset", offset, 0)
    if not isinstance(record, SequenceRecord):
        raise TypeError(f"genome_windows: argument 'record' must be a SequenceRecord, got {type(record).__name__}")
    seq = record.sequence
    for a, b in window_spans(len(seq), window, stride, min_length):
        piece = seq[a:b]
        for strand in strands:
            start, end = a + offset, b + offset
            wid = f"{genome}/{record.id}:{start}-{end}{strand}"
            if strand == "+":
                bases = piece
            else:
                try:
                    bases = reverse_complement(piece)
                except ValueError as e:
                    raise ValueError(f"genome_windows: window {wid} cannot be reverse complemented: {e}") from None
            yield {
                "id": wid,
                "sequence": bases,
                "genome": genome,
                "record_id": record.id,
                "strand": strand,
                "start": start,
                "end": end,
            }


def write_windows(rows: Iterable[dict], path, dataset: dict, *, row_group_size: int = 256,
                  compression_level: int | None = None) -> int:
    """Write window rows to Parquet (zstd) with ``dataset`` (a JSON-able
    dict) as the file's ``seqfuse.dataset`` metadata; returns the row count."""
    import pyarrow as pa

    schema = pa.schema([
        ("id", pa.string()), ("sequence", pa.string()), ("genome", pa.string()), ("record_id", pa.string()),
        ("strand", pa.string()), ("start", pa.int64()), ("end", pa.int64()),
    ])
    meta = {METADATA_KEY: json.dumps(dataset, sort_keys=True)}
    return write_rows(
        rows, path, schema, row_group_size=row_group_size, compression_level=compression_level,
        use_dictionary=["genome", "record_id", "strand"], metadata=meta, caller="write_windows",
    )


def read_dataset_metadata(path) -> dict:
    """The ``seqfuse.dataset`` description of a windows file; ValueError if
    the file has none."""
    meta = read_metadata(path)
    if METADATA_KEY not in meta:
        raise ValueError(f"read_dataset_metadata: {path} has no {METADATA_KEY!r} metadata (not written by write_windows)")
    return json.loads(meta[METADATA_KEY])
