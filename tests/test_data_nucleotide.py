"""The nucleotide tokenizer: its character rule, the Hugging Face directory
that transformers' AutoTokenizer loads (round trip, ids equal to seqfuse's),
the bulk lookup-table path against the ``tokenizers`` path, and reverse
complements. Real DNA: the committed lambda phage windows of the Llama 3
recipe (recipes/llama3/data/subset)."""
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

from seqfuse.data import NUCLEOTIDE_VOCAB, NucleotideTokenizer, read_parquet, reverse_complement

SUBSET = Path(__file__).resolve().parents[1] / "recipes" / "llama3" / "data" / "subset"


@lru_cache(maxsize=1)
def real_windows() -> tuple[str, ...]:
    """Both splits' windows of the committed subset, as stored (both strands)."""
    return tuple(r.sequence for name in ("train", "validation") for r in read_parquet(SUBSET / f"{name}.parquet"))


def test_vocabulary_and_character_rule():
    tok = NucleotideTokenizer()
    assert tok.vocab == NUCLEOTIDE_VOCAB == ["<pad>", "<unk>", "<bos>", "<eos>", "<mask>", "A", "C", "G", "T", "N"]
    assert (tok.pad_token_id, tok.unk_token_id, tok.bos_token_id, tok.eos_token_id, tok.mask_token_id) == (0, 1, 2, 3, 4)
    assert tok.encode("ACGTN").tolist() == [2, 5, 6, 7, 8, 9, 3]
    assert tok.encode("acgtn", add_special_tokens=False).tolist() == [5, 6, 7, 8, 9]  # soft-masked
    assert tok.encode("RYKMswbdhv", add_special_tokens=False).tolist() == [9] * 10  # IUPAC -> N
    # any other character -> N, one for one (lengths kept); whitespace skipped
    assert tok.encode("AU-*é1G", add_special_tokens=False).tolist() == [5, 9, 9, 9, 9, 9, 7]
    assert tok.encode("AC\nG T\t", add_special_tokens=False).tolist() == [5, 6, 7, 8]
    assert tok.encode("A<mask>C", add_special_tokens=False).tolist() == [5, 4, 6]
    assert tok.encode("ACGT" * 10, max_length=6).tolist() == [2, 5, 6, 7, 8, 3]
    assert tok.decode(tok.encode("acgRt")) == "<bos>ACGNT<eos>"
    assert tok.decode(tok.encode("acgRt"), skip_special_tokens=True) == "ACGNT"
    assert sorted(tok.random_token_ids.tolist()) == [5, 6, 7, 8]
    assert tok.special_token_ids == [0, 1, 2, 3, 4]


def test_strict_refuses_with_the_character_and_position():
    for tok in (NucleotideTokenizer("error"), NucleotideTokenizer(strict=True)):
        with pytest.raises(ValueError, match="character 'U' at position 2"):
            tok.encode("ACUG")
        with pytest.raises(ValueError, match="character 'U' at position 2"):
            tok.encode_bytes(b"ACUG")
        assert tok.encode("acgtRY", add_special_tokens=False).tolist() == [5, 6, 7, 8, 9, 9]
    bare = NucleotideTokenizer(strict=True, uppercase=False, iupac_to_n=False)
    with pytest.raises(ValueError, match="character 'a'"):
        bare.encode("a")
    with pytest.raises(ValueError, match="character 'R'"):
        bare.encode("R")
    with pytest.raises(ValueError, match="argument 'unknown' must be 'N' or 'error'"):
        NucleotideTokenizer("unk")
    with pytest.raises(ValueError, match="only\nunknown='N'|only unknown='N'"):
        NucleotideTokenizer(strict=True).to_hf()


def test_encode_bytes_checks_its_argument():
    tok = NucleotideTokenizer()
    assert tok.encode_bytes(np.frombuffer(b"ACGT", np.uint8), dtype=np.uint8).dtype == np.uint8
    assert tok.encode_bytes(bytearray(b"a\xc3\xa9")).tolist() == [5, 9, 9]  # non-ASCII bytes -> N each
    with pytest.raises(TypeError, match="argument 'data' must be bytes"):
        tok.encode_bytes("ACGT")
    with pytest.raises(ValueError, match="argument 'data' must be 1-D uint8"):
        tok.encode_bytes(np.zeros(4, dtype=np.int64))


def test_hf_directory_loads_and_round_trips(tmp_path):
    transformers = pytest.importorskip("transformers")
    tok = NucleotideTokenizer()
    tok.save_pretrained(tmp_path, model_max_length=8192)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert hf.vocab_size == len(hf) == 10
    assert (hf.pad_token_id, hf.unk_token_id, hf.bos_token_id, hf.eos_token_id, hf.mask_token_id) == (0, 1, 2, 3, 4)
    assert hf.model_max_length == 8192
    for text in ("ACGT", "acgtnRYKM", "AU-*é1G", "AC\nG T", "A<mask>C<eos>", "NNNN"):
        assert hf(text)["input_ids"] == tok.encode(text).tolist(), text
        assert hf(text, add_special_tokens=False)["input_ids"] == tok.encode(text, add_special_tokens=False).tolist()
    ids = hf("acgTN")["input_ids"]
    assert hf.decode(ids) == "<bos>ACGTN<eos>"
    assert hf.decode(ids, skip_special_tokens=True) == "ACGTN"
    batch = hf(["ACG", "A"], padding=True)
    assert batch["input_ids"] == [[2, 5, 6, 7, 3], [2, 5, 3, 0, 0]]
    assert batch["attention_mask"] == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]


def test_real_dna_bulk_path_equals_tokenizers_path(tmp_path):
    """Every committed window through the lookup table (whole-genome bulk
    path) and through the saved Hugging Face tokenizer: same ids; decoding
    gives the window back."""
    transformers = pytest.importorskip("transformers")
    tok = NucleotideTokenizer()
    hf = transformers.AutoTokenizer.from_pretrained(tok.save_pretrained(tmp_path))
    windows = real_windows()
    assert len(windows) >= 20
    got = hf(list(windows), add_special_tokens=False)["input_ids"]
    for w, ids in zip(windows, got):
        bulk = tok.encode_bytes(w.encode("ascii"), dtype=np.uint8)
        assert bulk.tolist() == ids
        assert hf.decode(ids) == w.upper() == tok.decode(bulk.tolist())
        # soft-masked (lower case) input: same ids
        assert tok.encode_bytes(w.lower().encode("ascii")).tolist() == ids
    # one buffer for all windows (the genome-sized case): the concatenation
    whole = "".join(windows)
    assert tok.encode_bytes(whole.encode("ascii")).tolist() == [i for ids in got for i in ids]
    assert tok.encode_residues(whole).tolist() == [i for ids in got for i in ids]


def test_reverse_complement_on_real_windows():
    w = real_windows()[0]
    rc = reverse_complement(w)
    assert len(rc) == len(w) and reverse_complement(rc) == w
    assert rc.count("A") == w.count("T") and rc.count("G") == w.count("C")
    assert reverse_complement("AACGTRYKMBVDHSWNacg") == "cgtNWSDHBVKMRYACGTT"
    with pytest.raises(ValueError, match="not IUPAC nucleotide codes"):
        reverse_complement("ACGU")
