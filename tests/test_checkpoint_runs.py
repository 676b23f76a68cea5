"""Checkpoints never lose or mix what a user saved, and never load into
another model (recipes/recipe_common/checkpoint.py and trainer.py):

* pruning (checkpoint.keep_last) keeps the checkpoint just saved and deletes
  only lower steps: a save of step 50 into a directory holding step 200
  stays (before: the save was deleted right after it was written), and a
  user's folder named ``step_99999999`` or ``step_00000000`` is left alone;
* a save of a step whose good checkpoint exists is refused (before: the
  other run's checkpoint was replaced, a WARNING only); a damaged one is
  replaced, named in a WARNING with what is wrong; a user's folder of that
  name is refused;
* the Llama 3 recipe refuses, before building anything, a fresh run
  (checkpoint.resume=false) into a checkpoint.dir that holds checkpoints,
  a resume from a checkpoint outside such a directory, and a resume from
  an older checkpoint of the directory while a newer good one is there
  (before: the new run's saves replaced and pruned the old run's, and a
  later resume took the old run's newest step: two runs mixed);
* a resume whose model.* config differs from the checkpoint's is refused,
  naming the fields (before: model.num_hidden_layers=1 loaded layer 0 of a
  2-layer checkpoint and trained on; a changed rope_theta loaded silently);
* load_checkpoint refuses checkpoint keys the model lacks and model keys
  the checkpoint lacks, naming some (before: a 3-layer checkpoint loaded
  into a 2-layer model, its layer 2 dropped), and turns torch's
  CheckpointException (a BaseException, missed by ``except Exception``:
  a multi-kB traceback string naming no checkpoint) into a CheckpointError
  naming the checkpoint and the first error (a size mismatch and its key).
"""
import json
import logging
import os
import shutil

import pytest
import torch

from recipe_checks import CAUSAL_TINY, recipe_path  # noqa: E402

recipe_path("llama3")

pytest.importorskip("transformers")
pytest.importorskip("pyarrow")
pytest.importorskip("hydra")

from llama3_recipe import trainer  # noqa: E402
from llama3_recipe.config import load_config  # noqa: E402
from llama3_recipe.trainer import train  # noqa: E402
from recipe_common import checkpoint as ckpt  # noqa: E402

LOGGER = "recipe.checkpoint"


def tiny_llama(layers=2, seed=0, hidden=32, **kw):
    """A stepped tiny seqfuse Llama and its optimizer (so the optimizer has state)."""
    from seqfuse.hf import SeqfuseLlamaConfig, SeqfuseLlamaForCausalLM

    torch.manual_seed(seed)
    m = SeqfuseLlamaForCausalLM(SeqfuseLlamaConfig(vocab_size=16, hidden_size=hidden, num_hidden_layers=layers,
                                                   num_attention_heads=2, num_key_value_heads=1,
                                                   intermediate_size=64, **kw))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    x = torch.tensor([[1, 5, 6, 2, 7]])
    m(x, labels=x).loss.backward()
    opt.step()
    opt.zero_grad()
    return m, opt


def step_dir(root, s):
    return os.path.join(str(root), f"step_{s:08d}")


def steps_in(root):
    return [s for s, _ in ckpt.list_checkpoints(str(root))]


def weights(model):
    return {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}


def loads_as(path, want):
    """The checkpoint at ``path`` loads into a fresh model with ``want``'s weights."""
    m, o = tiny_llama(seed=99)
    ckpt.load_checkpoint(path, m, o)
    got = weights(m)
    return all(torch.equal(got[k], v) for k, v in want.items())


def tree(root):
    """Every file under ``root`` with its bytes (to see a directory left untouched)."""
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            p = os.path.join(d, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, root)] = f.read()
    return out


