"""seqfuse.data readers and writers (FASTA plain/.gz, Parquet) on the real
UniProt subset, and recipes/esm2/prepare_data.py on a mock package folder."""
import gzip
import hashlib
import importlib.util
import os
from functools import lru_cache
from pathlib import Path

import pytest

from seqfuse.data import SequenceRecord, iter_records, load_sequences, read_fasta, read_parquet, write_fasta, write_parquet

pytest.importorskip("pyarrow")

ROOT = Path(__file__).resolve().parents[1]
SUBSET = ROOT / "recipes" / "esm2" / "data" / "subset"


@lru_cache(maxsize=None)
def subset_records(split="train"):
    return tuple(read_parquet(SUBSET / f"{split}.parquet"))


def test_subset_is_real_uniprot():
    train, val = subset_records("train"), subset_records("validation")
    assert len(train) == 2000 and len(val) == 200
    assert all(r.id.startswith(("sp|", "tr|")) for r in train + val)
    assert not {r.id for r in train} & {r.id for r in val}
    lens = sorted(len(r.sequence) for r in train)
    assert 250 < lens[len(lens) // 2] < 450  # median near UniProt's ~345
    assert set("".join(r.sequence for r in train)) <= set("ACDEFGHIKLMNPQRSTVWYXBZUO")


@pytest.mark.parametrize("suffix,width", [(".fasta", 60), (".fasta.gz", 0), (".fa.gz", 17)])
def test_fasta_round_trip_real(tmp_path, suffix, width):
    recs = [SequenceRecord(r.id, r.sequence, "desc %d" % k if k % 3 else "") for k, r in enumerate(subset_records()[:300])]
    path = tmp_path / ("x" + suffix)
    assert write_fasta(recs, path, line_width=width) == 300
    if suffix.endswith(".gz"):
        assert path.read_bytes()[:2] == b"\x1f\x8b"
    back = list(read_fasta(path))
    assert back == recs
    ids, seqs = load_sequences(path)
    assert ids == [r.id for r in recs] and seqs == [r.sequence for r in recs]


def test_fasta_gz_is_deterministic(tmp_path):
    recs = subset_records()[:50]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    write_fasta(recs, tmp_path / "a" / "x.fasta.gz")  # gzip stores the name, not the time
    write_fasta(recs, tmp_path / "b" / "x.fasta.gz")
    assert (tmp_path / "a" / "x.fasta.gz").read_bytes() == (tmp_path / "b" / "x.fasta.gz").read_bytes()


def test_fasta_parsing_details(tmp_path):
    p = tmp_path / "odd.fa"
    p.write_text(";comment\n>a first one\nMKT\n  AY \n\n>b\nLL\r\n>c\tx y\nQ\n")
    recs = list(read_fasta(p))
    assert recs == [SequenceRecord("a", "MKTAY", "first one"), SequenceRecord("b", "LL"), SequenceRecord("c", "Q", "x y")]
    # gzip is detected by content, whatever the suffix
    g = tmp_path / "hidden.txt"
    with gzip.open(g, "wt") as f:
        f.write(">z\nAC\n")
    assert list(read_fasta(g)) == [SequenceRecord("z", "AC")]


@pytest.mark.parametrize(
    "text,match",
    [("MKT\n>a\nM\n", "before the first '>' header"), (">\nMKT\n", "empty header"), (">a\n>b\nM\n", "'a' has no sequence")],
)
def test_fasta_bad_input(tmp_path, text, match):
    p = tmp_path / "bad.fasta"
    p.write_text(text)
    with pytest.raises(ValueError, match=match):
        list(read_fasta(p))


def test_write_fasta_bad_id(tmp_path):
    with pytest.raises(ValueError, match="without whitespace"):
        write_fasta([SequenceRecord("a b", "M")], tmp_path / "x.fa")


@pytest.mark.parametrize("row_group", [1, 7, 4096])
def test_parquet_round_trip_real(tmp_path, row_group):
    recs = [SequenceRecord(r.id, r.sequence, "d" * (k % 4)) for k, r in enumerate(subset_records("validation"))]
    path = tmp_path / "v.parquet"
    assert write_parquet(recs, path, row_group_size=row_group) == len(recs)
    assert list(read_parquet(path, batch_size=13)) == recs
    assert list(iter_records(path)) == recs


def test_parquet_from_fasta_gz(tmp_path):
    recs = subset_records()[:100]
    write_fasta(recs, tmp_path / "a.fasta.gz")
    write_parquet(read_fasta(tmp_path / "a.fasta.gz"), tmp_path / "a.parquet")
    assert tuple(read_parquet(tmp_path / "a.parquet")) == recs


def test_parquet_empty_and_bad(tmp_path):
    assert write_parquet([], tmp_path / "e.parquet") == 0
    assert list(read_parquet(tmp_path / "e.parquet")) == []
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"name": ["a"], "seq": ["M"]}), tmp_path / "wrong.parquet")
    with pytest.raises(ValueError, match=r"lacks column\(s\) \['id', 'sequence'\]"):
        list(read_parquet(tmp_path / "wrong.parquet"))
    with pytest.raises(ValueError, match="cannot tell the format"):
        iter_records(tmp_path / "x.csv")


