"""The ESM-2 training recipe (recipes/esm2) on the CPU, on the committed real
UniProt subset: config loading, the LR schedule, L0_sanity trains (the loss
falls), stop-and-resume equals the uninterrupted run, checkpoints are atomic,
the export loads in transformers, and a two-process gloo FSDP2 run under
torchrun (sharded DCP checkpoint, resume and export included)."""
import contextlib
import json
import math
import os

import pytest
import torch

from recipe_checks import losses as _losses  # noqa: E402
from recipe_checks import fp8_seen_by_layer, recipe_path, save_dying_in, torchrun  # noqa: E402

RECIPE = recipe_path("esm2")

pytest.importorskip("transformers")
pytest.importorskip("pyarrow")

from esm2_recipe import checkpoint as ckpt  # noqa: E402
from esm2_recipe.config import load_config  # noqa: E402
from esm2_recipe.trainer import lr_lambda, train  # noqa: E402

# A smaller, quicker L0 for the tests that compare runs.
TINY = ["data.micro_batch_tokens=512", "data.max_length=64", "data.val_batches=2", "train.log_interval=1", "train.eval_interval=0",
        "train.warmup_steps=2", "logging.progress_bar=false",
        "device=cpu"]


# ------------------------------------------------------------ config
def test_config_compose_and_override():
    cfg = load_config("L0_sanity", ["train.lr=1e-3", "precision.recipe=fp8_block", "data.packed=false",
                                    "train.betas=[0.9,0.95]", "train.clip_grad_norm=2"])
    assert cfg.train.lr == 1e-3 and isinstance(cfg.train.lr, float)
    assert cfg.precision.recipe == "fp8_block" and cfg.data.packed is False
    assert cfg.train.betas == [0.9, 0.95]
    assert cfg.train.clip_grad_norm == 2.0 and isinstance(cfg.train.clip_grad_norm, float)  # schema's type
    with pytest.raises(ValueError, match=r"model.extra=3: not a key of the model group"):
        load_config("L0_sanity", ["+model.extra=3"])  # a key nothing reads is refused
    assert cfg.model.hidden_size == 64 and cfg.train.weight_decay == 0.01  # L0 over base
    assert isinstance(load_config("35M").train.lr, float)  # "4.0e-4" from YAML
    for size in ("8M", "35M", "150M", "650M", "3B"):
        assert load_config(size).model.size == size
    with pytest.raises(ValueError, match="train.stepz=3: not a key of the train group"):
        load_config("L0_sanity", ["train.stepz=3"])
    with pytest.raises(ValueError, match="key=value"):
        load_config("L0_sanity", ["train.steps"])
    with pytest.raises(FileNotFoundError, match="nope"):
        load_config("nope")


def test_lr_schedule_warmup_and_decay():
    cfg = load_config("L0_sanity", ["train.steps=100", "train.warmup_steps=10", "train.min_lr_ratio=0.1"])
    f = lr_lambda(cfg)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0) and f(100) == pytest.approx(0.1)
    assert f(55) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    lin = lr_lambda(load_config("L0_sanity", ["train.steps=100", "train.warmup_steps=10", "train.decay=linear"]))
    assert lin(55) == pytest.approx(1 - 0.9 * 0.5)
    with pytest.raises(ValueError, match="train.decay"):
        lr_lambda(load_config("L0_sanity", ["train.decay=exp"]))


