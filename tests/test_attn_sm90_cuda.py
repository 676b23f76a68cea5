"""The Hopper (wgmma) attention forward, csrc/attn/attn_forward_sm90_cuda.cu:
against the float64 reference (attn_ref.py) and against the sm80 forward
(same out, same lse meaning) for every layout, mask, window, GQA ratio, head
dim 64/128 and dtype, at lengths that are and are not multiples of the
128-row / 128-key tiles, outputs poisoned (NaN) before each run.  Also the
kernel choice (SEQFUSE_ATTN_FORWARD_KERNEL / set_attention_forward_kernel), its
query and the once-per-reason log when a Hopper GPU runs the sm80 kernel.
The wgmma backward (attn_backward_sm90_cuda.cu) likewise: dq, dk, dv against the
reference and the sm80 backward, its choice (default wgmma on Hopper for head
dims 64 and 128; deterministic calls always sm80), query and log.  The choice and
query tests run on CPU-only machines too."""
import logging
import os
import random

import pytest
import torch

import seqfuse
from attn_ref import PADDING, reference
from helpers import BACKWARD_FACTOR, rel_error, rel_tol, seqfuse_attention_only
from test_attn_cuda import make_case, run_forward as forward, run_ours, run_reference


@pytest.fixture(autouse=True)
def _seqfuse_kernels(monkeypatch):
    """ops.attention calls here test seqfuse's kernels, not the cuDNN route."""
    seqfuse_attention_only(monkeypatch)


def is_hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.fixture(params=["forward", "backward"], ids=["sm90forward", "sm90backward"])
def sm90(request):
    """A checker of one case, check(q, k, v, dout, fmt, mask, lq, lk, window,
    what), for each wgmma kernel: the forward ("forward", the library's schedule:
    warp-specialized, ping-pong consumers, 192 rows at head dim 64 and 128 at
    128), checked on out and lse, and the backward ("backward", after that
    forward), checked on dq, dk, dv.  The forward's other schedules build
    into check_attn_sm90 only, which runs every case of its part (c) through
    each of them.  Skipped off Hopper; afterwards the process's kernel
    choices come back."""
    if not is_hopper():
        pytest.skip("the wgmma kernels need a compute capability 9.0 GPU")
    forward_was, backward_was = seqfuse.ops.attention_forward_kernel(64)[0], seqfuse.ops.attention_backward_kernel(64)[0]
    seqfuse.ops.set_attention_forward_kernel(90)
    if request.param == "backward":
        seqfuse.ops.set_attention_backward_kernel(90)
        yield check_backward
    else:
        yield lambda q, k, v, dout, *case: check(q, k, v, *case)
    seqfuse.ops.set_attention_forward_kernel(forward_was)  # the process's choices (an env override) again
    seqfuse.ops.set_attention_backward_kernel(backward_was)


def both_kernels(q, k, v, fmt, mask, lq, lk, window=None):
    seqfuse.ops.set_attention_forward_kernel(80)
    o80, l80 = forward(q, k, v, fmt, mask, lq, lk, window)
    seqfuse.ops.set_attention_forward_kernel(90)
    assert seqfuse.ops.attention_forward_kernel(q.shape[-1], q.device)[0] == 90
    o90, l90 = forward(q, k, v, fmt, mask, lq, lk, window)
    return o90, l90, o80, l80


def check(q, k, v, fmt, mask, lq, lk, window, what):
    o90, l90, o80, l80 = both_kernels(q, k, v, fmt, mask, lq, lk, window)
    ref = reference(q.double(), k.double(), v.double(), qkv_format=fmt, attn_mask_type=mask,
                    seqlens_q=lq, seqlens_kv=lk, window_size=window)
    assert not torch.isnan(o90).any(), f"{what}: NaN in out"
    e = rel_error(o90, ref)
    assert e <= rel_tol(q.dtype), f"{what}: out rel error {e:.2e} (sm80: {rel_error(o80, ref):.2e})"
    # lse: the same natural-log logsumexp of the scaled scores as the sm80 kernel, +inf alike
    assert torch.equal(torch.isinf(l90), torch.isinf(l80)), f"{what}: lse +inf rows differ"
    fin = torch.isfinite(l80)
    assert not torch.isnan(l90).any(), f"{what}: NaN in lse"
    err = (l90[fin] - l80[fin]).abs().max().item() if fin.any() else 0.0
    assert err <= 2e-3, f"{what}: lse differs from the sm80 kernel's by {err:.2e}"


