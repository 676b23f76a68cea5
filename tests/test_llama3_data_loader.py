"""The causal-LM data path of the Llama 3 recipe on the committed lambda phage
windows: CausalLMDataset (framing, crops, labels), the packed THD and padded
BSHD batches (a next-token loss over a packed batch equals the per-sequence
losses: nothing is predicted across a sequence boundary), and
build_causal_lm_loader (budget, coverage, evaluation order, exact resume)."""
from functools import lru_cache
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from seqfuse.data import (
    IGNORE_INDEX,
    CausalLMDataset,
    NucleotideTokenizer,
    PackedTHDCollator,
    PaddedBSHDCollator,
    TokenizedSequences,
    build_causal_lm_loader,
    build_mlm_loader,
    load_sequences,
)

pytest.importorskip("pyarrow")

SUBSET = Path(__file__).resolve().parents[1] / "recipes" / "llama3" / "data" / "subset"
TOK = NucleotideTokenizer()


@lru_cache(maxsize=None)
def windows(split="train") -> tuple[str, ...]:
    return tuple(load_sequences(SUBSET / f"{split}.parquet")[1])


@lru_cache(maxsize=None)
def store(split="train") -> TokenizedSequences:
    return TokenizedSequences(list(windows(split)), TOK)


def next_token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Hugging Face's causal-LM loss (shift by one, ignore -100), summed."""
    return F.cross_entropy(logits[..., :-1, :].reshape(-1, logits.shape[-1]).float(), labels[..., 1:].reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def test_samples_frame_windows_and_label_every_next_token():
    ds = CausalLMDataset(store(), TOK, max_length=1026, crop="start")
    assert len(ds) == 80 and (ds.lengths == 1026).all()
    for i in (0, 1, 57):
        s = ds[i]
        ids, labels = s["input_ids"], s["labels"]
        assert ids.tolist() == TOK.encode(windows()[i]).tolist()  # <bos> 1024 bases <eos>
        assert ids[0] == TOK.bos_token_id and ids[-1] == TOK.eos_token_id
        assert labels[0] == IGNORE_INDEX and torch.equal(labels[1:], ids[1:])
        assert s["index"] == i
    bare = CausalLMDataset(store(), TOK, max_length=1024, crop="start", add_special_tokens=False)
    assert bare[3]["input_ids"].tolist() == TOK.encode(windows()[3], add_special_tokens=False).tolist()


def test_random_crops_depend_on_seed_epoch_and_index_only():
    ds = CausalLMDataset(store(), TOK, max_length=258, seed=3)
    assert (ds.lengths == 258).all()
    a, b, c = ds[(0, 5)], ds[(0, 5)], ds[(1, 5)]
    assert torch.equal(a["input_ids"], b["input_ids"])
    assert not torch.equal(a["input_ids"], c["input_ids"])  # a new window next epoch
    bases = TOK.decode(a["input_ids"][1:-1].tolist())
    assert len(bases) == 256 and bases in windows()[5].upper()
    other = CausalLMDataset(store(), TOK, max_length=258, seed=4)
    assert not torch.equal(other[(0, 5)]["input_ids"], a["input_ids"])
    start = CausalLMDataset(store(), TOK, max_length=258, crop="start")[(1, 5)]
    assert TOK.decode(start["input_ids"][1:-1].tolist()) == windows()[5][:256].upper()


def test_packed_loss_equals_per_sequence_losses():
    """Three windows of different lengths packed (with a pad segment to a
    multiple of 16) or padded: the shifted loss sums agree with the losses of
    the sequences taken one by one, so no token of one sequence is asked to
    predict the next sequence's first token."""
    samples = [CausalLMDataset(store(), TOK, max_length=n, seed=1)[(0, i)] for n, i in ((100, 0), (37, 9), (64, 40))]
    g = torch.Generator().manual_seed(0)
    per_seq = [torch.randn(s["input_ids"].numel(), TOK.vocab_size, generator=g) for s in samples]
    expected = sum(next_token_loss_sum(lg, s["labels"]) for lg, s in zip(per_seq, samples))
    targets = sum(s["input_ids"].numel() - 1 for s in samples)

    packed = PackedTHDCollator(TOK.pad_token_id, pad_to_multiple_of=16)(samples)
    assert packed["cu_seqlens"].tolist() == [0, 100, 137, 201, 208]  # 201 real tokens + a pad segment of 7
    assert packed["num_tokens"] == 201 and packed["num_sequences"] == 3
    assert packed["position_ids"][100:103].tolist() == [0, 1, 2] and packed["position_ids"][201:].tolist() == list(range(7))
    assert (packed["labels"][[0, 100, 137]] == IGNORE_INDEX).all() and (packed["labels"][201:] == IGNORE_INDEX).all()
    flat_logits = torch.cat(per_seq + [torch.randn(7, TOK.vocab_size, generator=g)])
    assert torch.allclose(next_token_loss_sum(flat_logits, packed["labels"]), expected, rtol=1e-6, atol=1e-4)
    assert int((packed["labels"][1:] != IGNORE_INDEX).sum()) == targets

    padded = PaddedBSHDCollator(TOK.pad_token_id, pad_to_multiple_of=16)(samples)
    assert padded["input_ids"].shape == (3, 112)
    assert (padded["labels"][padded["attention_mask"] == 0] == IGNORE_INDEX).all()
    pad_logits = torch.randn(3, 112, TOK.vocab_size, generator=g)
    for b, lg in enumerate(per_seq):
        pad_logits[b, : lg.shape[0]] = lg
    assert torch.allclose(next_token_loss_sum(pad_logits, padded["labels"]), expected, rtol=1e-6, atol=1e-4)


@pytest.mark.parametrize("packed", [True, False])
def test_loader_covers_the_epoch_within_budget(packed):
    loader = build_causal_lm_loader(store(), TOK, max_tokens=2048, max_length=512, packed=packed,
                                    pad_to_multiple_of=16, seed=2)
    seen, tokens = [], 0
    for batch in loader:
        seen += batch["sample_indices"].tolist()
        tokens += batch["num_tokens"]
        assert batch["input_ids"].numel() <= 2048
        if packed:
            assert batch["cu_seqlens"].dtype == torch.int32 and batch["cu_seqlens"][-1] == batch["input_ids"].numel()
        else:
            assert batch["input_ids"].shape[1] == 512
    assert sorted(seen) == list(range(80)) and tokens == 80 * 512


def test_evaluation_loader_is_fixed_and_ordered():
    val = build_causal_lm_loader(list(windows("validation")), TOK, max_tokens=4096, max_length=1026, evaluation=True)
    first = [b["input_ids"] for b in val]
    second = [b["input_ids"] for b in val]
    assert all(torch.equal(x, y) for x, y in zip(first, second)) and len(first) == len(second) == 6  # 3 windows of 1026 per 4096
    assert torch.cat(first).tolist() == [t for w in windows("validation") for t in TOK.encode(w).tolist()]


def test_resume_gives_the_uninterrupted_batches():
    def make():
        return build_causal_lm_loader(store(), TOK, max_tokens=1024, max_length=300, seed=9, pad_to_multiple_of=16)

    ref = make()
    full = [b["input_ids"] for _, b in zip(range(30), _epochs(ref))]
    run = make()
    it = _epochs(run)
    for _ in range(13):
        next(it)
    state = run.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    rest = [b["input_ids"] for _, b in zip(range(17), _epochs(resumed))]
    assert all(torch.equal(x, y) for x, y in zip(full[13:], rest))
    mlm = build_mlm_loader(store(), TOK, max_tokens=1024, max_length=300, seed=9, pad_to_multiple_of=16)
    with pytest.raises(ValueError, match="dataset settings differ"):
        mlm.load_state_dict(state)


def _epochs(loader):
    while True:
        yield from loader


def test_bad_arguments():
    with pytest.raises(ValueError, match="does not fit in max_tokens=256"):
        build_causal_lm_loader(store(), TOK, max_tokens=256, max_length=300)
    with pytest.raises(ValueError, match="CausalLMDataset: argument 'max_length' must be >= 3"):
        CausalLMDataset(store(), TOK, max_length=2)
    with pytest.raises(ValueError, match="CausalLMDataset: argument 'crop' must be 'random' or 'start'"):
        CausalLMDataset(store(), TOK, crop="middle")
    with pytest.raises(IndexError, match="index 80 out of range"):
        CausalLMDataset(store(), TOK)[80]
