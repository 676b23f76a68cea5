"""Checkpoints of the ESM-2 recipe verify themselves
(recipes/esm2/esm2_recipe/checkpoint.py): a manifest of every file's size
and CRC-32, written last; on resume a damaged newest checkpoint (random
bytes in a shard, a missing state file, a state edited to another step) is
named and skipped for the newest good one with a WARNING, refused when named
with checkpoint.resume_from; a checkpoint at or past train.steps is
reported, not a silent exit 0; a process killed (SIGKILL) while writing
the manifest leaves the previous checkpoint loadable and the resumed run
equals the uninterrupted one exactly."""
import json
import logging
import os
import random
import subprocess
import sys
import textwrap

import pytest

from recipe_checks import ESM2_CHECKPOINT_RUN, ROOT, recipe_path  # noqa: E402
from recipe_checks import losses as _losses  # noqa: E402

RECIPE = recipe_path("esm2")

pytest.importorskip("transformers")
pytest.importorskip("pyarrow")
pytest.importorskip("hydra")

from esm2_recipe import checkpoint as ckpt  # noqa: E402
from esm2_recipe.config import load_config  # noqa: E402
from esm2_recipe.trainer import train  # noqa: E402

TINY = ESM2_CHECKPOINT_RUN + ["device=cpu"]


@pytest.fixture(scope="module")
def run4(tmp_path_factory):
    """A 6-step run stopped after step 4: checkpoints step 2 and step 4."""
    d = tmp_path_factory.mktemp("ck")
    train(load_config("L0_sanity", TINY + [f"checkpoint.dir={d}", "train.stop_at=4"]), "ddp")
    return d


def _copy(src, tmp_path):
    import shutil

    dst = tmp_path / "ck"
    shutil.copytree(src, dst)
    return dst


def _step_dir(d, s):
    return d / f"step_{s:08d}"


def test_manifest_lists_every_file(run4):
    for s in (2, 4):
        p = _step_dir(run4, s)
        m = json.loads((p / "manifest.json").read_text())
        assert m["checksum"] == "crc32 (zlib)" and m["step"] == s
        files = sorted(str(f.relative_to(p)) for f in p.rglob("*") if f.is_file() and f.name != "manifest.json")
        assert sorted(m["files"]) == files and "trainer_state.json" in files and ".metadata" in files
        for rel, e in m["files"].items():
            assert (p / rel).stat().st_size == e["size"] and len(e["crc32"]) == 8
        assert ckpt.verify_checkpoint(str(p)) == []


def _resume(d, caplog, extra=()):
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="esm2"):
        out = train(load_config("L0_sanity", TINY + [f"checkpoint.dir={d}", *extra]), "ddp")
    return out, caplog.text


