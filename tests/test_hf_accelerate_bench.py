"""benchmarks/hf/bench_accelerate.py on the CPU at its tiny shape: the rows
run, the JSON holds them with the run metadata, and the rows' first losses
agree (same weights, same batch).  Speed figures on a CPU mean nothing."""
import json
import os
import sys

import pytest
import torch

pytest.importorskip("transformers")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "hf"))

import bench_accelerate  # noqa: E402
from helpers import FP8_DLPACK, needs_fp8  # noqa: E402


@pytest.mark.parametrize("mode", ["train", "prefill"])
def test_bench_accelerate_tiny_cpu(tmp_path, mode):
    out = str(tmp_path / f"acc_{mode}.json")
    bench_accelerate.main(["--shape", "tiny", "--device", "cpu", "--seq", "32", "--rows",
                           "hf_eager,seqfuse_bf16,seqfuse_bf16_keep", "--warmup", "1", "--steps", "1", "--mode", mode,
                           "--out", out])
    with open(out) as f:
        doc = json.load(f)
    assert doc["complete"] and doc["run"]["command"] and doc["mode"] == mode
    rows = {r["row"]: r for r in doc["rows"]}
    assert set(rows) == {"hf_eager", "seqfuse_bf16", "seqfuse_bf16_keep"}, doc["rows"]
    assert all("error" not in r and r["tokens_per_s"] > 0 for r in rows.values())
    # bf16 rounding of the same computation (train: the first loss; prefill: a logits fingerprint)
    a, b = rows["hf_eager"]["loss0"], rows["seqfuse_bf16"]["loss0"]
    assert abs(a - b) <= 2e-2 * abs(a)
    assert rows["hf_eager"]["vs_hf_eager"] == 1.0
    assert rows["seqfuse_bf16_keep"]["loss0"] == b  # the same forward: only what the backward keeps differs
    for name in ("seqfuse_bf16", "seqfuse_bf16_keep"):  # (the run's one peer is the strongest)
        assert rows[name]["strongest_peer"] == "hf_eager"
        assert rows[name]["vs_strongest_peer"] == rows[name]["tokens_per_s"] / rows["hf_eager"]["tokens_per_s"]


def test_peer_ratios_hold_each_row_against_the_strongest_peer_of_its_kind():
    """bf16 rows against the fastest bf16 peer (compiled transformers here),
    FP8 rows against every peer (torchao's FP8 here); ratios over each peer,
    peak memory where measured; nothing without a peer."""
    by = {"hf_eager": {"tokens_per_s": 40.0, "peak_gib": 20.0}, "hf_compile": {"tokens_per_s": 50.0, "peak_gib": 17.0},
          "liger": {"tokens_per_s": 45.0, "peak_gib": 12.0}, "torchao_float8": {"tokens_per_s": 60.0, "peak_gib": 14.0}}
    bf16 = bench_accelerate.peer_ratios("seqfuse_bf16", {"tokens_per_s": 55.0, "peak_gib": 11.0}, by)
    assert bf16["strongest_peer"] == "hf_compile" and bf16["vs_strongest_peer"] == 55.0 / 50.0
    assert bf16["vs_peers"]["liger"] == {"tokens_per_s": 55.0 / 45.0, "peak_memory": 11.0 / 12.0}
    fp8 = bench_accelerate.peer_ratios("seqfuse_fp8_delayed", {"tokens_per_s": 66.0, "peak_gib": 13.0}, by)
    assert fp8["strongest_peer"] == "torchao_float8" and fp8["vs_strongest_peer"] == 66.0 / 60.0
    assert set(fp8["vs_peers"]) == set(by)
    cpu = {"hf_eager": {"tokens_per_s": 40.0, "peak_gib": float("nan")}}
    assert bench_accelerate.peer_ratios("seqfuse_bf16", {"tokens_per_s": 44.0, "peak_gib": float("nan")}, cpu) == {
        "vs_peers": {"hf_eager": {"tokens_per_s": 1.1, "peak_memory": None}}, "strongest_peer": "hf_eager",
        "vs_strongest_peer": 1.1}
    assert bench_accelerate.peer_ratios("seqfuse_bf16", {"tokens_per_s": 1.0, "peak_gib": 1.0}, {}) == {}
    # Liger with its layers compiled is a bf16 peer too: the strongest here
    by["liger_compile"] = {"tokens_per_s": 52.0, "peak_gib": 11.5}
    bf16 = bench_accelerate.peer_ratios("seqfuse_bf16", {"tokens_per_s": 55.0, "peak_gib": 11.0}, by)
    assert bf16["strongest_peer"] == "liger_compile" and bf16["vs_strongest_peer"] == 55.0 / 52.0


