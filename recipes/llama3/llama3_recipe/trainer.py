"""Llama 3 causal-LM training on real DNA: what is specific to Llama in the
loop shared by the recipes (recipes/recipe_common/trainer.py, where the
loop, the strategies "fsdp2" / "ddp", logging, validation, checkpoints and
the Nsight capture range are described).

This module is the ``spec`` the shared loop reads:
  * the model: SeqfuseLlamaForCausalLM (seqfuse.hf) of a published Llama 3
    shape (model.size: llama3_config) or the config's fields, with the
    nucleotide vocabulary (10 tokens, seqfuse.data.NucleotideTokenizer);
  * layer-wise precision (config.resolve_layer_precision: 1-indexed
    fp8_layers / fp4_layers, BioNeMo's rule): the whole forward runs inside
    seqfuse's autocast with the FP8 recipe; a bf16 layer runs its forward
    (and so its backward) with autocast off, an FP4 layer inside a nested
    autocast with NVFP4BlockScaling.  MXFP8 and NVFP4 GEMMs need compute
    capability 10.x (Blackwell): ``check_run`` refuses them on Hopper and on
    the CPU before anything is built, naming the first layer that asks;
  * the loaders: DNA windows from Parquet (recipes/llama3/data, DATA.md)
    through seqfuse.data.build_causal_lm_loader (packed THD or padded BSHD,
    token budget, resumable);
  * FLOPs for MFU (causal attention: half the score matrix);
  * the export: transformers' LlamaForCausalLM directory
    (seqfuse.hf.llama_convert.export_hf) with the tokenizer
    (NucleotideTokenizer.save_pretrained), loadable by AutoTokenizer and
    LlamaForCausalLM without seqfuse.
"""
from __future__ import annotations

import logging

import torch

from recipe_common import checkpoint as ckpt
from recipe_common import trainer as _loop
from recipe_common.export import write_hf_export
from recipe_common.metrics import batch_seq_lengths
from recipe_common.trainer import build_optimizer, lr_lambda  # noqa: F401

from .config import FP8_RECIPES, RECIPES, ConfigError, check_paths, layer_precision, validate_config  # noqa: F401

log = logging.getLogger("llama3")

KEEP_PG_ENV = "LLAMA3_KEEP_PG"
DATA_NOUN = "DNA windows"


class HardwareError(ConfigError, NotImplementedError):
    """A config the device cannot run (a ConfigError, so the command line
    reports it with exit status 2; a NotImplementedError, as seqfuse names
    a feature the GPU lacks)."""


# ---------------------------------------------------------------- precision
def fp8_recipe(cfg):
    """The model-wide recipe (None: no FP8; FP4 layers bring their own)."""
    return _loop.fp8_recipe_of(cfg, RECIPES)


def _device_words(device):
    if device.type != "cuda":
        return "the CPU", None
    major, minor = torch.cuda.get_device_capability(device)
    gen = {8: "Ampere/Ada", 9: "Hopper", 10: "Blackwell", 12: "Blackwell"}.get(major, "")
    name = torch.cuda.get_device_name(device)
    return f"{device} ({name}, compute capability {major}.{minor}{', ' + gen if gen else ''})", major


def check_run(cfg, device, context_parallel=False):
    """Before anything is built: cp_size > 1 only where the script runs
    context parallelism (train_fsdp2_cp.py, ``context_parallel``), and
    every layer's format must run here.  MXFP8
    (precision.recipe=mxfp8) and NVFP4 (precision.fp4) GEMMs need compute
    capability 10.x (Blackwell) in cuBLASLt; on Hopper and on the CPU a
    config asking for them is refused, naming the first layer that would
    need them and the rule.  On a Blackwell GPU seqfuse's own modules are
    asked (seqfuse.quantization.gemm_quantizers.recipe_kind), so a format
    seqfuse cannot run there is refused now too, in its words."""
    from seqfuse.common.recipe import MXFP8BlockScaling, NVFP4BlockScaling
    from seqfuse.quantization.gemm_quantizers import recipe_kind

    if int(cfg.get("cp_size", 1)) > 1 and not context_parallel:
        raise ConfigError(cfg.get("config_name", "?"), [
            f"cp_size={cfg.cp_size}: context parallelism runs in train_fsdp2_cp.py; train_fsdp2.py and "
            f"train_ddp.py take cp_size=1"])
    plan = layer_precision(cfg)
    wants = []
    if cfg.precision.recipe == "mxfp8" and "fp8" in plan:
        wants.append(("precision.fp8_layers", plan.index("fp8") + 1, "MXFP8", MXFP8BlockScaling()))
    if "fp4" in plan:
        wants.append(("precision.fp4_layers", plan.index("fp4") + 1, "NVFP4", NVFP4BlockScaling()))
    if not wants:
        return
    where, major = _device_words(device)
    problems = []
    for key, layer, fmt, recipe in wants:
        listed = cfg.precision.fp8_layers if key.endswith("fp8_layers") else cfg.precision.fp4_layers
        # the key that put the layer there: the list, or (no list) the switch that turned the format on
        asked = f"{key}={listed}" if listed is not None else \
            ("precision.recipe=mxfp8" if fmt == "MXFP8" else "precision.fp4=true")
        head = f"{asked}: layer {layer} (1-indexed) would run {fmt} GEMMs"
        if major is None or major < 10:
            problems.append(f"{head}, which need compute capability 10.x (Blackwell); this run is on {where}. "
                            f"On Hopper use precision.recipe=fp8_delayed, fp8_current or fp8_block "
                            f"{'and precision.fp4=false' if fmt == 'NVFP4' else ''}".rstrip())
            continue
        try:
            recipe_kind(recipe, f"layer {layer}")
        except NotImplementedError as e:
            problems.append(f"{head}: seqfuse cannot run them on {where}: {e}")
    if problems:
        raise HardwareError(cfg.get("config_name", "?"), problems)


