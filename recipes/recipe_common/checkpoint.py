"""Checkpoints of a training run, shared by the recipes (recipes/esm2,
recipes/llama3): written atomically, the last N kept, verified, resumed
exactly.  (The Hugging Face exports are recipe_common/export.py's;
full_model_state_dict here gathers what they write.)

A checkpoint is a directory ``<dir>/step_00001000`` holding:
  * a torch.distributed.checkpoint (DCP) of ``{"model", "optim"}`` from
    torch.distributed.checkpoint.state_dict.get_state_dict, so the same code
    serves one process, DDP and FSDP2 (sharded: every rank writes its
    shards).  The model state includes each module's ``_extra_state``,
    which is where seqfuse keeps FP8 scaling state (amax history, scales).
  * ``rng_rank<r>.pt``: python, numpy, torch CPU and CUDA generator states
    of each rank.
  * ``trainer_state.json`` (rank 0): step, scheduler state, the data
    loader's position, the config.
  * ``manifest.json`` (rank 0, written last, atomically: a temporary file
    renamed): every other file's relative path, size and CRC-32 (zlib.crc32;
    a check against damage, not tampering).  The ranks checksum the files
    between them (file i by rank i % world) and rank 0 writes the list.

Verification (verify_checkpoint, on every resume): each listed file exists
with its size and CRC-32, no file is missing from the list, and the trainer
state's step is the directory's.  find_resume_checkpoint takes the newest
checkpoint that passes; a damaged newer one is named in a WARNING that says
which older one is used instead; if none passes the run stops with an error
(a damaged directory is never silently replaced by a fresh start).  A
checkpoint the user names (checkpoint.resume_from) that fails is refused.
A checkpoint from before manifests existed is used with a warning that it
could not be verified.

Atomicity: everything is written into ``<dir>/.tmp_step_<n>``; after every
rank has finished (barrier) rank 0 renames it to ``step_<n>``.  A rename
within a directory is atomic on POSIX file systems, so a crash at any moment
leaves either no new checkpoint or a complete one, and the previous ones
untouched.  Every ``step_*`` directory counts as a checkpoint (and is
verified before use); a ``.tmp_step_*`` directory is an interrupted save
and never one: resume names each in a WARNING (left in place, not used),
verify_checkpoint refuses one named with checkpoint.resume_from, and the
next save removes them, naming each in a WARNING (its own step may need
the name again).

Nothing saved is replaced or deleted behind the user's back:
  * A save of step n where ``step_n`` already exists: a good one (it passes
    verify_checkpoint) is refused with CheckpointError before anything is
    written (two runs mixed in one directory; the trainer refuses such runs
    at the start, see recipe_common.trainer).  A damaged one is replaced,
    named in a WARNING with what is wrong: resume skipped it already (a
    rerun from the last good checkpoint writes that step again), so nothing
    usable is lost.  A ``step_n`` directory that holds none of a
    checkpoint's files (a user's folder) is refused, never replaced.
  * Pruning, after the rename: of the checkpoints with a step lower than the
    one just saved, all but the newest ``keep_last - 1`` are deleted (with
    the new one, ``keep_last`` remain).  The new checkpoint and any with a
    higher step are never pruned, and neither is a ``step_*`` directory that
    holds none of a checkpoint's files.
  * load_checkpoint refuses a checkpoint whose model keys are not the
    model's (a checkpoint of another model config: more or fewer layers, a
    delayed-scaling FP8 state the run does not keep) naming some of them,
    and reports torch's load errors (a size mismatch) as CheckpointError
    naming the checkpoint and the first error.

Under torch.distributed every collective of a save (DCP's gather of write
results, the barriers, the checksum gather) needs every rank, so a rank
killed at any moment of a save leaves the others failing or blocked in a
collective before rank 0's rename: the launcher (torchrun) ends them, and
no ``step_*`` directory is written.
"""
from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import zlib

import numpy as np
import torch
import torch.distributed as dist

log = logging.getLogger("recipe.checkpoint")

