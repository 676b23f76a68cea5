"""The opt-in "cudnn_ragged" route of ops.attention (python/seqfuse/ops/attn/
_cudnn_ragged.py: packed thd batches on cuDNN's variable-length attention
through torch.ops.aten._cudnn_attention_forward), on the CPU:

- each rule of ragged_eligibility as a pure function, and their order;
- device_checks.sequence_facts, the lengths facts the route reads;
- the choice (attention_backend) on CPU tensors with an H200's device facts
  and a torch that has the op with cuDNN 9.19: off by default, taken in auto
  only with SEQFUSE_ATTN_CUDNN_RAGGED=1 or set_attention_cudnn_ragged(True),
  after the uniform-length cuDNN route and before flash, refused for calls
  that want gradients (rule torch_backward), forced by
  SEQFUSE_ATTN_BACKEND=cudnn_ragged with NotImplementedError naming the rule;
- the route's plumbing run on the CPU: the op is CUDA only, so a stand-in
  with its documented semantics (3-D packed q/k/v, top-left causal within
  each sequence, tokens outside every sequence left unwritten: NaN here)
  takes its place, and the route's output is checked against seqfuse's CPU
  kernels; a RuntimeError from it falls back to seqfuse in auto, logged;
- the frontend provider (nvidia-cudnn-frontend's cudnn.sdpa_torch) with a
  differentiable stand-in: batch size bucketed to a multiple of 16 with
  empty sequences, max lengths to powers of two, training calls taken,
  forward and gradients against seqfuse's CPU kernels; its absence named;
- benchmarks/attn/ragged_probe.py's own pieces that run without a GPU.
The CUDA tests: tests/test_attn_ragged_cuda.py."""
import logging

import pytest
import torch

import seqfuse
from attn_ref import attend, check_route_cu_seqlens, cu_seqlens, thd_case
from helpers import BACKWARD_FACTOR, fresh_routing, pair_tol, record_calls, rel_error
from seqfuse.ops import device_checks
from seqfuse.ops.attn import _cudnn_ragged as ragged
from seqfuse.ops.attn import _routing as routing

RAGGED = seqfuse.ops.attn.ragged_eligibility


@pytest.fixture(autouse=True)
def restore_backend(monkeypatch):
    fresh_routing(monkeypatch)  # backend "auto", the ragged route off until a test turns it on


@pytest.fixture
def emulated_h200(monkeypatch):
    """CPU tensors routed as if on an H200 whose torch has the op and cuDNN 9.19."""
    monkeypatch.setattr(routing, "_device_facts", lambda device: ("cuda", (9, 0)))
    monkeypatch.setattr(routing, "_SDPA_BACKENDS", [routing.SDPBackend.MATH])
    monkeypatch.setattr(routing, "_ragged_support", {"torch": True, "frontend": False, "cudnn": 91900})


# ------------------------------------------------------------ the rules, pure
OK = dict(device_type="cuda", capability=(9, 0), qkv_format="thd", attn_mask_type="padding", window=(-1, -1),
          dropout_p=0.0, deterministic=False, dtype=torch.bfloat16, heads_q=20, heads_kv=20, head_dim=64,
          cudnn_enabled=True, covered=True, cudnn_version=91900)

BROKEN = [
    ("qkv_format", dict(qkv_format="bshd")),
    ("alignment", dict(attn_mask_type="padding_causal_bottom_right")),
    ("alignment", dict(attn_mask_type="causal_bottom_right")),
    ("window", dict(window=(8, 0))),
    ("dropout", dict(dropout_p=0.1)),
    ("deterministic", dict(deterministic=True)),
    ("deterministic", dict(deterministic_algorithms=True)),
    ("dtype", dict(dtype=torch.float32)),
    ("gqa", dict(heads_kv=3)),
    ("gqa", dict(heads_kv=5, cudnn_version=90500)),
    ("gqa", dict(heads_kv=5, cudnn_version=None)),
    ("head_dim", dict(head_dim=20)),
    ("head_dim", dict(head_dim=256)),
    ("device", dict(device_type="cpu")),
    ("torch_op", dict(op_present=False)),
    ("graph_capture", dict(capturing=True)),
    ("lengths", dict(covered=None)),
    ("lengths", dict(covered=False)),
    ("torch_backward", dict(needs_grad=True)),
    ("capability", dict(capability=(8, 0))),
    ("capability", dict(capability=None)),
    ("cudnn_sdp_enabled", dict(cudnn_enabled=False)),
]


