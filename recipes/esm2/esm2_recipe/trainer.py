"""The ESM-2 masked-LM training: what is specific to ESM-2 in the loop
shared by the recipes (recipes/recipe_common/trainer.py, where the loop, the
strategies "fsdp2" / "ddp", logging, validation, checkpoints and the
profiler capture range are described).

This module is the ``spec`` the shared loop reads: model building
(SeqfuseEsmForMaskedLM of a published ESM-2 shape or the config's fields),
per-layer precision (the first / last N layers and listed indices run
without FP8), the UniProt loaders (MLM masking; data.fixed_length cuts
windows of exactly max_length tokens), the forward and loss, FLOPs, the
wrapping that captures the encoder layers as CUDA graphs (train.cuda_graphs,
graphs.py), and the Hugging Face export (EsmForMaskedLM).  ``train(cfg,
strategy)`` runs one process of a job.
"""
from __future__ import annotations

import logging

from recipe_common import trainer as _loop
from recipe_common.trainer import (all_reduce_sum, build_optimizer, endless, init_distributed,  # noqa: F401
                                   lr_lambda, no_grad_sync, param_dtype, seed_everything, to_device)

from . import checkpoint as ckpt
from .config import check_paths, validate_config  # noqa: F401
from .metrics import batch_seq_lengths, train_flops

log = logging.getLogger("esm2")

RECIPES = ("bf16", "fp32", "fp8_delayed", "fp8_current", "fp8_block")
KEEP_PG_ENV = "ESM2_KEEP_PG"
DATA_NOUN = "proteins"


# ---------------------------------------------------------------- setup
def resolve_data_path(path: str) -> str:
    return _loop.resolve_data_path(path, "run recipes/esm2/prepare_data.py, see recipes/esm2/DATA.md")


def check_run(cfg, device):
    """Nothing of ESM-2's precision depends on the device (no FP4 / MXFP8);
    train.cuda_graphs needs one CUDA process (graphs.check_graphs_run); an
    export (checkpoint.export_dir) needs an MLP activation transformers'
    EsmConfig describes, refused here rather than after the training."""
    import torch.distributed as dist

    from seqfuse.hf.esm_config import HF_EXPORTABLE_ACTIVATIONS

    from .graphs import check_graphs_run

    check_graphs_run(cfg, device, dist.get_world_size() if dist.is_initialized() else 1)
    if cfg.checkpoint.export_dir and cfg.model.mlp_activation not in HF_EXPORTABLE_ACTIVATIONS:
        raise ValueError(f"checkpoint.export_dir is set, but model.mlp_activation={cfg.model.mlp_activation!r} "
                         "has no transformers EsmConfig counterpart (EsmForMaskedLM computes the exact GELU); "
                         f"export takes {list(HF_EXPORTABLE_ACTIVATIONS)}: change the activation or unset "
                         "checkpoint.export_dir")


def fp8_recipe(cfg):
    return _loop.fp8_recipe_of(cfg, RECIPES)


def model_config(cfg):
    from seqfuse.hf import SeqfuseEsmConfig, esm2_config

    m = cfg.model
    mlp = dict(mlp_activation=m.mlp_activation, mlp_recompute_activation=bool(m.recompute_activation))
    if m.size:
        return esm2_config(str(m.size), **mlp)
    return SeqfuseEsmConfig(hidden_size=int(m.hidden_size), num_hidden_layers=int(m.num_hidden_layers),
                            num_attention_heads=int(m.num_attention_heads),
                            intermediate_size=int(m.intermediate_size), **mlp)


def build_model(cfg, device, dtype):
    from seqfuse.hf import SeqfuseEsmForMaskedLM

    mcfg = model_config(cfg)
    model = _loop.build_model_on(SeqfuseEsmForMaskedLM, mcfg, cfg, device, dtype)
    model.tie_weights()
    # ESM-2's contact regression is fitted after pre-training, never by the MLM
    # loss: frozen, so it gets no optimizer state (and no zero gradients).
    model.esm.contact_head.requires_grad_(False)
    return model, mcfg


def apply_layer_precision(model, cfg, recipe, rank):
    """Per-layer precision: the first / last N TransformerLayers, and those
    listed in precision.bf16_layers (indices, negative from the end), run
    their forward (and so their backward) without FP8 inside the FP8 region."""
    layers = model.esm.encoder.layers
    n = len(layers)
    first, last = int(cfg.precision.bf16_first_layers), int(cfg.precision.bf16_last_layers)
    listed = cfg.precision.get("bf16_layers") or []
    if isinstance(listed, int):
        listed = [listed]
    chosen = set()
    for i in listed:
        if isinstance(i, bool) or not isinstance(i, int) or not -n <= i < n:
            raise ValueError(f"precision.bf16_layers: {i!r} is not a layer index of a {n}-layer model "
                             f"(0..{n - 1}, or negative from the end)")
        chosen.add(i % n)
    if recipe is None:
        if first or last or chosen:
            log.info("precision: bf16_first/last_layers and bf16_layers ignored (recipe %s has no FP8)",
                     cfg.precision.recipe)
        return []
    keep = sorted(set(range(min(first, n))) | set(range(max(0, n - last), n)) | chosen)
    for i in keep:
        _loop.run_without_fp8(layers[i])
    if rank == 0:
        log.info("precision: %s on layers %s of %d; layers %s without FP8", cfg.precision.recipe,
                 [i for i in range(n) if i not in keep], n, keep)
    return keep