def check_backward(q, k, v, dout, fmt, mask, lq, lk, window, what):
    """dq, dk, dv of the sm90 backward against the float64 reference (the
    tolerances of test_attn_cuda) and against the sm80 backward."""
    seqfuse.ops.set_attention_backward_kernel(80)
    _, _, g80 = run_ours(q, k, v, dout, fmt, mask, lq, lk, window)
    seqfuse.ops.set_attention_backward_kernel(90)
    assert seqfuse.ops.attention_backward_kernel(q.shape[-1], q.device)[0] == 90
    _, _, g90 = run_ours(q, k, v, dout, fmt, mask, lq, lk, window)
    ref, ref_grads = run_reference(q, k, v, dout, fmt, mask, lq, lk, window)
    for name, g, g8, r in zip(("dq", "dk", "dv"), g90, g80, ref_grads):
        assert not torch.isnan(g).any(), f"{what}: NaN in {name}"
        e, e80 = rel_error(g, r), rel_error(g8, r)
        assert e <= rel_tol(q.dtype, BACKWARD_FACTOR), f"{what}: {name} rel error {e:.2e} (sm80: {e80:.2e})"
        d = rel_error(g, g8)
        assert d <= rel_tol(q.dtype, BACKWARD_FACTOR), f"{what}: {name} differs from the sm80 backward's by {d:.2e}"


MASKS = ["no_mask", "padding", "causal", "padding_causal", "causal_bottom_right",
         "padding_causal_bottom_right"]


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "thd"])
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("h,hk", [(4, 4), (8, 2), (6, 1)])  # (4, 2) GQA: the tests below
@pytest.mark.parametrize("sq,sk", [(128, 128), (77, 150), (200, 65), (256, 384), (1, 9), (513, 300)])
def test_sm90_matches_reference(fmt, mask, d, h, hk, sq, sk, seed, sm90):
    if fmt == "thd" and mask not in PADDING:
        pytest.skip("thd always delimits sequences: covered by the padding masks")
    rng = random.Random(seed)
    q, k, v, dout, lq, lk = make_case(fmt, mask, 3, sq, sk, h, hk, d, torch.bfloat16, rng)
    sm90(q, k, v, dout, fmt, mask, lq, lk, None, f"{fmt} {mask} d={d} h={h}/{hk} {sq}x{sk} lq={lq} lk={lk}")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("mask", ["no_mask", "causal", "padding_causal_bottom_right"])
@pytest.mark.parametrize("sq,sk", [(63, 65), (191, 333), (500, 129), (1000, 1000)])
def test_sm90_dtypes_and_longer(dtype, d, mask, sq, sk, seed, sm90):
    rng = random.Random(seed)
    q, k, v, dout, lq, lk = make_case("bshd", mask, 2, sq, sk, 4, 2, d, dtype, rng)
    sm90(q, k, v, dout, "bshd", mask, lq, lk, None, f"{dtype} {mask} d={d} {sq}x{sk}")


@pytest.mark.cuda
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("mask", ["padding", "padding_causal"])
def test_sm90_packed_many_tiles(d, mask, seed, sm90):
    """Packed sequences of very different lengths, up to 23 key tiles: the
    K/V stages wrap around many times and blocks of one launch run different
    numbers of tiles (the forward's mbarrier phases)."""
    lq = [1500, 37, 2900, 640, 129]
    lk = list(lq)
    h, hk = 4, 2
    q = torch.randn(sum(lq) + 3, h, d, device="cuda").to(torch.bfloat16)
    k = torch.randn(sum(lk) + 2, hk, d, device="cuda").to(torch.bfloat16)
    v = torch.randn(sum(lk) + 2, hk, d, device="cuda").to(torch.bfloat16)
    dout = torch.randn_like(q)
    sm90(q, k, v, dout, "thd", mask, lq, lk, None, f"thd {mask} d={d} lq={lq}")


