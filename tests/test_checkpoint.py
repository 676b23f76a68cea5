"""seqfuse.pytorch.checkpoint (activation recomputation under FP8): a
checkpointed module gives bit for bit the outputs and gradients of the same
module run plainly, step after step (so delayed scaling's scales and amax
histories evolve alike: the recompute neither uses the moved-on scales nor
records its amaxes), under every per-tensor and block recipe and in bf16,
with dropout inside; and its refusals."""
import pytest
import torch
from torch import nn

import seqfuse
import seqfuse.pytorch as te
from seqfuse.common.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling
from helpers import needs_fp8

# delayed scaling from the latest amax only, so each step's scales follow that step's amaxes:
# a recompute that used the moved-on scales, or recorded its amaxes into the next step, shows
RECIPES = {"bf16": None, "delayed": DelayedScaling(amax_history_len=1, amax_compute_algo="most_recent"),
           "delayed_max": DelayedScaling(), "current": Float8CurrentScaling(), "block": Float8BlockScaling()}
SCALES = {"growing": (1.0, 2.0, 4.0), "shrinking": (4.0, 2.0, 1.0)}


def steps(make, inputs, recipe, ck):
    torch.manual_seed(0)
    m = make()
    out = []
    for i, x in enumerate(inputs):
        x = x.clone().requires_grad_()
        torch.manual_seed(100 + i)  # the same dropout draws in both runs
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            y = te.checkpoint(m, x) if ck else m(x)
        y.float().pow(2).sum().backward()
        out.append([y.detach(), x.grad] + [p.grad.clone() for p in m.parameters() if p.grad is not None])
        m.zero_grad(set_to_none=True)
    return out


def assert_same(a, b):
    for step_a, step_b in zip(a, b):
        assert len(step_a) == len(step_b)
        for u, v in zip(step_a, step_b):
            assert torch.equal(u, v)


@needs_fp8
@pytest.mark.parametrize("inputs", sorted(SCALES))
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_checkpointed_layernorm_mlp_equals_plain(recipe, inputs):
    torch.manual_seed(1)
    inputs = [torch.randn(64, 128) * c for c in SCALES[inputs]]
    make = lambda: te.LayerNormMLP(128, 256)  # noqa: E731
    assert_same(steps(make, inputs, RECIPES[recipe], False), steps(make, inputs, RECIPES[recipe], True))


@needs_fp8
@pytest.mark.parametrize("recipe", ["bf16", "delayed"])
def test_checkpointed_transformer_layer_with_dropout_equals_plain(recipe):
    inputs = [torch.randn(2, 16, 128) * c for c in SCALES["shrinking"]]  # [b, s, h]

    def make():
        return te.TransformerLayer(128, 256, 4, hidden_dropout=0.1, attention_dropout=0.1,
                                   attn_input_format="bshd", self_attn_mask_type="causal")

    plain, ck = steps(make, inputs, RECIPES[recipe], False), steps(make, inputs, RECIPES[recipe], True)
    assert_same(plain, ck)


@needs_fp8
def test_torch_checkpoint_alone_cannot_recompute_fp8():
    """Why seqfuse has its own: torch's recompute runs after the autocast
    region has exited, so it computes in high precision and torch refuses."""
    m = te.Linear(64, 64)
    x = torch.randn(32, 64, requires_grad=True)
    with te.autocast(enabled=True, recipe=DelayedScaling()):
        y = torch.utils.checkpoint.checkpoint(m, x, use_reentrant=False)
    with pytest.raises(torch.utils.checkpoint.CheckpointError):
        y.sum().backward()


def test_checkpoint_refusals():
    m = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(NotImplementedError, match="use_reentrant=True"):
        te.checkpoint(m, x, use_reentrant=True)
    with pytest.raises(NotImplementedError, match="tensor parallelism"):
        te.checkpoint(m, x, tp_group=object())


@needs_fp8
def test_recompute_that_reads_other_scales_raises():
    """A function whose recompute runs another FP8 module than its forward
    (it depends on more than its inputs) is refused, not recomputed wrongly."""
    a, b = te.Linear(64, 64), te.Linear(64, 64)
    calls = []

    def fn(x):
        calls.append(1)
        return (a if len(calls) == 1 else b)(x)

    x = torch.randn(32, 64, requires_grad=True)
    with te.autocast(enabled=True, recipe=DelayedScaling()):
        y = te.checkpoint(fn, x)
    # (the first thing b's recompute asks that a's forward did not note: its weight-transpose choice)
    with pytest.raises(RuntimeError, match=r"the recompute (made a choice \(weight_transpose\)|read an FP8 "
                                           r"scale) the forward did not"):
        y.sum().backward()


