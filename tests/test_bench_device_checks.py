"""benchmarks/bench_device_checks.py on the CPU: its "off" setting really
skips the labels and cu_seqlens checks, also where the attention and RoPE
ops call them, and puts everything back (even when the region raises); the
packed batch it times is exactly the asked token count of real protein
lengths.  (The timings themselves need a GPU.)"""
import os
import sys

import pytest
import torch

import seqfuse.ops.attn._args as attn_args
import seqfuse.ops.rope as rope_ops
from seqfuse.ops import device_checks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench_device_checks as bench  # noqa: E402


def test_off_skips_both_checks_and_restores(monkeypatch):
    monkeypatch.setattr(device_checks, "HOST_READ", ())  # the device path on CPU tensors
    monkeypatch.setattr(device_checks, "_cu_facts", None)
    real = device_checks.check_cu_seqlens
    bad_labels = torch.tensor([1, 40, 2])
    bad_cu = torch.tensor([0, 5, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"argument 'labels' holds 40 at row 1"):
        device_checks.check_labels("cross_entropy_forward", bad_labels, 32, -100)
    with pytest.raises(ValueError, match="must be non-decreasing"):
        attn_args.check_cu_seqlens("attention", "cu_seqlens_q", bad_cu)
    with pytest.raises(RuntimeError, match="inside"):
        with bench.checks(False) as patched:
            assert attn_args in patched and rope_ops in patched and device_checks in patched
            device_checks.check_labels("cross_entropy_forward", bad_labels, 32, -100)  # skipped
            for mod in (device_checks, attn_args, rope_ops):
                mod.check_cu_seqlens("attention", "cu_seqlens_q", bad_cu)  # skipped
            raise RuntimeError("inside")
    assert device_checks.check_cu_seqlens is real and attn_args.check_cu_seqlens is real
    assert rope_ops.check_cu_seqlens is real
    with pytest.raises(ValueError, match=r"argument 'labels' holds 40"):
        device_checks.check_labels("cross_entropy_forward", bad_labels, 32, -100)
    with bench.checks(True) as patched:
        assert patched == []
        with pytest.raises(ValueError, match="must be non-decreasing"):
            rope_ops.check_cu_seqlens("rope", "cu_seqlens", bad_cu)


def test_packed_batch_of_real_protein_lengths():
    pytest.importorskip("pyarrow")
    cu, longest = bench.protein_cu_seqlens(16384)
    lens = (cu[1:] - cu[:-1]).tolist()
    assert cu.dtype == torch.int32 and int(cu[0]) == 0 and int(cu[-1]) == 16384
    assert min(lens) >= 1 and max(lens) == longest <= 1024 and len(lens) > 10
