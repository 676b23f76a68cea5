"""ops.attention's routes through torch's own kernels (python/seqfuse/ops/attn/
_torch_routes.py), on the CPU: the "flash" route (torch's FlashAttention-2
for packed thd, padded bshd/sbhd, GQA, windows, dropout) and the
"torch_fp32" route (float32 on CUDA through SDPA).

- Each rule of flash_eligibility and fp32_eligibility as a pure function,
  and the order they are checked in.
- The choice (attention_backend) on CPU tensors with the device facts of an
  H200 (the emulated_h200 fixture of test_attn_backend.py): which route each
  kind of call takes, and the reason named when it stays on seqfuse.
- The flash route's plumbing run on the CPU: torch's FlashAttention forward
  is CUDA only, so a stand-in with its documented semantics (varlen
  cu_seqlens, bottom-right causal diagonal and window, GQA, dropout applied
  to softmax, written here on the float64 reference of attn_ref.py) takes its
  place; the route's layouts (the thd tail, three sequences per padded row,
  sbhd), causal/window arguments and scale are checked against seqfuse's
  CPU kernels, forward and backward.  The stand-in also checks FlashAttention's
  contract on what the route hands it (every sequence within max_seqlen,
  cu_seqlens covering every token).
- The torch_fp32 route run on the CPU as it is (SDPA's math backend is the
  CPU's), against seqfuse's CPU kernels in float32: every mask, padding
  with empty rows, windows, GQA, unequal lengths, thd.
The CUDA tests of both routes: tests/test_attn_routes_cuda.py."""
import logging

import pytest
import torch

import seqfuse
from attn_ref import attend, check_route_cu_seqlens, cu_seqlens, thd_case
from helpers import BACKWARD_FACTOR, fresh_routing, grads_of, record_calls, rel_error, rel_tol
from seqfuse.ops.attn import _routing as routing
from seqfuse.ops.attn import _torch_routes as routes

FLASH = seqfuse.ops.attn.flash_eligibility
FP32 = seqfuse.ops.attn.fp32_eligibility


@pytest.fixture(autouse=True)
def restore_backend(monkeypatch):
    fresh_routing(monkeypatch)  # backend "auto", the opt-in cuDNN ragged route off whatever the environment says


@pytest.fixture
def emulated_h200(monkeypatch):
    monkeypatch.setattr(routing, "_device_facts", lambda device: ("cuda", (9, 0)))
    monkeypatch.setattr(routing, "_SDPA_BACKENDS", [routing.SDPBackend.MATH])


def flash_standin_for(calls):
    """A CPU stand-in for torch.ops.aten._flash_attention_forward with its
    semantics; each call's arguments are appended to ``calls``."""
    def standin(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *, scale=None,
                window_size_left=None, window_size_right=None):
        calls.append(dict(q=q, k=k, v=v, cu_q=cu_q, cu_k=cu_k, max_q=max_q, max_k=max_k, dropout_p=dropout_p,
                          is_causal=is_causal, scale=scale, left=window_size_left, right=window_size_right))
        assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
        assert not return_debug_mask and q.shape[-2] % k.shape[-2] == 0
        left = -1 if window_size_left is None else window_size_left
        right = -1 if window_size_right is None else window_size_right
        mask = "causal_bottom_right" if is_causal else "no_mask"  # FlashAttention's diagonal: bottom-right

        def one(qs, ks, vs):
            drop = None
            if dropout_p > 0:
                keep = torch.rand(qs.shape[1], qs.shape[0], ks.shape[0]) >= dropout_p
                drop = keep.double() / (1 - dropout_p)
            return attend(qs.double(), ks.double(), vs.double(), mask, (left, right), scale, drop).to(q.dtype)

        if cu_q is None:
            assert q.dim() == 4 and q.shape[1] <= max_q and k.shape[1] <= max_k
            out = torch.stack([one(q[i], k[i], v[i]) for i in range(q.shape[0])])
        else:
            bq, bk = check_route_cu_seqlens(cu_q, cu_k, max_q, max_k)
            # the route covers every token
            assert bq[0] == 0 and bk[0] == 0 and bq[-1] == q.shape[0] and bk[-1] == k.shape[0], (bq, bk)
            out = torch.cat([one(q[a:b], k[c:e], v[c:e]) for a, b, c, e in zip(bq, bq[1:], bk, bk[1:])])
        return out, None, None, None, None
    return standin


@pytest.fixture
def flash_calls(monkeypatch, emulated_h200):
    return record_calls(monkeypatch, routes, "_flash_forward", flash_standin_for)


# ------------------------------------------------------------ the rules, pure
FLASH_OK = dict(device_type="cuda", capability=(9, 0), qkv_format="thd", attn_mask_type="padding", dropout_p=0.0,
                deterministic=False, dtype=torch.bfloat16, heads_q=20, heads_kv=20, head_dim=64,
                flash_enabled=True)

