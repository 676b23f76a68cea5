"""The attention backend choice of ops.attention (python/seqfuse/ops/attn/_routing.py):
SEQFUSE_ATTN_BACKEND and set_attention_backend, every eligibility rule of
the cuDNN route (cudnn_eligibility, a pure function, and attention_backend
on CPU tensors), forced "cudnn" refusing ineligible calls, CPU calls in auto
keeping seqfuse's CPU path bit for bit, and the route itself run on the CPU
with SDPA's math backend standing in for cuDNN (permutations, scale,
is_causal, the copy made only when needed, the INFO line, the fallback on a
RuntimeError and its memory).  CUDA tests (H200): the cuDNN route against
seqfuse's kernels and the float64 reference, auto's pick at ESM-2's shape,
where the calls cuDNN refuses go, and a TransformerLayer under both
backends.  The flash and torch_fp32 routes: tests/test_attn_routes*.py."""
import logging
import random

import pytest
import torch
import torch.nn.functional as F

import seqfuse
from attn_ref import cu_seqlens
from helpers import BACKWARD_FACTOR, fresh_routing, grads_of, rel_error, rel_tol
from seqfuse.ops.attn import _routing as routing
from test_attn_cuda import check, make_case, run_reference

ESM_REASON = "bshd no_mask d=64 bfloat16 runs cuDNN fused attention through torch SDPA"
ESM_LOG = ("seqfuse attention: bshd no_mask d=64 bfloat16 runs cuDNN fused attention through torch SDPA "
           "(set SEQFUSE_ATTN_BACKEND=seqfuse for seqfuse's kernels)")


@pytest.fixture(autouse=True)
def restore_backend(monkeypatch):
    """Each test leaves the process's backend choice and the choice's caches
    as it found them (the backend and the ragged route as the environment set them)."""
    fresh_routing(monkeypatch, backend=routing._backend, ragged_on=routing._ragged_on)


@pytest.fixture
def emulated_h200(monkeypatch):
    """Runs the cuDNN route on the CPU: the device facts say CUDA 9.0 and SDPA
    may use its math backend (which runs on the CPU)."""
    monkeypatch.setattr(routing, "_device_facts", lambda device: ("cuda", (9, 0)))
    monkeypatch.setattr(routing, "_SDPA_BACKENDS", [routing.SDPBackend.MATH])


def layout(fmt, b, s, h, d, dtype=torch.bfloat16, device="cpu", requires_grad=False):
    shape = (b, s, h, d) if fmt == "bshd" else (s, b, h, d)
    x = torch.randn(shape, device=device).to(dtype)
    return x.requires_grad_(requires_grad)


# ------------------------------------------------------------------ the choice
@pytest.mark.parametrize("value,expected", [(None, "auto"), ("", "auto"), ("auto", "auto"),
                                            ("seqfuse", "seqfuse"), ("cudnn", "cudnn"), (" seqfuse ", "seqfuse")])
def test_env_values(monkeypatch, value, expected):
    monkeypatch.setattr(routing, "_backend", None)
    if value is None:
        monkeypatch.delenv("SEQFUSE_ATTN_BACKEND", raising=False)
    else:
        monkeypatch.setenv("SEQFUSE_ATTN_BACKEND", value)
    q = layout("bshd", 1, 8, 2, 16)
    if expected == "cudnn":
        with pytest.raises(NotImplementedError, match="device: cpu tensors"):
            seqfuse.ops.attention(q, q, q)
    else:
        seqfuse.ops.attention(q, q, q)
    assert routing._backend == expected
    if expected == "seqfuse":
        assert seqfuse.ops.attention_backend(q, q, q) == (
            "seqfuse", "backend 'seqfuse' chosen (SEQFUSE_ATTN_BACKEND or set_attention_backend)")
    elif expected == "auto":
        assert seqfuse.ops.attention_backend(q, q, q) == (
            "seqfuse", "device: cpu tensors (cuDNN fused attention is CUDA only); flash route: device: cpu tensors "
                       "(FlashAttention is CUDA only)")


@pytest.mark.parametrize("value", ["FLASH", "CUDNN", "seqfuse,cudnn", "0", "torch_fp32"])
def test_env_bad_value_raises_at_the_first_call(monkeypatch, value):
    monkeypatch.setattr(routing, "_backend", None)
    monkeypatch.setenv("SEQFUSE_ATTN_BACKEND", value)
    q = layout("bshd", 1, 8, 2, 16)
    for _ in range(2):  # not remembered: every call says it until it is fixed
        with pytest.raises(ValueError) as e:
            seqfuse.ops.attention(q, q, q)
        assert str(e.value) == f"SEQFUSE_ATTN_BACKEND must be one of 'auto', 'seqfuse', 'cudnn', 'flash', 'cudnn_ragged', got {value!r}"
    with pytest.raises(ValueError, match="SEQFUSE_ATTN_BACKEND must be one of"):
        seqfuse.ops.attention_backend(q, q, q)
    monkeypatch.setenv("SEQFUSE_ATTN_BACKEND", "seqfuse")
    seqfuse.ops.attention(q, q, q)
    assert routing._backend == "seqfuse"


def test_env_is_read_once(monkeypatch):
    monkeypatch.setattr(routing, "_backend", None)
    monkeypatch.setenv("SEQFUSE_ATTN_BACKEND", "seqfuse")
    q = layout("bshd", 1, 8, 2, 16)
    seqfuse.ops.attention(q, q, q)
    monkeypatch.setenv("SEQFUSE_ATTN_BACKEND", "cudnn")  # read again, a CPU call would raise
    seqfuse.ops.attention(q, q, q)
    assert seqfuse.ops.attention_backend(q, q, q)[0] == "seqfuse"


@pytest.mark.parametrize("name", ["CUDNN", "Flash", "torch_fp32", "", None, 1, ["cudnn"]])
def test_set_attention_backend_rejects(name):
    before = routing._backend
    with pytest.raises(ValueError) as e:
        seqfuse.ops.set_attention_backend(name)
    assert str(e.value) == ("set_attention_backend: argument 'name' must be one of 'auto', 'seqfuse', 'cudnn', "
                            f"'flash', 'cudnn_ragged', got {name!r}")
    assert routing._backend == before


def test_set_attention_backend_overrides_the_environment(monkeypatch):
    monkeypatch.setattr(routing, "_backend", None)
    monkeypatch.setenv("SEQFUSE_ATTN_BACKEND", "seqfuse")
    seqfuse.ops.set_attention_backend("cudnn")
    q = layout("bshd", 1, 8, 2, 16)
    with pytest.raises(NotImplementedError, match="backend 'cudnn' was chosen"):
        seqfuse.ops.attention(q, q, q)
    seqfuse.ops.set_attention_backend("auto")
    assert seqfuse.ops.attention_backend(q, q, q)[1].startswith("device:")


# ------------------------------------------------------------------ the rules
ELIGIBLE = dict(device_type="cuda", capability=(9, 0), qkv_format="bshd", attn_mask_type="no_mask", s_q=1024,
                s_kv=1024, window_size=None, dropout_p=0.0, deterministic=False, dtype=torch.bfloat16,
                heads_q=20, heads_kv=20, head_dim=64, cudnn_enabled=True)

