"""Context parallelism (seqfuse.distributed) on the CPU over gloo.

The claim: attention run with context parallelism over cp ranks (each
holding its load-balanced share of the tokens) gives, on every rank, the
rows of the output and of dq, dk, dv that single-process attention over the
whole sequence gives for those tokens, within float32 rounding; for bshd,
sbhd and packed thd, causal and full masks, GQA, cp_comm_type p2p and
all_gather, at cp = 2 and 4; through DotProductAttention too; and two
Llama-shaped TransformerLayers (rotary embeddings included in bshd) give
the full run's loss and gradients.  A group of one rank is plain attention.
Bad arguments raise naming the argument.  The batch split, thd padding,
rotary-table and lse-merge helpers are checked in this process.

Each world size is one start of worker processes (forkserver with torch and
seqfuse preloaded, so a start costs one import, not one per process) that
runs every case and saves its errors; the tests read them.  Shapes are tiny:
the whole file takes seconds beyond the starts.
"""

import pytest
import torch
import torch.distributed as dist

import seqfuse.ops as ops
from helpers import BACKWARD_FACTOR, REL_TOL, check_raised, raised, rel_error, run_ranks, run_seed
from seqfuse.modules.attention import DotProductAttention
from seqfuse.distributed import (context_parallel_attention, local_token_index, pad_thd_sequences_for_cp,
                              split_batch_for_cp_rank)

FORMATS = ("bshd", "sbhd", "thd")
MASKS = ("causal", "no_mask")
COMMS = ("p2p", "all_gather")
CASES = [(f, m, c, g) for f in FORMATS for m in MASKS for c in COMMS for g in (False, True)]
WORLDS = (2, 4)
HEADS, DIM = 4, 16

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def case_id(case):
    f, m, c, g = case
    return f"{f}-{m}-{c}" + ("-gqa" if g else "")


# ---- the reference and the CP run of one case (inside a worker) -------------

def _lengths(fmt, world):
    """Sequence lengths of the full batch: thd packs unequal ones (one empty)."""
    m = 2 * world
    return [3 * m, m, 0, 2 * m] if fmt == "thd" else [4 * m]


def _full_inputs(fmt, world, gqa, seed):
    """Full q, k, v, dout of the case (same on every rank: one seed), and
    the thd cu_seqlens (None otherwise)."""
    gen = torch.Generator().manual_seed(seed)
    lens = _lengths(fmt, world)
    kv_heads = 2 if gqa else HEADS
    batch = 2
    if fmt == "thd":
        t = sum(lens)
        shapes = [(t, HEADS, DIM), (t, kv_heads, DIM)]
        cu = torch.tensor([0] + list(torch.cumsum(torch.tensor(lens), 0)), dtype=torch.int32)
    else:
        s = lens[0]
        shapes = [(batch, s, HEADS, DIM), (batch, s, kv_heads, DIM)] if fmt == "bshd" else \
            [(s, batch, HEADS, DIM), (s, batch, kv_heads, DIM)]
        cu = None
    q = torch.randn(shapes[0], generator=gen)
    k = torch.randn(shapes[1], generator=gen)
    v = torch.randn(shapes[1], generator=gen)
    dout = torch.randn(shapes[0], generator=gen)
    return q, k, v, dout, cu


def _local(x, fmt, world, rank, cu):
    """This rank's tokens of a full tensor (the load-balanced split)."""
    if fmt == "thd":
        lengths = (cu[1:] - cu[:-1]).long()
        return x.index_select(0, local_token_index(lengths, world, rank))
    s_dim = 1 if fmt == "bshd" else 0
    index = local_token_index(torch.tensor([x.shape[s_dim]]), world, rank)
    return x.index_select(s_dim, index)


