"""The peer benchmarks (benchmarks/peers) on the CPU: the run metadata every
result records (commit from git or from SEQFUSE_GIT_COMMIT, versions, the
exact command), why a peer is skipped, the alternating queued timing and its
failure reporting, and tiny runs of bench_te_modules / bench_liger /
bench_torchao: each writes its JSON with the skipped peers' reasons, and
each torch-side or TE-side twin computes what seqfuse computes (the
comparisons compare one computation; Transformer Engine played by seqfuse's
TE-named modules, tests/fake_transformer_engine.py)."""
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)

import fake_transformer_engine  # noqa: E402
from peers import bench_liger, bench_te_modules, bench_torchao, meta, timing  # noqa: E402

CPU = torch.device("cpu")


def test_run_metadata_names_commit_versions_and_command():
    m = meta.run_metadata(os.path.join(BENCH, "peers", "bench_liger.py"), ["bench_liger.py", "--ops", "rope x"])
    assert m["command"] == "python3 bench_liger.py --ops 'rope x'"
    assert m["script"] == "benchmarks/peers/bench_liger.py" and len(m["script_sha256"]) == 64
    assert m["versions"]["torch"] != "not installed"
    assert set(meta.DISTRIBUTIONS) <= set(m["versions"])
    if os.path.isdir(os.path.join(ROOT, ".git")) and not os.environ.get("SEQFUSE_GIT_COMMIT"):
        head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        assert m["git_commit"] == head and m["git_commit_source"] == "git"


def test_commit_without_git_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("SEQFUSE_GIT_COMMIT", "abc123")
    sha, dirty, source = meta.git_commit(str(tmp_path))
    assert (sha, dirty) == ("abc123", None) and "SEQFUSE_GIT_COMMIT" in source
    monkeypatch.delenv("SEQFUSE_GIT_COMMIT")
    assert meta.git_commit(str(tmp_path))[0].startswith("unknown")


def test_commit_from_the_environment_wins_over_a_git_directory(monkeypatch):
    """The GPU machine's copy of .git can lag the tree sent with it: the
    caller's SEQFUSE_GIT_COMMIT is recorded instead of what that .git says."""
    if not os.path.isdir(os.path.join(ROOT, ".git")):
        pytest.skip("needs the checkout's .git")
    monkeypatch.setenv("SEQFUSE_GIT_COMMIT", "abc123")
    sha, _, source = meta.git_commit(ROOT)
    assert sha == "abc123" and "the checkout's .git says" in source  # both views recorded


def test_skip_reasons():
    mod, why = meta.try_import("no_such_peer_library_xyz")
    assert mod is None and "no_such_peer_library_xyz not importable here: ModuleNotFoundError" in why
    assert meta.try_import("json") == (json, None)
    if not torch.cuda.is_available():
        assert "needs a CUDA GPU" in meta.skip_reason("json")
    assert meta.skip_reason("json", need_cuda=False) is None


def test_interleaved_timing_reports_a_failing_peer_and_times_the_rest():
    calls = []

    def bad():
        raise RuntimeError("peer broke")

    out = timing.interleaved_ms({"ok": lambda: calls.append(1), "bad": bad}, CPU, iters=4, rounds=2, warmup=1)
    assert isinstance(out["bad"], RuntimeError) and isinstance(out["ok"], float) and out["ok"] >= 0
    assert len(calls) == 1 + 4 * 2
    assert timing.error_text(out["bad"]) == "RuntimeError: peer broke"
    assert timing.rel_diff(torch.ones(4), torch.ones(4)) == 0.0


def test_results_are_saved_after_every_row(tmp_path):
    r = timing.Results(str(tmp_path / "x.json"), bench_liger.__file__, extra={"k": 1})
    r.add(a=1.0)
    doc = json.loads((tmp_path / "x.json").read_text())
    assert doc["complete"] is False and doc["rows"] == [{"a": 1.0}] and doc["k"] == 1 and "git_commit" in doc["run"]
    r.save(goals=[])
    assert json.loads((tmp_path / "x.json").read_text())["complete"] is True


def test_results_guard_keeps_going_and_finish_writes_goals(tmp_path):
    r = timing.Results(str(tmp_path / "g.json"), bench_liger.__file__)

    def case(name, ratio):
        if ratio is None:
            raise ValueError(f"{name} broke")
        r.add(name=name, ratio=ratio)

    for name, ratio in (("a", 1.2), ("b", None), ("c", 0.9)):
        r.guard(case, name, ratio, name=name)
    assert [row.get("error") for row in r.rows] == [None, "ValueError: b broke", None]
    r.finish("ratio", lambda row: f"{row['name']} >= 1")
    doc = json.loads((tmp_path / "g.json").read_text())
    assert [(g["goal"], g["pass"]) for g in doc["goals"]] == [("a >= 1", True), ("c >= 1", False)]


