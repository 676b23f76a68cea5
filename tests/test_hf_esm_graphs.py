"""SeqfuseEsmModel.graph_layers: the encoder layers captured as CUDA graphs
for one fixed unpadded batch shape.  The checks: the preconditions refuse
with the argument and the rule (CPU), and on CUDA the graphed model gives
the eager model's losses and gradients over several training steps with
optimizer updates in between (bf16 and FP8 delayed, whose amax history and
scale update run inside the graphs), calls of another shape or with
padding run eagerly and say so once, and a recipe other than the captured
one is refused."""
import copy
import logging

import pytest
import torch

from seqfuse.common.recipe import DelayedScaling, Float8CurrentScaling
from seqfuse.hf import SeqfuseEsmConfig, SeqfuseEsmForMaskedLM
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
    model = SeqfuseEsmForMaskedLM(small_config(hidden_dropout_prob=0.1))
    if torch.cuda.is_available():
        model = model.cuda()
        with pytest.raises(ValueError, match="dropout must be 0 to graph the layers"):
            model.esm.graph_layers(2, 64)


def real_batch(b, s, seed):
    """Protein tokens (the ESM vocabulary's amino-acid ids 4..23) with 15 %
    masked-LM labels: the graphs do not care about the data's source, the
    loss only needs a stable masked-LM objective."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 24, (b, s), generator=g)
    labels = torch.full((b, s), -100)
    pick = torch.rand((b, s), generator=g) < 0.15
    labels[pick] = ids[pick]
    ids[pick] = 32
    return ids.cuda(), labels.cuda()


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
