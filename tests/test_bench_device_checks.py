"""benchmarks/bench_device_checks.py on the CPU: its "off" setting really
skips the labels and cu_seqlens checks and puts both settings back (even when
the region raises), and the packed batch it times is exactly the asked
token count of real protein lengths.  (The timings themselves need a GPU.)"""
import os
import sys

import pytest
import torch

from seqfuse.ops import device_checks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench_device_checks as bench  # noqa: E402


def test_off_skips_both_checks_and_restores(monkeypatch):
    monkeypatch.setattr(device_checks, "HOST_READ", ())  # the device path on CPU tensors
    monkeypatch.setattr(device_checks, "_cu_facts", None)
    bad_labels = torch.tensor([1, 40, 2])
    bad_cu = torch.tensor([0, 5, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"argument 'labels' holds 40 at row 1"):
        device_checks.check_labels("cross_entropy_forward", bad_labels, 32, -100)
    with pytest.raises(ValueError, match="must be non-decreasing"):
        device_checks.check_cu_seqlens("attention", "cu_seqlens_q", bad_cu)
    with pytest.raises(RuntimeError, match="inside"):
        with bench.checks(False, device_type="cpu"):
            device_checks.check_labels("cross_entropy_forward", bad_labels, 32, -100)  # skipped
            device_checks.check_cu_seqlens("attention", "cu_seqlens_q", bad_cu)  # skipped
            raise RuntimeError("inside")
    assert device_checks.HOST_READ == ()
    with pytest.raises(ValueError, match=r"argument 'labels' holds 40"):
        device_checks.check_labels("cross_entropy_forward", bad_labels, 32, -100)
    with bench.checks(True, device_type="cpu"):
        with pytest.raises(ValueError, match="must be non-decreasing"):
            device_checks.check_cu_seqlens("attention", "cu_seqlens_q", bad_cu)


def test_packed_batch_of_real_protein_lengths():
    pytest.importorskip("pyarrow")
    cu, longest = bench.protein_cu_seqlens(16384)
    lens = (cu[1:] - cu[:-1]).tolist()
    assert cu.dtype == torch.int32 and int(cu[0]) == 0 and int(cu[-1]) == 16384
    assert min(lens) >= 1 and max(lens) == longest <= 1024 and len(lens) > 10
