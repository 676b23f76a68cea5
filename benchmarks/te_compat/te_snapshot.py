"""Read Transformer Engine's public PyTorch surface from its source and write
it as a JSON snapshot (benchmarks/te_compat/te_snapshot.json).

What it records, all parsed with Python's ast from the files of one commit
of NVIDIA/TransformerEngine (nothing of TE is imported or run):

- ``names``: the public names of ``transformer_engine.pytorch`` (the names
  its __init__.py imports at top level, less the two helpers it imports for
  its own use, load_framework_extension and torch_version);
- ``modules``: for the eight core modules (Linear, LayerNormLinear,
  LayerNormMLP, LayerNorm, RMSNorm, DotProductAttention,
  MultiheadAttention, TransformerLayer) the arguments of ``__init__`` and
  ``forward`` with their defaults as written in TE's source.  LayerNorm and
  RMSNorm pass ``**kwargs`` on to the fusible op of the same name, whose
  keyword arguments are merged in;
- ``submodules``: the public names of te.ops and te.optimizers.

The snapshot is committed so that the comparison (compat_table.py) and its
test run without TE's source; re-run this script against a newer TE
checkout to move the table to that version:

    python3 benchmarks/te_compat/te_snapshot.py --git-dir PATH/TO/TransformerEngine/.git \
        [--rev REV] [--out benchmarks/te_compat/te_snapshot.json]
"""
import argparse
import ast
import json
import os
import subprocess

CORE = {  # class -> (file under transformer_engine/pytorch, op file whose kwargs it forwards)
    "Linear": ("module/linear.py", None),
    "LayerNormLinear": ("module/layernorm_linear.py", None),
    "LayerNormMLP": ("module/layernorm_mlp.py", None),
    "LayerNorm": ("module/layernorm.py", "ops/basic/layer_norm.py"),
    "RMSNorm": ("module/rmsnorm.py", "ops/basic/rmsnorm.py"),
    "DotProductAttention": ("attention/dot_product_attention/dot_product_attention.py", None),
    "MultiheadAttention": ("attention/multi_head_attention.py", None),
    "TransformerLayer": ("transformer.py", None),
}
#: imported by TE's __init__ for its own use, not part of its API
HELPERS = {"load_framework_extension", "torch_version"}
ROOT = "transformer_engine/pytorch/"


def git_show(git_dir, rev, path):
    return subprocess.run(["git", "--git-dir", git_dir, "show", f"{rev}:{path}"], check=True,
                          capture_output=True, text=True).stdout


def public_imports(source, helpers=()):
    """Names bound by the file's top-level ``from X import ...`` statements
    (and ``from .basic import *`` resolved by the caller), in order."""
    names, stars = [], []
    for node in ast.parse(source).body:
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if alias.name == "*":
                    stars.append(node.module)
                    continue
                name = alias.asname or alias.name
                if not name.startswith("_") and name not in helpers and name not in names:
                    names.append(name)
    return names, stars


def arguments(source, cls, method):
    """[(name, default source or None)] of cls.method, self dropped, and
    whether it takes **kwargs."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == method:
                    a = item.args
                    pos = a.posonlyargs + a.args
                    defaults = [None] * (len(pos) - len(a.defaults)) + list(a.defaults)
                    out = [(arg.arg, None if d is None else ast.unparse(d)) for arg, d in zip(pos, defaults)]
                    out += [(arg.arg, None if d is None else ast.unparse(d))
                            for arg, d in zip(a.kwonlyargs, a.kw_defaults)]
                    return [x for x in out if x[0] != "self"], a.kwarg is not None
    raise LookupError(f"{cls}.{method} not found")


def snapshot(git_dir, rev):
    commit = subprocess.run(["git", "--git-dir", git_dir, "rev-parse", rev], check=True,
                            capture_output=True, text=True).stdout.strip()
    version = git_show(git_dir, commit, "build_tools/VERSION.txt").strip()
    names, _ = public_imports(git_show(git_dir, commit, ROOT + "__init__.py"), HELPERS)
    modules = {}
    for cls, (path, op_path) in CORE.items():
        src = git_show(git_dir, commit, ROOT + path)
        init, has_kwargs = arguments(src, cls, "__init__")
        if op_path and has_kwargs:  # the norm modules forward **kwargs to the fusible op
            op_init, _ = arguments(git_show(git_dir, commit, ROOT + op_path), cls, "__init__")
            init += [a for a in op_init if a[0] not in dict(init)]
        try:
            forward, _ = arguments(src, cls, "forward")
        except LookupError:  # the norm modules inherit the fusible ops' forward
            forward, _ = arguments(git_show(git_dir, commit, ROOT + "ops/op.py"), "BasicOperation", "forward")
        modules[cls] = {"init": [list(a) for a in init], "forward": [list(a) for a in forward]}
    ops_names, stars = public_imports(git_show(git_dir, commit, ROOT + "ops/__init__.py"))
    for star in stars:  # from .basic import *
        basic, _ = public_imports(git_show(git_dir, commit, ROOT + "ops/" + star + "/__init__.py"))
        ops_names += [n for n in basic if n not in ops_names]
    optim_names, _ = public_imports(git_show(git_dir, commit, ROOT + "optimizers/__init__.py"))
    return {"te_version": version, "commit": commit, "repository": "github.com/NVIDIA/TransformerEngine",
            "names": names, "modules": modules,
            "submodules": {"ops": sorted(ops_names), "optimizers": sorted(optim_names)}}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--git-dir", required=True, help="a clone of NVIDIA/TransformerEngine (its .git)")
    ap.add_argument("--rev", default="HEAD")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "te_snapshot.json"))
    args = ap.parse_args()
    snap = snapshot(args.git_dir, args.rev)
    with open(args.out, "w") as f:
        json.dump(snap, f, indent=1)
        f.write("\n")
    print(f"TE {snap['te_version']} at {snap['commit'][:12]}: {len(snap['names'])} names, "
          f"{sum(len(m['init']) for m in snap['modules'].values())} constructor arguments -> {args.out}")


if __name__ == "__main__":
    main()
