"""Configuration machinery shared by the training recipes (recipes/esm2,
recipes/llama3): YAML files composed by Hydra's compose API and checked
against a dataclass schema before anything heavy starts.

A recipe describes itself with a ``ConfigSpec``: its name, its hydra_config
folder, its schema (a dataclass of dataclass groups, one field per key, each
with its ``rule``), its rules between keys, and where its requirements are
listed.  The spec then gives the recipe's ``load_config`` / ``compose_config``
/ ``validate_config`` / ``check_paths`` / ``parse_args`` / ``main_entry``.

Composition and overrides are Hydra's own (``defaults: [base, _self_]``,
``group.key=value``, ``+group.key=value`` to add, ``~group.key`` to delete;
the override grammar of hydra.cc), so the files and the command line behave
as BioNeMo's users know them.  hydra-core is a declared dependency of the
recipes (recipes/*/requirements.txt); there is no second reader.

Every bad key is reported, all together, in one ``ConfigError`` (a
ValueError), one line per key naming the key, the value and the rule:

    config L0_sanity: 2 bad keys
      train.steps=-5: must be an integer >= 1
      device='tpu': must be one of 'auto', 'cpu', 'cuda'

Unknown keys (a typo, or a ``+key`` the recipe does not read) are errors
too: a key nothing reads would be a silent wrong answer.  The trainer gets a
plain nested dict (``Cfg``) with the values normalised to the schema's types
(an integer where a float is expected becomes a float).

The groups every recipe has with the same keys (train, data, checkpoint,
logging, distributed, profiler) are defined here, and so is the root that
holds them (RecipeConfig); a recipe subclasses one to change a default or
add keys or groups (a dataclass field redefined keeps its place; a new one
comes after the shared ones).
"""
from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import os
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, Optional


class ConfigError(ValueError):
    """A config that cannot run: one line per bad key (``.problems``)."""

    def __init__(self, name, problems):
        self.problems = list(problems)
        n = len(self.problems)
        super().__init__(f"config {name}: {n} bad key{'s' if n != 1 else ''}\n  " + "\n  ".join(self.problems))