def _reference(q, k, v, dout, fmt, mask, cu):
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    kw = dict(qkv_format=fmt, attn_mask_type=mask)
    if fmt == "thd":
        kw.update(cu_seqlens_q=cu, cu_seqlens_kv=cu, attn_mask_type="padding_causal" if mask == "causal" else "padding")
    out = ops.attention(q, k, v, **kw)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _run_case(case, world, rank, group, seed, through_module=False):
    fmt, mask, comm, gqa = case
    q, k, v, dout, cu = _full_inputs(fmt, world, gqa, seed)
    ref = _reference(q, k, v, dout, fmt, mask, cu)
    ql, kl, vl, dl = (_local(x, fmt, world, rank, cu).requires_grad_(x is not dout) for x in (q, k, v, dout))
    if through_module:
        dpa = DotProductAttention(HEADS, DIM, num_gqa_groups=k.shape[-2], qkv_format=fmt, attn_mask_type=mask)
        dpa.set_context_parallel_group(group, dist.get_process_group_ranks(group), None, comm)
        out = dpa(ql, kl, vl, cu_seqlens_q=cu, cu_seqlens_kv=cu)
        out = out.view(ql.shape)
    else:
        out = context_parallel_attention(ql, kl, vl, cp_group=group, cp_comm_type=comm, qkv_format=fmt,
                                         attn_mask_type=mask, cu_seqlens_q=cu, cu_seqlens_kv=cu)
    out.backward(dl)
    got = (out.detach(), ql.grad, kl.grad, vl.grad)
    return [rel_error(g, _local(r, fmt, world, rank, cu)) for g, r in zip(got, ref)]


