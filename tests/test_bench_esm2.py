"""The one-GPU ESM-2 table's pieces on the CPU (benchmarks/esm2/bench_esm2.py,
common.py, benchmarks/peers/te_esm2.py): every real-length layout holds the
same samples and masks, length grouping really cuts padding, the row names
(each recipe accepted only by the impls that run it), the ratios against the
strongest peer and the goals (torchao's float8 HF rows, hfao, among the
peers), the sample check, a tiny end-to-end run whose JSON carries the run
metadata and a Transformer Engine row and a torchao row skipped with their
reasons, an hfao row on the CPU (torchao's emulated FP8, compiled per layer;
where torchao imports), and the BioNeMo-layout TE model built
on seqfuse's TE-named modules standing in for transformer_engine (same loss
as seqfuse's ESM-2 on the same packed and padded batches; a TE row names
the attention backend TE ran)."""
import argparse
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
for p in (os.path.join(BENCH, "esm2"), BENCH, os.path.join(ROOT, "recipes", "esm2")):
    if p not in sys.path:
        sys.path.insert(0, p)

import bench_esm2  # noqa: E402
import common  # noqa: E402
import fake_transformer_engine  # noqa: E402

TOKENS = 2048


@pytest.fixture(scope="module")
def seqs():
    return common.load_train_sequences(common.data_dir())


@pytest.fixture(scope="module")
def layouts(seqs):
    return common.real_length_layouts(seqs, 4, 2, tokens=TOKENS, max_length=256, seed=3)


def _samples(batches):
    """{sample index: (input_ids, labels)} over batches of any layout."""
    out = {}
    for b in batches:
        if "cu_seqlens" in b:
            for s in common.split_packed(b):
                out[s["index"]] = (s["input_ids"].tolist(), s["labels"].tolist())
        else:
            n = b["attention_mask"].sum(-1).tolist()
            for row, idx in enumerate(b["sample_indices"].tolist()):
                out[idx] = (b["input_ids"][row, : n[row]].tolist(), b["labels"][row, : n[row]].tolist())
    return out


def test_every_layout_trains_on_the_same_samples_and_masks(layouts):
    for part in (0, 1):  # warm-up samples, timed samples
        ref = _samples(layouts["packed"][part])
        assert ref
        for layout in ("padded", "unsorted"):
            got = _samples(layouts[layout][part])
            assert got == ref, f"{layout} part {part} holds other samples or masks than the packed batches"
    timed = {i for i in _samples(layouts["packed"][1])}
    warm = {i for i in _samples(layouts["packed"][0])}
    assert not timed & warm  # warm-up samples are not timed
    real = {k: sum(int(b["num_tokens"]) for b in v[1]) for k, v in layouts.items()}
    assert len(set(real.values())) == 1, real


def test_padded_batches_keep_the_token_budget_and_grouping_cuts_padding(layouts):
    def padding(batches):
        return 1 - sum(int(b["num_tokens"]) for b in batches) / sum(b["input_ids"].numel() for b in batches)

    for layout in ("padded", "unsorted"):
        for b in layouts[layout][1]:
            assert b["input_ids"].numel() <= TOKENS and b["input_ids"].shape[1] % 16 == 0
    grouped, unsorted = padding(layouts["padded"][1]), padding(layouts["unsorted"][1])
    assert grouped < 0.5 * unsorted, (grouped, unsorted)


def test_length_grouping_sorts_within_pools_only():
    def s(n, i):
        return {"input_ids": torch.full((n,), 5), "labels": torch.full((n,), -100), "index": i}

    lengths = [30, 3, 29, 4, 28, 5, 27, 6]
    samples = [s(n, i) for i, n in enumerate(lengths)]
    # one pool: every batch holds neighbours in length
    for b in common.padded_batches(samples, tokens=64, group_by_length=True, pad_to_multiple_of=1):
        lens = b["attention_mask"].sum(-1)
        assert int(lens.max()) - int(lens.min()) <= 3
    # no grouping: the samples' own order, cut by the budget
    b0 = common.padded_batches(samples, tokens=64, group_by_length=False, pad_to_multiple_of=1)[0]
    assert b0["sample_indices"].tolist() == [0, 1]
    # pools of two samples: a long and a short one stay together
    mixed = common.padded_batches(samples, tokens=64, group_by_length=True, pool=2, pad_to_multiple_of=1)
    assert sum(b["input_ids"].numel() for b in mixed) > sum(lengths) * 1.3
    with pytest.raises(ValueError, match="no samples"):
        common.padded_batches([], tokens=64, group_by_length=True)


