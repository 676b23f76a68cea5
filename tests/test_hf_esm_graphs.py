"""SeqfuseEsmModel.graph_layers and graph_packed_layers: the encoder layers
captured as CUDA graphs for one fixed unpadded batch shape, or for packed
batches within bounds (padded to them on the device).  The checks: the
preconditions refuse with the argument and the rule (CPU); the packed
layout's padding gives the unpadded call's loss and gradients (CPU, the
layers run uncaptured in the padded form); on CUDA the graphed model gives
the eager model's losses and gradients over several training steps with
optimizer updates in between (bf16 and FP8 delayed, whose amax history and
scale update run inside the graphs), calls of another shape, with padding
or beyond the packed bounds run eagerly and say so once, and a recipe other
than the captured one is refused."""
import copy
import logging

import pytest
import torch

from seqfuse.common.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling
from seqfuse.hf import SeqfuseEsmConfig, SeqfuseEsmForMaskedLM
from seqfuse.hf.esm import _PackedLayer
from seqfuse.hf.layer_graphs import PackedLayout
from seqfuse.optim import FusedAdamW
import seqfuse.pytorch as te

from helpers import assert_replays_only_plain_calls, assert_same_training, train_steps


def small_config(**kw):
    base = dict(vocab_size=33, hidden_size=128, num_hidden_layers=3, num_attention_heads=4, intermediate_size=256,
                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, mask_token_id=32, pad_token_id=1)
    base.update(kw)
    return SeqfuseEsmConfig(**base)


def test_replays_only_the_calls_it_can(caplog):
    """The encoder replays its graphed layers for a plain or all-ones-mask
    call of the captured shape in training, from the forward's one mask
    read, and runs them eagerly, saying why once, for a padded, packed,
    hidden-states or other-shape call (the graphs stood in for by a
    counter: this runs on the CPU)."""
    model = SeqfuseEsmForMaskedLM(small_config()).train()
    calls = []
    model.esm._layer_graphs.set((2, 8), None, [lambda x, freqs: calls.append(1) or x] * 3)
    assert_replays_only_plain_calls(model, lambda: len(calls), caplog, lambda ids: ids.reshape(-1))
    assert len(calls) == 6  # two calls, three layers each


def test_graph_layers_refuses_without_cuda_and_with_dropout():
    model = SeqfuseEsmForMaskedLM(small_config()).train()
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="graph_layers: CUDA graphs need the model on a CUDA device"):
            model.esm.graph_layers(2, 64)
        with pytest.raises(RuntimeError, match="SeqfuseEsmModel.graph_packed_layers: CUDA graphs need the model "
                                               "on a CUDA device"):
            model.esm.graph_packed_layers(256, 8, 64)
    model = SeqfuseEsmForMaskedLM(small_config(hidden_dropout_prob=0.1))
    if torch.cuda.is_available():
        model = model.cuda()
        with pytest.raises(ValueError, match="dropout must be 0 to graph the layers"):
            model.esm.graph_layers(2, 64)
        model = SeqfuseEsmForMaskedLM(small_config()).cuda().train()
        with pytest.raises(ValueError, match="graph_packed_layers: argument 'max_sequences' must be a positive int"):
            model.esm.graph_packed_layers(256, 0, 64)
        with pytest.raises(ValueError, match=r"graph_packed_layers: argument 'max_sequences' \(4\) must be at "
                                             r"least 5"):
            model.esm.graph_packed_layers(256, 4, 64)


