"""benchmarks/llama3 on the CPU: the pieces of the Llama 3 benchmark that do
not need a GPU, and a tiny end-to-end run.

- the genome windows: fixed-length pieces are exact, and the committed
  subset's fallback joins each strand's windows in genome order (the pieces
  are real contiguous genome, checked against the window coordinates);
  make_bench_data's selection is round-robin over genomes, exact-length only;
- batches: every sequence exactly seq_len tokens framed <bos> ... <eos>, and
  the padded [B, L] batch holds the packed batch's tokens (padded == packed);
- the FLOP count against the GEMM weights of a built model (an independent
  count) plus the causal attention term;
- ratios, goals and the first-step loss check (which fails on a wrong loss);
  the Liger-patched transformers row counts among the peers, and its
  patches of transformers' Llama module last only as long as its row;
- ``--size tiny --device cpu``: training rows (transformers, seqfuse bf16
  padded/packed, FP8 delayed) start from the same weights (first losses equal
  in float32), the compiled rows are skipped with their reason, the decode
  rows give transformers' greedy tokens, and the JSON carries the run
  metadata.
"""
import json
import os
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("pyarrow")

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.join(os.path.dirname(HERE), "benchmarks", "llama3")
sys.path.insert(0, BENCH)

import bench_llama3 as B  # noqa: E402
import llama3_common as C  # noqa: E402
import make_bench_data  # noqa: E402
from helpers import needs_fp8  # noqa: E402


