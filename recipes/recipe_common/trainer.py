"""The training loop and its pieces, shared by the recipes (recipes/esm2
masked LM, recipes/llama3 causal LM on DNA).

``train(cfg, strategy, spec)`` runs one process of a job: one process alone,
or one of many under torchrun (the process group is initialised from
torchrun's environment).  ``strategy`` picks the data-parallel wrapping:
  * "fsdp2": torch.distributed.fsdp.fully_shard on every TransformerLayer,
    then on the whole model (recipe_common.fsdp.shard_model, with
    distributed.reshard_after_forward, .reduce_dtype, .prefetch and
    .layers_per_unit).
  * "ddp": torch DistributedDataParallel (nothing wrapped with one process).

``spec`` is what is specific to the model: the recipe's trainer module
(esm2_recipe.trainer, llama3_recipe.trainer), read attribute by attribute
when the loop needs it (so a test that replaces ``spec.build_model`` is
heard).  It provides: ``log`` (its logger), ``KEEP_PG_ENV``,
``validate_config`` / ``check_paths``, ``check_run(cfg, device)`` (refusals
that depend on the device, before anything is built), ``fp8_recipe(cfg)``,
``build_model(cfg, device, dtype) -> (model, model_config)``,
``model_layers(model)``, ``describe(...)`` (the first log line),
``apply_layer_precision(model, cfg, recipe, rank)`` -> the layer indices that
run without FP8, ``build_optimizer(model, cfg)``, ``build_loaders(cfg, rank,
world, recipe, pin_memory)``, ``DATA_NOUN``, ``forward_loss(model, batch)``,
``step_flops(host_batch, model_config)`` and ``export(model, model_config,
out_dir, cfg, rank)``.  Optional: ``wrap_model`` (same arguments as this
module's; the recipe's own data-parallel wrapping, e.g. Mixtral's expert
parallelism) and ``clip_grad_norm(model, params, max_norm)``; without them
this module's wrap_model and seqfuse.optim.clip_grad_norm_ run.  The
module publishes its ``evaluate`` and ``train`` with ``entry_points(__name__)``.

A step: ``grad_accum`` micro-batches (token-budget batches, packed THD or
padded BSHD), forward under seqfuse's autocast with the configured FP8
recipe (none for bf16/fp32; layers listed by apply_layer_precision run with
autocast off inside it), loss / accum backward (gradient sync only on the
last micro-batch), clip, FusedAdamW, LR schedule (linear warm-up, then
cosine / linear / constant decay).  Logs every ``log_interval`` steps (loss,
LR, tokens/s, unpadded tokens/s, step time, MFU and peak memory on CUDA);
validation every ``eval_interval``; a bad label that seqfuse's CUDA loss
recorded without stopping the host (its deferred label check) is raised at
the latest at each logging step, after each validation and before each
checkpoint (seqfuse.check_pending_errors on every rank together; in the
steps between a bad label and its error the NaN gradients of its rows have
already reached the weights, so no checkpoint is written from them);
checkpoints every
``checkpoint.interval`` and at the end (a run never writes among another
run's checkpoints: check_checkpoint_dir refuses it before anything is
built; a resume refuses a checkpoint of another model config:
check_model_config); HF export at the end; an Nsight
Systems capture range (``profiler``: cudaProfilerStart before
profiler.start_step, cudaProfilerStop after profiler.end_step, an NVTX range
per step and per phase, rank 0 only).  Returns a summary dict (losses,
throughput, paths) for tests and benchmarks.
"""
from __future__ import annotations

