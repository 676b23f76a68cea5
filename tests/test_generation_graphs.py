"""The decode step of seqfuse's cached generation (seqfuse.hf.generation)
and its CUDA graphs.

generate's decode step (``decode_step``) takes every value that changes
between steps from a device tensor, so the same function runs eagerly or is
captured once per batch size as a CUDA graph (``DecodeGraph``) and replayed.
CPU (CI): the step itself against the full forward (Llama, and Mixtral with
its experts in the capture-safe form, ``forward_every_expert``, which must
equal the routed block), the argument checks, the reasons graphs are
refused, the weights' signature that invalidates a graph, the model's kept
caches, the one generate both families share.  CUDA: graphed and eager
decode give the same tokens (greedy and sampled, bf16, Llama and Mixtral,
batch 1 and 4, uneven prompt lengths, padded and packed), a second call
replays the captured graph (counters), in-place weight updates are seen by
replays and moved weights are captured again, FP8 decode stays eager with
its reason logged.
"""
import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")

import seqfuse  # noqa: E402,F401
from helpers import REL_TOL, needs_fp8, rel_error  # noqa: E402
from seqfuse.hf import generation  # noqa: E402
from seqfuse.hf.generation import (CachedGenerate, InferenceParams, decode_graph_stats,  # noqa: E402
                                   decode_step, weights_signature)
from seqfuse.hf.llama import SeqfuseLlamaForCausalLM  # noqa: E402
from seqfuse.hf.mixtral import SeqfuseMixtralForCausalLM  # noqa: E402

import test_hf_llama as L  # noqa: E402
import test_hf_mixtral as M  # noqa: E402
from seqfuse.hf.llama_convert import from_hf_model as llama_from_hf  # noqa: E402
from seqfuse.hf.mixtral_convert import from_hf_model as mixtral_from_hf  # noqa: E402


def llama(seed=40, dtype=torch.float32, **kw):
    return llama_from_hf(L.hf_model(seed=seed, dtype=dtype, **kw)).eval()


def mixtral(seed=41, dtype=torch.float32, **kw):
    return mixtral_from_hf(M.hf_model(seed=seed, dtype=dtype, **kw)).eval()


# ---------------------------------------------------------------- CPU
def test_one_generate_serves_both_families():
    assert SeqfuseLlamaForCausalLM.generate is CachedGenerate.generate
    assert SeqfuseMixtralForCausalLM.generate is CachedGenerate.generate
    # not transformers' GenerationMixin interface (no generation_config is made or saved for them)
    assert not SeqfuseLlamaForCausalLM.can_generate() and not SeqfuseMixtralForCausalLM.can_generate()


def test_decode_graphs_argument():
    m = llama()
    b, _ = L.batch((7, 5), seed=1)
    with pytest.raises(ValueError, match="decode_graphs must be None"):
        m.generate(b["input_ids"], attention_mask=b["attention_mask"], max_new_tokens=2, decode_graphs="yes")
    with pytest.raises(ValueError, match="decode_graphs=True needs a CUDA model"):
        m.generate(b["input_ids"], attention_mask=b["attention_mask"], max_new_tokens=2, decode_graphs=True)
    kw = dict(attention_mask=b["attention_mask"], max_new_tokens=5, eos_token_id=[])
    # on the CPU auto and off are the same eager step
    assert torch.equal(m.generate(b["input_ids"], **kw), m.generate(b["input_ids"], decode_graphs=False, **kw))


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_decode_step_equals_full_forward(family):
    """Prefill (generate with one new token fills the cache), then two
    decode steps by hand: each step's logits are the full forward's at the
    new position (float32), and the cached lengths advance by one a step."""
    m = llama() if family == "llama" else mixtral()
    b, seqs = L.batch((9, 6, 3), seed=2)
    cache = InferenceParams(3, 32, m.config.num_key_value_heads, m.config.head_dim, dtype=torch.float32)
    first = m.generate(b["input_ids"], attention_mask=b["attention_mask"], max_new_tokens=1, eos_token_id=[],
                       inference_params=cache)[:, 0]
    assert cache.sequence_lengths[:3].tolist() == [9, 6, 3]
    freqs = m.model.rotary_emb(cache.max_sequence_length)
    rows, cu_q = torch.arange(3), torch.arange(4, dtype=torch.int32)
    cur = [torch.cat([s, t[None]]) for s, t in zip(seqs, first)]
    tok = first
    for step in range(2):
        with torch.no_grad():
            logits = decode_step(m, cache, tok, freqs, rows, cu_q)
        assert cache.sequence_lengths[:3].tolist() == [10 + step, 7 + step, 4 + step]
        for r, c in enumerate(cur):
            with torch.no_grad():
                ref = m(input_ids=c[None]).logits[0, -1]
            assert rel_error(logits[r], ref) <= 10 * REL_TOL[torch.float32], (family, step, r)
        tok = logits.argmax(-1)
        cur = [torch.cat([c, t[None]]) for c, t in zip(cur, tok)]


