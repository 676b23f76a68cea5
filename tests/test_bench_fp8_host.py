"""benchmarks/bench_fp8_host.py: the kernel stubs are in place only inside the
measurement (seqfuse works normally afterwards, even when the measured code
raises), and a layer's host time comes out for bf16 and each FP8 recipe."""
import os
import sys

import pytest
import torch

import seqfuse
from helpers import needs_fp8

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench_fp8_host  # noqa: E402


def test_stubs_restored_even_on_error():
    real = seqfuse._C.gemm
    with pytest.raises(RuntimeError, match="inside"):
        with bench_fp8_host.stubbed_kernels():
            assert seqfuse._C.gemm is not real and seqfuse._C.gemm(1, 2, x=3) is None
            raise RuntimeError("inside")
    assert seqfuse._C.gemm is real
    a, b = torch.randn(16, 32), torch.randn(8, 32)
    assert torch.allclose(seqfuse.ops.gemm(a, b, transb=True), a @ b.t(), rtol=1e-5, atol=1e-5)


@needs_fp8
def test_host_time_per_recipe():
    from seqfuse.common.recipe import DelayedScaling, Float8BlockScaling

    runners = [bench_fp8_host.layer_runner(recipe, torch.device("cpu"), update)
               for recipe in (None, DelayedScaling(), Float8BlockScaling()) for update in (True, False)]
    times = bench_fp8_host.host_us(runners, iters=3, rounds=2)
    assert len(times) == 6 and all(0 < us < 1e6 for us in times)
