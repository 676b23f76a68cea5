"""bench_mixtral_train's ratios: against the transformers rows of the whole
run, whatever order the rows ran in, memory net of what earlier rows left."""
import os
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("pyarrow")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "moe"))

import bench_mixtral_train as B  # noqa: E402


def row(name, tps, peak, start, loss=2.0):
    return dict(row=name, unpadded_tokens_per_s=tps, peak_gib=peak, start_gib=start, first_loss=loss)


def test_ratios_cover_rows_timed_before_the_peers():
    done = {n: r for n, r in (("seqfuse_fp8", row("seqfuse_fp8", 250.0, 12.0, 0.0)),
                              ("hf_bf16_compile", row("hf_bf16_compile", 200.0, 13.0, 0.5)),
                              ("hf_bf16", row("hf_bf16", 100.0, 16.0, 1.0, loss=2.2)))}
    B.add_ratios(done)
    s = done["seqfuse_fp8"]
    assert s["vs_hf"] == 2.5 and s["vs_best_hf"] == 1.25 and s["best_hf_row"] == "hf_bf16_compile"
    assert s["mem_vs_best_hf"] == pytest.approx(12.0 / 12.5) and s["mem_vs_hf"] == pytest.approx(12.0 / 15.0)
    assert s["first_loss_rel_diff_vs_hf"] == pytest.approx(0.2 / 2.2)
    assert "vs_best_hf" not in done["hf_bf16_compile"]  # the best peer is not compared with itself
    assert done["hf_bf16"]["vs_best_hf"] == 0.5


def test_reserved_ratio_is_net_of_what_was_reserved_before_and_needs_both_rows():
    done = {"hf_bf16_compile": {**row("hf_bf16_compile", 200.0, 13.0, 0.5),
                                "steady_reserved_gib": 14.0, "start_reserved_gib": 2.0},
            "seqfusegraph_fp8": {**row("seqfusegraph_fp8", 250.0, 11.0, 0.0),
                                 "steady_reserved_gib": 15.0, "start_reserved_gib": 0.0},
            "seqfuse_fp8": row("seqfuse_fp8", 240.0, 11.0, 0.0)}
    B.add_ratios(done)
    # the graphed row's allocated peak is lower, its reserved memory (the graphs' pool) is not
    assert done["seqfusegraph_fp8"]["mem_vs_best_hf"] == pytest.approx(11.0 / 12.5)
    assert done["seqfusegraph_fp8"]["reserved_vs_best_hf"] == pytest.approx(15.0 / 12.0)
    assert "reserved_vs_best_hf" not in done["seqfuse_fp8"]  # a row without the figure gets no ratio
    done = {"hf_bf16_compile": row("hf_bf16_compile", 200.0, 13.0, 0.5),
            "seqfusegraph_fp8": {**row("seqfusegraph_fp8", 250.0, 11.0, 0.0),
                                 "steady_reserved_gib": 15.0, "start_reserved_gib": 0.0}}
    B.add_ratios(done)
    assert "reserved_vs_best_hf" not in done["seqfusegraph_fp8"]  # nor against a peer without it


def test_eager_steps_before_capture_leave_an_untimed_step_after_the_capture(capsys):
    assert B.eager_steps_before_capture("hf_bf16", 2, 16, graphed=False) == 0  # (not graphed: no capture)
    assert B.eager_steps_before_capture("g", 0, 16, graphed=True) == 0
    assert B.eager_steps_before_capture("g", 2, 16, graphed=True) == 2
    assert "leaves no untimed step" not in capsys.readouterr().out
    assert B.eager_steps_before_capture("g", 5, 3, graphed=True) == 2  # cut to all untimed steps but one, said
    assert "--eager-before-graphs 5 leaves no untimed step to capture after: 2 eager steps" in capsys.readouterr().out