_STEP_RE = re.compile(r"^step_(\d+)$")
_TMP_PREFIX = ".tmp_step_"
TRAINER_STATE = "trainer_state.json"
MANIFEST = "manifest.json"
_CHUNK = 16 << 20


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used (named, with what is wrong)."""


def _dist_on():
    return dist.is_available() and dist.is_initialized()


def _rank():
    return dist.get_rank() if _dist_on() else 0


def _barrier():
    if _dist_on():
        dist.barrier()


def _fail_together(error, kind=RuntimeError):
    """A barrier that also carries rank 0's error: every rank raises it
    (``kind``, RuntimeError unless told) when rank 0 failed, instead of the
    others waiting at the next barrier for a rank that has left (a hang
    until the process group's timeout)."""
    if _dist_on():
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise kind(error)


def list_checkpoints(root: str) -> list:
    """Checkpoints under ``root`` (``step_*`` directories: only a finished
    save is renamed to one), oldest first, as (step, path).  Not verified."""
    if not root or not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        m = _STEP_RE.match(name)
        path = os.path.join(root, name)
        if m and os.path.isdir(path):
            out.append((int(m.group(1)), path))
    return sorted(out)


def interrupted_saves(root: str) -> list:
    """The ``.tmp_step_*`` directories under ``root``: saves that never
    finished (a crash or a kill before the rename), sorted by name."""
    if not root or not os.path.isdir(root):
        return []
    return sorted(os.path.join(root, n) for n in os.listdir(root)
                  if n.startswith(_TMP_PREFIX) and os.path.isdir(os.path.join(root, n)))


def latest_checkpoint(root: str):
    """The newest checkpoint directory under ``root`` (not verified: see
    find_resume_checkpoint)."""
    c = list_checkpoints(root)
    return c[-1][1] if c else None


def _world():
    return dist.get_world_size() if _dist_on() else 1


def _crc32(path: str) -> str:
    crc = 0
    with open(path, "rb") as f:
        while True:
            b = f.read(_CHUNK)
            if not b:
                break
            crc = zlib.crc32(b, crc)
    return f"{crc & 0xFFFFFFFF:08x}"


def _files(path: str) -> list:
    out = []
    for d, _, names in os.walk(path):
        for n in names:
            rel = os.path.relpath(os.path.join(d, n), path)
            if rel != MANIFEST and not rel.startswith(MANIFEST + "."):
                out.append(rel)
    return sorted(out)


def _gather(obj) -> list:
    """Every rank's ``obj`` on every rank (one process: [obj])."""
    if not _dist_on():
        return [obj]
    out = [None] * _world()
    dist.all_gather_object(out, obj)
    return out


def _checksum_share(path: str, files: list) -> dict:
    """Size and CRC-32 of this rank's share of ``files`` (file i by rank i % world)."""
    rank, world = _rank(), _world()
    out = {}
    for i, rel in enumerate(files):
        if i % world == rank:
            p = os.path.join(path, rel)
            out[rel] = {"size": os.path.getsize(p), "crc32": _crc32(p)}
    return out


def _write_manifest(path: str, step: int, entries: dict) -> None:
    """manifest.json, atomically: written to a temporary name, synced, renamed."""
    tmp = os.path.join(path, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"format": 1, "checksum": "crc32 (zlib)", "step": step, "files": entries}, f, indent=1,
                  sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(path, MANIFEST))