def test_eligible_call_passes():
    assert RAGGED(**OK) == ("", "")
    # what it also takes: top-left causal with separate cu_seqlens, bottom-right with one tensor, GQA, fp16,
    # head dims 8 to 128, gradients where the torch's backward is trusted, any capability when forced
    for extra in (dict(attn_mask_type="padding_causal"), dict(attn_mask_type="causal"),
                  dict(attn_mask_type="causal_bottom_right", same_cu=True), dict(heads_kv=5),
                  dict(dtype=torch.float16), dict(head_dim=8), dict(head_dim=128),
                  dict(needs_grad=True, backward_trusted=True), dict(capability=(8, 0), check_capability=False)):
        assert RAGGED(**{**OK, **extra}) == ("", ""), extra


@pytest.mark.parametrize("rule,change", BROKEN, ids=[f"{r}-{i}" for i, (r, _) in enumerate(BROKEN)])
def test_each_rule(rule, change):
    got, reason = RAGGED(**{**OK, **change})
    assert got == rule and reason.startswith(rule + ": ")


def test_rules_are_checked_in_order():
    # every later change of BROKEN stacked on an earlier one: the earliest rule is named
    for i, (rule, change) in enumerate(BROKEN):
        stacked = dict(OK)
        for _, later in BROKEN[i:]:
            stacked.update(later)
        stacked.update(change)
        assert RAGGED(**stacked)[0] == rule, (rule, change)


def test_frontend_provider_rules():
    """The frontend provider takes gradients (no torch_backward rule) and
    names its own absence."""
    fe = dict(OK, provider="frontend")
    assert RAGGED(**fe) == ("", "") and RAGGED(**{**fe, "needs_grad": True}) == ("", "")
    rule, reason = RAGGED(**{**fe, "op_present": False})
    assert rule == "frontend" and "pip install nvidia-cudnn-frontend" in reason
    assert RAGGED(**{**fe, "covered": False})[0] == "lengths"  # the same unwritten-token rule


@pytest.mark.parametrize("given,bucketed", [((46, 1024, 1024), (48, 1024, 1024)), ((7, 300, 65), (16, 512, 128)),
                                            ((16, 1, 1), (16, 64, 64)), ((17, 4096, 2000), (32, 4096, 2048))])
def test_frontend_bucketing(given, bucketed):
    assert ragged.bucket_lengths(*given) == bucketed


def test_reasons_name_the_torch_bugs():
    assert "PyTorch PR #186142" in RAGGED(**{**OK, "needs_grad": True})[1]
    assert "needs cuDNN 9.6 or later, this torch has 90500" in RAGGED(**{**OK, "heads_kv": 5,
                                                                         "cudnn_version": 90500})[1]


def test_torch_release_and_backward_trust(monkeypatch):
    assert ragged.torch_release("2.11.0+cu130") == (2, 11)
    assert ragged.torch_release("2.13.0a0+git1234") == (2, 13)
    assert ragged.torch_release("3.0.1") == (3, 0)
    assert ragged.RAGGED_BACKWARD_FROM is None and not ragged.ragged_backward_trusted("9.9.0")
    monkeypatch.setattr(ragged, "RAGGED_BACKWARD_FROM", (2, 13))
    assert not ragged.ragged_backward_trusted("2.12.1") and ragged.ragged_backward_trusted("2.13.0")


# ------------------------------------------------------------ the lengths facts
def test_sequence_facts():
    cu = cu_seqlens([5, 0, 9, 2])
    assert device_checks.sequence_facts(cu) == (16, 0, 9)
    assert device_checks.sequence_facts(cu, 9) == (16, 0, 9)
    assert device_checks.sequence_facts(cu, 8) is None  # a sequence longer than the max given
    assert device_checks.sequence_facts(torch.tensor([1, 4], dtype=torch.int32)) is None  # not from 0
    assert device_checks.sequence_facts(torch.tensor([0, 4, 3], dtype=torch.int32)) is None  # decreasing
    assert device_checks.sequence_facts(cu.long()) is None
    assert device_checks.sequence_facts(cu[:1]) is None
    assert device_checks.sequence_facts(None) is None


# ------------------------------------------------------------ the choice
def test_off_by_default(emulated_h200, monkeypatch):
    monkeypatch.setattr(routing, "_ragged_on", None)
    monkeypatch.delenv("SEQFUSE_ATTN_CUDNN_RAGGED", raising=False)
    q, k, v, kw = thd_case([5, 7, 3])
    name, reason = seqfuse.ops.attention_backend(q, k, v, **kw)
    assert name == "seqfuse" and "cudnn_ragged" not in reason  # forward only: seqfuse's kernels, as before
    q.requires_grad_()
    assert seqfuse.ops.attention_backend(q, k, v, **kw)[0] == "flash"


