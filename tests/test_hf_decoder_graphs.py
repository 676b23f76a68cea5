"""graph_layers of the decoder families (llama.DecoderStack: Llama, Mixtral)
and the replay rules they share with ESM-2 (hf/layer_graphs.py).

CPU: the replay decision (shape, training, the caller's layout reasons, a
recipe other than the captured one) and the CUDA precondition.  CUDA: a
graphed Mixtral (the experts on the device-split route, bf16 and FP8
current scaling E4M3) and a graphed Llama train as their eager copies over
several optimizer steps on real DNA (the Llama 3 recipe's committed lambda
phage windows); under FP8 delayed scaling, whose experts' backward reads
the routing counts on the host, the layers' attention blocks are graphed
and the experts run eagerly (experts="graphed" refuses with that reason),
and train as the eager model; calls of another shape run eagerly and say so
once.  CPU: a Mixtral layer equals its attention block followed by the rest
(the split the attention-only graphs replay), bit for bit."""
import copy
import logging
from pathlib import Path

import pytest
import torch

from seqfuse.common.recipe import DelayedScaling, Float8CurrentScaling, Format
from seqfuse.data import NucleotideTokenizer, read_parquet
from seqfuse.hf import SeqfuseLlamaConfig, SeqfuseLlamaForCausalLM, SeqfuseMixtralConfig, SeqfuseMixtralForCausalLM
from seqfuse.hf.layer_graphs import LayerGraphs
import seqfuse.pytorch as te

from helpers import assert_replays_only_plain_calls, assert_same_training, train_steps

SUBSET = Path(__file__).resolve().parents[1] / "recipes" / "llama3" / "data" / "subset"
E4M3 = Float8CurrentScaling(fp8_format=Format.E4M3)


def mixtral(**kw):
    base = dict(vocab_size=16, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=512,
                output_router_logits=True, router_aux_loss_coef=0.02, pad_token_id=0)
    base.update(kw)
    return SeqfuseMixtralForCausalLM(SeqfuseMixtralConfig(**base))


def llama():
    return SeqfuseLlamaForCausalLM(SeqfuseLlamaConfig(
        vocab_size=16, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=256, max_position_embeddings=512, pad_token_id=0))


def dna_batches(n, b, s):
    """n batches [b, s] of consecutive pieces of the committed phage windows."""
    tok = NucleotideTokenizer()
    ids = torch.cat([tok.encode(r.sequence, add_special_tokens=False)
                     for r in read_parquet(SUBSET / "train.parquet")])
    assert ids.numel() >= n * b * s
    return [ids[i * b * s:(i + 1) * b * s].view(b, s).cuda() for i in range(n)]


# ---- the replay decision (CPU) ---------------------------------------------------------

def test_layer_graphs_replay_rules(caplog):
    g = LayerGraphs("Owner")
    assert g.for_call(True, (2, 8)) is None  # nothing captured
    layers = (lambda x: x,)
    g.set((2, 8), None, layers)
    assert g.for_call(True, torch.Size([2, 8])) == layers
    with caplog.at_level(logging.WARNING):
        assert g.for_call(True, (3, 8)) is None
        assert g.for_call(True, (3, 8)) is None
        assert g.for_call(False, (2, 8)) is None
        assert g.for_call(True, (2, 8), "packed (thd) call") is None
    text = [r.getMessage() for r in caplog.records]
    assert text == ["Owner: graphed layers not used, layers run eagerly: input_ids (3, 8), graphed for (2, 8)",
                    "Owner: graphed layers not used, layers run eagerly: not training (eval mode or no grad)",
                    "Owner: graphed layers not used, layers run eagerly: packed (thd) call"]
    with te.autocast(enabled=True, recipe=E4M3):
        with pytest.raises(ValueError, match="graphed with fp8_recipe=None but this call runs under"):
            g.for_call(True, (2, 8))
    # another setting of the same recipe type is another recipe (the graphs hold E4M3's routes)
    g.set((2, 8), E4M3, layers)
    with te.autocast(enabled=True, recipe=Float8CurrentScaling(fp8_format=Format.E4M3)):
        assert g.for_call(True, (2, 8)) == layers
    with te.autocast(enabled=True, recipe=Float8CurrentScaling()):
        with pytest.raises(ValueError, match="graphed with fp8_recipe=Float8CurrentScaling"):
            g.for_call(True, (2, 8))
    # a cause that costs a host read is asked last, and only when nothing else applies
    asked = []
    assert g.for_call(False, (2, 8), None, lambda: asked.append(1) or "late") is None
    assert asked == []


