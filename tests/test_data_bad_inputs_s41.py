"""seqfuse.data, audited for bad input: every case here was a
crash with a foreign error (AttributeError, KeyError, OverflowError, a
numpy IndexError), or a silently wrong answer (a flag given as the string
"False" read as True, a float id or seed truncated, a negative id read from
the end of a table, one protein string read as many one-residue sequences),
and is now an exception naming the argument and the rule.  The few
documented transformations the audit met (cropping to max_length, unknown
characters -> N for DNA, runs -> one <unk> for unknown='unk') are tested in
test_data_tokenizers / test_data_nucleotide / test_data_masking already.

Sequences: the first residues of real UniProt proteins from the ESM-2
recipe's subset (CC BY 4.0, UniProt) and of the lambda phage genome."""
import gzip
import os

import numpy as np
import pytest
import torch

from seqfuse.data import (
    CausalLMDataset, EsmTokenizer, MLMDataset, NucleotideTokenizer, PackedTHDCollator, PaddedBSHDCollator,
    ResumableDataLoader, SequenceRecord, TokenBudgetBatchSampler, TokenizedSequences, batch_to_device,
    build_causal_lm_loader, build_mlm_loader, genome_windows, mlm_mask, read_fasta, sample_generator, sample_seed,
    window_spans,
)
from seqfuse.data.tokenizers import CharTokenizer

# tr|Q95PM3 (Schistocerca gregaria), tr|S1MFM7 (Escherichia), tr|B1YAX1 (Pyrobaculum neutrophilum)
PROTEINS = [
    "MKVTLAIAAAVLFVAMATTVDAASECTPGDTKKEDCNTCRCTPTGVWVCTRKGCVTKREVNCTPGTTFKN",
    "MAAKIIDGKTIAQQVRSEVAQKVQARVAAGLRAPGLAVVLVGSNPASQIYVASKRKACEEVGFVSRSYDL",
    "MTSGGRGPKALITGTPGVGKTTQCRKLAAWLSTVCVSVGELLAGTPYVRYIPELDTHEIVDVEAATRHVH",
]
# lambda phage (NC_001416.1), bases 0-80
LAMBDA = "GGGCGGCGACCTCGCGGGTTTTCGCTATTTATGAAAATTTTCCGGTTTAAGGCGTTTCCGTTCTTCTTCGTCATAACTTA"

ESM = EsmTokenizer()
DNA = NucleotideTokenizer()
SPECIALS = ["<cls>", "<pad>", "<eos>", "<unk>", "<mask>"]


# -- 1. flags given as strings ("False" is truthy) -----------------------------
@pytest.mark.parametrize("make,name", [
    (lambda v: EsmTokenizer(parse_special_tokens=v), "EsmTokenizer: argument 'parse_special_tokens'"),
    (lambda v: NucleotideTokenizer(strict=v), "NucleotideTokenizer: argument 'strict'"),
    (lambda v: NucleotideTokenizer(uppercase=v), "NucleotideTokenizer: argument 'uppercase'"),
    (lambda v: NucleotideTokenizer(iupac_to_n=v), "NucleotideTokenizer: argument 'iupac_to_n'"),
    (lambda v: ESM.encode(PROTEINS[0], add_special_tokens=v), "EsmTokenizer.encode: argument 'add_special_tokens'"),
    (lambda v: ESM.decode([0, 20, 2], skip_special_tokens=v), "EsmTokenizer.decode: argument 'skip_special_tokens'"),
    (lambda v: TokenBudgetBatchSampler([70] * 4, 256, shuffle=v), "TokenBudgetBatchSampler: argument 'shuffle'"),
    (lambda v: TokenBudgetBatchSampler([70] * 4, 256, padded=v), "TokenBudgetBatchSampler: argument 'padded'"),
    (lambda v: TokenBudgetBatchSampler([70] * 4, 256, balance_ranks=v),
     "TokenBudgetBatchSampler: argument 'balance_ranks'"),
    (lambda v: CausalLMDataset([LAMBDA], DNA, add_special_tokens=v), "CausalLMDataset: argument 'add_special_tokens'"),
    (lambda v: build_mlm_loader(PROTEINS, ESM, max_tokens=256, max_length=64, evaluation=v),
     "build_mlm_loader: argument 'evaluation'"),
    (lambda v: build_mlm_loader(PROTEINS, ESM, max_tokens=256, max_length=64, packed=v),
     "build_mlm_loader: argument 'packed'"),
    (lambda v: build_causal_lm_loader([LAMBDA], DNA, max_tokens=256, max_length=64, shuffle=v),
     "build_causal_lm_loader: argument 'shuffle'"),
])
def test_flags_must_be_bools(make, name):
    """"False" from a command line or a hand-written config was read as True
    (evaluation="False" gave a fixed-epoch, unshuffled validation loader;
    strict="False" a strict tokenizer)."""
    with pytest.raises(TypeError, match=f"^{name} must be a bool .*got str \\('False'\\)"):
        make("False")
    make(np.bool_(False))  # numpy's bools are bools
    make(True)