def _bad_arguments(world, group):
    q = torch.randn(2, 2 * world + 1, HEADS, DIM)  # odd local length: the sequence is no multiple of 2*cp
    good = torch.randn(2, 4, HEADS, DIM)
    cu_bad = torch.tensor([0, 4 * world + 2], dtype=torch.int32)  # a thd sequence no multiple of 2*cp
    t_bad = torch.randn((4 * world + 2) // world, HEADS, DIM)
    dpa = DotProductAttention(HEADS, DIM, attention_dropout=0.1, qkv_format="bshd", attn_mask_type="causal")
    dpa.set_context_parallel_group(group, None, None, "p2p")
    return {
        "comm_type": raised(lambda: context_parallel_attention(good, good, good, cp_group=group,
                                                               cp_comm_type="ring")),
        "bshd_length": raised(lambda: context_parallel_attention(q, q, q, cp_group=group)),
        "thd_length": raised(lambda: context_parallel_attention(t_bad, t_bad, t_bad, cp_group=group,
                                                                qkv_format="thd", cu_seqlens_q=cu_bad)),
        "dropout": raised(lambda: context_parallel_attention(good, good, good, cp_group=group, dropout_p=0.1)),
        "module_dropout": raised(lambda: dpa(good, good, good)),
        "global_ranks": raised(lambda: context_parallel_attention(good, good, good, cp_group=group,
                                                                  cp_global_ranks=list(range(world + 1)))),
        "padding_bshd": raised(lambda: context_parallel_attention(good, good, good, cp_group=group,
                                                                  attn_mask_type="padding")),
    }


def _small_llama(fmt, comm, world, rank, group, seed):
    """Two Llama-shaped TransformerLayers (RMSNorm, SwiGLU, GQA, causal,
    rotary embeddings): the CP run's loss, input gradient (its rows) and
    parameter gradients (summed over the CP ranks) against the
    full-sequence run.  Returns their relative errors.

    Two states of the layer are handled, each checked for what it does.
    With TransformerLayer.set_context_parallel_group (TE's call), the layer
    rotates each local token by its full-sequence position itself, given
    the full angle table, as TE does (bshd and thd).  Without it, the core
    attention is put under CP directly and the caller passes the rank's
    rows of the table (freqs_for_cp_rank), bshd only (the rotary kernel's
    thd path numbers positions per local sequence, so thd runs without
    rotary embeddings)."""
    from seqfuse.modules.rope import RotaryPositionEmbedding
    from seqfuse.modules.transformer_layer import TransformerLayer
    from seqfuse.distributed import freqs_for_cp_rank

    torch.manual_seed(seed)
    hidden, b = 32, 2
    layers = torch.nn.Sequential(*[TransformerLayer(
        hidden, 64, 4, num_gqa_groups=2, hidden_dropout=0.0, attention_dropout=0.0, bias=False,
        activation="swiglu", normalization="RMSNorm", attn_input_format=fmt, self_attn_mask_type="causal")
        for _ in range(2)])
    lens = _lengths(fmt, world)
    cu = torch.tensor([0] + list(torch.cumsum(torch.tensor(lens), 0)), dtype=torch.int32) if fmt == "thd" else None
    shape = (sum(lens), hidden) if fmt == "thd" else (b, lens[0], hidden)
    x = torch.randn(shape)
    target = torch.randn(shape)
    layer_cp = hasattr(TransformerLayer, "set_context_parallel_group")
    freqs = RotaryPositionEmbedding(hidden // 4)(max(lens) + 6) if fmt == "bshd" or layer_cp else None
    kw = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu) if fmt == "thd" else {}

    def run(x, target, rope):
        x = x.clone().requires_grad_()
        h = x
        for layer in layers:
            h = layer(h, rotary_pos_emb=rope, **kw)
        # a sum of squares (no cancellation that would make the loss's relative error meaningless),
        # over the full batch's token count so the ranks' losses add up to the full one
        loss = ((h - target) ** 2).sum() / target.new_tensor(float(sum(lens) * (1 if fmt == "thd" else b)))
        layers.zero_grad()
        loss.backward()
        return loss.detach(), x.grad, [p.grad.clone() for p in layers.parameters()]

    full = run(x, target, freqs)
    for layer in layers:
        if layer_cp:
            layer.set_context_parallel_group(group, None, None, comm)
        else:
            layer.self_attention.core_attention.set_context_parallel_group(group, None, None, comm)
    if freqs is not None and not layer_cp:
        freqs = freqs_for_cp_rank(freqs, world, rank, seq_len=lens[0])
    local = run(_local(x, fmt, world, rank, cu), _local(target, fmt, world, rank, cu), freqs)
    loss = local[0].clone()
    dist.all_reduce(loss, group=group)
    grads = [g.clone() for g in local[2]]
    for g in grads:
        dist.all_reduce(g, group=group)
    return [rel_error(loss, full[0]), rel_error(local[1], _local(full[1], fmt, world, rank, cu)),
            max(rel_error(g, r) for g, r in zip(grads, full[2]))]


def _te_split_matches(world, rank, group):
    """get_batch_on_this_cp_rank (TE's name and argument order, rank and
    size from the group) picks what split_batch_for_cp_rank picks."""
    from seqfuse.distributed import get_batch_on_this_cp_rank

    lens = _lengths("thd", world)
    cu = torch.tensor([0] + list(torch.cumsum(torch.tensor(lens), 0)), dtype=torch.int32)
    ids = torch.arange(sum(lens)).view(1, -1)
    pos = torch.cat([torch.arange(n) for n in lens]).view(1, -1)
    got = get_batch_on_this_cp_rank(cu, ids, ids + 7, pos, group)
    want = split_batch_for_cp_rank(ids, ids + 7, None, cu, cp_size=world, cp_rank=rank)
    return all(torch.equal(a, b) for a, b in zip(got, (want.input_ids, want.labels, want.position_ids)))


def _ranks_body(rank, world, seed):
    """Every CP case on this rank (run_ranks' body)."""
    group = dist.new_group(list(range(world)))  # CP over a group that is not the default one
    results = {case_id(c): _run_case(c, world, rank, group, seed + i) for i, c in enumerate(CASES)}
    for i, c in enumerate([("bshd", "causal", "p2p", True), ("thd", "causal", "all_gather", False)]):
        results["module-" + case_id(c)] = _run_case(c, world, rank, group, seed + 100 + i, through_module=True)
    singles = [dist.new_group([r]) for r in range(world)]  # every rank takes part in every new_group
    for i, c in enumerate([("bshd", "causal", "p2p", True), ("thd", "causal", "all_gather", False),
                           ("sbhd", "no_mask", "p2p", False)]):
        results["cp1-" + case_id(c)] = _run_case(c, 1, 0, singles[rank], seed + 300 + i)
    for fmt in ("bshd", "thd"):
        for comm in COMMS:
            results[f"llama-{fmt}-{comm}"] = _small_llama(fmt, comm, world, rank, group, seed + 200)
    results["bad"] = _bad_arguments(world, group)
    results["te_split"] = _te_split_matches(world, rank, group)
    return results


@pytest.fixture(scope="module")
def cp_results(tmp_path_factory):
    """{world: [per-rank result dicts]}: one start of `world` processes each."""
    seed = run_seed()
    return {world: run_ranks(_ranks_body, (seed,), world, tmp_path_factory.mktemp(f"cp{world}"),
                             f"context-parallel workers (world size {world})")
            for world in WORLDS}


# ---- the tests ----------------------------------------------------------------

@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_cp_equals_full_attention(cp_results, world, case):
    """Every rank's out, dq, dk, dv equal the full-sequence attention's rows
    of its tokens (float32 on the CPU)."""
    for rank, res in enumerate(cp_results[world]):
        e_out, e_dq, e_dk, e_dv = res[case_id(case)]
        assert e_out <= REL_TOL[torch.float32], (rank, "out", e_out)
        for name, e in (("dq", e_dq), ("dk", e_dk), ("dv", e_dv)):
            assert e <= REL_TOL[torch.float32] * BACKWARD_FACTOR, (rank, name, e)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", ["module-bshd-causal-p2p-gqa", "module-thd-causal-all_gather"])
def test_dot_product_attention_with_cp(cp_results, world, name):
    """DotProductAttention.set_context_parallel_group runs the same CP
    attention (output flattened to [.., h*d] as without CP)."""
    for rank, res in enumerate(cp_results[world]):
        errs = res[name]
        assert errs[0] <= REL_TOL[torch.float32], (rank, errs)
        assert max(errs[1:]) <= REL_TOL[torch.float32] * BACKWARD_FACTOR, (rank, errs)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", [f"llama-{f}-{c}" for f in ("bshd", "thd") for c in COMMS])
def test_small_llama_with_cp_equals_full(cp_results, world, name):
    """Two Llama-shaped TransformerLayers under CP: the loss (summed over the
    ranks), the input gradient rows and the parameter gradients (summed over
    the ranks) equal the full-sequence run's (float32)."""
    for rank, res in enumerate(cp_results[world]):
        e_loss, e_dx, e_params = res[name]
        assert e_loss <= REL_TOL[torch.float32], (rank, "loss", e_loss)
        assert e_dx <= REL_TOL[torch.float32] * BACKWARD_FACTOR, (rank, "input grad", e_dx)
        assert e_params <= REL_TOL[torch.float32] * BACKWARD_FACTOR, (rank, "parameter grads", e_params)


@pytest.mark.parametrize("name", ["cp1-bshd-causal-p2p-gqa", "cp1-thd-causal-all_gather", "cp1-sbhd-no_mask-p2p"])
def test_cp_group_of_one_rank(cp_results, name):
    """A CP group of one rank is plain attention (nothing sent to itself)."""
    for res in cp_results[2]:
        errs = res[name]
        assert errs[0] <= REL_TOL[torch.float32] and max(errs[1:]) <= REL_TOL[torch.float32] * BACKWARD_FACTOR, errs


BAD = {
    "comm_type": ("ValueError", "cp_comm_type"),
    "bshd_length": ("ValueError", "multiple of 2*cp"),
    "thd_length": ("ValueError", "cu_seqlens_q"),
    "dropout": ("NotImplementedError", "dropout_p"),
    "module_dropout": ("NotImplementedError", "attention_dropout"),
    "global_ranks": ("ValueError", "cp_global_ranks"),
    "padding_bshd": ("NotImplementedError", "attn_mask_type"),
}


@pytest.mark.parametrize("which", sorted(BAD))
def test_cp_bad_arguments(cp_results, which):
    check_raised(cp_results[2], which, BAD)


@pytest.mark.parametrize("world", WORLDS)
def test_get_batch_on_this_cp_rank_matches_split(cp_results, world):
    assert all(res["te_split"] for res in cp_results[world])


def test_set_context_parallel_group_refuses_unknown_comm_type():
    dpa = DotProductAttention(HEADS, DIM)
    with pytest.raises(ValueError, match="cp_comm_type"):
        dpa.set_context_parallel_group(None, None, None, "ring")
    with pytest.raises(NotImplementedError, match="a2a"):
        dpa.set_context_parallel_group(None, None, None, "a2a")
    with pytest.raises(ValueError, match="cp_comm_type"):
        DotProductAttention(HEADS, DIM, cp_comm_type="bogus")
    dpa.set_context_parallel_group(None, None, None, "all_gather")  # None: CP off, accepted
    assert dpa.cp_group is None and dpa.cp_comm_type == "all_gather"


# ---- the batch split (no process group needed) ---------------------------------

@pytest.mark.parametrize("cp", [1, 2, 4])
def test_split_batch_thd_covers_every_token_once(cp):
    lens = [4 * cp, 2 * cp, 0, 6 * cp]
    cu = torch.tensor([0] + list(torch.cumsum(torch.tensor(lens), 0)), dtype=torch.int32)
    t = sum(lens)
    ids = torch.arange(t).view(1, t) + 1000
    labels = torch.arange(t).view(1, t) + 5000
    parts = [split_batch_for_cp_rank(ids, labels, None, cu, cp_size=cp, cp_rank=r) for r in range(cp)]
    got = torch.cat([p.input_ids.flatten() for p in parts]) - 1000
    assert sorted(got.tolist()) == list(range(t))
    for r, p in enumerate(parts):
        assert torch.equal(p.labels - 5000, p.input_ids - 1000)  # labels follow their tokens
        assert p.cu_seqlens is cu and p.max_seqlen == max(lens)
        # rank r holds, per sequence, chunk r then chunk 2cp-1-r; position ids are full-sequence positions
        start, off = 0, 0
        for n in lens:
            c = n // (2 * cp)
            want_pos = list(range(r * c, (r + 1) * c)) + list(range((2 * cp - 1 - r) * c, (2 * cp - r) * c))
            assert p.position_ids.flatten()[off:off + 2 * c].tolist() == want_pos
            assert (p.input_ids.flatten()[off:off + 2 * c] - 1000 - start).tolist() == want_pos
            start, off = start + n, off + 2 * c


def test_split_batch_bshd_and_refusals():
    ids = torch.arange(2 * 16).view(2, 16)
    p = split_batch_for_cp_rank(ids, ids + 1, cp_size=2, cp_rank=1)
    assert p.input_ids.tolist() == [[4, 5, 6, 7, 8, 9, 10, 11], [20, 21, 22, 23, 24, 25, 26, 27]]
    assert p.position_ids.tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]] * 2 and p.cu_seqlens is None
    with pytest.raises(ValueError, match="multiple of 2\\*cp_size = 4; the row length is 14"):
        split_batch_for_cp_rank(ids[:, :14], cp_size=2, cp_rank=0)
    cu = torch.tensor([0, 8, 14], dtype=torch.int32)
    with pytest.raises(ValueError, match="sequence 1's length is 6"):
        split_batch_for_cp_rank(torch.arange(14), cu_seqlens=cu, cp_size=2, cp_rank=0)
    with pytest.raises(ValueError, match="cp_rank"):
        split_batch_for_cp_rank(ids, cp_size=2, cp_rank=2)
    with pytest.raises(ValueError, match="labels"):
        split_batch_for_cp_rank(ids, ids[:, :8], cp_size=2, cp_rank=0)