def test_layer_graphs_replay_only_under_the_captured_autocast(caplog, monkeypatch):
    """Graphs captured with torch's CUDA autocast off replay the capture's
    precision: a call with it on runs eagerly and says why (and the
    reverse); the setting is read at set(), right after the capture."""
    autocast = [False]
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda device_type=None: autocast[0])
    g = LayerGraphs("Owner")
    layers = (lambda x: x,)
    g.set((2, 8), None, layers)
    autocast[0] = True
    with caplog.at_level(logging.WARNING):
        assert g.for_call(True, (2, 8)) is None
    assert "torch autocast on, graphed with it off" in caplog.text
    g.set((2, 8), None, layers)  # captured under autocast
    assert g.for_call(True, (2, 8)) == layers
    autocast[0] = False
    with caplog.at_level(logging.WARNING):
        assert g.for_call(True, (2, 8)) is None
    assert "torch autocast off, graphed with it on" in caplog.text


class StandIn:
    """A graphed layer stood in for on the CPU: counts its replays, returns
    x (with a router-logits extra for Mixtral's layers)."""

    def __init__(self, extra=False):
        self.calls, self.extra = 0, extra

    def __call__(self, x, freqs):
        self.calls += 1
        return (x, x.new_zeros(x.shape[0] * x.shape[1], 4)) if self.extra else x


@pytest.mark.parametrize("make", [llama, mixtral], ids=["llama", "mixtral"])
def test_decoder_replays_only_the_calls_it_can(make, caplog):
    """run_layers replays the graphed layers for a plain or all-ones-mask
    call of the captured shape in training, and runs the layers eagerly,
    saying why once, for a padded, packed, hidden-states or other-shape
    call (the graphs stood in for: this runs on the CPU)."""
    m = make().train()
    layers = tuple(StandIn(extra=isinstance(m, SeqfuseMixtralForCausalLM)) for _ in range(2))
    m.model._layer_graphs.set((2, 8), None, layers)
    assert_replays_only_plain_calls(m, lambda: layers[0].calls, caplog, lambda ids: ids.reshape(1, 16))
    assert layers[0].calls == 2


def test_check_graphable_rules(monkeypatch):
    """Every precondition, each named (the CUDA one stood in for: these run on the CPU)."""
    from seqfuse.hf.layer_graphs import check_graphable

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    ok = dict(on_cuda=True, dropout=None, checkpointing=False, training=True, batch_size=2, seq_len=8)
    check_graphable("M", **ok)
    for change, words in ((dict(on_cuda=False), "CUDA graphs need the model on a CUDA device"),
                          (dict(dropout="attention_dropout=0.1"), "dropout must be 0 .*attention_dropout=0.1"),
                          (dict(checkpointing=True), "activation checkpointing is on"),
                          (dict(batch_size=0), "argument 'batch_size' must be a positive int, got 0"),
                          (dict(seq_len=True), "argument 'seq_len' must be a positive int, got True"),
                          (dict(training=False), "call it in training mode")):
        with pytest.raises((RuntimeError, ValueError), match="M.graph_layers: " + words):
            check_graphable("M", **{**ok, **change})


def test_graph_layers_experts_argument():
    """``experts`` is one of three words, and "eager" needs experts."""
    with pytest.raises(ValueError, match="argument 'experts' must be 'auto', 'graphed' or 'eager', got 'none'"):
        mixtral().train().model.graph_layers(2, 64, experts="none")
    with pytest.raises(ValueError, match="experts='eager' graphs the attention blocks of mixture-of-experts "
                                         "layers; this model has none"):
        llama().train().model.graph_layers(2, 64, experts="eager")


