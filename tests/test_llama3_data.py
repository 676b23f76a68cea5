"""The Llama 3 recipe's DNA data: the window rule (seqfuse.data.genome), the
committed lambda phage subset (coordinates, strands, region split, provenance
metadata, identical regeneration), recipes/llama3/prepare_data.py's
split by whole genome on a mock package tree built from real lambda DNA, the
Debian copyright reader, and .xz FASTA reading. Nothing is downloaded."""
import gzip
import hashlib
import importlib.util
import json
import lzma
import sys
from functools import lru_cache
from pathlib import Path

import pytest

from seqfuse.data import SequenceRecord, read_fasta, read_parquet, reverse_complement
from seqfuse.data.debian import DebianPackage, fetch_package, read_copyright
from seqfuse.data.genome import WINDOW_COLUMNS, genome_windows, read_dataset_metadata, window_spans

pq = pytest.importorskip("pyarrow.parquet")

ROOT = Path(__file__).resolve().parents[1]
SUBSET = ROOT / "recipes" / "llama3" / "data" / "subset"
LAMBDA_LENGTH = 48502  # NC_001416.1


@lru_cache(maxsize=None)
def subset_rows(split):
    return tuple(pq.read_table(SUBSET / f"{split}.parquet").to_pylist())


@lru_cache(maxsize=1)
def lambda_genome() -> str:
    """The lambda genome rebuilt from the subset's forward windows (they tile
    it: [0, cut) in train, [cut, end) in validation)."""
    seq = [None] * LAMBDA_LENGTH
    for split in ("train", "validation"):
        for r in subset_rows(split):
            if r["strand"] == "+":
                for k, c in enumerate(r["sequence"]):
                    assert seq[r["start"] + k] in (None, c)  # overlapping windows agree
                    seq[r["start"] + k] = c
    assert None not in seq, "the subset's forward windows do not cover lambda"
    return "".join(seq)


