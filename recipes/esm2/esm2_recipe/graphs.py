"""train.cuda_graphs: the ESM-2 recipe's encoder layers replayed as CUDA graphs.

A training step of ESM-2 launches a few hundred kernels per layer from
Python; at 650M on one H200 the host's launch work is a visible part of the
step.  Capturing each encoder layer's forward and backward once as CUDA
graphs (seqfuse.pytorch.make_graphed_callables, through
SeqfuseEsmModel.graph_layers) replaces that work with one graph launch per
layer and direction.  Under FP8 the graphs hold every cast of the layer, the
weight casts included, reading the GPU-resident scales and writing this
step's amaxes into the delayed-scaling history at fixed addresses; the
history roll and scale update stay one launch per state chunk at the exit of
the step's autocast region, as in eager mode.

A graph replays one shape, so the option needs batches of one shape without
padding: data.fixed_length=true with data.packed=false gives
[micro_batch_tokens // max_length, max_length] batches every step (the
config rules refuse anything else, naming the keys).  Packed THD batches are
refused: their token count and cu_seqlens change every step.

The capture happens once, when the trainer wraps the model: after the
weights exist and before a checkpoint is resumed (the checkpoint is loaded
into the same parameter and scaling-state tensors, in place, which the graphs
keep reading) and before the training RNG is seeded, so the capture's
warm-up draws change nothing a run computes.  Calls the graphs cannot serve
(validation, a batch of another shape) run the layers eagerly and the model
logs why, once per reason.

One process only: FSDP2 shards the parameters (the graphs would hold one
all-gathered copy), and DDP with graphed layers has no test here; both are
refused with the rule before anything is built.
"""
from __future__ import annotations

import logging
import time

import torch

log = logging.getLogger("esm2")


def check_graphs_run(cfg, device, world):
    """The refusals of train.cuda_graphs that depend on the run, not the
    config alone (the config's own rules are in config.py)."""
    if not cfg.train.get("cuda_graphs"):
        return
    if device.type != "cuda":
        raise ValueError(f"train.cuda_graphs=true: needs a CUDA device, the run is on {device.type} "
                         f"(device={cfg.device!r})")
    if world > 1:
        raise ValueError(f"train.cuda_graphs=true: one process only, this job has {world} (FSDP2 shards the "
                         f"parameters a captured graph would hold whole; DDP with graphed layers is not "
                         f"supported): run without train.cuda_graphs or on one GPU")


def graphed_batch_shape(cfg):
    """The [B, L] of every training batch under data.fixed_length with
    data.packed=false: L = data.max_length (a multiple of the token multiple,
    a config rule), B = as many as the token budget takes (the padded
    sampler's rule: B * L <= micro_batch_tokens)."""
    length = int(cfg.data.max_length)
    return int(cfg.data.micro_batch_tokens) // length, length


def capture_layers(model, cfg, recipe):
    """Capture every encoder layer of ``model`` (a SeqfuseEsmForMaskedLM on
    one CUDA device) for the recipe's batch shape, under ``recipe`` (None:
    the model's dtype).  Returns the shape."""
    b, s = graphed_batch_shape(cfg)
    model.train()
    if model.esm.embeddings.word_embeddings.weight.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.esm.graph_layers(b, s, fp8_recipe=recipe)
    torch.cuda.synchronize()
    log.info("train.cuda_graphs: %d encoder layers captured as CUDA graphs (forward and backward) for batches "
             "[%d, %d], %s, in %.1f s; other calls (validation, another shape) run the layers eagerly",
             len(model.esm.encoder.layers), b, s,
             f"FP8 {type(recipe).__name__}" if recipe is not None else "no FP8", time.perf_counter() - t0)
    return b, s