def test_pad_thd_sequences_for_cp():
    cu = torch.tensor([0, 5, 8, 8, 16], dtype=torch.int32)
    ids = torch.arange(16) + 1
    out_ids, out_labels, out_cu = pad_thd_sequences_for_cp(ids, ids + 100, cu, cp_size=2)
    assert out_cu.tolist() == [0, 8, 12, 12, 20] and out_cu.dtype == torch.int32
    assert out_ids.tolist() == [1, 2, 3, 4, 5, 0, 0, 0, 6, 7, 8, 0, 9, 10, 11, 12, 13, 14, 15, 16]
    assert out_labels.tolist()[5:8] == [-100] * 3 and out_labels.tolist()[:5] == [101, 102, 103, 104, 105]
    # the padded batch splits
    split_batch_for_cp_rank(out_ids, out_labels, None, out_cu, cp_size=2, cp_rank=1)


@pytest.mark.parametrize("cp", [2, 4])
def test_freqs_for_cp_rank_rotates_like_the_full_sequence(cp):
    """Rotating a rank's tokens with freqs_for_cp_rank's rows equals the
    rank's rows of the full sequence rotated (bshd, and thd through the sbhd
    view of the packed tokens)."""
    from seqfuse.modules.rope import RotaryPositionEmbedding, apply_rotary_pos_emb
    from seqfuse.distributed import freqs_for_cp_rank

    s = 4 * cp
    freqs = RotaryPositionEmbedding(DIM)(s)
    x = torch.randn(2, s, HEADS, DIM)
    full = apply_rotary_pos_emb(x, freqs, "bshd")
    lens = [2 * cp, 0, 4 * cp]
    cu = torch.tensor([0] + list(torch.cumsum(torch.tensor(lens), 0)), dtype=torch.int32)
    xt = torch.randn(sum(lens), HEADS, DIM)
    full_t = apply_rotary_pos_emb(xt, freqs, "thd", cu_seqlens=cu)
    for r in range(cp):
        idx = local_token_index(torch.tensor([s]), cp, r)
        got = apply_rotary_pos_emb(x.index_select(1, idx), freqs_for_cp_rank(freqs, cp, r), "bshd")
        assert torch.allclose(got, full.index_select(1, idx), rtol=1e-6, atol=1e-6)
        # a model's table is often longer than the sequence: seq_len names the full length
        longer = RotaryPositionEmbedding(DIM)(s + 5)
        got = apply_rotary_pos_emb(x.index_select(1, idx), freqs_for_cp_rank(longer, cp, r, seq_len=s), "bshd")
        assert torch.allclose(got, full.index_select(1, idx), rtol=1e-6, atol=1e-6)
        idx_t = local_token_index(torch.tensor(lens), cp, r)
        local = freqs_for_cp_rank(freqs, cp, r, cu)
        got_t = apply_rotary_pos_emb(xt.index_select(0, idx_t).unsqueeze(1), local, "sbhd").squeeze(1)
        assert torch.allclose(got_t, full_t.index_select(0, idx_t), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="multiple of 2\\*cp_size"):
        freqs_for_cp_rank(freqs[:s - 1], cp, 0)
    with pytest.raises(ValueError, match="at most the table's"):
        freqs_for_cp_rank(freqs, cp, 0, seq_len=2 * s)