def verify_checkpoint(path: str, collective: bool = True) -> list:
    """What is wrong with checkpoint ``path`` (an empty list: nothing).
    Collective under torch.distributed (every rank checks a share of the
    files; every rank gets the same answer); ``collective=False``: this
    process checks every file alone (rank 0 inside a save)."""
    problems = []
    m = _STEP_RE.match(os.path.basename(os.path.normpath(path)))
    mpath = os.path.join(path, MANIFEST)
    manifest, entries = None, {}
    if os.path.basename(os.path.normpath(path)).startswith(_TMP_PREFIX):
        # whatever it holds, the save did not reach its rename: a rank may have
        # died before writing its shards, its RNG state or the manifest
        problems.append(f"is an interrupted save (a {_TMP_PREFIX}* directory is renamed to step_* only "
                        f"when every rank has finished writing it)")
    if not os.path.isdir(path):
        problems.append("is not a directory")
    elif os.path.isfile(mpath):
        try:
            with open(mpath) as f:
                manifest = json.load(f)
            entries = manifest["files"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            problems.append(f"{MANIFEST} is unreadable ({e})")
    mine = []
    if entries:
        names = sorted(entries)
        rank, world = (_rank(), _world()) if collective else (0, 1)
        for i, rel in enumerate(names):
            if i % world != rank:
                continue
            p = os.path.join(path, rel)
            want = entries[rel]
            if not os.path.isfile(p):
                mine.append(f"{rel} is missing")
            elif os.path.getsize(p) != want["size"]:
                mine.append(f"{rel} has {os.path.getsize(p)} bytes, the manifest says {want['size']}")
            elif _crc32(p) != want["crc32"]:
                mine.append(f"{rel} fails its CRC-32 check (contents changed since it was written)")
    for share in (_gather(mine) if collective else [mine]):
        problems.extend(share)
    if entries and os.path.isdir(path):
        extra = [f for f in _files(path) if f not in entries]
        if extra:
            problems.append(f"files not in the manifest: {extra[:5]}{' ...' if len(extra) > 5 else ''}")
    if os.path.isdir(path) and manifest is None and not problems:
        if not os.path.isfile(os.path.join(path, TRAINER_STATE)):
            problems.append(f"has no {MANIFEST} and no {TRAINER_STATE} (an incomplete save)")
    st = os.path.join(path, TRAINER_STATE)
    if not problems and os.path.isfile(st):
        try:
            with open(st) as f:
                state_step = int(json.load(f)["step"])
            if m and state_step != int(m.group(1)):
                problems.append(f"{TRAINER_STATE} says step {state_step}, the directory step {int(m.group(1))}")
            if manifest is not None and state_step != int(manifest.get("step", state_step)):
                problems.append(f"{TRAINER_STATE} says step {state_step}, {MANIFEST} step {manifest['step']}")
        except (OSError, ValueError, KeyError, TypeError) as e:
            problems.append(f"{TRAINER_STATE} is unreadable ({e})")
    return problems


def has_manifest(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST))


def holds_checkpoint_files(path: str) -> bool:
    """Whether directory ``path`` holds any of a checkpoint's own files (its
    manifest, trainer state or DCP metadata): a damaged checkpoint does, a
    user's folder that happens to be named ``step_*`` does not."""
    return any(os.path.isfile(os.path.join(path, n)) for n in (MANIFEST, TRAINER_STATE, ".metadata"))


def find_resume_checkpoint(root: str, named: str = None):
    """The checkpoint to resume from: ``named`` (checkpoint.resume_from),
    refused with CheckpointError if it fails verification; else the newest
    checkpoint under ``root`` that passes, each newer damaged one named in a
    WARNING; None when ``root`` holds none.  If ``root`` holds checkpoints
    and none passes: CheckpointError (never a silent fresh start)."""
    if named:
        problems = verify_checkpoint(named)
        if problems:
            raise CheckpointError(f"checkpoint.resume_from={named}: damaged, refused: " + "; ".join(problems))
        return named
    if _rank() == 0:
        for tmp in interrupted_saves(root):
            log.warning("checkpoint: %s is an interrupted save (never completed): not used, left in place "
                        "until the next save removes it", tmp)
    damaged = []
    for step, path in reversed(list_checkpoints(root)):
        problems = verify_checkpoint(path)
        if not problems:
            if damaged and _rank() == 0:
                log.warning("checkpoint: %d newer checkpoint(s) skipped as damaged; resuming from %s instead",
                            len(damaged), path)
            if not has_manifest(path) and _rank() == 0:
                log.warning("checkpoint %s has no %s (written before manifests): not verified", path, MANIFEST)
            return path
        damaged.append(path)
        if _rank() == 0:
            log.warning("checkpoint %s is damaged and skipped: %s", path, "; ".join(problems))
    if damaged:
        raise CheckpointError(f"no usable checkpoint in {root}: every one is damaged ({', '.join(damaged)}); "
                              f"remove them (then the run starts afresh), or resume a good one from elsewhere "
                              f"with checkpoint.resume_from=... and a checkpoint.dir of its own")
    return None


def rng_state() -> dict:
    s = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        s["cuda"] = torch.cuda.get_rng_state_all()
    return s


def set_rng_state(s: dict) -> None:
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def _model_optim_state(model, optimizer):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optim": osd}