class Cfg(dict):
    """A dict whose keys read as attributes (cfg.train.lr), recursively."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"config has no key {name!r} (keys: {sorted(self)})") from None

    def __setattr__(self, name, value):
        self[name] = value

    @staticmethod
    def wrap(d):
        if isinstance(d, dict):
            return Cfg({k: Cfg.wrap(v) for k, v in d.items()})
        if isinstance(d, list):
            return [Cfg.wrap(v) for v in d]
        return d

    def to_dict(self):
        def unwrap(v):
            if isinstance(v, dict):
                return {k: unwrap(x) for k, x in v.items()}
            if isinstance(v, list):
                return [unwrap(x) for x in v]
            return v
        return unwrap(self)


# ---------------------------------------------------------------- rules
class _Bad(Exception):
    pass


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class Rule:
    """A field's rule: ``check(value)`` returns the normalised value or
    raises _Bad; ``text`` is what the error line says."""

    text = ""
    optional = False
    null_means = ""

    def __call__(self, v):
        if v is None:
            if self.optional:
                return None
            raise _Bad(self.describe())
        return self.check(v)

    def describe(self):
        return self.text + (f", or null ({self.null_means})" if self.optional and self.null_means
                            else ", or null" if self.optional else "")

    def check(self, v):
        raise NotImplementedError


class Int(Rule):
    def __init__(self, lo=None, hi=None, optional=False, null_means="", also=()):
        self.lo, self.hi, self.optional, self.null_means, self.also = lo, hi, optional, null_means, tuple(also)
        bounds = (f" >= {lo}" if hi is None else f" in [{lo}, {hi}]") if lo is not None else \
                 (f" <= {hi}" if hi is not None else "")
        self.text = "must be an integer" + bounds + "".join(f", or {a!r}" for a in self.also)

    def check(self, v):
        if v in self.also and isinstance(v, str):
            return v
        if not _is_int(v):
            raise _Bad(self.describe())
        if (self.lo is not None and v < self.lo) or (self.hi is not None and v > self.hi):
            raise _Bad(self.describe())
        return int(v)


class Float(Rule):
    def __init__(self, lo=None, hi=None, lo_open=False, hi_open=False, optional=False, null_means=""):
        self.lo, self.hi, self.lo_open, self.hi_open = lo, hi, lo_open, hi_open
        self.optional, self.null_means = optional, null_means
        parts = []
        if lo is not None:
            parts.append(f"{'>' if lo_open else '>='} {lo:g}")
        if hi is not None:
            parts.append(f"{'<' if hi_open else '<='} {hi:g}")
        self.text = "must be a finite number" + (" " + " and ".join(parts) if parts else "")

    def check(self, v):
        if not _is_num(v) or not math.isfinite(v):
            raise _Bad(self.describe())
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            raise _Bad(self.describe())
        if self.hi is not None and (v >= self.hi if self.hi_open else v > self.hi):
            raise _Bad(self.describe())
        return float(v)


class Bool(Rule):
    text = "must be true or false"

    def check(self, v):
        if not isinstance(v, bool):
            raise _Bad(self.describe())
        return v


class Choice(Rule):
    def __init__(self, *values, optional=False, null_means=""):
        self.values, self.optional, self.null_means = values, optional, null_means
        self.text = "must be one of " + ", ".join(repr(x) for x in values)

    def check(self, v):
        if not isinstance(v, str) or v not in self.values:
            raise _Bad(self.describe())
        return v


class Str(Rule):
    def __init__(self, optional=False, null_means="", what="a non-empty string"):
        self.optional, self.null_means = optional, null_means
        self.text = f"must be {what}"

    def check(self, v):
        if not isinstance(v, str) or not v:
            raise _Bad(self.describe())
        return v


class IntList(Rule):
    text = "must be a list of integers (or one integer)"

    def __init__(self, optional=False, null_means=""):
        self.optional, self.null_means = optional, null_means

    def check(self, v):
        if _is_int(v):
            return [int(v)]
        if not isinstance(v, (list, tuple)) or not all(_is_int(x) for x in v):
            raise _Bad(self.describe())
        return [int(x) for x in v]


class Betas(Rule):
    text = "must be a list of two numbers, each >= 0 and < 1"

    def check(self, v):
        if (not isinstance(v, (list, tuple)) or len(v) != 2
                or not all(_is_num(x) and math.isfinite(x) and 0 <= x < 1 for x in v)):
            raise _Bad(self.describe())
        return [float(x) for x in v]


def rule(default, r: Rule, doc=""):
    """A schema field: its default (as base.yaml) and its rule."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"rule": r, "doc": doc})
    return field(default=default, metadata={"rule": r, "doc": doc})



# ---------------------------------------------------------------- shared groups
@dataclass
class TrainConfig:
    steps: int = rule(1000, Int(1))
    stop_at: Optional[int] = rule(None, Int(1, optional=True, null_means="train.steps"))
    grad_accum: int = rule(1, Int(1))
    activation_checkpointing: bool = rule(False, Bool())
    lr: float = rule(4.0e-4, Float(0.0, lo_open=True))
    warmup_steps: int = rule(100, Int(0))
    decay: str = rule("cosine", Choice("cosine", "linear", "constant"))
    min_lr_ratio: float = rule(0.1, Float(0.0, 1.0))
    weight_decay: float = rule(0.01, Float(0.0))
    betas: list = rule([0.9, 0.98], Betas())
    eps: float = rule(1.0e-8, Float(0.0, lo_open=True))
    adam_moments: str = rule("float32", Choice("float32", "bfloat16"),
                             "FusedAdamW's moment dtype: bfloat16 keeps 4 bytes a parameter less (the moments "
                             "read, updated in fp32 and stored rounded); the fp32 master weights stay")
    master_weights: bool = rule(True, Bool(),
                                "FusedAdamW's fp32 master copy of each bf16 / fp16 parameter (false: the update "
                                "runs on the parameter itself, 4 bytes a parameter less; with adam_moments="
                                "bfloat16 that is torch.optim.AdamW's update and state on bf16 parameters)")
    clip_grad_norm: Optional[float] = rule(1.0, Float(0.0, lo_open=True, optional=True, null_means="no clipping"))
    seed: int = rule(42, Int(0))
    eval_interval: int = rule(100, Int(0))
    log_interval: int = rule(10, Int(1))


