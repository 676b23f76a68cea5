"""The Llama 3 recipe's configuration: its schema (the groups and keys of
hydra_config/base.yaml, one dataclass per group, each field with its rule),
its rules between keys, and the layer-wise precision rule.  The machinery
(Hydra composition, checking, the ConfigError that lists every bad key, path
checks, the command line) is shared with the other recipes:
recipes/recipe_common/config.py.

    cfg = load_config("L0_sanity", ["train.steps=100", "precision.recipe=fp8_delayed", "precision.fp8_layers=[2]"])

Layer-wise precision, as BioNeMo's Llama 3 recipe defines it
(``resolve_layer_precision``): ``precision.fp8_layers`` and
``precision.fp4_layers`` are 1-indexed layer lists.  FP8 is on when
precision.recipe is an FP8 recipe (fp8_delayed, fp8_current, fp8_block,
mxfp8); FP4 (NVFP4) when precision.fp4 is true.  A format that is on with no
list takes every layer the other format's list does not claim (so with only
FP8 on and no list, all layers run FP8); both on with no list at all is an
error (which layers would be which?).  Layers in neither run bf16.  Unlike
BioNeMo's recipe, a list for a format that is off is an error instead of
being dropped without a word.  Whether the device can run the formats
(MXFP8 and NVFP4 GEMMs need compute capability 10.x, Blackwell) is checked
by the trainer at the start (llama3_recipe.trainer.check_run), naming the
first layer that would need them.
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

#: seqfuse.hf.llama_config.LLAMA3_SHAPES: size -> number of layers (the rest of the shape is read there)
LLAMA3_LAYERS = {"1B": 16, "3B": 28, "8B": 32, "70B": 80}
FP8_RECIPES = ("fp8_delayed", "fp8_current", "fp8_block", "mxfp8")
RECIPES = ("bf16", "fp32") + FP8_RECIPES


# ---------------------------------------------------------------- schema
@dataclass
class ModelConfig:
    size: Optional[str] = rule(None, Choice(*LLAMA3_LAYERS, optional=True, null_means="the fields below"))
    hidden_size: int = rule(64, Int(1))
    num_hidden_layers: int = rule(2, Int(1))
    num_attention_heads: int = rule(4, Int(1))
    num_key_value_heads: int = rule(2, Int(1))
    intermediate_size: int = rule(256, Int(1))
    tie_word_embeddings: bool = rule(True, Bool())
    rope_theta: float = rule(500000.0, Float(0.0, lo_open=True))
    max_position_embeddings: int = rule(8192, Int(1))
    recompute_activation: bool = rule(False, Bool())  # SeqfuseLlamaConfig.mlp_recompute_activation


@dataclass
class DataConfig(CommonDataConfig):
    path: str = rule("recipes/llama3/data/subset", Str())
    max_length: int = rule(8192, Int(3))  # <bos>, one base, <eos>


@dataclass
class LlamaTrainConfig(TrainConfig):
    lr: float = rule(3.0e-4, Float(0.0, lo_open=True))
    weight_decay: float = rule(0.1, Float(0.0))
    betas: list = rule([0.9, 0.95], TrainConfig.__dataclass_fields__["betas"].metadata["rule"])


@dataclass
class PrecisionConfig:
    recipe: str = rule("bf16", Choice(*RECIPES))
    param_dtype: str = rule("auto", Choice("auto", "bf16", "fp32"))
    fp8_layers: Optional[list] = rule(None, IntList(optional=True, null_means="every layer fp4_layers leaves"))
    fp4: bool = rule(False, Bool())
    fp4_layers: Optional[list] = rule(None, IntList(optional=True, null_means="every layer fp8_layers leaves"))
    fp8_format: str = rule("hybrid", Choice("hybrid", "e4m3"))
    amax_history_len: int = rule(1024, Int(1))
    amax_compute_algo: str = rule("max", Choice("max", "most_recent"))


@dataclass
class LlamaDistributedConfig(DistributedConfig):
    layers_per_unit: int = rule(1, Int(1))


@dataclass
class RecipeConfig(CommonRecipeConfig):
    """The whole Llama 3 recipe config: the shared root (device, checkpoint,
    logging, profiler) with Llama's groups and context-parallel keys;
    base.yaml holds the same defaults."""
    run_name: str = rule("llama3", Str())
    data: DataConfig = field(default_factory=DataConfig)
    train: LlamaTrainConfig = field(default_factory=LlamaTrainConfig)
    distributed: LlamaDistributedConfig = field(default_factory=LlamaDistributedConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    # context parallelism (train_fsdp2_cp.py; the other scripts refuse cp_size > 1)
    cp_size: int = rule(1, Int(1))
    cp_comm_type: str = rule("p2p", Choice("p2p", "all_gather"))


# ---------------------------------------------------------------- layer-wise precision
def num_layers(model_cfg) -> int:
    """Decoder layers of a model group: model.size's, else model.num_hidden_layers (a group without a size
    key, as the Mixtral recipe's, which reuses these rules, reads the latter)."""
    size = model_cfg.get("size")
    return LLAMA3_LAYERS[size] if size else int(model_cfg["num_hidden_layers"])