@pytest.mark.cuda
@pytest.mark.parametrize("window", [(0, 0), (16, 0), (100, 0), (33, 17), (-1, 5), (64, -1), (200, 130)])
@pytest.mark.parametrize("mask", ["no_mask", "causal", "padding_causal_bottom_right"])
@pytest.mark.parametrize("fmt", ["bshd", "thd"])
@pytest.mark.parametrize("d", [64, 128])
def test_sm90_sliding_window(window, mask, fmt, d, seed, sm90):
    if fmt == "thd" and mask not in PADDING:
        pytest.skip("thd always delimits sequences: covered by the padding masks")
    rng = random.Random(seed)
    q, k, v, dout, lq, lk = make_case(fmt, mask, 2, 300, 420, 4, 2, d, torch.bfloat16, rng)
    sm90(q, k, v, dout, fmt, mask, lq, lk, window, f"{fmt} {mask} d={d} window={window}")


@pytest.mark.cuda
def test_sm90_log_once_when_sm80_runs_on_hopper(caplog):
    if not is_hopper():
        pytest.skip("the log concerns Hopper GPUs")
    from seqfuse.ops.attn import _routing as routing

    forward_was = seqfuse.ops.attention_forward_kernel(64)[0]
    seqfuse.ops.set_attention_forward_kernel(80)
    routing._forward_reasons_logged.clear()
    q = torch.randn(1, 64, 2, 64, device="cuda", dtype=torch.bfloat16)
    try:
        with caplog.at_level(logging.INFO, logger="seqfuse"):
            for _ in range(3):
                seqfuse.ops.attention_forward(q, q, q)
    finally:
        seqfuse.ops.set_attention_forward_kernel(forward_was)
    hits = [r for r in caplog.records if "sm80 (mma.sync) kernel runs" in r.getMessage()]
    assert len(hits) == 1, [r.getMessage() for r in caplog.records]
    assert "sm80 kernel chosen" in hits[0].getMessage()


def test_forward_kernel_choice_rejects_other_values():
    expected = ValueError if seqfuse.build_info()["cuda"] else NotImplementedError
    with pytest.raises(expected):
        seqfuse.ops.set_attention_forward_kernel(75)
    # the forward's other schedules are the check programs' (csrc/build_checks.sh), not the library's
    assert not hasattr(seqfuse._C, "attn_set_forward_sm90_variant")


def test_forward_kernel_query_default():
    """The wgmma kernel is the default on Hopper for head dims 64 and 128 (it
    passed every check on an H200); elsewhere, and for other head dims, the
    sm80 kernel runs and the query says why where the device is Hopper."""
    if os.environ.get("SEQFUSE_ATTN_FORWARD_KERNEL"):
        pytest.skip("SEQFUSE_ATTN_FORWARD_KERNEL overrides the default")
    arch, why = seqfuse._C.attn_forward_kernel_for(128, 0)
    assert isinstance(why, str)
    if is_hopper():
        assert arch == 90 and why == ""
    else:
        assert arch == 80
    arch, why = seqfuse._C.attn_forward_kernel_for(32, 0)
    assert arch == 80
    if is_hopper():
        assert "head dims 64 and 128" in why


def test_forward_kernel_choice_asked_once_per_head_dim_and_device(monkeypatch):
    """The forward asks C for its kernel choice once per (head dim, device)
    until the choice changes, not on every call (host time per forward)."""
    from seqfuse.ops.attn import _routing as routing

    calls = []

    class FakeC:
        @staticmethod
        def attn_forward_kernel_for(d, dev, dropout=0):
            calls.append((d, dev))
            return 90, ""

        @staticmethod
        def attn_set_forward_kernel(arch):
            pass

    monkeypatch.setattr(routing, "_C", FakeC)
    monkeypatch.setattr(routing, "_forward_kernel_checked", set())
    q64, q128 = torch.empty(1, 4, 2, 64), torch.empty(1, 4, 2, 128)
    for _ in range(3):
        routing.note_forward_kernel(q64, False)
        routing.note_forward_kernel(q128, False)
    assert calls == [(64, 0), (128, 0)]
    routing.set_attention_forward_kernel(80)  # a new choice: asked again
    routing.note_forward_kernel(q64, False)
    assert calls == [(64, 0), (128, 0), (64, 0)]


class _FakeKernelC:
    """_C's kernel-choice functions, recording what the routing layer hands them."""

    def __init__(self):
        self.set = []

    def attn_set_forward_kernel(self, arch):
        self.set.append(("forward", arch))

    def attn_set_backward_kernel(self, arch):
        self.set.append(("backward", arch))

    def attn_forward_kernel_for(self, d, dev, dropout=0):
        return 90, ""

    def attn_backward_kernel_for(self, d, dev, deterministic, dropout=0):
        return 90, ""