# -- 2. CharTokenizer's vocabulary and named tokens -----------------------------
def _tok(vocab=None, **kw):
    args = dict(bos_token="<cls>", random_tokens=list("ACGU"))
    args.update(kw)
    return CharTokenizer(SPECIALS + list("ACGU") if vocab is None else vocab, **args)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(vocab=["<cls>", "<eos>", "<unk>", "<mask>", "A", "C"], random_tokens=["A"]), ValueError,
     r"argument 'pad_token' \('<pad>'\) is not in the vocabulary"),
    (dict(pad_token="A"), ValueError,
     r"argument 'pad_token' must be a special token \(<...>\) of the vocabulary, got 'A', a residue"),
    (dict(mask_token="C"), ValueError, r"argument 'mask_token' must be a special token"),
    (dict(random_tokens=["A", "T"]), ValueError, r"argument 'random_tokens': 'T' is not in the vocabulary"),
    (dict(random_tokens=["A", "<pad>"]), ValueError, r"argument 'random_tokens': '<pad>' is a special token"),
    (dict(vocab=SPECIALS + list("ACGU") + ["AU"]), ValueError,
     r"argument 'vocab': token 'AU' has several characters but is not a special token written <...>"),
    (dict(vocab=SPECIALS + list("ACGU") + ["\u00e9"]), ValueError, r"argument 'vocab': token '\u00e9' is not"),
    (dict(vocab=SPECIALS + list("ACGU") + [" "]), ValueError, r"argument 'vocab': token ' ' is not"),
    (dict(vocab="ACGU"), TypeError, r"argument 'vocab' must be a sequence of tokens, got one str"),
    (dict(extra_char_map={"ac": "A"}), ValueError, r"argument 'extra_char_map': key 'ac' must be one ASCII"),
    (dict(extra_char_map={"t": "T"}), ValueError, r"argument 'extra_char_map': 't' -> 'T', which is not a residue"),
])
def test_char_tokenizer_checks_its_vocabulary(kw, exc, match):
    """A token missing from the vocabulary was a bare KeyError; a padding or
    mask token that is a residue gave real tokens' ids to padding; a
    multi-character token without <...> was recognised only in text holding
    '<'; a non-ASCII one-character token was in the vocabulary but never
    encoded."""
    with pytest.raises(exc, match="^CharTokenizer: " + match):
        _tok(**kw)
    rna = _tok(extra_char_map={"a": "A", "c": "C"})  # a valid custom vocabulary still builds
    assert rna.encode("ACGUac").tolist() == [0, 5, 6, 7, 8, 5, 6, 2]


