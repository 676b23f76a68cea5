"""seqfuse.data refuses bad input with an error naming the argument and the
rule (masking settings, writers' records, batching / collator integers, a
loader state, empty causal-LM samples), and its writers never leave a
user's earlier file truncated or replaced by one the readers refuse."""
import gzip
import math
import os
import stat

import numpy as np
import pytest
import torch

from seqfuse.data import (
    CausalLMDataset, EsmTokenizer, MLMDataset, NucleotideTokenizer, PackedTHDCollator, PaddedBSHDCollator,
    SequenceRecord, TokenBudgetBatchSampler, build_mlm_loader, mlm_mask, read_fasta, write_fasta,
)

SEQS = ["ACDEFGHIKLMNPQRSTVWY" * 3, "MKV", "A"]


# -- 1. masking settings -------------------------------------------------------
@pytest.mark.parametrize("kw,match", [
    (dict(mask_prob=1.5), r"MLMDataset: argument 'mask_prob' must be in \[0, 1\], got 1.5"),
    (dict(mask_prob=-0.5), r"MLMDataset: argument 'mask_prob' must be in \[0, 1\], got -0.5"),
    (dict(mask_prob=math.nan), r"MLMDataset: argument 'mask_prob' must be in \[0, 1\], got nan"),
    (dict(mask_token_frac=-1.0), r"MLMDataset: argument 'mask_token_frac' must be in \[0, 1\], got -1.0"),
    (dict(random_token_frac=math.nan), r"MLMDataset: argument 'random_token_frac' must be in \[0, 1\], got nan"),
    (dict(mask_token_frac=0.9, random_token_frac=0.5), r"MLMDataset: .*'mask_token_frac' and 'random_token_frac'.*sum <= 1"),
])
def test_mlm_dataset_checks_masking_settings(kw, match):
    with pytest.raises(ValueError, match=match):
        MLMDataset(SEQS, EsmTokenizer(), max_length=64, **kw)


def test_mlm_dataset_masking_settings_types_and_loader():
    tok = EsmTokenizer()
    with pytest.raises(TypeError, match="MLMDataset: argument 'mask_prob' must be a real number"):
        MLMDataset(SEQS, tok, mask_prob="0.15")
    with pytest.raises(ValueError, match=r"build_mlm_loader: argument 'mask_prob' must be in \[0, 1\], got 2.0"):
        build_mlm_loader(SEQS, tok, max_tokens=128, max_length=64, mask_prob=2.0)
    # numpy floats pass, stored as floats (the fingerprint compares them)
    ds = MLMDataset(SEQS, tok, max_length=64, mask_prob=np.float64(1.0), mask_token_frac=1.0, random_token_frac=0.0)
    assert type(ds.mask_prob) is float and ds.fingerprint()["mask_prob"] == 1.0
    s = ds[0]
    assert (s["input_ids"][1:-1] == tok.mask_token_id).all()


@pytest.mark.parametrize("kw", [dict(mask_token_frac=math.nan), dict(random_token_frac=math.nan)])
def test_mlm_mask_refuses_nan_fractions(kw):
    tok = EsmTokenizer()
    with pytest.raises(ValueError, match=rf"mlm_mask: argument '{next(iter(kw))}' must be in \[0, 1\], got nan"):
        mlm_mask(tok.encode("ACDE"), special_token_ids=tok.special_token_ids, mask_token_id=tok.mask_token_id,
                 random_token_ids=tok.random_token_ids, generator=torch.Generator(), **kw)