# ------------------------------------------------------------ training
def test_l0_sanity_loss_falls(tmp_path):
    """The real L0_sanity config (shortened to 30 steps): validation and
    training loss fall well below the uniform-guess loss ln(33) = 3.50."""
    jl = tmp_path / "m.jsonl"
    out = train(load_config("L0_sanity", ["train.steps=30", "train.eval_interval=15", "logging.progress_bar=false", "device=cpu",
                                          f"logging.metrics_jsonl={jl}"]), "fsdp2")
    h = out["history"]
    assert h["step"][-1] == 30 and len(h["val_loss"]) == 2
    assert all(math.isfinite(v) for v in h["loss"] + h["val_loss"])
    assert h["loss"][-1] < h["loss"][0] - 0.3, h["loss"]
    assert h["val_loss"][-1] < 3.2, h["val_loss"]
    rows = [json.loads(line) for line in open(jl)]
    assert {"loss", "tokens_per_s", "unpadded_tokens_per_s", "step_time_ms"} <= set(rows[0])
    assert rows[0]["unpadded_tokens_per_s"] <= rows[0]["tokens_per_s"]


@pytest.mark.parametrize("recipe", ["bf16", "fp8_delayed"])
def test_resume_exact(tmp_path, recipe):
    """Stop by interrupting at step 4 of an 8-step run (a checkpoint every 4
    steps and an exception after step 4), resume to 8: losses of steps 5-8
    equal the uninterrupted run's exactly on the CPU.  Under FP8 delayed
    scaling this needs the scaling state (amax histories, scales) restored
    from the checkpoint: a fresh state would quantize differently."""
    _check_resume_exact(tmp_path, [f"precision.recipe={recipe}", "precision.amax_history_len=4"])


def test_resume_exact_with_bf16_moments(tmp_path):
    """train.adam_moments=bfloat16: FusedAdamW keeps bf16 moments (fp32
    masters), the checkpoint holds them as saved, and a resumed run's losses
    equal the uninterrupted run's exactly."""
    with _built_optimizers() as seen:
        _check_resume_exact(tmp_path, ["train.adam_moments=bfloat16"])
    states = [st for st in seen[-1].state.values() if st]
    assert states and all(st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.bfloat16 for st in states)
    assert all(st["master_param"].dtype == torch.float32 for st in states if "master_param" in st)


def test_resume_exact_without_master_weights(tmp_path):
    """train.master_weights=false with bf16 parameters and bf16 moments (the
    update and state torch.optim.AdamW keeps for bf16 parameters): FusedAdamW
    keeps no fp32 master, updates the bf16 parameters in place, and a
    resumed run's losses equal the uninterrupted run's exactly."""
    with _built_optimizers() as seen:
        _check_resume_exact(tmp_path, ["train.master_weights=false", "train.adam_moments=bfloat16",
                                       "precision.param_dtype=bf16"])
    opt = seen[-1]
    assert all(g["master_weights"] is False for g in opt.param_groups)
    states = [st for st in opt.state.values() if st]
    assert states and not any("master_param" in st for st in states)
    params = [p for g in opt.param_groups for p in g["params"]]
    assert params and all(p.dtype == torch.bfloat16 for p in params)
    assert all(st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.bfloat16 for st in states)


@contextlib.contextmanager
def _built_optimizers(step_pre_hook=None):
    """The list of every optimizer the ESM-2 trainer builds inside the block
    (its build_optimizer wrapped, restored after), each given
    ``step_pre_hook`` where one is passed."""
    from esm2_recipe import trainer

    seen = []
    real_build = trainer.build_optimizer

    def recording(model, cfg):
        opt = real_build(model, cfg)
        if step_pre_hook is not None:
            opt.register_step_pre_hook(step_pre_hook)
        seen.append(opt)
        return opt

    trainer.build_optimizer = recording
    try:
        yield seen
    finally:
        trainer.build_optimizer = real_build


