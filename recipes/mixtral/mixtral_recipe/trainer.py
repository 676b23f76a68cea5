"""Mixtral (mixture-of-experts causal LM) training on real DNA: what is
specific to Mixtral in the loop shared by the recipes
(recipes/recipe_common/trainer.py, where the loop, the "fsdp2" strategy,
logging, validation, checkpoints and the Nsight capture range are
described).

This module is the ``spec`` the shared loop reads:
  * the model: SeqfuseMixtralForCausalLM (seqfuse.hf) of the config's shape
    with the nucleotide vocabulary (10 tokens); each decoder layer is
    attention as in seqfuse's Llama and a GroupedMLP of
    model.num_local_experts SwiGLU experts (router, token permutation and
    grouped GEMMs);
  * the loss: the causal-LM cross-entropy plus, while training,
    model.router_aux_loss_coef times the load-balancing loss (the model
    adds it when asked for router outputs, transformers' rule).  The logged
    ``loss`` is that training objective; validation (``val_loss``) is the
    cross-entropy alone, comparable with the Llama 3 recipe's;
  * layer-wise precision: the Llama 3 recipe's 1-indexed
    precision.fp8_layers rule; a bf16 layer runs with seqfuse's autocast
    off inside the model-wide FP8 region (its attention GEMMs and its
    experts' grouped GEMMs alike);
  * the data: the Llama 3 recipe's DNA windows, tokenizer and loaders,
    imported (llama3_recipe.trainer.build_loaders);
  * FLOPs for MFU: active parameters only (the router, and top-k of the
    experts per token), causal attention as half the score matrix;
  * the export: transformers' MixtralForCausalLM directory
    (seqfuse.hf.mixtral_convert.export_hf) with the tokenizer, loadable
    without seqfuse;
  * expert parallelism (distributed.expert_parallel_size = ep > 1, under
    torchrun with a multiple of ep processes): seqfuse.distributed's ("dp",
    "ep") mesh; each layer's mixture of experts becomes this rank's share
    of it (seqfuse.modules.ExpertParallelGroupedMLP: the router on every
    rank, num_local_experts / ep experts here, tokens dispatched to their
    experts' ranks and back with all_to_all_single); FSDP2 shards each
    expert module over its dp group and the rest of the model over every
    rank (fully_shard_expert_parallel); the gradient-norm clip is exact
    over EP and DP (seqfuse.distributed.clip_grad_norm_).  Expert parameters
    keep their global names (fc1.weight5 is expert 5 on whichever rank
    holds it), so checkpoints are keyed like the single-process model's;
    the export gathers every expert to rank 0.  With ep = 1 every rank
    holds every expert and FSDP2 shards them with the other weights.
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from llama3_recipe import trainer as llama
from recipe_common import checkpoint as ckpt
from recipe_common import trainer as _loop
from recipe_common.metrics import batch_seq_lengths
from recipe_common.trainer import build_optimizer, lr_lambda  # noqa: F401

from .config import FP8_RECIPES, RECIPES, ConfigError, check_paths, layer_precision, validate_config  # noqa: F401

log = logging.getLogger("mixtral")

KEEP_PG_ENV = "MIXTRAL_KEEP_PG"
DATA_NOUN = llama.DATA_NOUN

# The Llama 3 recipe's data: same windows, tokenizer and loaders.
tokenizer = llama.tokenizer
build_loaders = llama.build_loaders


# ---------------------------------------------------------------- precision
def fp8_recipe(cfg):
    """The model-wide recipe (None: bf16 / fp32)."""
    return _loop.fp8_recipe_of(cfg, RECIPES)


def expert_parallel_size(cfg) -> int:
    return int(cfg.distributed.get("expert_parallel_size", 1))


def check_run(cfg, device):
    """Before anything is built.  Every format the config allows runs on the
    CPU and on Hopper (MXFP8 / NVFP4 are refused by the config itself); the
    device-dependent rule left is expert parallelism's: its size must
    divide the number of processes (the config has checked it divides the
    experts)."""
    ep = expert_parallel_size(cfg)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if ep > 1 and world % ep:
        raise ConfigError(cfg.get("config_name", "?"), [
            f"distributed.expert_parallel_size={ep}: must divide the number of processes ({world}; run under "
            f"torchrun --nproc_per_node N with N a multiple of {ep})"])


def apply_layer_precision(model, cfg, recipe, rank):
    """Layers outside precision.fp8_layers run with autocast off (bf16 or
    the parameters' dtype) inside the model-wide FP8 region.  Returns their
    0-based indices (they get no delayed-scaling state)."""
    plan = layer_precision(cfg)
    layers = model_layers(model)
    off = [i for i, kind in enumerate(plan) if kind != "fp8"]
    if recipe is None:
        return off
    for i in off:
        _loop.run_without_fp8(layers[i])
    if rank == 0:
        fp8 = [i + 1 for i, kind in enumerate(plan) if kind == "fp8"]
        log.info("precision per layer (1-indexed): %s %s%s", cfg.precision.recipe, fp8,
                 f"; bf16 {[i + 1 for i in off]}" if off else "")
    return off


# ---------------------------------------------------------------- model
def model_config(cfg):
    """SeqfuseMixtralConfig of the config's shape; the vocabulary and special
    ids are the nucleotide tokenizer's."""
    from seqfuse.hf import SeqfuseMixtralConfig

    tok = tokenizer()
    m = cfg.model
    return SeqfuseMixtralConfig(
        vocab_size=len(tok.vocab), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, hidden_size=int(m.hidden_size), num_hidden_layers=int(m.num_hidden_layers),
        num_attention_heads=int(m.num_attention_heads), num_key_value_heads=int(m.num_key_value_heads),
        intermediate_size=int(m.intermediate_size), num_local_experts=int(m.num_local_experts),
        num_experts_per_tok=int(m.num_experts_per_tok), router_aux_loss_coef=float(m.router_aux_loss_coef),
        tie_word_embeddings=bool(m.tie_word_embeddings), max_position_embeddings=int(m.max_position_embeddings),
        rms_norm_eps=1e-5, rope_parameters=dict(rope_type="default", rope_theta=float(m.rope_theta)))


def build_model(cfg, device, dtype):
    """The whole model (the same initial weights on every rank: the loop
    seeds every rank alike before this); with expert parallelism each
    layer's mixture of experts is then replaced by this rank's share of it
    (expert_parallel_moe)."""
    from seqfuse.hf import SeqfuseMixtralForCausalLM

    mcfg = model_config(cfg)
    # (model.to(dtype) leaves the rotary inverse frequencies float32)
    model = _loop.build_model_on(SeqfuseMixtralForCausalLM, mcfg, cfg, device, dtype)
    ep = expert_parallel_size(cfg)
    if ep > 1:
        from seqfuse.distributed import init_expert_parallel_mesh

        model.ep_mesh = init_expert_parallel_mesh(ep)  # ("dp", "ep"): EP groups of ep consecutive ranks
        group = model.ep_mesh.get_group("ep")
        cls = expert_parallel_moe()
        for layer in model_layers(model):
            layer.mlp = cls.from_full(layer.mlp, group)
        if dist.get_rank() == 0:
            log.info("expert parallelism: %d experts per layer over %d ranks (%d on each), %d data-parallel "
                     "groups", mcfg.num_local_experts, ep, mcfg.num_local_experts // ep, model.ep_mesh.size(0))
    return model, mcfg


def expert_parallel_moe():
    """seqfuse's ExpertParallelGroupedMLP that, like the model's own
    SeqfuseMixtralSparseMoE, hands its decoder layer the router logits of
    the last forward (the model's load-balancing loss reads them; on each
    rank it covers that rank's tokens, as the cross-entropy does)."""
    from seqfuse.modules.moe_expert_parallel import ExpertParallelGroupedMLP

    class MixtralExpertParallelMoE(ExpertParallelGroupedMLP):
        router_logits = None

        def route(self, x):
            probs, routing_map, logits = super().route(x)
            self.router_logits = logits
            return probs, routing_map, logits

    return MixtralExpertParallelMoE


def wrap_model(model, layers, strategy, world, device, cfg, log_):
    """Data-parallel wrapping.  Without expert parallelism: the shared
    loop's (FSDP2 per decoder layer, then the root).  With it
    (seqfuse.distributed.fully_shard_expert_parallel over the model's
    ("dp", "ep") mesh): every expert module sharded over its dp group, its
    gradients divided by dp x ep (the token exchange has summed them over
    the EP group), then the rest of the model as one unit over every rank."""
    if getattr(model, "ep_mesh", None) is None:
        return _loop.wrap_model(model, layers, strategy, world, device, cfg, log_)
    if strategy != "fsdp2":
        raise ValueError(f"distributed.expert_parallel_size > 1 runs under FSDP2 (train_fsdp2.py), not {strategy}")
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from recipe_common.fsdp import REDUCE_DTYPES
    from seqfuse.distributed import fully_shard_expert_parallel

    d = cfg.distributed
    mp = MixedPrecisionPolicy(reduce_dtype=REDUCE_DTYPES[str(d.reduce_dtype)])
    return fully_shard_expert_parallel(model, model.ep_mesh, mp_policy=mp,
                                       reshard_after_forward=bool(d.reshard_after_forward))


def clip_grad_norm(model, params, max_norm):
    """The gradient norm clip: seqfuse.distributed.clip_grad_norm_ (exact over
    the EP and DP ranks: each expert counted once) with expert parallelism,
    seqfuse.optim.clip_grad_norm_ without."""
    if getattr(model, "ep_mesh", None) is not None:
        from seqfuse.distributed import clip_grad_norm_ as clip_ep

        return clip_ep(model, max_norm)
    from seqfuse.optim import clip_grad_norm_

    return clip_grad_norm_(params, max_norm)


def model_layers(model):
    return model.model.layers


def describe(cfg, mcfg, n_params):
    return (f"Mixtral {cfg.config_name}: {n_params / 1e6:.2f}M parameters, {active_params(mcfg) / 1e6:.2f}M "
            f"active per token (h={mcfg.hidden_size}, L={mcfg.num_hidden_layers}, heads="
            f"{mcfg.num_attention_heads}/{mcfg.num_key_value_heads} kv, {mcfg.num_local_experts} experts of "
            f"ffn={mcfg.intermediate_size}, top-{mcfg.num_experts_per_tok}, aux loss x"
            f"{mcfg.router_aux_loss_coef:g}, vocab={mcfg.vocab_size})")


def forward_loss(model, batch):
    """Training: cross-entropy + router_aux_loss_coef x load-balancing loss
    (the model adds it when output_router_logits is on; the coefficient 0
    turns it off).  Evaluation: the cross-entropy alone."""
    aux = bool(model.training) and float(getattr(model, "module", model).config.router_aux_loss_coef) > 0
    if "cu_seqlens" in batch:
        out = model(input_ids=batch["input_ids"], labels=batch["labels"], cu_seqlens=batch["cu_seqlens"],
                    max_seqlen=int(batch["max_seqlen"]), output_router_logits=aux)
    else:
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"],
                    output_router_logits=aux)
    return out.loss


# ---------------------------------------------------------------- FLOPs
def attention_params(mcfg) -> int:
    h, hd, a, g = mcfg.hidden_size, mcfg.head_dim, mcfg.num_attention_heads, mcfg.num_key_value_heads
    return h * (a + 2 * g) * hd + a * hd * h


def active_params(mcfg) -> int:
    """Weights a token multiplies through: QKV and attention out, the router
    (h x experts), num_experts_per_tok experts' gate + up + down (3 h f
    each) per layer, and the LM head (h V)."""
    h, f, e, k = mcfg.hidden_size, mcfg.intermediate_size, mcfg.num_local_experts, mcfg.num_experts_per_tok
    per_layer = attention_params(mcfg) + h * e + k * 3 * h * f
    return mcfg.num_hidden_layers * per_layer + h * mcfg.vocab_size


def train_flops(seq_lengths, mcfg) -> float:
    """Forward + backward over sequences of these real lengths: the Llama 3
    recipe's causal_lm_train_flops with the active weights only."""
    return llama.causal_lm_train_flops(seq_lengths, active_params(mcfg), mcfg)


def step_flops(host_batch, mcfg):
    return train_flops(batch_seq_lengths(host_batch), mcfg)


# ---------------------------------------------------------------- export
def export(model, mcfg, out_dir, cfg, rank):
    """Gather the whole model (every rank calls this) and, on rank 0, write
    transformers' MixtralForCausalLM directory with the tokenizer files."""
    sd = ckpt.full_model_state_dict(model)
    if getattr(model, "ep_mesh", None) is not None:
        sd.update(gather_experts(model, rank))
    if rank == 0:
        export_hf(mcfg, sd, out_dir, model_max_length=int(cfg.data.max_length))
        log.info("exported Hugging Face MixtralForCausalLM (safetensors) and the nucleotide tokenizer to %s",
                 out_dir)


@torch.no_grad()
def gather_experts(model, rank) -> dict:
    """Every expert's full weight (a collective: every rank calls it), on
    rank 0 (CPU; other ranks get {}): each local expert's FSDP2 shards
    gathered over its dp group, then the experts of the EP group's ranks
    gathered over it, under the single-process model's keys
    (model.layers.<i>.mlp.fc1.weight<e>)."""
    out = {}
    for i, layer in enumerate(model_layers(model)):
        moe = layer.mlp
        for fc_name in ("fc1", "fc2"):
            for g, w in enumerate(getattr(moe, fc_name).weights()):
                full = w.full_tensor() if hasattr(w, "full_tensor") else w.detach()
                parts = [torch.empty_like(full) for _ in range(moe.ep_size)]
                dist.all_gather(parts, full.contiguous(), group=moe.ep_group)
                if rank == 0:
                    for r, part in enumerate(parts):
                        out[f"model.layers.{i}.mlp.{fc_name}.weight{r * moe.num_local_experts + g}"] = part.cpu()
    return out


def export_hf(model_config, state_dict: dict, out_dir: str, model_max_length=None) -> str:
    """The Llama 3 recipe's export_dna_lm (the NucleotideTokenizer's files
    beside the model) of a SeqfuseMixtralForCausalLM, written with
    seqfuse.hf.mixtral_convert.export_hf; returns ``out_dir``."""
    from seqfuse.hf import SeqfuseMixtralForCausalLM
    from seqfuse.hf.mixtral_convert import export_hf as write_mixtral

    return llama.export_dna_lm(SeqfuseMixtralForCausalLM, write_mixtral, model_config, state_dict, out_dir,
                               model_max_length)


# ---------------------------------------------------------------- the run
# evaluate(model, val_loader, cfg, recipe, device) -> the validation cross-entropy (forward_loss leaves out the
# load-balancing loss in evaluation) and train(cfg, strategy="fsdp2"): one training run of Mixtral on DNA with
# this module as the spec (recipe_common.trainer.entry_points).
evaluate, train = _loop.entry_points(__name__)