BROKEN = [
    ("qkv_format", dict(qkv_format="thd")),
    ("padding", dict(attn_mask_type="padding")),
    ("padding", dict(attn_mask_type="padding_causal")),
    ("padding", dict(attn_mask_type="padding,causal")),
    ("padding", dict(attn_mask_type="padding_causal_bottom_right")),
    ("padding", dict(cu_seqlens=True)),
    ("attn_mask_type", dict(attn_mask_type="arbitrary")),
    ("lengths", dict(s_kv=512)),
    ("lengths", dict(attn_mask_type="causal", s_q=512)),
    ("lengths", dict(attn_mask_type="causal_bottom_right", s_kv=1000)),
    ("lengths", dict(s_q=1, s_kv=1)),  # torch's cuDNN attention refuses key length 1
    ("lengths", dict(s_q=0, s_kv=0)),
    ("lengths", dict(batch=65536)),
    ("lengths", dict(heads_q=65536, heads_kv=65536)),
    ("window", dict(window_size=(0, 0))),
    ("window", dict(window_size=(-1, 0))),  # a causal window without a causal mask
    ("window", dict(window_size=(128, 0), attn_mask_type="causal")),
    ("window", dict(window_size=(-1, 5), attn_mask_type="causal")),
    ("dropout", dict(dropout_p=0.1)),  # cuDNN's version unknown
    ("dropout", dict(dropout_p=0.1, cudnn_version=91101)),  # torch refuses dropout for 91100 < version < 91400
    ("dropout", dict(dropout_p=0.1, cudnn_version=91399)),
    ("dropout", dict(dropout_p=0.1, cudnn_version=91900, explicit_rng=True)),  # seqfuse's Philox mask asked for
    ("dropout", dict(dropout_p=0.1, cudnn_version=91900, head_dim=32)),  # slower than flash's below head dim 64
    ("deterministic", dict(deterministic=True)),
    ("deterministic", dict(deterministic_algorithms=True)),
    ("dtype", dict(dtype=torch.float32)),
    ("dtype", dict(dtype=torch.float64)),
    ("gqa", dict(heads_kv=3)),  # 20 q heads: not a multiple of 3
    ("gqa", dict(heads_kv=0)),
    ("head_dim", dict(head_dim=60)),
    ("head_dim", dict(head_dim=136)),
    ("head_dim", dict(head_dim=256)),
    ("head_dim", dict(head_dim=0)),
    ("device", dict(device_type="cpu", capability=None)),
    ("capability", dict(capability=(8, 0))),
    ("capability", dict(capability=(8, 9))),
    ("capability", dict(capability=(10, 0))),
    ("capability", dict(capability=None)),
    ("cudnn_sdp_enabled", dict(cudnn_enabled=False)),
]

STILL_ELIGIBLE = [
    dict(qkv_format="sbhd"), dict(attn_mask_type="causal"), dict(attn_mask_type="causal_bottom_right"),
    dict(window_size=(-1, -1)), dict(window_size=[-1, -1]), dict(window_size=(-1, 0), attn_mask_type="causal"),
    dict(window_size=(-1, 0), attn_mask_type="causal_bottom_right"), dict(dtype=torch.float16),
    dict(head_dim=8), dict(head_dim=72), dict(head_dim=128), dict(s_q=2, s_kv=2), dict(heads_q=1, heads_kv=1),
    dict(heads_kv=4), dict(heads_kv=1),  # GQA and MQA: SDPA's enable_gqa
    dict(batch=65535, heads_q=65535, heads_kv=65535),
    dict(capability=(8, 0), check_capability=False),  # forced cudnn skips the speed rule
    dict(dropout_p=0.1, cudnn_version=91900), dict(dropout_p=0.5, cudnn_version=91400),
    dict(dropout_p=0.1, cudnn_version=91002), dict(explicit_rng=True),  # rng_state without dropout: no matter
    dict(dropout_p=0.1, cudnn_version=91900, head_dim=128), dict(head_dim=16), dict(dropout_p=0.1, cudnn_version=91100),
    dict(dropout_p=0.1, cudnn_version=91900, head_dim=16, check_capability=False),  # forced: any head dim
]


def test_eligible_base_case():
    assert seqfuse.ops.cudnn_eligibility(**ELIGIBLE) == ("", "")


@pytest.mark.parametrize("rule,change", BROKEN, ids=lambda x: str(x))
def test_each_rule(rule, change):
    got, reason = seqfuse.ops.cudnn_eligibility(**{**ELIGIBLE, **change})
    assert got == rule, reason
    assert reason.startswith(rule + ": ") and len(reason) > len(rule) + 10


@pytest.mark.parametrize("change", STILL_ELIGIBLE, ids=lambda x: str(x))
def test_still_eligible(change):
    assert seqfuse.ops.cudnn_eligibility(**{**ELIGIBLE, **change}) == ("", "")


def test_rules_are_checked_in_the_documented_order():
    # every call-level rule broken at once: removing the first broken one names the next
    order = ["qkv_format", "padding", "lengths", "window", "dropout", "deterministic", "dtype", "gqa",
             "head_dim", "device", "capability", "cudnn_sdp_enabled"]
    broken = dict(qkv_format="thd", cu_seqlens=True, s_kv=3, window_size=(4, 4), dropout_p=0.5,
                  deterministic=True, dtype=torch.float32, heads_kv=3, head_dim=12, device_type="cpu",
                  capability=(8, 0), cudnn_enabled=False)
    fixes = dict(qkv_format="bshd", cu_seqlens=False, s_kv=1024, window_size=None, dropout_p=0.0,
                 deterministic=False, dtype=torch.bfloat16, heads_kv=20, head_dim=64, device_type="cuda",
                 capability=(9, 0), cudnn_enabled=True)
    facts = {**ELIGIBLE, **broken}
    seen = []
    for _ in order:
        rule, _ = seqfuse.ops.cudnn_eligibility(**facts)
        seen.append(rule)
        key = next(k for k in fixes if facts.get(k, False) != fixes[k] and _rule_of(k) == rule)
        facts[key] = fixes[key]
    assert seen == order
    assert seqfuse.ops.cudnn_eligibility(**facts) == ("", "")


def _rule_of(fact):
    return {"cu_seqlens": "padding", "s_kv": "lengths", "window_size": "window", "dropout_p": "dropout",
            "heads_kv": "gqa", "device_type": "device", "cudnn_enabled": "cudnn_sdp_enabled"}.get(fact, fact)


# attention_backend on CPU tensors: the call-level rules come before the device
CPU_CASES = [
    ("qkv_format", "thd", "no_mask", {}),
    ("padding", "bshd", "padding", dict(cu=True)),
    ("padding", "sbhd", "padding_causal", dict(cu=True)),
    ("padding", "bshd", "no_mask", dict(cu=True)),
    ("lengths", "bshd", "no_mask", dict(s_kv=12)),
    ("lengths", "sbhd", "causal", dict(s_kv=12)),
    ("window", "bshd", "no_mask", dict(window_size=(2, 2))),
    ("window", "bshd", "causal", dict(window_size=(3, 0))),
    ("dropout", "bshd", "no_mask", dict(dropout_p=0.1, rng_state=(1, 0))),
    ("deterministic", "bshd", "causal", dict(deterministic=True)),
    ("dtype", "bshd", "no_mask", dict(dtype=torch.float32)),
    ("gqa", "sbhd", "no_mask", dict(hk=3)),  # 2 q heads
    ("head_dim", "bshd", "no_mask", dict(d=20)),
    ("inputs", "bshd", "no_mask", dict(v_dtype=torch.float16)),
    ("device", "bshd", "no_mask", {}),
    ("device", "sbhd", "causal", {}),
    ("device", "bshd", "causal_bottom_right", dict(window_size=(-1, 0))),
]


def cpu_call(fmt, mask, cu=False, s_kv=8, window_size=None, dropout_p=0.0, deterministic=False,
             dtype=torch.bfloat16, hk=2, d=16, v_dtype=None, rng_state=None):
    b, s, h = 2, 8, 2
    if fmt == "thd":
        q = torch.randn(b * s, h, d).to(dtype)
        k = torch.randn(b * s_kv, hk, d).to(dtype)
        cu = True
    else:
        q, k = layout(fmt, b, s, h, d, dtype), layout(fmt, b, s_kv, hk, d, dtype)
    v = k.clone().to(v_dtype or dtype)
    kw = dict(qkv_format=fmt, attn_mask_type=mask, window_size=window_size, dropout_p=dropout_p,
              deterministic=deterministic)
    if rng_state is not None:
        kw["rng_state"] = rng_state
    if cu:
        kw.update(cu_seqlens_q=cu_seqlens([s] * b, "cpu"), cu_seqlens_kv=cu_seqlens([s_kv] * b, "cpu"))
    return q, k, v, kw


