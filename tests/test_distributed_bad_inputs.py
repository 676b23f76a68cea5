"""Bad input to seqfuse.distributed (and the te.distributed / TE-named helpers
beside it) gets a Python exception naming the argument and the rule, never
a silently wrong answer; and enable_fp8_all_gather keeps tied weights tied.

CPU only; the functions that need a process group get a single-process gloo
group (a fixture per test, torn down with end_process_group).
"""
import logging

import numpy as np
import pytest
import torch
import torch.distributed as dist

import seqfuse.pytorch as te
from seqfuse.common.recipe import DelayedScaling
from seqfuse.distributed import (all_to_all_single_autograd, clip_grad_norm_, dispatch_tokens, end_process_group,
                                 enable_fp8_all_gather, fp8_all_gather_params, freqs_for_cp_rank,
                                 get_batch_on_this_cp_rank, init_expert_parallel_mesh, pad_thd_sequences_for_cp,
                                 split_batch_for_cp_rank)
from seqfuse.distributed.fp8_allgather import FP8ShardWeight

from helpers import free_port


@pytest.fixture
def group():
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield dist.group.WORLD
    end_process_group()


# ---- enable_fp8_all_gather and tied weights ------------------------------------------

class _TwoLinears(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = te.Linear(16, 16, params_dtype=torch.float32)
        self.b = te.Linear(16, 16, params_dtype=torch.float32)
        self.b.weight = self.a.weight


class _TiedHead(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 16)
        self.head = te.Linear(16, 32, bias=False, params_dtype=torch.float32)
        self.head.weight = self.emb.weight


def test_fp8_all_gather_keeps_a_weight_shared_by_two_fp8_modules_tied():
    """Two Linears sharing their weight: one converted Parameter in both
    (before, each got its own copy: the tie was cut and the parameter count
    went from 3 to 4)."""
    m = _TwoLinears()
    w = m.a.weight.detach().clone()
    count = len(list(m.parameters()))
    assert count == 3
    assert enable_fp8_all_gather(m, DelayedScaling()) == ["a.weight"]
    assert m.a.weight is m.b.weight
    assert len(list(m.parameters())) == count
    assert isinstance(m.a.weight, FP8ShardWeight)
    assert fp8_all_gather_params(m) == ["a.weight"]
    assert torch.equal(m.b.weight, w) and m.b.weight.requires_grad
    # both modules still compute with the one weight
    x = torch.randn(4, 16)
    assert torch.equal(m.a(x) - m.a.bias, m.b(x) - m.b.bias)
    assert enable_fp8_all_gather(m, DelayedScaling()) == []  # already converted


def test_fp8_all_gather_leaves_a_weight_tied_to_an_embedding_in_high_precision(caplog):
    """An embedding tied to the output Linear: the embedding has no FP8
    path (it would read FP8-rounded values), so the weight stays as it is,
    tied, and the log line names both holders."""
    m = _TiedHead()
    w = m.emb.weight
    with caplog.at_level(logging.WARNING, logger="seqfuse"):
        assert enable_fp8_all_gather(m, DelayedScaling()) == []
    assert m.emb.weight is m.head.weight is w
    assert len(list(m.parameters())) == 1
    assert not isinstance(m.head.weight, FP8ShardWeight)
    assert fp8_all_gather_params(m) == []
    text = caplog.text
    assert "head.weight" in text and "emb.weight" in text and "high precision" in text


# ---- split_batch_for_cp_rank, pad_thd_sequences_for_cp, freqs_for_cp_rank -------------

def test_split_batch_refuses_input_ids_not_matching_cu_seqlens():
    """20 ids against cu_seqlens ending at 16: tokens 16-19 were dropped
    silently with position_ids given, and a reshape error without."""
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    ids = torch.arange(20)
    for kw in (dict(labels=ids, position_ids=ids), dict()):
        with pytest.raises(ValueError, match=r"input_ids hold 20 tokens but cu_seqlens ends at 16"):
            split_batch_for_cp_rank(ids, cu_seqlens=cu, cp_size=2, cp_rank=1, **kw)
    with pytest.raises(ValueError, match=r"input_ids hold 12 tokens but cu_seqlens ends at 16"):
        split_batch_for_cp_rank(ids[:12], ids[:12], ids[:12], cu, cp_size=2, cp_rank=0)
    with pytest.raises(ValueError, match=r"input_ids hold 20 tokens"):
        split_batch_for_cp_rank(ids.view(1, 20), cu_seqlens=cu, cp_size=2, cp_rank=0)
    # matching: as before
    b = split_batch_for_cp_rank(ids[:16], cu_seqlens=cu, cp_size=2, cp_rank=0)
    assert b.input_ids.tolist() == [0, 1, 6, 7, 8, 9, 14, 15]


@pytest.mark.parametrize("bad,match", [
    # cu_seqlens not matching the batch: 20 tokens, cu_seqlens ending at 16 (or 24); each message names
    # the argument as get_batch_on_this_cp_rank calls it
    (dict(cu=torch.tensor([0, 8, 16], dtype=torch.int32)), r"input_ids_padded hold 20 tokens but cu_seqlens_padded ends at 16"),
    (dict(cu=torch.tensor([0, 8, 24], dtype=torch.int32)), r"input_ids_padded hold 20 tokens but cu_seqlens_padded ends at 24"),
    (dict(cu=torch.tensor([1, 8, 20], dtype=torch.int32)), r"cu_seqlens_padded must start at 0 and never decrease"),
    (dict(cu=torch.tensor([0, 12, 8, 20], dtype=torch.int32)), r"cu_seqlens_padded must start at 0 and never decrease"),
    (dict(cu=torch.tensor([[0, 8, 20]], dtype=torch.int32)), r"cu_seqlens_padded must be a 1-D tensor"),
    (dict(cu=[0, 8, 20]), r"cu_seqlens_padded must be a 1-D tensor"),
    (dict(cu=None), r"qkv_format 'thd' needs cu_seqlens_padded"),
    # per-token tensors of another shape
    (dict(labels=torch.arange(16)), r"labels_padded must be a tensor of input_ids_padded' shape \(20,\), got "
                                   r"\(16,\)"),
    (dict(pos=torch.arange(20).view(1, 20)), r"position_ids_padded must be a tensor of input_ids_padded' shape "
                                             r"\(20,\), got \(1, 20\)"),
    (dict(ids=torch.arange(20).view(2, 10)), r"thd input_ids_padded must be \[t\] or \[1, t\], got \(2, 10\)"),
], ids=["cu-short", "cu-long", "cu-start", "cu-decreasing", "cu-2d", "cu-list", "cu-none", "labels-shape",
        "position-ids-shape", "ids-2-rows"])
def test_get_batch_on_this_cp_rank_checks_a_group_of_one(group, bad, match):
    """A CP group of one rank returned its inputs unchecked: a cu_seqlens
    that does not describe the batch (or labels / position ids of another
    shape) went through silently there, and was refused with more ranks.
    Now the same checks run at every group size."""
    ids = bad.get("ids", torch.arange(20))
    cu = bad.get("cu", torch.tensor([0, 8, 20], dtype=torch.int32))
    labels = bad.get("labels", ids + 7)
    pos = bad.get("pos", None)
    assert dist.get_world_size(group) == 1
    with pytest.raises(ValueError, match="get_batch_on_this_cp_rank: " + match):
        get_batch_on_this_cp_rank(cu, ids, labels, pos, group)


def test_get_batch_on_this_cp_rank_group_of_one_keeps_the_batch(group):
    """A matching batch on one rank: the tensors themselves back, position
    ids made per sequence when not given (as with more ranks); sequence
    lengths need not be a multiple of 2 (one rank cuts no chunks)."""
    cu = torch.tensor([0, 7, 20], dtype=torch.int32)  # odd lengths
    ids = torch.arange(20).view(1, 20)
    labels, pos = ids + 7, torch.cat([torch.arange(7), torch.arange(13)]).view(1, 20)
    got = get_batch_on_this_cp_rank(cu, ids, labels, pos, group)
    assert got[0] is ids and got[1] is labels and got[2] is pos
    got = get_batch_on_this_cp_rank(cu, ids, None, None, group)
    assert got[0] is ids and got[1] is None and torch.equal(got[2], pos)
    # the same split as split_batch_for_cp_rank(cp_size=1) where that applies (even lengths)
    cu = torch.tensor([0, 8, 20], dtype=torch.int32)
    want = split_batch_for_cp_rank(ids, labels, None, cu, cp_size=1, cp_rank=0)
    got = get_batch_on_this_cp_rank(cu, ids, labels, None, group)
    assert all(torch.equal(a, b) for a, b in zip(got, (want.input_ids, want.labels, want.position_ids)))
    with pytest.raises(ValueError, match="qvk_format must be 'thd'"):
        get_batch_on_this_cp_rank(cu, ids, labels, None, group, qvk_format="bshd")


def test_cp_sizes_and_ranks_are_integers():
    ids = torch.arange(16).view(2, 8)
    with pytest.raises(ValueError, match="cp_size must be a positive int, got True"):
        split_batch_for_cp_rank(ids, cp_size=True, cp_rank=0)
    with pytest.raises(ValueError, match="cp_rank must be an int"):
        split_batch_for_cp_rank(ids, cp_size=2, cp_rank=1.0)
    # numpy / torch integers are integers
    a = split_batch_for_cp_rank(ids, cp_size=np.int64(2), cp_rank=torch.tensor(1))
    b = split_batch_for_cp_rank(ids, cp_size=2, cp_rank=1)
    assert torch.equal(a.input_ids, b.input_ids)


def test_pad_thd_refuses_labels_of_another_length():
    ids = torch.arange(7)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    with pytest.raises(ValueError, match="labels must be a tensor of one label per token of input_ids"):
        pad_thd_sequences_for_cp(ids, ids[:5], cu, 2)
    out, labels, cu_p = pad_thd_sequences_for_cp(ids, ids, cu, 2)
    assert out.tolist() == [0, 1, 2, 0, 3, 4, 5, 6] and cu_p.tolist() == [0, 4, 8]


def test_freqs_for_cp_rank_refuses_a_non_integer_seq_len():
    """seq_len=8.9 was truncated to 8 silently; -8 raised 'repeats can not be negative'."""
    freqs = torch.randn(16, 1, 1, 4)
    with pytest.raises(TypeError, match="seq_len must be an int"):
        freqs_for_cp_rank(freqs, 2, 0, seq_len=8.9)
    with pytest.raises(TypeError, match="seq_len must be an int"):
        freqs_for_cp_rank(freqs, 2, 0, seq_len=True)
    with pytest.raises(ValueError, match="seq_len must be >= 0"):
        freqs_for_cp_rank(freqs, 2, 0, seq_len=-8)
    assert torch.equal(freqs_for_cp_rank(freqs, 2, 1, seq_len=np.int64(8)), freqs_for_cp_rank(freqs, 2, 1, seq_len=8))


# ---- expert parallelism ----------------------------------------------------------------

def _routing():
    torch.manual_seed(0)
    x, probs = torch.randn(6, 8), torch.rand(6, 4)
    return x, probs, probs > 0.5


def test_dispatch_tokens_refuses_a_non_integer_expert_count():
    """num_local_experts=4.7 ran as 4 (int() truncation)."""
    x, probs, rm = _routing()
    for bad in (4.7, 4.0, "4", True):
        with pytest.raises(TypeError, match="num_local_experts"):
            dispatch_tokens(x, probs, rm, None, bad)
    ref = dispatch_tokens(x, probs, rm, None, 4)
    out = dispatch_tokens(x, probs, rm, None, np.int64(4))
    assert out[2] == ref[2] and torch.equal(out[0], ref[0])


def test_all_to_all_refuses_fractional_splits(group):
    """Split sizes of 6.7 ran as 6."""
    x = torch.randn(6, 8)
    with pytest.raises(TypeError, match="'input_splits' must be a sequence of ints"):
        all_to_all_single_autograd(x, [6], [6.7], group)
    with pytest.raises(TypeError, match="'output_splits' must be a sequence of ints"):
        all_to_all_single_autograd(x, [6.7], [6], group)
    with pytest.raises(TypeError, match="'output_splits' must be a sequence of ints"):
        all_to_all_single_autograd(x, [True], [6], group)
    assert torch.equal(all_to_all_single_autograd(x, [np.int64(6)], torch.tensor([6]), group), x)


def test_init_expert_parallel_mesh_refuses_a_float_dp_size(group):
    with pytest.raises(TypeError, match="'dp_size' must be an int"):
        init_expert_parallel_mesh(1, dp_size=1.0)
    assert tuple(init_expert_parallel_mesh(1, dp_size=1).shape) == (1, 1)


def _with_grads(m, value=3.0):
    for p in m.parameters():
        p.grad = torch.full_like(p, value)
    return m


def test_clip_grad_norm_refuses_bad_max_norm_and_takes_an_empty_model():
    """A negative max_norm flipped every gradient, NaN made them NaN; a
    model without parameters raised a bare StopIteration (torch's
    clip_grad_norm_ gives 0 for no parameters)."""
    m = _with_grads(torch.nn.Linear(4, 4))
    for bad in (-1.0, float("nan"), torch.tensor(-1.0)):
        with pytest.raises(ValueError, match="'max_norm' must be >= 0"):
            clip_grad_norm_(m, bad)
        assert all(bool((p.grad == 3.0).all()) for p in m.parameters())  # untouched
    for bad in ("1.0", None, True):
        with pytest.raises(TypeError, match="'max_norm' must be a real number"):
            clip_grad_norm_(m, bad)
    norm = clip_grad_norm_(torch.nn.Module(), 1.0)
    ref = torch.nn.utils.clip_grad_norm_([], 1.0)
    assert isinstance(norm, torch.Tensor) and float(norm) == float(ref) == 0.0
    # a tensor max_norm clips as the float does
    a, b = _with_grads(torch.nn.Linear(4, 4)), _with_grads(torch.nn.Linear(4, 4))
    assert float(clip_grad_norm_(a, torch.tensor(1.0))) == float(clip_grad_norm_(b, 1.0))
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters()))
    # inf: no clipping
    c = _with_grads(torch.nn.Linear(4, 4))
    clip_grad_norm_(c, float("inf"))
    assert all(bool((p.grad == 3.0).all()) for p in c.parameters())