FLASH_BROKEN = [
    ("alignment", dict(attn_mask_type="padding_causal")),  # thd, two cu_seqlens tensors
    ("alignment", dict(attn_mask_type="causal")),  # thd's "causal" is top-left padding_causal
    ("alignment", dict(qkv_format="bshd", attn_mask_type="padding,causal", s_q=8, s_kv=8)),
    ("alignment", dict(qkv_format="bshd", attn_mask_type="causal", s_q=8, s_kv=9, same_cu=True)),
    ("alignment", dict(qkv_format="sbhd", attn_mask_type="causal", s_q=9, s_kv=8)),
    ("rng_state", dict(dropout_p=0.1, explicit_rng=True)),
    ("deterministic", dict(deterministic=True)),
    ("deterministic", dict(deterministic_algorithms=True)),
    ("dtype", dict(dtype=torch.float32)),
    ("dtype", dict(dtype=torch.float64)),
    ("gqa", dict(heads_q=20, heads_kv=8)),
    ("gqa", dict(heads_kv=0)),
    ("head_dim", dict(head_dim=20)),
    ("head_dim", dict(head_dim=264)),
    ("head_dim", dict(head_dim=0)),
    ("lengths", dict(qkv_format="bshd", attn_mask_type="no_mask", s_q=0, s_kv=4)),
    ("lengths", dict(qkv_format="sbhd", attn_mask_type="causal_bottom_right", s_q=4, s_kv=0)),
    ("device", dict(device_type="cpu", capability=None)),
    ("capability", dict(capability=(8, 0))),
    ("capability", dict(capability=(10, 0))),
    ("capability", dict(capability=None)),
    ("flash_sdp_enabled", dict(flash_enabled=False)),
    ("forward_only", dict(needs_grad=False)),
    ("forward_only", dict(needs_grad=False, head_dim=128, heads_kv=5)),
]

FLASH_STILL_OK = [
    dict(attn_mask_type="padding_causal", same_cu=True),
    dict(attn_mask_type="causal", same_cu=True),
    dict(attn_mask_type="padding_causal_bottom_right"),  # any lengths: FlashAttention's own diagonal
    dict(attn_mask_type="causal_bottom_right"),
    dict(attn_mask_type="no_mask"),
    dict(qkv_format="bshd", attn_mask_type="padding_causal", s_q=8, s_kv=12, same_cu=True),
    dict(qkv_format="bshd", attn_mask_type="causal", s_q=8, s_kv=8),
    dict(qkv_format="sbhd", attn_mask_type="no_mask", s_q=3, s_kv=700),
    dict(qkv_format="bshd", attn_mask_type="causal_bottom_right", s_q=9, s_kv=4),
    dict(heads_q=32, heads_kv=8), dict(heads_q=6, heads_kv=1),
    dict(head_dim=8), dict(head_dim=16), dict(head_dim=24), dict(head_dim=96), dict(head_dim=256),
    dict(dropout_p=0.1), dict(dropout_p=0.0, explicit_rng=True), dict(dtype=torch.float16),
    dict(capability=(8, 0), check_capability=False),
    dict(needs_grad=False, dropout_p=0.1),  # seqfuse's dropout forward is the slower sm80 kernel
    dict(needs_grad=False, head_dim=256), dict(needs_grad=False, head_dim=96),  # head dims seqfuse's CUDA lacks
    dict(needs_grad=False, check_capability=False),  # forced flash
]


def test_flash_eligible_base_case():
    assert FLASH(**FLASH_OK) == ("", "")


@pytest.mark.parametrize("rule,change", FLASH_BROKEN, ids=str)
def test_flash_each_rule(rule, change):
    got, reason = FLASH(**{**FLASH_OK, **change})
    assert got == rule, reason
    assert reason.startswith(rule + ": ") and len(reason) > len(rule) + 10


@pytest.mark.parametrize("change", FLASH_STILL_OK, ids=str)
def test_flash_still_eligible(change):
    assert FLASH(**{**FLASH_OK, **change}) == ("", "")


def test_flash_rules_are_checked_in_order():
    order = ["alignment", "rng_state", "deterministic", "dtype", "gqa", "head_dim", "device", "capability",
             "forward_only", "flash_sdp_enabled"]
    facts = {**FLASH_OK, **dict(attn_mask_type="padding_causal", dropout_p=0.0, explicit_rng=True,
                                deterministic=True, dtype=torch.float32, heads_kv=3, head_dim=12, device_type="cpu",
                                capability=(8, 0), flash_enabled=False, needs_grad=False)}
    fixes = [dict(same_cu=True), dict(dropout_p=0.2), dict(deterministic=False), dict(dtype=torch.float16),
             dict(heads_kv=4), dict(head_dim=64), dict(device_type="cuda"), dict(capability=(9, 0)),
             dict(needs_grad=True), dict(flash_enabled=True)]
    facts["dropout_p"] = 0.2  # with explicit_rng: the rng_state rule; fixed by dropping explicit_rng below
    fixes[1] = dict(explicit_rng=False, dropout_p=0.0)
    for rule, fix in zip(order, fixes):
        assert FLASH(**facts)[0] == rule
        facts.update(fix)
    assert FLASH(**facts) == ("", "")