# ------------------------------------------------------------ pruning (keep_last)
def test_pruning_keeps_the_save_it_just_wrote(tmp_path):
    """A save of step 50 into a directory holding another run's step 200
    (keep_last=1): the returned checkpoint exists and loads, step 200 is
    left (before: step 50 was pruned by step number right after its rename,
    and the returned path did not exist)."""
    root = str(tmp_path / "ck")
    old, old_opt = tiny_llama(seed=1)
    ckpt.save_checkpoint(root, 200, old, old_opt, {"step": 200}, keep_last=1)
    new, new_opt = tiny_llama(seed=2)
    p = ckpt.save_checkpoint(root, 50, new, new_opt, {"step": 50}, keep_last=1)
    assert p == step_dir(root, 50) and os.path.isdir(p)
    assert ckpt.verify_checkpoint(p) == []
    assert steps_in(root) == [50, 200]
    assert loads_as(p, weights(new)) and loads_as(step_dir(root, 200), weights(old))


def test_pruning_deletes_only_lower_steps_and_never_a_users_folder(tmp_path, caplog):
    """keep_last=2 over saves 1..4: the new save and the next lower one
    remain.  A user's folder named step_99999999 (before: every save was
    pruned, being "older" than it) and one named step_00000000 (before:
    deleted as the oldest checkpoint) hold no checkpoint files: both are
    left with their contents, the lower one named in a WARNING."""
    root = str(tmp_path / "ck")
    for name in ("step_99999999", "step_00000000"):
        os.makedirs(os.path.join(root, name))
        with open(os.path.join(root, name, "notes.txt"), "w") as f:
            f.write("mine")
    m, o = tiny_llama()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for s in (1, 2, 3, 4):
            p = ckpt.save_checkpoint(root, s, m, o, {"step": s}, keep_last=2)
            assert os.path.isdir(p), s
    assert steps_in(root) == [0, 3, 4, 99999999]
    for name in ("step_99999999", "step_00000000"):
        with open(os.path.join(root, name, "notes.txt")) as f:
            assert f.read() == "mine"
    assert (f"checkpoint: {os.path.join(root, 'step_00000000')} is named like a checkpoint but holds none of "
            f"its files: left in place") in caplog.text


def test_a_newer_damaged_checkpoint_is_not_pruned(tmp_path):
    """keep_last=1 and a damaged step_9 (resume would skip it): saves of
    steps 1 and 2 prune step 1 only; step 9 is neither counted nor deleted
    (before: step 9 counted as the newest, and each new save was pruned)."""
    root = str(tmp_path / "ck")
    m, o = tiny_llama()
    ckpt.save_checkpoint(root, 9, m, o, {"step": 9}, keep_last=1)
    os.remove(os.path.join(step_dir(root, 9), "rng_rank0.pt"))
    for s in (1, 2):
        ckpt.save_checkpoint(root, s, m, o, {"step": s}, keep_last=1)
    assert steps_in(root) == [2, 9]


# ------------------------------------------------------------ a step saved again
def test_a_good_checkpoint_of_the_same_step_is_never_replaced(tmp_path):
    """Another run's good step 10, saved again: CheckpointError naming the
    directory and what to do, before anything is written (no .tmp left);
    the old checkpoint still loads with its own weights (before: replaced
    by the new save, a WARNING only)."""
    root = str(tmp_path / "ck")
    old, old_opt = tiny_llama(seed=1)
    ckpt.save_checkpoint(root, 10, old, old_opt, {"step": 10})
    before = tree(root)
    new, new_opt = tiny_llama(seed=2)
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.save_checkpoint(root, 10, new, new_opt, {"step": 10})
    msg = str(e.value)
    assert f"cannot save step 10: {step_dir(root, 10)} already holds a good checkpoint of step 10" in msg
    assert "checkpoint.resume=true" in msg and "another checkpoint.dir" in msg
    assert tree(root) == before
    assert loads_as(step_dir(root, 10), weights(old))