@pytest.mark.parametrize("experts,topk,tokens", [(4, 2, 1), (4, 2, 5), (3, 1, 4), (8, 2, 7)])
def test_every_expert_form_equals_routed_block(experts, topk, tokens):
    """forward_every_expert (fixed row counts, no host read) computes what the
    routed block computes: the picked experts' terms, zeros for the others."""
    m = mixtral(experts=experts, topk=topk)
    mlp = m.model.layers[0].mlp
    x = torch.randn(tokens, m.config.hidden_size, generator=torch.Generator().manual_seed(tokens)) * 3
    with torch.no_grad():
        routed = mlp(x)
        dense = mlp.forward_every_expert(x)
    assert dense.shape == routed.shape and dense.dtype == routed.dtype
    assert rel_error(dense, routed) <= REL_TOL[torch.float32]
    # a zero routing weight really removes an expert: zeroing an unpicked expert's weights changes nothing
    with torch.no_grad():
        probs, routing_map, _ = mlp.route(x)
        unpicked = [e for e in range(experts) if not bool(routing_map[:, e].any())]
        for e in unpicked:
            getattr(mlp.fc1, f"weight{e}").mul_(1e3)
        assert torch.equal(mlp.forward_every_expert(x), dense)


def test_graph_refusal_reasons():
    cuda = torch.device("cuda")
    m = llama()
    assert "not CUDA" in generation._graph_refusal(m, torch.device("cpu"), 1)
    assert generation._graph_refusal(m, cuda, 1) is None  # (a pure check: nothing runs on the device)
    from seqfuse.common.recipe import DelayedScaling
    from seqfuse.pytorch import fp8_autocast

    with fp8_autocast(enabled=True, fp8_recipe=DelayedScaling()):
        assert "FP8 autocast is on" in generation._graph_refusal(m, cuda, 1)
    mx = mixtral()
    assert generation._graph_refusal(mx, cuda, 1) is None

    class RoutedOnly(torch.nn.Module):  # an MoE block without the capture-safe form
        def forward(self, x):
            return x

    mx.model.layers[1].mlp = RoutedOnly()
    assert "RoutedOnly" in generation._graph_refusal(mx, cuda, 1)


@needs_fp8
@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_fp8_decode_casts_each_weight_once(family):
    """Under FP8 autocast (eager decode: graphs are refused there) a
    weight is cast to FP8 once per generate, in the prefill: the decode
    steps reuse the cast (the weight's version has not moved)."""
    from seqfuse.common.recipe import DelayedScaling
    from seqfuse.pytorch import fp8_autocast
    from seqfuse.quantization import weight_casts

    _, seqs = L.batch((16,), seed=6)
    counts = []
    for new in (1, 8):
        m = llama() if family == "llama" else mixtral()  # (a fresh model: no cast cached yet)
        before = weight_casts(m)
        with fp8_autocast(enabled=True, fp8_recipe=DelayedScaling()):
            out = m.generate(seqs[0][None], max_new_tokens=new, eos_token_id=[])
        assert out.shape == (1, new)
        counts.append(weight_casts(m) - before)
    assert counts[0] > 0 and counts[1] == counts[0], counts


def test_weights_signature():
    m = llama()
    sig = weights_signature(m)
    with torch.no_grad():
        m.lm_head.weight.add_(1.0)  # in place: a replay reads the new values, the graph stays valid
    assert weights_signature(m) == sig
    m.to(torch.float64)
    assert weights_signature(m) != sig


def test_model_cache_kept_and_rounded():
    m = llama()
    c = generation._model_cache(m, 2, 40, torch.float32, torch.device("cpu"))
    assert c.max_sequence_length == generation.CACHE_LENGTH_STEP and c.max_batch_size == 2
    assert generation._model_cache(m, 2, 100, torch.float32, torch.device("cpu")) is c
    bigger = generation._model_cache(m, 2, generation.CACHE_LENGTH_STEP + 1, torch.float32, torch.device("cpu"))
    assert bigger is not c and bigger.max_sequence_length == 2 * generation.CACHE_LENGTH_STEP
    assert generation._model_cache(m, 2, 40, torch.float64, torch.device("cpu")) is not bigger  # dtype moved
    assert decode_graph_stats(m) == {2: (0, 0)}
    m.release_decode_graphs()
    assert decode_graph_stats(m) == {}


