"""MLM masking (15 %, 80/10/10) on real proteins: statistics within binomial
bounds, special tokens untouched, exact determinism per (seed, epoch, index),
and MLMDataset's cropping."""
import math
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
import torch

from seqfuse.data import IGNORE_INDEX, EsmTokenizer, MLMDataset, TokenizedSequences, mlm_mask, read_parquet, sample_generator, sample_seed

SUBSET = Path(__file__).resolve().parents[1] / "recipes" / "esm2" / "data" / "subset"


@lru_cache(maxsize=None)
def real_sequences(split="validation"):
    pytest.importorskip("pyarrow")
    return tuple(r.sequence for r in read_parquet(SUBSET / f"{split}.parquet"))


def within(count, n, p, sigmas=5.0):
    """|count - n p| within `sigmas` binomial standard deviations."""
    sd = math.sqrt(n * p * (1 - p))
    return abs(count - n * p) <= sigmas * sd + 1


def test_masking_statistics_real(seed):
    tok = EsmTokenizer()
    ds = MLMDataset(real_sequences(), tok, max_length=100000, seed=seed)
    n_cand = n_sel = n_mask = n_rand_changed = n_same = 0
    p_same_sum = 0.0  # expected count of "random" picks that hit the original
    std = set(tok.random_token_ids.tolist())
    freq_random_pick = torch.zeros(33, dtype=torch.long)
    for i in range(len(ds)):
        s = ds[(0, i)]
        orig = tok.encode(real_sequences()[i])
        ids, labels = s["input_ids"], s["labels"]
        assert ids.shape == labels.shape == orig.shape
        special = tok.special_tokens_mask(orig)
        sel = labels != IGNORE_INDEX
        assert not (sel & special).any()
        assert torch.equal(ids[special], orig[special])  # specials never altered
        assert torch.equal(labels[sel], orig[sel])  # labels are the originals
        assert torch.equal(ids[~sel], orig[~sel])  # unselected tokens unchanged
        n_cand += int((~special).sum())
        n_sel += int(sel.sum())
        is_mask = ids[sel] == tok.mask_token_id
        n_mask += int(is_mask.sum())
        changed = (ids[sel] != orig[sel]) & ~is_mask
        n_rand_changed += int(changed.sum())
        n_same += int((ids[sel] == orig[sel]).sum())
        p_same_sum += sum(1 / 20 if int(t) in std else 0.0 for t in orig[sel])
        freq_random_pick += torch.bincount(ids[sel][changed], minlength=33)
    assert n_cand > 80000
    assert within(n_sel, n_cand, 0.15), (n_sel, n_cand)
    assert within(n_mask, n_sel, 0.8), (n_mask, n_sel)
    # a random pick leaves the token unchanged with probability 1/20 (standard residues)
    q = p_same_sum / n_sel
    assert within(n_rand_changed, n_sel, 0.1 * (1 - q)), (n_rand_changed, n_sel)
    assert within(n_same, n_sel, 0.1 + 0.1 * q), (n_same, n_sel)
    # random replacements are standard amino acids, spread evenly
    picks = freq_random_pick[sorted(std)]
    assert freq_random_pick.sum() == picks.sum()
    assert picks.min() > 0.5 * picks.float().mean()


def test_masking_is_deterministic_per_sample():
    tok = EsmTokenizer()
    seqs = real_sequences()[:50]
    a = MLMDataset(seqs, tok, max_length=128, seed=7)
    b = MLMDataset(TokenizedSequences(seqs, tok), tok, max_length=128, seed=7)
    order = list(range(50))
    np.random.default_rng(0).shuffle(order)
    for i in order:  # access order does not matter
        for e in (0, 3):
            x, y = a[(e, i)], b[(e, i)]
            assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["labels"], y["labels"])
    assert torch.equal(a[5]["labels"], a[(0, 5)]["labels"])  # int key = epoch 0
    # other epochs, seeds and samples get other masks
    assert sum(not torch.equal(a[(0, i)]["labels"], a[(1, i)]["labels"]) for i in range(50)) > 40
    c = MLMDataset(seqs, tok, max_length=128, seed=8)
    assert sum(not torch.equal(a[(0, i)]["labels"], c[(0, i)]["labels"]) for i in range(50)) > 40


def test_sample_seed_mixing():
    seeds = {sample_seed(s, e, i) for s in range(3) for e in range(3) for i in range(200)}
    assert len(seeds) == 3 * 3 * 200
    assert all(0 <= x < 2**63 for x in seeds)
    assert sample_seed(1, 2, 3) == sample_seed(1, 2, 3)
    with pytest.raises(ValueError, match=">= 0"):
        sample_seed(0, -1, 0)


def test_mlm_mask_extremes_and_errors():
    tok = EsmTokenizer()
    ids = tok.encode(real_sequences()[0])
    kw = dict(special_token_ids=tok.special_token_ids, mask_token_id=32, random_token_ids=tok.random_token_ids)
    out, lab = mlm_mask(ids, generator=sample_generator(0, 0, 0), mask_prob=1.0, mask_token_frac=1.0, random_token_frac=0.0, **kw)
    assert (out[1:-1] == 32).all() and out[0] == 0 and out[-1] == 2
    assert torch.equal(lab[1:-1], ids[1:-1]) and lab[0] == lab[-1] == IGNORE_INDEX
    out, lab = mlm_mask(ids, generator=sample_generator(0, 0, 0), mask_prob=0.0, **kw)
    assert torch.equal(out, ids) and (lab == IGNORE_INDEX).all()
    with pytest.raises(ValueError, match="'mask_prob' must be in"):
        mlm_mask(ids, generator=torch.Generator(), mask_prob=1.5, **kw)
    with pytest.raises(ValueError, match="sum <= 1"):
        mlm_mask(ids, generator=torch.Generator(), mask_token_frac=0.9, random_token_frac=0.2, **kw)
    with pytest.raises(ValueError, match="must be 1-D"):
        mlm_mask(ids[None], generator=torch.Generator(), **kw)


def test_dataset_cropping():
    tok = EsmTokenizer()
    seqs = real_sequences()
    long_i = max(range(len(seqs)), key=lambda i: len(seqs[i]))
    assert len(seqs[long_i]) > 1000
    start = MLMDataset(seqs, tok, max_length=64, crop="start", mask_prob=0.0)
    s = start[(0, long_i)]
    assert s["input_ids"].tolist() == tok.encode(seqs[long_i], max_length=64).tolist()
    rnd = MLMDataset(seqs, tok, max_length=64, crop="random", mask_prob=0.0, seed=3)
    windows = set()
    for e in range(6):
        ids = rnd[(e, long_i)]["input_ids"]
        assert ids.numel() == 64 and ids[0] == 0 and ids[-1] == 2
        text = tok.decode(ids[1:-1])
        assert text in seqs[long_i]
        windows.add(seqs[long_i].index(text))
    assert len(windows) > 1  # the window moves between epochs
    assert (rnd.lengths == np.minimum([len(s) for s in seqs], 62) + 2).all()
    with pytest.raises(ValueError, match="'crop' must be"):
        MLMDataset(seqs, tok, crop="middle")
    with pytest.raises(ValueError, match="'max_length' must be >= 3"):
        MLMDataset(seqs, tok, max_length=2)
    with pytest.raises(IndexError):
        rnd[(0, len(seqs))]
    with pytest.raises(ValueError, match="sequence 1: .*character 'j'"):
        TokenizedSequences(["MKT", "MjK"], tok)
