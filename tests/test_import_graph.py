"""The import graph of python/seqfuse: no circles, no back edges against the
layer order, no private names taken from another module file.

Read statically with ``ast`` (nothing is imported).  Every ``import`` and
``from ... import`` statement in a file counts as an edge, at module level
AND inside functions, methods, ``if`` / ``try`` blocks alike: an import
deferred into a function still makes the caller depend on the callee, and
deferring one only hides a circle, it does not remove it.  (Imports built
from strings, ``importlib.import_module(...)``, are not seen; the package has
none.)

Edges.  ``from P import x`` is an edge to ``P.x`` when that is a module,
else to ``P``.  Importing ``a.b.c`` also runs the ``__init__`` of ``a`` and
``a.b``: those count as edges too, except packages the importing file lives
in (they are being initialised already; ``from . import sibling`` is not a
circle through the package's own ``__init__``).  An explicit ``import
seqfuse`` from inside the package does count: it is a use of the top-level
namespace.

Layers, top to bottom (a module may import its own layer or any layer below
it, never one above):

    seqfuse (the top-level __init__, __main__), seqfuse.hf, seqfuse.data
                                         what scripts and recipes import
    seqfuse.pytorch                      the Transformer Engine facade
    seqfuse.modules, seqfuse.optim,      nn.Modules + autograd; optimizers;
        seqfuse.distributed              context / expert parallelism, FSDP2's
                                         FP8 all-gather, process-group teardown
    seqfuse.quantization                 recipes' state, autocast, FP8 tensors
    seqfuse.ops                          functional ops over _C
    seqfuse._C, seqfuse._runtime, seqfuse.common
                                         the extension, build info, recipes'
                                         framework-neutral dataclasses

seqfuse.data (collators, readers, tokenizers) is used by training scripts
and depends on nothing of seqfuse's, so it sits in the top layer beside
seqfuse.hf: nothing below may depend on it.  seqfuse.optim uses ops only,
like the modules, and sits beside them; so does seqfuse.distributed (it
uses ops, quantization and common), which the modules use for context and
expert parallelism.  Within a layer, cross-package edges are allowed as long as they
make no circle.  Besides the order: only seqfuse.ops (and ``_runtime`` /
the top-level ``__init__``, which load it and report the build) import
``_C`` (DESIGN.md: "Only python/seqfuse/ops/ calls _C").

Private names.  A name with a leading underscore (``__dunder__`` aside)
belongs to the module or package that holds it.  ``_helper`` defined in a
module file may be used by that file only; a ``_``-prefixed module
(``modules/_base.py``, ``modules/_fp8.py``, ``ops/_call.py``) is a helper of
its package: files inside that package may import it and its public names,
files outside may not.  Checked for ``from M import _x`` and for attribute
reads through an imported module (``norm_ops._x`` after ``from ..ops import
norm as norm_ops``).
"""
import ast
import pathlib
from collections import defaultdict

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "python" / "seqfuse"
EXTENSIONS = {"seqfuse._C"}  # compiled modules: no .py file to parse

#: top to bottom; an entry names a package (with its submodules) or, for
#: the top-level package, the modules themselves
LAYERS = [
    ("seqfuse", "seqfuse.__main__", "seqfuse.hf", "seqfuse.data"),
    ("seqfuse.pytorch",),
    ("seqfuse.modules", "seqfuse.optim", "seqfuse.distributed"),
    ("seqfuse.quantization",),
    ("seqfuse.ops",),
    ("seqfuse._C", "seqfuse._runtime", "seqfuse.common"),
]
LAYER_NAMES = ["hf/data/top", "pytorch", "modules/optim/distributed", "quantization", "ops", "_C/common"]

#: the modules that may import seqfuse._C
C_IMPORTERS = ("seqfuse", "seqfuse._runtime", "seqfuse.ops")


# ---- reading the package ------------------------------------------------------