def test_split_packed_drops_the_padding_segment(layouts):
    b = layouts["packed"][1][0]
    parts = common.split_packed(b)
    assert len(parts) == int(b["num_sequences"])
    assert sum(p["input_ids"].numel() for p in parts) == int(b["num_tokens"])
    assert torch.equal(torch.cat([p["input_ids"] for p in parts]), b["input_ids"][: int(b["num_tokens"])])


@pytest.mark.parametrize("name,parsed", [("hfcompile_bf16_padded", ("hfcompile", "bf16", "padded")),
                                         ("te_fp8_block_packed", ("te", "fp8_block", "packed")),
                                         ("hf_bf16_unsorted", ("hf", "bf16", "unsorted")),
                                         ("seqfuse_fp8_current_fixed", ("seqfuse", "fp8_current", "fixed")),
                                         ("seqfusegraph_fp8_delayed_fixed", ("seqfusegraph", "fp8_delayed", "fixed")),
                                         ("seqfusegraph_bf16_packed", ("seqfusegraph", "bf16", "packed")),
                                         ("hfao_fp8_tensorwise_padded", ("hfao", "fp8_tensorwise", "padded")),
                                         ("hfao_fp8_rowwise_fixed", ("hfao", "fp8_rowwise", "fixed"))])
def test_parse_row_accepts(name, parsed):
    assert bench_esm2.parse_row(name) == parsed


@pytest.mark.parametrize("name,match", [("hf_fp8_delayed_padded", "Hugging Face runs bf16"),
                                        ("hfcompile_bf16_packed", "takes no packed batches"),
                                        ("apex_bf16_packed", "expected"), ("te_bf16_sorted", "expected"),
                                        ("seqfusegraph_bf16_padded", "graphed layers take fixed or packed"),
                                        ("seqfuse_fp8_foo_packed", "unknown recipe 'fp8_foo'"),
                                        # torchao's recipes with hfao only, seqfuse's / TE's never with hfao
                                        ("hfao_bf16_padded", "hfao rows run torchao's float8"),
                                        ("hfao_fp8_delayed_fixed", "hfao rows run torchao's float8"),
                                        ("seqfuse_fp8_tensorwise_packed", "torchao's float8 recipe: hfao rows only"),
                                        ("te_fp8_rowwise_fixed", "torchao's float8 recipe: hfao rows only"),
                                        ("hfcompile_fp8_tensorwise_fixed", "hfao rows only"),
                                        ("hfao_fp8_tensorwise_packed", "takes no packed batches")])
def test_parse_row_rejects(name, match):
    with pytest.raises(ValueError, match=match):
        bench_esm2.parse_row(name)


def _row(name, tps, mem=10.0):
    impl, recipe, layout = bench_esm2.parse_row(name)
    return dict(row=name, impl=impl, recipe=recipe, layout=layout, unpadded_tokens_per_s=tps, peak_mem_gib=mem)