def test_a_damaged_checkpoint_of_the_same_step_is_replaced_naming_the_damage(tmp_path, caplog):
    """A rerun past a damaged step_10 (resume skipped it) saves step 10
    again: the damaged one is replaced, the WARNING says what was wrong
    with it (before: a WARNING that did not tell a damaged one from a good
    one), and the new one verifies and holds the new weights."""
    root = str(tmp_path / "ck")
    m, o = tiny_llama(seed=1)
    ckpt.save_checkpoint(root, 10, m, o, {"step": 10})
    shard = next(n for n in os.listdir(step_dir(root, 10)) if n.endswith(".distcp"))
    with open(os.path.join(step_dir(root, 10), shard), "r+b") as f:
        f.seek(64)
        f.write(b"\xff" * 64)
    new, new_opt = tiny_llama(seed=2)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        ckpt.save_checkpoint(root, 10, new, new_opt, {"step": 10})
    assert (f"checkpoint: replacing {step_dir(root, 10)}, a damaged earlier save of the same step ({shard} fails "
            f"its CRC-32 check") in caplog.text
    assert ckpt.verify_checkpoint(step_dir(root, 10)) == []
    assert loads_as(step_dir(root, 10), weights(new))


def test_a_users_folder_named_like_the_step_is_refused(tmp_path):
    root = str(tmp_path / "ck")
    os.makedirs(step_dir(root, 10))
    with open(os.path.join(step_dir(root, 10), "notes.txt"), "w") as f:
        f.write("mine")
    m, o = tiny_llama()
    with pytest.raises(ckpt.CheckpointError, match=r"cannot save step 10: .*step_00000010 exists and is not a "
                                                   r"checkpoint .*refusing to replace it"):
        ckpt.save_checkpoint(root, 10, m, o, {"step": 10})
    assert os.listdir(step_dir(root, 10)) == ["notes.txt"]


# ------------------------------------------------------------ load_checkpoint: another model
@pytest.mark.parametrize("saved_layers,model_layers,what", [(3, 2, "holds 6 model key(s) the model lacks"),
                                                            (2, 3, "lacks 6 key(s) of the model")])
def test_load_into_another_number_of_layers_is_refused(tmp_path, saved_layers, model_layers, what):
    """A 3-layer checkpoint into a 2-layer model (before: loaded, layer 2
    dropped silently) and a 2-layer one into a 3-layer model (before:
    torch's CheckpointException, a BaseException) are CheckpointErrors
    naming the checkpoint and layer 2's keys."""
    root = str(tmp_path / "ck")
    m, o = tiny_llama(layers=saved_layers)
    p = ckpt.save_checkpoint(root, 10, m, o, {"step": 10})
    m2, o2 = tiny_llama(layers=model_layers, seed=5)
    before = weights(m2)
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.load_checkpoint(p, m2, o2)
    msg = str(e.value)
    assert msg.startswith(f"checkpoint {p} is not of this model: it {what}: model.layers.2.") and len(msg) < 1500
    assert all(torch.equal(v, before[k]) for k, v in weights(m2).items())  # nothing loaded


def test_fp8_scaling_state_the_model_lacks_is_named(tmp_path):
    """A checkpoint with delayed-scaling FP8 state loaded into a model
    without it (a run under another precision.recipe): refused, the message
    says it is FP8 state and what to do (before: dropped silently)."""
    from seqfuse.common.recipe import DelayedScaling
    from seqfuse.quantization import init_fp8_state

    root = str(tmp_path / "ck")
    m, o = tiny_llama()
    init_fp8_state(m, DelayedScaling())
    p = ckpt.save_checkpoint(root, 10, m, o, {"step": 10})
    m2, o2 = tiny_llama(seed=5)
    with pytest.raises(ckpt.CheckpointError, match=r"model key\(s\) the model lacks: model\.layers\.0\.layernorm_mlp"
                                                   r"\.fp8_state\.amax_history, .*\(FP8 delayed-scaling state: .*"
                                                   r"resume with the checkpoint's precision settings\)"):
        ckpt.load_checkpoint(p, m2, o2)