def test_bench_accelerate_fused_adamw_row(tmp_path):
    """A _fused_adamw row is its row's model stepping seqfuse's FusedAdamW:
    the same first loss, and the JSON says which optimizer the rows step."""
    out = str(tmp_path / "acc_opt.json")
    bench_accelerate.main(["--shape", "tiny", "--device", "cpu", "--seq", "32", "--rows",
                           "seqfuse_bf16,seqfuse_bf16_fused_adamw", "--warmup", "2", "--steps", "1", "--out", out])
    with open(out) as f:
        doc = json.load(f)
    rows = {r["row"]: r for r in doc["rows"]}
    assert all("error" not in r for r in rows.values()), doc["rows"]
    assert rows["seqfuse_bf16_fused_adamw"]["loss0"] == rows["seqfuse_bf16"]["loss0"]
    assert "FusedAdamW" in doc["optimizer"] and "torch.optim.AdamW" in doc["optimizer"]


def test_bench_accelerate_keep_rows(tmp_path):
    """A _keep row is its row with recompute_activation=False: the same
    forward (the same first loss); the fused MLPs make their activation
    again in the backward in the plain rows (accelerate()'s default, FP8
    too) and keep it in the _keep rows."""
    out = str(tmp_path / "acc_fp8.json")
    bench_accelerate.main(["--shape", "tiny", "--device", "cpu", "--seq", "32", "--rows",
                           "seqfuse_fp8_delayed,seqfuse_fp8_delayed_keep", "--warmup", "1", "--steps", "1",
                           "--out", out])
    with open(out) as f:
        doc = json.load(f)
    rows = {r["row"]: r for r in doc["rows"]}
    assert all("error" not in r for r in rows.values()), doc["rows"]
    assert rows["seqfuse_fp8_delayed_keep"]["loss0"] == rows["seqfuse_fp8_delayed"]["loss0"]
    assert rows["seqfuse_fp8_delayed_keep"]["note"].startswith("fused 2 layers")
    from seqfuse.modules.layernorm_mlp import LayerNormMLP

    base, family = bench_accelerate.build_base("tiny", None, torch.device("cpu"))
    for row, want in (("seqfuse_fp8_delayed", True), ("seqfuse_fp8_delayed_keep", False),
                      ("seqfuse_bf16", True), ("seqfuse_bf16_keep", False), ("seqfuse_fp8_delayed_head_keep", False)):
        mlps = [m for m in bench_accelerate.prepare(row, base, family)[0].modules() if isinstance(m, LayerNormMLP)]
        assert len(mlps) == 2 and all(m.recompute_activation is want for m in mlps), row


@needs_fp8
def test_bench_accelerate_own_amax_rows(monkeypatch):
    """An _own_amax row is its row with fp8_weight_history = False on every
    FP8 GEMM module of the fused model: after an optimizer step its weights'
    re-casts take the own-amax cast, which the plain row makes at the first
    step alone (then the history's scale)."""
    from seqfuse.ops import quant as qops

    base, family = bench_accelerate.build_base("tiny", None, torch.device("cpu"))
    casts = {}
    real = qops.cast_fp8_current_into
    for row in ("seqfuse_fp8_delayed", "seqfuse_fp8_delayed_own_amax"):
        model, note = bench_accelerate.prepare(row, base, family)
        gemm_modules = [m for m in model.modules() if getattr(type(m), "fp8_num_gemms", 0)]
        want = not row.endswith("_own_amax")
        assert gemm_modules and all(getattr(m, "fp8_weight_history", True) is want for m in gemm_modules), row
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = torch.randint(0, model.config.vocab_size, (1, 32))
        n = casts[row] = []
        monkeypatch.setattr(qops, "cast_fp8_current_into", lambda *a, **k: (n.append(1), real(*a, **k))[1])
        for _ in range(3):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
    # the _own_amax row casts every weight from its own amax at each of the three steps, the plain row at the
    # first alone: two steps' worth of weights fewer (other own-amax casts, the same in both rows, aside)
    weights = sum(type(m).fp8_num_gemms for m in gemm_modules)
    assert len(casts["seqfuse_fp8_delayed_own_amax"]) - len(casts["seqfuse_fp8_delayed"]) == 2 * weights, casts


def test_bench_accelerate_torchao_row_says_when_torchao_is_missing(monkeypatch):
    from peers import meta

    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    monkeypatch.setattr(meta, "_IMPORTS", {}, raising=False)
    base, family = bench_accelerate.build_base("tiny", None, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="torchao.float8 not importable here"):
        bench_accelerate.prepare("torchao_float8", base, family)