def test_opt_in_takes_forward_calls_and_refuses_gradients(emulated_h200):
    assert seqfuse.ops.attn.set_attention_cudnn_ragged(True) is None
    q, k, v, kw = thd_case([5, 7, 3])
    assert seqfuse.ops.attention_backend(q, k, v, **kw) == (
        "cudnn_ragged", "thd no_mask d=16 bfloat16 runs cuDNN's ragged fused attention through "
                        "torch.ops.aten._cudnn_attention_forward")
    q.requires_grad_()
    name, reason = seqfuse.ops.attention_backend(q, k, v, **kw)
    assert name == "flash"
    with torch.no_grad():
        assert seqfuse.ops.attention_backend(q, k, v, **kw)[0] == "cudnn_ragged"
    # a call flash does not take either names all three rules
    name, reason = seqfuse.ops.attention_backend(q, k, v, **kw, rng_state=(1, 0), dropout_p=0.1)
    assert name == "seqfuse" and "; cudnn_ragged route: dropout: " in reason and "; flash route: rng_state" in reason
    assert seqfuse.ops.attn.set_attention_cudnn_ragged(False) == "torch"
    with torch.no_grad():
        assert seqfuse.ops.attention_backend(q, k, v, **kw)[0] == "seqfuse"


def test_opt_in_keeps_uniform_batches_on_cudnn_bshd(emulated_h200):
    seqfuse.ops.attn.set_attention_cudnn_ragged(True)
    q, k, v, kw = thd_case([6, 6, 6])
    name, reason = seqfuse.ops.attention_backend(q, k, v, **kw)
    assert name == "cudnn" and "as bshd [3, 6]" in reason


def test_opt_in_leaves_padded_layouts_alone(emulated_h200):
    """bshd/sbhd calls are not the route's: their reasons do not mention it."""
    seqfuse.ops.attn.set_attention_cudnn_ragged(True)
    x = torch.randn(2, 6, 4, 20).bfloat16()  # head dim 20: neither cuDNN nor flash
    name, reason = seqfuse.ops.attention_backend(x, x, x)
    assert name == "seqfuse" and reason.startswith("head_dim: ") and "cudnn_ragged" not in reason


@pytest.mark.parametrize("case,rule", [
    (lambda: thd_case([5, 7], tail=(3, 3)), "lengths"),  # tokens past the last sequence
    (lambda: thd_case([5, 7], [4, 0], same=False), "lengths"),  # a query sequence with no keys
    (lambda: thd_case([5, 7], d=20), "head_dim"),
    (lambda: thd_case([5, 7], h=4, hk=3), None),  # q heads not a multiple: seqfuse's own checks ("inputs")
    (lambda: thd_case([5, 7], dtype=torch.float32), None),  # float32 on CUDA: the torch_fp32 route
])
def test_opt_in_refusals_name_the_rule(emulated_h200, case, rule):
    seqfuse.ops.attn.set_attention_cudnn_ragged(True)
    q, k, v, kw = case()
    name, reason = seqfuse.ops.attention_backend(q, k, v, **kw)
    assert name != "cudnn_ragged"
    if rule is not None:
        assert f"cudnn_ragged route: {rule}: " in reason


def test_opt_in_gqa_needs_cudnn_9_6(emulated_h200, monkeypatch):
    seqfuse.ops.attn.set_attention_cudnn_ragged(True)
    q, k, v, kw = thd_case([5, 7], h=4, hk=2)
    assert seqfuse.ops.attention_backend(q, k, v, **kw)[0] == "cudnn_ragged"
    monkeypatch.setattr(routing, "_ragged_support", {"torch": True, "cudnn": 90500})
    seqfuse.ops.attn.set_attention_cudnn_ragged(True)  # forgets the cached choices
    assert "cudnn_ragged route: gqa: " in seqfuse.ops.attention_backend(q, k, v, **kw)[1]