def _check_resume_exact(tmp_path, extra):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    base = TINY + ["train.steps=8", "train.grad_accum=2"] + extra
    train(load_config("L0_sanity", base + [f"logging.metrics_jsonl={a}"]), "ddp")
    d = tmp_path / "ck"
    cfg = load_config("L0_sanity", base + [f"checkpoint.dir={d}", "checkpoint.interval=4",
                                           f"logging.metrics_jsonl={b}"])

    class Stop(Exception):
        pass

    real_save = ckpt.save_checkpoint

    def save_then_crash(*args, **kw):
        path = real_save(*args, **kw)
        raise Stop(path)

    ckpt.save_checkpoint = save_then_crash
    try:
        with pytest.raises(Stop):
            train(cfg, "ddp")
    finally:
        ckpt.save_checkpoint = real_save
    assert [s for s, _ in ckpt.list_checkpoints(str(d))] == [4]
    out = train(cfg, "ddp")
    assert out["final_step"] == 8
    la, lb = _losses(a), _losses(b)
    assert sorted(lb) == list(range(1, 9))
    for s in range(1, 9):
        assert lb[s] == la[s], (s, la[s], lb[s])


def test_resume_into_a_longer_schedule(tmp_path):
    """A run checkpointed at the end of a 3-step schedule, resumed with
    train.steps=6: the first resumed step trains at the 6-step schedule's
    LR for step index 3 (not the stale LR the optimizer state carried)."""
    d = tmp_path / "ck"
    base = TINY + [f"checkpoint.dir={d}", "train.decay=linear", "train.min_lr_ratio=0.1"]
    train(load_config("L0_sanity", base + ["train.steps=3"]), "ddp")
    seen = []

    def record_lr(opt, args, kwargs):
        seen.append(opt.param_groups[0]["lr"])

    with _built_optimizers(record_lr):
        cfg6 = load_config("L0_sanity", base + ["train.steps=6"])
        out = train(cfg6, "ddp")
    # the first step() is torch DCP's state initialisation inside the load (lr 0)
    assert out["final_step"] == 6 and len(seen) == 4 and seen[0] == 0.0
    seen = seen[1:]
    want = [cfg6.train.lr * lr_lambda(cfg6)(s) for s in (3, 4, 5)]
    assert seen == pytest.approx(want, rel=1e-12), (seen, want)


def test_checkpoint_atomic_and_keep_last(tmp_path):
    """A crash inside the save leaves the previous checkpoint the newest
    complete one, loadable; the next save removes the leftover and keeps
    only keep_last checkpoints."""
    from seqfuse.hf import SeqfuseEsmConfig, SeqfuseEsmForMaskedLM
    from seqfuse.optim import FusedAdamW

    torch.manual_seed(0)
    model = SeqfuseEsmForMaskedLM(SeqfuseEsmConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                   intermediate_size=64))
    model.esm.contact_head.requires_grad_(False)  # as the recipe does: no MLM gradient reaches it
    opt = FusedAdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)

    def one_step():
        ids = torch.randint(4, 24, (2, 12))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    root = str(tmp_path / "ck")
    one_step()
    ckpt.save_checkpoint(root, 1, model, opt, {"step": 1}, keep_last=2)
    saved = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    one_step()
    save_dying_in(ckpt, "_finalize", root, 2, model, opt, keep_last=2)  # a crash before the rename
    assert os.path.isdir(os.path.join(root, ".tmp_step_00000002"))  # the half-written one
    assert [s for s, _ in ckpt.list_checkpoints(root)] == [1]
    state = ckpt.load_checkpoint(ckpt.latest_checkpoint(root), model, opt)
    assert state["step"] == 1
    for k, v in model.state_dict().items():
        if k in saved:
            assert torch.equal(v, saved[k]), k
    for s in (2, 3, 4):
        one_step()
        ckpt.save_checkpoint(root, s, model, opt, {"step": s}, keep_last=2)
    assert [s for s, _ in ckpt.list_checkpoints(root)] == [3, 4]
    assert not [n for n in os.listdir(root) if n.startswith(".tmp")]


