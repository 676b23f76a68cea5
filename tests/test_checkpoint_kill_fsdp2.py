"""kill -9 of one rank in the middle of a checkpoint save under FSDP2, two
processes (issue 23: "a kill -9 during checkpoint writes on two GPUs under
FSDP2 resumes exactly").

The ESM-2 recipe (recipes/esm2/train_fsdp2.py, checkpoints from
recipes/recipe_common/checkpoint.py) runs under ``torchrun
--nproc_per_node 2``, the launcher users run, and one rank SIGKILLs itself
at a chosen moment of the step-4 save:

* ``shards``: rank 1, inside DCP's save, right after its shard file is
  written (cut to half its length, as a write torn by the kill would leave
  it), before DCP gathers the write results: rank 0 is left waiting in a
  collective;
* ``manifest``: rank 0, after every file is written and checksummed, with
  manifest.json half written: rank 1 is left waiting in the last barrier.

Then the job must end (torchrun ends the survivor: nothing hangs), no
``step_4`` checkpoint exists, and a fresh two-process run resumes from
step 2, names the interrupted save in a WARNING, and its losses equal an
uninterrupted two-process run's exactly (gloo on the CPU: the same
reductions in the same order; steps 1-2 are the killed run's, 3-6 the
resumed run's).  The gloo cases are slow-marked: five torchrun jobs of
two processes, about 2-3 minutes on two CPU cores, most of it process
start-up.  The same test on two GPUs over NCCL is cuda-marked (skipped
without two GPUs).

The fast test at the end holds the defect this work found: an interrupted
save named with checkpoint.resume_from passed verification (a
``.tmp_step_*`` directory has no step in its name to check, and one
without a manifest was taken for a checkpoint written before manifests).
"""
import logging
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from recipe_checks import ESM2_CHECKPOINT_RUN, ROOT, recipe_path, save_dying_in, torchrun  # noqa: E402
from recipe_checks import losses as _losses  # noqa: E402

RECIPE = recipe_path("esm2")

pytest.importorskip("transformers")
pytest.importorskip("pyarrow")
pytest.importorskip("hydra")

from esm2_recipe import checkpoint as ckpt  # noqa: E402

TINY = ESM2_CHECKPOINT_RUN
DEVICE = {"gloo": ["device=cpu", "distributed.backend=gloo"], "nccl": ["device=cuda", "distributed.backend=nccl"]}
KILL_STEP = 4
#: A killed job must be over well within this (torchrun ends the survivor at once).
JOB_TIMEOUT = 240

