"""What the recipe tests (test_recipe_*.py) share: the recipe scripts run
under torchrun (two CPU processes on gloo, or two GPUs), the metrics file's
losses, and the L0 story the causal-LM recipes (Llama 3, Mixtral) tell on
the committed lambda-phage subset: train until the loss falls, stop at a
checkpoint and resume to the uninterrupted run's losses bit for bit, and an
export that transformers and its AutoTokenizer load with the checkpoint's
weights and seqfuse's logits.  Each recipe's test keeps its own names,
step counts and model-specific claims and calls these.

A test module puts its recipe folder on sys.path (``recipe_path``) before
it imports the recipe's package; ``recipe_common`` is then importable too."""
import json
import math
import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: L0_sanity of the causal-LM recipes made quicker for the tests that compare runs.
CAUSAL_TINY = ["data.micro_batch_tokens=512", "data.max_length=128", "data.val_batches=2", "train.log_interval=1",
               "train.eval_interval=0", "logging.progress_bar=false", "device=cpu"]
#: An untrained model's loss over the nucleotide tokenizer's 10 tokens.
LN10 = math.log(10)
#: Two DNA prompts: a phage window, and one with lower case and N (folded, kept).
#: The ESM-2 recipe's six-step run with a checkpoint every two steps (the
#: checkpoint tests; each adds its device).
ESM2_CHECKPOINT_RUN = ["data.micro_batch_tokens=512", "data.max_length=64", "data.val_batches=2",
                       "train.log_interval=1", "train.eval_interval=0", "train.warmup_steps=2",
                       "logging.progress_bar=false", "train.steps=6", "checkpoint.interval=2",
                       "checkpoint.keep_last=3"]
PROMPTS = ["GGGCGGCGACCTCGCGGGTTTTCGCTATTTATGAAAATTTTCCGGTTTAAGG", "acgtNNacgtTTGACA"]


def recipe_path(name):
    """recipes/<name>, put first on sys.path (and returned)."""
    path = os.path.join(ROOT, "recipes", name)
    if path not in sys.path:
        sys.path.insert(0, path)
    return path


def check_named_configs(recipe_config, expected):
    """A recipe's named configs (its hydra_config/*.yaml, ``recipe_config``
    being the recipe's config module): ``expected`` are among them, each
    loads under its own name, and "base" composes to the schema's defaults."""
    have = recipe_config.SPEC.configs()
    assert set(expected) <= set(have), (sorted(expected), have)
    for name in have:
        assert recipe_config.load_config(name).config_name == name
    assert recipe_config.compose_config("base") == recipe_config.schema_defaults()


