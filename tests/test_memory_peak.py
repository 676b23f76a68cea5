"""benchmarks/memory_peak.py's replay of an allocator history, on synthetic
snapshots in torch's documented format: the peak's moment and total, the
allocations live then grouped by the project frames that made them, frees
counted once whichever of free_requested / free_completed comes first."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import memory_peak  # noqa: E402

MiB = 2 ** 20


def frame(path, line, name):
    return {"filename": path, "line": line, "name": name}


TORCH = frame("/usr/lib/python3/site-packages/torch/nn/functional.py", 10, "linear")
LINEAR = frame("/repo/python/seqfuse/modules/linear.py", 120, "forward")
CACHE = frame("/repo/python/seqfuse/quantization/gemm_quantizers.py", 300, "get")
BENCH = frame("/repo/benchmarks/hf/bench_accelerate.py", 200, "step")


def alloc(addr, size, *frames):
    return {"action": "alloc", "addr": addr, "size": size, "frames": list(frames)}


def free(addr, size, action="free_requested"):
    return {"action": action, "addr": addr, "size": size, "frames": []}


def test_peak_moment_and_groups():
    events = [
        alloc(1, 64 * MiB, TORCH, LINEAR, BENCH),   # activation, kept to the peak
        alloc(2, 32 * MiB, CACHE, LINEAR, BENCH),   # weight copy, kept to the peak
        alloc(3, 50 * MiB, TORCH, LINEAR, BENCH),   # a temporary made and freed before the peak...
        free(3, 50 * MiB),
        free(3, 50 * MiB, "free_completed"),    # ...(its second free event counts nothing)
        alloc(4, 100 * MiB, TORCH, LINEAR, BENCH),  # the peak: 1 + 2 + 4 + 5 = 64 + 32 + 100 + 8 MiB
        alloc(5, 8 * MiB, CACHE, LINEAR, BENCH),
        free(4, 100 * MiB),
        free(1, 64 * MiB),
        alloc(6, 150 * MiB, TORCH, BENCH),       # after the peak: 32 + 8 + 150 = 190 < 204
    ]
    b = memory_peak.breakdown({"device_traces": [events]}, baseline=1024 * MiB)
    assert b["peak_event"] == 6 and b["events"] == len(events)
    assert b["recorded_peak_gib"] * 1024 == pytest.approx(204)
    assert b["peak_gib"] * 1024 == pytest.approx(1024 + 204) and b["baseline_gib"] == 1
    groups = {g["where"]: (g["count"], round(g["gib"] * 1024)) for g in b["groups"]}
    linear_bench = ("seqfuse/modules/linear.py:120 forward < benchmarks/hf/bench_accelerate.py:200 step")
    cache = ("seqfuse/quantization/gemm_quantizers.py:300 get < " + linear_bench)
    assert groups == {linear_bench: (2, 164), cache: (2, 40)}, groups
    assert [g["gib"] for g in b["groups"]] == sorted((g["gib"] for g in b["groups"]), reverse=True)
    text = memory_peak.format_breakdown("title", b, {"forward_peak": 1.5})
    assert "forward_peak 1.500" in text and cache in text and "1.199 GiB" in text


def test_peak_at_the_end_and_frees_by_completion_alone():
    """A history whose highest total is its last event (no free after it),
    and frees recorded only as free_completed."""
    events = [alloc(1, 10 * MiB, LINEAR), free(1, 10 * MiB, "free_completed"), alloc(2, 4 * MiB, LINEAR),
              alloc(3, 7 * MiB, TORCH)]
    b = memory_peak.breakdown({"device_traces": [events]})
    assert b["recorded_peak_gib"] * 1024 == pytest.approx(11) and b["peak_event"] == 3
    groups = {g["where"]: g["count"] for g in b["groups"]}
    assert groups == {"seqfuse/modules/linear.py:120 forward": 1, "functional.py:10 linear": 1}


def test_top_groups_and_the_rest():
    events = [alloc(i, (i + 1) * MiB, frame(f"/x/seqfuse/m{i}.py", i, "f")) for i in range(5)]
    b = memory_peak.breakdown({"device_traces": [events]}, top=2)
    assert [round(g["gib"] * 1024) for g in b["groups"]] == [5, 4, 1 + 2 + 3]
    assert b["groups"][-1]["where"] == "(3 more places)" and b["groups"][-1]["count"] == 3


def test_no_events():
    b = memory_peak.breakdown({"device_traces": []}, baseline=MiB)
    assert b["recorded_peak_gib"] == 0 and b["peak_event"] == -1 and b["groups"] == []
    assert memory_peak.where([]) == "?"


def test_truncated_history_and_the_counters_peak_are_said():
    events = [alloc(1, MiB, LINEAR), alloc(2, MiB, LINEAR)]
    full = memory_peak.breakdown({"device_traces": [events], "max_entries": 2})
    room = memory_peak.breakdown({"device_traces": [events], "max_entries": 3})
    assert full["truncated"] and not room["truncated"]
    text = memory_peak.format_breakdown("t", full, counter_peak_gib=0.5)
    assert "entry limit" in text and "counter's peak over the recording: 0.500 GiB" in text
    assert "entry limit" not in memory_peak.format_breakdown("t", room)