@pytest.mark.parametrize("rule,fmt,mask,extra", CPU_CASES, ids=lambda x: str(x))
def test_attention_backend_reasons_on_cpu(rule, fmt, mask, extra):
    seqfuse.ops.set_attention_backend("auto")
    q, k, v, kw = cpu_call(fmt, mask, **extra)
    name, reason = seqfuse.ops.attention_backend(q, k, v, **kw)
    assert name == "seqfuse"
    assert reason.split(":")[0] == rule, reason


def test_attention_backend_validates_like_the_call():
    seqfuse.ops.set_attention_backend("auto")
    q, k, v, kw = cpu_call("bshd", "no_mask")
    with pytest.raises(ValueError, match="attn_mask_type must be one of"):
        seqfuse.ops.attention_backend(q, k, v, attn_mask_type="nomask")
    with pytest.raises(ValueError, match="qkv_format must be"):
        seqfuse.ops.attention_backend(q, k, v, qkv_format="bhsd")
    with pytest.raises(ValueError, match="window_size"):
        seqfuse.ops.attention_backend(q, k, v, window_size=(-3, 0))
    with pytest.raises(TypeError, match="argument 'q' must be a torch.Tensor"):
        seqfuse.ops.attention_backend(None, k, v)


@pytest.mark.parametrize("fmt,mask", [("bshd", "no_mask"), ("sbhd", "causal")])
def test_dropout_takes_cudnn_where_torch_has_it(fmt, mask, emulated_h200, sdpa_calls, monkeypatch):
    """Attention dropout without an explicit rng_state goes to cuDNN (torch's
    dropout inside cuDNN's kernel, its random numbers from torch's generator)
    in training calls at head dims of 64 and more (where it measured faster
    than the flash route's), except on the cuDNN versions torch refuses it
    on (9.11-9.13) and where the version is unknown; the route hands
    dropout_p to SDPA."""
    monkeypatch.setattr(routing, "_choices", {})
    monkeypatch.setitem(routing._ragged_support, "cudnn", 91900)
    seqfuse.ops.set_attention_backend("auto")
    q, k, v = (layout(fmt, 2, 8, 2, 64, requires_grad=True) for _ in range(3))
    name, reason = seqfuse.ops.attention_backend(q, k, v, qkv_format=fmt, attn_mask_type=mask, dropout_p=0.25)
    assert name == "cudnn" and reason == f"{fmt} {mask} d=64 bfloat16 dropout runs cuDNN fused attention through " \
                                         "torch SDPA", reason
    with torch.no_grad():  # the same route without gradients: a recompute draws its mask where the forward did
        assert seqfuse.ops.attention_backend(q, k, v, qkv_format=fmt, attn_mask_type=mask, dropout_p=0.25)[0] == \
            "cudnn"
    q32 = layout(fmt, 2, 8, 2, 32, requires_grad=True)  # below head dim 64: the flash route's dropout, faster
    assert seqfuse.ops.attention_backend(q32, q32, q32, qkv_format=fmt, attn_mask_type=mask, dropout_p=0.25)[0] == \
        "flash"
    out = seqfuse.ops.attention(q, k, v, qkv_format=fmt, attn_mask_type=mask, dropout_p=0.25)
    out.float().sum().backward()
    assert len(sdpa_calls) == 1 and sdpa_calls[0][1]["dropout_p"] == 0.25
    assert sdpa_calls[0][1]["is_causal"] == (mask != "no_mask")
    _assert_finite(out, q.grad, k.grad, v.grad)
    kw = dict(qkv_format=fmt, attn_mask_type=mask, dropout_p=0.25)
    for version, says in ((91101, "cuDNN 91101 "), (91300, "cuDNN 91300 "), (None, "the cuDNN version unknown ")):
        monkeypatch.setitem(routing._ragged_support, "cudnn", version)  # auto: the flash route takes it
        seqfuse.ops.set_attention_backend("auto")
        assert seqfuse.ops.attention_backend(q, k, v, **kw)[0] == "flash"
        seqfuse.ops.set_attention_backend("cudnn")  # forced cudnn: refused, the rule named
        with pytest.raises(NotImplementedError, match=f"cannot run cuDNN fused attention: dropout: dropout_p 0.25 "
                                                      f"and {says}"):
            seqfuse.ops.attention_backend(q, k, v, **kw)
    monkeypatch.setitem(routing._ragged_support, "cudnn", 91900)
    seqfuse.ops.set_attention_backend("auto")
    name, reason = seqfuse.ops.attention_backend(q, k, v, **kw, rng_state=(3, 0))
    assert name == "seqfuse" and reason.startswith("dropout: dropout_p 0.25 with an explicit rng_state"), reason
    seqfuse.ops.set_attention_backend("cudnn")
    with pytest.raises(NotImplementedError, match="cannot run cuDNN fused attention: dropout: "):
        seqfuse.ops.attention(q, k, v, **kw, rng_state=(3, 0))


def test_dropout_recompute_takes_the_forwards_route(emulated_h200, monkeypatch):
    """A reentrant checkpoint runs its forward without gradients and its
    recompute with them: a dropout call must take one route both times (the
    same generator state gives the same mask only on the same kernel), so
    the route of a dropout call never depends on grad mode."""
    from torch.utils.checkpoint import checkpoint

    monkeypatch.setitem(routing._ragged_support, "cudnn", 91900)
    seqfuse.ops.set_attention_backend("auto")
    routes_taken = []
    real = routing._run_route
    monkeypatch.setattr(routing, "_run_route", lambda name, *a, **k: (routes_taken.append(name), real(name, *a, **k))[1])
    for d in (64, 32):  # cuDNN's dropout, and the flash route's below head dim 64
        q = layout("bshd", 2, 8, 2, d, requires_grad=True)
        if d == 64:  # (the flash route's kernel has no CPU stand-in here: only its choice is checked)
            out = checkpoint(lambda t: seqfuse.ops.attention(t, t, t, dropout_p=0.2), q, use_reentrant=True)
            out.float().sum().backward()
            assert routes_taken == ["cudnn", "cudnn"], routes_taken
        with torch.no_grad():
            no_grad = seqfuse.ops.attention_backend(q, q, q, dropout_p=0.2)[0]
        assert no_grad == seqfuse.ops.attention_backend(q, q, q, dropout_p=0.2)[0] == ("cudnn" if d == 64 else "flash")


@pytest.mark.parametrize("rule,fmt,mask,extra", [c for c in CPU_CASES if c[0] != "inputs"],
                         ids=lambda x: str(x))
def test_forced_cudnn_refuses_ineligible_calls(rule, fmt, mask, extra):
    seqfuse.ops.set_attention_backend("cudnn")
    q, k, v, kw = cpu_call(fmt, mask, **extra)
    for call in (seqfuse.ops.attention, seqfuse.ops.attention_backend):
        with pytest.raises(NotImplementedError) as e:
            call(q, k, v, **kw)
        assert f"cannot run cuDNN fused attention: {rule}: " in str(e.value)


def test_forced_cudnn_leaves_bad_inputs_to_seqfuse_checks():
    seqfuse.ops.set_attention_backend("cudnn")
    q, k, v, kw = cpu_call("bshd", "no_mask")
    with pytest.raises(TypeError, match="argument 'v' must have dtype bfloat16"):
        seqfuse.ops.attention(q, k, v.float(), **kw)
    with pytest.raises(ValueError, match="same batch size"):
        seqfuse.ops.attention(q, k[:1], v[:1], **kw)


def test_explicit_halves_never_dispatch(sdpa_calls, emulated_h200):
    seqfuse.ops.set_attention_backend("cudnn")
    q, k, v, _ = cpu_call("bshd", "no_mask")
    assert seqfuse.ops.attention_backend(q, k, v)[0] == "cudnn"
    out, lse = seqfuse.ops.attention_forward(q, k, v)
    seqfuse.ops.attention_backward(torch.randn_like(out), q, k, v, out, lse)
    assert sdpa_calls == []