FP32_OK = dict(device_type="cuda", qkv_format="thd", dtype=torch.float32, dropout_p=0.1)


@pytest.mark.parametrize("rule,change", [
    ("dtype", dict(dtype=torch.bfloat16)), ("dtype", dict(dtype=torch.float64)),
    ("device", dict(device_type="cpu")), ("rng_state", dict(explicit_rng=True)),
    ("graph_capture", dict(capturing=True))], ids=str)
def test_fp32_each_rule(rule, change):
    got, reason = FP32(**{**FP32_OK, **change})
    assert got == rule and reason.startswith(rule + ": "), reason


@pytest.mark.parametrize("change", [dict(), dict(qkv_format="bshd", capturing=True), dict(dropout_p=0.0,
                                    explicit_rng=True), dict(qkv_format="sbhd")], ids=str)
def test_fp32_still_eligible(change):
    assert FP32(**{**FP32_OK, **change}) == ("", "")


# ------------------------------------------------------------ the choice
def padded_case(fmt, b, s_q, s_kv, lengths_q, lengths_k=None, h=4, hk=4, d=16, dtype=torch.bfloat16):
    shape = (lambda s, n: (b, s, n, d)) if fmt == "bshd" else (lambda s, n: (s, b, n, d))
    q = torch.randn(shape(s_q, h)).to(dtype)
    k, v = (torch.randn(shape(s_kv, hk)).to(dtype) for _ in range(2))
    cu_q = cu_seqlens(lengths_q)
    cu_k = cu_q if lengths_k is None else cu_seqlens(lengths_k)
    return q, k, v, dict(qkv_format=fmt, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k)


CHOICES = [  # (what, the call, expected route, the reason's start)
    ("thd padding", lambda: thd_case([5, 7]), dict(attn_mask_type="padding"), "flash", "thd padding d=16"),
    ("thd no_mask", lambda: thd_case([5, 7]), dict(attn_mask_type="no_mask"), "flash", "thd no_mask"),
    ("thd causal, one cu", lambda: thd_case([5, 7]), dict(attn_mask_type="padding_causal"), "flash", "thd"),
    ("thd causal, two cu", lambda: thd_case([5, 7], same=False), dict(attn_mask_type="padding_causal"),
     "seqfuse", "qkv_format: "),
    ("thd bottom-right, two cu", lambda: thd_case([5, 7], [3, 9]),
     dict(attn_mask_type="padding_causal_bottom_right"), "flash", "thd"),
    ("thd gqa", lambda: thd_case([5, 7], h=4, hk=2), dict(), "flash", "thd no_mask d=16 bfloat16 gqa"),
    ("thd dropout", lambda: thd_case([5, 7]), dict(dropout_p=0.1), "flash", "thd no_mask d=16 bfloat16 dropout"),
    ("thd dropout, rng_state", lambda: thd_case([5, 7]), dict(dropout_p=0.1, rng_state=(3, 0)), "seqfuse",
     "qkv_format: "),
    ("thd deterministic", lambda: thd_case([5, 7]), dict(deterministic=True), "seqfuse", "qkv_format: "),
    ("thd head dim 20", lambda: thd_case([5, 7], d=20), dict(), "seqfuse", "qkv_format: "),
    ("thd int64 cu", lambda: (lambda q, k, v, kw: (q, k, v, {**kw, "cu_seqlens_q": kw["cu_seqlens_q"].long(),
                                                              "cu_seqlens_kv": kw["cu_seqlens_q"].long()}))(
        *thd_case([5, 7])), dict(), "seqfuse", "inputs: "),
    ("thd cu lengths differ", lambda: (lambda q, k, v, kw: (q, k, v, {**kw, "cu_seqlens_kv": cu_seqlens([12])}))(
        *thd_case([5, 7])), dict(), "seqfuse", "inputs: "),
    ("bshd padding", lambda: padded_case("bshd", 2, 6, 6, [6, 3]), dict(attn_mask_type="padding"), "flash",
     "bshd padding"),
    ("sbhd padding_causal", lambda: padded_case("sbhd", 2, 6, 6, [6, 3]), dict(attn_mask_type="padding_causal"),
     "flash", "sbhd padding_causal"),
    ("bshd padding, cu of b", lambda: padded_case("bshd", 3, 6, 6, [6, 3]), dict(attn_mask_type="padding"),
     "seqfuse", "inputs: cu_seqlens must have b+1 elements"),
    ("bshd no_mask", lambda: padded_case("bshd", 2, 6, 6, [6, 3])[:3] + ({},), dict(), "cudnn", "bshd no_mask"),
    ("bshd gqa", lambda: padded_case("bshd", 2, 6, 6, [6, 3], hk=2)[:3] + ({},), dict(), "cudnn",
     "bshd no_mask d=16 bfloat16 gqa runs cuDNN"),
    ("bshd gqa, window", lambda: padded_case("bshd", 2, 6, 6, [6, 3], hk=2)[:3] + ({},), dict(window_size=(2, 1)),
     "flash", "bshd no_mask d=16 bfloat16 gqa window"),
    ("thd, equal lengths", lambda: thd_case([6, 6], h=4, hk=2), dict(attn_mask_type="padding_causal"), "cudnn",
     "thd padding_causal d=16 bfloat16 gqa, every sequence 6 tokens long"),
    ("bshd window", lambda: padded_case("bshd", 2, 6, 6, [6, 3])[:3] + ({},), dict(window_size=(2, 1)), "flash",
     "bshd no_mask d=16 bfloat16 window"),
    ("sbhd causal s_q != s_kv", lambda: padded_case("sbhd", 2, 6, 8, [6, 3])[:3] + ({"qkv_format": "sbhd"},),
     dict(attn_mask_type="causal"), "seqfuse", "lengths: "),
    ("float32 bshd", lambda: padded_case("bshd", 2, 6, 6, [6, 3], dtype=torch.float32)[:3] + ({},), dict(),
     "torch_fp32", "bshd no_mask d=16 float32 on CUDA"),
    ("float32 thd", lambda: thd_case([5, 7], dtype=torch.float32), dict(attn_mask_type="padding_causal"),
     "torch_fp32", "thd padding_causal d=16 float32"),
]


