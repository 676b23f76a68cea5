"""The peer benchmarks (benchmarks/peers) on the CPU: the run metadata every
result records (commit from git or from SEQFUSE_GIT_COMMIT, versions, the
exact command), why a peer is skipped, the alternating queued timing and its
failure reporting, and tiny runs of bench_te_modules / bench_liger /
bench_torchao: each writes its JSON with the skipped peers' reasons, and
each torch-side or TE-side twin computes what seqfuse computes (the
comparisons compare one computation; Transformer Engine played by seqfuse's
TE-named modules, tests/fake_transformer_engine.py); which attention backend
a TE row names (te_esm2.te_attention_backend, from TE's own record) and the
attention probe that reads it (te_probe.py); the one-line-per-row summary
of the result JSONs (summary.py)."""
import argparse
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
from peers import bench_liger, bench_te_modules, bench_torchao, meta, summary, te_esm2, te_probe, timing  # noqa: E402

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


def test_version_of_a_package_imported_without_a_distribution(monkeypatch):
    """A package this process imported from a path (the GPU machine's seqfuse, imported from python/ with an
    extension built elsewhere) is recorded with its __version__ and where it came from, not "not installed";
    a package neither installed nor imported stays "not installed"."""
    import types

    fake = types.ModuleType("sf_fake_pkg_s52")
    fake.__version__ = "9.9.9"
    fake.__file__ = "/somewhere/sf_fake_pkg_s52/__init__.py"
    monkeypatch.setitem(sys.modules, "sf_fake_pkg_s52", fake)
    assert meta._dist_version("sf_fake_pkg_s52") == "9.9.9 (imported from /somewhere/sf_fake_pkg_s52, no distribution)"
    assert meta._dist_version("sf_absent_pkg_s52") == "not installed"


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
    args = argparse.Namespace(iters=1, rounds=1, warmup=0)
    res = timing.Results(str(tmp_path / "cell.json"), bench_te_modules.__file__)
    bench_te_modules.run_cell("tiny", bench_te_modules.SHAPES["tiny"], module, "bf16", args, CPU, res, None)
    row = res.rows[0]
    assert "te_error" not in row and "check_error" not in row, row
    assert row["rel_diff_bf16"] < 1e-6 and row["seqfuse_vs_te"] > 0
    # a layer row names the attention TE ran (the stand-in keeps no TE record: "unknown" with the reason)
    assert ("te_attention" in row) == (module == "TransformerLayer")
    if module == "TransformerLayer":
        assert row["te_attention"].startswith("unknown (")


def _cpu_smoke(bench, tmp_path, *options):
    """The JSON document of one quick CPU run of a peer benchmark's main()
    (one iteration, one round, no warm-up) with ``options``."""
    out = tmp_path / "smoke.json"
    bench.main(["--device", "cpu", *options, "--iters", "1", "--rounds", "1", "--warmup", "0", "--out", str(out)])
    return json.loads(out.read_text())


def test_te_modules_cpu_smoke_skips_te_with_its_reason(tmp_path):
    doc = _cpu_smoke(bench_te_modules, tmp_path, "--shapes", "tiny", "--modules", "Linear", "--recipes",
                     "bf16,fp8_delayed")
    assert doc["complete"] and "CUDA only" in doc["te_skipped"]
    assert [r["recipe"] for r in doc["rows"]] == ["bf16", "fp8_delayed"]
    assert all(r["seqfuse_ms"] > 0 and "CUDA only" in r["te_skipped"] for r in doc["rows"])
    with pytest.raises(SystemExit):
        bench_te_modules.main(["--device", "cpu", "--modules", "Conv2d"])