def test_merge_partial_is_exact_and_skips_rows_without_keys():
    """Attention over two disjoint key sets merged with their lse equals
    attention over all keys; a part where a row sees no key (lse +inf, the
    kernel's convention) weighs nothing."""
    from seqfuse.distributed import merge_partial

    q = torch.randn(2, 6, HEADS, DIM)
    k = torch.randn(2, 10, HEADS, DIM)
    v = torch.randn(2, 10, HEADS, DIM)
    full, full_lse = ops.attention_forward(q, k, v)
    out_a, lse_a = ops.attention_forward(q, k[:, :3], v[:, :3])
    out_b, lse_b = ops.attention_forward(q, k[:, 3:], v[:, 3:])
    acc, acc_lse = out_a.clone(), lse_a.clone()
    merge_partial(acc, acc_lse, out_b, lse_b, "bshd")
    assert rel_error(acc, full) <= REL_TOL[torch.float32] and rel_error(acc_lse, full_lse) <= REL_TOL[torch.float32]
    # thd: the second part's first sequence has no keys -> lse +inf there
    cu_q = torch.tensor([0, 4, 6], dtype=torch.int32)
    qt, kt, vt = q[0], k[0], v[0]
    ref, ref_lse = ops.attention_forward(qt, kt, vt, qkv_format="thd", attn_mask_type="padding", cu_seqlens_q=cu_q,
                                     cu_seqlens_kv=torch.tensor([0, 7, 10], dtype=torch.int32))
    # part A: sequence 0 gets all its 7 keys, sequence 1 its first key; part B: sequence 1's other 2 keys
    a, la = ops.attention_forward(qt, torch.cat([kt[:7], kt[7:8]]), torch.cat([vt[:7], vt[7:8]]), qkv_format="thd",
                              attn_mask_type="padding", cu_seqlens_q=cu_q,
                              cu_seqlens_kv=torch.tensor([0, 7, 8], dtype=torch.int32))
    b, lb = ops.attention_forward(qt, kt[8:], vt[8:], qkv_format="thd", attn_mask_type="padding", cu_seqlens_q=cu_q,
                              cu_seqlens_kv=torch.tensor([0, 0, 2], dtype=torch.int32))
    assert torch.isposinf(lb[:, :4]).all()  # the convention this merge relies on
    merge_partial(a, la, b, lb, "thd")
    assert rel_error(a, ref) <= REL_TOL[torch.float32] and rel_error(la, ref_lse) <= REL_TOL[torch.float32]