@pytest.mark.parametrize("what,make,kw,route,start", CHOICES, ids=[c[0] for c in CHOICES])
def test_choice_on_an_h200(what, make, kw, route, start, emulated_h200):
    q, k, v, base = make()
    q.requires_grad_()  # a training call (without gradients auto keeps seqfuse's faster forward: forward_only)
    name, reason = seqfuse.ops.attention_backend(q, k, v, **{**base, **kw})
    assert (name, reason[:len(start)]) == (route, start), reason
    if name == "seqfuse" and not start.startswith("inputs"):
        assert "; flash route: " in reason


def test_forward_only_calls_keep_seqfuses_forward(emulated_h200):
    q, k, v, kw = thd_case([5, 7], d=64)
    name, reason = seqfuse.ops.attention_backend(q, k, v, **kw)
    assert name == "seqfuse" and reason.startswith("qkv_format: ") and "; flash route: forward_only: " in reason
    assert seqfuse.ops.attention_backend(q, k, v, **kw, dropout_p=0.1)[0] == "flash"
    q.requires_grad_()
    assert seqfuse.ops.attention_backend(q, k, v, **kw)[0] == "flash"
    with torch.no_grad():
        assert seqfuse.ops.attention_backend(q, k, v, **kw)[1].endswith(
            "forward_only: no gradient is needed and seqfuse's forward measured faster than FlashAttention's")
    q96, k96, v96, kw96 = thd_case([5, 7], d=96)  # seqfuse's CUDA kernels lack head dim 96
    assert seqfuse.ops.attention_backend(q96, k96, v96, **kw96)[0] == "flash"


def test_stays_on_seqfuse_names_both_rules(emulated_h200):
    q, k, v, kw = thd_case([5, 7])
    q.requires_grad_()
    name, reason = seqfuse.ops.attention_backend(q, k, v, **kw, dropout_p=0.1, rng_state=(1, 0))
    assert name == "seqfuse"
    assert reason.startswith("qkv_format: qkv_format 'thd'") and \
        reason.endswith("; flash route: rng_state: an explicit rng_state asks for seqfuse's Philox dropout mask")


def test_forced_flash(emulated_h200):
    seqfuse.ops.set_attention_backend("flash")
    q, k, v, kw = thd_case([5, 7])
    assert seqfuse.ops.attention_backend(q, k, v, **kw)[0] == "flash"
    # padding-free bshd: flash too (forced), where auto takes cuDNN
    x = torch.randn(2, 6, 4, 16).bfloat16()
    assert seqfuse.ops.attention_backend(x, x, x)[0] == "flash"
    with pytest.raises(NotImplementedError, match=r"backend 'flash' was chosen .* cannot run torch's "
                                                  r"FlashAttention: head_dim: head dim 20"):
        seqfuse.ops.attention(*thd_case([5, 7], d=20)[:3], **thd_case([5, 7], d=20)[3])
    with pytest.raises(NotImplementedError, match="dtype: dtype torch.float32"):
        seqfuse.ops.attention_backend(x.float(), x.float(), x.float())