@needs_fp8
def test_autocast_inside_the_function_updates_once_per_step(monkeypatch):
    """A function that opens its own autocast leaves it again in the
    recompute (during the backward, with no autocast around): that exit must
    not run the step's scale update a second time."""
    import sys

    ac = sys.modules["seqfuse.quantization.autocast"]  # the module (the package's name is the function)

    updates = []
    real = ac.reduce_and_update
    monkeypatch.setattr(ac, "reduce_and_update", lambda *a, **k: (updates.append(1), real(*a, **k)))
    m = te.Linear(64, 64)
    recipe = DelayedScaling()

    def fn(x):
        with te.autocast(enabled=True, recipe=recipe):
            h = m(x)
        return h * h  # saved by the autograd graph, so the recompute runs past the autocast exit

    for step in range(2):
        x = torch.randn(32, 64, requires_grad=True)
        y = te.checkpoint(fn, x)
        assert len(updates) == step + 1
        y.sum().backward()
        assert len(updates) == step + 1, "the recompute ran the scale update again"


@needs_fp8
def test_fp8_stats_count_the_forward_casts_only():
    """FP8 statistics (enable_stats) of checkpointed steps equal plain ones:
    the recompute's casts, made after the step ended, are not counted into
    the next step."""
    recipe = DelayedScaling()

    def run(ck):
        torch.manual_seed(0)
        m = te.Linear(64, 64)
        seqfuse.quantization.name_states(m)
        seqfuse.quantization.enable_stats(every=1)
        try:
            for _ in range(3):
                x = torch.randn(32, 64, requires_grad=True)
                with te.autocast(enabled=True, recipe=recipe):
                    y = te.checkpoint(m, x) if ck else m(x)
                y.sum().backward()
            return [(r["step"], r["index"], r["numel"]) for r in seqfuse.quantization.stats_records()]
        finally:
            seqfuse.quantization.disable_stats()

    plain = run(False)
    assert plain and run(True) == plain


@needs_fp8
@pytest.mark.parametrize("recipe", ["bf16", "delayed"])
@pytest.mark.parametrize("packed", [False, True])
def test_esm_activation_checkpointing_equals_plain(recipe, packed):
    """SeqfuseEsmForMaskedLM with activation checkpointing (through
    transformers' gradient_checkpointing_enable name): the same loss and
    gradients, bit for bit, over 3 steps, padded and packed; off in eval."""
    from seqfuse.hf import SeqfuseEsmForMaskedLM, esm2_config

    cfg = esm2_config("8M", num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=4)
    torch.manual_seed(0)
    ids = torch.randint(4, 29, (2, 16))
    cu = torch.tensor([0, 9, 16], dtype=torch.int32)

    def run(ck):
        torch.manual_seed(0)
        m = SeqfuseEsmForMaskedLM(cfg)
        if ck:
            m.gradient_checkpointing_enable()
            assert m.is_gradient_checkpointing
        m.train()
        out = []
        for step in range(3):
            torch.manual_seed(50 + step)
            with te.autocast(enabled=RECIPES[recipe] is not None, recipe=RECIPES[recipe]):
                if packed:
                    loss = m(input_ids=ids[0], labels=ids[0], cu_seqlens=cu, max_seqlen=9).loss
                else:
                    loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            out.append([loss.detach()] + [p.grad.clone() for p in m.parameters() if p.grad is not None])
            m.zero_grad(set_to_none=True)
        return out

    assert_same(run(False), run(True))


def test_esm_activation_checkpointing_refuses_reentrant():
    from seqfuse.hf import SeqfuseEsmForMaskedLM, esm2_config

    m = SeqfuseEsmForMaskedLM(esm2_config("8M", num_hidden_layers=1))
    with pytest.raises(NotImplementedError, match="use_reentrant=True"):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    assert not m.is_gradient_checkpointing
    m.set_activation_checkpointing(True)
    m.gradient_checkpointing_disable()
    assert not m.is_gradient_checkpointing
    for kw in (dict(every_n_layers=2), dict(offload=True)):
        with pytest.raises(NotImplementedError, match="every_n_layers"):
            m.gradient_checkpointing_enable(**kw)
        assert not m.is_gradient_checkpointing
    m.activation_checkpointing_enable({"use_reentrant": False})
    assert m.is_gradient_checkpointing


def test_esm_activation_checkpointing_recomputes_in_training_only(monkeypatch):
    from seqfuse.hf import SeqfuseEsmForMaskedLM, esm2_config
    from seqfuse.hf import esm as esm_mod

    calls = []
    real = esm_mod.checkpoint
    monkeypatch.setattr(esm_mod, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    m = SeqfuseEsmForMaskedLM(esm2_config("8M", num_hidden_layers=3)).train()
    m.set_activation_checkpointing(True)
    ids = torch.randint(4, 29, (2, 8))
    m(input_ids=ids, labels=ids).loss.backward()
    assert len(calls) == 3  # one per layer
    m.eval()
    m(input_ids=ids, labels=ids)
    with torch.no_grad():
        m.train()(input_ids=ids, labels=ids)
    assert len(calls) == 3
