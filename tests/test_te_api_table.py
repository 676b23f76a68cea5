"""The Transformer Engine compatibility table stays true.

- README.md's generated section is what benchmarks/te_compat/compat_table.py
  makes now from the committed TE snapshot (te_snapshot.json) and seqfuse's
  classes: a name or argument added, refused or dropped without re-running
  the generator fails here.
- Every argument the table calls "refused" (seqfuse.modules.te_compat.REFUSED)
  raises NotImplementedError naming it when switched on, and is taken at
  its "off" value.
- No constructor argument of TE's eight core modules is left "lacking".
"""
import os
import sys

import pytest
import torch

import seqfuse.pytorch as te
from seqfuse.modules.te_compat import REFUSED

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                                "te_compat"))
import compat_table  # noqa: E402

SNAPSHOT = compat_table.load_snapshot()
RESULT = compat_table.classify(SNAPSHOT)

#: the required arguments of each core module, small
REQUIRED = {"Linear": (16, 16), "LayerNormLinear": (16, 16), "LayerNormMLP": (16, 32), "LayerNorm": (16,),
            "RMSNorm": (16,), "DotProductAttention": (2, 8), "MultiheadAttention": (16, 2),
            "TransformerLayer": (16, 32, 2)}


def build(cls, **kwargs):
    if cls != "DotProductAttention":
        kwargs.setdefault("device", "cpu")
    return getattr(te, cls)(*REQUIRED[cls], **kwargs)


def test_snapshot_names_its_te_version():
    assert SNAPSHOT["te_version"].startswith("2.20")
    assert len(SNAPSHOT["commit"]) == 40
    assert set(SNAPSHOT["modules"]) == set(REQUIRED)
    assert "is_fp8_available" in SNAPSHOT["names"] and "Sequential" in SNAPSHOT["submodules"]["ops"]


def test_readme_table_is_current():
    with open(compat_table.README) as f:
        text = f.read()
    assert compat_table.BEGIN in text and compat_table.END in text, \
        "README.md has no generated TE table: run python3 benchmarks/te_compat/compat_table.py --write"
    table = compat_table.render(SNAPSHOT, RESULT)
    assert compat_table.readme_with(table, text) == text, \
        "README.md's TE table is stale: run python3 benchmarks/te_compat/compat_table.py --write"


def test_no_core_constructor_argument_lacks():
    lacking = {cls: [a for a, s, _ in rows if s == "lacks"] for cls, rows in RESULT["modules"].items()}
    assert not any(lacking.values()), lacking


def test_grouped_linear_is_listed_as_lacking():
    assert RESULT["names"]["GroupedLinear"] == "lacks"


def test_refused_entries_are_te_arguments():
    for cls, table in REFUSED.items():
        te_args = {a for a, _ in SNAPSHOT["modules"][cls]["init"]}
        assert set(table) <= te_args, (cls, set(table) - te_args)


@pytest.mark.parametrize("cls,arg", [(c, a) for c, t in REFUSED.items() for a in t])
def test_refused_argument_raises_naming_it(cls, arg):
    entry = REFUSED[cls][arg]
    with pytest.raises(NotImplementedError, match=rf"{cls}: argument '{arg}'=.* is not supported: "):
        build(cls, **{arg: entry["probe"]})
    build(cls, **{arg: entry["off"][0]})  # its "off" value (TE's default) is taken


@pytest.mark.parametrize("cls", list(REQUIRED))
def test_taken_arguments_are_accepted_at_te_defaults(cls):
    """Every argument the table calls taken is accepted at TE's default value
    (what TE code that spells out its defaults passes)."""
    taken = {a for a, s, _ in RESULT["modules"][cls] if s == "has"}
    defaults = {a: d for a, d in SNAPSHOT["modules"][cls]["init"] if a in taken and d is not None}
    defaults.pop("device", None)  # TE's default is 'cuda'
    for name in ("normalized_shape", "hidden_size"):  # the norms: one of the pair, not both
        if cls in ("LayerNorm", "RMSNorm"):
            defaults.pop(name, None)
    kwargs = {a: eval(d, {"torch": torch}) for a, d in defaults.items()}
    build(cls, **kwargs)