def test_forced_flash_on_cpu_refuses_with_device():
    seqfuse.ops.set_attention_backend("flash")
    q, k, v, kw = thd_case([5, 7])
    with pytest.raises(NotImplementedError, match="device: cpu tensors"):
        seqfuse.ops.attention(q, k, v, **kw)


def test_forced_flash_skips_capability(monkeypatch):
    monkeypatch.setattr(routing, "_device_facts", lambda device: ("cuda", (8, 0)))
    q, k, v, kw = thd_case([5, 7])
    assert seqfuse.ops.attention_backend(q, k, v, **kw)[1].split("; flash route: ")[1].startswith("capability")
    seqfuse.ops.set_attention_backend("flash")
    assert seqfuse.ops.attention_backend(q, k, v, **kw)[0] == "flash"


def test_seqfuse_backend_keeps_everything(emulated_h200):
    seqfuse.ops.set_attention_backend("seqfuse")
    for make in (lambda: thd_case([5, 7]), lambda: thd_case([5, 7], dtype=torch.float32)):
        q, k, v, kw = make()
        assert seqfuse.ops.attention_backend(q, k, v, **kw)[0] == "seqfuse"


def test_float32_cuda_call_no_route_takes_raises(emulated_h200):
    q, k, v, kw = thd_case([5, 7], dtype=torch.float32)
    with pytest.raises(NotImplementedError, match=r"torch_fp32: float32 on CUDA runs only on torch's kernels, "
                                                  r"and this call cannot: rng_state: "):
        seqfuse.ops.attention(q, k, v, **kw, dropout_p=0.2, rng_state=(1, 0))


def test_choice_key_tells_one_cu_from_two(emulated_h200):
    q, k, v, kw = thd_case([5, 7])
    q.requires_grad_()
    causal = dict(kw, attn_mask_type="padding_causal")
    assert seqfuse.ops.attention_backend(q, k, v, **causal)[0] == "flash"
    two = dict(causal, cu_seqlens_kv=causal["cu_seqlens_q"].clone())
    assert seqfuse.ops.attention_backend(q, k, v, **two)[0] == "seqfuse"
    assert seqfuse.ops.attention_backend(q, k, v, **causal)[0] == "flash"


# ------------------------------------------------------------ the flash route, run on the CPU
def _both(q, k, v, kw, backend="auto"):
    """(route's out and grads, seqfuse's out and grads) of one call."""
    dout = torch.randn(q.shape).to(q.dtype)
    seqfuse.ops.set_attention_backend(backend)
    ours = grads_of(lambda a, b, c: seqfuse.ops.attention(a, b, c, **kw), (q, k, v), dout)
    seqfuse.ops.set_attention_backend("seqfuse")
    ref = grads_of(lambda a, b, c: seqfuse.ops.attention(a, b, c, **kw), (q, k, v), dout)
    return ours, ref


def _assert_same(ours, ref, dtype, what):
    (out, grads), (rout, rgrads) = ours, ref
    assert out.shape == rout.shape and out.dtype == rout.dtype
    assert rel_error(out, rout) <= rel_tol(dtype), what
    for name, g, r in zip("qkv", grads, rgrads):
        assert g.shape == r.shape and rel_error(g, r) <= rel_tol(dtype, BACKWARD_FACTOR), f"{what}: d{name}"


THD_RUNS = [
    ("no_mask with a tail", dict(lengths_q=[5, 7, 1], tail=(3, 2)), dict(attn_mask_type="padding")),
    ("causal, one cu", dict(lengths_q=[6, 2, 9]), dict(attn_mask_type="padding_causal")),
    ("bottom-right, unequal", dict(lengths_q=[4, 9, 3], lengths_k=[7, 2, 3], tail=(2, 5)),
     dict(attn_mask_type="padding_causal_bottom_right")),
    ("gqa 4/2 and a window", dict(lengths_q=[8, 6], h=4, hk=2), dict(window_size=(2, 1))),
    ("causal window", dict(lengths_q=[8, 6]), dict(attn_mask_type="padding_causal", window_size=(3, 0))),
    ("an empty sequence, mqa", dict(lengths_q=[5, 0, 4], h=3, hk=1), dict()),
    ("a tail longer than max_seqlen", dict(lengths_q=[2, 3], tail=(11, 13)), dict()),
    ("float16", dict(lengths_q=[5, 7], dtype=torch.float16), dict(softmax_scale=0.3)),
]