def load_prepare():
    spec = importlib.util.spec_from_file_location("llama3_prepare_data", ROOT / "recipes" / "llama3" / "prepare_data.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


# -- the window rule ----------------------------------------------------------
def test_window_spans_rule():
    assert window_spans(10, 4, 4) == [(0, 4), (4, 8), (6, 10)]  # tail aligned to the end
    assert window_spans(12, 4, 4) == [(0, 4), (4, 8), (8, 12)]  # exact fit: no extra window
    assert window_spans(10, 4, 2) == [(0, 4), (2, 6), (4, 8), (6, 10)]
    assert window_spans(10, 4, 5) == [(0, 4), (5, 9), (6, 10)]  # stride > window skips bases
    assert window_spans(3, 4, 4) == [(0, 3)]  # short record: one short window
    assert window_spans(3, 4, 4, min_length=4) == []  # ... unless shorter than min_length
    assert window_spans(0, 4, 4) == []
    for n in range(1, 40):
        for w in (1, 3, 8):
            for s in (1, 2, 3, 8, 9):
                spans = window_spans(n, w, s)
                assert all(b - a == min(w, n) for a, b in spans)
                assert spans[-1][1] == n and spans[0][0] == 0
    with pytest.raises(ValueError, match="need window >= 1"):
        window_spans(10, 0, 1)
    with pytest.raises(ValueError, match="'min_length' \\(5\\) must be <= 'window' \\(4\\)"):
        window_spans(10, 4, 4, min_length=5)
    with pytest.raises(TypeError, match="argument 'stride' must be an int"):
        window_spans(10, 4, 2.0)


def test_genome_windows_strands_and_ids():
    rec = SequenceRecord("chr1", lambda_genome()[:2500])
    rows = list(genome_windows("lam", rec, window=1000, stride=1000, offset=7))
    assert [(r["start"], r["end"], r["strand"]) for r in rows] == [
        (7, 1007, "+"), (7, 1007, "-"), (1007, 2007, "+"), (1007, 2007, "-"), (1507, 2507, "+"), (1507, 2507, "-")]
    assert rows[0]["id"] == "lam/chr1:7-1007+" and rows[1]["id"] == "lam/chr1:7-1007-"
    for plus, minus in zip(rows[::2], rows[1::2]):
        assert plus["sequence"] == rec.sequence[plus["start"] - 7 : plus["end"] - 7]
        assert minus["sequence"] == reverse_complement(plus["sequence"])
    assert set(rows[0]) == set(WINDOW_COLUMNS)
    with pytest.raises(ValueError, match="argument 'strands'"):
        list(genome_windows("lam", rec, window=1000, stride=1000, strands=("+", "x")))
    with pytest.raises(ValueError, match="argument 'genome'"):
        list(genome_windows("a/b", rec, window=1000, stride=1000))


# -- the committed subset -------------------------------------------------------
def test_subset_is_lambda_phage_both_strands():
    train, val = subset_rows("train"), subset_rows("validation")
    assert (len(train), len(val)) == (80, 16)
    genome = lambda_genome()
    assert genome.startswith("GGGCGGCGACCTCGCGGGTTTTCGCTATTTATGAAAATTTTCCGGTTTAAGGCGTTTCCG")  # NC_001416.1
    assert set(genome) == set("ACGT")
    for r in train + val:
        assert r["genome"] == "lambda_phage" and r["record_id"] == "gi|9626243|ref|NC_001416.1|"
        assert r["end"] - r["start"] == len(r["sequence"]) == 1024
        forward = genome[r["start"] : r["end"]]
        assert r["sequence"] == (forward if r["strand"] == "+" else reverse_complement(forward))
    assert len({r["id"] for r in train + val}) == 96
    # region split: no validation base inside a training window
    cut = min(r["start"] for r in val)
    assert max(r["end"] for r in train) == cut == LAMBDA_LENGTH - 8192
    assert [r["strand"] for r in train[:2]] == ["+", "-"]
    # read_parquet / load_sequences read these files too
    assert [r.id for r in read_parquet(SUBSET / "validation.parquet")] == [r["id"] for r in val]


def test_subset_metadata_names_source_and_licence():
    manifest = json.loads((SUBSET / "manifest.json").read_text())
    for split in ("train", "validation"):
        path = SUBSET / f"{split}.parquet"
        meta = read_dataset_metadata(path)
        assert meta["part"] == split
        (src,) = meta["sources"]
        assert (src["name"], src["version"], src["licence"], src["source_package"]) == (
            "bowtie2-examples", "2.5.0-3", "GPL-3.0+", "bowtie2")
        assert meta["genomes"][0]["accession"] == "NC_001416.1"
        assert meta["windows"] == {"window": 1024, "stride": 1024, "strands": ["+", "-"], "min_length": 1000,
                                   "max_n_fraction": 0.1}
        assert "split by region" in meta["split"]
        assert manifest["outputs"][split]["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert sum(p.stat().st_size for p in SUBSET.iterdir()) < 200_000


def _mock_package(tmp_path, name, root, version="1.0-1", licence="GPL-3+"):
    return DebianPackage(
        name=name, version=version, source_package=name.replace("-examples", ""), deb=str(tmp_path / f"{name}.deb"),
        deb_sha256="0" * 64, root=str(root), upstream_name=name, upstream_source="https://example.org",
        licence=licence, copyright_file=f"usr/share/doc/{name}/copyright",
    )


def _write_fasta_file(path: Path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(f">{r.id} {r.description}\n" + "\n".join(r.sequence[i : i + 70] for i in range(0, len(r.sequence), 70)) + "\n"
                   for r in records)
    opener = lzma.open if path.suffix == ".xz" else gzip.open
    with opener(path, "wt") as f:
        f.write(text)


def test_subset_regenerates_identically(tmp_path):
    """prepare_data.py's subset path, fed the lambda genome (rebuilt from the
    committed windows) and the package description the manifest records,
    writes the committed rows, metadata and manifest again."""
    prep = load_prepare()
    src = json.loads((SUBSET / "manifest.json").read_text())["sources"][0]
    g = prep.GENOME_BY_NAME["lambda_phage"]
    root = tmp_path / "pkg"
    _write_fasta_file(root / g.path, [SequenceRecord("gi|9626243|ref|NC_001416.1|", lambda_genome(),
                                                     "Enterobacteria phage lambda, complete genome")])
    fields = {k: v for k, v in src.items() if k != "deb"}
    pkg = DebianPackage(deb=str(tmp_path / src["deb"]), root=str(root), **fields)
    args = prep.argparse.Namespace(subset_dir=str(tmp_path / "subset"), subset_window=1024, subset_validation_bases=8192,
                                   strands=["+", "-"], min_length=1000, max_n_fraction=0.1)
    prep.prepare_subset(args, {"bowtie2-examples": pkg})
    new = tmp_path / "subset"
    for name in ("train.parquet", "validation.parquet"):
        assert pq.read_table(new / name).to_pylist() == pq.read_table(SUBSET / name).to_pylist(), name
        assert read_dataset_metadata(new / name) == read_dataset_metadata(SUBSET / name)
    # The files' bytes (and so the manifest's sha256) depend on the pyarrow
    # version as well; the rest of the manifest must match exactly.
    made, committed = (json.loads((d / "manifest.json").read_text()) for d in (new, SUBSET))
    for m in (made, committed):
        for out in m["outputs"].values():
            out.pop("sha256")
    assert made == committed


def test_full_preparation_splits_by_whole_genome(tmp_path):
    """prepare_data.py's full path on a mock package tree: every genome file
    in place (pieces of real lambda DNA, .gz and .xz, one with an IUPAC-rich
    stretch), windows of 1024 bases, default validation genomes."""
    prep = load_prepare()
    genome = lambda_genome()
    root = tmp_path / "pkg"
    for k, g in enumerate(prep.GENOMES):
        a = (k * 1700) % (LAMBDA_LENGTH - 3000)
        recs = [SequenceRecord(f"rec{k}", genome[a : a + 2600].lower() if k % 2 else genome[a : a + 2600], "chromosome")]
        if g.name == "kpneumoniae_HS11286":
            recs.append(SequenceRecord("plasmid_short", genome[:900], "too short: left out"))
            recs.append(SequenceRecord("plasmid_n", "ACGTRYN" * 200, "mostly ambiguous: dropped"))
        _write_fasta_file(root / g.path, recs)
    packages = {p: _mock_package(tmp_path, p, root, licence=lic) for p, lic in
                (("ragout-examples", "BSD-3-clause"), ("kleborate-examples", "GPL-3+"), ("bowtie2-examples", "GPL-3.0+"))}
    out = tmp_path / "full"
    args = prep.argparse.Namespace(out_dir=str(out), window=1024, stride=1024, strands=["+", "-"], min_length=1000,
                                   max_n_fraction=0.1, validation_genomes=list(prep.VALIDATION_GENOMES))
    prep.prepare_full(args, packages)
    train = pq.read_table(out / "train.parquet").to_pylist()
    val = pq.read_table(out / "validation.parquet").to_pylist()
    val_genomes = {r["genome"] for r in val}
    assert val_genomes == set(prep.VALIDATION_GENOMES)
    assert not val_genomes & {r["genome"] for r in train}  # no window of a validation genome in training
    assert {r["genome"] for r in train} | val_genomes == {g.name for g in prep.GENOMES}
    # 2600 bases, window 1024: spans (0,1024) (1024,2048) (1576,2600), two strands
    assert len(val) == 3 * 3 * 2 and len(train) == 18 * 6
    assert all(len(r["sequence"]) == 1024 for r in train + val)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["per_genome"]["kpneumoniae_HS11286"]["dropped_non_acgt"] == 4  # 2 spans x 2 strands
    assert "plasmid_short" in manifest["per_genome"]["kpneumoniae_HS11286"]["records"]
    meta = read_dataset_metadata(out / "train.parquet")
    assert {s["name"]: s["licence"] for s in meta["sources"]} == {
        "ragout-examples": "BSD-3-clause", "kleborate-examples": "GPL-3+", "bowtie2-examples": "GPL-3.0+"}
    assert "by whole genome" in meta["split"] and meta["part"] == "train"
    with pytest.raises(SystemExit, match="unknown genomes \\['nope'\\]"):
        prep.prepare_full(prep.argparse.Namespace(**{**vars(args), "validation_genomes": ["nope"]}), packages)


def test_prepare_data_argument_errors(capsys):
    prep = load_prepare()
    with pytest.raises(SystemExit):
        prep.main(["--max-n-fraction", "2"])
    assert "--max-n-fraction must be in [0, 1]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        prep.main(["--subset-only"])
    assert "--subset-only needs --subset-dir" in capsys.readouterr().err


# -- Debian and FASTA pieces ---------------------------------------------------
COPYRIGHT = """Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: Ragout
Source: https://github.com/fenderglass/Ragout/releases

Files: *
Copyright: 2013-2018 Mikhail Kolmogorov and Joel Armstrong and
                     Son Pham
License: BSD-3-clause

Files: ragout/newick/*
Copyright: 2003-2008 Thomas Mailund
License: GPL-2+
 This program is free software; you can redistribute it
"""


def test_read_copyright(tmp_path):
    p = tmp_path / "copyright"
    p.write_text(COPYRIGHT)
    assert read_copyright(p) == {"upstream_name": "Ragout", "upstream_source": "https://github.com/fenderglass/Ragout/releases",
                                 "licence": "BSD-3-clause"}
    p.write_text(COPYRIGHT.replace("Files: *", "Files: src/*"))
    with pytest.raises(ValueError, match="no 'Files: \\*' stanza"):
        read_copyright(p)


def test_fetch_package_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="argument 'name' must be a package name"):
        fetch_package("two words", tmp_path)
    with pytest.raises(RuntimeError, match="no such file"):
        fetch_package("bowtie2-examples", tmp_path, deb=str(tmp_path / "missing.deb"))


def test_read_fasta_xz(tmp_path):
    recs = [SequenceRecord("a", lambda_genome()[:500], "x"), SequenceRecord("b", lambda_genome()[500:777])]
    _write_fasta_file(tmp_path / "g.fna.xz", recs)
    assert list(read_fasta(tmp_path / "g.fna.xz")) == [SequenceRecord("a", recs[0].sequence, "x"),
                                                       SequenceRecord("b", recs[1].sequence, "")]