def test_ratios_name_the_strongest_peer():
    rows = bench_esm2.add_ratios([
        _row("hf_bf16_padded", 40.0), _row("hfcompile_bf16_padded", 30.0), _row("te_fp8_delayed_packed", 100.0),
        _row("te_bf16_packed", 80.0), _row("seqfuse_fp8_delayed_packed", 120.0, mem=5.0),
        _row("seqfuse_bf16_padded", 60.0), _row("hf_bf16_fixed", 50.0), _row("hfcompile_bf16_fixed", 70.0),
        _row("seqfuse_fp8_delayed_fixed", 119.0), {"row": "te_fp8_block_packed", "impl": "te", "recipe": "fp8_block",
                                                   "layout": "packed", "skipped": "no TE"}])
    by = {r["row"]: r for r in rows}
    s = by["seqfuse_fp8_delayed_packed"]
    assert s["vs_hf"] == pytest.approx(3.0) and s["mem_vs_hf"] == pytest.approx(0.5)
    assert s["vs_best_hf"] == pytest.approx(3.0) and s["best_hf"] == "hf_bf16_padded"
    assert s["vs_best_peer"] == pytest.approx(1.2) and s["best_peer"] == "te_fp8_delayed_packed"
    assert s["vs_te"] == pytest.approx(1.2) and s["te_peer"] == "te_fp8_delayed_packed"
    # no TE row of the same layout: the best TE row of the recipe in the length class
    assert by["seqfuse_bf16_padded"]["te_peer"] == "te_bf16_packed"
    # fixed length: compiled HF is the stronger HF row; the fixed class never borrows real-length peers
    f = by["seqfuse_fp8_delayed_fixed"]
    assert f["vs_hf"] == pytest.approx(119 / 50) and f["vs_best_hf"] == pytest.approx(1.7)
    assert f["best_peer"] == "hfcompile_bf16_fixed" and f["te_peer"] == ""
    assert "SLOWER than eager" in by["hfcompile_bf16_padded"]["note"]
    assert "note" not in by["hfcompile_bf16_fixed"]
    assert "vs_hf" not in by["te_fp8_block_packed"]
    goals = {g["goal"]: g for g in bench_esm2.check_goals(rows)}
    assert goals["packed FP8 delayed vs length-grouped HF, real lengths"]["pass"]
    g = goals[f"FP8 delayed vs best HF ({bench_esm2.FP8_HF}), all 1024"]
    assert g["key"] == "vs_best_hf" and g["value"] == pytest.approx(1.7) and g["pass"]
    assert goals["seqfuse_fp8_delayed_packed vs Transformer Engine (te_fp8_delayed_packed)"]["pass"]
    assert not goals["seqfuse_bf16_padded vs Transformer Engine (te_bf16_packed)"]["pass"]


def test_memory_ratio_is_net_of_what_earlier_rows_left():
    """mem_vs_hf compares peaks net of each row's start_gib (what earlier rows
    left allocated), as the Mixtral bench does; a row without a start figure
    counts its raw peak."""
    hf, sf = _row("hf_bf16_fixed", 50.0, mem=12.0), _row("seqfuse_bf16_fixed", 60.0, mem=13.0)
    hf["net_peak_mem_gib"], sf["net_peak_mem_gib"] = 12.0, 9.0  # seqfuse started with 4 GiB left over
    by = {r["row"]: r for r in bench_esm2.add_ratios([hf, sf])}
    assert by["seqfuse_bf16_fixed"]["mem_vs_hf"] == pytest.approx(0.75)
    raw = {r["row"]: r for r in bench_esm2.add_ratios([_row("hf_bf16_fixed", 50.0, mem=12.0),
                                                       _row("seqfuse_bf16_fixed", 60.0, mem=9.0)])}
    assert raw["seqfuse_bf16_fixed"]["mem_vs_hf"] == pytest.approx(0.75)
    f = bench_esm2.figures(dict(seconds=1.0, real=10, total=10, flops=1.0, peak=13.0, start_gib=4.0, losses=[1.0]))
    assert f["start_gib"] == 4.0 and f["net_peak_mem_gib"] == 9.0


