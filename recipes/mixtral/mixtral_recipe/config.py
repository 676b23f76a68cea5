"""The Mixtral recipe's configuration: its schema (the groups and keys of
hydra_config/base.yaml), its rules between keys, and its command line.

The recipe trains on the Llama 3 recipe's DNA (recipes/llama3/data, the
same Parquet windows, NucleotideTokenizer and loaders), so the groups that
describe data, optimisation and precision are the Llama 3 recipe's own
dataclasses (llama3_recipe.config), imported, and so are its rules between
keys (``llama3_recipe.config.cross_checks``: attention heads, padding under
FP8, the micro-batch budget, the 1-indexed layer-wise precision rule).
What is new here:

  * the model group: a Mixtral decoder (no published-size key; the named
    configs set the fields): attention as Llama's, and per layer a
    mixture of ``num_local_experts`` SwiGLU experts of width
    ``intermediate_size`` of which the router picks
    ``num_experts_per_tok`` per token, with the load-balancing loss
    weighted by ``router_aux_loss_coef`` (transformers' MixtralConfig
    names);
  * precision.recipe: bf16, fp32 and the FP8 recipes the experts' grouped
    GEMMs run (fp8_delayed, fp8_current, fp8_block).  MXFP8 and NVFP4 are
    refused by name: seqfuse's GroupedLinear has no path for them
    (precision.fp4 is kept, as a key that must stay false, so the Llama 3
    recipe's precision rules read the same group);
  * distributed.expert_parallel_size: experts sharded over that many ranks
    (seqfuse.distributed's expert parallelism, mixtral_recipe/trainer.py); it
    must divide model.num_local_experts here, and the world size at the
    start of the run.

    cfg = load_config("L0_sanity", ["train.steps=100", "precision.recipe=fp8_delayed"])
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

from llama3_recipe.config import DataConfig
from llama3_recipe.config import LlamaDistributedConfig, LlamaTrainConfig
from llama3_recipe.config import PrecisionConfig as LlamaPrecisionConfig
from llama3_recipe.config import cross_checks as causal_lm_cross_checks
from llama3_recipe.config import resolve_layer_precision
from recipe_common.config import RecipeConfig as CommonRecipeConfig
from recipe_common.config import (Bool, Cfg, CheckpointConfig, Choice, ConfigError, ConfigSpec,  # noqa: F401
                                  Float, Int, LoggingConfig, ProfilerConfig, Str, check_paths, rule)

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hydra_config")

#: The FP8 recipes the experts' grouped GEMMs run (seqfuse.modules.GroupedLinear).
FP8_RECIPES = ("fp8_delayed", "fp8_current", "fp8_block")
RECIPES = ("bf16", "fp32") + FP8_RECIPES

# ---------------------------------------------------------------- schema
@dataclass
class ModelConfig:
    hidden_size: int = rule(64, Int(1))
    num_hidden_layers: int = rule(2, Int(1))
    num_attention_heads: int = rule(4, Int(1))
    num_key_value_heads: int = rule(2, Int(1))
    intermediate_size: int = rule(128, Int(1))  # each expert's SwiGLU width
    num_local_experts: int = rule(4, Int(1))
    num_experts_per_tok: int = rule(2, Int(1))
    router_aux_loss_coef: float = rule(0.02, Float(0.0))
    tie_word_embeddings: bool = rule(False, Bool())
    rope_theta: float = rule(1000000.0, Float(0.0, lo_open=True))
    max_position_embeddings: int = rule(8192, Int(1))


@dataclass
class PrecisionConfig(LlamaPrecisionConfig):
    recipe: str = rule("bf16", Choice(*RECIPES))


@dataclass
class MixtralDistributedConfig(LlamaDistributedConfig):
    expert_parallel_size: int = rule(1, Int(1))


@dataclass
class RecipeConfig(CommonRecipeConfig):
    """The whole Mixtral recipe config: the shared root (device, checkpoint,
    logging, profiler) with the Llama 3 recipe's data and train groups and
    Mixtral's own; base.yaml holds the same defaults."""
    run_name: str = rule("mixtral", Str())
    data: DataConfig = field(default_factory=DataConfig)
    train: LlamaTrainConfig = field(default_factory=LlamaTrainConfig)
    distributed: MixtralDistributedConfig = field(default_factory=MixtralDistributedConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)