@pytest.mark.parametrize("fmt,mask", [("bshd", "no_mask"), ("sbhd", "causal"), ("bshd", "causal_bottom_right")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_auto_on_cpu_runs_seqfuse_cpu_path_unchanged(fmt, mask, dtype, sdpa_calls):
    seqfuse.ops.set_attention_backend("auto")
    q, k, v = (layout(fmt, 2, 9, 3, 16, dtype, requires_grad=True) for _ in range(3))
    dout = torch.randn(q.shape).to(dtype)
    out = seqfuse.ops.attention(q, k, v, qkv_format=fmt, attn_mask_type=mask)
    out.backward(dout)
    kw = dict(qkv_format=fmt, attn_mask_type=mask)
    out_ref, lse = seqfuse.ops.attention_forward(q, k, v, **kw)
    grads_ref = seqfuse.ops.attention_backward(dout, q, k, v, out_ref, lse, **kw)
    assert torch.equal(out, out_ref)
    for g, r in zip((q.grad, k.grad, v.grad), grads_ref):
        assert torch.equal(g, r)
    assert sdpa_calls == []


def test_device_facts_ask_capability_once_per_device(monkeypatch):
    asked = []

    def capability(index):
        asked.append(index)
        return (9, 0)

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    for _ in range(3):
        assert routing._device_facts(torch.device("cuda", 1)) == ("cuda", (9, 0))
    assert routing._device_facts(torch.device("cuda", 0)) == ("cuda", (9, 0))
    assert asked == [1, 0]
    assert routing._device_facts(torch.device("cpu")) == ("cpu", None)


def test_choice_is_cached_per_call_key(monkeypatch):
    facts = []
    monkeypatch.setattr(routing, "_device_facts", lambda device: facts.append(device) or ("cuda", (9, 0)))
    seqfuse.ops.set_attention_backend("auto")
    q, k, v, _ = cpu_call("bshd", "no_mask")
    for _ in range(5):
        assert seqfuse.ops.attention_backend(q, k, v)[0] == "cudnn"
    assert len(facts) == 1
    seqfuse.ops.attention_backend(q, k, v, attn_mask_type="causal")  # a new key
    assert len(facts) == 2
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:  # the global switches are read at every call: without cuDNN a training call takes the flash route
        qg = q.detach().requires_grad_()
        assert seqfuse.ops.attention_backend(qg, k, v)[0] == "flash"
        torch.backends.cuda.enable_flash_sdp(False)
        name, reason = seqfuse.ops.attention_backend(qg, k, v)
        assert name == "seqfuse" and reason.startswith("cudnn_sdp_enabled: ") and \
            "; flash route: flash_sdp_enabled: " in reason
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)
        torch.backends.cuda.enable_flash_sdp(True)
    assert seqfuse.ops.attention_backend(q, k, v)[0] == "cudnn"
    torch.use_deterministic_algorithms(True)
    try:
        assert seqfuse.ops.attention_backend(q, k, v)[1].startswith("deterministic: torch.use_deterministic")
        torch.use_deterministic_algorithms(True, warn_only=True)
        assert seqfuse.ops.attention_backend(q, k, v)[0] == "cudnn"
    finally:
        torch.use_deterministic_algorithms(False)


# ------------------------------------------- the cuDNN route, emulated on CPU
@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
@pytest.mark.parametrize("mask", ["no_mask", "causal", "causal_bottom_right"])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_route_layouts_scale_and_causal(fmt, mask, scale, sdpa_calls, emulated_h200):
    b, s, h, d = 2, 7, 3, 16  # all different: a wrong permutation changes shapes or values
    seqfuse.ops.set_attention_backend("auto")
    q, k, v = (layout(fmt, b, s, h, d, requires_grad=True) for _ in range(3))
    dout = torch.randn(q.shape).to(q.dtype)
    assert seqfuse.ops.attention_backend(q, k, v, qkv_format=fmt, attn_mask_type=mask) == \
        ("cudnn", f"{fmt} {mask} d={d} bfloat16 runs cuDNN fused attention through torch SDPA")
    out = seqfuse.ops.attention(q, k, v, qkv_format=fmt, attn_mask_type=mask, softmax_scale=scale)
    out.backward(dout)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    assert len(sdpa_calls) == 1
    args, kwargs, _ = sdpa_calls[0]
    for x, arg in zip((q, k, v), args):  # views of the caller's memory, [b, h, s, d]
        assert arg.shape == (b, h, s, d) and arg.data_ptr() == x.data_ptr() and not arg.is_contiguous()
    assert kwargs == dict(is_causal=mask != "no_mask", scale=d ** -0.5 if scale is None else scale)
    grads = (q.grad, k.grad, v.grad)

    seqfuse.ops.set_attention_backend("seqfuse")
    qs, ks, vs = (x.detach().clone().requires_grad_() for x in (q, k, v))
    ref = seqfuse.ops.attention(qs, ks, vs, qkv_format=fmt, attn_mask_type=mask, softmax_scale=scale)
    ref.backward(dout)
    assert len(sdpa_calls) == 1
    assert rel_error(out, ref) <= rel_tol(torch.bfloat16)
    for g, r in zip(grads, (qs.grad, ks.grad, vs.grad)):
        assert rel_error(g, r) <= rel_tol(torch.bfloat16, BACKWARD_FACTOR)


def test_route_without_grad(sdpa_calls, emulated_h200):
    seqfuse.ops.set_attention_backend("auto")
    q, k, v = (layout("sbhd", 2, 6, 2, 8, requires_grad=True) for _ in range(3))
    with torch.no_grad():
        out = seqfuse.ops.attention(q, k, v, qkv_format="sbhd")
    assert out.grad_fn is None and len(sdpa_calls) == 1
    seqfuse.ops.set_attention_backend("seqfuse")
    assert rel_error(out, seqfuse.ops.attention(q, k, v, qkv_format="sbhd")) <= rel_tol(torch.bfloat16)


def test_route_copies_only_when_needed(monkeypatch, emulated_h200):
    seqfuse.ops.set_attention_backend("auto")
    real = F.scaled_dot_product_attention
    returned = []

    def bshd_memory(*args, **kwargs):  # as torch's cuDNN path: [b, h, s, d] over bshd memory
        out = real(*args, **kwargs).transpose(1, 2).contiguous().transpose(1, 2)
        returned.append(out)
        return out

    monkeypatch.setattr(F, "scaled_dot_product_attention", bshd_memory)
    q = layout("bshd", 2, 5, 3, 8)
    out = seqfuse.ops.attention(q, q, q)
    assert out.is_contiguous() and out.data_ptr() == returned[-1].data_ptr()  # no copy
    q = layout("sbhd", 2, 5, 3, 8)
    out = seqfuse.ops.attention(q, q, q, qkv_format="sbhd")
    assert out.is_contiguous() and out.data_ptr() != returned[-1].data_ptr()  # copied into sbhd


@pytest.mark.parametrize("grad", [True, False])
def test_route_calls_the_cudnn_op_with_sdpas_arguments(grad, monkeypatch, emulated_h200, sdpa_calls):
    """Where torch's SDPA would pick cuDNN for the call (_torch_picks_cudnn),
    the route calls torch's cuDNN op itself with the arguments SDPA gives
    it: [b, h, s, d] views, no bias, the log-sum-exp only where gradients
    are wanted, dropout, is_causal, no debug mask, the scale (the op here a
    stand-in running SDPA's math backend); the result equals the SDPA path's."""
    seqfuse.ops.set_attention_backend("cudnn")
    monkeypatch.setattr(routing, "_SDPA_BACKENDS", routing._CUDNN_ONLY)
    monkeypatch.setattr(routing, "_direct_cudnn", [True])
    picks, seen = [], []
    monkeypatch.setattr(routing, "_torch_picks_cudnn",
                        lambda *args: picks.append((args[0].shape, args[1].shape, *args[3:])) or True)

    def op(q, k, v, bias, lse, p, causal, debug, *, scale):
        seen.append((q.shape, k.shape, bias, lse, p, causal, debug, scale))
        with routing.sdpa_kernel([routing.SDPBackend.MATH]):
            return (torch._C._nn.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True),)

    monkeypatch.setattr(routing, "_cudnn_attention", op)
    q = layout("sbhd", 2, 16, 4, 32, requires_grad=grad)
    k, v = (layout("sbhd", 2, 16, 2, 32, requires_grad=grad) for _ in range(2))
    out = seqfuse.ops.attention(q, k, v, qkv_format="sbhd", attn_mask_type="causal", softmax_scale=0.3)
    assert picks == [((2, 4, 16, 32), (2, 2, 16, 32), True, 0.3, 0.0, True, grad)] and not sdpa_calls
    assert seen == [((2, 4, 16, 32), (2, 2, 16, 32), None, grad, 0.0, True, False, 0.3)]
    assert out.shape == q.shape and out.is_contiguous() and (out.grad_fn is not None) == grad
    monkeypatch.setattr(routing, "_SDPA_BACKENDS", [routing.SDPBackend.MATH])  # the SDPA path, as before
    assert torch.equal(out, seqfuse.ops.attention(q, k, v, qkv_format="sbhd", attn_mask_type="causal",
                                                  softmax_scale=0.3))
    assert len(sdpa_calls) == 1 and len(seen) == 1