def test_env_opt_in(emulated_h200, monkeypatch):
    q, k, v, kw = thd_case([5, 7])
    monkeypatch.setattr(routing, "_ragged_on", None)
    monkeypatch.setenv("SEQFUSE_ATTN_CUDNN_RAGGED", "1")
    assert seqfuse.ops.attention_backend(q, k, v, **kw)[0] == "cudnn_ragged"
    monkeypatch.setattr(routing, "_ragged_on", None)
    monkeypatch.setattr(routing, "_choices", {})
    monkeypatch.setenv("SEQFUSE_ATTN_CUDNN_RAGGED", " 0 ")
    assert seqfuse.ops.attention_backend(q, k, v, **kw)[0] == "seqfuse"
    for bad in ("yes", "true", "2", "Frontend"):
        monkeypatch.setattr(routing, "_ragged_on", None)
        monkeypatch.setenv("SEQFUSE_ATTN_CUDNN_RAGGED", bad)
        for _ in range(2):  # every call says it until it is fixed
            with pytest.raises(ValueError) as e:
                seqfuse.ops.attention_backend(q, k, v, **kw)
            assert str(e.value) == f"SEQFUSE_ATTN_CUDNN_RAGGED must be '0', '1', 'torch' or 'frontend', got {bad!r}"
    # the setter overrides a bad variable
    seqfuse.ops.attn.set_attention_cudnn_ragged(True)
    assert seqfuse.ops.attention_backend(q, k, v, **kw)[0] == "cudnn_ragged"


@pytest.mark.parametrize("value", [1, "1", None, "on"])
def test_setter_takes_bools_only(value):
    with pytest.raises(TypeError) as e:
        seqfuse.ops.attn.set_attention_cudnn_ragged(value)
    assert str(e.value) == f"set_attention_cudnn_ragged: argument 'enabled' must be a bool, got " \
                           f"{type(value).__name__}"


@pytest.mark.parametrize("provider", ["gpu", "Torch", None, 1])  # ("cuda" would be skipped as a marker)
def test_setter_names_the_providers(provider):
    with pytest.raises(ValueError) as e:
        seqfuse.ops.attn.set_attention_cudnn_ragged(True, provider)
    assert str(e.value) == f"set_attention_cudnn_ragged: argument 'provider' must be 'torch' or 'frontend', got " \
                           f"{provider!r}"


def test_forced_route(emulated_h200, monkeypatch):
    monkeypatch.setattr(routing, "_backend", None)
    monkeypatch.setenv("SEQFUSE_ATTN_BACKEND", "cudnn_ragged")
    q, k, v, kw = thd_case([5, 7, 3])
    assert seqfuse.ops.attention_backend(q, k, v, **kw)[0] == "cudnn_ragged"
    q.requires_grad_()
    with pytest.raises(NotImplementedError, match=r"backend 'cudnn_ragged' was chosen .* cannot run cuDNN's "
                                                  r"ragged fused attention: torch_backward: "):
        seqfuse.ops.attention(q, k, v, **kw)
    x = torch.randn(2, 6, 4, 16).bfloat16()
    with pytest.raises(NotImplementedError, match="qkv_format: qkv_format 'bshd'; the cudnn_ragged route takes "
                                                  "packed thd only"):
        seqfuse.ops.attention_backend(x, x, x)


def test_forced_route_skips_capability_and_keeps_device(monkeypatch):
    monkeypatch.setattr(routing, "_ragged_support", {"torch": True, "frontend": False, "cudnn": 91900})
    seqfuse.ops.set_attention_backend("cudnn_ragged")
    q, k, v, kw = thd_case([5, 7])
    with pytest.raises(NotImplementedError, match="device: cpu tensors"):
        seqfuse.ops.attention(q, k, v, **kw)
    monkeypatch.setattr(routing, "_device_facts", lambda device: ("cuda", (10, 0)))
    assert seqfuse.ops.attention_backend(q, k, v, **kw)[0] == "cudnn_ragged"
    seqfuse.ops.set_attention_backend("auto")
    seqfuse.ops.attn.set_attention_cudnn_ragged(True)
    assert "cudnn_ragged route: capability: compute capability 10.0" in seqfuse.ops.attention_backend(q, k, v,
                                                                                                     **kw)[1]


# ------------------------------------------------------------ the route's plumbing, with a stand-in
def ragged_standin_for(calls):
    """A CPU stand-in for torch.ops.aten._cudnn_attention_forward's ragged
    path: the float64 reference per sequence (top-left causal when
    is_causal), tokens outside every sequence left NaN (cuDNN does not
    write them); checks what the route hands it."""
    def standin(q, k, v, attn_bias, cu_q, cu_k, max_q, max_k, compute_log_sumexp, dropout_p, is_causal,
                return_debug_mask, *, scale=None):
        calls.append(dict(max_q=max_q, max_k=max_k, lse=compute_log_sumexp, causal=is_causal, scale=scale,
                          strides=(q.stride(), k.stride(), v.stride())))
        assert q.dim() == 3 and k.dim() == 3 and attn_bias is None and dropout_p == 0.0 and not return_debug_mask
        bq, bk = check_route_cu_seqlens(cu_q, cu_k, max_q, max_k)
        mask = "causal" if is_causal else "no_mask"
        out = torch.full(q.shape[:2] + v.shape[2:], float("nan"), dtype=q.dtype)
        for a, b, c, e in zip(bq, bq[1:], bk, bk[1:]):
            if b > a:
                out[a:b] = attend(q[a:b].double(), k[c:e].double(), v[c:e].double(), mask, None, scale).to(q.dtype)
        return out, None, cu_q, cu_k, max_q, max_k, None, None, None
    return standin