@pytest.fixture
def kernel_env(monkeypatch):
    """The routing layer with a fake _C and its environment not read yet."""
    from seqfuse.ops.attn import _routing as routing

    fake = _FakeKernelC()
    monkeypatch.setattr(routing, "_C", fake)
    monkeypatch.setattr(routing, "_kernel_env_pending", {"forward", "backward"})
    monkeypatch.setattr(routing, "_forward_kernel_checked", set())
    monkeypatch.setattr(routing, "_backward_kernel_checked", set())
    monkeypatch.delenv("SEQFUSE_ATTN_FORWARD_KERNEL", raising=False)
    monkeypatch.delenv("SEQFUSE_ATTN_BACKWARD_KERNEL", raising=False)
    return routing, fake


def test_kernel_env_read_once_by_the_routing_layer(kernel_env, monkeypatch):
    """SEQFUSE_ATTN_FORWARD_KERNEL / SEQFUSE_ATTN_BACKWARD_KERNEL are read in Python
    (the C library reads no environment) at the first question about that
    direction, and handed to _C's setter once."""
    routing, fake = kernel_env
    monkeypatch.setenv("SEQFUSE_ATTN_FORWARD_KERNEL", "sm80")
    monkeypatch.setenv("SEQFUSE_ATTN_BACKWARD_KERNEL", " sm90 ")
    q = torch.empty(1, 4, 2, 64)
    for _ in range(3):
        routing.note_forward_kernel(q, False)
    assert fake.set == [("forward", 80)]
    routing.attention_backward_kernel(64, device=0)
    routing.note_backward_kernel(q, False)
    assert fake.set == [("forward", 80), ("backward", 90)]
    monkeypatch.setenv("SEQFUSE_ATTN_FORWARD_KERNEL", "sm90")  # read once: a later change is not seen
    routing.attention_forward_kernel(64, device=0)
    assert fake.set == [("forward", 80), ("backward", 90)]


def test_kernel_env_unset_keeps_default_and_setter_wins(kernel_env, monkeypatch):
    routing, fake = kernel_env
    monkeypatch.setenv("SEQFUSE_ATTN_BACKWARD_KERNEL", "")
    routing.attention_forward_kernel(64, device=0)
    routing.attention_backward_kernel(64, device=0)
    assert fake.set == []  # unset or empty: the C default (90) stays
    routing._kernel_env_pending.add("forward")
    monkeypatch.setenv("SEQFUSE_ATTN_FORWARD_KERNEL", "sm80")
    routing.set_attention_forward_kernel(90)  # an explicit choice overrides the environment
    routing.attention_forward_kernel(64, device=0)
    assert fake.set == [("forward", 90)]


def test_kernel_env_bad_value_names_the_variable(kernel_env, monkeypatch):
    routing, fake = kernel_env
    monkeypatch.setenv("SEQFUSE_ATTN_BACKWARD_KERNEL", "hopper")
    q = torch.empty(1, 4, 2, 64)
    for _ in range(2):  # raised at every question until fixed
        with pytest.raises(ValueError, match="SEQFUSE_ATTN_BACKWARD_KERNEL must be 'sm90' or 'sm80', got 'hopper'"):
            routing.note_backward_kernel(q, False)
    assert fake.set == []
    monkeypatch.setenv("SEQFUSE_ATTN_BACKWARD_KERNEL", "sm80")
    routing.note_backward_kernel(q, False)
    assert fake.set == [("backward", 80)]


# ---- the wgmma backward (csrc/attn/attn_backward_sm90_cuda.cu): also through the sm90 fixture above ----

@pytest.mark.cuda
def test_sm90_backward_autograd_and_deterministic(seed, caplog):
    """Through seqfuse.ops.attention's autograd: the sm90 backward's gradients
    match the sm80 deterministic ones; a deterministic call takes sm80 and
    says why once (WARNING, logger "seqfuse")."""
    from seqfuse.ops.attn import _routing as routing

    if not is_hopper():
        pytest.skip("the wgmma backward needs a compute capability 9.0 GPU")
    forward_was, backward_was = seqfuse.ops.attention_forward_kernel(64)[0], seqfuse.ops.attention_backward_kernel(64)[0]
    seqfuse.ops.set_attention_forward_kernel(90)
    seqfuse.ops.set_attention_backward_kernel(90)
    try:
        autograd_and_deterministic(seed, caplog, routing)
    finally:
        seqfuse.ops.set_attention_forward_kernel(forward_was)
        seqfuse.ops.set_attention_backward_kernel(backward_was)