@dataclass
class DataConfig:
    """The data keys every recipe reads (seqfuse.data's loaders); a recipe
    sets its own path and max_length defaults and adds its keys."""
    path: str = rule("data/subset", Str())
    max_length: int = rule(1024, Int(3))
    micro_batch_tokens: int = rule(16384, Int(1))
    packed: bool = rule(True, Bool())
    pad_to_multiple_of: Any = rule("auto", Int(1, optional=True, null_means="no padding", also=("auto",)))
    bucket_size: Optional[int] = rule(None, Int(1, optional=True, null_means="no bucketing"))
    balance_ranks: bool = rule(True, Bool())
    num_workers: int = rule(0, Int(0))
    val_batches: Optional[int] = rule(16, Int(1, optional=True, null_means="the whole split"))


@dataclass
class CheckpointConfig:
    dir: Optional[str] = rule(None, Str(optional=True, null_means="no checkpoints", what="a directory path"))
    interval: int = rule(0, Int(0))
    keep_last: int = rule(2, Int(1))
    resume: bool = rule(True, Bool())
    resume_from: Optional[str] = rule(None, Str(optional=True, null_means="the newest good one in dir",
                                                what="a checkpoint directory path"))
    export_dir: Optional[str] = rule(None, Str(optional=True, null_means="no export", what="a directory path"))


@dataclass
class LoggingConfig:
    tensorboard_dir: Optional[str] = rule(None, Str(optional=True, null_means="no TensorBoard",
                                                    what="a directory path"))
    progress_bar: bool = rule(True, Bool())
    metrics_jsonl: Optional[str] = rule(None, Str(optional=True, null_means="none", what="a file path"))


@dataclass
class DistributedConfig:
    backend: str = rule("auto", Choice("auto", "nccl", "gloo"))
    reshard_after_forward: bool = rule(False, Bool())
    reduce_dtype: str = rule("bfloat16", Choice("bfloat16", "float32"))
    prefetch: int = rule(0, Int(0))
    layers_per_unit: int = rule(11, Int(1))


@dataclass
class ProfilerConfig:
    enabled: bool = rule(False, Bool())
    start_step: int = rule(10, Int(1))
    end_step: int = rule(12, Int(1))


@dataclass
class RecipeConfig:
    """The root keys and groups every recipe has.  A recipe's root schema
    subclasses it: it sets run_name's default, gives data, train and
    distributed its own group where it changes them (they keep their place)
    and adds its model and precision groups and its own keys (after these)."""
    run_name: str = rule("run", Str())
    device: str = rule("auto", Choice("auto", "cpu", "cuda"))
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)


def common_cross_checks(c, ok, problems):
    """Rules between keys of the shared groups."""
    t = c["train"]
    if t["stop_at"] is not None and ok("train.stop_at", "train.steps") and t["stop_at"] > t["steps"]:
        problems.append(f"train.stop_at={t['stop_at']}: must be <= train.steps={t['steps']} "
                        f"(or null: run to train.steps)")
    p = c.get("profiler")
    if isinstance(p, dict) and p.get("enabled") and ok("profiler.start_step", "profiler.end_step") \
            and p["end_step"] < p["start_step"]:
        problems.append(f"profiler.end_step={p['end_step']}: must be >= profiler.start_step={p['start_step']}")


