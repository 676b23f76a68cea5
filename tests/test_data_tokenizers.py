"""EsmTokenizer against transformers.EsmTokenizer (built from a vocab.txt
written here, nothing downloaded) on the real UniProt subset, the unknown-
character policy (the nucleotide tokenizer: test_data_nucleotide.py)."""
from functools import lru_cache
from pathlib import Path

import pytest
import torch

from seqfuse.data import ESM2_VOCAB, EsmTokenizer, read_parquet

SUBSET = Path(__file__).resolve().parents[1] / "recipes" / "esm2" / "data" / "subset"

# ESM-2's vocabulary as the facebook/esm2_* checkpoints ship it, written out
# independently of seqfuse's own table.
HF_VOCAB_TXT = """<cls>
<pad>
<eos>
<unk>
L
A
G
V
S
E
R
T
I
D
P
K
Q
N
F
Y
M
H
W
C
X
B
U
Z
O
.
-
<null_1>
<mask>
"""


@lru_cache(maxsize=None)
def real_sequences():
    pytest.importorskip("pyarrow")
    return tuple(r.sequence for split in ("train", "validation") for r in read_parquet(SUBSET / f"{split}.parquet"))


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("esm_vocab")
    (d / "vocab.txt").write_text(HF_VOCAB_TXT)
    return transformers.EsmTokenizer(str(d / "vocab.txt"))


def test_every_id_matches_transformers(hf_tok):
    tok = EsmTokenizer()
    assert tok.vocab_size == 33 == len(hf_tok)
    for token in HF_VOCAB_TXT.split():
        assert tok.token_to_id[token] == hf_tok.convert_tokens_to_ids(token), token
    assert (tok.cls_token_id, tok.pad_token_id, tok.eos_token_id, tok.unk_token_id, tok.mask_token_id) == (
        hf_tok.cls_token_id, hf_tok.pad_token_id, hf_tok.eos_token_id, hf_tok.unk_token_id, hf_tok.mask_token_id,
    ) == (0, 1, 2, 3, 32)


def test_vocab_literal():
    assert ESM2_VOCAB == HF_VOCAB_TXT.split()


def test_real_sequences_match_transformers(hf_tok):
    tok = EsmTokenizer()
    seqs = real_sequences()
    assert len(seqs) == 2200
    hf = hf_tok(list(seqs))["input_ids"]
    for s, ref in zip(seqs, hf):
        assert tok.encode(s).tolist() == ref
    for s in seqs[:300]:
        assert tok.encode(s, add_special_tokens=False).tolist() == hf_tok(s, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("max_length", [3, 64, 345, 1024])
def test_truncation_matches_transformers(hf_tok, max_length):
    tok = EsmTokenizer()
    for s in real_sequences()[:200]:
        ref = hf_tok(s, truncation=True, max_length=max_length)["input_ids"]
        got = tok.encode(s, max_length=max_length)
        assert got.tolist() == ref
        assert got.numel() <= max_length and got[0] == 0 and got[-1] == 2


@pytest.mark.parametrize(
    "text",
    ["MKTJJAYIAK", "mkt", "MKJ JQ", "MK<mask>TA", "A<B*", "XXBZUO.-", "<cls>MK<eos>", "M\u00e9K", "J<mask>J", ""],
)
def test_unknown_policy_unk_matches_transformers(hf_tok, text):
    tok = EsmTokenizer(unknown="unk")
    assert tok.encode(text).tolist() == hf_tok(text)["input_ids"]


def test_unknown_policy_error():
    tok = EsmTokenizer()
    with pytest.raises(ValueError, match=r"character 'J' at position 3 is not in the vocabulary"):
        tok.encode("MKTJAY")
    with pytest.raises(ValueError, match=r"character 'm' at position 0"):
        tok.encode("mkt")
    with pytest.raises(ValueError, match=r"character '\*' at position 7"):
        tok.encode("<mask>M*")
    with pytest.raises(ValueError, match="'unknown' must be 'error' or 'unk'"):
        EsmTokenizer(unknown="skip")
    with pytest.raises(TypeError, match="expected a str"):
        tok.encode(b"MKT")
    with pytest.raises(ValueError, match="'max_length' must be >= 3"):
        tok.encode("MKT", max_length=2)


def test_decode_and_masks():
    tok = EsmTokenizer()
    ids = tok.encode("MK<mask>TX")
    assert tok.decode(ids) == "<cls>MK<mask>TX<eos>"
    assert tok.decode(ids, skip_special_tokens=True) == "MKTX"
    assert tok.special_tokens_mask(ids).tolist() == [True, False, False, True, False, False, True]
    assert sorted(tok.random_token_ids.tolist()) == sorted(tok.token_to_id[a] for a in "ACDEFGHIKLMNPQRSTVWY")
    with pytest.raises(ValueError, match="outside"):
        tok.decode([33])


def test_save_vocabulary_loads_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    path = EsmTokenizer().save_vocabulary(tmp_path)
    assert Path(path).read_text() == HF_VOCAB_TXT
    hf = transformers.EsmTokenizer(path)
    assert hf("MKTAYIAK")["input_ids"] == EsmTokenizer().encode("MKTAYIAK").tolist()


def test_encode_speed_is_vectorised():
    """A 20k-residue protein must not be encoded character by character in
    Python: 200 encodes of it well under a second."""
    import time

    s = "".join(real_sequences()[:60])[:20000]
    tok = EsmTokenizer()
    t0 = time.perf_counter()
    for _ in range(200):
        tok.encode(s)
    assert time.perf_counter() - t0 < 1.0