def test_export_loads_in_transformers(tmp_path):
    """The final export is an EsmForMaskedLM directory (safetensors) whose
    logits equal the trained seqfuse model's."""
    from transformers import EsmForMaskedLM, EsmTokenizer

    from seqfuse.hf.convert import from_hf_model

    exp, d = tmp_path / "hf", tmp_path / "ck"
    train(load_config("L0_sanity", TINY + ["train.steps=3", f"checkpoint.dir={d}", f"checkpoint.export_dir={exp}"]),
          "fsdp2")
    assert (exp / "model.safetensors").is_file()
    hf = EsmForMaskedLM.from_pretrained(str(exp)).eval()
    tok = EsmTokenizer.from_pretrained(str(exp))
    enc = tok(["MKTAYIAKQRQISFVKSHFSRQ", "MSEQLLKAL"], return_tensors="pt", padding=True)
    # The same weights through seqfuse, from the last checkpoint.
    sf = from_hf_model(hf)
    with torch.no_grad():
        want = sf(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits
        got = hf(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits
    m = enc["attention_mask"].bool()
    torch.testing.assert_close(got[m], want[m], atol=2e-4, rtol=2e-4)
    # and they are the trained weights, not a fresh init: the checkpoint's embedding matches
    import torch.distributed.checkpoint as dcp
    sd = {"model": {"esm.embeddings.word_embeddings.weight": torch.empty_like(hf.esm.embeddings.word_embeddings.weight)}}
    dcp.load(sd, checkpoint_id=ckpt.latest_checkpoint(str(d)))
    assert torch.equal(sd["model"]["esm.embeddings.word_embeddings.weight"], hf.esm.embeddings.word_embeddings.weight)


# ------------------------------------------------------------ two processes
def _torchrun(script, args, env_extra=None, timeout=240):
    return torchrun(os.path.join(RECIPE, script), args, env_extra=env_extra, timeout=timeout)


def test_two_process_gloo_fsdp2(tmp_path):
    """torchrun --nproc_per_node 2 train_fsdp2.py on gloo: sharded training
    with FusedAdamW on the DTensor shards (no torch AdamW fallback), a
    sharded DCP checkpoint where a 6-step run stops (train.stop_at=3;
    optimizer moments saved as shards), a resume to step 6 whose losses
    equal an uninterrupted 6-step run's, and the HF export."""
    jl, d, exp = tmp_path / "m.jsonl", tmp_path / "ck", tmp_path / "hf"
    ref_jl = tmp_path / "ref.jsonl"
    r = _torchrun("train_fsdp2.py", ["--config", "L0_sanity", *TINY, "train.steps=6", f"logging.metrics_jsonl={ref_jl}"])
    assert "torch.optim.AdamW" not in r.stdout + r.stderr
    args = ["--config", "L0_sanity", *TINY, "train.steps=6", f"checkpoint.dir={d}", f"logging.metrics_jsonl={jl}"]
    _torchrun("train_fsdp2.py", args + ["train.stop_at=3"])
    assert [s for s, _ in ckpt.list_checkpoints(str(d))] == [3]
    names = os.listdir(ckpt.latest_checkpoint(str(d)))
    assert {"rng_rank0.pt", "rng_rank1.pt", ".metadata"} <= set(names)
    r = _torchrun("train_fsdp2.py", args + [f"checkpoint.export_dir={exp}"])
    assert "resumed from" in r.stdout + r.stderr
    losses, ref = _losses(jl), _losses(ref_jl)
    assert sorted(losses) == list(range(1, 7)) and all(math.isfinite(v) for v in losses.values())
    for s in range(1, 7):  # gloo on the CPU: the same reductions in the same order, so exactly equal
        assert losses[s] == ref[s], (s, losses, ref)
    from transformers import EsmForMaskedLM
    assert EsmForMaskedLM.from_pretrained(str(exp)).config.num_hidden_layers == 2


def test_fp8_delayed_with_bf16_first_layer(tmp_path):
    """precision.recipe=fp8_delayed with bf16_first_layers=1: FP8 is on inside
    layer 1 and off inside layer 0 (seen from a hook inside each layer), the
    FP8 batches are padded to a multiple of 16 tokens, and the loss is finite."""
    from esm2_recipe import trainer

    seen, out = fp8_seen_by_layer(
        trainer, lambda model: enumerate(layer.self_attention for layer in model.esm.encoder.layers),
        lambda: train(load_config("L0_sanity", TINY + ["train.steps=2", "precision.recipe=fp8_delayed",
                                                       "precision.bf16_first_layers=1"]), "ddp"))
    assert seen[0] == {False} and seen[1] == {True}, seen
    assert all(math.isfinite(v) for v in out["history"]["loss"])


@pytest.mark.cuda
@pytest.mark.parametrize("recipe", ["bf16", "fp8_delayed"])
@pytest.mark.parametrize("packed", [True, False])
def test_l0_sanity_cuda(recipe, packed):
    """L0_sanity on the GPU (bf16 parameters, FusedAdamW), bf16 and FP8
    delayed scaling, packed and padded: the loss falls below ln(33) - 0.3 and
    the logged MFU and peak memory are there."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    # L0_sanity's own 4 heads of 16 (the CUDA attention kernel takes head dim 16)
    out = train(load_config("L0_sanity", ["device=cuda",
                                          f"precision.recipe={recipe}", f"data.packed={packed}",
                                          "logging.progress_bar=false", "train.eval_interval=0"]), "fsdp2")
    h = out["history"]
    assert h["loss"][-1] < math.log(33) - 0.3, h["loss"]
    assert out["rates"][-1]["peak_mem_gib"] > 0 and out["rates"][-1]["mfu_measured"] > 0


def test_per_layer_precision_listed_layers():
    """precision.bf16_layers=[1,-1] with bf16_first_layers=0 on a 4-layer
    model under FP8 delayed scaling: layers 1 and 3 run without FP8, 0 and 2
    with it; an index outside the model is refused, naming the key."""
    from esm2_recipe.trainer import apply_layer_precision, fp8_recipe

    from seqfuse.hf import SeqfuseEsmConfig, SeqfuseEsmForMaskedLM
    from seqfuse.pytorch import autocast
    from seqfuse.quantization import is_fp8_enabled

    cfg = load_config("L0_sanity", ["precision.recipe=fp8_delayed", "precision.bf16_layers=[1,-1]"])
    torch.manual_seed(0)
    model = SeqfuseEsmForMaskedLM(SeqfuseEsmConfig(hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                                                   intermediate_size=64))
    recipe = fp8_recipe(cfg)
    assert apply_layer_precision(model, cfg, recipe, rank=0) == [1, 3]
    seen = {}
    for i, layer in enumerate(model.esm.encoder.layers):
        layer.self_attention.register_forward_hook(lambda m, a, o, i=i: seen.update({i: is_fp8_enabled()}))
    ids = torch.randint(4, 24, (16,))
    with autocast(enabled=True, recipe=recipe):
        model(input_ids=ids, cu_seqlens=torch.tensor([0, 16], dtype=torch.int32))
    assert seen == {0: True, 1: False, 2: True, 3: False}, seen
    bad = load_config("L0_sanity", ["precision.recipe=fp8_delayed", "precision.bf16_layers=[4]"])
    with pytest.raises(ValueError, match="precision.bf16_layers"):
        apply_layer_precision(model, bad, recipe, rank=0)


def test_activation_checkpointing_setting_reaches_the_model():
    """train.activation_checkpointing turns the model's (FP8-aware) layer
    recomputation on, and only then."""
    from esm2_recipe.trainer import build_model

    for on in (False, True):
        cfg = load_config("L0_sanity", [f"train.activation_checkpointing={str(on).lower()}"])
        model, _ = build_model(cfg, "cpu", torch.float32)
        assert model.is_gradient_checkpointing is on


def test_validation_does_not_change_fp8_training(tmp_path):
    """Under FP8 delayed scaling a validation's forwards record amaxes and
    their autocast exit runs the scale update; the trainer restores the
    scaling state afterwards, so a run validating at steps 2 and 4 trains
    exactly as one that validates only at the end (bit-equal losses) and
    ends with the same amax histories and scales (but for the weights'
    columns, see below)."""
    from esm2_recipe import trainer

    from seqfuse.quantization import ScalingState

    models = []
    real_build = trainer.build_model

    def keep(cfg, device, dtype):
        model, mcfg = real_build(cfg, device, dtype)
        models.append(model)
        return model, mcfg

    base = TINY + ["train.steps=6", "precision.recipe=fp8_delayed", "precision.amax_history_len=4",
                   "precision.amax_compute_algo=most_recent"]
    runs = {}
    trainer.build_model = keep
    try:
        for every in (0, 2):
            jl = tmp_path / f"v{every}.jsonl"
            out = train(load_config("L0_sanity", base + [f"train.eval_interval={every}",
                                                         f"logging.metrics_jsonl={jl}"]), "ddp")
            # (copied now: the next run's scale updates roll every live state's history)
            states = [(s.amax_history.clone(), s.scale.clone()) for s in models[-1].modules()
                      if isinstance(s, ScalingState)]
            runs[every] = (_losses(jl), out["history"]["val_step"], states)
    finally:
        trainer.build_model = real_build
    assert runs[2][1] == [2, 4, 6] and runs[0][1] == [6]
    assert sorted(runs[0][0]) == list(range(1, 7))
    assert runs[2][0] == runs[0][0], (runs[0][0], runs[2][0])
    assert len(runs[0][2]) == len(runs[2][2]) > 0
    # Input and output-gradient columns equal.  The weight columns (index 1 of
    # each GEMM's 3) may not: a module re-quantizes a weight (recording its
    # amax) only when its cached FP8 copy is stale, and validation refreshes
    # that cache.  The weights' FP8 scales come from their own amax (current
    # scaling), so nothing computed reads those columns (the losses above).
    for (h0, s0), (h1, s1) in zip(runs[0][2], runs[2][2]):
        cols = [i for i in range(h0.shape[1]) if i % 3 != 1]
        assert torch.equal(h0[:, cols], h1[:, cols]) and torch.equal(s0[cols], s1[cols]), (h0, h1)


def test_export_with_an_activation_esmconfig_cannot_describe_is_refused_before_training():
    """checkpoint.export_dir with model.mlp_activation=relu would train the whole run and then fail to
    export (and leave the other ranks waiting at the barrier): refused by check_run, naming both keys."""
    from esm2_recipe.trainer import check_run

    cfg = load_config("L0_sanity", ["model.mlp_activation=relu", "checkpoint.export_dir=/tmp/x"])
    with pytest.raises(ValueError, match=r"checkpoint.export_dir is set, but model.mlp_activation='relu' has no "
                                         r"transformers EsmConfig counterpart"):
        check_run(cfg, torch.device("cpu"))
    check_run(load_config("L0_sanity", ["model.mlp_activation=relu"]), torch.device("cpu"))  # no export: fine
    check_run(load_config("L0_sanity", ["checkpoint.export_dir=/tmp/x"]), torch.device("cpu"))


def test_recompute_activation_option_reaches_the_model():
    """model.recompute_activation=true sets the config's mlp_recompute_activation,
    which every layer's LayerNormMLP takes; refused with the tanh "gelu"."""
    from esm2_recipe.trainer import model_config

    assert model_config(load_config("L0_sanity")).mlp_recompute_activation is False
    mcfg = model_config(load_config("L0_sanity", ["model.recompute_activation=true"]))
    assert mcfg.mlp_recompute_activation is True
    assert model_config(load_config("650M", ["model.recompute_activation=true"])).mlp_recompute_activation
    with pytest.raises(ValueError, match="mlp_recompute_activation=True needs an mlp_activation other than 'gelu'"):
        model_config(load_config("L0_sanity", ["model.recompute_activation=true", "model.mlp_activation=gelu"]))
