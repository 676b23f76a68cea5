#!/usr/bin/env python3
"""Prepare the ESM-2 recipe's real protein data: UniProt sequences shipped in
Debian's ``mmseqs2-examples`` package, as Parquet with a train/validation split.

Steps (all deterministic, so two runs give byte-identical Parquet files):
  1. ``apt-get download mmseqs2-examples`` into a scratch folder and
     ``dpkg -x`` it (or use --deb / --example-dir to skip either step);
  2. read example-data/DB.fasta.gz (20,000 proteins) and QUERY.fasta.gz (500),
     drop records whose exact sequence was already seen (the files overlap);
  3. split by a hash of the sequence id: validation when
     sha256(id) mod 10,000 < 10,000 x --validation-fraction, train otherwise,
     rows ordered by that hash (a stable shuffle);
  4. write <out>/train.parquet, <out>/validation.parquet (columns id,
     sequence, description) and <out>/manifest.json (counts, length
     statistics, sha256 of inputs and outputs);
  5. with --subset-dir, also write the small subset committed under
     recipes/esm2/data/subset/ (the first N rows of each split, ids and
     sequences only) that CI and the CPU L0_sanity recipe use.

Source and licence: recipes/esm2/DATA.md (UniProt, CC BY 4.0).

    python recipes/esm2/prepare_data.py                       # -> recipes/esm2/data/full
    python recipes/esm2/prepare_data.py --apt-update          # run apt-get update first (root)
    python recipes/esm2/prepare_data.py --subset-dir recipes/esm2/data/subset
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

from seqfuse.data.debian import DebianPackageError, download_deb, run_tool, sha256_file  # noqa: E402
from seqfuse.data.fasta import SequenceRecord, read_fasta  # noqa: E402
from seqfuse.data.parquet import write_parquet  # noqa: E402

PACKAGE = "mmseqs2-examples"
SOURCE_FILES = ("DB.fasta.gz", "QUERY.fasta.gz")
HASH_BUCKETS = 10_000


class PrepareError(RuntimeError):
    pass


def fetch_deb(workdir: str, apt_update: bool) -> str:
    """Download the package's .deb into workdir with apt-get
    (seqfuse.data.debian.download_deb, whose DebianPackageError main reports
    like a PrepareError); returns its path."""
    if shutil.which("apt-get") is None:
        raise PrepareError(
            "apt-get is not available on this machine. The data come from Debian's "
            f"'{PACKAGE}' package: fetch it on a Debian/Ubuntu machine (apt-get download {PACKAGE}) "
            "and pass --deb PATH, or pass --example-dir with its extracted example-data folder."
        )
    return download_deb(PACKAGE, workdir, apt_update)


def extract_deb(deb: str, workdir: str) -> str:
    """dpkg -x the .deb; returns the example-data folder inside it."""
    if shutil.which("dpkg") is None:
        raise PrepareError("dpkg is not available: it is needed to unpack the .deb (or pass --example-dir)")
    dest = os.path.join(workdir, "extracted")
    run_tool(["dpkg", "-x", os.path.abspath(deb), dest], cwd=workdir)
    return find_example_dir(dest)


def find_example_dir(root: str) -> str:
    hits = glob.glob(os.path.join(root, "**", "example-data", SOURCE_FILES[0]), recursive=True)
    if not hits:
        raise PrepareError(f"no example-data/{SOURCE_FILES[0]} under {root}")
    return os.path.dirname(sorted(hits)[0])


def id_bucket(seq_id: str) -> int:
    return int.from_bytes(hashlib.sha256(seq_id.encode()).digest()[:8], "big") % HASH_BUCKETS


def split_records(records: list[SequenceRecord], validation_fraction: float):
    """(train, validation), each ordered by (hash bucket, full hash)."""
    cut = round(validation_fraction * HASH_BUCKETS)
    keyed = sorted(records, key=lambda r: hashlib.sha256(r.id.encode()).digest())
    train = [r for r in keyed if id_bucket(r.id) >= cut]
    val = [r for r in keyed if id_bucket(r.id) < cut]
    return train, val


def read_source(example_dir: str) -> tuple[list[SequenceRecord], dict]:
    seen, records, stats = set(), [], {}
    for name in SOURCE_FILES:
        path = os.path.join(example_dir, name)
        if not os.path.exists(path):
            raise PrepareError(f"{path} is missing")
        n = dup = 0
        for rec in read_fasta(path):
            n += 1
            if rec.sequence in seen:
                dup += 1
                continue
            seen.add(rec.sequence)
            records.append(rec)
        stats[name] = {"records": n, "duplicate_sequences_dropped": dup, "sha256": sha256_file(path)}
    return records, stats


def length_stats(records) -> dict:
    lens = sorted(len(r.sequence) for r in records)
    if not lens:
        return {"count": 0}
    return {
        "count": len(lens),
        "residues": sum(lens),
        "min": lens[0],
        "median": statistics.median(lens),
        "p90": lens[int(0.9 * (len(lens) - 1))],
        "max": lens[-1],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", default=os.path.join(HERE, "data", "full"))
    ap.add_argument("--validation-fraction", type=float, default=0.05)
    ap.add_argument("--deb", help="an already downloaded mmseqs2-examples_*.deb (skips apt-get download)")
    ap.add_argument("--example-dir", help="an already extracted example-data folder (skips apt and dpkg)")
    ap.add_argument("--apt-update", action="store_true", help="run apt-get update before downloading")
    ap.add_argument("--subset-dir", help="also write the small committed subset here")
    ap.add_argument("--subset-train", type=int, default=2000)
    ap.add_argument("--subset-validation", type=int, default=200)
    args = ap.parse_args(argv)
    if not 0.0 < args.validation_fraction < 1.0:
        ap.error("--validation-fraction must be in (0, 1)")

    with tempfile.TemporaryDirectory(prefix="seqfuse_esm2_") as work:
        try:
            if args.example_dir:
                example_dir = args.example_dir
                deb_name = None
            else:
                if args.deb and not os.path.isfile(args.deb):
                    raise PrepareError(f"--deb {args.deb}: no such file")
                deb = args.deb or fetch_deb(work, args.apt_update)
                deb_name = os.path.basename(deb)
                example_dir = extract_deb(deb, work)
            records, source_stats = read_source(example_dir)
        except (PrepareError, DebianPackageError) as e:
            print(f"prepare_data: error: {e}", file=sys.stderr)
            return 1

        train, val = split_records(records, args.validation_fraction)
        os.makedirs(args.out_dir, exist_ok=True)
        outputs = {}
        for name, recs in (("train", train), ("validation", val)):
            path = os.path.join(args.out_dir, f"{name}.parquet")
            write_parquet(recs, path)
            outputs[name] = {"file": os.path.basename(path), "sha256": sha256_file(path), **length_stats(recs)}
        manifest = {
            "source": f"Debian package {PACKAGE}" + (f" ({deb_name})" if deb_name else ""),
            "source_files": source_stats,
            "origin": "UniProtKB (Swiss-Prot and TrEMBL entries), https://www.uniprot.org",
            "licence": "CC BY 4.0 (https://creativecommons.org/licenses/by/4.0/); see recipes/esm2/DATA.md",
            "split": f"validation if sha256(id) mod {HASH_BUCKETS} < {round(args.validation_fraction * HASH_BUCKETS)}",
            "outputs": outputs,
        }
        with open(os.path.join(args.out_dir, "manifest.json"), "w") as f:
            json.dump(manifest, f, indent=2, sort_keys=True)
            f.write("\n")
        print(f"prepare_data: {len(train)} train, {len(val)} validation -> {args.out_dir}")

        if args.subset_dir:
            os.makedirs(args.subset_dir, exist_ok=True)
            sub = {}
            for name, recs, n in (("train", train, args.subset_train), ("validation", val, args.subset_validation)):
                picked = [SequenceRecord(r.id, r.sequence) for r in recs[:n]]
                path = os.path.join(args.subset_dir, f"{name}.parquet")
                write_parquet(picked, path, compression_level=19)
                sub[name] = {"file": os.path.basename(path), "sha256": sha256_file(path), **length_stats(picked)}
            sub_manifest = dict(manifest, outputs=sub, subset_of="the first rows of each split of the full preparation")
            with open(os.path.join(args.subset_dir, "manifest.json"), "w") as f:
                json.dump(sub_manifest, f, indent=2, sort_keys=True)
                f.write("\n")
            print(f"prepare_data: subset {args.subset_train} + {args.subset_validation} -> {args.subset_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