def test_route_takes_sdpa_where_torch_would_not_pick_cudnn(monkeypatch, emulated_h200, sdpa_calls):
    """Where SDPA's own choice is not cuDNN (or raises), the call goes through
    SDPA itself, which runs or refuses it as it would; each answer is asked
    once per shapes, strides, dtype, device, mask, dropout and gradient need."""
    asked = []

    def choice(q, k, v, **kw):
        asked.append(kw)
        if kw["dropout_p"] > 0.0:
            raise RuntimeError("No available kernel. Aborting execution.")
        return routing.SDPBackend.CUDNN_ATTENTION.value if kw["is_causal"] else routing.SDPBackend.MATH.value

    monkeypatch.setattr(torch, "_fused_sdp_choice", choice)
    q = torch.randn(1, 2, 8, 16)
    for _ in range(2):
        assert routing._torch_picks_cudnn(q, q, q, True, None, 0.0, False, False)
        assert not routing._torch_picks_cudnn(q, q, q, False, None, 0.0, False, False)
        assert not routing._torch_picks_cudnn(q, q, q, True, None, 0.1, False, False)
        assert routing._torch_picks_cudnn(q, q, q, True, 0.5, 0.0, True, True)  # another gradient need: asked
        assert routing._torch_picks_cudnn(q.half(), q.half(), q.half(), True, None, 0.0, False, False)  # dtype
    assert [(kw["is_causal"], kw["dropout_p"], kw["enable_gqa"]) for kw in asked] == [
        (True, 0.0, False), (False, 0.0, False), (True, 0.1, False), (True, 0.0, True), (True, 0.0, False)]
    seqfuse.ops.set_attention_backend("cudnn")
    monkeypatch.setattr(routing, "_SDPA_BACKENDS", routing._CUDNN_ONLY)
    monkeypatch.setattr(routing, "_direct_cudnn", [True])
    monkeypatch.setattr(routing, "_cudnn_attention", lambda *args, **kwargs: pytest.fail("the op was called"))
    real_context = routing.sdpa_kernel
    monkeypatch.setattr(routing, "sdpa_kernel", lambda backends: real_context([routing.SDPBackend.MATH]))
    x = layout("bshd", 1, 8, 2, 16)
    out = seqfuse.ops.attention(x, x, x)  # torch's choice (the stand-in's) is not cuDNN: SDPA runs it
    assert len(sdpa_calls) == 1 and out.shape == x.shape


def test_direct_cudnn_call_needs_sdpas_signature_and_no_autocast_kernel(monkeypatch, emulated_h200, sdpa_calls):
    """_direct_cudnn_ok, decided once: torch's cuDNN op taking SDPA's
    arguments in order, its backend choice taking enable_gqa and the op
    without an autocast kernel; a torch where any of it fails runs every
    call through SDPA."""
    monkeypatch.setattr(routing, "_direct_cudnn", [])
    assert routing._direct_cudnn_ok() == (
        [a.name for a in torch.ops.aten._scaled_dot_product_cudnn_attention.default._schema.arguments] ==
        routing._CUDNN_OP_ARGS and not torch._C._dispatch_has_kernel_for_dispatch_key(
            "aten::_scaled_dot_product_cudnn_attention", "AutocastCUDA"))
    def no_dispatcher_query(op, key):
        raise RuntimeError(f"no operator {op}")

    for patch in (("_CUDNN_OP_ARGS", routing._CUDNN_OP_ARGS[:3] + ["attn_mask"] + routing._CUDNN_OP_ARGS[4:]),
                  ("autocast", lambda op, key: key == "AutocastCUDA"), ("autocast", no_dispatcher_query)):
        monkeypatch.setattr(routing, "_direct_cudnn", [])
        with monkeypatch.context() as m:
            if patch[0] == "autocast":  # an autocast kernel, or a torch whose dispatcher cannot be asked
                m.setattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", patch[1])
            else:
                m.setattr(routing, *patch)
            assert routing._direct_cudnn_ok() is False
        assert routing._direct_cudnn == [False]  # remembered
    seqfuse.ops.set_attention_backend("cudnn")
    monkeypatch.setattr(routing, "_SDPA_BACKENDS", routing._CUDNN_ONLY)
    monkeypatch.setattr(routing, "_torch_picks_cudnn", lambda *args: True)
    monkeypatch.setattr(routing, "_cudnn_attention", lambda *args, **kwargs: pytest.fail("the op was called"))
    real_context = routing.sdpa_kernel
    monkeypatch.setattr(routing, "sdpa_kernel", lambda backends: real_context([routing.SDPBackend.MATH]))
    x = layout("bshd", 1, 8, 2, 16)
    assert seqfuse.ops.attention(x, x, x).shape == x.shape and len(sdpa_calls) == 1


def test_route_copies_inputs_without_unit_stride_head_dim(sdpa_calls, emulated_h200):
    seqfuse.ops.set_attention_backend("auto")
    base = layout("bshd", 2, 5, 3, 16)
    q = base.transpose(-1, -2).contiguous().transpose(-1, -2)  # same values, head dim stride h
    assert q.stride(-1) != 1
    out = seqfuse.ops.attention(q, base, base)
    assert sdpa_calls[0][0][0].stride(-1) == 1 and sdpa_calls[0][0][1].data_ptr() == base.data_ptr()
    seqfuse.ops.set_attention_backend("seqfuse")
    assert rel_error(out, seqfuse.ops.attention(q, base, base)) <= rel_tol(torch.bfloat16)


def test_route_logs_once_per_reason(caplog, emulated_h200):
    seqfuse.ops.set_attention_backend("auto")
    q = layout("bshd", 1, 4, 2, 64)
    with caplog.at_level(logging.INFO, logger="seqfuse"):
        for _ in range(3):
            seqfuse.ops.attention(q, q, q)
        q32 = layout("bshd", 1, 4, 2, 32)
        seqfuse.ops.attention(q32, q32, q32)
    lines = [r.getMessage() for r in caplog.records if "cuDNN" in r.getMessage()]
    assert lines == [ESM_LOG, ESM_LOG.replace("d=64", "d=32")]
    assert all(r.levelno == logging.INFO for r in caplog.records if "cuDNN" in r.getMessage())
    caplog.clear()
    seqfuse.ops.set_attention_backend("cudnn")  # forced: no line (the user asked for it)
    with caplog.at_level(logging.INFO, logger="seqfuse"):
        seqfuse.ops.attention(q, q, q, attn_mask_type="causal")
    assert not [r for r in caplog.records if "cuDNN" in r.getMessage()]


