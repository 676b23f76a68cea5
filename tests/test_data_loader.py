"""Token-budget batching and the resumable loader on the real UniProt subset:
budgets respected, every sample once per epoch, ranks disjoint and in step,
and a saved position resuming into exactly the uninterrupted continuation
(one rank, two ranks, a changed world size, worker processes)."""
import io
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
import torch

from seqfuse.data import (
    EsmTokenizer, MLMDataset, PackedTHDCollator, ResumableDataLoader, TokenBudgetBatchSampler,
    TokenizedSequences, build_mlm_loader, read_parquet,
)

SUBSET = Path(__file__).resolve().parents[1] / "recipes" / "esm2" / "data" / "subset"
TOK = EsmTokenizer()


@lru_cache(maxsize=None)
def store():
    pytest.importorskip("pyarrow")
    seqs = [r.sequence for r in read_parquet(SUBSET / "train.parquet")][:800]
    return TokenizedSequences(seqs, TOK)


def loader(**kw):
    args = dict(max_tokens=4096, max_length=512, pad_to_multiple_of=16, seed=5, bucket_size=None)
    args.update(kw)
    return build_mlm_loader(store(), TOK, **args)


def same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def take(it, n):
    return [next(it) for _ in range(n)]


def roundtrip(state):
    """Through torch.save / torch.load, as a checkpoint would carry it."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("bucket", [None, 200])
@pytest.mark.parametrize("multiple", [None, 16])
def test_budget_and_coverage(padded, bucket, multiple):
    lengths = MLMDataset(store(), TOK, max_length=512).lengths
    s = TokenBudgetBatchSampler(lengths, 3000, padded=padded, pad_to_multiple_of=multiple, bucket_size=bucket, seed=1)
    m = multiple or 1
    for epoch in (0, 1):
        batches = s.batches(epoch)
        flat = sorted(i for b in batches for i in b)
        assert flat == list(range(len(lengths)))  # each sample exactly once
        for b in batches:
            ls = lengths[b]
            cost = len(b) * -(-ls.max() // m) * m if padded else -(-ls.sum() // m) * m
            assert cost <= 3000
        # greedy: a batch closed early would have overflowed with the next sample in order
    assert s.batches(0) != s.batches(1)  # reshuffled per epoch
    if bucket and padded:
        # bucketing cuts padding: compare with unbucketed batching
        plain = TokenBudgetBatchSampler(lengths, 3000, padded=True, pad_to_multiple_of=multiple, seed=1)
        assert len(batches) < len(plain.batches(1))


def test_collated_batches_respect_budget():
    L = loader(max_tokens=2048)
    n = 0
    for b in L:
        assert b["input_ids"].numel() <= 2048 and b["input_ids"].numel() % 16 == 0
        assert b["cu_seqlens"][-1] == b["input_ids"].numel()
        n += 1
    assert n == len(loader(max_tokens=2048)) > 100


def test_max_sequences_and_no_shuffle():
    lengths = np.array([10, 20, 30, 40, 50, 60])
    s = TokenBudgetBatchSampler(lengths, 1000, max_sequences=4, shuffle=False)
    assert s.batches(0) == [[0, 1, 2, 3], [4, 5]]
    assert s.batches_added_by_cap(0) == (2, 1)  # uncapped, all six fit the budget in one batch
    assert s.batches(0) == [[0, 1, 2, 3], [4, 5]] and s.max_sequences == 4  # the count leaves the sampler as it was
    assert TokenBudgetBatchSampler(lengths, 100, max_sequences=4, shuffle=False).batches_added_by_cap(0) == (3, 0)
    assert TokenBudgetBatchSampler(lengths, 1000, shuffle=False).batches_added_by_cap(0) == (1, 0)
    s = TokenBudgetBatchSampler(lengths, 60, shuffle=False)
    assert s.batches(0) == [[0, 1, 2], [3], [4], [5]]
    s = TokenBudgetBatchSampler(lengths, 100, padded=True, shuffle=False)
    assert s.batches(0) == [[0, 1, 2], [3, 4], [5]]  # 3 x 30 = 90, 2 x 50 = 100


def test_sequence_longer_than_budget_raises():
    with pytest.raises(ValueError, match=r"sample 3 needs 48 tokens after padding to a multiple of 16, more than max_tokens=40 \(2 sample"):
        TokenBudgetBatchSampler([10, 20, 30, 45, 50], 40, pad_to_multiple_of=16)
    with pytest.raises(ValueError, match="does not fit in max_tokens=1000"):
        loader(max_tokens=1000, max_length=1024)
    with pytest.raises(ValueError, match="rank < world_size"):
        TokenBudgetBatchSampler([10], 40, rank=2, world_size=2)
    with pytest.raises(ValueError, match="lengths must be >= 1"):
        TokenBudgetBatchSampler([10, 0], 40)
    with pytest.raises(ValueError, match="fewer than world_size=4"):
        TokenBudgetBatchSampler([10, 10, 10], 20, world_size=4, rank=1).rank_batches(0)
    with pytest.raises(TypeError, match="must be a TokenBudgetBatchSampler"):
        ResumableDataLoader(MLMDataset(store(), TOK), [[0]], PackedTHDCollator(1))


@pytest.mark.parametrize("stop", [0, 1, 17, 40])
def test_resume_mid_epoch_single_rank(stop):
    ref = loader()
    it = iter(ref)
    epoch0 = list(it)
    n = len(epoch0)
    epoch1 = take(iter(ref), 10)
    expected = (epoch0 + epoch1)[stop:]

    run = loader()
    it = iter(run)
    got = take(it, stop)
    for a, b in zip(got, epoch0):
        same(a, b)
    state = roundtrip(run.state_dict())
    assert state["epoch"] == 0 and state["global_batches_consumed"] == stop

    resumed = loader()
    resumed.load_state_dict(state)
    out = list(iter(resumed)) + take(iter(resumed), 10)
    assert len(out) == len(expected) == n - stop + 10
    for a, b in zip(out, expected):
        same(a, b)


def test_resume_at_epoch_boundary():
    ref = loader()
    n = len(ref)
    e0 = list(ref)
    e1_first = next(iter(ref))
    run = loader()
    it = iter(run)
    take(it, n)  # consumed every batch, but never exhausted the generator
    resumed = loader()
    resumed.load_state_dict(run.state_dict())
    same(next(iter(resumed)), e1_first)
    assert len(e0) == n


def test_resume_two_ranks():
    ranks = [loader(rank=r, world_size=2) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1])
    full = [list(iter(l)) for l in ranks]
    # ranks take alternate global batches, disjoint samples
    glob = ranks[0].batch_sampler.batches(0)
    assert [b["num_sequences"] for b in full[0]] == [len(g) for g in glob[0 : 2 * len(full[0]) : 2]]
    cover = set()
    for r in range(2):
        for g in glob[r : 2 * len(full[r]) : 2]:
            assert not cover & set(g)
            cover |= set(g)
    stop = 9
    states = []
    for r in range(2):
        l = loader(rank=r, world_size=2)
        take(iter(l), stop)
        states.append(roundtrip(l.state_dict()))
    assert all(s["global_batches_consumed"] == 2 * stop for s in states)
    for r in range(2):
        l = loader(rank=r, world_size=2)
        l.load_state_dict(states[r])
        rest = list(iter(l))
        assert len(rest) == len(full[r]) - stop
        for a, b in zip(rest, full[r][stop:]):
            same(a, b)


def test_resume_on_other_world_size():
    one = list(iter(loader()))
    two = loader(rank=1, world_size=2)
    take(iter(two), 5)  # 10 global batches consumed
    state = two.state_dict()
    single = loader()
    single.load_state_dict(state)
    same(next(iter(single)), one[10])
    with pytest.raises(ValueError, match="cannot be split evenly over world_size=4"):
        loader(rank=0, world_size=4).load_state_dict(dict(state, global_batches_consumed=6))


def test_resume_with_other_settings_refused():
    l = loader()
    take(iter(l), 3)
    state = l.state_dict()
    with pytest.raises(ValueError, match="max_tokens"):
        loader(max_tokens=8192).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        loader(seed=6).load_state_dict(state)
    with pytest.raises(ValueError, match=r"dataset settings differ.*'mask_prob': \(0.15, 0.2\)"):
        loader(mask_prob=0.2).load_state_dict(state)
    with pytest.raises(ValueError, match="lengths_crc32"):
        loader(max_length=256).load_state_dict(state)
    with pytest.raises(ValueError, match="not a seqfuse.data.ResumableDataLoader"):
        l.load_state_dict({"epoch": 0})
    with pytest.raises(ValueError, match="past the end of epoch"):
        loader().load_state_dict(dict(state, global_batches_consumed=10**6))


def test_position_saved_without_a_dataset_fingerprint_loads_with_a_warning():
    """A position saved while the dataset had no fingerprint (None) still
    loads, saying its dataset settings are unchecked; the sampler's check
    still refuses other lengths."""
    l = loader()
    take(iter(l), 3)
    state = dict(l.state_dict(), dataset=None)
    fresh = loader()
    with pytest.warns(UserWarning, match="no dataset fingerprint .* not checked"):
        fresh.load_state_dict(state)
    assert fresh.batches_consumed == l.batches_consumed
    with pytest.raises(ValueError, match="lengths_crc32"):
        loader(max_length=256).load_state_dict(state)


def test_workers_give_the_same_batches():
    ref = take(iter(loader()), 12)
    l = loader(num_workers=2)
    it = iter(l)
    got = take(it, 7)
    state = l.state_dict()  # prefetching workers ran ahead; the position did not
    assert state["global_batches_consumed"] == 7
    del it
    resumed = loader(num_workers=1)
    resumed.load_state_dict(state)
    got += take(iter(resumed), 5)
    for a, b in zip(got, ref):
        same(a, b)


def test_padded_loader_matches_packed_tokens():
    packed = take(iter(loader(packed=True, max_tokens=4096)), 3)
    ds = MLMDataset(store(), TOK, max_length=512, seed=5)
    sampler = TokenBudgetBatchSampler(ds.lengths, 4096, pad_to_multiple_of=16, seed=5)
    for b, idx in zip(packed, sampler.batches(0)):
        want = torch.cat([ds[(0, i)]["input_ids"] for i in idx])
        assert torch.equal(b["input_ids"][: want.numel()], want)


def test_evaluation_loader_is_fixed():
    ev = loader(evaluation=True)
    first = list(ev)
    second = list(ev)
    assert len(first) == len(second) == len(ev) > 0
    for a, b in zip(first, second):
        same(a, b)
    # file order, crops from the start
    order = [i for b in ev.batch_sampler.batches(0) for i in b]
    assert order == sorted(order)
    assert ev.state_dict()["global_batches_consumed"] == 0


def test_rank_from_process_group(tmp_path):
    import torch.distributed as dist

    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        l = loader()
        assert (l.rank, l.world_size) == (0, 1)
        assert loader(rank=1, world_size=2).rank == 1
    finally:
        dist.destroy_process_group()