class _FakeStream:
    def wait_stream(self, other):
        pass


@pytest.fixture
def fake_graphs(monkeypatch):
    """DecodeGraph's bookkeeping on the CPU: capture and replay stand-ins
    that behave as a CUDA graph does for this step (capture runs nothing
    that lasts: the lengths it would advance are put back; a replay runs the
    step again into the same output buffer).  What this cannot check (the
    capture itself) is the cuda tests' job."""
    import contextlib

    def capture(self, step, stream):
        lens = self.cache.sequence_lengths
        saved = lens.clone()
        out = step().clone()
        lens.copy_(saved)
        self._fake_step = step
        return out

    def replay(self):
        self.logits.copy_(self._fake_step())

    monkeypatch.setattr(generation.DecodeGraph, "_capture", capture)
    monkeypatch.setattr(generation.DecodeGraph, "_replay", replay)
    monkeypatch.setattr(generation, "_capture_stream", lambda device: _FakeStream())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(generation, "_graph_refusal", lambda model, device, b: None)


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_graph_bookkeeping_with_stand_ins(family, fake_graphs):
    """With capture/replay stand-ins: graphed tokens equal eager ones (padded
    and packed), one capture per batch size and cache, later calls replay,
    in-place updates keep the graph, moved weights are captured again, a
    caller's cache keeps its own graph."""
    m = llama() if family == "llama" else mixtral()
    b, seqs = L.batch((11, 7, 4), seed=5)
    kw = dict(attention_mask=b["attention_mask"], max_new_tokens=8, eos_token_id=[])
    eager = m.generate(b["input_ids"], decode_graphs=False, **kw)
    assert decode_graph_stats(m) == {}
    assert torch.equal(m.generate(b["input_ids"], **kw), eager)
    assert decode_graph_stats(m) == {3: (1, 7)}
    assert torch.equal(m.generate(b["input_ids"], **kw), eager)
    ids, cu, _ = L.packed(seqs)
    assert torch.equal(m.generate(ids, cu_seqlens=cu, max_new_tokens=8, eos_token_id=[]), eager)
    assert decode_graph_stats(m) == {3: (1, 21)}
    one = m.generate(b["input_ids"][:1, :11], max_new_tokens=8, eos_token_id=[])
    assert torch.equal(one, eager[:1]) and decode_graph_stats(m) == {3: (1, 21), 1: (1, 7)}
    with torch.no_grad():
        m.lm_head.weight.mul_(-1.0)
    flipped = m.generate(b["input_ids"], decode_graphs=False, **kw)
    assert not torch.equal(flipped, eager)
    assert torch.equal(m.generate(b["input_ids"], **kw), flipped)
    assert decode_graph_stats(m)[3] == (1, 28)
    m.to(torch.float64).to(torch.float32)  # new storage, same dtype: the kept cache fits, its graph does not
    assert torch.equal(m.generate(b["input_ids"], **kw), flipped)
    assert decode_graph_stats(m)[3] == (2, 7)
    cache = InferenceParams(4, 40, m.config.num_key_value_heads, m.config.head_dim, dtype=torch.float32)
    assert torch.equal(m.generate(b["input_ids"], inference_params=cache, **kw), flipped)
    assert cache.graph_captures == 1 and cache.decode_graphs[3].replays == 7
    assert decode_graph_stats(m)[3] == (2, 7)
    # one new token: no decode step, nothing captured
    assert torch.equal(m.generate(b["input_ids"], attention_mask=b["attention_mask"], max_new_tokens=1,
                                  eos_token_id=[]), flipped[:, :1])


# ---------------------------------------------------------------- CUDA
LLAMA_CUDA = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512)
NEW = 24


def cuda_model(family, seed):
    if family == "llama":
        return llama_from_hf(L.hf_model(seed=seed, dtype=torch.bfloat16, **LLAMA_CUDA).cuda()).eval()
    return mixtral_from_hf(M.hf_model(seed=seed, dtype=torch.bfloat16, **M.CUDA_KW).cuda()).eval()


LENGTHS = {1: (37,), 4: (40, 33, 17, 9)}