def real_batch(b, s, seed, device="cuda"):
    """Protein tokens (the ESM vocabulary's amino-acid ids 4..23) with 15 %
    masked-LM labels: the graphs do not care about the data's source, the
    loss only needs a stable masked-LM objective."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 24, (b, s), generator=g)
    labels = torch.full((b, s), -100)
    pick = torch.rand((b, s), generator=g) < 0.15
    labels[pick] = ids[pick]
    ids[pick] = 32
    return ids.to(device), labels.to(device)


def train(model, batches, recipe):
    opt = FusedAdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    return train_steps(model, opt, [dict(input_ids=ids, labels=labels) for ids, labels in batches], recipe)


@pytest.mark.cuda
@pytest.mark.parametrize("recipe", [None, DelayedScaling()], ids=["bf16", "fp8_delayed"])
def test_cuda_graphed_layers_train_as_eager(recipe):
    torch.manual_seed(0)
    eager = SeqfuseEsmForMaskedLM(small_config()).cuda().to(torch.bfloat16).train()
    graphed = copy.deepcopy(eager)
    graphed.esm.graph_layers(2, 64, fp8_recipe=recipe)
    batches = [real_batch(2, 64, seed) for seed in range(4)]
    le, ge = train(eager, batches, recipe)
    lg, gg = train(graphed, batches, recipe)
    assert_same_training((le, ge), (lg, gg))


@pytest.mark.cuda
def test_cuda_graphed_layers_other_shapes_run_eagerly_and_say_so(caplog):
    torch.manual_seed(0)
    model = SeqfuseEsmForMaskedLM(small_config()).cuda().to(torch.bfloat16).train()
    ref = copy.deepcopy(model)
    model.esm.graph_layers(2, 64)
    ids, labels = real_batch(3, 32, 7)
    with caplog.at_level(logging.WARNING, logger="seqfuse.hf.esm"):
        out = model(input_ids=ids, labels=labels).loss
        model(input_ids=ids, labels=labels)
    assert sum("graphed layers not used" in r.message for r in caplog.records) == 1
    assert "input_ids (3, 32), graphed for (2, 64)" in caplog.text
    assert torch.equal(out, ref(input_ids=ids, labels=labels).loss)
    ids, labels = real_batch(2, 64, 8)
    with pytest.raises(ValueError, match="graphed with fp8_recipe=None but this call runs under"):
        with te.autocast(enabled=True, recipe=Float8CurrentScaling()):
            model(input_ids=ids, labels=labels)


def test_packed_layout_bounds_and_padding():
    """misfit names the bound a call breaks; pad appends zero rows as
    padding sequences of 128 tokens where the sequence bound leaves room,
    else of the fewest tokens that fit (at most max_seqlen), then
    zero-length sequences; the capture's sample has unequal lengths within
    the bounds."""
    layout = PackedLayout("M.graph_packed_layers", 1000, 12, 300)
    assert layout.misfit(1000, 4, 300) is None
    assert layout.misfit(1001, 4, 300) == ("tokens", "packed call of 1001 tokens, graphed for at most 1000")
    assert layout.misfit(900, 4, 301) == ("max_seqlen", "packed call with a sequence of 301 tokens, graphed for "
                                                        "at most max_seqlen 300")
    assert layout.misfit(700, 9, 100) is None  # 300 padding rows: 3 sequences of 128, 12 in all
    assert layout.padding(700, 9) == (3, 128)
    assert layout.padding(700, 10) == (2, 150) and layout.misfit(700, 10, 100) is None
    assert layout.padding(700, 11) == (1, 300) and layout.misfit(700, 11, 100) is None
    assert ("packed call of 12 sequences and 300 padding tokens, which need 1 more sequences of at most "
            "max_seqlen 300: graphed for at most 12 sequences") == layout.misfit(700, 12, 100)[1]
    assert layout.misfit(1000, 12, 300) is None and layout.padding(1000, 12) == (0, 128)
    x = torch.randn(700, 4)
    cu = torch.tensor([0, 100, 350, 700], dtype=torch.int32)
    xp, cup = layout.pad(x, cu)
    assert xp.shape == (1000, 4) and torch.equal(xp[:700], x) and not xp[700:].any()
    assert cup.tolist() == [0, 100, 350, 700, 828, 956, 1000] + [1000] * 6
    cu = torch.tensor([0] + list(range(70, 701, 70)), dtype=torch.int32)  # 10 sequences: padding of 150
    assert layout.pad(x, cu)[1].tolist() == cu.tolist() + [850, 1000]
    full = torch.randn(1000, 2, 4)  # no padding rows, and (below) no room: nothing appended
    cu = torch.tensor([0, 500, 1000], dtype=torch.int32)
    xp, cup = layout.pad(full, cu)
    assert xp.shape == full.shape and torch.equal(xp, full) and cup.tolist() == [0, 500, 1000] + [1000] * 10
    cu12 = torch.arange(0, 1001, 1000 // 12 + 1, dtype=torch.int32)[:12].tolist() + [1000]
    assert layout.pad(full, torch.tensor(cu12, dtype=torch.int32))[1].tolist() == cu12
    assert layout.sequences_wanted(700, 3) == 6 and layout.sequences_wanted(1000, 3) == 3
    big = PackedLayout("t", 1024, 2**24 + 8, 128)  # the ends past the padding would overflow int32
    ends = big.pad(torch.zeros(1000, 1), torch.tensor([0, 1000], dtype=torch.int32))[1]
    assert ends.dtype == torch.int32 and ends[:3].tolist() == [0, 1000, 1024] and int(ends.min()) == 0
    assert int(ends[-1]) == 1024
    with pytest.raises(ValueError, match="PackedLayout.pad: a call of 1001 tokens in 1 sequences"):
        layout.pad(torch.zeros(1001, 4), torch.tensor([0, 1001], dtype=torch.int32))
    with pytest.raises(ValueError, match="a call of 700 tokens in 12 sequences .* does not fit these graphs: "
                                         "packed call of 12 sequences and 300 padding tokens"):  # no room for padding
        layout.pad(torch.zeros(700, 4), torch.tensor([0] + [58 * i for i in range(1, 12)] + [700], dtype=torch.int32))
    lengths = layout.sample_lengths(1000, 300)
    assert sum(lengths) == 1000 and max(lengths) <= 300 and len(set(lengths)) > 1
    assert layout.sample_cu_seqlens("cpu").tolist() == [0, 299, 599, 899, 1000] + [1000] * 8
    assert PackedLayout.min_sequences(1000, 300) == 4 and PackedLayout.min_sequences(100, 300) == 1
    for tokens in range(1, 40):  # the count is the sample's, at every remainder
        for longest in range(1, 12):
            assert PackedLayout.min_sequences(tokens, longest) == len(PackedLayout.sample_lengths(tokens, longest))
    assert PackedLayout.padding_sequences(300, 300) == 1 and PackedLayout.padding_sequences(301, 300) == 2
    most = layout.sequences - PackedLayout.padding_sequences(layout.tokens, layout.max_seqlen)
    assert most == 12 - 4
    for n in range(1, most + 1):  # up to there, any token count fits
        assert all(layout.misfit(t, n, 1) is None for t in (0, 1, 299, 300, 301, 999, 1000))
    assert layout.misfit(0, most + 1, 1)[0] == "sequences"
    with pytest.raises(ValueError, match="not on one device"):  # cu_seqlens and the rows on two devices
        layout.pad(torch.zeros(700, 4), torch.tensor([0, 700], dtype=torch.int32, device="meta"))
    with pytest.raises(ValueError, match="argument 'max_sequences' \\(3\\) must be at least 4"):
        PackedLayout("M.graph_packed_layers", 1000, 3, 300)
    with pytest.raises(ValueError, match="M.graph_packed_layers: argument 'max_seqlen' must be a positive int"):
        PackedLayout("M.graph_packed_layers", 1000, 3, 0)


def packed_batch(lengths, seed, device="cpu"):
    """Protein-token sequences of ``lengths`` packed, 15 % masked-LM labels."""
    ids, labels = real_batch(1, sum(lengths), seed, device)
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return dict(input_ids=ids.reshape(-1), labels=labels.reshape(-1), cu_seqlens=cu.to(ids.device),
                max_seqlen=max(lengths))


def test_packed_padding_gives_the_unpadded_loss_and_gradients():
    """The packed graphs' computation, run uncaptured: every call padded to
    the layout (zero rows, padding and zero-length sequences, the max_seqlen
    bound) gives the eager call's loss and gradients (float32, CPU)."""
    torch.manual_seed(0)
    eager = SeqfuseEsmForMaskedLM(small_config()).train()
    padded = copy.deepcopy(eager)
    layout = PackedLayout("test", 160, 10, 64)
    padded.esm._layer_graphs.set(layout.key(), None, [_PackedLayer(layer, 64) for layer in
                                                     padded.esm.encoder.layers], packed=layout)
    for lengths, seed in (([40, 17, 64, 3], 1), ([64, 64], 2), ([5] * 8, 3)):
        batch = packed_batch(lengths, seed)
        le, ge = train_steps(eager, torch.optim.SGD(eager.parameters(), lr=0), [batch])
        lp, gp = train_steps(padded, torch.optim.SGD(padded.parameters(), lr=0), [batch])
        assert abs(le[0] - lp[0]) <= 1e-5 * abs(le[0])
        for n in ge:
            torch.testing.assert_close(gp[n], ge[n], rtol=1e-4, atol=1e-6, msg=n)


