"""The ESM-2 recipe's checkpoints ARE the shared ones: this module name is an
alias of recipes/recipe_common/checkpoint.py (atomic DCP checkpoints with a
CRC-32 manifest, keep-last-N, verified resume, RNG and trainer state), so
``from esm2_recipe import checkpoint`` and the recipes' trainer reach one
module object -- one place to read, and one place a test replaces a function
in.  ESM-2's Hugging Face export is esm2_recipe/export.py.
"""
import sys

from recipe_common import checkpoint as _shared

sys.modules[__name__] = _shared