def token_budget_checks(c, ok, problems, quantized, quantized_by, gemms, unit):
    """The data group's token rules, shared by the recipes: under a
    quantized recipe (``quantized``, set by the keys ``quantized_by``, whose
    ``gemms`` GEMMs need it) data.pad_to_multiple_of must be a multiple of
    16 or 'auto'; one cropped ``unit`` (data.max_length tokens, padded to
    the token multiple) must fit data.micro_batch_tokens.  Returns that
    token multiple (16 for 'auto' under a quantized recipe, 1 without
    padding), or None where those data keys are bad."""
    d = c["data"]
    pad = d["pad_to_multiple_of"]
    if ok("data.pad_to_multiple_of") and quantized and pad != "auto" and (pad is None or pad % 16):
        said = []
        for key in quantized_by:
            group, name = key.split(".")
            said.append(f"{key}={c[group][name]}")
        problems.append(f"data.pad_to_multiple_of={pad!r}: must be a multiple of 16 (or 'auto') under "
                        f"{' / '.join(said)} ({gemms} GEMMs need it)")
    if not ok("data.max_length", "data.micro_batch_tokens", "data.pad_to_multiple_of"):
        return None
    mult = 16 if pad == "auto" and quantized else (pad if isinstance(pad, int) else 1)
    need = -(-d["max_length"] // mult) * mult
    if d["micro_batch_tokens"] < need:
        problems.append(f"data.micro_batch_tokens={d['micro_batch_tokens']}: must be >= data.max_length="
                        f"{d['max_length']} (padded: {need}): one cropped {unit} must fit a micro-batch")
    return mult


# ---------------------------------------------------------------- checking and loading
def _show(v):
    return repr(v.to_dict() if isinstance(v, Cfg) else v)


def _check_section(schema, d, prefix, problems):
    out = {}
    names = {f.name: f for f in dataclasses.fields(schema)}
    for key in d:
        if key not in names:
            where = f"the {prefix[:-1]} group" if prefix else "the top level"
            near = difflib.get_close_matches(str(key), list(names), n=1)
            hint = f" (did you mean {prefix}{near[0]}?)" if near else f" (keys: {', '.join(names)})"
            problems.append(f"{prefix}{key}={_show(d[key])}: not a key of {where}{hint}")
    for name, f in names.items():
        key = prefix + name
        sub_schema = f.default_factory
        if sub_schema is not dataclasses.MISSING and dataclasses.is_dataclass(sub_schema):
            sub = d.get(name, {})
            if not isinstance(sub, dict):
                problems.append(f"{key}={_show(sub)}: must be a group of keys "
                                f"({', '.join(x.name for x in dataclasses.fields(sub_schema))})")
                continue
            out[name] = _check_section(sub_schema, sub, key + ".", problems)
            continue
        if name not in d:  # not in the YAML: the schema's default
            out[name] = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            continue
        try:
            out[name] = f.metadata["rule"](d[name])
        except _Bad as e:
            problems.append(f"{key}={_show(d[name])}: {e}")
    return out


def _unwritable(path):
    """Why directory ``path`` cannot be written (None when it can): the
    directory, or the nearest existing one it would be created in, must
    take a new file.  Nothing is created."""
    p = os.path.abspath(path)
    if os.path.exists(p) and not os.path.isdir(p):
        return "exists and is not a directory"
    probe = p
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        return f"cannot be created: {probe} is a file"
    try:
        fd, tmp = tempfile.mkstemp(dir=probe, prefix=".seqfuse_write_test_")
        os.close(fd)
        os.remove(tmp)
    except OSError as e:
        return f"is not writable ({e.strerror}: {probe})"
    return None


def check_paths(cfg, name=None):
    """Before anything heavy: the output directories (checkpoint.dir,
    checkpoint.export_dir, logging.tensorboard_dir, the metrics_jsonl's
    folder) must be writable and checkpoint.resume_from must exist.  All
    problems in one ConfigError."""
    problems = []
    outs = [("checkpoint.dir", cfg.checkpoint.dir), ("checkpoint.export_dir", cfg.checkpoint.export_dir),
            ("logging.tensorboard_dir", cfg.logging.tensorboard_dir)]
    jl = cfg.logging.metrics_jsonl
    if jl:
        if os.path.isdir(jl):
            problems.append(f"logging.metrics_jsonl={jl!r}: is a directory, must be a file path")
        else:
            outs.append(("logging.metrics_jsonl", os.path.dirname(os.path.abspath(jl))))
    for key, path in outs:
        if path:
            why = _unwritable(path)
            if why:
                problems.append(f"{key}={path!r}: {why}")
    rf = cfg.checkpoint.get("resume_from")
    if rf and not os.path.isdir(rf):
        problems.append(f"checkpoint.resume_from={rf!r}: is not a checkpoint directory")
    if problems:
        raise ConfigError(name or cfg.get("config_name", "?"), problems)


class ConfigSpec:
    """One recipe's configuration: ``schema`` (the root dataclass),
    ``config_dir`` (its hydra_config folder), ``cross_checks(c, ok,
    problems)`` (rules between keys, beyond the shared ones; ``ok(*keys)``
    says the keys themselves are good), ``title`` (for messages, e.g.
    "the ESM-2 recipe"), ``requirements`` (the file that lists hydra-core)
    and ``logger`` (the recipe's logger name)."""

    def __init__(self, schema, config_dir, *, cross_checks: Optional[Callable] = None, title="the recipe",
                 requirements="recipes/<recipe>/requirements.txt", logger="recipe"):
        self.schema, self.config_dir, self.extra_checks = schema, config_dir, cross_checks
        self.title, self.requirements, self.logger = title, requirements, logger

    # -- checking
    def unknown_key(self, dotted):
        """Why ``dotted`` (group.key) is not a key of the schema; None if it is."""
        schema, prefix = self.schema, ""
        parts = dotted.split(".")
        for i, part in enumerate(parts):
            names = {f.name: f for f in dataclasses.fields(schema)}
            if part not in names:
                where = f"the {prefix[:-1]} group" if prefix else "the top level"
                near = difflib.get_close_matches(part, list(names), n=1)
                return f"not a key of {where}" + (f" (did you mean {prefix}{near[0]}?)" if near else
                                                  f" (keys: {', '.join(names)})")
            f = names[part]
            sub = f.default_factory
            if sub is not dataclasses.MISSING and dataclasses.is_dataclass(sub):
                schema, prefix = sub, prefix + part + "."
            elif i < len(parts) - 1:
                return f"{prefix}{part} is a key, not a group"
        return None

    def validate(self, cfg, name=None) -> Cfg:
        """Check a composed config (dict or Cfg) against the schema; return
        it as a Cfg with normalised values, or raise ConfigError listing
        every bad key.  Idempotent: the trainer calls it again on what it is
        given."""
        d = cfg.to_dict() if isinstance(cfg, Cfg) else dict(cfg)
        name = name or d.get("config_name") or "?"
        d.pop("config_name", None)
        d.pop("hydra", None)
        problems = []
        out = _check_section(self.schema, d, "", problems)
        bad = {p.split("=", 1)[0] for p in problems}

        def ok(*keys):
            return not any(k in bad for k in keys)

        groups = [f.name for f in dataclasses.fields(self.schema)
                  if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory)]
        if all(isinstance(out.get(g), dict) for g in groups):
            common_cross_checks(out, ok, problems)
            if self.extra_checks is not None:
                self.extra_checks(out, ok, problems)
        if problems:
            raise ConfigError(name, problems)
        out["config_name"] = name
        return Cfg.wrap(out)

    def defaults(self) -> dict:
        """The schema's defaults as a nested dict (base.yaml must agree)."""
        return dataclasses.asdict(self.schema())

    # -- loading
    def _hydra(self):
        try:
            import hydra  # noqa: F401
            from hydra import compose, initialize_config_dir
            from hydra.errors import HydraException, MissingConfigException
            from omegaconf import OmegaConf
        except ImportError as e:
            raise ImportError(f"{self.title} reads its configs with Hydra: pip install -r "
                              f"{self.requirements} (hydra-core, pure Python) ({e})") from None
        return compose, initialize_config_dir, HydraException, MissingConfigException, OmegaConf

    def configs(self, config_dir=None):
        d = config_dir or self.config_dir
        return sorted(f[:-5] for f in os.listdir(d) if f.endswith(".yaml"))

    def compose(self, name: str = "L0_sanity", overrides=(), config_dir: str = None) -> dict:
        """Hydra's composition of config ``name`` with ``overrides``: a
        plain nested dict, not yet checked."""
        config_dir = config_dir or self.config_dir
        compose, initialize_config_dir, HydraException, MissingConfigException, OmegaConf = self._hydra()
        overrides = [str(o) for o in overrides]
        problems = []
        for o in overrides:
            if "=" not in o and not o.startswith("~"):
                problems.append(f"override {o!r}: must be key=value (e.g. train.steps=100)")
            elif o[0] not in "+~":  # overriding: the key must exist (adding one is checked after composition)
                key, value = o.split("=", 1)
                why = self.unknown_key(key)
                if why:
                    problems.append(f"{key}={value}: {why}")
        if problems:
            raise ConfigError(name, problems)
        try:
            with initialize_config_dir(config_dir=os.path.abspath(config_dir), version_base="1.3"):
                c = compose(config_name=name, overrides=overrides)
        except MissingConfigException:
            raise FileNotFoundError(f"config {name!r} not found in {config_dir} "
                                    f"(have: {self.configs(config_dir)})") from None
        except HydraException as e:
            msg = " ".join(str(e).split("\n")[:2])
            raise ConfigError(name, [f"override: {msg}"]) from None
        d = OmegaConf.to_container(c, resolve=True)
        d.pop("hydra", None)
        return d

    def load(self, name: str = "L0_sanity", overrides=(), config_dir: str = None) -> Cfg:
        """Compose config ``name`` with ``overrides`` (Hydra) and check it
        against the schema (ConfigError naming every bad key)."""
        return self.validate(self.compose(name, overrides, config_dir), name)

    def parse_args(self, argv):
        """``[--config NAME | --config-name NAME | -cn NAME] key=value ...``
        -> (name, overrides)."""
        name, rest = "L0_sanity", []
        i = 0
        while i < len(argv):
            a = argv[i]
            flag = a.split("=", 1)[0]
            if flag in ("--config", "--config-name", "-cn"):
                if "=" in a:
                    name = a.split("=", 1)[1]
                    i += 1
                else:
                    if i + 1 >= len(argv):
                        raise SystemExit(f"usage: {flag} NAME key=value ...: {flag} needs a config name")
                    name = argv[i + 1]
                    i += 2
                continue
            if a.startswith("-"):
                raise SystemExit(f"usage: [--config NAME] key=value ...: unknown option {a!r} "
                                 f"(configs: {self.configs()})")
            rest.append(a)
            i += 1
        return name, rest

    def main_entry(self, train_fn, strategy: str, argv=None):
        """Command-line entry of a training script: ``--config NAME
        key=value ...`` (``--config-name NAME`` works too).  A bad config
        ends the process with the list of bad keys, exit status 2, before
        anything is built."""
        argv = list(sys.argv[1:] if argv is None else argv)
        if not logging.getLogger().handlers:
            logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        name, rest = self.parse_args(argv)
        try:
            cfg = self.load(name, rest)
            logging.getLogger(self.logger).info("config: Hydra composed %s.yaml from %s, overrides %s", name,
                                                self.config_dir, rest)
            return train_fn(cfg, strategy)
        except (ConfigError, FileNotFoundError) as e:  # (the trainer's path checks raise ConfigError too)
            print(f"error: {e}", file=sys.stderr)
            raise SystemExit(2) from None

    def entry_points(self):
        """The six functions a recipe's config module publishes, in this
        order: validate_config = validate (cfg, name=None) -> Cfg, ConfigError
        naming every bad key; schema_defaults = defaults () -> dict, the
        schema's defaults (base.yaml must agree); compose_config = compose
        (name="L0_sanity", overrides=(), config_dir=None) -> dict, not yet
        checked; load_config = load (the same arguments) -> Cfg, composed and
        checked; parse_args argv -> (name, overrides); main_entry
        (train_fn, strategy, argv=None), a training script's command line."""
        return self.validate, self.defaults, self.compose, self.load, self.parse_args, self.main_entry