def test_fixed_length_pieces_and_subset_fallback():
    rows = C.load_windows(C.SUBSET_DATA)
    assert {len(r["sequence"]) for r in rows} == {1024}
    pieces = C.fixed_length_sequences(rows, 254)
    assert pieces and {len(p) for p in pieces} == {254}
    assert len(pieces) == len(rows) * (1024 // 254)
    # none long enough: windows joined per (genome, strand) in coordinate order, then cut
    long = C.fixed_length_sequences(rows, 8190)
    assert long and {len(p) for p in long} == {8190}
    plus = sorted((r for r in rows if r["strand"] == "+"), key=lambda r: r["start"])
    contiguous = all(a["end"] == b["start"] for a, b in zip(plus, plus[1:]))
    joined = "".join(r["sequence"] for r in plus)
    if contiguous:  # the pieces are real stretches of the genome
        assert long[0] == joined[:8190]
    assert any(p == joined[:8190] for p in long)
    with pytest.raises(ValueError, match="no 100000-base"):
        C.fixed_length_sequences(rows, 100000)


def test_data_path_falls_back_with_a_message(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(C, "BENCH_DATA", str(tmp_path / "absent.parquet"))
    path, note = C.data_path()
    assert path == C.SUBSET_DATA and "FALLING BACK" in note
    assert "FALLING BACK" in capsys.readouterr().out
    assert C.data_path("x.parquet") == ("x.parquet", "given with --data")


def test_bench_selection_round_robin_exact_windows():
    rows = []
    for g, n in (("a", 10), ("b", 3), ("c", 6)):
        for i in range(n):
            rows.append(dict(genome=g, start=i * 8, end=i * 8 + 8, sequence="A" * 8, id=f"{g}{i}"))
    rows.append(dict(genome="c", start=100, end=105, sequence="A" * 5, id="short"))
    got = make_bench_data.select(rows, 8, 9)
    assert len(got) == 9 and all(r["end"] - r["start"] == 8 for r in got)
    by = {g: [r["id"] for r in got if r["genome"] == g] for g in "abc"}
    assert {g: len(v) for g, v in by.items()} == {"a": 3, "b": 3, "c": 3}
    assert by["a"] == ["a0", "a3", "a6"]  # evenly spaced along the genome
    assert len(make_bench_data.select(rows, 8, 100)) == 19  # all exact windows, never more than there are
    with pytest.raises(ValueError, match="exactly 7"):
        make_bench_data.select(rows, 7, 3)


def test_batches_fixed_length_padded_equals_packed():
    seqs = C.fixed_length_sequences(C.load_windows(C.SUBSET_DATA), 62)
    packed, padded = C.make_batches(seqs, 5, max_length=64, batch_size=3)
    tok = C.tokenizer()
    assert len(packed) == len(padded) == 5
    for p, q in zip(packed, padded):
        assert p["input_ids"].shape == (192,) and p["cu_seqlens"].tolist() == [0, 64, 128, 192]
        assert q["input_ids"].shape == (3, 64) and torch.equal(q["input_ids"].reshape(-1), p["input_ids"])
        assert torch.equal(q["labels"].reshape(-1), p["labels"])
        assert (q["input_ids"][:, 0] == tok.bos_token_id).all() and (q["input_ids"][:, -1] == tok.eos_token_id).all()
        assert int(p["num_tokens"]) == 192
    # distinct batches (the loader's shuffled order), not one batch repeated
    assert not torch.equal(packed[0]["input_ids"], packed[1]["input_ids"])


def test_train_flops_counts_the_gemm_weights():
    from seqfuse.hf import SeqfuseLlamaForCausalLM

    cfg = C.seqfuse_config("tiny")
    with torch.device("meta"):
        model = SeqfuseLlamaForCausalLM(cfg)
    gemm = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed_tokens" not in n)
    gemm += cfg.vocab_size * cfg.hidden_size if cfg.tie_word_embeddings else 0  # the tied head is a GEMM too
    q = cfg.num_attention_heads * cfg.head_dim
    lengths = [64, 128]
    attn = sum(cfg.num_hidden_layers * 2 * s * s * q for s in lengths)
    assert C.train_flops(lengths, cfg) == 3 * (2 * gemm * sum(lengths) + attn)
    one = C.train_flops([8192], C.seqfuse_config("1B"))
    # per token: 6 x 0.973e9 GEMM weights (1.236e9 less the 128256-row embedding; vocabulary 16 here)
    # + 3 x 16 layers x 2 x 8192 x 2048 (causal attention) = 7.45e9
    assert 7.3e9 < one / 8192 < 7.6e9


def test_row_names_ratios_goals_and_loss_check():
    assert B.parse_train_row("hf_bf16_compiled") == ("hfcompile", "bf16", "padded")
    assert B.parse_train_row("seqfuse_fp8_block_packed") == ("seqfuse", "fp8_block", "packed")
    with pytest.raises(ValueError, match="training row"):
        B.parse_train_row("seqfuse_fp8_current_packed")
    rows = [dict(row="hf_bf16", impl="hf", recipe="bf16", unpadded_tokens_per_s=100.0, peak_mem_gib=50.0,
                 first_loss=2.5),
            dict(row="hf_bf16_compiled", impl="hfcompile", recipe="bf16", unpadded_tokens_per_s=90.0,
                 peak_mem_gib=40.0, first_loss=2.5),
            dict(row="seqfuse_bf16_packed", impl="seqfuse", recipe="bf16", unpadded_tokens_per_s=150.0,
                 peak_mem_gib=45.0, first_loss=2.51),
            dict(row="seqfuse_fp8_delayed_packed", impl="seqfuse", recipe="fp8_delayed",
                 unpadded_tokens_per_s=170.0, peak_mem_gib=55.0, first_loss=2.6)]
    B.add_train_ratios(rows)
    by = {r["row"]: r for r in rows}
    assert by["seqfuse_bf16_packed"]["vs_best_hf"] == pytest.approx(1.5)
    assert by["seqfuse_bf16_packed"]["best_hf"] == "hf_bf16"
    assert "SLOWER than eager" in by["hf_bf16_compiled"]["note"]
    goals = {g["goal"]: g for g in B.train_goals(rows)}
    assert goals["bf16 (packed) vs best transformers row"]["pass"]
    assert not goals["FP8 delayed (packed) vs best transformers row"]["pass"]  # 1.7 < 1.8
    assert not goals["peak memory vs transformers (seqfuse_fp8_delayed_packed)"]["pass"]
    check = B.loss_check(rows, fp32=False)
    assert check["pass"] and check["rows"]["seqfuse_fp8_delayed_packed"]["rel_diff"] == pytest.approx(0.04)
    rows[2]["first_loss"] = 2.6  # a bf16 row 4 % off transformers' first loss: wrong weights or loss
    assert not B.loss_check(rows, fp32=False)["pass"]
    assert B.first_divergence(torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.tensor([[1, 2, 3], [4, 0, 6]])) == [None, 1]


@needs_fp8
def test_tiny_cpu_run(tmp_path):
    out = B.main(["--size", "tiny", "--device", "cpu", "--steps", "2", "--batch-size", "2", "--seq-len", "64",
                  "--rows", "hf_bf16,seqfuse_bf16_padded,seqfuse_bf16_packed,seqfuse_fp8_delayed_packed,"
                            "hf_bf16_compiled,hf_bf16_liger",
                  "--decode-batches", "1,3", "--prompt-len", "24", "--new-tokens", "6", "--decode-repeats", "1",
                  "--data", C.SUBSET_DATA, "--results-dir", str(tmp_path), "--out", "l3"])
    doc = json.load(open(tmp_path / "l3.json"))
    assert doc["complete"] and doc["seq_len"] == 64 and doc["tokens_per_step"] == 128
    assert doc["run"]["command"].startswith("python3 ") and "--size tiny" in doc["run"]["command"]
    assert "git_commit" in doc["run"] and "transformers" in doc["run"]["versions"]
    rows = {r["row"]: r for r in doc["rows"]}
    assert "needs a CUDA GPU" in rows["hf_bf16_compiled"]["skipped"]
    assert "Liger-Kernel (Triton) row: needs a CUDA GPU" in rows["hf_bf16_liger"]["skipped"]
    measured = [r for r in rows.values() if "unpadded_tokens_per_s" in r]
    assert len(measured) == 4 and all(r["unpadded_tokens_per_s"] > 0 and r["steps"] == 2 for r in measured)
    assert len({r["real_tokens"] for r in measured}) == 1 and measured[0]["real_tokens"] == 2 * 128
    assert all(r["padding_pct"] == 0 for r in measured)
    # same weights, same batch: float32 first losses equal to 1e-4; FP8 within 5 %
    check = doc["loss_check"]
    assert check["pass"] and set(check["rows"]) == {r["row"] for r in measured}
    assert check["rows"]["seqfuse_bf16_packed"]["rel_diff"] <= 1e-4
    assert out["loss_check"]["pass"]
    dec = json.load(open(tmp_path / "l3_decode.json"))
    drows = [r for r in dec["rows"] if "tokens_per_s" in r]
    assert {(r["row"], r["batch"]) for r in drows} == {("hf_static", 1), ("hf_static", 3), ("seqfuse_bf16", 1),
                                                        ("seqfuse_bf16", 3), ("seqfuse_bf16_eager", 1),
                                                        ("seqfuse_bf16_eager", 3)}
    # (on the CPU no decode graph: both seqfuse rows run the same eager step)
    assert all("run eagerly" in r["note"] for r in drows if r["row"].startswith("seqfuse"))
    assert all(r["same_tokens_as_seqfuse_bf16"] for r in drows if r["row"] == "seqfuse_bf16_eager")
    assert all(r["same_tokens_as_hf_static"] for r in drows)  # float32 greedy: transformers' tokens
    assert all("GPUs only" in r["skipped"] for r in dec["rows"] if r["row"] == "hf_static_compiled")
    assert any(g["row"] == "seqfuse_bf16" for g in dec["goals"])


def test_liger_row_is_a_peer_and_its_patches_end_with_the_row(monkeypatch):
    """hf_bf16_liger parses as the Liger impl, counts as a transformers peer
    (the best one when fastest; a Liger row slower than eager says so), and
    liger_patched undoes apply_liger_kernel_to_llama's module-level patches
    of transformers' Llama code when its block ends, error or not."""
    import types

    from transformers.models.llama import modeling_llama

    from peers import meta

    assert B.parse_train_row("hf_bf16_liger") == ("liger", "bf16", "padded")
    rows = [dict(row="hf_bf16", impl="hf", recipe="bf16", unpadded_tokens_per_s=100.0, peak_mem_gib=50.0),
            dict(row="hf_bf16_liger", impl="liger", recipe="bf16", unpadded_tokens_per_s=120.0, peak_mem_gib=40.0),
            dict(row="seqfuse_bf16_packed", impl="seqfuse", recipe="bf16", unpadded_tokens_per_s=150.0,
                 peak_mem_gib=45.0)]
    by = {r["row"]: r for r in B.add_train_ratios(rows)}
    assert by["seqfuse_bf16_packed"]["best_hf"] == "hf_bf16_liger"
    assert by["seqfuse_bf16_packed"]["vs_best_hf"] == pytest.approx(1.25)
    rows[1]["unpadded_tokens_per_s"] = 90.0
    by = {r["row"]: r for r in B.add_train_ratios(rows)}
    assert by["seqfuse_bf16_packed"]["best_hf"] == "hf_bf16" and "Liger is SLOWER than eager" in by["hf_bf16_liger"]["note"]

    names = ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP")
    before = {n: getattr(modeling_llama, n) for n in names}
    seen = {}

    def apply_liger_kernel_to_llama(model=None):  # what Liger does to the module, with stand-ins
        for n in names:
            setattr(modeling_llama, n, f"liger {n}")
        model.patched = True

    fake = types.SimpleNamespace(apply_liger_kernel_to_llama=apply_liger_kernel_to_llama)
    monkeypatch.setitem(meta._IMPORTS, "liger_kernel.transformers", (fake, None))
    model = types.SimpleNamespace()
    with pytest.raises(RuntimeError, match="row broke"):
        with B.liger_patched(model):
            seen.update({n: getattr(modeling_llama, n) for n in names})
            raise RuntimeError("row broke")
    assert model.patched and seen == {n: f"liger {n}" for n in names}
    assert {n: getattr(modeling_llama, n) for n in names} == before
    monkeypatch.setitem(meta._IMPORTS, "liger_kernel.transformers", (None, "liger_kernel not importable here: X"))
    with pytest.raises(RuntimeError, match="not importable"):
        with B.liger_patched(model):
            pass
