"""Checkpoints of a training run: written atomically, the last N kept,
resumed exactly; and the final export to a Hugging Face directory.

A checkpoint is a directory ``<dir>/step_00001000`` holding:
  * a torch.distributed.checkpoint (DCP) of ``{"model", "optim"}`` from
    torch.distributed.checkpoint.state_dict.get_state_dict, so the same code
    serves one process, DDP and FSDP2 (sharded: every rank writes its
    shards).  The model state includes each module's ``_extra_state``,
    which is where seqfuse keeps FP8 scaling state (amax history, scales).
  * ``rng_rank<r>.pt``: python, numpy, torch CPU and CUDA generator states
    of each rank.
  * ``trainer_state.json`` (rank 0, written last): step, scheduler state,
    the data loader's position, the config.

Atomicity: everything is written into ``<dir>/.tmp_step_<n>``; after every
rank has finished (barrier) rank 0 renames it to ``step_<n>``.  A rename
within a directory is atomic on POSIX file systems, so a crash at any moment
leaves either no new checkpoint or a complete one, and the previous ones
untouched.  Only ``step_*`` directories with a trainer_state.json count as
checkpoints; leftover ``.tmp_*`` directories from a crash are removed at the
next save.  After the rename, all but the newest ``keep_last`` are deleted.
"""
from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil

import numpy as np
import torch
import torch.distributed as dist

log = logging.getLogger("esm2")

_STEP_RE = re.compile(r"^step_(\d+)$")
TRAINER_STATE = "trainer_state.json"


def _dist_on():
    return dist.is_available() and dist.is_initialized()


def _rank():
    return dist.get_rank() if _dist_on() else 0


def _barrier():
    if _dist_on():
        dist.barrier()


def list_checkpoints(root: str) -> list:
    """Complete checkpoints under ``root``, oldest first, as (step, path)."""
    if not root or not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        m = _STEP_RE.match(name)
        path = os.path.join(root, name)
        if m and os.path.isfile(os.path.join(path, TRAINER_STATE)):
            out.append((int(m.group(1)), path))
    return sorted(out)


def latest_checkpoint(root: str):
    c = list_checkpoints(root)
    return c[-1][1] if c else None


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
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        for name in os.listdir(root):  # leftovers of a crashed save
            if name.startswith(".tmp_step_"):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    dcp.save(_model_optim_state(model, optimizer), checkpoint_id=tmp)
    torch.save(rng_state(), os.path.join(tmp, f"rng_rank{rank}.pt"))
    _barrier()
    if rank == 0:
        with open(os.path.join(tmp, TRAINER_STATE), "w") as f:
            json.dump(trainer_state, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _finalize(tmp, final)
        for _, old in list_checkpoints(root)[:-max(1, int(keep_last))]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def _finalize(tmp: str, final: str) -> None:
    """The atomic step: the temporary directory becomes the checkpoint."""
    if os.path.exists(final):  # the same step saved again (e.g. a rerun): replace it
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


def load_checkpoint(path: str, model, optimizer) -> dict:
    """Restore model, optimizer and this rank's RNG from ``path``; returns
    the trainer state (step, scheduler, data position)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _model_optim_state(model, optimizer)
    dcp.load(state, checkpoint_id=path)
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


def full_model_state_dict(model) -> dict:
    """The whole model's state on CPU on rank 0 (gathered from FSDP2 shards;
    every rank must call this)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def export_hf(model_config, state_dict: dict, out_dir: str) -> str:
    """Write the trained model as transformers' EsmForMaskedLM (safetensors
    + config) and the ESM tokenizer files into ``out_dir``; rank 0 only."""
    from transformers import EsmTokenizer
    from transformers.initialization import no_init_weights

    from seqfuse.data import ESM2_VOCAB
    from seqfuse.hf import SeqfuseEsmForMaskedLM
    from seqfuse.hf.convert import to_hf_model

    with torch.device("cpu"), no_init_weights():
        sf = SeqfuseEsmForMaskedLM(model_config)
    own = sf.state_dict()
    sd = {k: v for k, v in state_dict.items()}
    for k, v in own.items():  # module bookkeeping missing from a gathered state stays as built
        sd.setdefault(k, v)
    dtype = sd["esm.embeddings.word_embeddings.weight"].dtype
    sf = sf.to(dtype)
    sf.load_state_dict(sd, strict=True)
    sf.tie_weights()
    hf = to_hf_model(sf.eval())
    os.makedirs(out_dir, exist_ok=True)
    hf.save_pretrained(out_dir, safe_serialization=True)
    vocab = os.path.join(out_dir, "vocab.txt")
    with open(vocab, "w") as f:
        f.write("\n".join(ESM2_VOCAB) + "\n")
    EsmTokenizer(vocab_file=vocab).save_pretrained(out_dir)
    return out_dir
