"""benchmarks/bench_fp8_weight_transpose.py on the CPU at its tiny row: every
weight-cache mode runs and is recorded, and the two settings it switches
are given back as they were.  Times on a CPU mean nothing."""
import json
import os
import sys

import pytest

from helpers import needs_fp8

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))


@needs_fp8
def test_bench_fp8_weight_transpose_tiny_cpu(tmp_path):
    import bench_fp8_weight_transpose as bench
    from seqfuse.quantization import (set_weight_rowwise_cache, set_weight_transpose_cache, weight_rowwise_cache,
                                      weight_transpose_cache)

    before = set_weight_transpose_cache(False), set_weight_rowwise_cache(True)
    try:
        out = str(tmp_path / "fwt")
        bench.main(["--rows", "tiny", "--device", "cpu", "--rounds", "1", "--steps", "1", "--out", out])
        assert (weight_transpose_cache(), weight_rowwise_cache()) == (False, True)
    finally:
        set_weight_transpose_cache(before[0])
        set_weight_rowwise_cache(before[1])
    with open(out + ".json") as f:
        doc = json.load(f)
    rows = doc["rows"]
    assert [r["mode"] for r in rows] == list(bench.MODES) == ["both", "transpose", "rowwise"]
    assert all(r["row"] == "tiny" and r["ms"] > 0 for r in rows)
    assert rows[0]["time_vs_both"] == pytest.approx(1.0)


@needs_fp8
def test_ab_weight_rowwise_cache_runs_and_restores(tmp_path):
    """benchmarks/ab_weight_rowwise_cache.py: a row per recipe, both
    layouts timed, the setting given back."""
    import ab_weight_rowwise_cache as ab
    from seqfuse.quantization import weight_rowwise_cache

    before = weight_rowwise_cache()
    out = str(tmp_path / "ab")
    ab.main(["--rounds", "2", "--iters", "1", "--out", out])
    assert weight_rowwise_cache() == before
    with open(out + ".json") as f:
        rows = json.load(f)["rows"]
    assert [r["recipe"] for r in rows] == ["delayed", "current", "block"]
    assert all(r["lean_us"] > 0 and r["keep_us"] > 0 and r["bf16_us"] > 0 for r in rows)