def test_tokenizer_tensor_helpers_check_their_ids():
    ids = ESM.encode(PROTEINS[0][:6])
    with pytest.raises(TypeError, match=r"^EsmTokenizer.special_tokens_mask: argument 'ids' must be a torch.Tensor"):
        ESM.special_tokens_mask(ids.tolist())
    with pytest.raises(TypeError, match=r"^EsmTokenizer.add_special_tokens: argument 'residue_ids' must be a "
                                        r"torch.Tensor .*got list"):
        ESM.add_special_tokens([20, 15])
    with pytest.raises(TypeError, match=r"^EsmTokenizer.add_special_tokens: argument 'residue_ids' must hold "
                                        r"integers, got dtype torch.float32"):
        ESM.add_special_tokens(torch.tensor([20.7, 15.2]))  # was truncated to [20, 15] silently
    assert ESM.add_special_tokens(ids[1:-1].int()).tolist() == ids.tolist()
    assert ESM.special_tokens_mask(ids).tolist() == [True] + [False] * 6 + [True]


def test_to_hf_model_max_length_must_be_an_integer():
    pytest.importorskip("tokenizers")
    pytest.importorskip("transformers")
    with pytest.raises(TypeError, match="^NucleotideTokenizer.to_hf: argument 'model_max_length' must be an integer, "
                                        "got float"):
        DNA.to_hf(2.5)  # was stored as model_max_length=2.5
    with pytest.raises(TypeError, match="argument 'model_max_length' must be an integer, got str"):
        DNA.to_hf("8192")  # was "'<' not supported between instances of 'str' and 'int'"
    assert DNA.to_hf(np.int64(8192)).model_max_length == 8192


def test_save_into_a_file_path_is_refused(tmp_path):
    f = tmp_path / "model"
    f.write_text("mine")
    with pytest.raises(NotADirectoryError, match=r"^EsmTokenizer.save_vocabulary: argument 'directory' .*model' is "
                                                 r"a file, not a directory"):
        ESM.save_vocabulary(f)
    pytest.importorskip("transformers")
    with pytest.raises(NotADirectoryError, match=r"^NucleotideTokenizer.save_pretrained: argument 'directory' "
                                                 r".*model' is a file"):
        DNA.save_pretrained(f)
    assert f.read_text() == "mine"


# -- 3. seeds and masking --------------------------------------------------------
def test_sample_seed_reads_integers_only():
    """A numpy seed overflowed inside splitmix64 (OverflowError); a float
    seed was a foreign TypeError; True was seed 1; 2**64 and 0 were the same
    seed."""
    assert sample_seed(np.int64(3), np.int32(1), torch.tensor(7)) == sample_seed(3, 1, 7)
    with pytest.raises(TypeError, match="^sample_seed: argument 'seed' must be an integer, got float"):
        sample_seed(1.5, 0, 0)
    with pytest.raises(TypeError, match="^sample_seed: argument 'seed' must be an integer, got bool"):
        sample_seed(True, 0, 0)
    with pytest.raises(ValueError, match=r"^sample_seed: argument 'seed' must be <= 2\*\*64 - 1, got 18446744073709551616"):
        sample_seed(2**64, 0, 0)
    with pytest.raises(TypeError, match="^sample_generator: argument 'index' must be an integer, got str"):
        sample_generator(0, 0, "3")
    with pytest.raises(ValueError, match="^MLMDataset: argument 'seed' must be <= 2\\*\\*64 - 1"):
        MLMDataset(PROTEINS, ESM, seed=2**64)
    with pytest.raises(ValueError, match="^TokenBudgetBatchSampler: argument 'seed' must be <= 2\\*\\*64 - 1"):
        TokenBudgetBatchSampler([70] * 4, 256, seed=2**64 + 5)


def _mask_kw(**kw):
    out = dict(special_token_ids=ESM.special_token_ids, mask_token_id=ESM.mask_token_id,
               random_token_ids=ESM.random_token_ids, generator=sample_generator(0, 0, 0))
    out.update(kw)
    return out