def save_checkpoint(root: str, step: int, model, optimizer, trainer_state: dict, keep_last: int = 2) -> str:
    """Write checkpoint ``step`` atomically (see the module note); every rank calls it."""
    import torch.distributed.checkpoint as dcp

    rank = _rank()
    final = os.path.join(root, f"step_{step:08d}")
    tmp = os.path.join(root, f".tmp_step_{step:08d}")
    error = _refuse_replacing(final, step) if rank == 0 else None
    _fail_together(error, CheckpointError)
    if rank == 0:
        try:
            os.makedirs(root, exist_ok=True)
            for left in interrupted_saves(root):  # leftovers of a crashed save (tmp may be one of them)
                log.warning("checkpoint: removing %s, an interrupted save", left)
                shutil.rmtree(left)
            os.makedirs(tmp)
        except OSError as e:
            error = f"checkpoint: cannot prepare {tmp} for step {step}: {e}"
    _fail_together(error)
    dcp.save(_model_optim_state(model, optimizer), checkpoint_id=tmp)
    torch.save(rng_state(), os.path.join(tmp, f"rng_rank{rank}.pt"))
    if rank == 0:
        with open(os.path.join(tmp, TRAINER_STATE), "w") as f:
            json.dump(trainer_state, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
    _barrier()
    # every file is complete: checksum them (shared out over the ranks), then
    # the manifest, last, atomically; then the directory's rename
    entries = {}
    for share in _gather(_checksum_share(tmp, _files(tmp))):
        entries.update(share)
    error = None
    if rank == 0:
        _write_manifest(tmp, int(step), entries)
        try:
            _finalize(tmp, final)
        except CheckpointError as e:
            error = str(e)
        else:
            _prune(root, int(step), keep_last)
    _fail_together(error, CheckpointError)
    return final


def _refuse_replacing(final: str, step: int):
    """Rank 0, before a save of ``step``: why ``final`` (its directory) must
    not be replaced (a message), or None when it does not exist or is a
    damaged checkpoint (which _finalize replaces, naming it)."""
    if not os.path.lexists(final):
        return None
    if not os.path.isdir(final) or not holds_checkpoint_files(final):
        return (f"checkpoint: cannot save step {step}: {final} exists and is not a checkpoint (none of "
                f"{MANIFEST}, {TRAINER_STATE}, .metadata in it); refusing to replace it: move it out of the "
                f"checkpoint directory")
    if verify_checkpoint(final, collective=False):
        return None  # damaged: resume skipped it; _finalize replaces it, naming what is wrong
    return (f"checkpoint: cannot save step {step}: {final} already holds a good checkpoint of step {step} "
            f"(of an earlier run into the same checkpoint directory?); refusing to replace it.  Resume that "
            f"run (checkpoint.resume=true), write this one to another checkpoint.dir, or delete {final}")


def _prune(root: str, step: int, keep_last) -> None:
    """checkpoint.keep_last: the checkpoint just saved (``step``) and the
    newest ``keep_last - 1`` of those with a lower step remain; the older
    ones are deleted.  Higher steps (a newer checkpoint that resume skipped
    as damaged) and ``step_*`` directories holding no checkpoint files are
    never touched (the latter named in a WARNING, and not counted)."""
    older = []
    for s, path in list_checkpoints(root):
        if s >= step:
            continue
        if holds_checkpoint_files(path):
            older.append(path)
        else:
            log.warning("checkpoint: %s is named like a checkpoint but holds none of its files: left in place, "
                        "not counted in checkpoint.keep_last", path)
    keep = max(1, int(keep_last)) - 1
    for path in older[:len(older) - keep]:
        shutil.rmtree(path, ignore_errors=True)


def _finalize(tmp: str, final: str) -> None:
    """The atomic step: the temporary directory becomes the checkpoint.  An
    existing ``final`` was checked before the save (_refuse_replacing): only
    a damaged checkpoint gets here, and it is replaced, named in a WARNING
    with what is wrong with it (resume skipped it: nothing usable is lost)."""
    if os.path.lexists(final):
        problems = verify_checkpoint(final, collective=False) if holds_checkpoint_files(final) else [
            "holds no checkpoint files"]
        if not problems or not holds_checkpoint_files(final):  # appeared during this save
            raise CheckpointError(f"checkpoint: {final} appeared during this save of the same step "
                                  f"({'a good checkpoint' if not problems else 'not a checkpoint'}): refusing "
                                  f"to replace it; the new save is left in {tmp}")
        log.warning("checkpoint: replacing %s, a damaged earlier save of the same step (%s), with the new save",
                    final, "; ".join(problems))
        trash = final + ".old"
        shutil.rmtree(trash, ignore_errors=True)
        os.rename(final, trash)
        os.rename(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.rename(tmp, final)
    try:  # make the rename durable
        fd = os.open(os.path.dirname(final), os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    except OSError:
        pass


def _first_error_line(e: BaseException) -> str:
    """``Type: first line`` of the error under ``e``: for torch's
    CheckpointException (a BaseException carrying each rank's exception and
    traceback) the first failing rank's exception, not the multi-kB
    traceback text its str() is."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank = sorted(failures)[0]
        inner = failures[rank]
        inner = inner[0] if isinstance(inner, tuple) and inner else inner
        if isinstance(inner, BaseException):
            where = f" (rank {rank}, one of {len(failures)} failing)" if len(failures) > 1 else (
                f" (rank {rank})" if _dist_on() else "")
            return _first_error_line(inner) + where
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _names(keys, n=5) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:n]) + (f" ... ({len(keys)} in all)" if len(keys) > n else "")


def _covered(key: str, keys: set) -> bool:
    """``key`` is one of ``keys`` or lies under one (DCP flattens a nested
    value's entries to ``<key>.<sub>``)."""
    parts = key.split(".")
    return any(".".join(parts[:i]) in keys for i in range(len(parts), 0, -1))


def check_model_keys(path: str, model_state: dict) -> None:
    """CheckpointError unless the model entries saved in checkpoint ``path``
    (its DCP metadata's ``model.*`` keys) are the model's state keys
    (``model_state``): a checkpoint key the model lacks would be dropped
    silently (a layer more, an FP8 scaling state), one the checkpoint lacks
    would stay at its initial value.  Collective under torch.distributed:
    the model's keys are those of every rank together (expert parallelism
    names each rank's experts by their global index, so one rank holds a
    part of the checkpoint's expert keys), and every rank gets the same
    answer."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        saved_meta = FileSystemReader(path).read_metadata().state_dict_metadata
    except Exception as e:  # (an unreadable .metadata)
        raise CheckpointError(f"checkpoint {path}: cannot read its metadata: {_first_error_line(e)}") from e
    saved = {k[len("model."):] for k in saved_meta if k.startswith("model.")}
    have = set()
    for keys in _gather(sorted(model_state)):
        have.update(keys)
    extra = {k for k in saved if not _covered(k, have)}
    missing = {k for k in have if k not in saved and not any(s.startswith(k + ".") for s in saved)}
    if not extra and not missing:
        return
    parts = []
    if extra:
        parts.append(f"it holds {len(extra)} model key(s) the model lacks: {_names(extra)}")
    if missing:
        parts.append(f"it lacks {len(missing)} key(s) of the model: {_names(missing)}")
    hint = ""
    if all(".fp8_state." in k for k in extra | missing):
        hint = (" (FP8 delayed-scaling state: the checkpoint and this run differ in precision.recipe or in "
                "which layers run FP8; resume with the checkpoint's precision settings)")
    raise CheckpointError(f"checkpoint {path} is not of this model: " + "; ".join(parts) + hint +
                          ".  It was saved with another model config (compare the checkpoint's "
                          f"{TRAINER_STATE} 'config'); resume it with the same model settings, or start a new run "
                          f"in another checkpoint.dir")


def load_checkpoint(path: str, model, optimizer) -> dict:
    """Restore model, optimizer and this rank's RNG from ``path``; returns
    the trainer state (step, scheduler, data position).  Verify first
    (find_resume_checkpoint does).  CheckpointError, naming ``path``, when
    its model keys are not the model's (check_model_keys) or torch's load
    fails (a size mismatch: the first error, naming the key)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _model_optim_state(model, optimizer)
    check_model_keys(path, state["model"])
    try:
        dcp.load(state, checkpoint_id=path)
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        raise CheckpointError(f"checkpoint {path}: loading failed: {_first_error_line(e)}") from e
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rank = _rank()
    rng_file = os.path.join(path, f"rng_rank{rank}.pt")
    if os.path.isfile(rng_file):
        set_rng_state(torch.load(rng_file, weights_only=False))
    else:
        log.warning("checkpoint %s has no RNG state for rank %d (saved with fewer ranks); RNG not restored",
                    path, rank)
    with open(os.path.join(path, TRAINER_STATE)) as f:
        return json.load(f)


def read_trainer_state(path: str) -> dict:
    with open(os.path.join(path, TRAINER_STATE)) as f:
        return json.load(f)


def full_model_state_dict(model) -> dict:
    """The whole model's state on CPU on rank 0 (gathered from FSDP2 shards;
    every rank must call this)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