def _module_files():
    """{module name: (path, is_package)} for every .py file under ROOT."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            out[".".join(parts[:-1])] = (path, True)
        else:
            out[".".join(parts)] = (path, False)
    return out


MODULES = _module_files()


def _is_module(name):
    return name in MODULES or name in EXTENSIONS


def _is_package(name):
    return name in MODULES and MODULES[name][1]


def _ancestors(name):
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _inside(importer, package):
    return importer == package or importer.startswith(package + ".")


def _is_private(component):
    return component.startswith("_") and not (component.startswith("__") and component.endswith("__"))


class _Edge:
    __slots__ = ("src", "dst", "line", "where", "text")

    def __init__(self, src, dst, line, where, text):
        self.src, self.dst, self.line, self.where, self.text = src, dst, line, where, text

    def __str__(self):
        return f"{self.src} -> {self.dst}   ({_rel(self.src)}:{self.line}, {self.where}: {self.text})"


def _rel(module):
    path = MODULES[module][0] if module in MODULES else None
    return str(path.relative_to(ROOT.parents[1])) if path else module


class _Reader(ast.NodeVisitor):
    """Edges, module aliases and private-name uses of one file."""

    def __init__(self, module, is_package):
        self.module = module
        self.package = module if is_package else module.rpartition(".")[0]
        self.depth = 0          # > 0 inside a function
        self.edges = []
        self.aliases = {}       # local name -> seqfuse module it is bound to
        self.private = []       # (line, dotted path)

    # scope ---------------------------------------------------------------
    def _function(self, node):
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def _edge(self, dst, node, explicit):
        if dst == self.module or not dst.startswith("seqfuse"):
            return
        if not explicit and _inside(self.module, dst):
            return  # a package this file lives in: initialised already
        where = "function-level" if self.depth else "module-level"
        self.edges.append(_Edge(self.module, dst, node.lineno, where, ast.unparse(node)))

    def _target(self, dst, node):
        """An explicit import of module ``dst``, and the __init__s it runs."""
        for parent in _ancestors(dst):
            self._edge(parent, node, explicit=False)
        self._edge(dst, node, explicit=True)

    def _check_path(self, node, path):
        """Every private component of ``path`` (a dotted name reached from
        seqfuse) must be visible from this file."""
        parts = path.split(".")
        for i in range(1, len(parts)):
            if not _is_private(parts[i]):
                continue
            holder = ".".join(parts[:i])
            visible = _inside(self.module, holder) if _is_package(holder) else self.module == holder
            if not visible:
                self.private.append((node.lineno, path))
                return

    # imports ---------------------------------------------------------------
    def visit_Import(self, node):
        for a in node.names:
            if not a.name.startswith("seqfuse"):
                continue
            self._target(a.name, node)
            self._check_path(node, a.name)
            if a.asname:
                self.aliases[a.asname] = a.name
            else:
                self.aliases[a.name.split(".")[0]] = a.name.split(".")[0]

    def visit_ImportFrom(self, node):
        if node.level:
            base = self.package.split(".")
            if node.level > 1:
                base = base[:-(node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        if not source.startswith("seqfuse"):
            return
        for a in node.names:
            local = a.asname or a.name
            full = f"{source}.{a.name}"
            if _is_module(full):
                self._target(full, node)
                self.aliases[local] = full
            else:
                self._target(source, node)
                self.aliases.pop(local, None)
            self._check_path(node, full)

    # attribute reads through module aliases ----------------------------------
    def collect_attributes(self, tree):
        seen = set()
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            chain, cur = [], node
            while isinstance(cur, ast.Attribute):
                chain.append(cur.attr)
                cur = cur.value
            if not isinstance(cur, ast.Name) or cur.id not in self.aliases:
                continue
            chain.reverse()
            mod = self.aliases[cur.id]
            for attr in chain:
                path = f"{mod}.{attr}"
                if _is_private(attr) and (node.lineno, path) not in seen:
                    seen.add((node.lineno, path))
                    n = len(self.private)
                    self._check_path(node, path)
                    if len(self.private) > n:
                        break
                if not _is_module(path):
                    break
                mod = path


def _unique(edges):
    seen, out = set(), []
    for e in edges:
        if (e.src, e.dst, e.line) not in seen:
            seen.add((e.src, e.dst, e.line))
            out.append(e)
    return out


def _read_all():
    edges, private = [], []
    for module, (path, is_package) in MODULES.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        r = _Reader(module, is_package)
        r.visit(tree)
        r.collect_attributes(tree)
        edges += _unique(r.edges)
        private += [f"{module} uses {p}   ({_rel(module)}:{line})" for line, p in r.private]
    return edges, sorted(set(private))


EDGES, PRIVATE = _read_all()


def _layer(module):
    for i, entries in enumerate(LAYERS):
        for e in entries:
            if module == e or (e != "seqfuse" and module.startswith(e + ".")):
                return i
    return None


# ---- checks ----------------------------------------------------------------

def _cycles(edges):
    """The strongly connected components of more than one module (Tarjan),
    each with the edges that stay inside it."""
    graph = defaultdict(set)
    for e in edges:
        graph[e.src].add(e.dst)
    index, low, stack, on, comps = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(comp)

    for v in sorted(set(graph) | {e.dst for e in edges}):
        if v not in index:
            visit(v)
    return [(sorted(c), [e for e in edges if e.src in c and e.dst in c]) for c in comps]


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in list(MODULES) + sorted(EXTENSIONS) if _layer(m) is None)
    if unplaced:
        pytest.fail("modules in no layer (add them to LAYERS in this test):\n  " + "\n  ".join(unplaced), pytrace=False)


def test_no_import_circles():
    found = _cycles(EDGES)
    lines = []
    for comp, inner in found:
        lines.append("circle among: " + ", ".join(comp))
        lines += ["    " + str(e) for e in inner]
    if found:
        pytest.fail(f"{len(found)} import circle(s):\n" + "\n".join(lines), pytrace=False)


def test_no_back_edges():
    back = [e for e in EDGES
            if _layer(e.src) is not None and _layer(e.dst) is not None and _layer(e.dst) < _layer(e.src)]
    lines = [f"{e}   [{LAYER_NAMES[_layer(e.src)]} imports {LAYER_NAMES[_layer(e.dst)]}]" for e in back]
    if back:
        pytest.fail(f"{len(back)} import(s) against the layer order:\n" + "\n".join(lines), pytrace=False)


def test_only_ops_imports_the_extension():
    bypass = [e for e in EDGES if e.dst in EXTENSIONS
              and not any(e.src == c or (c != "seqfuse" and e.src.startswith(c + ".")) for c in C_IMPORTERS)]
    if bypass:
        pytest.fail("seqfuse._C imported outside seqfuse.ops:\n" + "\n".join(str(e) for e in bypass), pytrace=False)


def test_no_private_names_across_files():
    if PRIVATE:
        pytest.fail(f"{len(PRIVATE)} private name(s) used outside their file / package:\n" + "\n".join(PRIVATE),
                    pytrace=False)


def test_the_reader_sees_the_package():
    """The checks above pass vacuously if nothing is read: the graph must
    hold the edges every checkout has."""
    pairs = {(e.src, e.dst) for e in EDGES}
    assert ("seqfuse.pytorch", "seqfuse.modules.linear") in pairs
    assert ("seqfuse.ops.gemm", "seqfuse._C") in pairs
    assert ("seqfuse.modules.linear", "seqfuse.quantization") in pairs  # an implicit __init__ edge
    assert len(MODULES) > 40


@pytest.mark.parametrize("source, want_cycle, want_back, want_private", [
    # a function-level import that closes a circle with its package facade
    ({"seqfuse.a": "from .b import f", "seqfuse.b": "def f():\n    from .a import g"}, True, False, False),
    # a lower layer reaching up
    ({"seqfuse.ops.x": "def f():\n    from seqfuse.pytorch import Linear"}, False, True, False),
    # a private name from a sibling file, and through a module alias
    ({"seqfuse.modules.x": "from .norm import _hidden"}, False, False, True),
    ({"seqfuse.modules.x": "from ..ops import norm as norm_ops\nnorm_ops._workspace(1)"}, False, False, True),
    # a private helper module of another package
    ({"seqfuse.modules.x": "from ..ops._call import stream_for"}, False, False, True),
    # allowed: a private helper module of one's own package, and its public names
    ({"seqfuse.modules.x": "from . import _fp8 as F8\nfrom ._split import parse_split\nF8.forward"},
     False, False, False),
])
def test_the_checks_can_fail(source, want_cycle, want_back, want_private):
    edges, private = [], []
    for module, text in source.items():
        r = _Reader(module, False)
        tree = ast.parse(text)
        r.visit(tree)
        r.collect_attributes(tree)
        edges += _unique(r.edges)
        private += r.private
    assert bool(_cycles(edges)) == want_cycle
    back = [e for e in edges if None not in (_layer(e.src), _layer(e.dst)) and _layer(e.dst) < _layer(e.src)]
    assert bool(back) == want_back
    assert bool(private) == want_private