@pytest.mark.parametrize("ids,kw,exc,match", [
    (PROTEINS[0], {}, TypeError, r"argument 'input_ids' must be a torch.Tensor of token ids, got str"),
    ([0, 20, 2], {}, TypeError, r"argument 'input_ids' must be a torch.Tensor of token ids, got list"),
    (torch.tensor([0.0, 20.7, 2.0]), {}, TypeError, r"argument 'input_ids' must hold integers, got dtype torch.float32"),
    (torch.tensor([True, False]), {}, TypeError, r"argument 'input_ids' must hold integers, got dtype torch.bool"),
    (torch.tensor([0, 20, -100, 2]), {}, ValueError, r"argument 'input_ids' holds -100 at position 2; token ids are >= 0"),
    (None, dict(generator=42), TypeError, r"argument 'generator' must be a torch.Generator .*got int"),
    (None, dict(generator=None), TypeError, r"argument 'generator' must be a torch.Generator .*got NoneType"),
    (None, dict(mask_token_id=32.9), TypeError, r"argument 'mask_token_id' must be an integer, got float"),
    (None, dict(mask_token_id=True), TypeError, r"argument 'mask_token_id' must be an integer, got bool"),
    (None, dict(special_token_ids=[0.0, 1.0]), TypeError, r"argument 'special_token_ids' must be an integer"),
    (None, dict(special_token_ids=[0, -1]), ValueError, r"argument 'special_token_ids' must be >= 0, got -1"),
    (None, dict(random_token_ids=torch.tensor([5.5])), TypeError,
     r"argument 'random_token_ids' must hold integers, got dtype torch.float32"),
    (None, dict(random_token_ids=torch.tensor([5, -3])), ValueError, r"argument 'random_token_ids' holds -3"),
])
def test_mlm_mask_checks_its_arguments(ids, kw, exc, match):
    """Before: AttributeError for a list, a float id / mask id / random id
    truncated silently (32.9 -> 32, True -> id 1), a negative id an
    IndexError of numpy's, a negative special id marking the last id of
    the table special, an int generator torch's overload listing, and
    generator=None the global RNG (masks no seed reproduces)."""
    ids = ESM.encode(PROTEINS[1]) if ids is None else ids
    with pytest.raises(exc, match="^mlm_mask: " + match):
        mlm_mask(ids, **_mask_kw(**kw))


def test_mlm_mask_takes_integer_sequences_for_ids_lists():
    ids = ESM.encode(PROTEINS[1])
    a = mlm_mask(ids, **_mask_kw(mask_prob=0.5))
    b = mlm_mask(ids.int(), **_mask_kw(mask_prob=0.5, random_token_ids=ESM.random_token_ids.tolist(),
                                       special_token_ids=torch.tensor(ESM.special_token_ids),
                                       mask_token_id=np.int64(ESM.mask_token_id)))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_mlm_dataset_needs_random_tokens_for_random_replacement():
    tok = _tok(random_tokens=[])
    with pytest.raises(ValueError, match=r"^MLMDataset: the tokenizer has no random_token_ids, so "
                                         r"'random_token_frac' must be 0 \(got 0.1\)"):
        MLMDataset(["ACGUACGU"], tok, mask_prob=1.0)
    s = MLMDataset(["ACGUACGU"], tok, mask_prob=1.0, mask_token_frac=1.0, random_token_frac=0.0)[0]
    assert (s["input_ids"][1:-1] == tok.mask_token_id).all()


# -- 4. collators ------------------------------------------------------------------
def _sample(seq, index=None):
    ids = ESM.encode(seq)
    s = {"input_ids": ids, "labels": ids.clone()}
    if index is not None:
        s["index"] = index
    return s