def test_te_modules_flops_and_weight_copy():
    c = bench_te_modules.SHAPES["llama_1b"]
    t = c["batch"] * c["seq"]
    assert bench_te_modules.qkv_out(c) == (32 + 16) * 64
    assert bench_te_modules.flops("Linear", c) == 3 * 2 * t * 2048 * 3072
    assert bench_te_modules.flops("LayerNormMLP", c) == 3 * 2 * t * (2048 * 16384 + 8192 * 2048)
    with pytest.raises(KeyError, match="parameter names differ"):
        bench_te_modules.copy_weights(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4, bias=False))


@pytest.mark.parametrize("module", ["LayerNormLinear", "TransformerLayer"])
def test_te_modules_cell_compares_one_computation(module, monkeypatch, tmp_path):
    """With seqfuse's modules playing Transformer Engine, the TE side of a
    cell gets seqfuse's weights and computes seqfuse's output."""
    fake_transformer_engine.install(monkeypatch)
    args = bench_te_modules.main.__globals__["argparse"].Namespace(iters=1, rounds=1, warmup=0)
    res = timing.Results(str(tmp_path / "cell.json"), bench_te_modules.__file__)
    bench_te_modules.run_cell("tiny", bench_te_modules.SHAPES["tiny"], module, "bf16", args, CPU, res, None)
    row = res.rows[0]
    assert "te_error" not in row and "check_error" not in row, row
    assert row["rel_diff_bf16"] < 1e-6 and row["seqfuse_vs_te"] > 0


def test_te_modules_cpu_smoke_skips_te_with_its_reason(tmp_path):
    out = tmp_path / "te_modules.json"
    bench_te_modules.main(["--device", "cpu", "--shapes", "tiny", "--modules", "Linear", "--recipes",
                           "bf16,fp8_delayed", "--iters", "1", "--rounds", "1", "--warmup", "0", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["complete"] and "CUDA only" in doc["te_skipped"]
    assert [r["recipe"] for r in doc["rows"]] == ["bf16", "fp8_delayed"]
    assert all(r["seqfuse_ms"] > 0 and "CUDA only" in r["te_skipped"] for r in doc["rows"])
    with pytest.raises(SystemExit):
        bench_te_modules.main(["--device", "cpu", "--modules", "Conv2d"])


def test_liger_cpu_smoke_every_twin_matches_torch(tmp_path):
    out = tmp_path / "liger.json"
    bench_liger.main(["--device", "cpu", "--size", "tiny", "--no-compile", "--iters", "1", "--rounds", "1",
                      "--warmup", "0", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert [r["op"] for r in doc["rows"]] == list(bench_liger.OPS)
    for r in doc["rows"]:
        assert "CUDA only" in r["liger_skipped"], r
        assert r["seqfuse_rel_diff"] < 1e-5, r  # seqfuse's kernel and the torch code compute the same thing
        assert r["seqfuse_ms"] > 0 and r["best_peer"] == "torch"
    with pytest.raises(SystemExit):
        bench_liger.main(["--device", "cpu", "--ops", "softmax"])


def test_torchao_cpu_smoke(tmp_path):
    out = tmp_path / "torchao.json"
    bench_torchao.main(["--device", "cpu", "--shapes", "tiny", "--no-compile", "--iters", "1", "--rounds", "1",
                        "--warmup", "0", "--out", str(out)])
    doc = json.loads(out.read_text())
    impls = {(r["module"], r["impl"]): r for r in doc["rows"]}
    for module in bench_torchao.MODULES:
        assert impls[(module, "torch_bf16")]["rel_diff_vs_seqfuse_bf16"] < 1e-5  # the torch twin holds seqfuse's weights
        for r in bench_torchao.SEQFUSE_RECIPES:
            assert impls[(module, f"seqfuse_{r}")]["ms"] > 0
    if doc["torchao_skipped"]:
        assert "torchao" in doc["torchao_skipped"] and not any(k[1].startswith("torchao") for k in impls)
    else:  # torchao importable here: its emulated FP8 rows ran, and the seqfuse FP8 rows carry the ratio
        assert doc["torchao_emulated"] and impls[("Linear", "torchao_tensorwise")]["ms"] > 0
        assert "vs_best_torchao" in impls[("Linear", "seqfuse_fp8_current")]