# -- 2. writers ------------------------------------------------------------------
@pytest.mark.parametrize("rec,exc,match", [
    (SequenceRecord("r1", "ACGT>x ACGT"), ValueError, r"\('r1'\): field 'sequence' must not hold whitespace, '>' or ';'"),
    (SequenceRecord("r1", "ACGTAC>G"), ValueError, r"field 'sequence' .*got '>' at position 6"),
    (SequenceRecord("r1", "ACGT;CC"), ValueError, r"field 'sequence' .*got ';' at position 4"),
    (SequenceRecord("r1", "AC\nGT"), ValueError, r"field 'sequence' must not hold whitespace"),
    (SequenceRecord("r1", ""), ValueError, r"\('r1'\): field 'sequence' must be non-empty"),
    (SequenceRecord("r1", "ACGT", "desc\n>evil"), ValueError, r"field 'description' must not hold a line break"),
    (SequenceRecord("r1", "ACGT", "desc\rmore"), ValueError, r"field 'description' must not hold a line break"),
    (SequenceRecord("r1", "ACGT", " padded "), ValueError, r"field 'description' must not begin or end with whitespace"),
    (SequenceRecord("r1", "ACGé"), ValueError, r"field 'sequence' must be ASCII .*'é'"),
    (SequenceRecord("r1", "ACG", "café"), ValueError, r"field 'description' must be ASCII"),
    (SequenceRecord("ré", "ACG"), ValueError, r"field 'id' must be ASCII"),
    (SequenceRecord("r1", None), TypeError, r"field 'sequence' must be a str, got NoneType"),
    (SequenceRecord("r1", "ACG", None), TypeError, r"field 'description' must be a str, got NoneType"),
    (("r1", "ACG"), TypeError, r"must be a SequenceRecord, got tuple"),
])
@pytest.mark.parametrize("suffix", [".fa", ".fa.gz"])
def test_write_fasta_refuses_what_read_fasta_cannot_give_back(tmp_path, rec, exc, match, suffix):
    p = tmp_path / ("a" + suffix)
    with pytest.raises(exc, match=r"^write_fasta: record 0\b.*" + match):
        write_fasta([rec], p, line_width=4)
    assert os.listdir(tmp_path) == []  # nothing written, no temporary file left


@pytest.mark.parametrize("suffix", [".fa", ".fa.gz"])
@pytest.mark.parametrize("bad", [SequenceRecord("bad id", "GG"), SequenceRecord("x", "Gé"), SequenceRecord("x", "")])
def test_write_fasta_failure_keeps_the_existing_file(tmp_path, suffix, bad):
    p = tmp_path / ("a" + suffix)
    write_fasta([SequenceRecord("keep", "ACGT", "mine")], p)
    before = p.read_bytes()
    os.chmod(p, 0o640)
    link = tmp_path / ("link" + suffix)
    link.symlink_to(p.name)
    for target in (p, link):
        with pytest.raises(ValueError, match=r"write_fasta: record 1\b"):
            write_fasta([SequenceRecord("ok", "AC"), bad], target)
        assert p.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == sorted([p.name, link.name])  # no temporary file left
    # a generator failing midway too
    def records():
        yield SequenceRecord("ok", "AC")
        raise RuntimeError("source failed")
    with pytest.raises(RuntimeError, match="source failed"):
        write_fasta(records(), p)
    assert p.read_bytes() == before and sorted(os.listdir(tmp_path)) == sorted([p.name, link.name])
    # a complete write replaces the file through the link, keeping the link and the permission bits
    assert write_fasta([SequenceRecord("new", "MKV", "d e")], link) == 1
    assert link.is_symlink() and os.readlink(link) == p.name
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o640
    assert list(read_fasta(p)) == [SequenceRecord("new", "MKV", "d e")]
    if suffix == ".fa.gz":  # the gzip header names the file given, not the temporary one
        assert p.read_bytes()[10:10 + len("link.fa") + 1] == b"link.fa\x00"
        assert gzip.decompress(p.read_bytes()) == b">new d e\nMKV\n"


def test_write_fasta_line_width_must_be_an_int(tmp_path):
    with pytest.raises(TypeError, match="write_fasta: argument 'line_width' must be an integer, got float"):
        write_fasta([SequenceRecord("r", "ACGTACGT")], tmp_path / "a.fa", line_width=2.5)
    assert write_fasta([SequenceRecord("r", "ACGTACGT")], tmp_path / "a.fa", line_width=np.int64(3)) == 1
    assert (tmp_path / "a.fa").read_text() == ">r\nACG\nTAC\nGT\n"


@pytest.mark.parametrize("bad,match", [
    (SequenceRecord("bad", None), r"write_parquet: record 1: field 'sequence' must be a str, got NoneType"),
    (SequenceRecord(None, "AC"), r"write_parquet: record 1: field 'id' must be a str, got NoneType"),
    (SequenceRecord("bad", 12), r"write_parquet: record 1: field 'sequence' must be a str, got int"),
])
def test_write_parquet_refuses_null_fields_and_keeps_the_existing_file(tmp_path, bad, match):
    pytest.importorskip("pyarrow")
    from seqfuse.data import read_parquet, write_parquet

    p = tmp_path / "a.parquet"
    write_parquet([SequenceRecord("keep", "ACGT")], p)
    before = p.read_bytes()
    with pytest.raises(TypeError, match=match):
        write_parquet([SequenceRecord("ok", "AC"), bad], p)
    assert p.read_bytes() == before and os.listdir(tmp_path) == ["a.parquet"]
    assert [r.id for r in read_parquet(p)] == ["keep"]