def test_packed_graphs_serve_only_calls_within_bounds(caplog):
    """Packed graphs (stand-ins counting calls) replay for a packed training
    call within the bounds and not for one beyond any bound, a bshd call,
    output_hidden_states or eval, each bound's reason said once whatever
    the call's figures; a call under another FP8 recipe is refused, naming
    graph_packed_layers."""
    model = SeqfuseEsmForMaskedLM(small_config()).train()
    layout = PackedLayout("test", 64, 6, 32)
    seen = []
    model.esm._layer_graphs.set(layout.key(), None, [lambda x, freqs, cu: seen.append(
        (x.shape[0], freqs.shape[0], cu.tolist())) or x] * 3, packed=layout)
    model(**packed_batch([20, 30], 1))
    assert seen == [(64, 32, [0, 20, 50, 64, 64, 64, 64])] * 3
    with caplog.at_level(logging.WARNING):
        model(**packed_batch([40, 30], 2))
        model(**packed_batch([33, 3], 3))
        model(**packed_batch([2] * 6, 4))
        model(**packed_batch([20], 5), output_hidden_states=True)
        model(input_ids=torch.randint(4, 16, (2, 8)))
        model(**packed_batch([41, 30], 6))  # the token bound again, other figures: not logged again
        model.eval()
        model(**packed_batch([20, 30], 1))
        model.train()
    assert len(seen) == 3
    assert sum("graphed for at most 64" in r.getMessage() for r in caplog.records) == 1
    assert "not training" in caplog.text
    with pytest.raises(ValueError, match="call graph_packed_layers again with this recipe"):
        with te.autocast(enabled=True, recipe=Float8CurrentScaling()):
            model(**packed_batch([20, 30], 1))
    said = " | ".join(r.getMessage() for r in caplog.records)
    for reason in ("packed call of 70 tokens, graphed for at most 64", "a sequence of 33 tokens, graphed for at most max_seqlen 32",
                   "packed call of 6 sequences and 52 padding tokens, which need 2 more sequences of at most "
                   "max_seqlen 32: graphed for at most 6 sequences",
                   "output_hidden_states", "input_ids (2, 8), graphed for ('thd', 64, 6, 32)"):
        assert reason in said


