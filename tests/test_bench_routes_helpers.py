"""The pure helpers behind bench_routes.py's new sweep layouts (padded,
sbhd, window, gqa), on the CPU: the banded FLOP count against a brute-force
count of the mask, the padded lengths and masks, --sweep-layouts' parsing,
the scaled error, the rows a cell builds, and the output check before
timing, run on seqfuse's CPU kernels against the SDPA peers the benchmark
uses (the padded layout's key-padding mask, the window layout's banded mask)
and against a peer that disagrees.  (The timings need a GPU.)"""
import argparse
import os
import random
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(HERE, "benchmarks"), os.path.join(HERE, "benchmarks", "attn")]
import bench_routes as bench  # noqa: E402
from helpers import fresh_routing  # noqa: E402


@pytest.mark.parametrize("n", [1, 2, 7, 64, 300])
@pytest.mark.parametrize("left,right", [(-1, -1), (-1, 0), (0, 0), (3, 0), (256, 0), (5, 2), (0, -1), (400, 400)])
def test_band_pairs_counts_the_masks_pairs(n, left, right):
    assert bench.band_pairs(n, left, right) == int(bench.banded_mask(n, left, right).sum())


def test_attention_pairs_conventions_and_the_window_band():
    lengths = [1024, 512]
    assert bench.attention_pairs(lengths, False) == 1024 ** 2 + 512 ** 2
    assert bench.attention_pairs(lengths, True) == (1024 ** 2 + 512 ** 2) / 2  # the rows without a window
    assert bench.attention_pairs(lengths, True, (-1, 0)) == (1024 ** 2 + 512 ** 2) / 2
    assert bench.attention_pairs(lengths, False, (-1, -1)) == 1024 ** 2 + 512 ** 2
    band = sum(n * 257 - 256 * 257 // 2 for n in lengths)  # 257 keys a query, fewer in the first 256 rows
    assert bench.attention_pairs(lengths, True, (256, 0)) == band
    assert bench.attention_pairs(lengths, True, (256, 7)) == band  # causal: the right edge is 0
    assert bench.attention_pairs([100], True, (256, 0)) == 100 * 101 / 2  # the window wider than the sequence
    h, d = 16, 128
    assert bench.flops(lengths, h, d, True, False, (256, 0)) == 4.0 * h * d * band
    assert bench.flops(lengths, h, d, True, True, (256, 0)) == 4.0 * h * d * band * 3.5
    assert bench.flops(lengths, h, d, True, True) == 4.0 * h * d * (1024 ** 2 + 512 ** 2) / 2 * 3.5


@pytest.mark.parametrize("s,b", [(512, 32), (1024, 16), (32768, 1), (3, 5), (1, 2)])
def test_padded_lengths(s, b):
    for seed in range(10):
        lengths = bench.padded_lengths(s, b, random.Random(seed))
        assert len(lengths) == b and all(max(1, s // 2) <= n <= s for n in lengths)
        assert lengths == bench.padded_lengths(s, b, random.Random(seed))
    drawn = [n for seed in range(50) for n in bench.padded_lengths(64, 16, random.Random(seed))]
    assert min(drawn) == 32 and max(drawn) == 64  # both ends reached: uniform over [s/2, s]


@pytest.mark.parametrize("causal", [False, True])
def test_padding_masks(causal):
    lengths, s = [5, 8, 1], 8
    keep = bench.key_padding_keep(lengths, s)
    assert keep.shape == (3, 8) and keep.sum(1).tolist() == lengths
    mask = bench.padding_mask(keep, causal)
    assert mask.shape == ((3, 1, 8, 8) if causal else (3, 1, 1, 8))
    full = mask.expand(3, 1, s, s)[:, 0]  # [b, query, key]
    real = sum(int(full[i, :n].sum()) for i, n in enumerate(lengths))  # pairs over the real queries
    assert real == sum(n * (n + 1) // 2 if causal else n * n for n in lengths)
    for i, n in enumerate(lengths):
        assert not full[i, :, n:].any()  # padding keys never seen
        for r in range(s):  # each query sees every real key (up to itself when causal)
            assert full[i, r, :(min(r, n - 1) + 1 if causal else n)].all()


def test_layout_list():
    assert bench.layout_list("bshd") == ("bshd",)
    assert bench.layout_list("all") == bench.SWEEP_LAYOUTS
    assert bench.layout_list("gqa, window,thd") == ("thd", "window", "gqa")  # the sweep's order
    assert bench.layout_list("padded,all") == bench.SWEEP_LAYOUTS
    for bad in ("", ",", "bshd,nope", "BSHD"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.layout_list(bad)
    assert bench.head_dims("64,128") == [64, 128]
    for bad in ("96", "1024", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.head_dims(bad)


def test_scaled_error():
    ref = torch.tensor([1.0, -4.0, 2.0])
    assert bench.scaled_error(ref + torch.tensor([0.0, 0.04, 0.0]), ref) == pytest.approx((0.04, 0.01), rel=1e-5)
    assert bench.scaled_error(torch.zeros(3), torch.zeros(3)) == (0.0, 0.0)
    assert bench.scaled_error(torch.ones(3), torch.zeros(3))[1] == float("inf")
    nan = bench.scaled_error(torch.tensor([float("nan"), 0.0, 0.0]), ref)
    assert nan[1] != nan[1] and not nan[1] <= 1.0  # never within a tolerance


def _cpu_inputs(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    monkeypatch.setattr(bench, "_rand", lambda *shape: torch.randn(*shape, generator=gen))


@pytest.mark.parametrize("causal", [False, True])
def test_sweep_case_builds_the_new_layouts(causal, monkeypatch):
    _cpu_inputs(monkeypatch)
    s, d, tokens = 256, 64, 1024
    case = bench.sweep_case(s, d, causal, tokens=tokens, layouts=bench.SWEEP_LAYOUTS)
    layouts = [row[6].get("layout") for row in case.rows]
    want = ["bshd"] * 3 + ["thd"] * 3 + ["padded"] * 3 + ["sbhd"] * 2 + (["window"] * 2 + ["gqa"] * 2 if causal else [])
    assert layouts == want
    rows = {row[6]["layout"] + " " + row[0].split(":")[0].split(" ")[0]: row for row in case.rows}
    padded = rows["padded auto"]
    assert padded[2][0].shape == (4, s, 32, d) and all(s // 2 <= n <= s for n in padded[4])
    assert rows["padded peer"][4] == padded[4]  # FLOPs over the real tokens only
    ceiling = rows["padded ceiling"]
    per_token = sum(n * n for n in padded[4]) / sum(padded[4])
    assert abs(ceiling[4][0] - per_token) <= 32 and ceiling[0].endswith("(padded's FLOPs per real token)")
    sbhd = rows["sbhd auto"]
    assert sbhd[2][0].shape == (s, 4, 32, d)
    assert torch.equal(rows["sbhd ceiling"][2][0], sbhd[2][0].transpose(0, 1))  # the same values as bshd
    assert [c["layout"] for c in case.checks] == ["padded", "sbhd"] + (["window", "gqa"] if causal else [])
    if causal:
        assert rows["window auto"][6]["window"] == (256, 0) == rows["window peer"][6]["window"]
        gqa = rows["gqa auto"]
        assert gqa[6]["heads"] == "32/8" and gqa[2][1].shape == (4, s, 8, d)
        assert "enable_gqa" in rows["gqa ceiling"][0]
    # the old calls build the old rows, untagged by new layouts
    old = bench.sweep_case(s, d, causal, tokens=tokens)
    assert [row[6]["layout"] for row in old.rows] == ["bshd"] * 3 + ["thd"] * 3 and not old.checks
    # window and gqa are causal cells' layouts: a full cell of those alone has no rows (main skips it)
    assert len(bench.sweep_case(s, d, causal, tokens=tokens, layouts=("window", "gqa")).rows) == (4 if causal else 0)


@pytest.mark.parametrize("causal", [False, True])
def test_verify_passes_seqfuse_against_the_padded_peer_and_refuses_a_wrong_one(causal, monkeypatch):
    """seqfuse's CPU kernels on the padded layout against SDPA with the mask
    a Hugging Face model builds: they agree on the real queries (outputs and
    gradients); a peer that is off by 5 % of its scale turns every padded
    row into an error row that is not timed."""
    fresh_routing(monkeypatch)
    _cpu_inputs(monkeypatch)
    case = bench.sweep_case(64, 64, causal, tokens=256, layouts=("padded",))
    bench.verify(case)
    ours, peer, ceiling = case.rows
    assert ours[1] is not None and peer[1] is not None and ceiling[1] is not None
    assert ours[6]["check_scaled_err"] < 1e-4 and ours[6]["check_scaled_err_grad"] < 1e-4
    assert ours[6]["check_against"] == peer[0] and peer[6]["check_against"] == ours[0]

    case = bench.sweep_case(64, 64, causal, tokens=256, layouts=("padded",))
    label, fn, inputs, dout, lengths, error, meta = case.rows[1]

    def off(q, k, v):
        out = fn(q, k, v)
        return out + 0.05 * out.detach().abs().max()
    case.rows[1] = (label, off, inputs, dout, lengths, error, meta)
    bench.verify(case)
    assert all(row[1] is None and "outputs disagree" in row[5] for row in case.rows)
    assert case.rows[0][6]["check_scaled_err"] > 0.02


def _varlen_standin(cu, max_len, window):
    """varlen_attn's computation on the CPU (SDPA per sequence with the
    banded mask): checks the window peer's cu_seqlens and views."""
    def call(q, k, v):
        outs = []
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            assert b - a <= max_len
            x = [t[a:b].transpose(0, 1) for t in (q, k, v)]
            out = torch.nn.functional.scaled_dot_product_attention(*x, attn_mask=bench.banded_mask(b - a, *window))
            outs.append(out.transpose(0, 1))
        return torch.cat(outs)
    return call


@pytest.mark.parametrize("varlen", [False, True])
def test_verify_window_against_its_peer(varlen, monkeypatch):
    """seqfuse's window (256, 0) on its CPU kernels against the window
    layout's peer: varlen_attn on the same tensors as [b * s, h, d] (a CPU
    stand-in here: varlen_attn needs CUDA), or where this torch's
    varlen_attn has no window, SDPA with the banded mask."""
    fresh_routing(monkeypatch)
    _cpu_inputs(monkeypatch)
    monkeypatch.setattr(bench, "varlen_has_window", lambda: varlen)
    monkeypatch.setattr(bench, "torch_varlen_window", _varlen_standin)
    case = bench.Case("window", [320, 320], 2, 2, 16, True)
    bench.add_window(case, 320, 2, 2, 16)  # (the cell's 2048 / d heads are slow on seqfuse's CPU kernels)
    peer = case.rows[1]
    if varlen:
        assert peer[0] == "peer: torch varlen_attn window (256, 0) (bshd as thd)" and peer[2][0].shape == (640, 2, 16)
        assert peer[2][0].data_ptr() == case.rows[0][2][0].data_ptr()  # the same tensors
    else:
        assert peer[0].startswith("peer: torch SDPA, banded bool mask")
    bench.verify(case)
    assert all(row[1] is not None for row in case.rows)
    assert case.rows[0][6]["check_scaled_err"] < 1e-4 and case.rows[0][6]["check_scaled_err_grad"] < 1e-4


@pytest.mark.parametrize("causal", [False, True])
def test_verify_sbhd_and_gqa_against_their_ceilings(causal, monkeypatch):
    """The sbhd layout (seqfuse on [s, b, h, d] against the ceiling on the
    same values as bshd) and the gqa one (8 q heads, 2 k/v heads), on
    seqfuse's CPU kernels, the cuDNN ceiling stood in for by SDPA without a
    backend restriction (cuDNN needs a GPU): the views line up and they
    agree."""
    fresh_routing(monkeypatch)
    _cpu_inputs(monkeypatch)
    monkeypatch.setattr(bench, "cudnn_ceiling", lambda c: bench.sdpa_bshd(c))
    case = bench.Case("sbhd + gqa", [48] * 3, 8, 8, 16, causal)
    bench.add_sbhd(case, 48, 3, 8, 16, causal)
    bench.add_gqa(case, 48, 3, 8, 16)
    assert case.rows[2][6]["heads"] == "8/2" and case.rows[2][2][1].shape == (3, 48, 2, 16)
    bench.verify(case)
    assert all(row[1] is not None for row in case.rows)
    for row in case.rows:
        assert row[6]["check_scaled_err"] < 1e-4 and row[6]["check_scaled_err_grad"] < 1e-4


def test_verify_records_a_row_that_raises(monkeypatch):
    fresh_routing(monkeypatch)
    _cpu_inputs(monkeypatch)
    case = bench.sweep_case(64, 64, True, tokens=128, layouts=("padded", "sbhd"))

    def broken(q, k, v):
        raise RuntimeError("no kernel\nsecond line")
    label, _, inputs, dout, lengths, error, meta = case.rows[1]
    case.rows[1] = (label, broken, inputs, dout, lengths, error, meta)
    monkeypatch.setattr(case, "checks", case.checks[:1])  # (sbhd's peer is cuDNN: not on a CPU)
    bench.verify(case)
    padded = [row for row in case.rows if row[6]["layout"] == "padded"]
    assert all(row[1] is None and "raised RuntimeError: no kernel" in row[5] for row in padded)
    assert all(row[1] is not None for row in case.rows if row[6]["layout"] == "sbhd")  # its own layout only


def test_run_case_ratios_stay_within_a_layout(monkeypatch):
    """vs_ceiling: each sweep row against its own layout's ceiling (bshd's
    default-SDPA peer, listed after the bshd ceiling, no longer against the
    thd ceiling after it); the window layout has none; vs_peer against the
    layout's peer; the window's FLOPs are the band's."""
    fresh_routing(monkeypatch)
    _cpu_inputs(monkeypatch)
    monkeypatch.setattr(bench, "verify", lambda case, tol: None)
    monkeypatch.setattr(bench.torch.cuda, "empty_cache", lambda: None)
    ms = {"auto": 2.0, "ceiling": 1.0, "peer": 4.0}
    monkeypatch.setattr(bench, "timed", lambda fn, inputs, dout, backward, queue=1: ms[fn.kind])
    case = bench.sweep_case(512, 64, True, tokens=1024, layouts=("bshd", "thd", "window"))
    for i, row in enumerate(case.rows):
        def fn(*a):
            return None
        fn.kind = row[0].split(":")[0].split(" ")[0]
        case.rows[i] = (row[0], fn) + row[2:]
    table = bench.Table("test_bench_routes_helpers", ["route", "layout", "ms"])
    bench.run_case(table, case)
    rows = {(r["layout"], r["route"].split(":")[0].split(" ")[0]): r for r in table.rows[:len(case.rows)]}
    assert rows[("bshd", "peer")]["vs_ceiling"] == pytest.approx(0.25)  # its own ceiling (1 ms), same FLOPs
    assert rows[("bshd", "auto")]["vs_ceiling"] == pytest.approx(0.5) and rows[("bshd", "auto")]["vs_peer"] == 2.0
    assert "vs_ceiling" not in rows[("window", "auto")] and rows[("window", "auto")]["vs_peer"] == 2.0
    band = 4.0 * 32 * 64 * 2 * (512 * 257 - 256 * 257 // 2)
    assert rows[("window", "auto")]["tflops"] == pytest.approx(band / 2.0 / 1e9)
    assert rows[("window", "auto")]["window"] == (256, 0)