@pytest.mark.parametrize("cls", [PackedTHDCollator, PaddedBSHDCollator])
def test_collators_check_the_batch(cls):
    name = cls.__name__
    c = cls(ESM.pad_token_id)
    with pytest.raises(TypeError, match=f"^{name}: argument 'samples' must be a list of sample dicts, got dict"):
        c(_sample(PROTEINS[0]))  # one sample, not a batch of one (was "string indices must be integers")
    with pytest.raises(TypeError, match=f"^{name}: sample 1 must be a dict with 'input_ids' and 'labels', got Tensor"):
        c([_sample(PROTEINS[0]), ESM.encode(PROTEINS[1])])
    bad = _sample(PROTEINS[1])
    bad["input_ids"] = torch.where(bad["input_ids"] == ESM.cls_token_id, -100, bad["input_ids"])
    with pytest.raises(ValueError, match=f"^{name}: sample 1: 'input_ids' holds -100 at position 0; token ids must "
                                         f"be >= 0"):
        c([_sample(PROTEINS[0]), bad])  # labels given as ids: was collated silently
    with pytest.raises(TypeError, match=f"^{name}: sample 0: 'index' must be an integer, got float \\(3.7\\)"):
        c([_sample(PROTEINS[0], 3.7)])  # was truncated to 3
    out = c((_sample(PROTEINS[0], np.int64(3)),))  # a tuple of one, numpy index: fine
    assert out["sample_indices"].tolist() == [3]


def test_batch_to_device_needs_a_dict():
    with pytest.raises(TypeError, match="^batch_to_device: argument 'batch' must be a dict .*got list"):
        batch_to_device([torch.zeros(2)], "cpu")


# -- 5. sampler epochs, stored sequences, dataset keys ------------------------------
def test_sampler_set_epoch_reads_integers():
    s = TokenBudgetBatchSampler([70] * 6, 150, seed=3)
    with pytest.raises(TypeError, match="^TokenBudgetBatchSampler.set_epoch: argument 'epoch' must be an integer, "
                                        "got float"):
        s.set_epoch(1.5)  # was epoch 1
    with pytest.raises(ValueError, match="^TokenBudgetBatchSampler.set_epoch: argument 'epoch' must be >= 0, got -1"):
        s.set_epoch(-1)  # was refused only when iterated, by sample_seed
    s.set_epoch(np.int64(1))
    assert s.epoch == 1 and type(s.epoch) is int


@pytest.mark.parametrize("seqs,exc,match", [
    (PROTEINS[0], TypeError, r"argument 'sequences' must be a collection of sequences \(str\), got one str of 70 "
                             r"characters"),
    (PROTEINS[0].encode(), TypeError, r"argument 'sequences' must be a collection of sequences \(str\), got bytes"),
    ({"Q95PM3": PROTEINS[0]}, TypeError, r"argument 'sequences' is a dict: pass its values"),
    ([PROTEINS[0], SequenceRecord("S1MFM7", PROTEINS[1])], TypeError,
     r"sequence 1: EsmTokenizer.encode: expected a str, got SequenceRecord"),
])
def test_tokenized_sequences_refuses_what_is_not_a_list_of_strings(seqs, exc, match):
    """One protein string was read as 70 one-residue sequences; a dict as
    its keys (ids tokenized as residues)."""
    for make in (lambda: TokenizedSequences(seqs, ESM), lambda: MLMDataset(seqs, ESM, max_length=64)):
        with pytest.raises(exc, match="^TokenizedSequences: " + match):
            make()


def test_tokenized_sequences_tokenizer_iterables_and_indices():
    with pytest.raises(TypeError, match="^TokenizedSequences: argument 'tokenizer' must be a seqfuse.data "
                                        "CharTokenizer .*got object"):
        TokenizedSequences(PROTEINS, object())
    with pytest.raises(TypeError, match="^MLMDataset: argument 'tokenizer' must be a seqfuse.data CharTokenizer"):
        MLMDataset(TokenizedSequences(PROTEINS, ESM), object())
    store = TokenizedSequences((s for s in PROTEINS), ESM)  # a generator: read once, whole
    assert len(store) == 3 and store.residues(2).tolist() == ESM.encode_residues(PROTEINS[2]).tolist()
    with pytest.raises(IndexError, match=r"^TokenizedSequences.residues: index -1 out of range \[0, 3\)"):
        store.residues(-1)  # was an empty tensor
    with pytest.raises(IndexError, match=r"^TokenizedSequences.residues: index 3 out of range \[0, 3\)"):
        store.residues(3)