@pytest.mark.parametrize("what,case,extra", THD_RUNS, ids=[r[0] for r in THD_RUNS])
def test_flash_route_thd(what, case, extra, flash_calls):
    q, k, v, kw = thd_case(**case)
    kw.update(extra)
    assert seqfuse.ops.attention_backend(q.detach().requires_grad_(), k, v, **kw)[0] == "flash"
    ours, ref = _both(q, k, v, kw)
    assert len(flash_calls) == 1
    call = flash_calls[0]
    assert call["q"].data_ptr() == q.data_ptr() or call["q"].shape == q.shape
    assert call["max_q"] == max(case["lengths_q"]) and call["dropout_p"] == 0.0
    assert call["scale"] == kw.get("softmax_scale", q.shape[-1] ** -0.5)
    assert call["is_causal"] == ("causal" in kw.get("attn_mask_type", ""))
    _assert_same(ours, ref, q.dtype, what)
    tail = q.shape[0] - sum(case["lengths_q"])
    if tail:  # exactly 0, gradients too
        assert torch.equal(ours[0][-tail:], torch.zeros_like(ours[0][-tail:]))
        assert torch.equal(ours[1][0][-tail:], torch.zeros_like(ours[1][0][-tail:]))


def test_flash_route_thd_reads_max_seqlen_when_not_given(flash_calls):
    q, k, v, kw = thd_case([5, 9, 2])
    del kw["max_seqlen_q"], kw["max_seqlen_kv"]
    ours, ref = _both(q, k, v, kw)
    assert flash_calls[0]["max_q"] == 9 and flash_calls[0]["max_k"] == 9
    _assert_same(ours, ref, q.dtype, "max_seqlen read")


PADDED_RUNS = [
    ("bshd padding", "bshd", 3, 6, 6, [6, 3, 0], None, dict(attn_mask_type="padding")),
    ("sbhd padding", "sbhd", 3, 6, 6, [2, 6, 5], None, dict(attn_mask_type="padding")),
    ("bshd padding_causal", "bshd", 2, 7, 7, [7, 4], None, dict(attn_mask_type="padding_causal")),
    ("sbhd padding_causal_bottom_right, s_q < s_kv", "sbhd", 2, 5, 8, [5, 2], [8, 6],
     dict(attn_mask_type="padding_causal_bottom_right")),
    ("bshd padding, s_q > s_kv, gqa", "bshd", 2, 8, 5, [8, 3], [5, 1], dict(attn_mask_type="padding")),
    ("bshd padding window", "bshd", 2, 9, 9, [9, 6], None, dict(attn_mask_type="padding", window_size=(2, 2))),
]


@pytest.mark.parametrize("what,fmt,b,s_q,s_kv,lq,lk,extra", PADDED_RUNS, ids=[r[0] for r in PADDED_RUNS])
def test_flash_route_padded(what, fmt, b, s_q, s_kv, lq, lk, extra, flash_calls):
    hk = 2 if "gqa" in what else 4
    q, k, v, kw = padded_case(fmt, b, s_q, s_kv, lq, lk, hk=hk)
    kw.update(extra)
    assert seqfuse.ops.attention_backend(q.detach().requires_grad_(), k, v, **kw)[0] == "flash"
    ours, ref = _both(q, k, v, kw)
    call = flash_calls[0]
    assert call["q"].shape == (b * s_q, 4, 16) and call["cu_q"].numel() == 3 * b + 1
    assert (call["max_q"], call["max_k"]) == (s_q, s_kv)
    _assert_same(ours, ref, q.dtype, what)
    # padding queries: exactly 0 out and 0 gradient
    out, (dq, _, _) = ours
    rows = out if fmt == "bshd" else out.transpose(0, 1)
    drows = dq if fmt == "bshd" else dq.transpose(0, 1)
    for i, n in enumerate(lq):
        assert torch.equal(rows[i, n:], torch.zeros_like(rows[i, n:]))
        assert torch.equal(drows[i, n:], torch.zeros_like(drows[i, n:]))


DENSE_RUNS = [
    ("bshd gqa causal window", "bshd", 6, 6, 2, dict(attn_mask_type="causal", window_size=(2, 0))),  # GQA alone: cuDNN
    ("sbhd mqa bottom-right s_q > s_kv", "sbhd", 7, 4, 1, dict(attn_mask_type="causal_bottom_right")),
    ("bshd window", "bshd", 9, 9, 4, dict(window_size=(1, 2))),
    ("sbhd window causal", "sbhd", 9, 9, 4, dict(attn_mask_type="causal", window_size=(3, 0))),
]