def test_torch_load_errors_are_a_checkpoint_error_naming_the_checkpoint(tmp_path):
    """hidden_size 32 saved, 64 loaded: torch raises CheckpointException, a
    BaseException that ``except Exception`` missed (the user got its
    multi-kB traceback text, naming no checkpoint).  Now a CheckpointError
    (an Exception) naming the checkpoint and the first error line: the size
    mismatch and its key, no traceback."""
    root = str(tmp_path / "ck")
    m, o = tiny_llama(hidden=32)
    p = ckpt.save_checkpoint(root, 10, m, o, {"step": 10})
    m2, o2 = tiny_llama(hidden=64, seed=5)
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.load_checkpoint(p, m2, o2)
    msg = str(e.value)
    assert isinstance(e.value, Exception)
    assert msg.startswith(f"checkpoint {p}: loading failed: ValueError: Size mismatch between saved "
                          f"torch.Size([16, 32]) and current: torch.Size([16, 64]) for model."), msg
    assert "Traceback" not in msg and "\n" not in msg and len(msg) < 500, msg
    from torch.distributed.checkpoint.api import CheckpointException

    assert isinstance(e.value.__cause__, CheckpointException)


def test_first_error_line_of_several_ranks():
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    def failed(exc):
        try:
            raise exc
        except BaseException as e:  # noqa: B036
            return _wrap_exception(e)

    e = CheckpointException("load failed", {1: failed(RuntimeError("Missing key in checkpoint state_dict: model.x.\n"
                                                                   "more")),
                                            0: failed(ValueError("Size mismatch ... for model.y"))})
    assert ckpt._first_error_line(e) == "ValueError: Size mismatch ... for model.y (rank 0, one of 2 failing)"


# ------------------------------------------------------------ the recipe: runs never mixed
BASE = CAUSAL_TINY + ["train.warmup_steps=1", "checkpoint.interval=2", "checkpoint.keep_last=3"]


@pytest.fixture(scope="module")
def run4(tmp_path_factory):
    """A Llama 3 L0_sanity run of 6 steps stopped after step 4: checkpoints 2 and 4."""
    d = tmp_path_factory.mktemp("llama_ck") / "ck"
    train(load_config("L0_sanity", BASE + ["train.steps=6", "train.stop_at=4", f"checkpoint.dir={d}"]), "ddp")
    assert steps_in(d) == [2, 4]
    return d


def _copy(src, tmp_path):
    dst = tmp_path / "ck"
    shutil.copytree(src, dst)
    return dst


def _no_build(monkeypatch):
    def no_build(*a, **k):
        raise AssertionError("the model was built for a run that is refused")

    monkeypatch.setattr(trainer, "build_model", no_build)


def test_fresh_run_into_a_dir_with_checkpoints_is_refused(run4, tmp_path, monkeypatch):
    """checkpoint.resume=false into a checkpoint.dir holding step 2 and 4:
    refused before the model is built, naming checkpoint.dir, its
    checkpoints and the ways out; the directory is untouched (before: the
    new run's step 2 replaced the old one with a WARNING, its step 4 the
    old step 4, and pruning by step could delete its own saves).  Then
    checkpoint.resume=true continues that run."""
    d = _copy(run4, tmp_path)
    before = tree(d)
    _no_build(monkeypatch)
    with pytest.raises(ckpt.CheckpointError) as e:
        train(load_config("L0_sanity", BASE + ["train.steps=6", f"checkpoint.dir={d}", "checkpoint.resume=false"]),
              "ddp")
    msg = str(e.value)
    assert msg.startswith(f"checkpoint.dir={str(d)!r} already holds 2 checkpoint(s) (step_00000002, step_00000004) "
                          f"and checkpoint.resume=false starts a new run there")
    assert "checkpoint.resume=true" in msg and "another checkpoint.dir" in msg and "delete" in msg
    assert tree(d) == before
    # the way out it names: resume=true continues that run (keep_last=3 keeps 2, 4 and 6), its config saved
    monkeypatch.undo()
    out = train(load_config("L0_sanity", BASE + ["train.steps=6", f"checkpoint.dir={d}"]), "ddp")
    assert out["final_step"] == 6 and steps_in(d) == [2, 4, 6]
    with open(os.path.join(step_dir(d, 6), "trainer_state.json")) as f:
        assert json.load(f)["config"]["model"] == load_config("L0_sanity", BASE).model.to_dict()