# ---------------------------------------------------------------- rules
def layer_precision(cfg):
    """Per decoder layer (0-indexed list): "fp8" or None (bf16), the Llama 3
    recipe's 1-indexed precision.fp8_layers rule."""
    p = cfg["precision"]
    return resolve_layer_precision(int(cfg["model"]["num_hidden_layers"]), p["recipe"] in FP8_RECIPES,
                                   bool(p["fp4"]), p["fp8_layers"], p["fp4_layers"])


def fp8_shape_problems(m, recipe):
    """The FP8 GEMMs' feature sizes (seqfuse.quantization.gemm_quantizers.
    check_features: multiples of 16, of 128 under block scaling) of a model
    group, as lines naming the key that sets each size.  The GEMMs: QKV
    (hidden -> (heads + 2 kv heads) x head_dim), the attention output
    (heads x head_dim -> hidden), the experts' fc1 (hidden -> 2 x
    intermediate) and fc2 (intermediate -> hidden); the router and the LM
    head are not FP8."""
    mult = 128 if recipe == "fp8_block" else 16
    rule = f"must be a multiple of {mult} under precision.recipe={recipe} (" + \
        ("whole 128-wide scaling blocks" if mult == 128 else "FP8 GEMM operands") + ")"
    h, a, g, f = m["hidden_size"], m["num_attention_heads"], m["num_key_value_heads"], m["intermediate_size"]
    out = []
    if h % mult:
        out.append(f"model.hidden_size={h}: {rule}")
    if f % mult:
        out.append(f"model.intermediate_size={f}: {rule}")
    if not out and (2 * g * (h // a)) % mult:
        out.append(f"model.num_key_value_heads={g}: the QKV GEMM's output, (num_attention_heads + 2 x "
                   f"num_key_value_heads) x head_dim = {(a + 2 * g) * (h // a)}, {rule}")
    return out


def _cross_checks(c, ok, problems):
    """The Llama 3 recipe's rules (same data, precision and attention keys),
    then Mixtral's own: the router's top-k, the FP8 GEMMs' sizes, no FP4,
    expert parallelism."""
    causal_lm_cross_checks(c, ok, problems)
    m, p, dist = c["model"], c["precision"], c["distributed"]
    if ok("model.num_experts_per_tok", "model.num_local_experts") \
            and m["num_experts_per_tok"] > m["num_local_experts"]:
        problems.append(f"model.num_experts_per_tok={m['num_experts_per_tok']}: must be <= "
                        f"model.num_local_experts={m['num_local_experts']} (the router picks that many experts "
                        f"per token)")
    keys = ("precision.recipe", "model.hidden_size", "model.num_attention_heads", "model.num_key_value_heads",
            "model.intermediate_size")
    if ok(*keys) and p["recipe"] in FP8_RECIPES and m["hidden_size"] % m["num_attention_heads"] == 0:
        problems.extend(fp8_shape_problems(m, p["recipe"]))
    if ok("precision.fp4") and p["fp4"]:
        problems.append("precision.fp4=true: the Mixtral recipe has no NVFP4 path (seqfuse's GroupedLinear, the "
                        "experts' GEMMs, runs bf16 and FP8 only); set precision.fp4=false")
    ep = dist["expert_parallel_size"] if ok("distributed.expert_parallel_size") else None
    if ep and ok("model.num_local_experts") and m["num_local_experts"] % ep:
        problems.append(f"distributed.expert_parallel_size={ep}: must divide model.num_local_experts="
                        f"{m['num_local_experts']} (each rank of an expert-parallel group holds as many experts)")
    if ep and ep > 1 and ok("precision.recipe") and p["recipe"] == "fp8_delayed":
        problems.append(f"distributed.expert_parallel_size={ep} with precision.recipe=fp8_delayed: delayed "
                        "scaling's amax histories are reduced over all ranks, where each expert-parallel rank "
                        "holds other experts (their histories would be joined); use fp8_current or fp8_block")


SPEC = ConfigSpec(RecipeConfig, CONFIG_DIR, cross_checks=_cross_checks, title="the Mixtral recipe",
                  requirements="recipes/mixtral/requirements.txt", logger="mixtral")


# The recipe's entry points: the spec's methods (signatures in recipe_common.config.ConfigSpec.entry_points).
validate_config, schema_defaults, compose_config, load_config, parse_args, main_entry = SPEC.entry_points()