# ---- CudaRNGStatesTracker -------------------------------------------------------------

def _draw(tracker, name="s"):
    with tracker.fork(name):
        return torch.rand(4)


def test_rng_tracker_seeds_are_integers_compared_as_torch_seeds_them():
    """add('d', 1.5) and add('n', torch.tensor(1)) after add('a', 1) passed
    the duplicate-seed check (1.5 seeded like 1); a refused seed must leave
    the tracker as it was."""
    t = te.CudaRNGStatesTracker()
    with pytest.raises(TypeError, match="'seed' must be an integer"):
        t.add("c", "x")
    assert not t.is_initialized() and t.get_states() == {} and not t.seeds_
    t.add("a", 1)
    with pytest.raises(TypeError, match="'seed' must be an integer"):
        t.add("d", 1.5)
    with pytest.raises(TypeError, match="'seed' must be an integer"):
        t.add("d", True)
    for same in (torch.tensor(1), np.int64(1)):
        with pytest.raises(ValueError, match="seed 1 is already used"):
            t.add("n", same)
    t.add("big", 2 ** 64 - 1)
    with pytest.raises(ValueError, match="seed -1 is already used"):  # torch seeds -1 as 2**64 - 1
        t.add("neg", -1)
    with pytest.raises(ValueError, match=r"\[-2\*\*63, 2\*\*64\)"):
        t.add("huge", 2 ** 64)
    assert sorted(t.get_states()) == ["a", "big"]
    t.add("s", torch.tensor(7))
    torch.manual_seed(7)
    assert torch.equal(_draw(t), torch.rand(4))