def test_resume_from_elsewhere_into_a_dir_with_checkpoints_is_refused(run4, tmp_path, monkeypatch):
    """checkpoint.resume_from names a checkpoint of another directory while
    checkpoint.dir holds checkpoints: refused before building (before: this
    run's saves pruned the other run's lower steps)."""
    d = _copy(run4, tmp_path)
    other = tmp_path / "other"
    shutil.copytree(run4, other)
    with monkeypatch.context() as mp:
        _no_build(mp)
        with pytest.raises(ckpt.CheckpointError, match=r"checkpoint.dir=.* already holds 2 checkpoint\(s\) .*and "
                                                       r"this run continues from checkpoint.resume_from=.*other.*, "
                                                       r"outside it"):
            train(load_config("L0_sanity", BASE + ["train.steps=6", f"checkpoint.dir={d}",
                                                   f"checkpoint.resume_from={step_dir(other, 2)}"]), "ddp")
    # into an empty checkpoint.dir it runs (the context-parallel test's pattern)
    fresh = tmp_path / "fresh"
    out = train(load_config("L0_sanity", BASE + ["train.steps=6", f"checkpoint.dir={fresh}",
                                                 f"checkpoint.resume_from={step_dir(other, 4)}"]), "ddp")
    assert out["final_step"] == 6 and steps_in(fresh) == [6]


def test_resume_from_an_older_checkpoint_while_a_newer_good_one_exists(run4, tmp_path, monkeypatch, caplog):
    """checkpoint.resume_from=<dir>/step_2 while <dir>/step_4 is good:
    refused before building (before: the run's step 4 replaced it).  With
    step 4 damaged the same resume runs, and its save of step 4 replaces the
    damaged one, naming the damage."""
    d = _copy(run4, tmp_path)
    args = BASE + ["train.steps=6", f"checkpoint.dir={d}", f"checkpoint.resume_from={step_dir(d, 2)}"]
    with monkeypatch.context() as mp:
        _no_build(mp)
        with pytest.raises(ckpt.CheckpointError, match=r"checkpoint.resume_from=.*step_00000002' \(step 2\) is older "
                                                       r"than checkpoint\(s\) of checkpoint.dir=.* \(step_00000004\)"):
            train(load_config("L0_sanity", args), "ddp")
    os.remove(os.path.join(step_dir(d, 4), "rng_rank0.pt"))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        out = train(load_config("L0_sanity", args), "ddp")
    assert out["final_step"] == 6
    assert f"checkpoint: replacing {step_dir(d, 4)}, a damaged earlier save of the same step" in caplog.text
    assert steps_in(d) == [2, 4, 6] and all(ckpt.verify_checkpoint(p) == [] for _, p in ckpt.list_checkpoints(str(d)))


@pytest.mark.parametrize("change,named", [
    (["model.num_hidden_layers=1"], "model.num_hidden_layers: checkpoint 2, this run 1"),
    (["model.rope_theta=10000.0"], "model.rope_theta: checkpoint 500000.0, this run 10000.0"),
    (["model.num_hidden_layers=3", "model.intermediate_size=128"],
     "model.intermediate_size: checkpoint 256, this run 128; model.num_hidden_layers: checkpoint 2, this run 3")])
def test_resume_with_another_model_config_is_refused(run4, tmp_path, change, named):
    """The run of step 2 and 4 resumed with a model.* field changed:
    CheckpointError naming the checkpoint and every field that differs
    (before: model.num_hidden_layers=1 logged "resumed from" and trained on
    layer 0 of the checkpoint; a changed rope_theta loaded silently)."""
    d = _copy(run4, tmp_path)
    with pytest.raises(ckpt.CheckpointError) as e:
        train(load_config("L0_sanity", BASE + ["train.steps=6", f"checkpoint.dir={d}", *change]), "ddp")
    msg = str(e.value)
    assert msg.startswith(f"checkpoint {step_dir(d, 4)} was saved with another model config ({named}):"), msg
    assert steps_in(d) == [2, 4]