@pytest.fixture
def ragged_calls(monkeypatch, emulated_h200):
    return record_calls(monkeypatch, ragged, "_ragged_forward", ragged_standin_for)


@pytest.mark.parametrize("mask", ["no_mask", "padding", "causal", "padding_causal", "causal_bottom_right",
                                  "padding_causal_bottom_right"])
@pytest.mark.parametrize("lengths,hk", [([5, 11, 1, 7], 4), ([9, 0, 6], 2)])
def test_route_matches_seqfuse_cpu(ragged_calls, mask, lengths, hk):
    seqfuse.ops.set_attention_backend("cudnn_ragged")
    q, k, v, kw = thd_case(lengths, hk=hk)
    out = seqfuse.ops.attention(q, k, v, attn_mask_type=mask, softmax_scale=0.3, **kw)
    assert len(ragged_calls) == 1
    call = ragged_calls[0]
    assert call["causal"] == ("causal" in mask) and call["scale"] == 0.3 and not call["lse"]
    assert call["max_q"] == max(lengths) and call["max_k"] == max(lengths)
    seqfuse.ops.set_attention_backend("seqfuse")
    ref = seqfuse.ops.attention(q, k, v, attn_mask_type=mask, softmax_scale=0.3, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert rel_error(out, ref) <= pair_tol(torch.bfloat16)


def test_route_top_left_causal_with_separate_lengths(ragged_calls):
    seqfuse.ops.set_attention_backend("cudnn_ragged")
    q, k, v, kw = thd_case([4, 9, 6], [7, 3, 6], same=False)
    out = seqfuse.ops.attention(q, k, v, attn_mask_type="padding_causal", **kw)
    assert ragged_calls[-1]["causal"] and ragged_calls[-1]["max_k"] == 7
    seqfuse.ops.set_attention_backend("seqfuse")
    ref = seqfuse.ops.attention(q, k, v, attn_mask_type="padding_causal", **kw)
    assert rel_error(out, ref) <= pair_tol(torch.bfloat16)


def test_route_reads_no_max_length_from_the_device(ragged_calls, monkeypatch):
    """Without max_seqlen the route takes the longest lengths from the cached
    facts; a given max is passed as it is."""
    seqfuse.ops.set_attention_backend("cudnn_ragged")
    q, k, v, kw = thd_case([5, 11, 2])
    kw.pop("max_seqlen_q"), kw.pop("max_seqlen_kv")
    seqfuse.ops.attention(q, k, v, **kw)
    assert (ragged_calls[-1]["max_q"], ragged_calls[-1]["max_k"]) == (11, 11)
    seqfuse.ops.attention(q, k, v, max_seqlen_q=16, max_seqlen_kv=16, **kw)
    assert (ragged_calls[-1]["max_q"], ragged_calls[-1]["max_k"]) == (16, 16)


def test_route_hands_aligned_rows(ragged_calls):
    """q, k, v go through kernel_layout: a head-dim-strided view is copied to unit stride."""
    seqfuse.ops.set_attention_backend("cudnn_ragged")
    q, k, v, kw = thd_case([5, 7], d=16)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # head dim stride != 1
    out = seqfuse.ops.attention(qt, k, v, **kw)
    assert ragged_calls[-1]["strides"][0][-1] == 1
    seqfuse.ops.set_attention_backend("seqfuse")
    assert rel_error(out, seqfuse.ops.attention(q, k, v, **kw)) <= pair_tol(torch.bfloat16)


def test_route_logs_once_and_falls_back_on_runtime_error(monkeypatch, emulated_h200, caplog):
    seqfuse.ops.attn.set_attention_cudnn_ragged(True)
    q, k, v, kw = thd_case([6, 5])
    calls = record_calls(monkeypatch, ragged, "_ragged_forward", ragged_standin_for)
    with caplog.at_level(logging.INFO, logger="seqfuse"):
        seqfuse.ops.attention(q, k, v, **kw)
        seqfuse.ops.attention(q, k, v, **kw)
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert infos == ["seqfuse attention: thd no_mask d=16 bfloat16 runs cuDNN's ragged fused attention through "
                     "torch.ops.aten._cudnn_attention_forward (set SEQFUSE_ATTN_BACKEND=seqfuse for seqfuse's "
                     "kernels)"] and len(calls) == 2

    def broken(*args, **kwargs):
        raise RuntimeError("cuDNN Frontend error: [cudnn_frontend] Error: No valid execution plans built.")

    monkeypatch.setattr(ragged, "_ragged_forward", broken)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="seqfuse"):
        out = seqfuse.ops.attention(q, k, v, **kw)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "cuDNN's ragged fused attention failed on thd no_mask d=16 bfloat16: cuDNN " \
                                  "Frontend error" in warnings[0]
    assert torch.equal(out, seqfuse.ops.attention_forward(q, k, v, **kw)[0])
    name, reason = seqfuse.ops.attention_backend(q, k, v, **kw)
    assert name == "seqfuse" and reason.startswith("cudnn_ragged_failed: ")