def test_liger_cpu_smoke_every_twin_matches_torch(tmp_path):
    doc = _cpu_smoke(bench_liger, tmp_path, "--size", "tiny", "--no-compile")
    assert [r["op"] for r in doc["rows"]] == list(bench_liger.OPS)
    for r in doc["rows"]:
        assert "CUDA only" in r["liger_skipped"], r
        assert r["seqfuse_rel_diff"] < 1e-5, r  # seqfuse's kernel and the torch code compute the same thing
        assert r["seqfuse_ms"] > 0 and r["best_peer"] == "torch"
    with pytest.raises(SystemExit):
        bench_liger.main(["--device", "cpu", "--ops", "softmax"])


def test_torchao_cpu_smoke(tmp_path):
    doc = _cpu_smoke(bench_torchao, tmp_path, "--shapes", "tiny", "--no-compile")
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


def _fake_backend_record(monkeypatch, **selection):
    """TE's record of its last attention selection (dot_product_attention._attention_backends), faked."""
    import types

    record = {"attention_params": None, "use_flash_attention": False, "flash_attention_backend": None,
              "use_fused_attention": False, "fused_attention_backend": None, "use_unfused_attention": False,
              "backend_selection_requires_update": False, **selection}
    inner = types.ModuleType("transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention")
    inner._attention_backends = record
    pkg = types.ModuleType("transformer_engine.pytorch.attention.dot_product_attention")
    pkg.__path__ = []
    pkg.dot_product_attention = inner
    monkeypatch.setitem(sys.modules, pkg.__name__, pkg)
    monkeypatch.setitem(sys.modules, inner.__name__, inner)
    return record


def test_te_attention_backend_names_what_te_chose(monkeypatch):
    fake_transformer_engine.install(monkeypatch)
    assert te_esm2.te_attention_backend().startswith("unknown (TE's backend record not importable")
    record = _fake_backend_record(monkeypatch)
    assert te_esm2.te_attention_backend() == "unknown (no attention selection recorded yet)"
    record.update(use_unfused_attention=True)
    assert te_esm2.te_attention_backend() == "UnfusedDotProductAttention"
    record.update(use_fused_attention=True, fused_attention_backend="NVTE_F16_arbitrary_seqlen")
    assert te_esm2.te_attention_backend() == "FusedAttention (NVTE_F16_arbitrary_seqlen)"
    record.update(use_flash_attention=True, flash_attention_backend="2.8.3")
    assert te_esm2.te_attention_backend() == "FlashAttention (2.8.3)"


@pytest.mark.parametrize("fused", [True, False])
def test_te_probe_runs_every_case_and_says_whether_all_were_fused(fused, monkeypatch, tmp_path, capsys):
    """The probe runs TE's DotProductAttention (seqfuse's standing in) on the
    bshd, thd and causal GQA cases and prints one TE_PROBE line per case and
    the verdict gpu_peers.sh greps for."""
    fake_transformer_engine.install(monkeypatch)
    monkeypatch.setattr(meta, "_IMPORTS", {})  # the stand-in's import must not stay cached for later tests
    _fake_backend_record(monkeypatch, use_fused_attention=fused, use_unfused_attention=not fused,
                         fused_attention_backend="NVTE_F16_arbitrary_seqlen" if fused else None)
    out = tmp_path / "probe.json"
    te_probe.main(["--device", "cpu", "--out", str(out)])
    printed = capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert [r["case"] for r in doc["rows"]] == list(te_probe.CASES) and doc["complete"]
    want = "FusedAttention (NVTE_F16_arbitrary_seqlen)" if fused else "UnfusedDotProductAttention"
    assert all(r["backend"] == want for r in doc["rows"]), doc["rows"]
    assert f"TE_PROBE fused_all={'yes' if fused else 'no'}" in printed and doc["fused_all"] is fused
    assert f"TE_PROBE esm2_thd backend={want}" in printed
    assert "git_commit" in doc["run"] and "mapped_libcudnn" in doc
    with pytest.raises(SystemExit):
        te_probe.main(["--device", "cpu", "--cases", "esm2_sbhd"])


