"""csrc/core/visit.cuh compiles for every element type it names.

The header holds the CUDA launchers' dtype visitors (sf_visit_float / _half /
_fp8) and the scoped device guard (sf_on_device).  A template is only checked
when it is instantiated, so this test compiles a small translation unit that
instantiates each visitor with a kernel launch per element type, with nvcc
for sm_90a as the build does.  Needs nvcc (skips without it); about ten
seconds on two cores."""
import os
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)

SOURCE = r"""
#include "core/visit.cuh"

template <typename T> __global__ void copy_one(T *p) { p[0] = p[1]; }

template <typename Visit>
static sf_status launch_each(Visit visit, sf_dtype dtype, void *p, cudaStream_t stream)
{
    return visit("visit_test", "x", dtype, [&](auto tag) -> sf_status {
        using T = typename decltype(tag)::type;
        copy_one<T><<<1, 1, 0, stream>>>(static_cast<T *>(p));
        SF_CUDA_CHECK_LAUNCH("visit_test");
        return SF_OK;
    });
}

extern "C" sf_status visit_all(sf_dtype dtype, void *p, cudaStream_t stream)
{
    return sf_on_device("visit_test", 0, [&]() -> sf_status {
        SF_TRY(launch_each([](auto... a) { return sf_visit_float(a...); }, dtype, p, stream));
        SF_TRY(launch_each([](auto... a) { return sf_visit_half(a...); }, dtype, p, stream));
        return launch_each([](auto... a) { return sf_visit_fp8(a...); }, dtype, p, stream);
    });
}
"""


@pytest.mark.skipif(NVCC is None, reason="needs nvcc")
def test_visitors_compile_for_every_element_type(tmp_path):
    src = tmp_path / "visit_test.cu"
    src.write_text(SOURCE)
    cmd = [NVCC, "-c", str(src), "-o", str(tmp_path / "visit_test.o"), "-std=c++17", "-Xcompiler", "-fPIC",
           "-DSF_WITH_CUDA=1", f"-I{ROOT / 'csrc' / 'include'}", f"-I{ROOT / 'csrc'}",
           "-gencode", "arch=compute_90a,code=sm_90a"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "visit_test.o").stat().st_size > 0