# -- recipes/esm2/prepare_data.py -------------------------------------------

def _prepare_module():
    spec = importlib.util.spec_from_file_location("prepare_data", ROOT / "recipes" / "esm2" / "prepare_data.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _mock_example_dir(tmp_path):
    """A stand-in for the package's example-data: real subset proteins, with
    QUERY repeating two DB sequences (which the script must drop)."""
    ex = tmp_path / "pkg" / "usr" / "share" / "doc" / "mmseqs2" / "example-data"
    ex.mkdir(parents=True)
    recs = subset_records()[:400]
    write_fasta(recs[:360], ex / "DB.fasta.gz")
    write_fasta(list(recs[360:]) + [SequenceRecord("dup1", recs[0].sequence), SequenceRecord("dup2", recs[5].sequence)],
                ex / "QUERY.fasta.gz")
    return ex


def test_prepare_data_split_and_determinism(tmp_path):
    prep = _prepare_module()
    ex = _mock_example_dir(tmp_path)
    outs = []
    for k in range(2):
        out = tmp_path / f"out{k}"
        assert prep.main(["--example-dir", str(ex), "--out-dir", str(out), "--validation-fraction", "0.2",
                          "--subset-dir", str(out / "sub"), "--subset-train", "30", "--subset-validation", "5"]) == 0
        outs.append(out)
    for name in ("train.parquet", "validation.parquet", "sub/train.parquet"):
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes(), name
    train = list(read_parquet(outs[0] / "train.parquet"))
    val = list(read_parquet(outs[0] / "validation.parquet"))
    assert len(train) + len(val) == 400  # the two repeated sequences dropped
    assert 40 < len(val) < 120  # ~20 % of 400
    for r in val:
        assert int.from_bytes(hashlib.sha256(r.id.encode()).digest()[:8], "big") % 10000 < 2000
    for r in train:
        assert int.from_bytes(hashlib.sha256(r.id.encode()).digest()[:8], "big") % 10000 >= 2000
    assert [r.id for r in read_parquet(outs[0] / "sub" / "train.parquet")] == [r.id for r in train[:30]]


def test_prepare_data_without_apt(tmp_path, monkeypatch, capsys):
    prep = _prepare_module()
    monkeypatch.setattr(prep.shutil, "which", lambda name: None)
    assert prep.main(["--out-dir", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert "apt-get is not available" in err and "--deb" in err


def test_prepare_data_missing_source(tmp_path, capsys):
    prep = _prepare_module()
    (tmp_path / "example-data").mkdir()
    assert prep.main(["--example-dir", str(tmp_path / "example-data"), "--out-dir", str(tmp_path / "o")]) == 1
    assert "DB.fasta.gz is missing" in capsys.readouterr().err
