"""benchmarks/attn/bench_routes.py on the CPU: the sweep's packed lengths
hold exactly the asked tokens within [s/2, 3s/2] (the last cut to fit), the
same for a seed; each row's ratio is to its own layout's ceiling (the first
ceiling row at or after it), none where that ceiling was not timed;
--rounds' rotated order, medians and error rows, and --queue's per-call
figure, with a stand-in timer.  (The timings need a GPU.)"""
import os
import random
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(HERE, "benchmarks"), os.path.join(HERE, "benchmarks", "attn")]
import bench_routes as bench  # noqa: E402
from helpers import fresh_routing  # noqa: E402


@pytest.mark.parametrize("s,tokens", [(512, 16384), (4096, 16384), (16384, 16384), (32768, 32768), (3, 10)])
def test_sweep_lengths(s, tokens):
    for seed in range(20):
        lengths = bench.sweep_lengths(s, tokens, random.Random(seed))
        assert sum(lengths) == tokens and all(n >= 1 for n in lengths)
        assert all(max(1, s // 2) <= n <= s + s // 2 for n in lengths[:-1])
        assert lengths[-1] <= s + s // 2
        assert lengths == bench.sweep_lengths(s, tokens, random.Random(seed))


def test_each_row_against_its_layouts_ceiling():
    rows = [dict(route="auto bshd", tflops=300.0), dict(route="ceiling: bshd", tflops=400.0),
            dict(route="auto thd", tflops=100.0), dict(route="peer: varlen", error="absent"),
            dict(route="ceiling: thd's FLOPs", tflops=200.0)]
    figures = {"auto bshd": (1.0, 300.0), "ceiling: bshd": (0.75, 400.0), "auto thd": (2.0, 100.0),
               "ceiling: thd's FLOPs": (1.0, 200.0)}
    bench.with_ceilings(rows, figures)
    assert [r.get("vs_ceiling") for r in rows] == [0.75, 1.0, 0.5, None, 1.0]
    rows = [dict(route="auto bshd", tflops=300.0), dict(route="ceiling: bshd", error="no kernel")]
    bench.with_ceilings(rows, {"auto bshd": (1.0, 300.0)})  # the ceiling failed: no ratio at all
    assert "vs_ceiling" not in rows[0]



@pytest.mark.parametrize("causal", [False, True])
def test_sweep_and_packed_cases_share_the_thd_rows(causal, monkeypatch):
    """sweep_case and packed_case build their packed rows and their thd
    ceiling with the same helpers (built here on CPU tensors, nothing run):
    the keywords describe the packed batch, and the ceiling's equal
    sequences carry the packed batch's attention FLOPs per token within the
    rounding of its length to 64."""
    monkeypatch.setattr(bench, "_rand", lambda *shape: torch.zeros(*shape, dtype=torch.bfloat16))
    case = bench.sweep_case(1024, 64, causal, tokens=4096, rng=random.Random(1))
    labels = [row[0] for row in case.rows]
    assert labels[0] == "auto bshd" and labels[1] == "ceiling: cuDNN SDPA bshd 4 x 1024"
    assert labels[2] == "peer: torch SDPA default bshd"
    del case.rows[2]  # (the rows below as packed_case has them)
    labels = labels[:2] + labels[3:]
    assert labels[2].startswith("auto thd, ") and labels[3] == "peer: torch varlen_attn thd"
    assert labels[4].startswith("ceiling: cuDNN SDPA bshd ") and labels[4].endswith(" (thd's FLOPs per token)")
    assert [row[0] for row in bench.sweep_case(1024, 64, causal, tokens=4096, thd=False).rows] == labels[:2] + [
        "peer: torch SDPA default bshd"]
    lengths = case.rows[2][4]
    assert sum(lengths) == 4096
    q, _, _, cu, kw = bench.thd_inputs(lengths, 32, 8, 64, causal)
    assert q.shape == (4096, 32, 64) and cu.tolist()[-1] == 4096 and kw["max_seqlen_q"] == max(lengths)
    assert kw["attn_mask_type"] == ("padding_causal" if causal else "padding")
    per_token = sum(n * n for n in lengths) / 4096
    s_ceiling = case.rows[4][4][0]
    assert abs(s_ceiling - per_token) <= 32 and s_ceiling % 64 == 0
    packed = bench.packed_case("p", lengths, 32, 8, 64, causal)
    assert [row[0] for row in packed.rows][-1] == f"ceiling: cuDNN SDPA bshd {case.rows[4][2][0].shape[0]} x " \
        f"{s_ceiling} (MHA, 32 k/v heads)"


def test_run_case_rotates_the_rows_and_keeps_each_rows_median(monkeypatch):
    """--rounds: each direction times the rows once a round, the order
    rotated by one row a round and reversed every other round; a row's ms is
    the median of its rounds with their range beside it; a row that raises
    keeps its error and is not timed again in that direction (it is tried
    again in the other); --queue reaches every timing."""
    from seqfuse.ops.attn import _routing as routing
    fresh_routing(monkeypatch, backend=routing._backend, ragged_on=routing._ragged_on)
    order = []
    clock = iter(range(1, 100))

    def fake_timed(fn, inputs, dout, backward, queue=1):
        assert queue == 4
        order.append((fn.__name__, backward))
        if fn.__name__ == "broken":
            raise RuntimeError("no kernel for this\nsecond line")
        return float(next(clock))

    def named(name):
        def fn(*args):
            return None
        fn.__name__ = name
        return fn

    monkeypatch.setattr(bench, "timed", fake_timed)
    monkeypatch.setattr(bench.torch.cuda, "empty_cache", lambda: None)
    case = bench.Case("c", [4, 4], 2, 2, 8, False)
    x = torch.zeros(8, 2, 8)
    for name in ("auto", "ceiling", "broken"):
        case.add(f"{name} bshd", named(name), (x, x, x), [4, 4])
    case.add("peer bshd", None, (x, x, x), [4, 4], error="not installed")
    table = bench.Table("test_run_case", ["case", "direction", "route", "ms"])
    was = routing._read_backend()
    bench.run_case(table, case, rounds=3, queue=4)
    forward = [name for name, backward in order if not backward]
    # rows 0-3 = auto, ceiling, broken, peer (never made); round 0: 0 1 2 3; round 1: 1 2 3 0 reversed,
    # 0 3 2 1 (broken not timed again); round 2: 2 3 0 1
    assert forward == ["auto", "ceiling", "broken", "auto", "ceiling", "auto", "ceiling"]
    assert [name for name, backward in order if backward][:3] == ["auto", "ceiling", "broken"]
    auto, ceiling, broken, peer = table.rows[:4]
    assert (auto["ms"], auto["ms_min"], auto["ms_max"], auto["rounds"], auto["queue"]) == (3.0, 1.0, 5.0, 3, 4)
    assert (ceiling["ms"], ceiling["ms_min"], ceiling["ms_max"]) == (4.0, 2.0, 6.0)
    assert broken["error"] == "no kernel for this" and "ms" not in broken
    assert peer["error"] == "not installed" and "ms" not in peer
    assert len(table.rows) == 8 and [r["direction"] for r in table.rows[4:]] == ["forward+backward"] * 4
    assert routing._backend == was  # put back as it was


def test_timed_queue_issues_the_calls_back_to_back_and_reports_one(monkeypatch):
    """--queue N: one timed step issues N calls (forward: without grad;
    forward+backward: each with its backward) and the figure is per call."""
    calls = []
    monkeypatch.setattr(bench, "cuda_time_ms", lambda step: step() or 8.0)
    x = torch.zeros(2, 3)
    assert bench.timed(lambda *a: calls.append(torch.is_grad_enabled()), (x,), None, False, queue=4) == 2.0
    assert calls == [False] * 4
    grads = []
    y = torch.ones(2, 3)
    ms = bench.timed(lambda t: grads.append(torch.is_grad_enabled()) or t * 2.0, (y,), torch.ones(2, 3), True,
                     queue=2)
    assert ms == 4.0 and grads == [True, True]
