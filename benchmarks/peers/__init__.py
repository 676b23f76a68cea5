"""Peer benchmarks: seqfuse beside Transformer Engine, torchao, Liger-Kernel and
torch.compile in one process on the same inputs (bench_te_modules.py,
bench_torchao.py, bench_liger.py), with the shared run metadata (meta.py),
timing (timing.py), the TE-built ESM-2 (te_esm2.py), the check of which
attention TE runs here (te_probe.py) and the one-line-per-row summary of
the result JSONs that benchmarks/gpu_peers.sh prints last (summary.py).

Importing the package makes seqfuse importable from a source checkout that
is built in place but not installed (python/ goes on sys.path then), as
benchmarks/esm2/common.py does.
"""
import os
import sys

try:
    import seqfuse  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                    "python"))