def test_resume_with_a_longer_context_is_not_refused():
    """max_position_embeddings changes no weight (RoPE's positions are computed): a resume may extend it;
    with the same model.size on both sides, the shape fields the size replaces are not compared."""
    from recipe_common.trainer import check_model_config

    cfg = load_config("L0_sanity", ["model.max_position_embeddings=4096"])
    saved = {"model": dict(cfg.model.to_dict(), max_position_embeddings=1024)}
    check_model_config("ckpt", saved, cfg)
    saved["model"]["hidden_size"] = cfg.model.hidden_size * 2
    with pytest.raises(ckpt.CheckpointError, match=r"model.hidden_size: checkpoint"):
        check_model_config("ckpt", saved, cfg)
    sized = load_config("L0_sanity", ["model.size=1B"])
    saved = {"model": dict(sized.model.to_dict(), hidden_size=12345)}  # not read under model.size
    check_model_config("ckpt", saved, sized)
    saved["model"]["size"] = "8B"
    with pytest.raises(ckpt.CheckpointError, match=r"model.size: checkpoint '8B', this run '1B'"):
        check_model_config("ckpt", saved, sized)


@pytest.mark.parametrize("override, was_now_why", [
    ("train.adam_moments=bfloat16", ("train.adam_moments=float32", "bfloat16", "its Adam moments would be loaded into "
                                     "another precision")),
    ("train.master_weights=false", ("train.master_weights=true", "false", "FusedAdamW restores the setting with "
                                    "the checkpoint's state, so this run's would be ignored")),
])
def test_resume_with_other_optimizer_setting_is_refused_naming_it(run4, tmp_path, override, was_now_why):
    """The run of step 2 and 4 (float32 moments and fp32 masters, the defaults) resumed with
    train.adam_moments or train.master_weights changed: CheckpointError naming the recipe setting,
    before anything is loaded; nothing is written.  (FusedAdamW's own refusal of other moments names its
    constructor arguments, which a recipe user does not write; it restores master_weights from the
    checkpoint's groups, so the run would otherwise keep the masters silently.)"""
    was, now, why = was_now_why
    d = _copy(run4, tmp_path)
    with pytest.raises(ckpt.CheckpointError) as e:
        train(load_config("L0_sanity", BASE + ["train.steps=6", f"checkpoint.dir={d}", override]), "ddp")
    assert str(e.value) == (f"checkpoint {step_dir(d, 4)} was saved with {was}, this run has {now}: {why}.  "
                            f"Resume with {was}, or start a new run in another checkpoint.dir")
    assert steps_in(d) == [2, 4]


def test_optimizer_config_check_master_weights():
    """A checkpoint's train.master_weights against this run's; a config without the setting was saved
    before it existed, with masters."""
    from recipe_common.trainer import check_optimizer_config

    off = load_config("L0_sanity", ["train.master_weights=false"])
    on = load_config("L0_sanity", [])
    check_optimizer_config("ckpt", None, off)
    check_optimizer_config("ckpt", {"train": {"master_weights": False}}, off)
    check_optimizer_config("ckpt", {"train": {}}, on)
    with pytest.raises(ckpt.CheckpointError, match=r"train.master_weights=true, this run has false"):
        check_optimizer_config("ckpt", {"train": {}}, off)
    with pytest.raises(ckpt.CheckpointError, match=r"train.master_weights=false, this run has true"):
        check_optimizer_config("ckpt", {"train": {"master_weights": False}}, on)


def test_optimizer_config_check_skips_checkpoints_without_the_setting():
    from recipe_common.trainer import check_optimizer_config

    cfg = load_config("L0_sanity", ["train.adam_moments=bfloat16"])
    check_optimizer_config("ckpt", None, cfg)
    check_optimizer_config("ckpt", {"train": {}}, cfg)
    check_optimizer_config("ckpt", {"train": {"adam_moments": "bfloat16"}}, cfg)
    with pytest.raises(ckpt.CheckpointError, match=r"train.adam_moments=float32, this run has bfloat16"):
        check_optimizer_config("ckpt", {"train": {"adam_moments": "float32"}}, cfg)