@pytest.mark.parametrize("key,exc,match", [
    (1.7, TypeError, r"argument 'index' must be an integer, got float \(1.7\)"),
    (True, TypeError, r"argument 'index' must be an integer, got bool"),
    ((0.5, 0), TypeError, r"argument 'epoch' must be an integer, got float \(0.5\)"),
    ((-1, 0), ValueError, r"argument 'epoch' must be >= 0, got -1"),
    ((0, 0, 1), ValueError, r"key must be an index or an \(epoch, index\) pair, got \(0, 0, 1\)"),
])
def test_dataset_keys_are_integers(key, exc, match):
    """A float index / epoch was truncated (ds[1.7] gave sample 1, epoch 0.5
    epoch 0's masks); a 3-tuple was 'too many values to unpack'."""
    for ds in (MLMDataset(PROTEINS, ESM, max_length=32), CausalLMDataset([LAMBDA] * 3, DNA, max_length=32)):
        with pytest.raises(exc, match=f"^{type(ds).__name__}: " + match):
            ds[key]
    ds = MLMDataset(PROTEINS, ESM, max_length=32)
    assert torch.equal(ds[(np.int64(1), np.int64(2))]["input_ids"], ds[(1, 2)]["input_ids"])


# -- 6. loaders ---------------------------------------------------------------------
def test_resumable_loader_checks_its_arguments():
    ds = MLMDataset(PROTEINS, ESM, max_length=64)
    s = TokenBudgetBatchSampler(ds.lengths, 256)
    c = PackedTHDCollator(ESM.pad_token_id)
    for kw, exc, match in [
        (dict(num_workers=1.5), TypeError, "argument 'num_workers' must be an integer, got float"),
        (dict(num_workers=-1), ValueError, "argument 'num_workers' must be >= 0, got -1"),
        (dict(fixed_epoch=0.5), TypeError, "argument 'fixed_epoch' must be an integer, got float"),
        (dict(fixed_epoch=-1), ValueError, "argument 'fixed_epoch' must be >= 0, got -1"),
        (dict(pin_memory="no"), TypeError, "argument 'pin_memory' must be a bool"),
    ]:
        with pytest.raises(exc, match="^ResumableDataLoader: " + match):
            ResumableDataLoader(ds, s, c, **kw)
    with pytest.raises(TypeError, match="^ResumableDataLoader: argument 'collate_fn' must be callable, got str"):
        ResumableDataLoader(ds, s, "packed")


@pytest.mark.parametrize("build,seqs,tok", [(build_mlm_loader, PROTEINS, ESM), (build_causal_lm_loader, [LAMBDA], DNA)])
@pytest.mark.parametrize("kw,exc,match", [
    (dict(max_length="64"), TypeError, r"argument 'max_length' must be an integer, got str \('64'\)"),
    (dict(max_tokens="256"), TypeError, r"argument 'max_tokens' must be an integer, got str \('256'\)"),
    (dict(max_length=None), TypeError, r"argument 'max_length' must be an integer, got NoneType"),
    (dict(pad_to_multiple_of=2.5), TypeError, r"argument 'pad_to_multiple_of' must be an integer, got float"),
    (dict(max_tokens=0), ValueError, r"argument 'max_tokens' must be >= 1, got 0"),
])
def test_loader_builders_read_their_sizes_first(build, seqs, tok, kw, exc, match):
    """A string size was 'can only concatenate str' / "'>' not supported";
    None 'unsupported operand type(s)'."""
    args = dict(max_tokens=256, max_length=64)
    args.update(kw)
    with pytest.raises(exc, match=f"^{build.__name__}: " + match):
        build(seqs, tok, **args)


