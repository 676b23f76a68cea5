"""benchmarks/esm2/bench_esm2_convergence.py --merge on the CPU: runs saved by
separate processes (one run each, as on two GPUs at once) are joined into one
comparison whose bound checks sit at the last validation step every run
reached; parts of different settings, or unfinished ones, are refused.  The
parts are written by the script's own writer from synthetic curves, into a
temporary results folder."""
import argparse
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "esm2"))

import harness  # noqa: E402
import bench_esm2_convergence as conv  # noqa: E402

META = {"size": "tiny", "steps_planned": 6, "tokens_per_step": 1024, "lr": 5e-4, "warmup": 2,
        "bound_nats": 0.05, "fp8_bound_nats": 0.05, "data": "x", "train_proteins": 10,
        "real_train_tokens_planned": 6000, "time_budget_s": None}


@pytest.fixture
def results_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "RESULTS", str(tmp_path))
    monkeypatch.setattr(conv, "RESULTS", str(tmp_path))
    return tmp_path


def _args(out, **kw):
    a = dict(out=out, bound=0.05, fp8_bound=0.05, steps=6, size="tiny", tokens=1024, merge=None)
    a.update(kw)
    return argparse.Namespace(**a)


def _part(name, run, vals, steps_done=6, meta=None, final=True):
    """Write one process's result file: `run` with validation losses `vals`
    at steps 3, 6 (or fewer)."""
    val = [(3 * (i + 1), v) for i, v in enumerate(vals)]
    r = {"train_loss": [3.0 - 0.1 * i for i in range(steps_done)], "logged": [], "val": val, "seconds": 1.5,
         "steps_done": steps_done, "steps_per_s": steps_done / 1.5, "peak_mem_gib": float("nan"),
         "stopped_early": steps_done < 6, "note": ""}
    m = dict(META if meta is None else meta, runs=[run])
    conv.write_outputs({run: r}, _args(name), m, final=final)


def _load(d, name):
    with open(os.path.join(d, f"{name}.json")) as f:
        return json.load(f)


def test_merge_joins_runs_and_checks_bounds(results_dir):
    _part("p_hf", "hf_bf16", [3.0, 2.50])
    _part("p_bf16", "seqfuse_bf16", [3.0, 2.52])
    _part("p_fp8", "seqfuse_fp8_delayed", [3.0, 2.60])  # 0.08 from bf16, 0.10 from HF: over the bound
    conv.merge(_args("merged", merge="p_hf,p_bf16,p_fp8"))
    d = _load(results_dir, "merged")
    assert [r["run"] for r in d["rows"]] == ["hf_bf16", "seqfuse_bf16", "seqfuse_fp8_delayed"]
    assert d["merged_from"] == ["p_hf", "p_bf16", "p_fp8"]
    assert d["common_val_step"] == 6 and d["complete"]
    checks = {(c["a"], c["b"]): c for c in d["checks"]}
    assert checks[("seqfuse_bf16", "hf_bf16")]["diff"] == pytest.approx(0.02)
    assert checks[("seqfuse_bf16", "hf_bf16")]["pass"]
    assert not checks[("seqfuse_fp8_delayed", "hf_bf16")]["pass"]
    assert not checks[("seqfuse_fp8_delayed", "seqfuse_bf16")]["pass"]
    assert d["all_pass"] is False
    assert d["curves"]["seqfuse_bf16"]["val"] == [[3, 3.0], [6, 2.52]]


def test_merge_compares_at_the_last_common_step(results_dir):
    _part("p_hf", "hf_bf16", [3.0], steps_done=3)  # stopped early by its time budget
    _part("p_bf16", "seqfuse_bf16", [2.99, 2.5])
    conv.merge(_args("merged", merge="p_hf,p_bf16"))
    d = _load(results_dir, "merged")
    assert d["common_val_step"] == 3
    (c,) = d["checks"]
    assert c["step"] == 3 and c["diff"] == pytest.approx(-0.01) and c["pass"]


def test_merge_refuses_parts_of_other_settings(results_dir):
    _part("p_hf", "hf_bf16", [3.0, 2.5])
    _part("p_bf16", "seqfuse_bf16", [3.0, 2.5], meta=dict(META, tokens_per_step=2048))
    with pytest.raises(SystemExit, match="p_bf16 ran .*tokens_per_step.*2048.*not one comparison"):
        conv.merge(_args("merged", merge="p_hf,p_bf16"))


def test_merge_refuses_a_run_given_twice(results_dir):
    _part("p_a", "seqfuse_bf16", [3.0, 2.5])
    _part("p_b", "seqfuse_bf16", [3.0, 2.4])
    with pytest.raises(SystemExit, match="run seqfuse_bf16 is in two parts"):
        conv.merge(_args("merged", merge="p_a,p_b"))


def test_merge_refuses_an_unfinished_part(results_dir):
    _part("p_hf", "hf_bf16", [3.0, 2.5])
    _part("p_bf16", "seqfuse_bf16", [3.0], final=False)
    with pytest.raises(SystemExit, match="p_bf16 did not finish"):
        conv.merge(_args("merged", merge="p_hf,p_bf16"))