@pytest.mark.parametrize("what,fmt,s_q,s_kv,hk,extra", DENSE_RUNS, ids=[r[0] for r in DENSE_RUNS])
def test_flash_route_dense(what, fmt, s_q, s_kv, hk, extra, flash_calls):
    q, k, v, _ = padded_case(fmt, 2, s_q, s_kv, [s_q, s_q], hk=hk)
    assert seqfuse.ops.attention_backend(q.detach().requires_grad_(), k, v, qkv_format=fmt, **extra)[0] == "flash"
    ours, ref = _both(q, k, v, dict(qkv_format=fmt, **extra))
    call = flash_calls[0]
    assert call["cu_q"] is None and call["q"].shape == (2, s_q, 4, 16)
    assert call["q"].is_contiguous() == (fmt == "bshd")  # sbhd goes in as a transposed view, not a copy
    _assert_same(ours, ref, q.dtype, what)
    assert ours[0].is_contiguous()


def test_flash_route_dropout_reaches_the_kernel_and_rng_state_stays(flash_calls):
    q, k, v, kw = thd_case([6, 5])
    out = seqfuse.ops.attention(q, k, v, **kw, dropout_p=0.25)  # no gradient, but dropout: the flash route
    assert len(flash_calls) == 1 and flash_calls[0]["dropout_p"] == 0.25
    no_drop = seqfuse.ops.attention(q, k, v, **kw)  # forward_only: seqfuse's kernels
    assert len(flash_calls) == 1 and not torch.equal(out, no_drop)
    # an explicit (seed, offset): seqfuse's Philox mask, seqfuse's kernels
    pinned = seqfuse.ops.attention(q, k, v, **kw, dropout_p=0.25, rng_state=(11, 0))
    assert len(flash_calls) == 1
    assert torch.equal(pinned, seqfuse.ops.attention_forward(q, k, v, **kw, dropout_p=0.25, rng_state=(11, 0))[0])


def test_flash_route_logs_once_and_falls_back_on_runtime_error(monkeypatch, emulated_h200, caplog):
    q, k, v, kw = thd_case([6, 5])

    def broken(*args, **kwargs):
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.")

    monkeypatch.setattr(routes, "_flash_forward", broken)
    q.requires_grad_()
    with caplog.at_level(logging.INFO, logger="seqfuse"):
        out = seqfuse.ops.attention(q, k, v, **kw).detach()
        again = seqfuse.ops.attention(q, k, v, **kw).detach()
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert infos == ["seqfuse attention: thd no_mask d=16 bfloat16 runs torch's FlashAttention-2 (set "
                     "SEQFUSE_ATTN_BACKEND=seqfuse for seqfuse's kernels)"]
    assert len(warnings) == 1 and "torch's FlashAttention failed on thd no_mask d=16 bfloat16: FlashAttention " \
                                  "only supports Ampere" in warnings[0]
    ref = seqfuse.ops.attention_forward(q, k, v, **kw)[0]
    assert torch.equal(out, ref) and torch.equal(again, ref)
    name, reason = seqfuse.ops.attention_backend(q, k, v, **kw)
    assert name == "seqfuse" and reason.startswith("flash_failed: ")
    seqfuse.ops.set_attention_backend("flash")  # forced: torch's error as it comes
    with pytest.raises(RuntimeError, match="only supports Ampere"):
        seqfuse.ops.attention(q, k, v, **kw)


def test_flash_route_does_not_swallow_cuda_errors(monkeypatch, emulated_h200):
    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(routes, "_flash_forward", broken)
    q, k, v, kw = thd_case([6, 5])
    q.requires_grad_()
    with pytest.raises(RuntimeError, match="illegal memory access"):
        seqfuse.ops.attention(q, k, v, **kw)
    assert routing._route_failed == {}


def test_thd_cover_layout():
    cu_q, cu_k = cu_seqlens([3, 4]), cu_seqlens([2, 6])
    cq, ck = routes._thd_cover(cu_q, cu_k, 12, 9, 4, 6)
    # the query tail (5 tokens) in ceil(12 / 4) chunks of <= 4 without keys, then the key tail (1 token)
    # in ceil(9 / 6) chunks of <= 6 without queries
    assert cq.tolist() == [0, 3, 7, 11, 12, 12, 12, 12]
    assert ck.tolist() == [0, 2, 8, 8, 8, 8, 9, 9]


def test_padded_layout():
    cq, ck = routes._padded_cus(cu_seqlens([4, 0]), cu_seqlens([3, 5]), 2, 4, 5)
    assert cq.tolist() == [0, 4, 4, 4, 4, 8, 8]
    assert ck.tolist() == [0, 3, 3, 5, 10, 10, 10]
    # lengths past the row are clamped to it (as seqfuse's kernels clamp)
    cq, ck = routes._padded_cus(cu_seqlens([9, 1]), cu_seqlens([9, 1]), 2, 4, 4)
    assert cq.tolist() == [0, 4, 4, 4, 5, 8, 8]