# torchrun runs this in place of train_fsdp2.py (every run of the test, so
# all run the same code): it records its pid in PID_DIR, arms the kill on
# rank KILL_RANK at the moment KILL_AT names ("none": no kill), makes the
# attention backward deterministic where DETERMINISTIC_ATTENTION=1 (the GPU
# runs: the default CUDA backward adds dQ with atomics, so two uninterrupted
# runs could differ in the last bits and "resumes exactly" would test the
# kernel, not the checkpoint), and runs the recipe.
_WRAPPER = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {recipe!r})
    import torch.distributed.checkpoint as dcp
    from esm2_recipe import checkpoint as ckpt, main_entry, train

    rank = int(os.environ["RANK"])
    with open(os.path.join(os.environ["PID_DIR"], f"pid{{rank}}"), "w") as f:
        f.write(str(os.getpid()))
    where, kill_rank = os.environ["KILL_AT"], int(os.environ["KILL_RANK"])
    if where not in ("none", "shards", "manifest"):
        raise SystemExit(f"KILL_AT={{where!r}}: this wrapper arms 'none', 'shards' or 'manifest'")
    tmp_name = ".tmp_step_{kill_step:08d}"

    if os.environ.get("DETERMINISTIC_ATTENTION") == "1":
        from seqfuse.modules.attention import DotProductAttention
        real_init = DotProductAttention.__init__

        def deterministic_init(self, *args, **kwargs):
            real_init(self, *args, **kwargs)
            self.deterministic = True

        DotProductAttention.__init__ = deterministic_init

    def die(what):
        print(f"KILL: rank {{rank}} sends itself SIGKILL {{what}}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    if rank == kill_rank and where == "shards":
        # DCP's file writer fsyncs each shard file once it is written: cut the
        # file to half (a torn write) and die there, inside dcp.save
        real_save, real_fsync = dcp.save, os.fsync

        def fsync_then_die(fd):
            real_fsync(fd)
            os.ftruncate(fd, os.fstat(fd).st_size // 2)
            die("inside dcp.save, its shard file half written")

        def save(state, *args, checkpoint_id=None, **kwargs):
            if os.path.basename(str(checkpoint_id)) == tmp_name:
                os.fsync = fsync_then_die
            return real_save(state, *args, checkpoint_id=checkpoint_id, **kwargs)

        dcp.save = save
    elif rank == kill_rank and where == "manifest":
        real_manifest = ckpt._write_manifest

        def write_then_die(path, step, entries):
            if os.path.basename(path) == tmp_name:
                with open(os.path.join(path, "manifest.json.tmp"), "w") as f:
                    f.write('{{"format": 1, "files": {{"__0_0.di')  # half written
                die("while writing manifest.json")
            return real_manifest(path, step, entries)

        ckpt._write_manifest = write_then_die
    main_entry(train, "fsdp2")
""")


def _wrapper(d):
    """The wrapper script, written into folder ``d``; its path."""
    w = d / "train_with_kill.py"
    w.write_text(_WRAPPER.format(recipe=RECIPE, kill_step=KILL_STEP))
    return str(w)


def _run_env(backend, pid_dir, kill_at="none", kill_rank=-1):
    return {"PID_DIR": str(pid_dir), "KILL_AT": kill_at, "KILL_RANK": str(kill_rank),
            "DETERMINISTIC_ATTENTION": "1" if backend == "nccl" else "0"}


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "python"), env.get("PYTHONPATH", "")])
    return env


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module", params=[
    pytest.param("gloo", marks=pytest.mark.slow),
    pytest.param("nccl", marks=[pytest.mark.cuda, pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")]),
])
def reference(request, tmp_path_factory):
    """(backend, the uninterrupted two-process run's losses by step)."""
    backend = request.param
    d = tmp_path_factory.mktemp(f"ref_{backend}")
    jl = d / "ref.jsonl"
    torchrun(_wrapper(d), ["--config", "L0_sanity", *TINY, *DEVICE[backend], f"logging.metrics_jsonl={jl}"],
             env_extra=_run_env(backend, d), timeout=JOB_TIMEOUT)
    got = _losses(jl)
    assert sorted(got) == list(range(1, 7)), got
    return backend, got


@pytest.mark.parametrize("where,kill_rank", [("shards", 1), ("manifest", 0)])
def test_sigkill_of_one_rank_mid_save_resumes_exactly(reference, where, kill_rank, tmp_path):
    backend, want = reference
    d, killed_jl, resumed_jl = tmp_path / "ck", tmp_path / "killed.jsonl", tmp_path / "resumed.jsonl"
    wrapper = _wrapper(tmp_path)
    args = ["--config", "L0_sanity", *TINY, *DEVICE[backend], f"checkpoint.dir={d}"]

    # the killed job: it must end, non-zero, with no process left behind
    env = dict(_env(), **_run_env(backend, tmp_path, where, kill_rank))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", wrapper,
           *args, f"logging.metrics_jsonl={killed_jl}"]
    t0 = time.time()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT, cwd=ROOT)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-4000:]
    assert f"KILL: rank {kill_rank} sends itself SIGKILL" in out, out[-4000:]
    assert "Signal 9 (SIGKILL)" in out or "exitcode  : -9" in out, out[-4000:]
    pids = [int((tmp_path / f"pid{rk}").read_text()) for rk in range(2)]
    assert not [p for p in pids if _alive(p)], f"ranks still running after the job ended: {pids}"
    print(f"killed job ended after {time.time() - t0:.0f} s")
    assert sorted(_losses(killed_jl)) == list(range(1, KILL_STEP + 1))

    # what the kill left: step 2 complete and verified; step 4 only an interrupted save
    assert [s for s, _ in ckpt.list_checkpoints(str(d))] == [2]
    step2 = d / "step_00000002"
    assert ckpt.verify_checkpoint(str(step2)) == []
    tmp = d / f".tmp_step_{KILL_STEP:08d}"
    names = set(os.listdir(tmp))
    assert "manifest.json" not in names
    if where == "shards":
        assert ".metadata" not in names and "trainer_state.json" not in names, names
    else:
        assert {".metadata", "trainer_state.json", "rng_rank0.pt", "rng_rank1.pt", "manifest.json.tmp"} <= names
    # named explicitly, the interrupted save is refused (an unnamed resume never lists it)
    assert any("interrupted save" in p for p in ckpt.verify_checkpoint(str(tmp)))

    # a fresh two-process run: resumes from step 2, names the interrupted save, equals the reference
    r = torchrun(wrapper, args + [f"logging.metrics_jsonl={resumed_jl}"], env_extra=_run_env(backend, tmp_path),
                 timeout=JOB_TIMEOUT)
    out = r.stdout + r.stderr
    assert f"checkpoint: {tmp} is an interrupted save (never completed): not used" in out, out[-4000:]
    assert f"resumed from {step2} at step 2" in out, out[-4000:]
    assert f"checkpoint: removing {tmp}, an interrupted save" in out, out[-4000:]
    got = _losses(resumed_jl)
    assert sorted(got) == list(range(3, 7)), got
    killed = _losses(killed_jl)
    for s in range(1, 7):
        assert (got if s >= 3 else killed)[s] == want[s], (s, killed, got, want)
    assert [s for s, _ in ckpt.list_checkpoints(str(d))] == [2, 4, 6]
    assert all(ckpt.verify_checkpoint(p) == [] for _, p in ckpt.list_checkpoints(str(d)))
    assert ckpt.interrupted_saves(str(d)) == []