def resolve_layer_precision(n_layers, fp8_on, fp4_on, fp8_layers, fp4_layers):
    """Per layer (0-indexed list of length ``n_layers``): "fp8", "fp4" or
    None (bf16), from 1-indexed lists, BioNeMo's rule (see the module note).
    Raises ValueError naming the key and the rule."""
    every = set(range(1, n_layers + 1))
    problems = []
    for key, lst, on, what in (("precision.fp8_layers", fp8_layers, fp8_on, "FP8 is off (precision.recipe is "
                                "not an FP8 recipe)"),
                               ("precision.fp4_layers", fp4_layers, fp4_on, "FP4 is off (precision.fp4=false)")):
        if lst is None:
            continue
        if not on:
            problems.append(f"{key}={lst}: {what}; set it to null or turn the format on")
        bad = [i for i in lst if i not in every]
        if bad:
            problems.append(f"{key}={lst}: layer {bad[0]} is not a layer of this {n_layers}-layer model "
                            f"(1-indexed: 1..{n_layers})")
        dup = sorted({i for i in lst if lst.count(i) > 1})
        if dup:
            problems.append(f"{key}={lst}: layer {dup[0]} is listed twice")
    if fp8_on and fp4_on and fp8_layers is None and fp4_layers is None:
        problems.append("precision.fp8_layers / precision.fp4_layers: both FP8 and FP4 are on and neither list is "
                        "given: say which layers run which (one list is enough: the other format takes the rest)")
    if not problems and fp8_layers is not None and fp4_layers is not None:
        both = sorted(set(fp8_layers) & set(fp4_layers))
        if both:
            problems.append(f"precision.fp8_layers / precision.fp4_layers: layer {both[0]} is in both lists "
                            f"(overlap {both})")
    if problems:
        raise ValueError("\n".join(problems))
    if fp8_on and fp8_layers is None:
        fp8_layers = sorted(every - set(fp4_layers or ()))
    if fp4_on and fp4_layers is None:
        fp4_layers = sorted(every - set(fp8_layers or ()))
    fp8 = set(fp8_layers or ()) if fp8_on else set()
    fp4 = set(fp4_layers or ()) if fp4_on else set()
    return ["fp8" if i in fp8 else "fp4" if i in fp4 else None for i in range(1, n_layers + 1)]


def layer_precision(cfg):
    """resolve_layer_precision of a checked config."""
    p = cfg["precision"]
    return resolve_layer_precision(num_layers(cfg["model"]), p["recipe"] in FP8_RECIPES, bool(p["fp4"]),
                                   p["fp8_layers"], p["fp4_layers"])


def cross_checks(c, ok, problems):
    """Rules between keys, checked where the keys themselves are good.  The
    Mixtral recipe (recipes/mixtral), on the same DNA with the same data and
    precision groups, runs these too: its model group has no size key."""
    m, d, p = c["model"], c["data"], c["precision"]
    size = m.get("size")
    if not size and ok("model.hidden_size", "model.num_attention_heads", "model.num_key_value_heads"):
        h, a, g = m["hidden_size"], m["num_attention_heads"], m["num_key_value_heads"]
        if h % a or (h // a) % 2:
            problems.append(f"model.num_attention_heads={a}: must divide model.hidden_size={h} into an even "
                            f"head dim (rotary embeddings)")
        elif a % g:
            problems.append(f"model.num_key_value_heads={g}: must divide model.num_attention_heads={a} "
                            f"(grouped-query attention)")
    quantized = (p["recipe"] in FP8_RECIPES or p["fp4"]) if ok("precision.recipe", "precision.fp4") else False
    token_budget_checks(c, ok, problems, quantized, ("precision.recipe", "precision.fp4"), "FP8 / FP4", "window")
    if ok("data.max_length", "model.max_position_embeddings") and not size \
            and d["max_length"] > m["max_position_embeddings"]:
        problems.append(f"data.max_length={d['max_length']}: must be <= model.max_position_embeddings="
                        f"{m['max_position_embeddings']}")
    if ok("precision.recipe", "precision.fp4", "precision.fp8_layers", "precision.fp4_layers", "model.size",
          "model.num_hidden_layers"):
        try:
            layer_precision(c)
        except ValueError as e:
            problems.extend(str(e).splitlines())


SPEC = ConfigSpec(RecipeConfig, CONFIG_DIR, cross_checks=cross_checks, title="the Llama 3 recipe",
                  requirements="recipes/llama3/requirements.txt", logger="llama3")


# The recipe's entry points: the spec's methods (signatures in recipe_common.config.ConfigSpec.entry_points).
validate_config, schema_defaults, compose_config, load_config, parse_args, main_entry = SPEC.entry_points()