def test_torchao_rows_are_peers_and_fp8_rows_name_the_strongest():
    """hfao (HF on torchao's float8, compiled) counts among the peers: an FP8
    row's best HF and best peer name it where it is the fastest, and its
    vs_ao names the fastest hfao row; a bf16 row's best HF stays bf16 HF."""
    rows = bench_esm2.add_ratios([
        _row("hf_bf16_fixed", 50.0), _row("hfcompile_bf16_fixed", 70.0), _row("hfao_fp8_tensorwise_fixed", 80.0),
        _row("hfao_fp8_rowwise_fixed", 60.0), _row("te_fp8_delayed_fixed", 75.0), _row("seqfuse_bf16_fixed", 90.0),
        _row("seqfuse_fp8_delayed_fixed", 120.0), _row("hf_bf16_padded", 40.0), _row("hfcompile_bf16_padded", 60.0),
        _row("hfao_fp8_tensorwise_padded", 55.0), _row("seqfuse_fp8_delayed_packed", 100.0),
        {"row": "hfao_fp8_rowwise_padded", "impl": "hfao", "recipe": "fp8_rowwise", "layout": "padded",
         "skipped": "torchao.float8 not importable here"}])
    by = {r["row"]: r for r in rows}
    f = by["seqfuse_fp8_delayed_fixed"]
    assert f["best_hf"] == f["best_peer"] == f["ao_peer"] == "hfao_fp8_tensorwise_fixed"
    assert f["vs_best_hf"] == f["vs_best_peer"] == f["vs_ao"] == pytest.approx(1.5)
    assert f["te_peer"] == "te_fp8_delayed_fixed" and f["vs_te"] == pytest.approx(1.6)
    b = by["seqfuse_bf16_fixed"]  # bf16 against bf16 HF; the best peer of any kind is still named
    assert b["best_hf"] == "hfcompile_bf16_fixed" and b["vs_best_hf"] == pytest.approx(90 / 70)
    assert b["best_peer"] == "hfao_fp8_tensorwise_fixed" and b["ao_peer"] == "" and b["vs_ao"] != b["vs_ao"]
    p = by["seqfuse_fp8_delayed_packed"]  # no packed hfao row: the fastest of its length class
    assert p["ao_peer"] == "hfao_fp8_tensorwise_padded" and p["vs_ao"] == pytest.approx(100 / 55)
    assert p["best_hf"] == p["best_peer"] == "hfcompile_bf16_padded"
    assert by["hfao_fp8_tensorwise_padded"]["vs_hfcompile"] == pytest.approx(55 / 60)
    assert "torchao float8 is SLOWER than compiled bf16 HF (0.92x)" in by["hfao_fp8_tensorwise_padded"]["note"]
    assert by["hfao_fp8_tensorwise_fixed"]["vs_hfcompile"] == pytest.approx(80 / 70)
    assert "note" not in by["hfao_fp8_tensorwise_fixed"] and "vs_ao" not in by["hfao_fp8_rowwise_padded"]
    goals = {g["goal"]: g for g in bench_esm2.check_goals(rows)}
    g = goals[f"FP8 delayed vs best HF ({bench_esm2.FP8_HF}), all 1024"]
    assert g["value"] == pytest.approx(1.5) and not g["pass"]
    assert goals["bf16 vs best HF (eager or compiled), all 1024"]["value"] == pytest.approx(90 / 70)
    assert goals["seqfuse_fp8_delayed_fixed vs torchao float8 (hfao_fp8_tensorwise_fixed)"]["pass"]
    assert goals["seqfuse_fp8_delayed_packed vs torchao float8 (hfao_fp8_tensorwise_padded)"]["pass"]
    assert not [k for k in goals if k.startswith("seqfuse_bf16_fixed vs torchao")]


def test_sample_check_flags_rows_on_other_samples():
    rows = [dict(_row("hf_bf16_padded", 1.0), real_tokens=100), dict(_row("seqfuse_bf16_packed", 1.0), real_tokens=100),
            dict(_row("hf_bf16_fixed", 1.0), real_tokens=64)]
    assert bench_esm2.sample_check(rows)["same_samples"]
    rows.append(dict(_row("te_bf16_packed", 1.0), real_tokens=99))
    assert not bench_esm2.sample_check(rows)["same_samples"]


