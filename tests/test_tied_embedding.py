"""The tied input embedding's gradient added into the LM head's
(seqfuse.ops.embedding_backward_add, seqfuse.modules.embedding,
linear_cross_entropy's tied_embedding, and accelerate()'s fused loss on a
model whose embedding and head share their weight): the op against float64
on fresh inputs (a 1,000-token vocabulary and a DNA-sized one of 16, where
every index repeats hundreds of times), CUDA's bits against the CPU's, the
shared weight's gradient against autograd's own sum, what is refused, and
the fallbacks with their log lines."""
import copy
import logging

import pytest
import torch

import seqfuse.ops as ops
from seqfuse.modules import TiedGradient, linear_cross_entropy, tied_embedding
from helpers import rel_error

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
EPS = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def _inputs(device, dtype, n=(3, 100), h=40, v=1000, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, v, n, generator=g)
    dy = torch.randn(*n, h, generator=g).to(dtype)
    w = torch.randn(v, h, generator=g).to(dtype)
    return ids.to(device), dy.to(device), w.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("v,padding_idx", [(1000, None), (16, None), (16, 3), (1000, -1)])
def test_op_against_float64(device, dtype, v, padding_idx):
    ids, dy, w = _inputs(device, dtype, v=v)
    before = w.clone()
    ref = w.double().cpu()
    flat_ids, rows = ids.reshape(-1).cpu(), dy.reshape(-1, dy.shape[-1]).double().cpu()
    pad = None if padding_idx is None else padding_idx % v
    keep = flat_ids != pad if pad is not None else torch.ones_like(flat_ids, dtype=torch.bool)
    ref.index_add_(0, flat_ids[keep], rows[keep])
    absum = w.double().cpu().abs().index_add_(0, flat_ids[keep], rows[keep].abs())
    run = torch.bincount(flat_ids, minlength=v).max().item()
    out = ops.embedding_backward_add(dy, ids, w, padding_idx=padding_idx)
    assert out is w
    err = (w.double().cpu() - ref).abs()
    # one rounding to the dtype, after a float32 sum of the run's rows
    tol = EPS[dtype] * ref.abs() + (run + 1) * 2.0 ** -24 * absum
    assert (err <= tol).all(), (err - tol).max()
    named = torch.zeros(v, dtype=torch.bool)
    named[flat_ids[keep]] = True
    assert torch.equal(w[~named.to(device)], before[~named.to(device)])  # rows no index names: their bytes


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("v", [16, 128256])
def test_cuda_equals_cpu_bits(dtype, v):
    ids, dy, w = _inputs("cpu", dtype, n=(2, 2048), h=256, v=v, seed=3)
    got = ops.embedding_backward_add(dy.cuda(), ids.cuda(), w.cuda())
    want = ops.embedding_backward_add(dy, ids, w.clone())
    assert torch.equal(got.cpu(), want)


def test_op_refuses_bad_arguments():
    ids, dy, w = _inputs("cpu", torch.float32, v=50)
    with pytest.raises(ValueError, match="'ids'.*outside"):
        ops.embedding_backward_add(dy, ids.masked_fill(ids == ids[0, 0], 50), w)
    with pytest.raises(ValueError, match="'ids'.*outside"):
        ops.embedding_backward_add(dy, ids.masked_fill(ids == ids[0, 0], -1), w)
    with pytest.raises(TypeError, match="'dweight' must have dtype"):
        ops.embedding_backward_add(dy, ids, w.bfloat16())
    with pytest.raises(ValueError, match="'dy' must have shape"):
        ops.embedding_backward_add(dy[:, :5], ids, w)
    with pytest.raises(ValueError, match="same width"):
        ops.embedding_backward_add(dy, ids, w[:, :10].contiguous())
    with pytest.raises(ValueError, match="'padding_idx'"):
        ops.embedding_backward_add(dy, ids, w, padding_idx=50)
    with pytest.raises(TypeError, match="'ids'"):
        ops.embedding_backward_add(dy, ids.float(), w)