# -- 7. genome windows, FASTA reading, Parquet rows -------------------------------------
def test_genome_windows_arguments():
    rec = SequenceRecord("NC_001416.1", LAMBDA)
    # numpy integers (a window size read from an array or a config) were refused as "not an int"
    assert window_spans(np.int64(80), np.int64(32), 32) == [(0, 32), (32, 64), (48, 80)]
    assert len(list(genome_windows("lambda", rec, window=np.int64(40), stride=np.int32(40)))) == 4
    with pytest.raises(TypeError, match="^genome_windows: argument 'genome' must be a str, got int"):
        list(genome_windows(5, rec, window=40, stride=40))  # was "argument of type 'int' is not iterable"
    with pytest.raises(TypeError, match="^genome_windows: argument 'offset' must be an integer, got float"):
        list(genome_windows("lambda", rec, window=40, stride=40, offset=1.5))  # ids were "...:1.5-41.5+"
    with pytest.raises(TypeError, match="^genome_windows: argument 'record' must be a SequenceRecord, got tuple"):
        list(genome_windows("lambda", ("NC_001416.1", LAMBDA), window=40, stride=40))
    bad = SequenceRecord("NC_001416.1", LAMBDA[:40] + "ACGU" + LAMBDA[44:])
    with pytest.raises(ValueError, match=r"^genome_windows: window lambda/NC_001416.1:40-80- cannot be reverse "
                                         r"complemented: .*\['U'\]"):
        list(genome_windows("lambda", bad, window=40, stride=40))


@pytest.mark.parametrize("gz", [False, True])
def test_read_fasta_names_the_line_of_a_non_ascii_byte(tmp_path, gz):
    """Was a bare UnicodeDecodeError with a byte offset in a decoded chunk,
    no file and no line."""
    data = (">sp|Q95PM3 Schistocerca gregaria\n" + PROTEINS[0] + "\n>sp|S1MFM7 caf\u00e9\n" + PROTEINS[1] + "\n").encode()
    p = tmp_path / ("a.fa.gz" if gz else "a.fa")
    p.write_bytes(gzip.compress(data) if gz else data)
    with pytest.raises(ValueError, match=r"^read_fasta: .*a.fa(.gz)?:3: byte 0xc3 at column 15 is not ASCII"):
        list(read_fasta(p))
    crlf = tmp_path / "b.fa"  # Windows and old Mac line ends still read
    crlf.write_bytes(b">r1\r\nMKV\r\nLA\r>r2\rMA\r")
    assert [(r.id, r.sequence) for r in read_fasta(crlf)] == [("r1", "MKVLA"), ("r2", "MA")]


def test_write_rows_checks_rows_and_keeps_the_existing_file(tmp_path):
    pa = pytest.importorskip("pyarrow")
    from seqfuse.data import read_parquet, write_parquet, write_rows

    p = tmp_path / "w.parquet"
    write_parquet([SequenceRecord("keep", PROTEINS[0])], p)
    before = p.read_bytes()
    schema = pa.schema([("id", pa.string()), ("sequence", pa.string()), ("start", pa.int64())])
    good = [{"id": f"w{i}", "sequence": LAMBDA[i:i + 8], "start": i} for i in range(5)]
    for rows, exc, match in [
        (good + [("w5", "ACGT", 5)], TypeError, r"^write_rows: row 5 must be a dict \(one key per column\), got tuple"),
        (good + [{"id": "w5", "sequence": "ACGT", "start": 5.5}], TypeError,
         r"^write_rows: row 5: column 'start' must hold integers \(int64\), got float \(5.5\)"),  # pyarrow: 5
        (good + [{"id": "w5", "sequence": 12, "start": 5}], TypeError,
         r"^write_rows: row 5: column 'sequence' \(string\) cannot hold 12 \(int\)"),  # pyarrow: no row, no column
        (good + [{"id": "w5", "sequence": "ACGT", "start": 2**70}], ValueError,
         r"^write_rows: row 5: column 'start' \(int64\) cannot hold 1180591620717411303424 \(int\)"),  # OverflowError
    ]:
        with pytest.raises(exc, match=match):
            write_rows(rows, p, schema, row_group_size=2)
        assert p.read_bytes() == before and os.listdir(tmp_path) == ["w.parquet"]
    assert write_rows(good + [{"id": "w5", "sequence": "ACGT", "start": np.int64(5)}], p, schema) == 6
    assert [r.id for r in read_parquet(p)] == [f"w{i}" for i in range(6)]


