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

A graph replays one shape.  Packed THD batches (data.packed=true, the
default) change their token count, sequences and longest sequence every
step; the graphs are captured for their bounds (SeqfuseEsmModel.
graph_packed_layers: data.micro_batch_tokens tokens, train.
cuda_graphs_max_sequences sequences, data.max_length the longest; the
default bound is 1.5 times the sequences an average batch of the training
split holds, and room for the padding: ``default_max_sequences``) and every batch is padded to them on the
device.  So that every training batch fits, the loader caps its sequences
(``loader_max_sequences``): the bound less the padding sequences the
emptiest batch could need (ceil(micro_batch_tokens / max_length)) and the
collator's own padding sequence (its token multiple); by default that is
the 1.5 times the average.  The bound is kept small because every sequence
in it costs the graphs' attention a few empty thread blocks per head, real
or not: on the H200 at ESM-2 650M's 16,384-token batches, a bound of 273
sequences ran at 0.95x the speed of one of 56.  Padded batches
need one shape without padding: data.fixed_length=true with data.packed=false
gives [micro_batch_tokens // max_length, max_length] every step (the config
rules refuse padded real-length batches, naming the keys).

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

import functools
import logging
import math
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
    if cfg.data.packed:
        packed_layout(cfg)
        pad, longest = cfg.data.get("pad_to_multiple_of"), int(cfg.data.max_length)
        if pad not in (None, "auto") and int(pad) > longest:
            raise ValueError(f"train.cuda_graphs=true: data.pad_to_multiple_of={pad} must be at most "
                             f"data.max_length={longest} with packed batches (the collator's padding sequence "
                             f"would be longer than the graphs' max_seqlen, and every such batch would run eagerly)")


def loader_max_sequences(cfg):
    """The training loader's cap on a packed batch's sequences under
    train.cuda_graphs (None without it, or with padded batches): with at
    most this many, any batch within the token budget leaves the graphs'
    sequence bound room for its padding (PackedLayout.misfit) and for the
    collator's padding sequence (data.pad_to_multiple_of)."""
    if not (cfg.train.get("cuda_graphs") and cfg.data.packed):
        return None
    layout = packed_layout(cfg)
    return layout.sequences - _padding_room(layout.tokens, layout.max_seqlen)


def _padding_room(tokens, longest):
    """The sequences a packed batch's padding may take: the graphs' padding
    of an empty budget (PackedLayout.padding_sequences), and the collator's."""
    from seqfuse.hf.layer_graphs import PackedLayout

    return PackedLayout.padding_sequences(tokens, longest) + 1


#: The default sequence bound's margin over an average packed batch's count.
SEQUENCES_MARGIN = 1.5


def default_max_sequences(cfg):
    """train.cuda_graphs_max_sequences=null: SEQUENCES_MARGIN times the
    sequences an average packed batch of the training split holds
    (data.micro_batch_tokens over the mean token length: each protein with
    its two special tokens, cropped to data.max_length; windows of
    data.max_length under data.fixed_length), and the padding's room."""
    tokens, longest = int(cfg.data.micro_batch_tokens), int(cfg.data.max_length)
    mean = longest if cfg.data.get("fixed_length") else _mean_length(str(cfg.data.path), longest)
    return math.ceil(SEQUENCES_MARGIN * tokens / mean) + _padding_room(tokens, longest)


@functools.lru_cache(maxsize=4)
def _mean_length(path, longest):
    """The training split's mean token length (read once per data path)."""
    from recipe_common.trainer import load_splits

    from .trainer import resolve_data_path

    train, _ = load_splits(resolve_data_path(path))
    return max(1.0, sum(min(len(s) + 2, longest) for s in train) / max(len(train), 1))


def packed_layout(cfg):
    """The packed batches' bounds the graphs are captured for
    (layer_graphs.PackedLayout); a train.cuda_graphs_max_sequences too small
    for the capture's sample batch is a ValueError naming the key."""
    from seqfuse.hf.layer_graphs import PackedLayout

    tokens, longest = int(cfg.data.micro_batch_tokens), int(cfg.data.max_length)
    given = cfg.train.get("cuda_graphs_max_sequences")
    sequences = default_max_sequences(cfg) if given is None else int(given)
    # the capture's sample batch, and one sequence a batch besides its padding's room
    need = max(PackedLayout.min_sequences(tokens, longest), _padding_room(tokens, longest) + 1)
    if sequences < need:
        what = (f"train.cuda_graphs_max_sequences={given}" if given is not None else
                f"train.cuda_graphs_max_sequences=null (its default from the data, {sequences}; set the key)")
        raise ValueError(f"{what}: must be at least {need} (the graphs' capture "
                         f"batch holds data.micro_batch_tokens={tokens} tokens in sequences of at most "
                         f"data.max_length={longest}, of unequal lengths, and every batch needs room for "
                         f"its padding besides one sequence)")
    return PackedLayout("train.cuda_graphs", tokens, sequences, longest)


def graphed_batch_shape(cfg):
    """The [B, L] of every training batch under data.fixed_length with
    data.packed=false: L = data.max_length (a multiple of the token multiple,
    a config rule), B = as many as the token budget takes (the padded
    sampler's rule: B * L <= micro_batch_tokens)."""
    length = int(cfg.data.max_length)
    return int(cfg.data.micro_batch_tokens) // length, length


def capture_layers(model, cfg, recipe):
    """Capture every encoder layer of ``model`` (a SeqfuseEsmForMaskedLM on
    one CUDA device) for the recipe's batches, under ``recipe`` (None: the
    model's dtype).  Returns the shape: [B, L], or ("thd", tokens,
    sequences, max_seqlen) for packed batches."""
    model.train()
    if model.esm.embeddings.word_embeddings.weight.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    if cfg.data.packed:
        layout = packed_layout(cfg)
        shape = layout.key()
        model.esm.graph_packed_layers(layout.tokens, layout.sequences, layout.max_seqlen, fp8_recipe=recipe)
        what = (f"packed batches of at most {layout.tokens} tokens in {layout.sequences} sequences (padding "
                f"sequences counted) of at most {layout.max_seqlen}")
        if cfg.data.get("fixed_length"):
            log.warning("train.cuda_graphs with data.fixed_length=true and data.packed=true: the graphed layers run "
                        "every packed batch on FlashAttention's variable-length kernels, where the eager layers "
                        "run windows of one length on cuDNN's (faster); data.packed=false graphs the same windows "
                        "as [B, %d] batches on cuDNN", layout.max_seqlen)
    else:
        shape = graphed_batch_shape(cfg)
        model.esm.graph_layers(*shape, fp8_recipe=recipe)
        what = f"batches [{shape[0]}, {shape[1]}]"
    torch.cuda.synchronize()
    log.info("train.cuda_graphs: %d encoder layers captured as CUDA graphs (forward and backward) for %s, %s, "
             "in %.1f s; other calls (validation, batches beyond these) run the layers eagerly",
             len(model.esm.encoder.layers), what,
             f"FP8 {type(recipe).__name__}" if recipe is not None else "no FP8", time.perf_counter() - t0)
    return shape