@pytest.mark.cuda
@pytest.mark.parametrize("recipe", [None, DelayedScaling(), Float8CurrentScaling(), Float8BlockScaling()],
                         ids=["bf16", "fp8_delayed", "fp8_current", "fp8_block"])
def test_cuda_graphed_packed_layers_train_as_eager(recipe, caplog):
    """Packed batches of other token counts, sequence counts and longest
    lengths replay one set of graphs and train as the eager model does.
    (No batch has sequences of one length: eager runs those as the padded
    batch they are, on cuDNN, another kernel than the graphs' FlashAttention,
    whose rounding FP8's scales carry through the later steps.)"""
    torch.manual_seed(0)
    eager = SeqfuseEsmForMaskedLM(small_config()).cuda().to(torch.bfloat16).train()
    graphed = copy.deepcopy(eager)
    graphed.esm.graph_packed_layers(512, 16, 128, fp8_recipe=recipe)
    batches = [packed_batch(lengths, seed, "cuda") for seed, lengths in enumerate(
        ([128, 100, 77, 128, 64], [33] * 12 + [96], [128] * 3 + [127, 1], [1, 127, 125, 3, 90, 80, 16]))]
    le, ge = train_steps(eager, FusedAdamW([p for p in eager.parameters() if p.requires_grad], lr=1e-3), batches,
                         recipe)
    with caplog.at_level(logging.WARNING):
        lg, gg = train_steps(graphed, FusedAdamW([p for p in graphed.parameters() if p.requires_grad], lr=1e-3),
                             batches, recipe)
    assert "graphed layers not used" not in caplog.text
    # The graphs run the GEMMs on the padded row count (cuBLAS may pick another algorithm) and FP8
    # delayed scaling's amaxes include the padding rows: rounding differences, which FP8's codes and
    # three Adam updates carry to the last step's gradients (measured on an H200: 0.074-0.085 in layer 0's
    # norm weight).  A padding error shows as an O(1) difference from the first loss on.
    assert_same_training((le, ge), (lg, gg), grad_tol=5e-2 if recipe is None else 0.15)