def _tied_step(device, dtype, linked, scale=1.0, seed=0, v=61, h=32):
    g = torch.Generator().manual_seed(seed)
    w = torch.nn.Parameter((torch.randn(v, h, generator=g) * 0.5).to(device, dtype))
    ids = torch.randint(0, v, (2, 37), generator=g).to(device)
    labels = torch.randint(0, v, (74,), generator=g).to(device)
    link = TiedGradient(w) if linked else None
    x = tied_embedding(ids, w, link) if linked else torch.nn.functional.embedding(ids, w)
    hidden = torch.tanh(x * 1.5).reshape(-1, h)  # (a layer between the lookup and the head)
    loss = linear_cross_entropy(hidden, w, labels, tied_embedding=link)
    (loss * scale).backward()
    return w.grad, loss


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 3.0])
def test_tied_gradient_equals_autograds_sum(device, dtype, scale):
    got, loss = _tied_step(device, dtype, True, scale)
    want, loss2 = _tied_step(device, dtype, False, scale)
    assert torch.equal(loss, loss2)
    # the same sum; the linked one rounds once where autograd rounds the embedding's part, then the sum
    assert rel_error(got, want) <= (1e-6 if dtype == torch.float32 else 2 * EPS[dtype])
    # and both against float64
    g = torch.Generator().manual_seed(0)
    w64 = torch.nn.Parameter((torch.randn(61, 32, generator=g) * 0.5).to(dtype).double())
    ids = torch.randint(0, 61, (2, 37), generator=g)
    labels = torch.randint(0, 61, (74,), generator=g)
    hidden = torch.tanh(torch.nn.functional.embedding(ids, w64) * 1.5).reshape(-1, 32)
    (torch.nn.functional.cross_entropy(hidden @ w64.T, labels) * scale).backward()
    assert rel_error(got, w64.grad) <= (1e-5 if dtype == torch.float32 else 4 * EPS[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["two_forwards", "penalty", "lookup_used_twice", "accumulate"])
def test_other_gradients_of_the_weight_add_up(device, case):
    """The shared weight's gradient from more than the pair: two forwards
    summed before one backward, a penalty on the weight, the lookup's
    output feeding a second term, and two backwards accumulating into
    .grad; the same as autograd's own sum without the link."""
    def run(linked):
        g = torch.Generator().manual_seed(5)
        w = torch.nn.Parameter((torch.randn(40, 16, generator=g) * 0.5).to(device))
        total = 0
        for k in range(2 if case in ("two_forwards", "accumulate") else 1):
            ids = torch.randint(0, 40, (2, 9), generator=g).to(device)
            labels = torch.randint(0, 40, (18,), generator=g).to(device)
            link = TiedGradient(w) if linked else None
            x = tied_embedding(ids, w, link) if linked else torch.nn.functional.embedding(ids, w)
            loss = linear_cross_entropy(torch.tanh(x).reshape(-1, 16), w, labels, tied_embedding=link)
            if case == "penalty":
                loss = loss + 1e-2 * w.pow(2).sum()
            if case == "lookup_used_twice":  # (the lookup's output also feeds a second term)
                loss = loss + (x.sum((0, 1)) * torch.arange(16.0, device=device)).sum()
            if case == "accumulate":
                loss.backward()
            else:
                total = total + loss
        if case != "accumulate":
            total.backward()
        return w.grad

    assert rel_error(run(True), run(False)) <= 1e-6


def test_expanded_gradient_rows_are_copied():
    ids, _, w = _inputs("cpu", torch.float32, n=(3, 5), h=8, v=20)
    dy = torch.randn(8).expand(3, 5, 8)  # (strides 0, 0, 1: overlapping rows)
    want = w.double().index_add_(0, ids.reshape(-1), dy.reshape(-1, 8).double())
    assert rel_error(ops.embedding_backward_add(dy, ids, w), want) <= 1e-6


def test_a_loss_whose_backward_runs_after_the_lookups_returns_its_own_gradient():
    """A loss that does not depend on the lookup (its backward may run after
    the lookup's) and a lookup under no_grad: the loss keeps its gradient."""
    g = torch.Generator().manual_seed(2)
    w = torch.nn.Parameter(torch.randn(30, 8, generator=g))
    h = torch.randn(6, 8, generator=g, requires_grad=True)
    labels = torch.randint(0, 30, (6,), generator=g)
    ids = torch.randint(0, 30, (2, 3), generator=g)
    for lookup_grad, loss_first in ((True, False), (True, True), (False, False)):
        w.grad = None
        link = TiedGradient(w)
        if loss_first:  # (then the lookup's backward runs first)
            loss = linear_cross_entropy(h, w, labels, tied_embedding=link)
        with torch.set_grad_enabled(lookup_grad):
            x = tied_embedding(ids, w, link)
        if not loss_first:
            loss = linear_cross_entropy(h, w, labels, tied_embedding=link)
        total = loss + (x.sum() if lookup_grad else 0)
        total.backward()
        w2 = torch.nn.Parameter(w.detach().clone())
        want = linear_cross_entropy(h.detach(), w2, labels) + \
            (torch.nn.functional.embedding(ids, w2).sum() if lookup_grad else 0)
        want.backward()
        assert rel_error(w.grad, w2.grad) <= 1e-6, (lookup_grad, loss_first)


def test_an_offer_not_taken_is_dropped_with_a_warning(caplog):
    """autograd.grad of the loss for the hidden states alone: the lookup's
    backward does not run; the offer is dropped at the backward's end, and a
    later backward of the lookup alone adds no head gradient."""
    import seqfuse.modules.embedding as E

    monkey = E._warned_untaken
    E._warned_untaken = False
    try:
        w = torch.nn.Parameter(torch.randn(30, 8))
        ids = torch.randint(0, 30, (2, 3))
        link = TiedGradient(w)
        x = tied_embedding(ids, w, link)
        hidden = torch.tanh(x).reshape(-1, 8)
        loss = linear_cross_entropy(hidden, w, torch.randint(0, 30, (6,)), tied_embedding=link)
        with caplog.at_level(logging.WARNING, logger="seqfuse"):
            torch.autograd.grad(loss, [hidden])
        assert "was not taken in this backward" in caplog.text
        x.sum().backward()
        w2 = torch.nn.Parameter(w.detach().clone())
        torch.nn.functional.embedding(ids, w2).sum().backward()
        assert torch.equal(w.grad, w2.grad)
    finally:
        E._warned_untaken = monkey


def test_link_serves_one_loss_and_padding_idx_is_checked():
    w = torch.nn.Parameter(torch.randn(30, 8))
    link = TiedGradient(w)
    linear_cross_entropy(torch.randn(4, 8), w, torch.randint(0, 30, (4,)), tied_embedding=link)
    with pytest.raises(ValueError, match="already serves another loss"):
        linear_cross_entropy(torch.randn(4, 8), w, torch.randint(0, 30, (4,)), tied_embedding=link)
    for bad in (30, -31, True, 2.0):  # (past either end; a bool or a float is not an index)
        with pytest.raises(ValueError, match="'padding_idx' must be an int within the 30 rows"):
            tied_embedding(torch.randint(0, 30, (4,)), w, TiedGradient(w), padding_idx=bad)


def test_used_where_the_loss_backward_ran(monkeypatch):
    calls = []
    real = ops.embedding_backward_add
    monkeypatch.setattr(ops, "embedding_backward_add", lambda *a, **k: calls.append(1) or real(*a, **k))
    _tied_step("cpu", torch.float32, True)
    assert calls == [1]


def test_without_the_loss_in_the_backward_falls_back_and_logs(caplog):
    import seqfuse.modules.embedding as E

    monkey = E._logged_alone
    E._logged_alone = False
    try:
        w = torch.nn.Parameter(torch.randn(20, 8))
        ids = torch.randint(0, 20, (3, 5))
        with caplog.at_level(logging.INFO, logger="seqfuse"):
            x = tied_embedding(ids, w, TiedGradient(w), padding_idx=2)
            (x * torch.arange(8.0)).sum().backward()
        assert "handed no head gradient over" in caplog.text
        w2 = torch.nn.Parameter(w.detach().clone())
        (torch.nn.functional.embedding(ids, w2, padding_idx=2) * torch.arange(8.0)).sum().backward()
        assert torch.equal(w.grad, w2.grad)
    finally:
        E._logged_alone = monkey


def test_second_backward_through_the_loss_is_refused():
    w = torch.nn.Parameter(torch.randn(30, 8))
    h = torch.randn(10, 8, requires_grad=True)
    loss = linear_cross_entropy(h, w, torch.randint(0, 30, (10,)))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second time through the same loss"):
        loss.backward()


def test_link_must_name_the_weight():
    w, other = torch.nn.Parameter(torch.randn(30, 8)), torch.nn.Parameter(torch.randn(30, 8))
    with pytest.raises(ValueError, match="'tied_embedding' must link this 'weight'"):
        linear_cross_entropy(torch.randn(4, 8), w, torch.randint(0, 30, (4,)), tied_embedding=TiedGradient(other))
    with pytest.raises(ValueError, match="'link' must be a TiedGradient over this 'weight'"):
        tied_embedding(torch.randint(0, 30, (4,)), w, TiedGradient(other))
    with pytest.raises(ValueError, match="leaf Parameter"):
        TiedGradient(w * 2)


transformers = pytest.importorskip("transformers")


def _tied_llama(**kw):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   pad_token_id=0, tie_word_embeddings=True, **kw)
    return transformers.LlamaForCausalLM(cfg)