def test_arguments_are_checked(capsys):
    with pytest.raises(SystemExit):
        bench_esm2.main(["--warm-passes", "-1", "--device", "cpu"])
    with pytest.raises(SystemExit):
        bench_esm2.main(["--torch-adamw", "--peer-adamw", "--device", "cpu"])
    assert "--torch-adamw and --peer-adamw are two choices" in capsys.readouterr().err
    with pytest.raises(ValueError, match="expected"):
        bench_esm2.main(["--size", "tiny", "--device", "cpu", "--rows", "hf_bf16_padded,bogus_bf16_packed"])


def test_tiny_run_writes_metadata_and_skips_te_with_its_reason(tmp_path):
    out = tmp_path / "esm2_tiny.json"
    rows = "hf_bf16_padded,hf_bf16_unsorted,te_bf16_packed"
    cmd = [sys.executable, os.path.join(BENCH, "esm2", "bench_esm2.py"), "--size", "tiny", "--device", "cpu",
           "--steps", "1", "--tokens", "1024", "--max-length", "128", "--out", str(out.with_suffix("")),
           "--rows", rows]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    by = {row["row"]: row for row in doc["rows"]}
    assert "needs a CUDA GPU" in by["te_bf16_packed"]["skipped"]
    assert by["hf_bf16_padded"]["unpadded_tokens_per_s"] > 0 and by["hf_bf16_padded"]["vs_hf"] == 1.0
    assert by["hf_bf16_padded"]["padding_pct"] <= by["hf_bf16_unsorted"]["padding_pct"]
    assert doc["sample_check"]["same_samples"] and doc["complete"] and doc["warm_passes"] == 1
    assert "untimed pass" in doc["timing"]
    run = doc["run"]
    assert run["command"].startswith("python3 ") and f"--rows {rows}" in run["command"]
    assert run["versions"]["torch"] != "not installed" and "transformers" in run["versions"]
    assert "torchao" in run["versions"]  # its version where installed, else "not installed"
    if os.path.isdir(os.path.join(ROOT, ".git")):
        head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        assert run["git_commit"] == head


def test_hfao_rows_are_skipped_with_the_reason_where_torchao_does_not_import(tmp_path, monkeypatch, capsys):
    """Where torchao.float8 does not import, the hfao rows are kept in the
    table as skipped, with the import's reason, and the others still run (the
    failed import is played by the bench's skip_reason: a stand-in package
    cannot do it, since transformers imports torchao itself where it is
    installed)."""
    why = "torchao.float8 not importable here: ImportError: withheld by the test"
    real = bench_esm2.skip_reason
    monkeypatch.setattr(bench_esm2, "skip_reason",
                        lambda name, need_cuda=True: why if name == bench_esm2.AO_NEEDS else real(name, need_cuda))
    out = tmp_path / "esm2_noao"
    bench_esm2.main(["--size", "tiny", "--device", "cpu", "--steps", "1", "--tokens", "1024", "--max-length", "128",
                     "--warm-passes", "0", "--out", str(out),
                     "--rows", "hf_bf16_fixed,hfao_fp8_tensorwise_fixed,hfao_fp8_rowwise_padded"])
    doc = json.loads(out.with_suffix(".json").read_text())
    by = {row["row"]: row for row in doc["rows"]}
    assert by["hfao_fp8_tensorwise_fixed"]["skipped"] == why == by["hfao_fp8_rowwise_padded"]["skipped"]
    assert by["hf_bf16_fixed"]["unpadded_tokens_per_s"] > 0 and doc["torchao"] == why and doc["complete"]
    assert "hfao_fp8_tensorwise_fixed: SKIPPED: torchao.float8 not importable" in capsys.readouterr().out