def test_bench_accelerate_torchao_row():
    """torchao_float8 (the FP8 peer): torchao's Float8Linear where torchao's
    own tensorwise filter keeps a Linear (at hidden 1,536: q, o, gate, up,
    down; not k and v, 512 wide), never the LM head, the layers compiled;
    with the compile undone, a training forward within FP8's distance of
    the plain model's loss; a token count off 16 refused."""
    pytest.importorskip("torchao.float8")
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=1536, intermediate_size=2048, num_hidden_layers=2,
                                   num_attention_heads=12, num_key_value_heads=4, tie_word_embeddings=True)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model, note = bench_accelerate.prepare("torchao_float8", base, "llama")
    kinds = {n: type(m).__name__ for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert kinds.pop("lm_head") == "Linear"
    assert {n for n, k in kinds.items() if k == "Float8Linear"} == {
        f"model.layers.{i}.{m}" for i in range(2)
        for m in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}, kinds
    assert note.startswith("torchao.float8.convert_to_float8_training: 10 Linears")
    assert all(layer._compiled_call_impl is not None for layer in model.model.layers)
    for layer in model.model.layers:
        layer._compiled_call_impl = None  # (eager on the CPU: the conversion's numbers, not inductor's)
    ids = torch.randint(0, 512, (1, 32), generator=torch.Generator().manual_seed(1))
    want = base(input_ids=ids, labels=ids, use_cache=False).loss.item()
    got = model(input_ids=ids, labels=ids, use_cache=False).loss
    got.backward()
    assert abs(got.item() - want) <= 2e-2 * abs(want) and model.model.layers[0].mlp.up_proj.weight.grad is not None
    with pytest.raises(RuntimeError, match="multiple of 16"):
        bench_accelerate.prepare("torchao_float8", base, "llama", (1, 30))


def test_fused_adamw_like_torch_is_torch_adamws_update():
    """peers.optimizers.fused_adamw_like_torch steps bf16 parameters as
    torch's AdamW does (the rows stepping either differ only in the kernel):
    three steps on the same gradients against torch's AdamW in float64 from
    the same start, within bf16's rounding of each step's parameters and
    moments.  (torch's CPU AdamW rounds every intermediate to bf16, several
    ulps off float64, so it is not the reference here; on the GPU its fused
    kernel computes in float32 as FusedAdamW does.)"""
    from peers import optimizers

    torch.manual_seed(0)
    shapes = [(64, 48), (48,), (7, 5)]
    ours = [torch.randn(s).to(torch.bfloat16).requires_grad_() for s in shapes]
    ref = [p.detach().double().requires_grad_() for p in ours]
    hyper = dict(lr=0.1, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.5)  # (large: a wrong update shows)
    opts = (optimizers.fused_adamw_like_torch(ours, **hyper), torch.optim.AdamW(ref, **hyper))
    steps = 3
    for _ in range(steps):
        grads = [torch.randn(s).to(torch.bfloat16) for s in shapes]
        for params, opt in zip((ours, ref), opts):
            for p, g in zip(params, grads):
                p.grad = g.to(p.dtype)
            opt.step()
    for b, c in zip(ours, ref):
        assert b.dtype == torch.bfloat16
        c = c.detach()
        tol = steps * (torch.finfo(torch.bfloat16).eps * c.abs() + hyper["lr"] * 2 ** -6)
        assert ((b.double() - c).abs() <= tol).all(), ((b.double() - c).abs() / tol).max()


def test_bench_accelerate_bad_arguments():
    with pytest.raises(SystemExit):
        bench_accelerate.main(["--rows", "hf_eager,nope", "--device", "cpu"])


def test_fusion_ab_switches_patch_and_restore():
    """fusion_ab.py's switches: "old" patches the path before the fusion in,
    "new" restores the very attribute (also one the class inherits: the patch
    is removed, not shadowed), and _graphed rows are refused."""
    import fusion_ab
    from seqfuse.modules.transformer_layer import TransformerLayer
    from seqfuse.quantization.gemm_quantizers import GradQuantizer

    owners = {"split_qkv_rope": [(fusion_ab.FL, "split_qkv_rope")],
              "residual": [(fusion_ab.FL.SeqfuseDecoderLayer, "_residual_fusable"),
                           (TransformerLayer, "_residual_fusable")],
              "act_grad_fp8": [(GradQuantizer, "fused_cast")],
              "attn_residual_grad": [(fusion_ab.LayerNormLinear, "forward")],
              "transient_buffers": [(fusion_ab.buffers, "TRANSIENT_POOL_BYTES")],
              "save_original_input": [(fusion_ab.Linear, "save_original_input")],
              "loss_chunk": [(fusion_ab.CE, "default_chunk_size")],
              "weight_history": [(fusion_ab.WeightQuantizer, "_cast_into")],
              "loss_grad_scale": [(fusion_ab.CE, "scale_by_loss_grad")],
              "tied_embedding": [(fusion_ab.FLOSS, "_tied_link")],
              "one_pass_swiglu": [(fusion_ab.LNMLP, "_one_pass_swiglu")],
              "qkv_one_launch": [(fusion_ab.ROPE, "ONE_LAUNCH")]}
    assert set(owners) | {"gemm_tune"} == set(fusion_ab.SWITCHES)
    # gemm_tune switches seqfuse.ops.gemm.set_tuning (which drops the plan cache), no attribute
    set_new, set_old = fusion_ab.SWITCHES["gemm_tune"]()
    try:
        set_old()
        assert not fusion_ab.GEMM.tuning_enabled()
        set_new()
        assert fusion_ab.GEMM.tuning_enabled()
    finally:
        fusion_ab.GEMM.set_tuning(None)
    for name, attrs in owners.items():
        before = [(o, a, o.__dict__.get(a)) for o, a in attrs]
        set_new, set_old = fusion_ab.SWITCHES[name]()
        set_old()
        assert all(o.__dict__.get(a) is not b for o, a, b in before), name
        set_new()
        assert all(o.__dict__.get(a) is b for o, a, b in before), name
    with pytest.raises(SystemExit):
        fusion_ab.main(["seqfuse_fp8_delayed_graphed", "--switch", "residual"])
    # the old path of attn_residual_grad: the input itself as the alias (autograd adds its gradient)
    set_new, set_old = fusion_ab.SWITCHES["attn_residual_grad"]()
    set_old()
    try:
        m = fusion_ab.LayerNormLinear(16, 16)
        x = torch.randn(4, 16)
        out, alias = m(x, return_input_alias=True)
        assert alias is x and torch.equal(out, m(x))
    finally:
        set_new()
    out, alias = m(x, return_input_alias=True)
    assert alias is not x and alias.data_ptr() == x.data_ptr()
    # the old paths of save_original_input (the module's own setting outranked) and loss_chunk (256 MiB chunks)
    kept = fusion_ab.Linear(16, 16, device="cpu", save_original_input=True)
    for name, old_value, new_value in (("save_original_input", False, True), ("loss_chunk", 1024, 2048)):
        set_new, set_old = fusion_ab.SWITCHES[name]()
        read = (lambda: kept.save_original_input) if name == "save_original_input" else \
            (lambda: fusion_ab.CE.default_chunk_size(8192, 128256, 2))
        set_old()
        try:
            assert read() == old_value, name
        finally:
            set_new()
        assert read() == new_value, name
    # weight_history: its old mode casts every weight from its own amax (fp8_weight_history False), the default
    # (new) the re-cast after an optimizer step with the history's scale
    if FP8_DLPACK:
        from seqfuse.common.recipe import DelayedScaling
        from seqfuse.ops import quant as qops
        import seqfuse.pytorch as te

        log = []
        real = qops.cast_fp8_current_into
        set_new, set_old = fusion_ab.SWITCHES["weight_history"]()
        try:
            qops.cast_fp8_current_into = lambda *a, **k: (log.append("own amax"), real(*a, **k))[1]
            for name, mode in (("old", set_old), ("new", set_new)):
                mode()
                lin = fusion_ab.Linear(32, 32, device="cpu")
                opt = torch.optim.SGD(lin.parameters(), lr=0.1)
                for _ in range(2):
                    with te.autocast(recipe=DelayedScaling()):
                        lin(torch.randn(16, 32)).sum().backward()
                    opt.step()
                    opt.zero_grad()
                log.append(name)
        finally:
            qops.cast_fp8_current_into = real
            set_new()
        assert log == ["own amax", "own amax", "old", "own amax", "new"], log


def test_fusion_ab_alternates_which_mode_goes_first(monkeypatch):
    """fusion_ab.ab: each round times both modes, the first one alternating
    (neither always first), warm-up steps for each, the fusion on at the end."""
    import fusion_ab

    mode, log = ["?"], []
    monkeypatch.setattr(fusion_ab.torch.cuda, "synchronize", lambda: None)

    def steps(n):
        log.append((mode[0], n))

    times = fusion_ab.ab(steps, (lambda: mode.__setitem__(0, "new"), lambda: mode.__setitem__(0, "old")),
                         rounds=4, per_round=2)
    timed = [m for m, n in log if n == 2]
    assert log[:2] == [("new", 3), ("old", 3)]
    assert timed == ["new", "old", "old", "new", "new", "old", "old", "new"]
    assert {k: len(v) for k, v in times.items()} == {"new": 4, "old": 4} and mode[0] == "new"
