"""The source tree keeps the shape the README's Layout section describes.

Two things drift silently as code moves: the file shape of the C kernel
families (csrc/<family>/: a math header, a public entry, a backend header,
a CPU reference, CUDA kernels, a standalone check) and the README's map of
the tree.  These tests read the tree and the README and fail on either:
a family missing a part without its entry file saying why, a file or
folder the Layout section names that does not exist, or a folder of the
tree the section does not mention.  They read files only (no build, no
import of seqfuse) and take well under a second.
"""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
NOT_FAMILIES = {"core", "include", "python"}
FAMILIES = sorted(p.name for p in CSRC.iterdir() if p.is_dir() and p.name not in NOT_FAMILIES)

# Where a family's file differs from <name>.h / <name>_backend.h /
# check_<name>*.cu, the file it has instead (None: it has none, and its
# entry file's first comment says why).  Keyed by (family, entry name).
MATH = {("optim", "optim"): "adamw.h", ("quant", "amax"): "fp8.h", ("quant", "cast"): "fp8.h",
        ("quant", "block"): "fp8.h", ("grouped", "grouped"): None}
BACKEND = {("quant", "block"): "cast_backend.h"}
CHECK = {("gemm", "gemm"): "check_cublaslt.cu", ("optim", "optim"): "check_adamw.cu",
         ("grouped", "grouped"): None}
CPU = {("grouped", "grouped"): None}
# The entry file whose first comment documents a family's departures.
NOTE_IN = {"quant": "cast.c"}


def entries(family):
    """The public entry files of a family: <name>.c other than the references."""
    return sorted(p.stem for p in (CSRC / family).glob("*.c") if not p.stem.endswith("_cpu"))


def first_comment(path):
    text = path.read_text()
    return text[text.index("/*"):text.index("*/")]


def layout_block():
    text = (ROOT / "README.md").read_text()
    start = text.index("## Layout")
    first = text.index("```\n", start) + 4
    return text[first:text.index("```", first)]


