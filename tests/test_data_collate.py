"""Packed THD and padded BSHD collators on real masked proteins: same tokens
and labels per sequence, cu_seqlens / position_ids, FP8 padding to a multiple
of 16 in its own segment, and bad inputs."""
from functools import lru_cache
from pathlib import Path

import pytest
import torch

from seqfuse.data import IGNORE_INDEX, EsmTokenizer, MLMDataset, PackedTHDCollator, PaddedBSHDCollator, read_parquet

SUBSET = Path(__file__).resolve().parents[1] / "recipes" / "esm2" / "data" / "subset"


@lru_cache(maxsize=None)
def dataset():
    pytest.importorskip("pyarrow")
    seqs = [r.sequence for r in read_parquet(SUBSET / "validation.parquet")]
    return MLMDataset(seqs, EsmTokenizer(), max_length=512, seed=11)


def samples(idx):
    return [dataset()[(0, i)] for i in idx]


@pytest.mark.parametrize("idx", [[0], [3, 1, 4, 1, 5], list(range(20, 37)), [199, 0]])
@pytest.mark.parametrize("multiple", [None, 16])
def test_packed_equals_padded_per_sequence(idx, multiple):
    ss = samples(idx)
    packed = PackedTHDCollator(pad_token_id=1, pad_to_multiple_of=multiple)(ss)
    padded = PaddedBSHDCollator(pad_token_id=1, pad_to_multiple_of=multiple)(ss)
    cu = packed["cu_seqlens"]
    B, L = padded["input_ids"].shape
    assert B == len(ss) == packed["num_sequences"]
    lens = [s["input_ids"].numel() for s in ss]
    assert packed["num_tokens"] == padded["num_tokens"] == sum(lens)
    for b, n in enumerate(lens):
        a, e = int(cu[b]), int(cu[b + 1])
        assert e - a == n
        assert torch.equal(packed["input_ids"][a:e], padded["input_ids"][b, :n])
        assert torch.equal(packed["labels"][a:e], padded["labels"][b, :n])
        assert torch.equal(packed["input_ids"][a:e], ss[b]["input_ids"])
        assert padded["attention_mask"][b, :n].all() and not padded["attention_mask"][b, n:].any()
        assert (padded["input_ids"][b, n:] == 1).all() and (padded["labels"][b, n:] == IGNORE_INDEX).all()
    # the loss sees exactly the same targets in both layouts
    assert torch.equal(packed["labels"][packed["labels"] != IGNORE_INDEX], padded["labels"][padded["labels"] != IGNORE_INDEX])
    if multiple:
        assert L % multiple == 0


def test_cu_seqlens_and_position_ids():
    ss = samples([5, 9, 2])
    lens = [s["input_ids"].numel() for s in ss]
    out = PackedTHDCollator(pad_token_id=1)(ss)
    T = sum(lens)
    assert out["cu_seqlens"].dtype == torch.int32
    assert out["cu_seqlens"].tolist() == [0, lens[0], lens[0] + lens[1], T]
    assert out["input_ids"].shape == out["labels"].shape == out["position_ids"].shape == (T,)
    assert out["input_ids"].dtype == out["labels"].dtype == out["position_ids"].dtype == torch.int64
    ref = torch.cat([torch.arange(n) for n in lens])
    assert torch.equal(out["position_ids"], ref)
    assert out["max_seqlen"] == max(lens)
    # each segment begins with <cls> and ends with <eos>
    cu = out["cu_seqlens"].tolist()
    assert all(out["input_ids"][a] == 0 and out["input_ids"][e - 1] == 2 for a, e in zip(cu[:-1], cu[1:]))


def test_fp8_padding_is_its_own_segment():
    ss = samples([0, 1, 2])
    lens = [s["input_ids"].numel() for s in ss]
    T = sum(lens)
    pad = (-T) % 16
    if pad == 0:  # make sure the case under test happens
        ss = ss[:2]
        lens = lens[:2]
        T = sum(lens)
        pad = (-T) % 16
    assert pad > 0
    out = PackedTHDCollator(pad_token_id=1, pad_to_multiple_of=16)(ss)
    assert out["input_ids"].numel() == T + pad and (T + pad) % 16 == 0
    cu = out["cu_seqlens"].tolist()
    assert len(cu) == len(ss) + 2 and cu[-2] == T and cu[-1] == T + pad  # dummy segment
    assert (out["input_ids"][T:] == 1).all() and (out["labels"][T:] == IGNORE_INDEX).all()
    assert out["position_ids"][T:].tolist() == list(range(pad))
    assert out["num_sequences"] == len(ss) and out["num_tokens"] == T
    # already a multiple: no dummy segment
    exact = [{"input_ids": torch.zeros(16, dtype=torch.long), "labels": torch.zeros(16, dtype=torch.long)}]
    assert PackedTHDCollator(1, pad_to_multiple_of=16)(exact)["cu_seqlens"].tolist() == [0, 16]


def test_padded_fixed_length():
    ss = samples([0, 1])
    out = PaddedBSHDCollator(pad_token_id=1, max_length=512)(ss)
    assert out["input_ids"].shape == (2, 512) and out["attention_mask"].dtype == torch.int64
    with pytest.raises(ValueError, match="exceeds max_length=8"):
        PaddedBSHDCollator(1, max_length=8)(ss)
    with pytest.raises(ValueError, match="multiple of 'pad_to_multiple_of'"):
        PaddedBSHDCollator(1, pad_to_multiple_of=16, max_length=100)


def test_collator_bad_input():
    ss = samples([0, 1])
    for coll in (PackedTHDCollator(1), PaddedBSHDCollator(1)):
        with pytest.raises(ValueError, match="empty batch"):
            coll([])
        with pytest.raises(ValueError, match="sample 1: .*1-D of one length"):
            coll([ss[0], {"input_ids": ss[1]["input_ids"], "labels": ss[1]["labels"][:-1]}])
        with pytest.raises(ValueError, match="sample 0 is empty"):
            coll([{"input_ids": torch.zeros(0, dtype=torch.long), "labels": torch.zeros(0, dtype=torch.long)}])
    total = sum(s["input_ids"].numel() for s in ss)
    with pytest.raises(ValueError, match=f"holds {total} tokens.*max_tokens=100"):
        PackedTHDCollator(1, max_tokens=100)(ss)
    with pytest.raises(ValueError, match="'pad_to_multiple_of' must be >= 1"):
        PackedTHDCollator(1, pad_to_multiple_of=0)


def test_sample_indices_carried():
    ss = samples([7, 3, 9])
    for coll in (PackedTHDCollator(1, pad_to_multiple_of=16), PaddedBSHDCollator(1)):
        assert coll(ss)["sample_indices"].tolist() == [7, 3, 9]
    bare = [{"input_ids": s["input_ids"], "labels": s["labels"]} for s in ss]
    assert "sample_indices" not in PackedTHDCollator(1)(bare)


def test_batch_to_device():
    from seqfuse.data import batch_to_device

    b = PackedTHDCollator(1, pad_to_multiple_of=16)(samples([1, 2]))
    moved = batch_to_device(b, torch.device("meta"))
    assert moved["input_ids"].device.type == "meta" and moved["cu_seqlens"].dtype == torch.int32
    assert moved["sample_indices"].device.type == "cpu" and moved["max_seqlen"] == b["max_seqlen"]