def test_write_rows_failure_after_a_row_group_keeps_the_existing_file(tmp_path):
    pa = pytest.importorskip("pyarrow")
    from seqfuse.data import read_parquet, write_parquet, write_rows

    p = tmp_path / "a.parquet"
    write_parquet([SequenceRecord("keep", "ACGT")], p)
    before = p.read_bytes()
    schema = pa.schema([("id", pa.string()), ("sequence", pa.string())])
    rows = [{"id": f"r{i}", "sequence": "AC"} for i in range(5)] + [{"id": "x"}]
    with pytest.raises(ValueError, match=r"write_rows: row 5 has columns \['id'\]"):
        write_rows(rows, p, schema, row_group_size=2)  # two row groups were written before the bad row
    assert p.read_bytes() == before and os.listdir(tmp_path) == ["a.parquet"]
    with pytest.raises(TypeError, match="write_rows: argument 'row_group_size' must be an integer, got float"):
        write_rows(rows[:5], p, schema, row_group_size=2.5)
    assert write_rows(rows[:5], p, schema, row_group_size=2) == 5
    assert [r.id for r in read_parquet(p)] == [f"r{i}" for i in range(5)]


# -- 3. batching, loader state, datasets, collators -----------------------------
@pytest.mark.parametrize("kw,exc,match", [
    (dict(max_sequences=2.5), TypeError, "argument 'max_sequences' must be an integer, got float"),
    (dict(max_tokens=100.9), TypeError, "argument 'max_tokens' must be an integer, got float"),
    (dict(pad_to_multiple_of=2.5), TypeError, "argument 'pad_to_multiple_of' must be an integer, got float"),
    (dict(bucket_size=4.0), TypeError, "argument 'bucket_size' must be an integer, got float"),
    (dict(rank=0.5, world_size=2), TypeError, "argument 'rank' must be an integer, got float"),
    (dict(max_sequences=True), TypeError, "argument 'max_sequences' must be an integer, got bool"),
    (dict(seed=-1), ValueError, "argument 'seed' must be >= 0, got -1"),
    (dict(lengths=[3.7, 4.2]), TypeError, "argument 'lengths' must hold integers .*float64"),
    (dict(lengths=np.array([True, True])), TypeError, "argument 'lengths' must hold integers .*bool"),
])
def test_sampler_requires_integers(kw, exc, match):
    args = dict(lengths=[1] * 6, max_tokens=100, shuffle=False)
    args.update(kw)
    lengths, max_tokens = args.pop("lengths"), args.pop("max_tokens")
    with pytest.raises(exc, match="TokenBudgetBatchSampler: " + match):
        TokenBudgetBatchSampler(lengths, max_tokens, **args)


def test_sampler_accepts_numpy_and_torch_integers():
    s = TokenBudgetBatchSampler(np.ones(6, dtype=np.int32), np.int64(100), max_sequences=torch.tensor(2), shuffle=False)
    assert list(s) == [[0, 1], [2, 3], [4, 5]]
    assert type(s.max_sequences) is int and s.fingerprint()["max_sequences"] == 2
    with pytest.raises(TypeError, match="'max_sequences' must be an integer"):
        TokenBudgetBatchSampler([1] * 6, 100, max_sequences=2.5)
    assert list(TokenBudgetBatchSampler(torch.tensor([3, 4]), 100, shuffle=False)) == [[0, 1]]


def _loader():
    return build_mlm_loader(SEQS, EsmTokenizer(), max_tokens=128, max_length=64)


@pytest.mark.parametrize("change,match", [
    (dict(global_batches_consumed=-2), r"field 'global_batches_consumed' must be an integer >= 0, got -2"),
    (dict(epoch=-3), r"field 'epoch' must be an integer >= 0, got -3"),
    (dict(epoch=1.5), r"field 'epoch' must be an integer >= 0, got 1.5"),
    (dict(sampler=None), r"field 'sampler' must be a dict"),
])
def test_load_state_dict_checks_fields(change, match):
    a = _loader()
    state = {**a.state_dict(), **change}
    with pytest.raises(ValueError, match="ResumableDataLoader.load_state_dict: argument 'state' " + match):
        a.load_state_dict(state)
    assert (a.epoch, a.batches_consumed) == (0, 0)