def test_te_layout_model_matches_seqfuse_esm2(monkeypatch, layouts):
    """BioNeMo's layout (te_esm2) on stand-in modules gives seqfuse's loss on
    the same packed (thd) and padded (bshd) batches: the weight mapping, the
    token-dropout rescaling, the masks and the tied, padded LM head agree."""
    fake_transformer_engine.install(monkeypatch)
    from peers import te_esm2
    from seqfuse.hf import SeqfuseEsmConfig
    from seqfuse.hf.esm import SeqfuseEsmForMaskedLM

    torch.manual_seed(0)
    cfg = SeqfuseEsmConfig(**common.TINY, mlp_activation="gelu", hidden_dropout_prob=0.0,
                           attention_probs_dropout_prob=0.0)
    sf = SeqfuseEsmForMaskedLM(cfg).eval()
    cpu = torch.device("cpu")
    for layout, batch in (("thd", layouts["packed"][1][0]), ("bshd", layouts["padded"][1][0])):
        te_model = te_esm2.from_seqfuse(sf, layout, dtype=torch.float32, device="cpu").eval()
        assert te_model.decoder.weight is te_model.word_embeddings.weight
        assert float(te_model.word_embeddings.weight[cfg.vocab_size:].detach().abs().sum()) == 0.0
        with torch.no_grad():
            ref = common.forward_loss(sf, batch, cpu)
            got = common.forward_loss(te_model, batch, cpu)
        assert float(got) == pytest.approx(float(ref), rel=1e-5), layout
    with pytest.raises(ValueError, match="layout"):
        te_esm2.TeEsmForMaskedLM(cfg, "sbhd", dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="packed input needs cu_seqlens"):
        common.forward_loss(te_esm2.from_seqfuse(sf, "bshd", dtype=torch.float32, device="cpu"),
                            layouts["packed"][1][0], cpu)
    assert te_esm2.te_recipe("bf16") is None
    assert type(te_esm2.te_recipe("fp8_block")).__name__ == "Float8BlockScaling"
    # the bench's te rows: the packed layout gets thd, the others bshd, with torch's fused AdamW
    args = argparse.Namespace(size="tiny")
    for layout, fmt in (("packed", "thd"), ("fixed", "bshd")):
        model, opt, notes = bench_esm2.build_model("te", args, cpu, torch.float32, layout)
        assert model.layout == fmt and fmt in notes["layout"] and isinstance(opt, torch.optim.AdamW)


def test_compile_hf_wraps_every_layer_or_the_model():
    args = argparse.Namespace(size="tiny", compile_scope="layers", compile_dynamic="auto")
    model, _, notes = bench_esm2.build_model("hfcompile", args, torch.device("cpu"), torch.float32, "padded")
    assert notes["compile"] == "torch.compile scope=layers dynamic=True"
    assert all(layer._compiled_call_impl is not None for layer in model.esm.encoder.layer)
    args.compile_scope, args.compile_dynamic = "model", "auto"
    model, _, notes = bench_esm2.build_model("hfcompile", args, torch.device("cpu"), torch.float32, "fixed")
    assert notes["compile"].endswith("dynamic=False") and model._compiled_call_impl is not None
    with pytest.raises(ValueError, match="compile-scope"):
        bench_esm2.compile_hf(model, "everything", True)
    with pytest.raises(ValueError, match="seqfuse rows"):
        bench_esm2.build_model("seqfuse", args, torch.device("cpu"), torch.float32, "packed")


def test_te_row_names_the_attention_te_ran(monkeypatch, layouts):
    """A TE row's notes carry te_attention, read from TE's own record of its
    last attention selection after the timed pass (here TE is played by
    seqfuse's modules and the record is faked: fused, then unfused)."""
    import types

    fake_transformer_engine.install(monkeypatch)
    record = {"use_flash_attention": False, "use_fused_attention": True, "use_unfused_attention": False,
              "fused_attention_backend": "NVTE_Fused_Attn_Backend.NVTE_F16_arbitrary_seqlen"}
    inner = types.ModuleType("transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention")
    inner._attention_backends = record
    pkg = types.ModuleType("transformer_engine.pytorch.attention.dot_product_attention")
    pkg.__path__, pkg.dot_product_attention = [], inner
    monkeypatch.setitem(sys.modules, pkg.__name__, pkg)
    monkeypatch.setitem(sys.modules, inner.__name__, inner)
    args = argparse.Namespace(size="tiny", torch_adamw=False, profile_steps=1)
    timed = layouts["packed"][1][:1]
    r = bench_esm2.run_row("te", "bf16", [], timed, args, torch.device("cpu"), layout="packed")
    assert r["notes"]["te_attention"] == "FusedAttention (NVTE_Fused_Attn_Backend.NVTE_F16_arbitrary_seqlen)"
    assert "thd" in r["notes"]["layout"] and r["real"] == int(timed[0]["num_tokens"])
    record.update(use_fused_attention=False, use_unfused_attention=True)
    r = bench_esm2.run_row("te", "bf16", [], timed, args, torch.device("cpu"), layout="packed")
    assert r["notes"]["te_attention"] == "UnfusedDotProductAttention"
    assert "te_attention" in bench_esm2._note(r["notes"])