def test_rng_tracker_set_states_checks_each_stream():
    """set_states accepted anything; a bad state failed only at fork
    ('too many values to unpack')."""
    t = te.CudaRNGStatesTracker()
    t.add("s", 5)
    good = t.get_states()
    with pytest.raises(TypeError, match="'states' must be a mapping"):
        t.set_states([("s", good["s"])])
    with pytest.raises(ValueError, match=r"states\['x'\] must be a \(cpu state, cuda state or None\) pair"):
        t.set_states({"s": good["s"], "x": "junk"})
    with pytest.raises(ValueError, match=r"states\['x'\]: the CPU generator state has 3 bytes"):
        t.set_states({"x": (torch.zeros(3, dtype=torch.uint8), good["s"][1])})
    with pytest.raises(ValueError, match=r"states\['x'\]: the CPU generator state must be a 1-D torch.uint8"):
        t.set_states({"x": (torch.get_rng_state().float(), good["s"][1])})
    assert t.get_states().keys() == {"s"}  # a refused set_states changes nothing
    cuda_state = torch.zeros(16, dtype=torch.uint8)
    if not torch.cuda.is_available():
        # TE's form (one CUDA generator state per stream) cannot be applied without CUDA
        with pytest.raises(ValueError, match=r"states\['te'\] is a single tensor.*CUDA is not available"):
            t.set_states({"te": cuda_state})
        with pytest.raises(ValueError, match=r"states\['x'\] holds a CUDA generator state but CUDA is not available"):
            t.set_states({"x": (good["s"][0], cuda_state)})
    else:
        # TE's form: the stream forks the CUDA generator only, and continues
        cuda_state = torch.cuda.get_rng_state()
        t.set_states({"te": cuda_state})
        cpu_before = torch.get_rng_state()
        with t.fork("te"):
            a = torch.rand(4, device="cuda")
            assert torch.equal(torch.get_rng_state(), cpu_before)
        with t.fork("te"):
            b = torch.rand(4, device="cuda")
        saved = torch.cuda.get_rng_state()
        torch.cuda.set_rng_state(cuda_state)
        assert torch.equal(torch.cat([a, b]), torch.rand(8, device="cuda"))
        torch.cuda.set_rng_state(saved)
        assert t.get_states()["te"][0] is None
        t.set_states(t.get_states())  # its own form comes back
    # the get_states round trip, as before
    t.set_states(good)
    first = _draw(t)
    t.set_states(good)
    assert torch.equal(_draw(t), first)