def test_load_state_dict_names_missing_keys():
    a = _loader()
    with pytest.raises(ValueError, match=r"argument 'state' lacks the key\(s\) \['epoch', 'global_batches_consumed', 'sampler'\]"):
        a.load_state_dict({"format": "seqfuse.data.ResumableDataLoader/1"})
    state = a.state_dict()
    del state["sampler"]
    with pytest.raises(ValueError, match=r"lacks the key\(s\) \['sampler'\]"):
        a.load_state_dict(state)
    state = a.state_dict()
    state["global_batches_consumed"] = np.int64(0)  # numpy integers still load
    a.load_state_dict(state)


def test_causal_dataset_refuses_empty_samples():
    tok = NucleotideTokenizer()
    with pytest.raises(ValueError, match=r"CausalLMDataset: sequence 1 is empty and add_special_tokens=False adds no "
                                         r"special tokens.*\(2 empty sequence\(s\)\)"):
        CausalLMDataset(["ACGT", "", ""], tok, add_special_tokens=False)
    ds = CausalLMDataset(["ACGT", ""], tok)  # framed, the empty sequence is <bos> <eos>
    assert ds[1]["input_ids"].tolist() == [tok.bos_token_id, tok.eos_token_id]


def test_framed_dataset_integer_arguments():
    tok = EsmTokenizer()
    with pytest.raises(TypeError, match="MLMDataset: argument 'max_length' must be an integer, got float"):
        MLMDataset(SEQS, tok, max_length=10.5)
    with pytest.raises(ValueError, match="CausalLMDataset: argument 'seed' must be >= 0, got -1"):
        CausalLMDataset(["ACGT"], NucleotideTokenizer(), seed=-1)


S1 = {"input_ids": torch.tensor([0, 5, 2]), "labels": torch.tensor([-100, 5, -100])}


@pytest.mark.parametrize("cls", [PackedTHDCollator, PaddedBSHDCollator])
def test_collators_refuse_non_integer_samples(cls):
    name = cls.__name__
    c = cls(1)
    with pytest.raises(TypeError, match=f"{name}: sample 0: 'input_ids' must be an integer tensor, got dtype torch.float32"):
        c([{"input_ids": torch.tensor([0.7, 5.9]), "labels": torch.tensor([1, 3])}])
    with pytest.raises(TypeError, match=f"{name}: sample 1: 'labels' must be an integer tensor, got dtype torch.float64"):
        c([S1, {"input_ids": torch.tensor([1, 3]), "labels": torch.tensor([1.2, 3.0], dtype=torch.float64)}])
    with pytest.raises(TypeError, match=f"{name}: sample 0: 'input_ids' must be a torch.Tensor, got list"):
        c([{"input_ids": [0, 5, 2], "labels": S1["labels"]}])
    with pytest.raises(ValueError, match=f"{name}: sample 0 has no 'labels'"):
        c([{"input_ids": S1["input_ids"]}])
    out = c([{"input_ids": S1["input_ids"].int(), "labels": S1["labels"].int()}])  # int32 still collates
    assert out["input_ids"].dtype == torch.long and out["input_ids"].flatten().tolist() == [0, 5, 2]


@pytest.mark.parametrize("cls", [PackedTHDCollator, PaddedBSHDCollator])
def test_collators_check_their_arguments(cls):
    name = cls.__name__
    with pytest.raises(TypeError, match=f"{name}: argument 'pad_token_id' must be an integer, got NoneType"):
        cls(None)
    with pytest.raises(TypeError, match=f"{name}: argument 'pad_to_multiple_of' must be an integer, got float"):
        cls(1, pad_to_multiple_of=2.5)
    extra = "max_tokens" if cls is PackedTHDCollator else "max_length"
    with pytest.raises(ValueError, match=f"{name}: argument '{extra}' must be >= 1, got 0"):
        cls(1, **{extra: 0})
    with pytest.raises(TypeError, match=f"{name}: argument '{extra}' must be an integer, got float"):
        cls(1, **{extra: 16.0})
    c = cls(np.int64(1), pad_to_multiple_of=np.int64(4))
    assert type(c.pad_token_id) is int and c.pad_to_multiple_of == 4
    assert c([S1])["input_ids"].numel() == 4


def test_tokenizer_counts_and_ids_must_be_integers():
    from seqfuse.data.tokenizers import EsmTokenizer
    tok = EsmTokenizer()
    with pytest.raises(TypeError, match=r"EsmTokenizer.encode: argument 'max_length' must be an integer, got float"):
        tok.encode("MKV", max_length=4.5)
    with pytest.raises(TypeError, match=r"EsmTokenizer.decode: argument 'ids' must be an integer, got float"):
        tok.decode([5.7])
    assert tok.decode(tok.encode("MKV", max_length=4)) == tok.decode(tok.encode("MK"))