def _corrupt_shard(p):
    shard = sorted(f for f in p.iterdir() if f.suffix == ".distcp")[0]
    size = shard.stat().st_size
    rng = random.Random(0)
    with open(shard, "r+b") as f:
        f.seek(size // 2)
        f.write(bytes(rng.randrange(256) for _ in range(4096)))
    assert shard.stat().st_size == size
    return shard


def test_random_bytes_in_a_shard_skip_to_the_previous_one(run4, tmp_path, caplog):
    d = _copy(run4, tmp_path)
    shard = _corrupt_shard(_step_dir(d, 4))
    out, text = _resume(d, caplog)
    assert f"checkpoint {_step_dir(d, 4)} is damaged and skipped: {shard.name} fails its CRC-32 check" in text
    assert f"resuming from {_step_dir(d, 2)} instead" in text
    assert f"resumed from {_step_dir(d, 2)} at step 2" in text
    assert out["final_step"] == 6


def test_missing_state_file_warns_and_uses_the_previous_one(run4, tmp_path, caplog):
    d = _copy(run4, tmp_path)
    os.remove(_step_dir(d, 4) / "trainer_state.json")
    out, text = _resume(d, caplog)
    assert "trainer_state.json is missing" in text and f"resuming from {_step_dir(d, 2)} instead" in text
    assert out["final_step"] == 6


def test_state_edited_to_step_999_is_damaged(run4, tmp_path, caplog):
    d = _copy(run4, tmp_path)
    st = _step_dir(d, 4) / "trainer_state.json"
    s = json.loads(st.read_text())
    s["step"] = 999
    st.write_text(json.dumps(s))
    out, text = _resume(d, caplog)
    assert "trainer_state.json has" in text and f"{_step_dir(d, 4)} is damaged and skipped" in text
    assert f"resumed from {_step_dir(d, 2)} at step 2" in text
    # the same edit where no manifest can tell: the state's step disagrees with the directory's
    os.remove(_step_dir(d, 2) / "manifest.json")
    st2 = _step_dir(d, 2) / "trainer_state.json"
    s = json.loads(st2.read_text())
    s["step"] = 999
    st2.write_text(json.dumps(s))
    assert ckpt.verify_checkpoint(str(_step_dir(d, 2))) == [
        "trainer_state.json says step 999, the directory step 2"]


def test_named_damaged_checkpoint_is_refused(run4, tmp_path):
    d = _copy(run4, tmp_path)
    _corrupt_shard(_step_dir(d, 4))
    cfg = load_config("L0_sanity", TINY + [f"checkpoint.dir={d}", f"checkpoint.resume_from={_step_dir(d, 4)}"])
    with pytest.raises(ckpt.CheckpointError, match=r"step_00000004: damaged, refused: .*CRC-32"):
        train(cfg, "ddp")


def test_all_damaged_is_an_error_not_a_fresh_start(run4, tmp_path):
    d = _copy(run4, tmp_path)
    for s in (2, 4):
        _corrupt_shard(_step_dir(d, s))
    with pytest.raises(ckpt.CheckpointError, match="no usable checkpoint"):
        train(load_config("L0_sanity", TINY + [f"checkpoint.dir={d}"]), "ddp")


def test_checkpoint_at_or_past_the_end_is_reported(run4, tmp_path):
    """A good checkpoint at step 4 resumed with train.steps=4 (or 3): nothing
    left to train is an error, not a silent exit 0."""
    d = _copy(run4, tmp_path)
    for steps, where in ((4, "the end of"), (3, "beyond")):
        cfg = load_config("L0_sanity", TINY + [f"checkpoint.dir={d}", f"train.steps={steps}"])
        with pytest.raises(ckpt.CheckpointError, match=f"at step 4, {where} train.steps={steps}"):
            train(cfg, "ddp")


_KILLER = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {recipe!r})
    from esm2_recipe import checkpoint as ckpt
    from esm2_recipe.config import load_config
    from esm2_recipe.trainer import train
    real = ckpt._write_manifest
    def write_then_die(path, step, entries):
        if step == {kill_step}:
            with open(os.path.join(path, "manifest.json.tmp"), "w") as f:
                f.write('{{"half": ')  # the manifest half written
            os.kill(os.getpid(), signal.SIGKILL)
        return real(path, step, entries)
    ckpt._write_manifest = write_then_die
    train(load_config("L0_sanity", {args!r}), "ddp")
""")


def test_sigkill_while_writing_the_manifest(tmp_path):
    """kill -9 in the middle of a save (after the shards, while the manifest
    is written) leaves step 2 the newest checkpoint; the rerun resumes from it
    and its losses equal the uninterrupted run's exactly."""
    ref, jl, d = tmp_path / "ref.jsonl", tmp_path / "m.jsonl", tmp_path / "ck"
    train(load_config("L0_sanity", TINY + [f"logging.metrics_jsonl={ref}"]), "ddp")
    args = TINY + [f"checkpoint.dir={d}", f"logging.metrics_jsonl={jl}"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", _KILLER.format(recipe=RECIPE, kill_step=4, args=args)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert r.returncode == -9, r.stderr[-3000:]
    assert [s for s, _ in ckpt.list_checkpoints(str(d))] == [2]
    assert (d / ".tmp_step_00000004" / "manifest.json.tmp").is_file()
    out = train(load_config("L0_sanity", args), "ddp")
    assert out["final_step"] == 6
    got, want = _losses(jl), _losses(ref)
    assert sorted(got) == list(range(1, 7))
    for s in range(1, 7):
        assert got[s] == want[s], (s, got, want)
    assert [s for s, _ in ckpt.list_checkpoints(str(d))] == [2, 4, 6]
    assert all(ckpt.verify_checkpoint(p) == [] for _, p in ckpt.list_checkpoints(str(d)))
