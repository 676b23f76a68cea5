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