# ------------------------------------------------------------ benchmarks/attn/ragged_probe.py's own pieces
@pytest.fixture(scope="module")
def probe():
    """The probe script as a module (its GPU-only parts are not run here)."""
    import importlib.util
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(root, "benchmarks", "attn", "ragged_probe.py")
    sys.path.insert(0, os.path.dirname(path))
    try:
        spec = importlib.util.spec_from_file_location("ragged_probe", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(os.path.dirname(path))
    return module


@pytest.mark.parametrize("causal,hk", [(False, 4), (True, 2)])
def test_probe_float64_reference_matches_seqfuse_cpu(probe, causal, hk):
    """The probe's float64 reference (its err64 columns) agrees with seqfuse's
    CPU backend, gradients too: top-left causal, GQA head grouping."""
    spec = dict(name="t", lengths=[5, 17, 1, 9], h=4, hk=hk, d=16, causal=causal, seed=3)
    q, k, v, dout, cu, max_len = probe.make_inputs(spec, device="cpu")
    exact, exact_grads = probe.float64_reference(spec, q, k, v, dout)
    seqfuse.ops.set_attention_backend("seqfuse")
    out, grads = probe.outputs(probe.seqfuse_call(spec, cu, max_len, "seqfuse")[0], q, k, v, dout)
    _, _, err64, err64_grad = probe.compare(out, grads, out, grads, exact, exact_grads)
    assert err64 <= pair_tol(torch.bfloat16) and err64_grad <= pair_tol(torch.bfloat16, BACKWARD_FACTOR)


def test_probe_second_batch_and_cases(probe):
    spec = dict(lengths=[5, 17, 9, 3, 20])
    cu2, max2 = probe.second_batch(spec, cu_seqlens(spec["lengths"]))
    assert cu2.tolist() == [0, 5, 22, 34, 54] and max2 == 20  # 9 and 3, the shortest neighbours, merged
    esm, esm_sorted, llama = probe.cases()
    assert sum(esm["lengths"]) <= probe.TOKENS and max(esm["lengths"]) <= 1024 and min(esm["lengths"]) >= 50
    assert esm_sorted["lengths"] == sorted(esm["lengths"], reverse=True)
    assert sum(llama["lengths"]) == probe.TOKENS and (llama["h"], llama["hk"], llama["causal"]) == (32, 8, True)


def test_probe_length_groups(probe):
    """Longest first, groups within a factor of 2, and no permutation for a
    batch already in that order."""
    perm, groups = probe.length_groups([100, 1024, 50, 600, 300, 1024, 200])
    assert [g[2] for g in groups] == [[1024, 1024, 600], [300, 200], [100], [50]]
    assert [(a, b) for a, b, _ in groups] == [(0, 2648), (2648, 3148), (3148, 3248), (3248, 3298)]
    assert sorted(perm) == list(range(3298)) and perm[:2] == [100, 101]  # the first 1,024-token sequence
    assert probe.length_groups([1024, 1024, 600, 300, 200, 100, 50])[0] is None
    # empty sequences hold no tokens: no group of their own (and no endless loop)
    perm, groups = probe.length_groups([7, 0, 3, 0])
    assert [g[2] for g in groups] == [[7], [3]] and groups[-1][1] == 10


@pytest.mark.parametrize("causal,lengths", [(False, [5, 17, 1, 9, 12]), (True, [9, 3, 16, 8])])
def test_probe_frontend_split_call_matches_the_reference(probe, monkeypatch, causal, lengths):
    """frontend_split_call with a CPU stand-in of cudnn.sdpa_torch (float64
    attention per sequence of its cu_seqlens, lengths checked against its
    max_seqlen): one call per length group, the permutation into length
    order and back right, forward and gradients against the probe's float64
    reference."""
    import sys
    import types

    calls = []

    def sdpa_torch(q, k, v, *, is_causal=False, cu_seqlens_q=None, cu_seqlens_kv=None, max_seqlen_q=0,
                   max_seqlen_kv=0, return_lse=False):
        bounds = cu_seqlens_q.tolist()
        calls.append((bounds, max_seqlen_q))
        assert bounds == cu_seqlens_kv.tolist() and bounds[-1] == q.shape[0]
        assert max(b - a for a, b in zip(bounds, bounds[1:])) == max_seqlen_q == max_seqlen_kv
        mask = "causal" if is_causal else "no_mask"
        out = torch.cat([attend(q[a:b].double(), k[a:b].double(), v[a:b].double(), mask, None, q.shape[-1] ** -0.5)
                         for a, b in zip(bounds, bounds[1:])]).to(q.dtype)
        return (out, None) if return_lse else out

    monkeypatch.setitem(sys.modules, "cudnn", types.SimpleNamespace(sdpa_torch=sdpa_torch))
    spec = dict(name="t", lengths=lengths, h=2, hk=2, d=16, causal=causal, seed=4)
    q, k, v, dout, cu, max_len = probe.make_inputs(spec, device="cpu")
    q, k, v = (x.double() for x in (q, k, v))
    fn = probe.frontend_split_call(spec, cu, max_len)
    out, grads = probe.outputs(fn, q, k, v, dout.double())
    exact, exact_grads = probe.float64_reference(spec, q, k, v, dout.double())
    assert len(calls) >= 2 and all(2 * min(b - a for a, b in zip(bd, bd[1:])) > m for bd, m in calls)
    assert torch.allclose(out, exact, atol=1e-10)
    for g, r in zip(grads, exact_grads):
        assert torch.allclose(g, r, atol=1e-10)
    with pytest.raises(ValueError, match="tokens past the last sequence are not taken"):
        fn(*(torch.cat((x, x[:1])) for x in (q, k, v)))


def test_probe_child_results_survive_a_crash(probe, monkeypatch):
    """A child that faults after its first case keeps that case's result and
    names the fault for the rest; a timeout likewise."""
    import json
    import subprocess
    import types

    specs = [dict(a=1), dict(b=2)]

    def crashed(cmd, **kw):
        assert json.loads(cmd[cmd.index("--spec") + 1]) == specs
        return types.SimpleNamespace(stdout='{"forward_ms": 1.0}\n', returncode=-6,
                                     stderr="x\nRuntimeError: CUDA error: an illegal memory access was encountered\n")
    monkeypatch.setattr(probe.subprocess, "run", crashed)
    assert probe.run_child("direct", specs) == [
        ({"forward_ms": 1.0}, None),
        (None, "child exited -6: x | RuntimeError: CUDA error: an illegal memory access was encountered")]

    def timed_out(cmd, **kw):
        raise subprocess.TimeoutExpired(cmd, 1, output=b'{"forward_ms": 2.0}\n')
    monkeypatch.setattr(probe.subprocess, "run", timed_out)
    assert probe.run_child("nested", specs) == [({"forward_ms": 2.0}, None),
                                                (None, f"child timed out after {probe.CHILD_TIMEOUT_S} s")]


# ------------------------------------------------------------ the frontend provider, with a stand-in
def frontend_standin_for(calls):
    """A CPU stand-in for nvidia-cudnn-frontend's cudnn.sdpa_torch on the
    THD path: differentiable float64 attention per sequence (top-left
    causal), tokens outside every sequence NaN; checks the route's bucketing."""
    def standin(q, k, v, *, scale=None, is_causal=False, cu_seqlens_q=None, cu_seqlens_kv=None, max_seqlen_q=0,
                max_seqlen_kv=0, return_lse=False):
        calls.append(dict(cu_q=cu_seqlens_q.tolist(), cu_k=cu_seqlens_kv.tolist(), max_q=max_seqlen_q,
                          max_k=max_seqlen_kv, lse=return_lse, causal=is_causal, scale=scale))
        bq, bk = cu_seqlens_q.tolist(), cu_seqlens_kv.tolist()
        assert len(bq) == len(bk) and (len(bq) - 1) % ragged.BUCKET_BATCH == 0
        assert all(0 <= b - a <= max_seqlen_q for a, b in zip(bq, bq[1:]))
        mask = "causal" if is_causal else "no_mask"
        pieces = []
        for a, b, c, e in zip(bq, bq[1:], bk, bk[1:]):
            if b > a:
                pieces.append(attend(q[a:b].double(), k[c:e].double(), v[c:e].double(), mask, None, scale))
        out = torch.cat(pieces + [torch.full((q.shape[0] - bq[-1],) + q.shape[1:], float("nan"),
                                             dtype=torch.float64)]).to(q.dtype)
        return (out, torch.zeros(q.shape[0], q.shape[1], 1)) if return_lse else out
    return standin


@pytest.fixture
def frontend_calls(monkeypatch, emulated_h200):
    monkeypatch.setattr(routing, "_ragged_support", {"torch": True, "frontend": True, "cudnn": 91900})
    return record_calls(monkeypatch, ragged, "_frontend_forward", frontend_standin_for)


@pytest.mark.parametrize("mask,lengths,hk", [("padding", [5, 11, 1, 7], 4), ("padding_causal", [9, 0, 6], 2)])
def test_frontend_route_trains_and_matches_seqfuse_cpu(frontend_calls, mask, lengths, hk):
    """Forward and gradients through the frontend provider (bucketed
    cu_seqlens, rounded max lengths) against seqfuse's CPU kernels."""
    seqfuse.ops.attn.set_attention_cudnn_ragged(True, "frontend")
    q, k, v, kw = thd_case(lengths, hk=hk)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    name, reason = seqfuse.ops.attention_backend(q, k, v, attn_mask_type=mask, **kw)
    assert name == "cudnn_ragged" and reason.endswith("through nvidia-cudnn-frontend's cudnn.sdpa_torch")
    out = seqfuse.ops.attention(q, k, v, attn_mask_type=mask, softmax_scale=0.3, **kw)
    call = frontend_calls[-1]
    bounds = cu_seqlens(lengths).tolist()
    assert call["cu_q"] == bounds + [bounds[-1]] * (16 - len(lengths)) and call["cu_k"] == call["cu_q"]
    assert (call["max_q"], call["max_k"], call["lse"], call["causal"], call["scale"]) == (64, 64, True,
                                                                                          "causal" in mask, 0.3)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    seqfuse.ops.set_attention_backend("seqfuse")
    ref = seqfuse.ops.attention(q, k, v, attn_mask_type=mask, softmax_scale=0.3, **kw)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    assert rel_error(out, ref) <= pair_tol(torch.bfloat16)
    for g, r in zip(grads, ref_grads):
        assert rel_error(g, r) <= pair_tol(torch.bfloat16, BACKWARD_FACTOR)


def test_frontend_provider_forced_and_absent(frontend_calls, monkeypatch):
    monkeypatch.setattr(routing, "_backend", None)
    monkeypatch.setenv("SEQFUSE_ATTN_BACKEND", "cudnn_ragged")
    monkeypatch.setattr(routing, "_ragged_on", None)
    monkeypatch.setenv("SEQFUSE_ATTN_CUDNN_RAGGED", "frontend")
    q, k, v, kw = thd_case([5, 7, 3])
    q.requires_grad_()
    assert seqfuse.ops.attention_backend(q, k, v, **kw)[0] == "cudnn_ragged"  # gradients too
    monkeypatch.setattr(routing, "_ragged_support", {"torch": True, "frontend": False, "cudnn": 91900})
    monkeypatch.setattr(routing, "_choices", {})
    with pytest.raises(NotImplementedError, match="frontend: the nvidia-cudnn-frontend package"):
        seqfuse.ops.attention(q, k, v, **kw)


def test_frontend_sdpa_absent(monkeypatch):
    """Without the package (or with one lacking sdpa_torch) the provider is
    reported absent instead of raising."""
    import sys
    import types

    monkeypatch.setitem(sys.modules, "cudnn", None)  # import cudnn raises ImportError
    assert ragged.frontend_sdpa() is None
    monkeypatch.setitem(sys.modules, "cudnn", types.ModuleType("cudnn"))  # an old frontend without sdpa_torch
    assert ragged.frontend_sdpa() is None
    fake = types.ModuleType("cudnn")
    fake.sdpa_torch = print
    monkeypatch.setitem(sys.modules, "cudnn", fake)
    assert ragged.frontend_sdpa() is print


def test_frontend_that_does_not_load_is_named(monkeypatch, caplog):
    """An installed frontend whose library fails to load is unavailable, and
    the log says why (once), rather than calling it not installed."""
    import sys
    import types

    class Broken(types.ModuleType):
        def __getattr__(self, name):
            raise OSError("libcudnn.so.9: cannot open shared object file")

    monkeypatch.setitem(sys.modules, "cudnn", Broken("cudnn"))
    monkeypatch.setattr(ragged, "_frontend_load_error", [])
    with caplog.at_level(logging.WARNING, logger="seqfuse"):
        assert ragged.frontend_sdpa() is None
        assert ragged.frontend_sdpa() is None
    assert caplog.text.count("does not load (OSError: libcudnn.so.9") == 1