import contextlib
import math
import os
import random
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from . import checkpoint as ckpt
from .metrics import H200_BF16_DATASHEET_TFLOPS, H200_BF16_MEASURED_TFLOPS, MetricLogger

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---------------------------------------------------------------- setup
def init_distributed(cfg):
    """(rank, world_size, local_rank, device) from torchrun's environment."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    want_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device=cuda but torch sees no CUDA device")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if want_cuda else torch.device("cpu")
    if want_cuda:
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        backend = cfg.distributed.backend
        if backend == "auto":
            backend = "nccl" if want_cuda else "gloo"
        dist.init_process_group(backend=backend, device_id=device if want_cuda else None)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    return rank, world, local_rank, device


def seed_everything(seed: int, rank: int):
    s = int(seed) + 1000003 * rank  # different per rank (dropout), same per run
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.manual_seed(s)


def resolve_data_path(path: str, prepare_hint: str = "") -> str:
    """``path`` as given (absolute or under the current directory), else
    under the repo root; FileNotFoundError naming data.path otherwise."""
    if os.path.isabs(path) or os.path.isdir(path):
        return path
    alt = os.path.join(REPO_ROOT, path)
    if os.path.isdir(alt):
        return alt
    hint = f" ({prepare_hint})" if prepare_hint and path.rstrip("/").endswith("full") else ""
    raise FileNotFoundError(f"data.path {path!r} is neither under the current directory nor the repo root{hint}")


def load_splits(path):
    """(training sequences, validation sequences) of the prepared data folder
    ``path`` (its train.parquet and validation.parquet)."""
    from seqfuse.data import load_sequences

    _, train_seqs = load_sequences(os.path.join(path, "train.parquet"))
    _, val_seqs = load_sequences(os.path.join(path, "validation.parquet"))
    return train_seqs, val_seqs


def train_val_loaders(build, tok, train_seqs, val_seqs, cfg, pad, rank, world, pin_memory=False, train_extra=None,
                      **extra):
    """A recipe's (training loader, validation loader, training sequences,
    validation sequences) from seqfuse.data's ``build`` (build_mlm_loader
    or build_causal_lm_loader) with tokenizer ``tok``: both take the data
    group's token budget, max_length and layout (packed), the token
    multiple ``pad``, train.seed, this rank's place among ``world`` ranks,
    ``pin_memory`` and ``extra`` (the builder's own arguments, e.g.
    mask_prob), and ``train_extra`` the training loader's alone (e.g. a
    cap on its batches' sequences); the training loader reads the sequences encoded once
    (TokenizedSequences) with the data group's workers, bucketing and rank
    balancing, the validation loader runs in evaluation mode (file order,
    crops from the start, one fixed epoch)."""
    from seqfuse.data import TokenizedSequences

    # page-locked batches on CUDA: their non_blocking copies then run behind the
    # GPU's queue instead of making the host wait for it to drain every step
    common = dict(max_tokens=int(cfg.data.micro_batch_tokens), max_length=int(cfg.data.max_length),
                  packed=bool(cfg.data.packed), pad_to_multiple_of=pad, seed=int(cfg.train.seed), rank=rank,
                  world_size=world, pin_memory=pin_memory, **extra)
    train = build(TokenizedSequences(train_seqs, tok), tok, num_workers=int(cfg.data.num_workers),
                  bucket_size=cfg.data.bucket_size, balance_ranks=bool(cfg.data.get("balance_ranks", False)), **common,
                  **(train_extra or {}))
    val = build(val_seqs, tok, evaluation=True, **common)
    return train, val, len(train_seqs), len(val_seqs)


def fp8_recipe_named(name, cfg):
    """The seqfuse recipe object of precision.recipe ``name`` (None: no FP8)."""
    from seqfuse.common.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format, MXFP8BlockScaling

    fmt = {"hybrid": Format.HYBRID, "e4m3": Format.E4M3}[str(cfg.precision.fp8_format).lower()]
    if name == "fp8_delayed":
        return DelayedScaling(fp8_format=fmt, amax_history_len=int(cfg.precision.amax_history_len),
                              amax_compute_algo=cfg.precision.amax_compute_algo)
    if name == "fp8_current":
        return Float8CurrentScaling(fp8_format=fmt)
    if name == "fp8_block":
        return Float8BlockScaling()  # E4M3 1x128 / 128x128, as Transformer Engine
    if name == "mxfp8":
        return MXFP8BlockScaling()
    if name in ("bf16", "fp32"):
        return None
    raise ValueError(f"precision.recipe: no recipe named {name!r}")


def fp8_recipe_of(cfg, recipes):
    """The seqfuse recipe object of cfg.precision.recipe (None: no FP8),
    which must be one of ``recipes`` (the names the calling recipe runs):
    ValueError naming precision.recipe and the list otherwise."""
    name = cfg.precision.recipe
    if name not in recipes:
        raise ValueError(f"precision.recipe must be one of {recipes}, got {name!r}")
    return fp8_recipe_named(name, cfg)


def build_model_on(model_class, model_config, cfg, device, dtype):
    """A recipe's model: ``model_class(model_config)`` built on ``device``,
    cast to ``dtype``, recomputing its layers' activations in the backward
    when train.activation_checkpointing (FP8-aware:
    seqfuse.pytorch.checkpoint)."""
    with torch.device(device):
        model = model_class(model_config)
    model = model.to(dtype)
    if cfg.train.get("activation_checkpointing", False):
        model.set_activation_checkpointing(True)
    return model


def param_dtype(cfg, device):
    p = cfg.precision.param_dtype
    if p == "auto":
        p = "bf16" if device.type == "cuda" else "fp32"
    if cfg.precision.recipe == "fp32":
        p = "fp32"
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[p]


def run_without_fp8(layer):
    """Make ``layer``'s forward (and so its backward) run with seqfuse's
    autocast off, inside a model-wide FP8 region."""
    from seqfuse.pytorch import autocast

    forward = layer.forward

    def high_precision_forward(*a, _forward=forward, **k):
        with autocast(enabled=False):
            return _forward(*a, **k)

    layer.forward = high_precision_forward


def prepare_fp8_state(model, layers, recipe, bf16_layers):
    """Make the delayed-scaling state (amax history, scales) of every module
    that runs FP8 now, at its initial values, so a resumed run finds a place
    for each saved state when the checkpoint is loaded
    (seqfuse.quantization.init_fp8_state; no forward runs).  The layers in
    ``bf16_layers`` (indices into ``layers``) run without FP8 and get none.
    Returns the number of states."""
    from seqfuse.common.recipe import DelayedScaling
    from seqfuse.quantization import init_fp8_state

    if not isinstance(recipe, DelayedScaling):
        return 0
    skip = {id(m) for i in bf16_layers for m in layers[i].modules()}
    return sum(init_fp8_state(m, recipe) for m in model.modules()
               if id(m) not in skip and getattr(type(m), "fp8_num_gemms", 0))


def wrap_model(model, layers, strategy, world, device, cfg, log):
    if strategy == "fsdp2":
        if world == 1 and not dist.is_initialized():
            log.info("FSDP2: one process without a process group: model not sharded")
            return model
        from .fsdp import shard_model

        d = cfg.distributed
        return shard_model(model, layers, reshard_after_forward=bool(d.reshard_after_forward),
                           reduce_dtype=str(d.get("reduce_dtype", "float32")), prefetch=int(d.get("prefetch", 0)),
                           layers_per_unit=int(d.get("layers_per_unit", 1)))
    if strategy == "ddp":
        if world == 1:
            return model
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    raise ValueError(f"strategy must be 'fsdp2' or 'ddp', got {strategy!r}")


def build_optimizer(model, cfg):
    """FusedAdamW (fp32 master weights unless train.master_weights is false,
    moments in train.adam_moments) with decay on matrices only.  Under FSDP2
    the parameters are DTensor shards: FusedAdamW updates the local shards
    and keeps its state (moments, fp32 masters) sharded like them."""
    from seqfuse.optim import FusedAdamW

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.dim() < 2 or name.endswith("bias") else decay).append(p)
    groups = [{"params": decay, "weight_decay": float(cfg.train.weight_decay)},
              {"params": no_decay, "weight_decay": 0.0}]
    t = cfg.train
    moments = getattr(torch, t.get("adam_moments", "float32"))
    kw = dict(lr=float(t.lr), betas=tuple(float(b) for b in t.betas), eps=float(t.eps), exp_avg_dtype=moments,
              exp_avg_sq_dtype=moments, master_weights=bool(t.get("master_weights", True)))
    return FusedAdamW(groups, **kw)


def lr_lambda(cfg):
    """Multiplier of the base LR at optimizer step s (0-based): linear
    warm-up over warmup_steps, then decay to min_lr_ratio at train.steps."""
    t = cfg.train
    warm, total, floor, kind = int(t.warmup_steps), int(t.steps), float(t.min_lr_ratio), t.decay
    if kind not in ("cosine", "linear", "constant"):
        raise ValueError(f"train.decay must be cosine, linear or constant, got {kind!r}")

    def f(s):
        if warm > 0 and s < warm:
            return (s + 1) / warm
        if kind == "constant" or total <= warm:
            return 1.0
        frac = min(1.0, (s - warm) / max(1, total - warm))
        if kind == "linear":
            return 1.0 - (1.0 - floor) * frac
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * frac))

    return f


def endless(loader):
    while True:
        yield from loader


def to_device(batch, device):
    return {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}


@contextlib.contextmanager
def no_grad_sync(model, strategy, active):
    """Skip the gradient all-reduce / reduce-scatter of a non-final micro-batch."""
    if not active:
        yield
        return
    if strategy == "ddp" and hasattr(model, "no_sync"):
        with model.no_sync():
            yield
    elif strategy == "fsdp2" and hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def labels_checked_together(device, wait):
    """seqfuse.check_pending_errors on every rank at once: the rank whose
    loss kernels recorded a bad label raises that ValueError and every other
    rank a RuntimeError naming it, instead of waiting in the next collective
    for a rank that has left (a hang until the process group's timeout)."""
    from seqfuse import check_pending_errors

    error = None
    try:
        check_pending_errors(wait=wait)
    except ValueError as e:
        error = e
    bad = [0] if error is not None else []
    if dist.is_initialized():
        flags = torch.zeros(dist.get_world_size(), device=device)
        flags[dist.get_rank()] = float(error is not None)
        dist.all_reduce(flags)
        bad = [i for i, f in enumerate(flags.tolist()) if f]
    if error is not None:
        raise error
    if bad:
        raise RuntimeError(f"a bad label was recorded on rank {', '.join(map(str, bad))} (its ValueError names it)")


def all_reduce_sum(values, device):
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


@torch.no_grad()
def evaluate(model, val_loader, cfg, recipe, device, forward_loss):
    """Validation loss (mean over the predicted tokens of every rank).  It
    never changes training state: under delayed scaling the validation
    forwards record amaxes and their autocast exits run the scale update
    (rolling the amax history), so the scaling state is snapshotted before
    and restored after -- a run that validates trains exactly as one that
    does not (tests/test_recipe_esm2.py)."""
    from seqfuse.pytorch import autocast
    from seqfuse.quantization import restore_scaling, snapshot_scaling

    was = model.training
    snapshot = snapshot_scaling(model) if recipe is not None else []
    try:
        model.eval()
        n = len(val_loader)
        if cfg.data.val_batches:
            n = min(n, int(cfg.data.val_batches))
        total = torch.zeros(2, dtype=torch.float64, device=device)
        for i, batch in enumerate(val_loader):
            if i >= n:
                break
            batch = to_device(batch, device)
            with autocast(enabled=recipe is not None, recipe=recipe):
                loss = forward_loss(model, batch)
            k = (batch["labels"] != -100).sum()
            total[0] += loss.double() * k
            total[1] += k
        if dist.is_initialized():
            dist.all_reduce(total)
        value = (total[0] / total[1].clamp(min=1)).item()  # synchronizes: every loss kernel has run
        if device.type == "cuda":
            labels_checked_together(device, wait=False)
        return value
    finally:
        restore_scaling(snapshot)
        model.train(was)


class CaptureRange:
    """Nsight Systems capture range on rank 0 (``nsys profile
    --capture-range=cudaProfilerApi --capture-range-end=stop``):
    cudaProfilerStart before step ``profiler.start_step``, cudaProfilerStop
    after ``profiler.end_step`` (1-based optimizer steps), an NVTX range per
    step and per phase (forward, backward, optimizer) inside.  Off unless
    ``profiler.enabled``; asked for without CUDA, it says so once and stays
    off (there is nothing for Nsight to capture)."""

    def __init__(self, cfg, rank, device, log):
        p = cfg.get("profiler") or {}
        self.on = bool(p.get("enabled")) and rank == 0 and device.type == "cuda"
        self.start, self.end = int(p.get("start_step", 0)), int(p.get("end_step", 0))
        self.active = False
        if p.get("enabled") and rank == 0 and device.type != "cuda":
            log.warning("profiler: enabled, but the run is on %s: no CUDA capture range (Nsight Systems "
                        "profiles CUDA runs)", device.type)
        elif self.on:
            log.info("profiler: Nsight Systems capture range steps %d..%d (cudaProfilerStart/Stop, NVTX per "
                     "step; run under nsys profile --capture-range=cudaProfilerApi)", self.start, self.end)

    def begin_step(self, step):  # step: the 1-based step about to run
        if not self.on:
            return
        if step == self.start and not self.active:
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStart()
            self.active = True
        if self.active:
            torch.cuda.nvtx.range_push(f"step {step}")

    @contextlib.contextmanager
    def phase(self, name):
        if self.active:
            torch.cuda.nvtx.range_push(name)
            try:
                yield
            finally:
                torch.cuda.nvtx.range_pop()
        else:
            yield

    def end_step(self, step):
        if not self.active:
            return
        torch.cuda.nvtx.range_pop()
        if step >= self.end:
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
            self.active = False
            self.on = False


# ---------------------------------------------------------------- the run
def train(cfg, strategy: str, spec) -> dict:
    """One training run (see the module note); returns its history.  The
    process group is torn down after the run's models are gone
    (seqfuse.distributed.end_process_group), unless ``spec.KEEP_PG_ENV`` is 1.

    Before anything is built the config is checked against the schema
    (spec.validate_config: every bad key in one ConfigError) and the output
    directories are checked writable (spec.check_paths)."""
    cfg = spec.validate_config(cfg)
    spec.check_paths(cfg)
    result = _run(cfg, strategy, spec)
    if os.environ.get(spec.KEEP_PG_ENV) != "1":  # (a no-op without a group)
        from seqfuse.distributed import end_process_group

        end_process_group()
    return result


def entry_points(spec_name: str):
    """The two functions a recipe's trainer module publishes, with that
    module (``spec_name``, its ``__name__``) as the spec, in this order:
    evaluate(model, val_loader, cfg, recipe, device) -> the validation loss
    (this module's evaluate with the spec's forward_loss: the FP8 scaling
    state is restored after); train(cfg, strategy="fsdp2") -> the run's
    history (this module's train: the config is checked against the schema,
    and the spec's check_run refuses what the device cannot run, before
    anything is built).  The spec is looked up when they are called, so a
    test that replaces one of its attributes is heard.  They carry the
    trainer module's name (``llama3_recipe.trainer.train``), so they pickle
    as its attributes."""

    def spec():
        return sys.modules[spec_name]

    def evaluate_spec(model, val_loader, cfg, recipe, device):
        return evaluate(model, val_loader, cfg, recipe, device, spec().forward_loss)

    def train_spec(cfg, strategy: str = "fsdp2") -> dict:
        return train(cfg, strategy, spec())

    for f, name, doc in ((evaluate_spec, "evaluate", "Validation loss (recipe_common.trainer.evaluate with this "
                          "module's forward_loss: the FP8 scaling state is restored after)."),
                         (train_spec, "train", "One training run with this module as the spec of "
                          "recipe_common.trainer.train; returns its history.")):
        f.__module__, f.__name__, f.__qualname__, f.__doc__ = spec_name, name, name, doc
    return evaluate_spec, train_spec


def _same_dir(a, b):
    return os.path.realpath(os.path.normpath(a)) == os.path.realpath(os.path.normpath(b))


def check_checkpoint_dir(cfg):
    """Refuse, before anything is built, a run that would write its
    checkpoints among another run's in checkpoint.dir (its saves would
    replace theirs, pruning by step would delete theirs or its own, and a
    later resume would take whichever step is newest: two runs mixed).
    CheckpointError naming checkpoint.dir and what to do, when it holds
    ``step_*`` checkpoints and
      * the run starts fresh (checkpoint.resume=false), or
      * the run resumes from checkpoint.resume_from in another directory, or
      * checkpoint.resume_from is one of its checkpoints and a newer good
        one is there too (a damaged newer one is replaced when the run
        reaches its step, named in a WARNING).
    There is no overwrite option: delete the old checkpoints (or move them)
    to reuse the directory.  Collective under torch.distributed."""
    root = cfg.checkpoint.dir
    if not root:
        return
    have = ckpt.list_checkpoints(root)
    if not have:
        return
    named = cfg.checkpoint.get("resume_from")
    names = ", ".join(os.path.basename(p) for _, p in have[-3:]) + (" ..." if len(have) > 3 else "")
    if not named and not cfg.checkpoint.resume:
        raise ckpt.CheckpointError(
            f"checkpoint.dir={root!r} already holds {len(have)} checkpoint(s) ({names}) and "
            f"checkpoint.resume=false starts a new run there: its checkpoints would replace or prune them and be "
            f"mixed with them on a later resume.  Continue that run with checkpoint.resume=true, write the new "
            f"one to another checkpoint.dir, or delete the old checkpoints")
    if not named:
        return
    if not _same_dir(os.path.dirname(os.path.normpath(named)), root):
        raise ckpt.CheckpointError(
            f"checkpoint.dir={root!r} already holds {len(have)} checkpoint(s) ({names}), and this run continues "
            f"from checkpoint.resume_from={named!r}, outside it: its checkpoints would replace or prune them and "
            f"be mixed with them on a later resume.  Give this run a checkpoint.dir of its own (or an empty one), "
            f"or delete the old checkpoints")
    try:
        from_step = int(ckpt.read_trainer_state(named)["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return  # find_resume_checkpoint refuses it, saying why
    newer = [(s, p) for s, p in have if s > from_step]
    good = [p for s, p in newer if not ckpt.verify_checkpoint(p)]
    if good:
        raise ckpt.CheckpointError(
            f"checkpoint.resume_from={named!r} (step {from_step}) is older than checkpoint(s) of checkpoint.dir="
            f"{root!r} ({', '.join(os.path.basename(p) for p in good)}): this run's saves would replace them and "
            f"a later resume would mix the two runs.  Give this run another checkpoint.dir, or delete the newer "
            f"checkpoints")


#: model fields a resume may change: no weight's shape or value depends on them (RoPE's positions are
#: computed, so a longer context continues the same weights)
_NO_WEIGHT_FIELDS = ("max_position_embeddings",)
#: the shape fields a published ``model.size`` replaces (the recipes' model_config reads them only without one)
_SIZE_FIELDS = frozenset({"hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                          "intermediate_size", "tie_word_embeddings", "rope_theta", "num_local_experts",
                          "num_experts_per_tok", "max_position_embeddings"})


def _saved_section(saved_config, name):
    """The ``name`` section (a dict) of a checkpoint's recorded config, or None where there is none."""
    section = saved_config.get(name) if isinstance(saved_config, dict) else None
    return section if isinstance(section, dict) else None


def check_model_config(path, saved_config, cfg):
    """CheckpointError naming every model.* field in which checkpoint
    ``path``'s config (its trainer state's "config", ``saved_config``)
    differs from this run's: resuming it would load a part of the checkpoint
    into another model, or the same weights into another computation
    (rope_theta).  Not compared: max_position_embeddings (no weight depends
    on it), and the shape fields a published model.size replaces when both
    name the same size.  A checkpoint without a recorded config is not
    compared (and load_checkpoint still compares its keys with the model's)."""
    saved = _saved_section(saved_config, "model")
    if saved is None:
        return
    now = cfg.model.to_dict() if hasattr(cfg.model, "to_dict") else dict(cfg.model)
    skip = set(_NO_WEIGHT_FIELDS)
    if saved.get("size") and saved.get("size") == now.get("size"):
        skip |= _SIZE_FIELDS  # a published shape: these fields are not read
    diff = [f"model.{k}: checkpoint {saved[k]!r}, this run {now[k]!r}" for k in sorted(set(saved) & set(now))
            if k not in skip and saved[k] != now[k]]
    if diff:
        raise ckpt.CheckpointError(
            f"checkpoint {path} was saved with another model config ({'; '.join(diff)}): resuming it would load "
            f"it into a different model.  Resume with the checkpoint's model settings, or start a new run in "
            f"another checkpoint.dir")


def check_optimizer_config(path, saved_config, cfg):
    """CheckpointError where checkpoint ``path`` was saved with another
    train.adam_moments or train.master_weights than this run's, naming the
    recipe setting (a recipe user sets them here, not in the optimizer's
    arguments): FusedAdamW refuses to load moments into another dtype (their
    precision would change), and it restores master_weights from the saved
    groups, so a run resumed with another setting would silently keep the
    checkpoint's.  A checkpoint without a recorded config is not compared;
    one whose config lacks adam_moments is not compared on it, and one
    without master_weights was saved before the setting existed, with
    masters (true)."""
    train = _saved_section(saved_config, "train")
    if train is None:
        return
    was = train.get("adam_moments")
    now = cfg.train.get("adam_moments", "float32")
    if was is not None and was != now:
        raise ckpt.CheckpointError(
            f"checkpoint {path} was saved with train.adam_moments={was}, this run has {now}: its Adam moments "
            f"would be loaded into another precision.  Resume with train.adam_moments={was}, or start a new run "
            f"in another checkpoint.dir")
    was, now = bool(train.get("master_weights", True)), bool(cfg.train.get("master_weights", True))
    if was != now:
        was, now = str(was).lower(), str(now).lower()  # (as the config writes them)
        raise ckpt.CheckpointError(
            f"checkpoint {path} was saved with train.master_weights={was}, this run has {now}: "
            f"FusedAdamW restores the setting with the checkpoint's state, so this run's would be ignored.  "
            f"Resume with train.master_weights={was}, or start a new run in another checkpoint.dir")


def _resume(cfg, spec, model, optimizer, scheduler, train_loader, rank):
    """The step to continue from (0: a fresh run), everything restored.
    (check_checkpoint_dir, at the start of the run, has refused a fresh run
    into a directory holding checkpoints.)"""
    root = cfg.checkpoint.dir
    named = cfg.checkpoint.get("resume_from")
    total_steps = int(cfg.train.steps)
    if not (named or (root and cfg.checkpoint.resume)):
        return 0
    # verified (manifest sizes and CRC-32s); a damaged newest one is skipped with a warning,
    # a damaged named one refused
    path = ckpt.find_resume_checkpoint(root, named)
    if not path:
        return 0
    saved = ckpt.read_trainer_state(path)
    saved_step = int(saved["step"])
    check_model_config(path, saved.get("config"), cfg)
    check_optimizer_config(path, saved.get("config"), cfg)
    if saved_step >= total_steps:
        where = "the end of" if saved_step == total_steps else "beyond"
        raise ckpt.CheckpointError(
            f"checkpoint {path} is at step {saved_step}, {where} train.steps={total_steps}: there is "
            f"nothing left to train.  Raise train.steps to continue this run, or start a new one "
            f"(checkpoint.resume=false or another checkpoint.dir)")
    state = ckpt.load_checkpoint(path, model, optimizer)
    scheduler.load_state_dict(state["scheduler"])
    # The optimizer's saved lr is the old schedule's; this run's schedule
    # (train.steps may have grown) sets the lr of the next step.
    for g, base in zip(optimizer.param_groups, scheduler.base_lrs):
        g["lr"] = base * lr_lambda(cfg)(scheduler.last_epoch)
    train_loader.load_state_dict(state["data"])
    if rank == 0:
        spec.log.info("resumed from %s at step %d (data epoch %d)", path, int(state["step"]),
                      state["data"]["epoch"])
    return int(state["step"])


def _run(cfg, strategy, spec):
    from seqfuse.optim import clip_grad_norm_
    from seqfuse.pytorch import autocast

    log = spec.log
    rank, world, _, device = init_distributed(cfg)
    spec.check_run(cfg, device)
    check_checkpoint_dir(cfg)  # before anything is built: never another run's checkpoints replaced or mixed
    recipe = spec.fp8_recipe(cfg)
    dtype = param_dtype(cfg, device)
    seed_everything(cfg.train.seed, 0)  # same initial weights on every rank
    model, mcfg = spec.build_model(cfg, device, dtype)
    n_params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        log.info("%s, %s params, recipe %s, %s, %d process(es) on %s, strategy %s",
                 spec.describe(cfg, mcfg, n_params), str(dtype).replace("torch.", ""), cfg.precision.recipe,
                 "packed THD" if cfg.data.packed else "padded BSHD", world, device.type, strategy)
        if device.type == "cpu" and cfg.precision.recipe == "bf16" and dtype == torch.float32:
            log.info("precision: recipe bf16 on the CPU runs fp32 parameters (precision.param_dtype=auto); "
                     "set precision.param_dtype=bf16 to force bf16")
    layers = spec.model_layers(model)
    bf16_layers = spec.apply_layer_precision(model, cfg, recipe, rank)
    n_states = prepare_fp8_state(model, layers, recipe, bf16_layers)
    if rank == 0 and n_states:
        log.info("precision: %d delayed-scaling states created (checkpointed with the model)", n_states)
    model = getattr(spec, "wrap_model", wrap_model)(model, layers, strategy, world, device, cfg, log)
    inner = model.module if hasattr(model, "module") and strategy == "ddp" else model
    optimizer = spec.build_optimizer(model, cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    train_loader, val_loader, n_train, n_val = spec.build_loaders(cfg, rank, world, recipe,
                                                                  pin_memory=device.type == "cuda")
    if rank == 0:
        log.info("data: %s: %d train / %d validation %s; %d micro-batches of <= %d tokens per rank per "
                 "epoch", cfg.data.path, n_train, n_val, spec.DATA_NOUN, len(train_loader),
                 cfg.data.micro_batch_tokens)

    seed_everything(cfg.train.seed, rank)  # training RNG (a resume restores the saved one)
    root = cfg.checkpoint.dir
    total_steps = int(cfg.train.steps)
    step = _resume(cfg, spec, model, optimizer, scheduler, train_loader, rank)

    accum = int(cfg.train.grad_accum)
    # train.stop_at: end this run after that step (checkpoint written), on
    # train.steps' schedule; a rerun resumes and continues the same run.
    stop_at = total_steps if cfg.train.get("stop_at") is None else min(total_steps, int(cfg.train.stop_at))
    if step >= stop_at and rank == 0:
        log.warning("resumed at step %d, at or past train.stop_at=%d: nothing to train in this run", step, stop_at)
    logger = MetricLogger(cfg, rank, total_steps, step, logger=log)
    profiler = CaptureRange(cfg, rank, device, log)
    batches = endless(train_loader)
    params = [p for p in model.parameters() if p.requires_grad]
    clip = getattr(spec, "clip_grad_norm", None) or (lambda _model, ps, max_norm: clip_grad_norm_(ps, max_norm))
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    history = {"step": [], "loss": [], "val_step": [], "val_loss": []}
    win = {"loss": [], "tokens": 0, "real": 0, "flops": 0.0, "t0": time.perf_counter(), "steps": 0}
    summary_rates = []

    def save(s):
        if cuda:  # a bad label of the steps since the last check: its NaN gradients are in the weights
            labels_checked_together(device, wait=True)
        trainer_state = {"step": s, "scheduler": scheduler.state_dict(), "data": train_loader.state_dict(),
                         "config": cfg.to_dict(), "world_size": world, "strategy": strategy}
        p = ckpt.save_checkpoint(root, s, model, optimizer, trainer_state, keep_last=int(cfg.checkpoint.keep_last))
        if rank == 0:
            log.info("checkpoint: %s", p)

    model.train()
    while step < stop_at:
        profiler.begin_step(step + 1)
        for micro in range(accum):
            host_batch = next(batches)
            # FLOPs from the host copy: reading cu_seqlens on the GPU would sync every micro-step.
            win["flops"] += spec.step_flops(host_batch, mcfg)
            batch = to_device(host_batch, device)
            with no_grad_sync(model, strategy, micro < accum - 1):
                with profiler.phase("forward"), autocast(enabled=recipe is not None, recipe=recipe):
                    loss = spec.forward_loss(model, batch)
                with profiler.phase("backward"):
                    (loss / accum).backward()
            win["loss"].append(loss.detach())
            win["tokens"] += batch["input_ids"].numel()
            win["real"] += int(batch["num_tokens"])
        with profiler.phase("optimizer"):
            if cfg.train.clip_grad_norm:
                # FSDP2: the local shards' squares, one all-reduce, the global norm
                clip(model, params, float(cfg.train.clip_grad_norm))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        step += 1
        profiler.end_step(step)
        win["steps"] += 1
        logger.advance()

        last = step == stop_at
        if step % int(cfg.train.log_interval) == 0 or last:
            if cuda:
                torch.cuda.synchronize(device)
                labels_checked_together(device, wait=False)  # a bad label recorded by a loss kernel of this window
            dt = time.perf_counter() - win["t0"]
            local_loss = torch.stack(win["loss"]).float().mean().item()
            loss_sum, tokens, real, flops = all_reduce_sum(
                [local_loss, win["tokens"], win["real"], win["flops"]], device)
            m = {"loss": loss_sum / world, "lr": scheduler.get_last_lr()[0],
                 "tokens_per_s": tokens / dt, "unpadded_tokens_per_s": real / dt,
                 "step_time_ms": 1000.0 * dt / win["steps"]}
            if cuda:
                m["mfu_measured"] = flops / dt / (H200_BF16_MEASURED_TFLOPS * 1e12 * world)
                m["mfu_datasheet"] = flops / dt / (H200_BF16_DATASHEET_TFLOPS * 1e12 * world)
                m["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            else:
                m["tflops_per_s"] = flops / dt / 1e12
            history["step"].append(step)
            history["loss"].append(m["loss"])
            summary_rates.append(m)
            logger.log(step, m)
            win = {"loss": [], "tokens": 0, "real": 0, "flops": 0.0, "t0": time.perf_counter(), "steps": 0}
        eval_every = int(cfg.train.eval_interval)
        if (eval_every and step % eval_every == 0) or last:
            vl = evaluate(model, val_loader, cfg, recipe, device, spec.forward_loss)
            history["val_step"].append(step)
            history["val_loss"].append(vl)
            logger.log(step, {"val_loss": vl})
            win["t0"] = time.perf_counter()  # validation time is not training throughput
        interval = int(cfg.checkpoint.interval)
        if root and ((interval and step % interval == 0) or last):
            save(step)
            win["t0"] = time.perf_counter()
    logger.close()

    export = cfg.checkpoint.export_dir
    if export and step < total_steps:
        if rank == 0:
            log.info("stopped at step %d of %d (train.stop_at): no export yet", step, total_steps)
        export = None
    if export:
        spec.export(inner, mcfg, export, cfg, rank)
        if dist.is_initialized():
            dist.barrier()
    return {"history": history, "rates": summary_rates, "world_size": world, "rank": rank,
            "final_step": step, "params": n_params, "export_dir": export}