def test_graph_layers_split_needs_the_layers_split_methods(monkeypatch):
    """experts='eager' on a stack whose layers cannot be split (experts inside a TransformerLayer, which has
    no attention_block / after_attention) is a ValueError naming the argument, before any capture (the
    CUDA precondition stood in for: this runs on the CPU)."""
    import seqfuse.hf.llama as llama_mod
    from seqfuse.modules import GroupedMLP

    monkeypatch.setattr(llama_mod, "check_graphable", lambda *a, **k: None)
    monkeypatch.setattr(llama_mod, "make_graphed_callables", lambda *a, **k: pytest.fail("captured"))
    m = llama().train()
    m.model.layers[0].experts = GroupedMLP(128, 64, 4, 2)
    with pytest.raises(ValueError, match="experts='eager' graphs each layer's attention block alone, which needs "
                                         "layers with attention_block and after_attention .* TransformerLayer"):
        m.model.graph_layers(2, 64, experts="eager")


def test_mixtral_layer_is_its_attention_block_then_the_rest():
    """A Mixtral layer called whole equals its attention block (what
    graph_layers captures where the experts cannot be) followed by
    after_attention (what then runs eagerly), output, router logits and
    gradients, bit for bit: the graphed form computes the same thing."""
    from seqfuse.hf.llama import _AttentionGraphedLayer, _BshdAttentionBlock

    torch.manual_seed(0)
    m = mixtral().train()
    layer = m.model.layers[0]
    freqs = m.model.rotary_emb(64)
    x = torch.randn(2, 64, 128, requires_grad=True)
    y, logits = layer(x, rotary_pos_emb=freqs, self_attn_mask_type="causal", qkv_format="bshd")
    (y.float().square().sum() + logits.sum()).backward()
    want = [x.grad] + [p.grad for p in layer.parameters()]
    layer.zero_grad(set_to_none=True)
    x2 = x.detach().clone().requires_grad_(True)
    block = _BshdAttentionBlock(layer)
    # what the capture differentiates: the attention block's parameters alone (unused ones would fail it)
    assert {id(p) for p in block.parameters()} == {id(p) for p in layer.self_attention.parameters()}
    y2, logits2 = _AttentionGraphedLayer(block, layer)(x2, freqs)
    (y2.float().square().sum() + logits2.sum()).backward()
    assert torch.equal(y, y2) and torch.equal(logits, logits2)
    for a, b in zip(want, [x2.grad] + [p.grad for p in layer.parameters()]):
        assert torch.equal(a, b)


def test_grouped_mlp_capture_refusal():
    """Why a GroupedMLP cannot be captured: under DelayedScaling its
    backward's host read, whatever else holds; otherwise the device-split
    route's own refusal (here: the CPU)."""
    from seqfuse.modules import GroupedMLP

    moe = GroupedMLP(64, 64, 4, 2)
    x = torch.randn(8, 64)
    forward = moe.device_split_refusal(x, DelayedScaling())  # (on the CPU the forward reads them too)
    assert forward is not None
    assert moe.capture_refusal(x, DelayedScaling()) == ("under DelayedScaling the experts' backward reads the "
                                                        f"routing counts on the host; the forward also reads "
                                                        f"them: {forward}")
    with te.autocast(enabled=True, recipe=DelayedScaling()):
        assert "backward reads the routing counts" in moe.capture_refusal(x)
    assert moe.capture_refusal(x, None) == moe.device_split_refusal(x, None) is not None


