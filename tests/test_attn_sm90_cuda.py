"""The Hopper (wgmma) attention forward, csrc/attn/attn_fwd_sm90_cuda.cu:
against the float64 reference (attn_ref.py) and against the sm80 forward
(same out, same lse meaning) for every layout, mask, window, GQA ratio, head
dim 64/128 and dtype, at lengths that are and are not multiples of the
128-row / 128-key tiles, outputs poisoned (NaN) before each run.  Also the
kernel choice (SEQFUSE_ATTN_FWD_KERNEL / set_attention_fwd_kernel), its
query and the once-per-reason log when a Hopper GPU runs the sm80 kernel.
The choice and query tests run on CPU-only machines too."""
import logging
import os
import random

import pytest
import torch

import seqfuse
from attn_ref import PADDING, reference
from helpers import rel_error
from test_attn_cuda import make_case, run_fwd as forward

FWD_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def is_hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


SM90_VARIANTS = [0, 1, 2, 3, 4]


@pytest.fixture(params=SM90_VARIANTS, ids=[f"sm90v{v}" for v in SM90_VARIANTS])
def sm90(request):
    """The wgmma forward for the test, every schedule (0: in order, 1: softmax
    overlapped with P V, 2: 1 warp-specialized with a producer warpgroup and
    an mbarrier K/V pipeline, 3: 2 with the consumers in ping-pong, 4: 3 with
    three consumer warpgroups of 192 rows at head dim 64), skipped
    off Hopper; the defaults (wgmma, schedule 4) restored after."""
    if not is_hopper():
        pytest.skip("the wgmma forward needs a compute capability 9.0 GPU")
    seqfuse._C.attn_set_fwd_sm90_variant(request.param)
    seqfuse.ops.set_attention_fwd_kernel(90)
    yield request.param
    seqfuse.ops.set_attention_fwd_kernel(90)
    seqfuse._C.attn_set_fwd_sm90_variant(4)


def both_kernels(q, k, v, fmt, mask, lq, lk, window=None):
    seqfuse.ops.set_attention_fwd_kernel(80)
    o80, l80 = forward(q, k, v, fmt, mask, lq, lk, window)
    seqfuse.ops.set_attention_fwd_kernel(90)
    assert seqfuse.ops.attention_fwd_kernel(q.shape[-1], q.device)[0] == 90
    o90, l90 = forward(q, k, v, fmt, mask, lq, lk, window)
    return o90, l90, o80, l80


def check(q, k, v, fmt, mask, lq, lk, window, what):
    o90, l90, o80, l80 = both_kernels(q, k, v, fmt, mask, lq, lk, window)
    ref = reference(q.double(), k.double(), v.double(), qkv_format=fmt, attn_mask_type=mask,
                    seqlens_q=lq, seqlens_kv=lk, window_size=window)
    assert not torch.isnan(o90).any(), f"{what}: NaN in out"
    e = rel_error(o90, ref)
    assert e <= FWD_TOL[q.dtype], f"{what}: out rel error {e:.2e} (sm80: {rel_error(o80, ref):.2e})"
    # lse: the same natural-log logsumexp of the scaled scores as the sm80 kernel, +inf alike
    assert torch.equal(torch.isinf(l90), torch.isinf(l80)), f"{what}: lse +inf rows differ"
    fin = torch.isfinite(l80)
    assert not torch.isnan(l90).any(), f"{what}: NaN in lse"
    err = (l90[fin] - l80[fin]).abs().max().item() if fin.any() else 0.0
    assert err <= 2e-3, f"{what}: lse differs from the sm80 kernel's by {err:.2e}"


MASKS = ["no_mask", "padding", "causal", "padding_causal", "causal_bottom_right",
         "padding_causal_bottom_right"]


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "thd"])
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("h,hk", [(4, 4), (6, 1)])  # (4, 2) GQA: the tests below
@pytest.mark.parametrize("sq,sk", [(128, 128), (77, 150), (200, 65), (256, 384), (1, 9)])
def test_sm90_matches_reference(fmt, mask, d, h, hk, sq, sk, seed, sm90):
    if fmt == "thd" and mask not in PADDING:
        pytest.skip("thd always delimits sequences: covered by the padding masks")
    rng = random.Random(seed)
    q, k, v, _, lq, lk = make_case(fmt, mask, 3, sq, sk, h, hk, d, torch.bfloat16, rng)
    check(q, k, v, fmt, mask, lq, lk, None, f"{fmt} {mask} d={d} h={h}/{hk} {sq}x{sk} lq={lq} lk={lk}")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("mask", ["no_mask", "causal", "padding_causal_bottom_right"])
@pytest.mark.parametrize("sq,sk", [(191, 333), (500, 129), (1000, 1000)])
def test_sm90_dtypes_and_longer(dtype, d, mask, sq, sk, seed, sm90):
    rng = random.Random(seed)
    q, k, v, _, lq, lk = make_case("bshd", mask, 2, sq, sk, 4, 2, d, dtype, rng)
    check(q, k, v, "bshd", mask, lq, lk, None, f"{dtype} {mask} d={d} {sq}x{sk}")