# ------------------------------------------------------------ one process, fast
def test_interrupted_save_is_named_refused_and_removed_with_warnings(tmp_path, caplog):
    """A save that dies before its manifest (every other file written)
    leaves ``.tmp_step_2``: resume takes step 1 and names the leftover in a
    WARNING; named with checkpoint.resume_from it is refused (before the
    fix: no problem found, taken as good); the next save removes it with a
    WARNING, and a later save of the same step replaces step_2 with a
    WARNING naming what is wrong with it when step_2 is damaged (before:
    all three silent); a good step_2 is never replaced (refused)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    root = str(tmp_path / "ck")
    ckpt.save_checkpoint(root, 1, model, opt, {"step": 1}, keep_last=3)
    save_dying_in(ckpt, "_write_manifest", root, 2, model, opt, keep_last=3)
    tmp = os.path.join(root, ".tmp_step_00000002")
    assert {".metadata", "trainer_state.json", "rng_rank0.pt"} <= set(os.listdir(tmp))
    assert ckpt.interrupted_saves(root) == [tmp]

    problems = ckpt.verify_checkpoint(tmp)
    assert len(problems) == 1 and problems[0].startswith("is an interrupted save"), problems
    with pytest.raises(ckpt.CheckpointError, match=r"\.tmp_step_00000002: damaged, refused: is an interrupted save"):
        ckpt.find_resume_checkpoint(root, named=tmp)

    with caplog.at_level(logging.WARNING, logger="recipe.checkpoint"):
        caplog.clear()
        assert ckpt.find_resume_checkpoint(root) == os.path.join(root, "step_00000001")
        assert f"{tmp} is an interrupted save (never completed): not used, left in place" in caplog.text
        assert os.path.isdir(tmp)  # resuming leaves it
        caplog.clear()
        ckpt.save_checkpoint(root, 2, model, opt, {"step": 2}, keep_last=3)
        assert f"checkpoint: removing {tmp}, an interrupted save" in caplog.text
    assert ckpt.interrupted_saves(root) == []
    assert [s for s, _ in ckpt.list_checkpoints(root)] == [1, 2]
    assert ckpt.verify_checkpoint(os.path.join(root, "step_00000002")) == []
    # a good step_2 saved again is refused (nothing written); a damaged one (a rerun past a
    # step_2 that resume skipped) is replaced, saying so and what was wrong with it
    step2 = os.path.join(root, "step_00000002")
    with pytest.raises(ckpt.CheckpointError, match="already holds a good checkpoint of step 2"):
        ckpt.save_checkpoint(root, 2, model, opt, {"step": 2}, keep_last=3)
    assert ckpt.verify_checkpoint(step2) == [] and ckpt.interrupted_saves(root) == []
    os.remove(os.path.join(step2, "rng_rank0.pt"))
    with caplog.at_level(logging.WARNING, logger="recipe.checkpoint"):
        caplog.clear()
        ckpt.save_checkpoint(root, 2, model, opt, {"step": 2}, keep_last=3)
        assert f"checkpoint: replacing {step2}, a damaged earlier save of the same step (rng_rank0.pt is " \
               "missing)" in caplog.text
    assert ckpt.verify_checkpoint(step2) == []
    assert [s for s, _ in ckpt.list_checkpoints(root)] == [1, 2] and "step_00000002.old" not in os.listdir(root)


def test_a_save_rank_0_cannot_prepare_raises_on_every_rank(tmp_path, monkeypatch):
    """Rank 0 failing to clear an interrupted save (an NFS busy file, a
    permission) raises a RuntimeError naming the directory and the cause,
    through the same collective every rank passes (so no rank waits at a
    barrier for a rank that has left); single process here."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    root = str(tmp_path / "ck")
    os.makedirs(os.path.join(root, ".tmp_step_00000001"))

    def busy(path, *a, **k):
        raise OSError(16, "Device or resource busy", path)

    monkeypatch.setattr(ckpt.shutil, "rmtree", busy)
    with pytest.raises(RuntimeError, match=r"checkpoint: cannot prepare .*\.tmp_step_00000002 for step 2: .*busy"):
        ckpt.save_checkpoint(root, 2, model, opt, {"step": 2}, keep_last=3)