def test_mixtral_layer_folds_its_residuals():
    """The Mixtral layer adds its residuals inside other kernels (the
    attention's in the projection's epilogue and the QKV norm's backward,
    the experts' gradient in the RMSNorm's backward): its output and
    gradients equal the plain composition h + attn(h), x + moe(norm(x))
    with autograd's adds, float32 on the CPU, within rounding."""
    torch.manual_seed(1)
    m = mixtral().train()
    layer = m.model.layers[1]
    freqs = m.model.rotary_emb(64)
    x = torch.randn(2, 64, 128, requires_grad=True)
    kw = dict(rotary_pos_emb=freqs, attn_mask_type="causal", qkv_format="bshd")

    def plain(h):
        h = h + layer.self_attention(h, **kw)
        y = h + layer.mlp(layer.pre_mlp_layernorm(h))
        logits, layer.mlp.router_logits = layer.mlp.router_logits, None
        return y, logits

    outs, grads = [], []
    for run in (plain, lambda h: layer(h, rotary_pos_emb=freqs, self_attn_mask_type="causal", qkv_format="bshd")):
        layer.zero_grad(set_to_none=True)
        xi = x.detach().clone().requires_grad_(True)
        y, logits = run(xi)
        (y.square().sum() + logits.sum()).backward()
        outs.append((y, logits))
        grads.append([xi.grad] + [p.grad for p in layer.parameters()])
    for a, b in zip(outs[0], outs[1]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only refusal")
def test_graph_layers_needs_cuda():
    for model in (mixtral(), llama()):
        with pytest.raises(RuntimeError, match="graph_layers: CUDA graphs need the model on a CUDA device"):
            model.model.graph_layers(2, 64)


# ---- CUDA ----------------------------------------------------------------------------

def train(model, batches, recipe):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return train_steps(model, opt, [dict(input_ids=ids, labels=ids) for ids in batches], recipe)


def assert_trains_as_eager(make, recipe, caplog, experts_graphed=True):
    torch.manual_seed(0)
    eager = make().cuda().to(torch.bfloat16).train()
    graphed = copy.deepcopy(eager)
    graphed.model.graph_layers(2, 256, fp8_recipe=recipe)
    batches = dna_batches(4, 2, 256)
    le, ge = train(eager, batches, recipe)
    experts = [m for m in graphed.modules() if hasattr(m, "fp8_device_weight_casts")]
    casts = [m.fp8_device_weight_casts for m in experts]
    calls = []  # the layers' attention modules called in Python (eagerly), not replayed
    for layer in graphed.model.layers:
        attention = getattr(layer, "self_attention", None)
        if attention is not None:
            attention.register_forward_pre_hook(lambda *_: calls.append(1))
    with caplog.at_level(logging.WARNING):
        lg, gg = train(graphed, batches, recipe)
    # the graphs replayed: no eager fallback was said, and (whole layers graphed) no expert layer's
    # forward ran in Python
    assert "graphed layers not used" not in caplog.text
    if experts_graphed:
        assert [m.fp8_device_weight_casts for m in experts] == casts
        assert not calls
    assert_same_training((le, ge), (lg, gg))
    return len(calls)


@pytest.mark.cuda
@pytest.mark.parametrize("recipe", [None, E4M3], ids=["bf16", "fp8_current_e4m3"])
def test_cuda_graphed_mixtral_trains_as_eager(recipe, caplog):
    assert_trains_as_eager(mixtral, recipe, caplog)


@pytest.mark.cuda
def test_cuda_graphed_attention_blocks_mixtral_delayed_trains_as_eager(caplog):
    """Under DelayedScaling the experts' backward reads the routing counts
    on the host: graph_layers (experts="auto") captures each layer's
    attention block, says so with the reason, and the experts run eagerly
    between the replays; training equals the eager model's."""
    with caplog.at_level(logging.WARNING, logger="seqfuse"):
        eager_calls = assert_trains_as_eager(mixtral, DelayedScaling(), caplog, experts_graphed=False)
    # the attention blocks ran in Python only until their FP8 tensors had a history, then replayed
    assert 0 < eager_calls < 4 * 2, eager_calls
    assert ("each layer's attention block is graphed and its experts run eagerly: the routing counts are read "
            "to the host at every step, which a CUDA graph cannot hold: under DelayedScaling the experts' "
            "backward reads the routing counts on the host") in caplog.text


@pytest.mark.cuda
def test_cuda_graphed_llama_trains_as_eager(caplog):
    assert_trains_as_eager(llama, None, caplog)


@pytest.mark.cuda
def test_cuda_graph_layers_refuses_host_reads_and_other_shapes_run_eagerly(caplog):
    model = mixtral().cuda().to(torch.bfloat16).train()
    with pytest.raises(ValueError, match="routing counts would be read to the host.*DelayedScaling"):
        model.model.graph_layers(2, 256, fp8_recipe=DelayedScaling(), experts="graphed")
    with pytest.raises(ValueError, match="dropout must be 0"):
        mixtral(attention_dropout=0.1).cuda().train().model.graph_layers(2, 256)
    ref = copy.deepcopy(model)
    model.model.graph_layers(2, 256)
    ids = dna_batches(1, 3, 128)[0]
    with caplog.at_level(logging.WARNING, logger="seqfuse"):
        out = model(input_ids=ids, labels=ids).loss
        model(input_ids=ids, labels=ids)
    assert sum("graphed layers not used" in r.getMessage() for r in caplog.records) == 1
    assert "input_ids (3, 128), graphed for (2, 256)" in caplog.text
    assert torch.equal(out, ref(input_ids=ids, labels=ids).loss)