def test_writers_want_an_iterable_of_records(tmp_path):
    """One record (not a list of one) was "'SequenceRecord' object is not
    iterable", naming neither the writer nor the argument."""
    from seqfuse.data import write_fasta

    rec = SequenceRecord("Q95PM3", PROTEINS[0])
    with pytest.raises(TypeError, match=r"^write_fasta: argument 'records' must be an iterable of SequenceRecord, got "
                                        r"one SequenceRecord; pass \[record\]"):
        write_fasta(rec, tmp_path / "a.fa")
    assert write_fasta([rec], tmp_path / "a.fa") == 1
    pytest.importorskip("pyarrow")
    from seqfuse.data import write_parquet

    with pytest.raises(TypeError, match=r"^write_parquet: argument 'records' must be an iterable of SequenceRecord"):
        write_parquet(rec, tmp_path / "a.parquet")
    assert sorted(os.listdir(tmp_path)) == ["a.fa"]


def test_read_parquet_batch_size_and_null_rows(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from seqfuse.data import read_parquet

    p = tmp_path / "a.parquet"
    pq.write_table(pa.table({"id": ["a", "b", None], "sequence": [PROTEINS[0], PROTEINS[1], PROTEINS[2]]}), p)
    with pytest.raises(TypeError, match="^read_parquet: argument 'batch_size' must be an integer, got float"):
        list(read_parquet(p, batch_size=2.5))
    with pytest.raises(ValueError, match=r"^read_parquet: .*a.parquet: row 2 has a null id or sequence"):
        list(read_parquet(p, batch_size=2))
    q = tmp_path / "b.parquet"
    pq.write_table(pa.table({"id": ["a"], "sequence": [7]}), q)
    with pytest.raises(ValueError, match=r"^read_parquet: .*b.parquet: column 'sequence' must hold strings, got int64"):
        list(read_parquet(q))


# -- 8. what already held, pinned -----------------------------------------------------
def test_rewriting_a_fasta_file_from_itself_keeps_every_record(tmp_path):
    """write_fasta(read_fasta(p), p): the records stream from p into a
    temporary file that replaces p only at the end, so nothing is lost."""
    from seqfuse.data import write_fasta

    p = tmp_path / "a.fa"
    recs = [SequenceRecord(f"r{i}", s, "UniProt") for i, s in enumerate(PROTEINS)]
    write_fasta(recs, p)
    assert write_fasta(read_fasta(p), p, line_width=7) == 3
    assert list(read_fasta(p)) == recs


def test_same_seed_same_samples_and_batches():
    a = build_mlm_loader(PROTEINS * 4, ESM, max_tokens=128, max_length=40, seed=5, pad_to_multiple_of=8)
    b = build_mlm_loader(PROTEINS * 4, EsmTokenizer(), max_tokens=128, max_length=40, seed=np.int64(5),
                         pad_to_multiple_of=8)
    c = build_mlm_loader(PROTEINS * 4, ESM, max_tokens=128, max_length=40, seed=6, pad_to_multiple_of=8)
    ba, bb, bc = list(a), list(b), list(c)
    assert len(ba) == len(bb) and all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(ba, bb))
    assert not all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(ba, bc))
