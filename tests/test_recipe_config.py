"""The ESM-2 recipe's config (recipes/esm2/esm2_recipe/config.py): Hydra's
compose API over hydra_config/, checked against the dataclass schema before
anything heavy starts.  Every bad key is reported in one ValueError, one line
per key naming the key, the value and the rule; output directories are
checked writable at the start, not after training."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "recipes", "esm2")
sys.path.insert(0, RECIPE)

pytest.importorskip("hydra")

from esm2_recipe import config as recipe_config  # noqa: E402
from esm2_recipe.config import ConfigError, load_config  # noqa: E402
from recipe_checks import check_named_configs  # noqa: E402

BAD = {  # override -> what its line must say
    "train.clip_grad_norm=-1": "train.clip_grad_norm=-1: must be a finite number > 0, or null (no clipping)",
    "train.steps=-5": "train.steps=-5: must be an integer >= 1",
    "train.warmup_steps=-3": "train.warmup_steps=-3: must be an integer >= 0",
    "data.mask_prob=1.5": "data.mask_prob=1.5: must be a finite number > 0 and <= 1",
    "device=tpu": "device='tpu': must be one of 'auto', 'cpu', 'cuda'",
    "train.grad_accum=0": "train.grad_accum=0: must be an integer >= 1",
    "train.log_interval=0": "train.log_interval=0: must be an integer >= 1",
    "train.lr=fast": "train.lr='fast': must be a finite number > 0",
    "model.hidden_size=big": "model.hidden_size='big': must be an integer >= 1",
    "precision.recipe=fp4": "precision.recipe='fp4': must be one of 'bf16', 'fp32', 'fp8_delayed'",
    "train.betas=[0.9]": "train.betas=[0.9]: must be a list of two numbers",
    "data.packed=maybe": "data.packed='maybe': must be true or false",
    "precision.bf16_layers=[a]": "precision.bf16_layers=['a']: must be a list of integers",
}


def test_every_bad_key_in_one_error():
    with pytest.raises(ValueError) as e:
        load_config("L0_sanity", list(BAD))
    msg = str(e.value)
    lines = msg.splitlines()
    assert lines[0] == f"config L0_sanity: {len(BAD)} bad keys", msg
    assert len(lines) == 1 + len(BAD), msg
    for want in BAD.values():
        assert sum(want in line for line in lines) == 1, (want, msg)
    assert isinstance(e.value, ConfigError) and len(e.value.problems) == len(BAD)


def test_unknown_keys_and_bad_overrides():
    with pytest.raises(ValueError) as e:
        load_config("L0_sanity", ["train.stepz=3", "trian.lr=1", "train.steps=4"])
    msg = str(e.value)
    assert "train.stepz=3: not a key of the train group (did you mean train.steps?)" in msg
    assert "trian.lr=1: not a key of the top level (did you mean train?)" in msg
    with pytest.raises(ValueError, match=r"\+?train.extra=1: not a key of the train group"):
        load_config("L0_sanity", ["+train.extra=1"])
    with pytest.raises(ValueError, match="must be key=value"):
        load_config("L0_sanity", ["train.steps"])
    with pytest.raises(ValueError, match=r"train=5: must be a group of keys"):
        load_config("L0_sanity", ["train=5"])


def test_cross_key_rules():
    with pytest.raises(ValueError) as e:
        load_config("L0_sanity", ["train.stop_at=100", "train.steps=10", "model.num_attention_heads=3",
                                  "data.micro_batch_tokens=100", "precision.recipe=fp8_delayed",
                                  "data.pad_to_multiple_of=8"])
    msg = str(e.value)
    assert "train.stop_at=100: must be <= train.steps=10" in msg
    assert "model.num_attention_heads=3: must divide model.hidden_size=64" in msg
    assert "data.micro_batch_tokens=100: must be >= data.max_length=128" in msg
    assert "data.pad_to_multiple_of=8: must be a multiple of 16" in msg


def test_every_named_config_is_valid_and_base_matches_the_schema():
    check_named_configs(recipe_config, {"L0_sanity", "base"})
    cfg = load_config("35M", ["train.lr=1", "checkpoint.dir=/tmp/x y/ck"])
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float) and cfg.checkpoint.dir == "/tmp/x y/ck"


def test_train_refuses_a_bad_config_before_building_anything(monkeypatch):
    """A config dict handed to train() directly (not through load_config) is
    checked too, before the model is built."""
    from esm2_recipe import trainer

    def no_build(*a, **k):
        raise AssertionError("the model was built from a bad config")

    monkeypatch.setattr(trainer, "build_model", no_build)
    cfg = load_config("L0_sanity", ["device=cpu"])
    cfg.train.steps = -5
    cfg.device = "tpu"
    with pytest.raises(ValueError) as e:
        trainer.train(cfg, "ddp")
    assert "train.steps=-5" in str(e.value) and "device='tpu'" in str(e.value)


def test_output_dirs_checked_writable_at_start(tmp_path, monkeypatch):
    """checkpoint.dir and export_dir that cannot be created are reported at
    the start (both, in one error), not when the first checkpoint is saved."""
    from esm2_recipe import trainer

    def no_build(*a, **k):
        raise AssertionError("training started with unwritable output directories")

    monkeypatch.setattr(trainer, "build_model", no_build)
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    cfg = load_config("L0_sanity", ["device=cpu", "train.steps=2", f"checkpoint.dir={blocker}/ck",
                                    f"checkpoint.export_dir={blocker}", f"logging.metrics_jsonl={blocker}/m.jsonl",
                                    f"checkpoint.resume_from={tmp_path}/nope"])
    with pytest.raises(ValueError) as e:
        trainer.train(cfg, "ddp")
    msg = str(e.value)
    assert f"checkpoint.dir='{blocker}/ck': cannot be created: {blocker} is a file" in msg
    assert f"checkpoint.export_dir='{blocker}': exists and is not a directory" in msg
    assert "logging.metrics_jsonl=" in msg and "checkpoint.resume_from=" in msg
    assert not (tmp_path / "ck").exists()
    # a writable one that does not exist yet passes, and nothing is created by the check
    recipe_config.check_paths(load_config("L0_sanity", [f"checkpoint.dir={tmp_path}/new/ck"]))
    assert not (tmp_path / "new").exists()


def test_command_line_reports_bad_keys_and_exits_2():
    r = subprocess.run([sys.executable, os.path.join(RECIPE, "train_fsdp2.py"), "--config", "L0_sanity",
                        "train.steps=-5", "device=tpu"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "train.steps=-5: must be an integer >= 1" in r.stderr and "device='tpu'" in r.stderr
    assert "Traceback" not in r.stderr
    assert recipe_config.parse_args(["--config-name=35M", "train.steps=3"]) == ("35M", ["train.steps=3"])
    assert recipe_config.parse_args(["--config", "8M"]) == ("8M", [])
    with pytest.raises(SystemExit, match="unknown option"):
        recipe_config.parse_args(["--steps", "3"])


def test_fp8_recipe_of_takes_only_the_recipes_named():
    # recipe_common.trainer.fp8_recipe_of: each recipe passes the names it runs
    from recipe_common.trainer import fp8_recipe_of

    from seqfuse.common.recipe import DelayedScaling, MXFP8BlockScaling

    cfg = load_config("L0_sanity", ["precision.recipe=fp8_delayed"])
    assert isinstance(fp8_recipe_of(cfg, ("bf16", "fp8_delayed")), DelayedScaling)
    with pytest.raises(ValueError, match=r"precision.recipe must be one of \('bf16', 'fp8_current'\), "
                                         r"got 'fp8_delayed'"):
        fp8_recipe_of(cfg, ("bf16", "fp8_current"))
    cfg.precision.recipe = "mxfp8"  # outside the ESM-2 schema's choices, inside this list
    assert isinstance(fp8_recipe_of(cfg, ("mxfp8",)), MXFP8BlockScaling)
    cfg.precision.recipe = "bf16"
    assert fp8_recipe_of(cfg, ("bf16",)) is None


def test_token_budget_rules_are_worded_for_each_recipe():
    # recipe_common.config.token_budget_checks: the padding and micro-batch rules every recipe runs, in its words
    from recipe_common.config import token_budget_checks

    c = {"data": {"pad_to_multiple_of": 8, "max_length": 100, "micro_batch_tokens": 10},
         "precision": {"recipe": "fp8_delayed", "fp4": True}}
    problems = []
    assert token_budget_checks(c, lambda *keys: True, problems, True, ("precision.recipe", "precision.fp4"),
                               "FP8 / FP4", "window") == 8
    assert problems == [
        "data.pad_to_multiple_of=8: must be a multiple of 16 (or 'auto') under precision.recipe=fp8_delayed / "
        "precision.fp4=True (FP8 / FP4 GEMMs need it)",
        "data.micro_batch_tokens=10: must be >= data.max_length=100 (padded: 104): one cropped window must fit a "
        "micro-batch"]
    c["data"].update(pad_to_multiple_of="auto", micro_batch_tokens=112)
    problems = []
    assert token_budget_checks(c, lambda *keys: True, problems, True, ("precision.recipe",), "FP8", "protein") == 16
    assert token_budget_checks(c, lambda *keys: True, problems, False, ("precision.recipe",), "FP8", "protein") == 1
    assert problems == []
    # a bad data key: no token multiple, and no rule that would read it
    assert token_budget_checks(c, lambda *keys: "data.max_length" not in keys, problems, True, ("precision.recipe",),
                               "FP8", "protein") is None
    assert problems == []


def test_trainer_entry_points_belong_to_the_trainer_module():
    # recipe_common.trainer.entry_points: train and evaluate named as the module's own (pickled by that name)
    import pickle

    from esm2_recipe import trainer

    for f, name in ((trainer.train, "train"), (trainer.evaluate, "evaluate")):
        assert (f.__module__, f.__name__, f.__qualname__) == ("esm2_recipe.trainer", name, name)
        assert pickle.loads(pickle.dumps(f)) is f