def test_hfao_row_runs_torchao_float8_compiled_on_the_cpu(layouts):
    """One hfao row at the tiny size where torchao imports (its emulated FP8 on
    the CPU): the linears with dims of 16 become Float8Linear, the LM decoder
    (33 tokens wide) and the contact head stay nn.Linear and the notes name
    them, the model is compiled per layer as hfcompile's, and its first loss
    is HF's bf16 loss on the same batch and weights within FP8's rounding."""
    from peers.meta import skip_reason

    why = skip_reason(bench_esm2.AO_NEEDS, need_cuda=False)
    if why:
        pytest.skip(why)  # the skipped-row path: test_tiny_run_writes_metadata_and_skips_te_and_torchao_...
    cpu = torch.device("cpu")
    args = argparse.Namespace(size="tiny", torch_adamw=False, profile_steps=1, compile_scope="layers",
                              compile_dynamic="auto")
    model, opt, notes = bench_esm2.build_model("hfao", args, cpu, torch.float32, "padded", recipe="fp8_rowwise")
    linears = {n: type(m).__name__ for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert linears.pop("lm_head.decoder") == "Linear" and linears.pop("esm.contact_head.regression") == "Linear"
    assert set(linears.values()) == {"Float8Linear"} and len(linears) == 13  # 2 layers x 6, lm_head.dense
    assert "from_recipe_name('rowwise')" in notes["torchao"] and "emulate=True" in notes["torchao"]
    assert notes["bf16_linears"].startswith("esm.contact_head.regression [8->1], lm_head.decoder [64->33] (")
    assert notes["compile"] == "torch.compile scope=layers dynamic=True"
    assert all(layer._compiled_call_impl is not None for layer in model.esm.encoder.layer)
    assert isinstance(opt, torch.optim.AdamW)
    del model, opt
    timed = layouts["padded"][1][:1]
    with torch.no_grad():
        ref = float(common.forward_loss(common.build_hf("tiny", cpu, torch.float32).eval(), timed[0], cpu))
    r = bench_esm2.run_row("hfao", "fp8_tensorwise", [], timed, args, cpu, layout="padded")
    assert "from_recipe_name('tensorwise')" in r["notes"]["torchao"] and r["notes"]["dynamo_graphs_so_far"] >= 1
    assert r["real"] == int(timed[0]["num_tokens"]) and r["seconds"] > 0
    assert r["losses"][0] == pytest.approx(ref, rel=0.02)


def test_packed_graph_bounds_cover_every_batch(layouts):
    """graph_packed_layers' bounds from the bench's packed batches: the token
    budget, max_length, and enough sequences (a multiple of 8) for every
    batch once padded to the budget."""
    from seqfuse.hf.layer_graphs import PackedLayout

    batches = layouts["packed"][0] + layouts["packed"][1]
    tokens, seqs, longest = bench_esm2.packed_graph_bounds(batches, TOKENS, 256)
    assert (tokens, longest) == (TOKENS, 256) and seqs % 8 == 0
    layout = PackedLayout("t", tokens, seqs, longest)
    for b in batches:
        assert layout.misfit(b["input_ids"].numel(), b["cu_seqlens"].numel() - 1, int(b["max_seqlen"])) is None
    assert layout.misfit(TOKENS, seqs + 1, 256)[0] == "sequences"