def test_te_probe_without_te_says_why(tmp_path, capsys):
    """Where transformer_engine does not import, the verdict is 'no' with the reason (no case runs)."""
    if meta.try_import("transformer_engine.pytorch")[0] is not None:
        pytest.skip("transformer_engine imports here")
    out = tmp_path / "probe.json"
    te_probe.main(["--device", "cpu", "--out", str(out)])
    assert "TE_PROBE fused_all=no (Transformer Engine not usable here" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["rows"] == [] and "not importable" in doc["te_skipped"]


def test_te_probe_thd_lengths_vary_within_the_sequence_length():
    lengths = te_probe.thd_lengths(8, 1024)
    assert len(lengths) == 8 and len(set(lengths)) == 8 and max(lengths) <= 1024 and min(lengths) >= 256
    assert all(n % 8 == 0 for n in lengths)


def test_summary_prints_one_line_per_row_with_the_comparison(tmp_path):
    esm = {"name": "esm2_peers", "complete": True, "run": {"git_commit": "abcdef1234567890"},
           "rows": [{"row": "te_bf16_packed", "unpadded_tokens_per_s": 80000.0, "vs_best_peer": 0.9,
                     "best_peer": "hfcompile_bf16_padded", "vs_te": 1.0, "vs_hf": 2.0, "warm_s": 3.0,
                     "notes": {"te_attention": "FusedAttention (x)"}},
                    {"row": "te_fp8_delayed_packed", "error": "OutOfMemoryError: no room"},
                    {"row": "seqfuse_fp8_delayed_fixed", "unpadded_tokens_per_s": 120000.0, "vs_best_peer": 1.2,
                     "best_peer": "hfcompile_bf16_fixed", "vs_ao": 1.5, "ao_peer": "hfao_fp8_tensorwise_fixed",
                     "vs_te": 1.3, "vs_hf": 2.0, "warm_s": 1.0}],
           "goals": [{"goal": "g1", "value": 0.5, "need": ">= 1.0", "pass": False},
                     {"goal": "g2", "value": 2.0, "need": ">= 1.0", "pass": True}]}
    te = {"name": "te_modules", "complete": False, "run": {"git_commit": "1234"},
          "rows": [{"shape": "llama_1b", "module": "TransformerLayer", "recipe": "bf16", "seqfuse_ms": 7.0,
                    "te_ms": 8.0, "seqfuse_vs_te": 8 / 7, "rel_diff_bf16": 0.004, "te_attention": "FusedAttention (x)"}]}
    (tmp_path / "esm2_peers.json").write_text(json.dumps(esm))
    (tmp_path / "te_modules.json").write_text(json.dumps(te))
    lines = []
    summary.summarize(str(tmp_path / "esm2_peers.json"), out=lines.append)
    summary.summarize(str(tmp_path / "te_modules.json"), out=lines.append)
    summary.summarize(str(tmp_path / "torchao.json"), out=lines.append)
    text = "\n".join(lines)
    assert "== " in lines[0] and "commit abcdef123456, complete, 3 rows" in lines[0]
    assert ("seqfuse_fp8_delayed_fixed: 120.0k tok/s, vs_best_peer 1.2 (hfcompile_bf16_fixed), "
            "vs_ao 1.5 (hfao_fp8_tensorwise_fixed), vs_te 1.3") in text
    assert "vs_ao" not in text.split("te_bf16_packed:")[1].splitlines()[0]
    assert "te_bf16_packed: 80.0k tok/s, vs_best_peer 0.9 (hfcompile_bf16_padded)" in text
    assert "attn FusedAttention (x)" in text and "te_fp8_delayed_packed: error: OutOfMemoryError" in text
    assert "goals: 1 of 2 pass; failed:" in text and "g1: 0.5 (need >= 1.0)" in text and "g2" not in text
    assert "INCOMPLETE" in text and "seqfuse 7 / TE 8 ms, seqfuse_vs_te 1.14" in text
    assert "TE attn FusedAttention (x)" in text
    assert "torchao.json: no result file" in text or "== " + str(tmp_path / "torchao.json") + ": no result" in text
    assert all(len(line) <= summary.WIDTH + 4 for line in lines)