@pytest.mark.cuda
@pytest.mark.parametrize("family", ["llama", "mixtral"])
@pytest.mark.parametrize("bsz", [1, 4])
def test_cuda_graphed_decode_equals_eager(family, bsz):
    """bf16, greedy, 24 new tokens, uneven prompts: the graphed decode gives
    the eager decode's tokens (the same step function, captured), padded and
    packed; the graph is captured once and a second call replays it."""
    m = cuda_model(family, seed=50 + bsz)
    b, seqs = L.batch(LENGTHS[bsz], seed=bsz)
    ids, mask = b["input_ids"].cuda(), b["attention_mask"].cuda()
    kw = dict(attention_mask=mask, max_new_tokens=NEW, eos_token_id=[])
    eager = m.generate(ids, decode_graphs=False, **kw)
    assert decode_graph_stats(m) == {}
    graphed = m.generate(ids, **kw)  # default: graphs on CUDA
    assert torch.equal(graphed, eager)
    assert decode_graph_stats(m) == {bsz: (1, NEW - 1)}
    again = m.generate(ids, **kw)
    assert torch.equal(again, eager)
    assert decode_graph_stats(m) == {bsz: (1, 2 * (NEW - 1))}  # replayed, not captured again
    p_ids, cu, _ = L.packed([s.cuda() for s in seqs])
    packed_eager = m.generate(p_ids, cu_seqlens=cu.cuda(), max_new_tokens=NEW, eos_token_id=[], decode_graphs=False)
    packed_graphed = m.generate(p_ids, cu_seqlens=cu.cuda(), max_new_tokens=NEW, eos_token_id=[])
    assert torch.equal(packed_graphed, packed_eager)
    assert decode_graph_stats(m) == {bsz: (1, 3 * (NEW - 1))}
    # the tokens are the model's: near ties aside, each is the argmax of the full forward
    from test_hf_llama_generate import greedy_tokens_check

    exact, total = greedy_tokens_check(graphed, [s.cuda() for s in seqs], lambda x: m(input_ids=x).logits)
    assert exact >= 0.75 * total, (exact, total)


@pytest.mark.cuda
def test_cuda_graphed_sampling_equals_eager():
    """Sampling happens outside the graph, from its logits: the same draws."""
    m = cuda_model("llama", seed=60)
    b, _ = L.batch((21, 14, 30, 5), seed=60)
    kw = dict(attention_mask=b["attention_mask"].cuda(), max_new_tokens=NEW, eos_token_id=[], do_sample=True,
              temperature=0.8, top_k=8, top_p=0.9)
    eager = m.generate(b["input_ids"].cuda(), generator=torch.Generator("cuda").manual_seed(3), decode_graphs=False,
                       **kw)
    graphed = m.generate(b["input_ids"].cuda(), generator=torch.Generator("cuda").manual_seed(3), decode_graphs=True,
                         **kw)
    assert torch.equal(graphed, eager)


@pytest.mark.cuda
def test_cuda_graph_sees_weight_updates_and_recaptures_moved_weights():
    m = cuda_model("llama", seed=61)
    b, _ = L.batch((19, 12), seed=61)
    ids = b["input_ids"].cuda()
    kw = dict(attention_mask=b["attention_mask"].cuda(), max_new_tokens=NEW, eos_token_id=[])
    m.generate(ids, **kw)
    with torch.no_grad():  # in place: the captured graph reads the new values
        for layer in m.model.layers:
            layer.self_attention.proj.weight.mul_(-1.5)
    assert torch.equal(m.generate(ids, **kw), m.generate(ids, decode_graphs=False, **kw))
    assert decode_graph_stats(m)[2][0] == 1
    m.to(torch.float16).to(torch.bfloat16)  # new storage, same dtype: the kept cache fits, its graph does not
    assert torch.equal(m.generate(ids, **kw), m.generate(ids, decode_graphs=False, **kw))
    assert decode_graph_stats(m)[2][0] == 2
    # a caller's cache keeps its own graphs
    cache = InferenceParams(2, 64, m.config.num_key_value_heads, m.config.head_dim, dtype=torch.bfloat16,
                            device="cuda")
    assert torch.equal(m.generate(ids, inference_params=cache, **kw), m.generate(ids, decode_graphs=False, **kw))
    assert cache.graph_captures == 1 and cache.decode_graphs[2].replays == NEW - 1


@pytest.mark.cuda
@needs_fp8
def test_cuda_fp8_decode_stays_eager_with_reason(caplog):
    from seqfuse.common.recipe import DelayedScaling
    from seqfuse.pytorch import fp8_autocast

    m = cuda_model("llama", seed=62)
    _, seqs = L.batch((40,), seed=62)
    generation._logged.clear()
    with caplog.at_level(logging.INFO, logger="seqfuse"), fp8_autocast(enabled=True, fp8_recipe=DelayedScaling()):
        out = m.generate(seqs[0][None].cuda(), max_new_tokens=NEW, eos_token_id=[])
    assert out.shape == (1, NEW) and ((out >= 0) & (out < L.VOCAB)).all()
    assert any("runs eagerly" in r.getMessage() and "FP8 autocast" in r.getMessage() for r in caplog.records)
    assert decode_graph_stats(m) == {}