def autograd_and_deterministic(seed, caplog, routing):
    torch.manual_seed(seed)
    q, k, v = (torch.randn(2, 300, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn(2, 300, 4, 128, device="cuda", dtype=torch.bfloat16)
    grads = {}
    routing._backward_reasons_logged.clear()
    with caplog.at_level(logging.INFO, logger="seqfuse"):
        for det in (False, True, True):
            for x in (q, k, v):
                x.grad = None
            seqfuse.ops.attention(q, k, v, attn_mask_type="causal", deterministic=det).backward(dout)
            grads[det] = [x.grad.clone() for x in (q, k, v)]
    arch, why = seqfuse.ops.attention_backward_kernel(128, q.device, deterministic=True)
    assert arch == 80 and "deterministic" in why
    assert seqfuse.ops.attention_backward_kernel(128, q.device)[0] == 90
    for name, a, b in zip(("dq", "dk", "dv"), grads[False], grads[True]):
        assert rel_error(a, b) <= rel_tol(torch.bfloat16, BACKWARD_FACTOR), f"{name}: sm90 vs deterministic sm80"
    hits = [r for r in caplog.records if "attention backward" in r.getMessage()]
    assert len(hits) == 1 and "deterministic" in hits[0].getMessage(), [r.getMessage() for r in caplog.records]
    assert hits[0].levelno == logging.WARNING


def test_backward_kernel_choice_rejects_other_values():
    expected = ValueError if seqfuse.build_info()["cuda"] else NotImplementedError
    with pytest.raises(expected):
        seqfuse.ops.set_attention_backward_kernel(75)
    with pytest.raises(expected):
        seqfuse.ops.set_attention_backward_kernel(-1)


def test_backward_kernel_query_default():
    """The wgmma backward is the default on Hopper for head dims 64 and 128
    (it passed every check on an H200); deterministic calls and other head
    dims get sm80 with the reason; elsewhere 80 with no reason."""
    if os.environ.get("SEQFUSE_ATTN_BACKWARD_KERNEL"):
        pytest.skip("SEQFUSE_ATTN_BACKWARD_KERNEL overrides the default")
    for d in (64, 128, 32):
        for det in (False, True):
            arch, why = seqfuse._C.attn_backward_kernel_for(d, 0, det)
            assert isinstance(why, str)
            if is_hopper():
                if d != 32 and not det:
                    assert arch == 90 and why == ""
                else:
                    assert arch == 80
                    # a head dim the wgmma kernel lacks is the first reason given
                    assert ("head dims 64 and 128" in why) if d == 32 else ("deterministic" in why)
            else:
                assert arch == 80
                if seqfuse.build_info()["cuda"] and torch.cuda.is_available():
                    assert why == ""


def test_backward_kernel_choice_asked_once_per_key(monkeypatch):
    """The backward asks C for its kernel choice once per (head dim, device,
    deterministic) until the choice changes, and logs a reason once."""
    from seqfuse.ops.attn import _routing as routing

    calls = []

    class FakeC:
        @staticmethod
        def attn_backward_kernel_for(d, dev, det, dropout=0):
            calls.append((d, dev, det))
            return (80, "deterministic backward: test") if det else (90, "")

        @staticmethod
        def attn_set_backward_kernel(arch):
            pass

    monkeypatch.setattr(routing, "_C", FakeC)
    monkeypatch.setattr(routing, "_backward_kernel_checked", set())
    monkeypatch.setattr(routing, "_backward_reasons_logged", set())
    q64 = torch.empty(1, 4, 2, 64)
    for _ in range(3):
        routing.note_backward_kernel(q64, False)
        routing.note_backward_kernel(q64, True)
    assert calls == [(64, 0, False), (64, 0, True)]
    assert routing._backward_reasons_logged == {"deterministic backward: test"}
    routing.set_attention_backward_kernel(90)  # a new choice: asked again
    routing.note_backward_kernel(q64, False)
    assert calls[-1] == (64, 0, False) and len(calls) == 3
