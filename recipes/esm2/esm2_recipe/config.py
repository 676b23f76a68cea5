"""Recipe configuration: the YAML files of hydra_config/, composed and
overridden from the command line, with or without Hydra.

The configs are Hydra configs (``defaults: [base, _self_]`` composition,
``key.sub=value`` overrides).  Where Hydra is installed the training
scripts run under ``@hydra.main``.  Where it is not (the GPU machines have
no network and no Hydra; OmegaConf is absent too) the same files are read
by the small loader below, which implements the part of Hydra the recipe
uses: a ``defaults`` list of sibling config names plus ``_self_``, nested
dict merge, dotted ``key=value`` overrides of existing keys (values parsed
as YAML), and ``+key=value`` to add a key.  Which path ran is logged, never
silent.  Both paths hand the trainer a plain nested dict (``Cfg``).
"""
from __future__ import annotations

import copy
import os

import yaml

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hydra_config")


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


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _load_file(name: str, config_dir: str, seen=()) -> dict:
    path = os.path.join(config_dir, name if name.endswith(".yaml") else name + ".yaml")
    if not os.path.isfile(path):
        have = sorted(f[:-5] for f in os.listdir(config_dir) if f.endswith(".yaml"))
        raise FileNotFoundError(f"config {name!r} not found in {config_dir} (have: {have})")
    if name in seen:
        raise ValueError(f"config {name!r}: circular defaults {list(seen) + [name]}")
    with open(path) as f:
        raw = yaml.safe_load(f) or {}
    defaults = raw.pop("defaults", ["_self_"])
    if "_self_" not in defaults:
        defaults = list(defaults) + ["_self_"]
    out: dict = {}
    for d in defaults:
        if d == "_self_":
            out = _merge(out, raw)
        elif isinstance(d, str):
            out = _merge(out, _load_file(d, config_dir, seen + (name,)))
        else:
            raise ValueError(f"config {name!r}: only plain config names are supported in 'defaults', got {d!r}")
    return out


def parse_value(text: str):
    """A command-line value as YAML would read it, plus numbers YAML 1.1
    leaves as strings (``1e-3``)."""
    v = yaml.safe_load(text) if text != "" else ""
    if isinstance(v, str):
        try:
            return int(v)
        except ValueError:
            pass
        try:
            return float(v)
        except ValueError:
            pass
    return v


def apply_override(cfg: dict, item: str) -> None:
    if "=" not in item:
        raise ValueError(f"override {item!r} must be key=value (e.g. train.steps=100)")
    key, text = item.split("=", 1)
    add = key.startswith("+")
    key = key.lstrip("+")
    parts = key.split(".")
    node = cfg
    for i, p in enumerate(parts[:-1]):
        if not isinstance(node.get(p), dict):
            if add:
                node[p] = {}
            else:
                raise KeyError(f"override {item!r}: no config group {'.'.join(parts[:i + 1])!r}")
        node = node[p]
    if parts[-1] not in node and not add:
        raise KeyError(f"override {item!r}: key {key!r} is not in the config (use +{key}=... to add one); "
                       f"keys here: {sorted(node)}")
    node[parts[-1]] = parse_value(text)


def normalize_numbers(d):
    """YAML 1.1 reads '4e-4' as a string; turn such strings into floats."""
    if isinstance(d, dict):
        return {k: normalize_numbers(v) for k, v in d.items()}
    if isinstance(d, list):
        return [normalize_numbers(v) for v in d]
    if isinstance(d, str):
        try:
            return float(d) if any(c in d for c in ".eE") and not d.isalpha() else d
        except ValueError:
            return d
    return d


def load_config(name: str = "L0_sanity", overrides=(), config_dir: str = CONFIG_DIR) -> Cfg:
    """Compose config ``name`` from hydra_config/ and apply ``overrides``."""
    cfg = _load_file(name, config_dir)
    cfg.pop("hydra", None)
    for item in overrides:
        apply_override(cfg, item)
    cfg = normalize_numbers(cfg)
    cfg["config_name"] = name
    return Cfg.wrap(cfg)


def hydra_available() -> bool:
    try:
        import hydra  # noqa: F401
        import omegaconf  # noqa: F401
        return True
    except ImportError:
        return False


def main_entry(train_fn, strategy: str, argv=None):
    """Command-line entry of a training script.

    ``--config NAME key=value ...`` (or no Hydra installed): the built-in
    loader.  Otherwise Hydra: ``--config-name NAME key=value ...``."""
    import logging
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    log = logging.getLogger("esm2")
    use_builtin = any(a == "--config" or a.startswith("--config=") for a in argv) or not hydra_available()
    if use_builtin:
        if not logging.getLogger().handlers:
            logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        name = "L0_sanity"
        rest = []
        i = 0
        while i < len(argv):
            a = argv[i]
            if a == "--config":
                name = argv[i + 1]
                i += 2
                continue
            if a.startswith("--config="):
                name = a.split("=", 1)[1]
            elif a.startswith("--config-name"):
                name = a.split("=", 1)[1] if "=" in a else argv[i + 1]
                i += 1 if "=" in a else 2
                continue
            else:
                rest.append(a)
            i += 1
        why = "requested with --config" if hydra_available() else "hydra-core/omegaconf are not installed"
        log.info("config: built-in YAML loader (%s): %s.yaml from %s, overrides %s", why, name, CONFIG_DIR, rest)
        return train_fn(load_config(name, rest), strategy)

    import hydra
    from omegaconf import OmegaConf

    @hydra.main(config_path=CONFIG_DIR, config_name="L0_sanity", version_base="1.2")
    def _hydra_main(cfg):
        from hydra.core.hydra_config import HydraConfig

        name = HydraConfig.get().job.config_name
        d = OmegaConf.to_container(cfg, resolve=True)
        d.pop("hydra", None)
        d = normalize_numbers(d)
        d["config_name"] = name
        log.info("config: Hydra composed %s.yaml from %s", name, CONFIG_DIR)
        return train_fn(Cfg.wrap(d), strategy)

    sys.argv = [sys.argv[0]] + argv
    return _hydra_main()