def test_auto_falls_back_on_runtime_error_and_remembers(monkeypatch, caplog):
    # the device facts say H200, but SDPA keeps its cuDNN-only restriction: on
    # the CPU torch raises a RuntimeError ("No viable backend ...")
    monkeypatch.setattr(routing, "_device_facts", lambda device: ("cuda", (9, 0)))
    seqfuse.ops.set_attention_backend("auto")
    q, k, v = (layout("bshd", 2, 6, 2, 16, requires_grad=True) for _ in range(3))
    assert seqfuse.ops.attention_backend(q, k, v)[0] == "cudnn"
    with caplog.at_level(logging.INFO, logger="seqfuse"):
        out = seqfuse.ops.attention(q, k, v)
        again = seqfuse.ops.attention(q, k, v)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "cuDNN fused attention (torch SDPA) failed on bshd no_mask d=16 bfloat16: " in warnings[0]
    assert "No viable backend" in warnings[0] and "run on seqfuse's kernels" in warnings[0]
    out_ref, _ = seqfuse.ops.attention_forward(q, k, v)
    assert torch.equal(out, out_ref) and torch.equal(again, out_ref)
    out.sum().backward()  # seqfuse's autograd function
    assert q.grad is not None and torch.isfinite(q.grad.float()).all()
    name, reason = seqfuse.ops.attention_backend(q, k, v)
    assert name == "seqfuse" and reason.startswith("cudnn_failed: ") and "No viable backend" in reason
    # the memory is per call (shapes, strides, dtype, mask, device): a causal call and another
    # sequence length still try cuDNN
    assert seqfuse.ops.attention_backend(q, k, v, attn_mask_type="causal")[0] == "cudnn"
    q8 = layout("bshd", 2, 8, 2, 16)
    assert seqfuse.ops.attention_backend(q8, q8, q8)[0] == "cudnn"
    # forced cudnn re-raises torch's error
    seqfuse.ops.set_attention_backend("cudnn")
    with pytest.raises(RuntimeError, match="No viable backend"):
        seqfuse.ops.attention(q, k, v)
    # a new choice forgets the failures
    seqfuse.ops.set_attention_backend("auto")
    assert seqfuse.ops.attention_backend(q, k, v)[0] == "cudnn"


def test_forced_cudnn_refuses_packed_calls(emulated_h200):
    """thd goes to the flash route in auto (tests/test_attn_routes.py); forced
    cudnn refuses it with the rule."""
    q = torch.randn(12, 2, 16).bfloat16()
    cu = cu_seqlens([5, 7])
    kw = dict(qkv_format="thd", attn_mask_type="padding", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=7,
              max_seqlen_kv=7)
    seqfuse.ops.set_attention_backend("cudnn")
    with pytest.raises(NotImplementedError, match="qkv_format"):
        seqfuse.ops.attention(q, q, q, **kw)


@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
@pytest.mark.parametrize("hk", [1, 2])
def test_route_gqa(fmt, hk, sdpa_calls, emulated_h200):
    """Fewer k/v heads (a divisor of the q heads) take the cuDNN route with
    SDPA's enable_gqa; out and gradients equal seqfuse's kernels'."""
    b, s, h, d = 2, 7, 4, 16
    seqfuse.ops.set_attention_backend("auto")
    q = layout(fmt, b, s, h, d, requires_grad=True)
    k, v = (layout(fmt, b, s, hk, d, requires_grad=True) for _ in range(2))
    assert seqfuse.ops.attention_backend(q, k, v, qkv_format=fmt, attn_mask_type="causal") == \
        ("cudnn", f"{fmt} causal d={d} bfloat16 gqa runs cuDNN fused attention through torch SDPA")
    def run(a, b_, c):
        return seqfuse.ops.attention(a, b_, c, qkv_format=fmt, attn_mask_type="causal")
    dout = torch.randn(q.shape).bfloat16()
    ours = grads_of(run, (q, k, v), dout)
    assert len(sdpa_calls) == 1 and sdpa_calls[0][1]["enable_gqa"] is True
    assert sdpa_calls[0][0][1].shape == (b, hk, s, d)  # k as it is, not expanded
    seqfuse.ops.set_attention_backend("seqfuse")
    ref = grads_of(run, (q, k, v), dout)
    assert rel_error(ours[0], ref[0]) <= rel_tol(torch.bfloat16)
    for g, r in zip(ours[1], ref[1]):
        assert rel_error(g, r) <= rel_tol(torch.bfloat16, BACKWARD_FACTOR)


@pytest.mark.parametrize("mask,as_mask", [("padding", "no_mask"), ("padding_causal", "causal"),
                                          ("causal", "causal"), ("no_mask", "no_mask")])
@pytest.mark.parametrize("hk", [2, 1])
def test_route_thd_of_equal_lengths(mask, as_mask, hk, sdpa_calls, emulated_h200):
    """Packed sequences all of one length L, under one cu_seqlens tensor,
    run the cuDNN route on the [b, L] view, equal to seqfuse's thd kernels;
    unequal lengths, a tail past the last sequence, or two cu_seqlens
    tensors do not (the call key holds L, so the same shapes can differ)."""
    h, d, lengths = 2, 16, [6, 6, 6]
    q = torch.randn(18, h, d).bfloat16()
    k, v = torch.randn(18, hk, d).bfloat16(), torch.randn(18, hk, d).bfloat16()
    cu = cu_seqlens(lengths)
    kw = dict(qkv_format="thd", attn_mask_type=mask, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=6,
              max_seqlen_kv=6)
    seqfuse.ops.set_attention_backend("auto")
    name, reason = seqfuse.ops.attention_backend(q, k, v, **kw)
    assert name == "cudnn" and "every sequence 6 tokens long" in reason and "as bshd [3, 6]" in reason, reason
    dout = torch.randn(q.shape).bfloat16()
    ours = grads_of(lambda a, b_, c: seqfuse.ops.attention(a, b_, c, **kw), (q, k, v), dout)
    assert len(sdpa_calls) == 1
    args, kwargs, _ = sdpa_calls[0]
    assert args[0].shape == (3, h, 6, d) and kwargs["is_causal"] == (as_mask == "causal")
    assert ours[0].shape == q.shape
    seqfuse.ops.set_attention_backend("seqfuse")
    ref = grads_of(lambda a, b_, c: seqfuse.ops.attention(a, b_, c, **kw), (q, k, v), dout)
    assert rel_error(ours[0], ref[0]) <= rel_tol(torch.bfloat16)
    for g, r in zip(ours[1], ref[1]):
        assert rel_error(g, r) <= rel_tol(torch.bfloat16, BACKWARD_FACTOR)
    seqfuse.ops.set_attention_backend("auto")
    for other in (cu_seqlens([5, 7, 6]), cu_seqlens([6, 6])):  # unequal; a tail of 6 tokens
        kw2 = dict(kw, cu_seqlens_q=other, cu_seqlens_kv=other, max_seqlen_q=7, max_seqlen_kv=7)
        name, reason = seqfuse.ops.attention_backend(q, k, v, **kw2)
        assert name != "cudnn" and reason.startswith("qkv_format"), reason
    assert seqfuse.ops.attention_backend(q, k, v, **dict(kw, cu_seqlens_kv=cu.clone()))[0] != "cudnn"
    assert seqfuse.ops.attention_backend(q, k, v, **kw)[0] == "cudnn"


def test_auto_does_not_swallow_cuda_errors(monkeypatch, emulated_h200):
    """A CUDA error leaves the context broken: re-raised, not remembered."""
    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(F, "scaled_dot_product_attention", broken)
    seqfuse.ops.set_attention_backend("auto")
    q = layout("bshd", 1, 4, 2, 16)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        seqfuse.ops.attention(q, q, q)
    assert routing._route_failed == {}