def test_accelerate_tied_llama_gradients_and_report(monkeypatch):
    from seqfuse.hf import accelerate
    from helpers import hf_grads_close, padded_lm_batch, rel_tol, train_alongside

    ref = _tied_llama()
    model = copy.deepcopy(ref)
    report = accelerate(model)
    assert model.model.embed_tokens.weight is model.lm_head.weight
    assert "tied input embedding's gradient added into the head's" in str(report)
    calls = []
    real = ops.embedding_backward_add
    monkeypatch.setattr(ops, "embedding_backward_add", lambda *a, **k: calls.append(1) or real(*a, **k))
    ids, mask, labels = padded_lm_batch(96, 1, 2, 13, low=1)
    train_alongside(model, ref, dict(input_ids=ids, attention_mask=mask, labels=labels), 1e-2,
                    rel_tol(torch.float32, 100), lambda m, r: hf_grads_close(m, r, rel_tol(torch.float32, 100)))
    assert calls == [1, 1, 1]  # one per training step


def test_accelerate_tied_under_gradient_checkpointing(monkeypatch):
    """transformers' gradient checkpointing hooks the input embedding
    (make_inputs_require_grads): the tied path stays on, the gradients match."""
    from seqfuse.hf import accelerate

    ref = _tied_llama()
    model = copy.deepcopy(ref)
    accelerate(model)
    for m in (model, ref):
        m.gradient_checkpointing_enable()
        m.train()
    calls = []
    real = ops.embedding_backward_add
    monkeypatch.setattr(ops, "embedding_backward_add", lambda *a, **k: calls.append(1) or real(*a, **k))
    ids = torch.randint(1, 96, (2, 9))
    model(ids, labels=ids).loss.backward()
    ref(ids, labels=ids).loss.backward()
    assert calls == [1]
    assert rel_error(model.lm_head.weight.grad, ref.lm_head.weight.grad) <= 1e-5


def test_accelerate_tied_embedding_refused_with_its_reason(caplog):
    from seqfuse.hf import accelerate
    import seqfuse.hf.fused_loss as FL

    ref = _tied_llama()
    ref.model.embed_tokens.max_norm = 10.0
    model = copy.deepcopy(ref)
    report = accelerate(model)
    assert "looked up by transformers (the input embedding uses max_norm" in str(report)
    FL._tie_logged.clear()
    ids = torch.randint(1, 96, (2, 9))
    with caplog.at_level(logging.INFO, logger="seqfuse"):
        model.train()
        model(ids, labels=ids).loss.backward()
    assert "transformers' own embedding lookup" in caplog.text and "max_norm" in caplog.text
    ref(ids, labels=ids).loss.backward()
    assert rel_error(model.lm_head.weight.grad, ref.lm_head.weight.grad) <= 1e-5