def fixed_length_windows(seqs, max_length, per_batch, split):
    """data.fixed_length: windows of exactly ``max_length - 2`` residues
    (``max_length`` tokens with <cls> and <eos>) cut in order from the
    concatenated proteins of a split, so no sample is cropped or padded
    (a window may span the end of one protein and the start of the next, as
    benchmarks/esm2's fixed layout does).  Cut to a whole number of
    ``per_batch``-sample batches, so every batch has the same shape."""
    residues = max_length - 2
    cat = "".join(seqs)
    windows = [cat[i:i + residues] for i in range(0, len(cat) - residues + 1, residues)]
    keep = len(windows) // per_batch * per_batch
    if keep == 0:
        raise ValueError(f"data.fixed_length=true: the {split} split gives {len(windows)} windows of "
                         f"{max_length} tokens, fewer than one batch of {per_batch} (data.micro_batch_tokens // "
                         f"data.max_length): use more data or a smaller data.micro_batch_tokens")
    return windows[:keep]


def build_loaders(cfg, rank, world, recipe, pin_memory=False):
    from seqfuse.data import EsmTokenizer, build_mlm_loader

    train_seqs, val_seqs = _loop.load_splits(resolve_data_path(cfg.data.path))
    pad = cfg.data.pad_to_multiple_of
    if pad == "auto":
        pad = 16 if recipe is not None else None
    elif recipe is not None and (not pad or int(pad) % 16):
        raise ValueError(f"data.pad_to_multiple_of={pad}: FP8 GEMMs need the token count a multiple of 16")
    if cfg.data.get("fixed_length"):
        length = int(cfg.data.max_length)  # a multiple of the token multiple (a config rule)
        # the padded sampler fits B samples of L tokens while B * L <= the budget; packed, any whole number
        per_batch = int(cfg.data.micro_batch_tokens) // length
        train_seqs = fixed_length_windows(train_seqs, length, per_batch * world, "train")
        val_seqs = fixed_length_windows(val_seqs, length, per_batch, "validation")
    from .graphs import loader_max_sequences

    # packed training batches under train.cuda_graphs: at most as many sequences as the graphs' bound leaves room
    # for (validation runs the layers eagerly: its batches are not capped)
    cap = loader_max_sequences(cfg)
    loaders = _loop.train_val_loaders(build_mlm_loader, EsmTokenizer(), train_seqs, val_seqs, cfg, pad, rank, world,
                                      pin_memory, train_extra=None if cap is None else dict(max_sequences=cap),
                                      mask_prob=float(cfg.data.mask_prob))
    if cap is not None:
        total, added = loaders[0].batch_sampler.batches_added_by_cap(0)
        log.info("train.cuda_graphs: packed training batches hold at most %d sequences; %s", cap,
                 f"in epoch 0 that splits batches of more short proteins into {added} more batches ({total} in "
                 f"all): raise train.cuda_graphs_max_sequences to split fewer" if added else
                 f"it splits none of epoch 0's {total} batches")
    return loaders


def forward_loss(model, batch):
    if "cu_seqlens" in batch:
        out = model(input_ids=batch["input_ids"], labels=batch["labels"], cu_seqlens=batch["cu_seqlens"],
                    max_seqlen=int(batch["max_seqlen"]))
    else:
        # A batch whose real tokens fill every row has no padding: pass no mask, which is exact (the
        # embeddings and layers treat an all-ones mask as none) and spares the model reading the mask on
        # the host (a synchronization); graphed layers take only such calls.  num_tokens is a host int.
        full = int(batch["num_tokens"]) == batch["input_ids"].numel()
        out = model(input_ids=batch["input_ids"], attention_mask=None if full else batch["attention_mask"],
                    labels=batch["labels"])
    return out.loss


def model_layers(model):
    return model.esm.encoder.layers


def wrap_model(model, layers, strategy, world, device, cfg, log):
    """The shared data-parallel wrapping (recipe_common.trainer.wrap_model),
    then, with train.cuda_graphs, the encoder layers captured as CUDA graphs
    (esm2_recipe/graphs.py; one process, checked in check_run)."""
    model = _loop.wrap_model(model, layers, strategy, world, device, cfg, log)
    if cfg.train.get("cuda_graphs"):
        from .graphs import capture_layers

        inner = model.module if strategy == "ddp" and hasattr(model, "module") else model
        capture_layers(inner, cfg, fp8_recipe(cfg))
    return model


def prepare_fp8_state(model, recipe, bf16_layers):
    """The delayed-scaling states of every module that runs FP8, made now
    (recipe_common.trainer.prepare_fp8_state over the encoder layers)."""
    return _loop.prepare_fp8_state(model, model_layers(model), recipe, bf16_layers)


def describe(cfg, mcfg, n_params):
    return (f"ESM-2 {cfg.model.size or 'custom'}: {n_params / 1e6:.2f}M parameters (h={mcfg.hidden_size}, "
            f"L={mcfg.num_hidden_layers}, heads={mcfg.num_attention_heads}, ffn={mcfg.intermediate_size})")


def step_flops(host_batch, mcfg):
    return train_flops(batch_seq_lengths(host_batch), mcfg.hidden_size, mcfg.intermediate_size,
                       mcfg.num_hidden_layers)


def export(model, mcfg, out_dir, cfg, rank):
    """Gather the whole model (every rank calls this) and write the
    EsmForMaskedLM directory on rank 0."""
    from .export import export_hf

    sd = ckpt.full_model_state_dict(model)
    if rank == 0:
        export_hf(mcfg, sd, out_dir)
        log.info("exported Hugging Face EsmForMaskedLM (safetensors) to %s", out_dir)


# ---------------------------------------------------------------- the run
# evaluate(model, val_loader, cfg, recipe, device) and train(cfg, strategy="fsdp2"): one training run of ESM-2
# with this module as the spec (recipe_common.trainer.entry_points).
evaluate, train = _loop.entry_points(__name__)