# ---- TE-named helpers: quantized_model_init / fp8_model_init, parallel_cross_entropy ----

@pytest.mark.parametrize("name", ["quantized_model_init", "fp8_model_init"])
def test_model_init_checks_its_arguments(name):
    init = getattr(te, name)
    with pytest.raises(TypeError, match="argument 'recipe' must be a seqfuse.common.recipe recipe"):
        with init(recipe=3):
            pass
    with pytest.raises(TypeError, match="argument 'enabled' must be a bool"):
        with init(enabled="yes"):
            pass
    with pytest.raises(TypeError, match="argument 'preserve_high_precision_init_val' must be a bool"):
        with init(True, None, "no"):
            pass
    with pytest.raises(TypeError, match="argument 'enabled' must be a bool, got DelayedScaling .a recipe goes"):
        with init(DelayedScaling()):
            pass
    import seqfuse.quantization as q
    assert not q.quantized_model_init_state().enabled  # nothing was entered
    with init(enabled=False, recipe=DelayedScaling()):
        assert not q.quantized_model_init_state().enabled


def test_parallel_cross_entropy_names_a_bad_process_group_without_a_group():
    """Without torch.distributed initialized, 'g' was accepted silently."""
    assert not dist.is_initialized()
    x, t = torch.randn(2, 3, 5), torch.randint(0, 5, (2, 3))
    with pytest.raises(TypeError, match="argument 'dist_process_group' must be a torch.distributed.ProcessGroup"):
        te.parallel_cross_entropy(x, t, dist_process_group="g")


def test_parallel_cross_entropy_names_a_bad_process_group(group):
    """With a group initialized, 'g' raised AttributeError from inside torch."""
    x, t = torch.randn(2, 3, 5), torch.randint(0, 5, (2, 3))
    with pytest.raises(TypeError, match="argument 'dist_process_group' must be a torch.distributed.ProcessGroup"):
        te.parallel_cross_entropy(x, t, dist_process_group="g")
    assert torch.equal(te.parallel_cross_entropy(x, t, dist_process_group=group), te.parallel_cross_entropy(x, t))