def apply_layer_precision(model, cfg, recipe, rank):
    """Give each decoder layer its format (config.layer_precision): FP8
    layers run inside the model-wide autocast, bf16 layers with autocast off,
    FP4 layers inside a nested NVFP4 autocast.  Returns the 0-based indices
    of the layers that do not run the model-wide FP8 recipe (they get no
    delayed-scaling state)."""
    from seqfuse.common.recipe import NVFP4BlockScaling
    from seqfuse.pytorch import autocast

    plan = layer_precision(cfg)
    layers = model_layers(model)
    off = []
    for i, kind in enumerate(plan):
        if kind == "fp8":
            continue
        off.append(i)
        if kind is None:
            _loop.run_without_fp8(layers[i])
        else:  # "fp4" (check_run has refused it where it cannot run)
            forward, fp4 = layers[i].forward, NVFP4BlockScaling()

            def fp4_forward(*a, _forward=forward, _r=fp4, **k):
                with autocast(enabled=True, recipe=_r):
                    return _forward(*a, **k)

            layers[i].forward = fp4_forward
    if rank == 0 and (recipe is not None or "fp4" in plan):
        names = {"fp8": cfg.precision.recipe, "fp4": "nvfp4", None: "bf16"}
        groups = {}
        for i, kind in enumerate(plan):
            groups.setdefault(names[kind], []).append(i + 1)
        log.info("precision per layer (1-indexed): %s", "; ".join(f"{k} {v}" for k, v in groups.items()))
    return off


def prepare_fp8_state(model, recipe, off_layers):
    return _loop.prepare_fp8_state(model, model_layers(model), recipe, off_layers)


# ---------------------------------------------------------------- model
def tokenizer():
    from seqfuse.data import NucleotideTokenizer

    return NucleotideTokenizer()


def model_config(cfg):
    """SeqfuseLlamaConfig: a published Llama 3 shape (model.size) or the
    config's fields; the vocabulary and special ids are the nucleotide
    tokenizer's; model.recompute_activation is the MLP's
    mlp_recompute_activation (its SwiGLU output made again in the backward
    from the kept fc1 output instead of saved)."""
    from seqfuse.hf import SeqfuseLlamaConfig, llama3_config

    tok = tokenizer()
    m = cfg.model
    ids = dict(vocab_size=len(tok.vocab), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
               pad_token_id=tok.pad_token_id, mlp_recompute_activation=bool(m.recompute_activation))
    if m.size:
        return llama3_config(str(m.size), **ids)
    return SeqfuseLlamaConfig(hidden_size=int(m.hidden_size), num_hidden_layers=int(m.num_hidden_layers),
                              num_attention_heads=int(m.num_attention_heads),
                              num_key_value_heads=int(m.num_key_value_heads),
                              intermediate_size=int(m.intermediate_size),
                              tie_word_embeddings=bool(m.tie_word_embeddings),
                              max_position_embeddings=int(m.max_position_embeddings), rms_norm_eps=1e-5,
                              rope_parameters=dict(rope_type="default", rope_theta=float(m.rope_theta)), **ids)


def build_model(cfg, device, dtype):
    from seqfuse.hf import SeqfuseLlamaForCausalLM

    mcfg = model_config(cfg)
    # (model.to(dtype) leaves the rotary inverse frequencies float32)
    return _loop.build_model_on(SeqfuseLlamaForCausalLM, mcfg, cfg, device, dtype), mcfg


def model_layers(model):
    return model.model.layers


def describe(cfg, mcfg, n_params):
    return (f"Llama 3 {cfg.model.size or 'custom'}: {n_params / 1e6:.2f}M parameters (h={mcfg.hidden_size}, "
            f"L={mcfg.num_hidden_layers}, heads={mcfg.num_attention_heads}/{mcfg.num_key_value_heads} kv, "
            f"ffn={mcfg.intermediate_size}, vocab={mcfg.vocab_size})")


