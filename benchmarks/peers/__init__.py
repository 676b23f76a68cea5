"""Peer benchmarks: seqfuse beside Transformer Engine, torchao, Liger-Kernel and
torch.compile in one process on the same inputs (see each bench_*.py), with
the shared run metadata (meta.py) and the TE-built ESM-2 (te_esm2.py)."""