def losses(path):
    """{step: training loss} of a metrics JSONL file."""
    with open(path) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def torchrun(script, args, env_extra=None, timeout=300):
    """``torchrun --standalone --nproc_per_node 2 script *args`` from the
    repository root with python/ on PYTHONPATH and one thread per process;
    asserts it exits 0 (the output's tails in the message) and returns the
    CompletedProcess."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "python"), env.get("PYTHONPATH", "")])
    env.update(env_extra or {})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", script, *args]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-6000:]
    return r


def check_l0_trains_and_resumes(train, load_config, tmp_path, steps):
    """(1) L0_sanity for ``steps`` steps (validation at the half and the
    end): finite losses, the loss falls far below ln(10) from an untrained
    start, the metrics rows carry the throughput fields; (2) the same run
    stopped at a checkpoint at steps / 2 (train.stop_at) and resumed, with
    the export on, gives the uninterrupted run's losses exactly.  Returns
    (the overrides, the checkpoint dir, the export dir)."""
    from recipe_common import checkpoint as ckpt

    half = steps // 2
    ref, jl, d, exp = tmp_path / "ref.jsonl", tmp_path / "m.jsonl", tmp_path / "ck", tmp_path / "hf"
    base = CAUSAL_TINY + [f"train.steps={steps}", "train.warmup_steps=3", f"train.eval_interval={half}"]
    out = train(load_config("L0_sanity", base + [f"logging.metrics_jsonl={ref}"]), "fsdp2")
    h = out["history"]
    assert h["step"] == list(range(1, steps + 1)) and h["val_step"] == [half, steps]
    assert all(math.isfinite(v) for v in h["loss"] + h["val_loss"])
    assert h["loss"][0] > LN10 - 0.2, h["loss"]  # starts untrained ...
    assert max(h["loss"][-3:]) < LN10 - 0.6, h["loss"]  # ... and learns the bases
    assert h["val_loss"][-1] < LN10 - 0.6, h["val_loss"]
    rows = [json.loads(line) for line in open(ref)]
    assert {"loss", "lr", "tokens_per_s", "unpadded_tokens_per_s", "step_time_ms", "tflops_per_s"} <= set(rows[0])

    args = base + [f"checkpoint.dir={d}", f"logging.metrics_jsonl={jl}"]
    first = train(load_config("L0_sanity", args + [f"train.stop_at={half}"]), "fsdp2")
    assert first["final_step"] == half and first["export_dir"] is None
    assert [s for s, _ in ckpt.list_checkpoints(str(d))] == [half]
    assert ckpt.verify_checkpoint(ckpt.latest_checkpoint(str(d))) == []
    second = train(load_config("L0_sanity", args + [f"checkpoint.export_dir={exp}"]), "fsdp2")
    assert second["final_step"] == steps
    got, want = losses(jl), losses(ref)
    assert sorted(got) == list(range(1, steps + 1))
    for s in range(1, steps + 1):
        assert got[s] == want[s], (s, got[s], want[s])
    return base, d, exp


def check_export(hf_cls, model_type, exp, ckpt_dir, seqfuse_model):
    """The export directory ``exp`` loads as transformers' ``hf_cls`` (its
    model_type, the 10-token vocabulary) with AutoTokenizer, holds the final
    checkpoint's embedding exactly, and gives the logits of
    ``seqfuse_model()`` (the trained seqfuse model) on PROMPTS.  Returns
    (transformers' model, the tokenizer, the seqfuse model)."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoTokenizer

    from recipe_common import checkpoint as ckpt

    hf = hf_cls.from_pretrained(str(exp)).eval()
    tok = AutoTokenizer.from_pretrained(str(exp))
    assert hf.config.model_type == model_type and hf.config.vocab_size == 10
    emb = {"model": {"model.embed_tokens.weight": torch.empty_like(hf.model.embed_tokens.weight)}}
    dcp.load(emb, checkpoint_id=ckpt.latest_checkpoint(str(ckpt_dir)))
    assert torch.equal(emb["model"]["model.embed_tokens.weight"], hf.model.embed_tokens.weight)
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    assert enc["input_ids"][0, 0].item() == 2 and enc["input_ids"][1, 1].item() == 5  # <bos>, 'a' folded to A
    sf = seqfuse_model().eval()
    with torch.no_grad():
        got_logits = sf(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits
        want_logits = hf(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits
    m = enc["attention_mask"].bool()
    torch.testing.assert_close(got_logits[m], want_logits[m], atol=1e-4, rtol=1e-4)
    return hf, tok, sf


def save_dying_in(ckpt, stage, root, step, model, optimizer, keep_last):
    """ckpt.save_checkpoint(step) with ckpt.<stage> (a function of the save,
    e.g. "_write_manifest" or "_finalize") raising OSError: what that stage
    had not written stays undone (a save killed there); asserts the save
    raised, and puts the stage back."""
    import pytest

    real = getattr(ckpt, stage)

    def dies(*args, **kwargs):
        raise OSError(f"simulated death in {stage}")

    setattr(ckpt, stage, dies)
    try:
        with pytest.raises(OSError, match="simulated death"):
            ckpt.save_checkpoint(root, step, model, optimizer, {"step": step}, keep_last=keep_last)
    finally:
        setattr(ckpt, stage, real)


def fp8_seen_by_layer(trainer, probed_modules, run):
    """Where FP8 was on: ``run()`` (a training run of ``trainer``'s recipe)
    with trainer.build_model wrapped so that a forward hook on each module
    that ``probed_modules(model)`` yields as (layer key, module) records
    whether seqfuse's FP8 autocast was on inside it.  Returns ({layer key:
    the set of is_fp8_enabled() values seen}, run()'s result); build_model
    is put back after."""
    from seqfuse.quantization import is_fp8_enabled

    seen = {}
    real = trainer.build_model

    def probed(cfg, device, dtype):
        model, mcfg = real(cfg, device, dtype)
        for key, module in probed_modules(model):
            module.register_forward_hook(lambda m, a, o, key=key: seen.setdefault(key, set()).add(is_fp8_enabled()))
        return model, mcfg

    trainer.build_model = probed
    try:
        out = run()
    finally:
        trainer.build_model = real
    return seen, out