def test_families_found():
    assert {"act", "attn", "gemm", "grouped", "loss", "moe", "norm", "optim", "quant", "rope"} <= set(FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_has_the_file_shape(family):
    d = CSRC / family
    assert entries(family), f"csrc/{family}/ has no public entry (<name>.c)"
    departs = False
    for name in entries(family):
        key = (family, name)
        expected = {
            "math header": MATH.get(key, f"{name}.h"),
            "backend header": BACKEND.get(key, f"{name}_backend.h"),
            "CPU reference": CPU.get(key, f"{name}_cpu.c"),
        }
        departs |= any(k in d for d in (MATH, BACKEND, CHECK, CPU) for k in [key])
        for kind, fname in expected.items():
            if fname is not None:
                assert (d / fname).is_file(), f"csrc/{family}/{name}.c: its {kind} {fname} is missing"
        assert list(d.glob(f"{name}*_cuda.cu")), f"csrc/{family}/{name}.c: no {name}*_cuda.cu kernels"
        check = CHECK.get(key, "")
        if check is not None:
            found = [check] if check and (d / check).is_file() else [p.name for p in d.glob(f"check_{name}*.cu")]
            assert found, f"csrc/{family}/{name}.c: no standalone check program (check_{name}*.cu)"
    if departs:
        note = first_comment(d / NOTE_IN.get(family, f"{family}.c"))
        assert "File shape" in note, (f"csrc/{family} departs from the family file shape; its entry file's first "
                                      "comment must say how and why ('File shape ...')")


def test_every_header_in_a_family_has_a_role():
    """A .h in a family folder is its math header or a backend header (or one
    named by an entry's first comment): no stray half-roles."""
    for family in FAMILIES:
        d = CSRC / family
        notes = "".join(first_comment(d / f"{e}.c") for e in entries(family))
        for h in d.glob("*.h"):
            known = (h.stem in entries(family) or h.name.endswith("_backend.h") or h.name in MATH.values()
                     or h.name in notes)
            assert known, f"csrc/{family}/{h.name}: neither a math header, a backend header nor named by an entry"


def test_layout_lists_every_family():
    block = layout_block()
    line = next(l for l in block.splitlines() if l.startswith("csrc/<family>/"))
    following = block[block.index(line):]
    listed = following[:following.index("csrc/build_checks.sh")]
    for family in FAMILIES:
        assert re.search(rf"\b{family}\b", listed), f"README Layout: family {family} not listed under csrc/<family>/"


def _entries_of_block(block):
    """(first-column path, the entry's text) for each entry of the Layout block."""
    out = []
    for line in block.splitlines():
        if line and not line[0].isspace():
            head = line.split()[0].rstrip(",")
            out.append([head, line])
        elif out:
            out[-1][1] += "\n" + line
    return out


PATH = re.compile(r"(?<![\w/.<])\.?[\w<>-]+(?:/[\w.*<>-]*)+")
FILE = re.compile(r"(?<![\w/<>.])[\w*-]+\.(?:c|h|cu|cuh|py|sh|md|toml|txt)\b")
TOP = {p.name for p in ROOT.iterdir()}


def _exists_under(dirs, rel):
    for d in dirs:
        if "*" in rel:
            if list(d.glob(rel)) or list(d.glob("**/" + rel)):
                return True
        elif (d / rel).exists() or list(d.glob("**/" + rel)):
            return True
    return False


def test_layout_names_only_what_exists():
    for head, text in _entries_of_block(layout_block()):
        dirs = []
        if "<" in head:  # csrc/<family>/: any family folder
            dirs = [CSRC / f for f in FAMILIES]
        elif (ROOT / head.rstrip("/")).is_dir():
            dirs = [ROOT / head.rstrip("/")]
        else:
            dirs = [ROOT]
        paths = [p for p in PATH.findall(text) if "<" not in p]  # placeholders: csrc/<family>/
        for p in paths:
            if p.split("/")[0] in TOP:
                assert list(ROOT.glob(p.rstrip("/"))), f"README Layout names {p}, which does not exist"
                if (ROOT / p.rstrip("/")).is_dir():
                    dirs.append(ROOT / p.rstrip("/"))
        for p in paths:  # folders named relative to the entry's (esm2/, ops/attn/)
            if p.split("/")[0] not in TOP and p.endswith("/"):
                assert _exists_under(dirs + [d.parent for d in dirs], p.rstrip("/")), \
                    f"README Layout ({head}) names {p}, not found there"
        for f in FILE.findall(text):
            if "/" not in f:
                assert _exists_under(dirs, f), f"README Layout ({head}) names {f}, not found there"


def test_layout_mentions_every_folder():
    block = layout_block()
    tracked_top = {"csrc", "python", "recipes", "tests", "benchmarks", "setup.py", "pyproject.toml", "Makefile",
                   "requirements-test.txt", ".ci"}
    for name in sorted(tracked_top):
        assert (ROOT / name).exists() and name in block, f"README Layout does not mention {name}"
    for d in sorted(p for p in (ROOT / "python" / "seqfuse").iterdir() if p.is_dir() and p.name != "__pycache__"):
        assert f"python/seqfuse/{d.name}/" in block, f"README Layout does not mention python/seqfuse/{d.name}/"
    for d in sorted(p for p in (ROOT / "recipes").iterdir() if p.is_dir() and p.name != "__pycache__"):
        assert f"recipes/{d.name}" in block, f"README Layout does not mention recipes/{d.name}"
    bench = next(t for h, t in _entries_of_block(block) if h == "benchmarks/")
    for d in sorted(p for p in (ROOT / "benchmarks").iterdir() if p.is_dir() and p.name != "__pycache__"):
        assert f"{d.name}/" in bench, f"README Layout does not mention benchmarks/{d.name}/"
    for d in ("core", "include", "python"):
        assert f"csrc/{d}/" in block, f"README Layout does not mention csrc/{d}/"