@pytest.mark.cuda
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("mask", ["padding", "padding_causal"])
def test_sm90_packed_many_tiles(d, mask, seed, sm90):
    """Packed sequences of very different lengths, up to 23 key tiles: the
    K/V stages (two or three) wrap around many times and blocks of one launch
    run different numbers of tiles (the mbarrier phases of schedules 2 and 3)."""
    lq = [1500, 37, 2900, 640, 129]
    lk = list(lq)
    h, hk = 4, 2
    q = torch.randn(sum(lq) + 3, h, d, device="cuda").to(torch.bfloat16)
    k = torch.randn(sum(lk) + 2, hk, d, device="cuda").to(torch.bfloat16)
    v = torch.randn(sum(lk) + 2, hk, d, device="cuda").to(torch.bfloat16)
    check(q, k, v, "thd", mask, lq, lk, None, f"thd {mask} d={d} lq={lq}")


@pytest.mark.cuda
@pytest.mark.parametrize("window", [(0, 0), (16, 0), (100, 0), (33, 17), (-1, 5), (64, -1), (200, 130)])
@pytest.mark.parametrize("mask", ["no_mask", "causal", "padding_causal_bottom_right"])
@pytest.mark.parametrize("fmt", ["bshd", "thd"])
@pytest.mark.parametrize("d", [64, 128])
def test_sm90_sliding_window(window, mask, fmt, d, seed, sm90):
    if fmt == "thd" and mask not in PADDING:
        pytest.skip("thd always delimits sequences: covered by the padding masks")
    rng = random.Random(seed)
    q, k, v, _, lq, lk = make_case(fmt, mask, 2, 300, 420, 4, 2, d, torch.bfloat16, rng)
    check(q, k, v, fmt, mask, lq, lk, window, f"{fmt} {mask} d={d} window={window}")


@pytest.mark.cuda
def test_sm90_log_once_when_sm80_runs_on_hopper(caplog):
    if not is_hopper():
        pytest.skip("the log concerns Hopper GPUs")
    from seqfuse.ops import attn as attn_mod

    seqfuse.ops.set_attention_fwd_kernel(80)
    attn_mod._fwd_reasons_logged.clear()
    q = torch.randn(1, 64, 2, 64, device="cuda", dtype=torch.bfloat16)
    try:
        with caplog.at_level(logging.INFO, logger="seqfuse"):
            for _ in range(3):
                seqfuse.ops.attention_fwd(q, q, q)
    finally:
        seqfuse.ops.set_attention_fwd_kernel(90)
    hits = [r for r in caplog.records if "sm80 (mma.sync) kernel runs" in r.getMessage()]
    assert len(hits) == 1, [r.getMessage() for r in caplog.records]
    assert "sm80 kernel chosen" in hits[0].getMessage()


def test_fwd_kernel_choice_rejects_other_values():
    expected = ValueError if seqfuse.build_info()["cuda"] else NotImplementedError
    with pytest.raises(expected):
        seqfuse.ops.set_attention_fwd_kernel(75)
    with pytest.raises(expected):
        seqfuse._C.attn_set_fwd_sm90_variant(5)
    with pytest.raises(expected):
        seqfuse._C.attn_set_fwd_sm90_variant(-1)


def test_fwd_kernel_query_default():
    """The wgmma kernel is the default on Hopper for head dims 64 and 128 (it
    passed every check on an H200); elsewhere, and for other head dims, the
    sm80 kernel runs and the query says why where the device is Hopper."""
    if os.environ.get("SEQFUSE_ATTN_FWD_KERNEL"):
        pytest.skip("SEQFUSE_ATTN_FWD_KERNEL overrides the default")
    arch, why = seqfuse._C.attn_fwd_kernel_for(128, 0)
    assert isinstance(why, str)
    if is_hopper():
        assert arch == 90 and why == ""
    else:
        assert arch == 80
    arch, why = seqfuse._C.attn_fwd_kernel_for(32, 0)
    assert arch == 80
    if is_hopper():
        assert "head dims 64 and 128" in why


def test_fwd_kernel_choice_asked_once_per_head_dim_and_device(monkeypatch):
    """The forward asks C for its kernel choice once per (head dim, device)
    until the choice changes, not on every call (host time per forward)."""
    from seqfuse.ops import attn as attn_mod

    calls = []

    class FakeC:
        @staticmethod
        def attn_fwd_kernel_for(d, dev):
            calls.append((d, dev))
            return 90, ""

        @staticmethod
        def attn_set_fwd_kernel(arch):
            pass

    monkeypatch.setattr(attn_mod, "_C", FakeC)
    monkeypatch.setattr(attn_mod, "_fwd_kernel_checked", set())
    q64, q128 = torch.empty(1, 4, 2, 64), torch.empty(1, 4, 2, 128)
    for _ in range(3):
        attn_mod._note_fwd_kernel(q64)
        attn_mod._note_fwd_kernel(q128)
    assert calls == [(64, 0), (128, 0)]
    attn_mod.set_attention_fwd_kernel(80)  # a new choice: asked again
    attn_mod._note_fwd_kernel(q64)
    assert calls == [(64, 0), (128, 0), (64, 0)]