def test_route_output_dtype_ignores_torch_autocast(emulated_h200):
    """Under torch.autocast the route returns q's dtype, as seqfuse's kernels
    do (SDPA is an autocast op: it would return the autocast dtype)."""
    seqfuse.ops.set_attention_backend("auto")
    q, k, v = (layout("bshd", 2, 6, 2, 16, dtype=torch.float16) for _ in range(3))
    assert seqfuse.ops.attention_backend(q, k, v)[0] == "cudnn"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = seqfuse.ops.attention(q, k, v)
    assert out.dtype == torch.float16
    seqfuse.ops.set_attention_backend("seqfuse")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert seqfuse.ops.attention(q, k, v).dtype == torch.float16


def test_auto_does_not_swallow_out_of_memory(monkeypatch, emulated_h200):
    def oom(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")

    monkeypatch.setattr(F, "scaled_dot_product_attention", oom)
    seqfuse.ops.set_attention_backend("auto")
    q = layout("bshd", 1, 4, 2, 16)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        seqfuse.ops.attention(q, q, q)
    assert routing._route_failed == {}


def _transformer_layer(**kw):
    """A TransformerLayer without dropout and with fused QKV."""
    import seqfuse.pytorch as te
    return te.TransformerLayer(hidden_dropout=0.0, attention_dropout=0.0, fuse_qkv_params=True, **kw)


def _layer_under_backends(layer, x0, dy, backends, sdpa_calls):
    """One forward+backward of ``layer`` per backend: {backend: (y, dx, the
    QKV weight's gradient, SDPA calls made)}."""
    results = {}
    for backend in backends:
        seqfuse.ops.set_attention_backend(backend)
        layer.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        calls = len(sdpa_calls)
        y = layer(x)
        y.backward(torch.ones_like(y) if dy is None else dy)
        results[backend] = (y.detach(), x.grad, layer.self_attention.layernorm_qkv.weight.grad.clone(),
                            len(sdpa_calls) - calls)
    return results


@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
def test_transformer_layer_through_the_route_on_cpu(fmt, sdpa_calls, emulated_h200):
    layer = _transformer_layer(hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                               self_attn_mask_type="causal", attn_input_format=fmt, params_dtype=torch.bfloat16,
                               device="cpu")
    x0 = torch.randn(6, 3, 64).bfloat16()  # [s, b, hidden] or [b, s, hidden]: 6 x 3 either way
    results = _layer_under_backends(layer, x0, None, ("seqfuse", "auto"), sdpa_calls)
    assert len(sdpa_calls) == 1
    results = {name: r[:3] for name, r in results.items()}
    for ours, ref, factor in zip(results["auto"], results["seqfuse"], (1, BACKWARD_FACTOR, BACKWARD_FACTOR)):
        assert ours.shape == ref.shape and rel_error(ours, ref) <= rel_tol(torch.bfloat16, factor)


# ----------------------------------------------------------------- CUDA (H200)
SHAPES = [(2, 128, 4), (3, 1000, 2), (1, 2048, 8)]  # (b, s, h)


def _fresh(x):
    return x.detach().clone().requires_grad_()


def _run(q, k, v, dout, fmt, mask):
    q, k, v = (_fresh(x) for x in (q, k, v))
    out = seqfuse.ops.attention(q, k, v, qkv_format=fmt, attn_mask_type=mask)
    out.backward(dout)
    return out, (q.grad, k.grad, v.grad)


def _assert_finite(*tensors):
    for t in tensors:
        assert torch.isfinite(t.float()).all()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("mask", ["no_mask", "causal"])
@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
@pytest.mark.parametrize("b,s,h", SHAPES)
def test_cuda_cudnn_route_matches_seqfuse_and_reference(b, s, h, fmt, mask, d, dtype, seed, cudnn_calls):
    rng = random.Random(seed)
    q, k, v, dout, _, _ = make_case(fmt, mask, b, s, s, h, h, d, dtype, rng)
    seqfuse.ops.set_attention_backend("cudnn")  # forced: an ineligible call or a torch error raises
    assert seqfuse.ops.attention_backend(q, k, v, qkv_format=fmt, attn_mask_type=mask)[0] == "cudnn"
    out, grads = _run(q, k, v, dout, fmt, mask)
    assert len(cudnn_calls) == 1
    assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
    _assert_finite(out, *grads)
    with torch.no_grad():
        out_nograd = seqfuse.ops.attention(q, k, v, qkv_format=fmt, attn_mask_type=mask)
    assert len(cudnn_calls) == 2 and out_nograd.grad_fn is None and rel_error(out_nograd, out) <= rel_tol(dtype)

    seqfuse.ops.set_attention_backend("seqfuse")
    out_s, grads_s = _run(q, k, v, dout, fmt, mask)
    assert len(cudnn_calls) == 2
    _assert_finite(out_s, *grads_s)
    assert out_s.shape == out.shape and out_s.dtype == out.dtype

    ref, ref_grads = run_reference(q, k, v, dout, fmt, mask, None, None)
    what = f"{fmt} {mask} d={d} {dtype} b={b} s={s} h={h}"
    check(out, grads, ref, ref_grads, dtype, "cudnn " + what)
    check(out_s, grads_s, ref, ref_grads, dtype, "seqfuse " + what)
    check(out, grads, out_s, grads_s, dtype, "cudnn vs seqfuse " + what)


@pytest.mark.cuda
def test_cuda_auto_picks_cudnn_for_esm2_on_h200(cudnn_calls, caplog):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("auto takes cuDNN on compute capability 9.0 only")
    seqfuse.ops.set_attention_backend("auto")
    q, k, v = (torch.randn(16, 1024, 20, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    assert seqfuse.ops.attention_backend(q, k, v) == ("cudnn", ESM_REASON)
    assert seqfuse.ops.attention_backend(q, k, v, attn_mask_type="causal")[0] == "cudnn"
    qs = q.detach().transpose(0, 1)  # sbhd view
    assert seqfuse.ops.attention_backend(qs, qs, qs, qkv_format="sbhd", attn_mask_type="causal")[0] == "cudnn"
    with caplog.at_level(logging.INFO, logger="seqfuse"):
        for _ in range(2):
            out = seqfuse.ops.attention(q, k, v)
            out.backward(torch.ones_like(out))
    assert [r.getMessage() for r in caplog.records if "cuDNN" in r.getMessage()] == [ESM_LOG]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(cudnn_calls) == 2
    _assert_finite(out, q.grad, k.grad, v.grad)


ROUTE_OF_RULE = {"dropout": "seqfuse", "padding": "flash", "window": "flash",
                 "deterministic": "seqfuse", "head_dim": "seqfuse", "dtype": "torch_fp32"}


def _thd_case(lengths, h, hk, d, dtype, rng):
    """q, k, v, dout packed [t, h, d] with no tail, and the lengths."""
    t = sum(lengths)
    q = torch.randn(t, h, d, device="cuda").to(dtype)
    k, v = (torch.randn(t, hk, d, device="cuda").to(dtype) for _ in range(2))
    return q, k, v, torch.randn(t, h, d, device="cuda").to(dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("mask", ["no_mask", "causal"])
@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
@pytest.mark.parametrize("h,hk,d", [(8, 2, 64), (4, 1, 128), (6, 3, 64)])
def test_cuda_cudnn_route_gqa(h, hk, d, fmt, mask, seed, cudnn_calls):
    """GQA/MQA on the cuDNN route (SDPA's enable_gqa): auto picks it on an
    H200, and out and gradients match the float64 reference as the seqfuse
    kernels do."""
    rng = random.Random(seed)
    dtype = torch.bfloat16
    q, k, v, dout, _, _ = make_case(fmt, mask, 2, 300, 300, h, hk, d, dtype, rng)
    if torch.cuda.get_device_capability() == (9, 0):
        seqfuse.ops.set_attention_backend("auto")
        name, reason = seqfuse.ops.attention_backend(q, k, v, qkv_format=fmt, attn_mask_type=mask)
        assert name == "cudnn" and " gqa " in reason, reason
    seqfuse.ops.set_attention_backend("cudnn")
    out, grads = _run(q, k, v, dout, fmt, mask)
    assert len(cudnn_calls) == 1 and cudnn_calls[0][1].get("enable_gqa") is True
    seqfuse.ops.set_attention_backend("seqfuse")
    out_s, grads_s = _run(q, k, v, dout, fmt, mask)
    ref, ref_grads = run_reference(q, k, v, dout, fmt, mask, None, None)
    what = f"gqa {h}/{hk} {fmt} {mask} d={d}"
    check(out, grads, ref, ref_grads, dtype, "cudnn " + what)
    check(out_s, grads_s, ref, ref_grads, dtype, "seqfuse " + what)


@pytest.mark.cuda
@pytest.mark.parametrize("mask", ["padding", "padding_causal", "causal"])
@pytest.mark.parametrize("h,hk", [(4, 4), (8, 2)])
def test_cuda_thd_of_equal_lengths_runs_cudnn_as_bshd(h, hk, mask, seed, cudnn_calls):
    """A packed batch whose one cu_seqlens splits every token into sequences
    of the same length runs cuDNN on the [b, L] view (no extra sync: the
    cu_seqlens check's facts), matching the reference; the same shapes with
    unequal lengths stay off it (the call key holds the length)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("auto takes the torch routes on compute capability 9.0 only")
    rng = random.Random(seed)
    dtype, d, lengths = torch.bfloat16, 64, [256] * 3
    q, k, v, dout = _thd_case(lengths, h, hk, d, dtype, rng)
    cu = cu_seqlens(lengths, "cuda")
    kw = dict(qkv_format="thd", attn_mask_type=mask, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=256,
              max_seqlen_kv=256)
    seqfuse.ops.set_attention_backend("auto")
    name, reason = seqfuse.ops.attention_backend(q, k, v, **kw)
    assert name == "cudnn" and "as bshd [3, 256]" in reason, reason
    qf, kf, vf = (_fresh(x) for x in (q, k, v))
    out = seqfuse.ops.attention(qf, kf, vf, **kw)
    out.backward(dout)
    assert len(cudnn_calls) == 1 and cudnn_calls[0][0][0].shape == (3, h, 256, d)
    ref, ref_grads = run_reference(q, k, v, dout, "thd", mask, lengths, lengths)
    check(out, (qf.grad, kf.grad, vf.grad), ref, ref_grads, dtype, f"uniform thd {mask} {h}/{hk}")
    # the same shapes, unequal lengths: not the bshd view
    other = cu_seqlens([200, 312, 256], "cuda")
    kw2 = dict(kw, cu_seqlens_q=other, cu_seqlens_kv=other, max_seqlen_q=312, max_seqlen_kv=312)
    assert seqfuse.ops.attention_backend(q, k, v, **kw2)[0] != "cudnn"
    out2 = seqfuse.ops.attention(q, k, v, **kw2)
    assert len(cudnn_calls) == 1
    ref2, _ = run_reference(q, k, v, dout, "thd", mask, [200, 312, 256], [200, 312, 256])
    assert rel_error(out2, ref2) <= rel_tol(dtype)
    # two cu_seqlens tensors (even equal ones) are not taken as one batch of equal lengths
    kw3 = dict(kw, cu_seqlens_kv=cu.clone())
    assert seqfuse.ops.attention_backend(q, k, v, **kw3)[0] != "cudnn"


@pytest.mark.cuda
@pytest.mark.parametrize("rule", list(ROUTE_OF_RULE))
def test_cuda_auto_route_of_calls_cudnn_refuses(rule, cudnn_calls):
    """Calls the cuDNN route refuses: the flash route takes padding and
    windows on an H200, float32 goes to torch_fp32; dropout with seqfuse's
    Philox mask asked for (rng_state) and the rest stay on seqfuse's kernels
    with cuDNN's rule named first."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("auto takes the torch routes on compute capability 9.0 only")
    seqfuse.ops.set_attention_backend("auto")
    b, s, h, hk, d, dtype = 2, 128, 4, 4, 64, torch.bfloat16
    kw = dict(qkv_format="bshd", attn_mask_type="no_mask")
    if rule == "dropout":  # with seqfuse's Philox mask asked for (without, cuDNN takes dropout)
        kw.update(dropout_p=0.1, rng_state=(1, 0))
    elif rule == "padding":
        kw.update(attn_mask_type="padding", cu_seqlens_q=cu_seqlens([128, 77], "cuda"))
        kw["cu_seqlens_kv"] = kw["cu_seqlens_q"]
    elif rule == "deterministic":
        kw["deterministic"] = True
    elif rule == "gqa":
        hk = 2
    elif rule == "window":
        kw["window_size"] = (32, 32)
    elif rule == "head_dim":
        d = 20  # not a multiple of 8
    else:
        dtype = torch.float32
    q = torch.randn(b, s, h, d, device="cuda").to(dtype).requires_grad_()
    k, v = (torch.randn(b, s, hk, d, device="cuda").to(dtype).requires_grad_() for _ in range(2))
    name, reason = seqfuse.ops.attention_backend(q, k, v, **kw)
    assert name == ROUTE_OF_RULE[rule], reason
    if name == "seqfuse":
        assert reason.split(":")[0] == rule, reason
    if rule == "head_dim":
        return  # seqfuse's CUDA kernels do not take it either: the choice is what is tested
    out = seqfuse.ops.attention(q, k, v, **kw)
    out.backward(torch.ones_like(out))
    assert len(cudnn_calls) == (1 if name == "torch_fp32" else 0)
    _assert_finite(out, q.grad, k.grad, v.grad)


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
def test_cuda_cudnn_route_strided_qkv_views(fmt, seed, cudnn_calls):
    # q, k, v sliced out of one fused [.., .., 3, h, d] projection, as the modules make them
    b, s, h, d = 2, 200, 4, 64
    shape = (b, s, 3, h, d) if fmt == "bshd" else (s, b, 3, h, d)
    qkv = torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    q, k, v = qkv.unbind(2)
    assert not q.is_contiguous()
    dout = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16)
    seqfuse.ops.set_attention_backend("cudnn")
    out = seqfuse.ops.attention(q, k, v, qkv_format=fmt, attn_mask_type="causal")
    out.backward(dout)
    assert len(cudnn_calls) == 1
    assert cudnn_calls[0][0][0].data_ptr() == q.data_ptr()  # the strided view itself, not a copy
    ref, ref_grads = run_reference(q, k, v, dout, fmt, "causal", None, None)
    check(out, qkv.grad.unbind(2), ref, ref_grads, torch.bfloat16, f"strided {fmt}")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cuda_transformer_layer_same_under_both_backends(dtype, seed, cudnn_calls):
    layer = _transformer_layer(hidden_size=256, ffn_hidden_size=512, num_attention_heads=4,
                               self_attn_mask_type="no_mask", attn_input_format="bshd", params_dtype=dtype,
                               device="cuda")
    x0 = torch.randn(2, 300, 256, device="cuda", dtype=dtype)
    dy = torch.randn(2, 300, 256, device="cuda", dtype=dtype)
    results = _layer_under_backends(layer, x0, dy, ("seqfuse", "cudnn"), cudnn_calls)
    for backend, (y, dx, dw, calls) in results.items():
        assert calls == (1 if backend == "cudnn" else 0)
        _assert_finite(y, dx, dw)
    (y_s, dx_s, dw_s, _), (y_c, dx_c, dw_c, _) = results["seqfuse"], results["cudnn"]
    assert y_c.shape == y_s.shape and y_c.dtype == y_s.dtype
    assert rel_error(y_c, y_s) <= rel_tol(dtype)
    assert rel_error(dx_c, dx_s) <= rel_tol(dtype, BACKWARD_FACTOR)
    assert rel_error(dw_c, dw_s) <= rel_tol(dtype, BACKWARD_FACTOR)