# ---------------------------------------------------------------- data
def resolve_data_path(path: str) -> str:
    return _loop.resolve_data_path(path, "run recipes/llama3/prepare_data.py, see recipes/llama3/DATA.md")


def build_loaders(cfg, rank, world, recipe, pin_memory=False):
    from seqfuse.data import build_causal_lm_loader

    train_seqs, val_seqs = _loop.load_splits(resolve_data_path(cfg.data.path))
    quantized = recipe is not None or bool(cfg.precision.fp4)
    pad = cfg.data.pad_to_multiple_of
    if pad == "auto":
        pad = 16 if quantized else None
    return _loop.train_val_loaders(build_causal_lm_loader, tokenizer(), train_seqs, val_seqs, cfg, pad, rank, world,
                                   pin_memory)


def forward_loss(model, batch):
    if "cu_seqlens" in batch:
        out = model(input_ids=batch["input_ids"], labels=batch["labels"], cu_seqlens=batch["cu_seqlens"],
                    max_seqlen=int(batch["max_seqlen"]))
    else:
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
    return out.loss


# ---------------------------------------------------------------- FLOPs
def matmul_params(mcfg) -> int:
    """Weights a token multiplies through: QKV (h x (heads + 2 kv heads) x
    head_dim), attention out, SwiGLU gate + up + down (3 h f) per layer, and
    the LM head (h V)."""
    h, f, hd = mcfg.hidden_size, mcfg.intermediate_size, mcfg.head_dim
    a, g = mcfg.num_attention_heads, mcfg.num_key_value_heads
    per_layer = h * (a + 2 * g) * hd + a * hd * h + 3 * h * f
    return mcfg.num_hidden_layers * per_layer + h * mcfg.vocab_size


def causal_lm_train_flops(seq_lengths, weights_per_token, mcfg) -> float:
    """Forward + backward (3 x forward) of a decoder over sequences of these
    real lengths: 2 FLOPs per weight a token multiplies through
    (``weights_per_token``), plus causal attention (QK^T and PV over the
    lower triangle: 2 x heads x head_dim x s^2 per layer).  The Mixtral
    recipe calls it with its active weights."""
    tokens = float(sum(seq_lengths))
    sq = float(sum(int(s) * int(s) for s in seq_lengths))
    attn = 2.0 * mcfg.num_attention_heads * mcfg.head_dim * mcfg.num_hidden_layers * sq
    return 3.0 * (2.0 * weights_per_token * tokens + attn)


def train_flops(seq_lengths, mcfg) -> float:
    """causal_lm_train_flops with every weight (matmul_params)."""
    return causal_lm_train_flops(seq_lengths, matmul_params(mcfg), mcfg)


def step_flops(host_batch, mcfg):
    return train_flops(batch_seq_lengths(host_batch), mcfg)


# ---------------------------------------------------------------- export
def export(model, mcfg, out_dir, cfg, rank):
    """Gather the whole model (every rank calls this) and, on rank 0, write
    transformers' LlamaForCausalLM directory with the tokenizer files."""
    sd = ckpt.full_model_state_dict(model)
    if rank == 0:
        export_hf(mcfg, sd, out_dir, model_max_length=int(cfg.data.max_length))
        log.info("exported Hugging Face LlamaForCausalLM (safetensors) and the nucleotide tokenizer to %s", out_dir)


def export_dna_lm(model_class, write_hf, model_config, state_dict: dict, out_dir: str, model_max_length=None) -> str:
    """The export of a causal LM trained on this recipe's DNA (Llama 3, and
    Mixtral's recipe): a ``model_class`` (seqfuse.hf's model, embeddings
    under model.embed_tokens) holding ``state_dict`` (a full, gathered
    model state), written with ``write_hf`` (its family's export_hf), and
    the NucleotideTokenizer's Hugging Face files beside it; returns
    ``out_dir``."""
    return write_hf_export(model_class, write_hf, model_config, state_dict, "model.embed_tokens.weight", out_dir,
                           lambda d: tokenizer().save_pretrained(d, model_max_length=model_max_length))


def export_hf(model_config, state_dict: dict, out_dir: str, model_max_length=None) -> str:
    """export_dna_lm of a SeqfuseLlamaForCausalLM, written with
    seqfuse.hf.llama_convert.export_hf; returns ``out_dir``."""
    from seqfuse.hf import SeqfuseLlamaForCausalLM
    from seqfuse.hf.llama_convert import export_hf as write_llama

    return export_dna_lm(SeqfuseLlamaForCausalLM, write_llama, model_config, state_dict, out_dir, model_max_length)


# ---------------------------------------------------------------- the run
# evaluate(model, val_loader, cfg, recipe, device) and train(cfg, strategy="fsdp2"): one training run of
# Llama 3 on DNA with this module as the spec (recipe_common.trainer.entry_points); check_run checks the
# device against the precision plan before anything is built.
evaluate, train = _loop.entry_points(__name__)