# ------------------------------------------------------------ the float32 route, run on the CPU
FP32_RUNS = [
    ("bshd no_mask", "bshd", dict()),
    ("sbhd causal", "sbhd", dict(attn_mask_type="causal")),
    ("bshd causal s_q > s_kv", "bshd", dict(attn_mask_type="causal", s_kv=5)),
    ("sbhd bottom-right s_q > s_kv", "sbhd", dict(attn_mask_type="causal_bottom_right", s_kv=4)),
    ("bshd window gqa", "bshd", dict(window_size=(2, 1), hk=2)),
    ("bshd padding with an empty row", "bshd", dict(attn_mask_type="padding", lq=[7, 0, 3])),
    ("sbhd padding_causal_bottom_right", "sbhd", dict(attn_mask_type="padding_causal_bottom_right", lq=[7, 2, 5],
                                                      lk=[4, 6, 0], s_kv=6)),
    ("bshd padding_causal window mqa", "bshd", dict(attn_mask_type="padding_causal", lq=[7, 5, 1],
                                                    window_size=(2, 0), hk=1)),
]


@pytest.mark.parametrize("what,fmt,case", FP32_RUNS, ids=[r[0] for r in FP32_RUNS])
def test_fp32_route_padded_layouts(what, fmt, case, emulated_h200, sdpa_calls):
    case = dict(case)
    mask, window = case.pop("attn_mask_type", "no_mask"), case.pop("window_size", None)
    s_q, s_kv = 7, case.pop("s_kv", 7)
    lq, lk = case.pop("lq", [s_q] * 3), case.pop("lk", None)
    q, k, v, kw = padded_case(fmt, 3, s_q, s_kv, lq, lk, dtype=torch.float32, **case)
    if "padding" not in mask:
        kw = dict(qkv_format=fmt)
    kw.update(attn_mask_type=mask, window_size=window)
    assert seqfuse.ops.attention_backend(q, k, v, **kw)[0] == "torch_fp32"
    ours, ref = _both(q, k, v, kw)
    assert len(sdpa_calls) == 1
    _assert_same(ours, ref, torch.float32, what)


@pytest.mark.parametrize("mask", ["padding", "padding_causal", "padding_causal_bottom_right"])
def test_fp32_route_thd(mask, emulated_h200, sdpa_calls):
    q, k, v, kw = thd_case([4, 0, 6], [5, 2, 6], h=4, hk=2, dtype=torch.float32, tail=(3, 1))
    kw.update(attn_mask_type=mask, window_size=(3, 1))
    assert seqfuse.ops.attention_backend(q, k, v, **kw)[0] == "torch_fp32"
    ours, ref = _both(q, k, v, kw)
    assert len(sdpa_calls) == 2  # one per sequence with queries and keys
    _assert_same(ours, ref, torch.float32, mask)
    assert torch.equal(ours[0][-3:], torch.zeros_like(ours[0][-3:]))


def test_fp32_route_dropout_and_deterministic(monkeypatch, emulated_h200, sdpa_calls):
    q, k, v, _ = padded_case("bshd", 2, 6, 6, [6, 6], dtype=torch.float32)
    seen = []
    real = routes.sdpa_kernel
    monkeypatch.setattr(routes, "sdpa_kernel", lambda backends: seen.append(list(backends)) or real(backends))
    out = seqfuse.ops.attention(q, k, v, dropout_p=0.3)
    assert sdpa_calls[-1][1]["dropout_p"] == 0.3 and seen[-1] == routes.FP32_SDPA_BACKENDS
    assert not torch.equal(out, seqfuse.ops.attention(q, k, v))
    seqfuse.ops.attention(q, k, v, deterministic=True)
    assert seen[-1] == [routes.SDPBackend.MATH]


def test_flash_route_layouts_made_once_per_cu_seqlens(monkeypatch, flash_calls):
    made = []
    real = routes._thd_cover
    monkeypatch.setattr(routes, "_thd_cover", lambda *a: made.append(a) or real(*a))
    monkeypatch.setattr(routes, "_thd_covers", routes.PerTensorCache(
        lambda cus, *extra: routes._thd_cover(*cus, *extra)))
    q, k, v, kw = thd_case([6, 5])
    q.requires_grad_()
    for _ in range(3):  # a model's layers: the same cu_seqlens tensor
        seqfuse.ops.attention(q, k, v, **kw)
    assert len(made) == 1 and len(flash_calls) == 3
    kw["cu_seqlens_q"] = kw["cu_seqlens_kv"] = kw["cu_seqlens_q"].clone()  # the next batch
    seqfuse.ops.attention(q, k, v, **kw)
    assert len(made) == 2
    kw["cu_seqlens_q"][1] = 5  # changed in place (lengths 5, 6): made again
    seqfuse.ops.attention(q, k, v, **kw)
    assert len(made) == 3
