"""The ESM-2 recipe's configuration: its schema (the groups and keys of
hydra_config/base.yaml, one dataclass per group, each field with its rule)
and its rules between keys.  The machinery (Hydra composition, checking,
the ConfigError that lists every bad key, path checks, the command line) is
shared with the other recipes: recipes/recipe_common/config.py.

    cfg = load_config("L0_sanity", ["train.steps=100", "precision.recipe=fp8_delayed"])

Every bad key is reported, all together, in one ``ConfigError`` (a
ValueError), one line per key naming the key, the value and the rule:

    config L0_sanity: 2 bad keys
      train.steps=-5: must be an integer >= 1
      device='tpu': must be one of 'auto', 'cpu', 'cuda'
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

from recipe_common.config import DataConfig as CommonDataConfig
from recipe_common.config import RecipeConfig as CommonRecipeConfig
from recipe_common.config import (Bool, Cfg, CheckpointConfig, Choice, ConfigError, ConfigSpec,  # noqa: F401
                                  DistributedConfig, Float, Int, IntList, LoggingConfig, ProfilerConfig, Str,
                                  TrainConfig, check_paths, rule, token_budget_checks)

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hydra_config")

ESM2_SIZES = ("8M", "35M", "150M", "650M", "3B", "15B")  # seqfuse.hf.esm_config.ESM2_SHAPES
MLP_ACTIVATIONS = ("gelu", "gelu_erf", "relu", "silu", "swiglu", "geglu", "reglu", "geglu_erf")
RECIPES = ("bf16", "fp32", "fp8_delayed", "fp8_current", "fp8_block")


# ---------------------------------------------------------------- schema
@dataclass
class ModelConfig:
    size: Optional[str] = rule(None, Choice(*ESM2_SIZES, optional=True, null_means="the fields below"))
    hidden_size: int = rule(320, Int(1))
    num_hidden_layers: int = rule(6, Int(1))
    num_attention_heads: int = rule(20, Int(1))
    intermediate_size: int = rule(1280, Int(1))
    mlp_activation: str = rule("gelu_erf", Choice(*MLP_ACTIVATIONS))
    recompute_activation: bool = rule(False, Bool())  # SeqfuseEsmConfig.mlp_recompute_activation


@dataclass
class DataConfig(CommonDataConfig):
    path: str = rule("recipes/esm2/data/subset", Str())
    max_length: int = rule(1024, Int(3))  # <cls>, one residue, <eos>
    mask_prob: float = rule(0.15, Float(0.0, 1.0, lo_open=True))
    fixed_length: bool = rule(False, Bool())  # every sample exactly max_length tokens (esm2_recipe.trainer)


@dataclass
class Esm2TrainConfig(TrainConfig):
    """The shared train group plus ESM-2's graphed layers (esm2_recipe/graphs.py)."""
    cuda_graphs: bool = rule(False, Bool())
    cuda_graphs_max_sequences: Optional[int] = rule(None, Int(1, optional=True,
                                                               null_means="1.5 x an average batch's sequences + the padding's room"))


@dataclass
class PrecisionConfig:
    recipe: str = rule("bf16", Choice(*RECIPES))
    param_dtype: str = rule("auto", Choice("auto", "bf16", "fp32"))
    bf16_first_layers: int = rule(0, Int(0))
    bf16_last_layers: int = rule(0, Int(0))
    bf16_layers: list = rule([], IntList())
    fp8_format: str = rule("hybrid", Choice("hybrid", "e4m3"))
    amax_history_len: int = rule(1024, Int(1))
    amax_compute_algo: str = rule("max", Choice("max", "most_recent"))


@dataclass
class RecipeConfig(CommonRecipeConfig):
    """The whole ESM-2 recipe config: the shared root (device, checkpoint,
    logging, distributed, profiler) with ESM-2's groups; base.yaml holds the
    same defaults."""
    run_name: str = rule("esm2", Str())
    data: DataConfig = field(default_factory=DataConfig)
    train: Esm2TrainConfig = field(default_factory=Esm2TrainConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)


def _cross_checks(c, ok, problems):
    """Rules between keys, checked where the keys themselves are good
    (train.stop_at against train.steps is a shared rule)."""
    m, d = c["model"], c["data"]
    if not m["size"] and ok("model.hidden_size", "model.num_attention_heads"):
        h, a = m["hidden_size"], m["num_attention_heads"]
        if h % a or (h // a) % 2:
            problems.append(f"model.num_attention_heads={a}: must divide model.hidden_size={h} into an even "
                            f"head dim (rotary embeddings)")
    fp8 = c["precision"]["recipe"].startswith("fp8") if ok("precision.recipe") else False
    mult = token_budget_checks(c, ok, problems, fp8, ("precision.recipe",), "FP8", "protein")
    if mult is not None and ok("data.fixed_length") and d["fixed_length"] and d["max_length"] % mult:
        problems.append(f"data.max_length={d['max_length']}: must be a multiple of {mult} with "
                        f"data.fixed_length=true (the token multiple of data.pad_to_multiple_of, 16 under "
                        f"FP8): fixed-length batches would be padded")
    _graph_checks(c, ok, problems)


def _graph_checks(c, ok, problems):
    """train.cuda_graphs: each encoder layer's forward and backward replay a
    CUDA graph (esm2_recipe/graphs.py).  Packed THD batches are padded to
    the graphs' bounds on the device; padded [B, L] batches must all have
    one shape and no padding (fixed-length windows), else nearly every step
    would run eagerly: refused, not run eagerly behind the user's back."""
    t, d = c["train"], c["data"]
    if not (ok("train.cuda_graphs") and t["cuda_graphs"]):
        return
    if ok("data.packed") and not d["packed"] and ok("data.fixed_length") and not d["fixed_length"]:
        problems.append("train.cuda_graphs=true: needs data.packed=true or data.fixed_length=true (padded "
                        "real-length batches change shape every step; a CUDA graph replays one batch shape)")

    if ok("train.activation_checkpointing") and t["activation_checkpointing"]:
        problems.append("train.cuda_graphs=true: needs train.activation_checkpointing=false (graphed layers keep "
                        "their activations in the graphs' memory; recomputation has nothing to save)")
    if ok("device") and c["device"] == "cpu":
        problems.append("train.cuda_graphs=true: needs a CUDA device, got device='cpu'")


SPEC = ConfigSpec(RecipeConfig, CONFIG_DIR, cross_checks=_cross_checks, title="the ESM-2 recipe",
                  requirements="recipes/esm2/requirements.txt", logger="esm2")


# The recipe's entry points: the spec's methods (signatures in recipe_common.config.ConfigSpec.entry_points).
validate_config, schema_defaults, compose_config, load_config, parse_args, main_entry = SPEC.entry_points()
