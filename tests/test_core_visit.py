"""No dtype reaches a kernel or a CPU loop by a silent default.

csrc/core/visit.cuh holds the CUDA launchers' dtype visitors (sf_visit_float /
_half / _fp8) and the scoped device guard (sf_on_device).  A template is only
checked when it is instantiated, so the first test compiles a small
translation unit that instantiates each visitor with a kernel launch per
element type, with nvcc for sm_90a as the build does.

The entries refuse a bad dtype before any backend runs, so from Python no bad
dtype reaches a launcher; the other tests call the C layer below the entries
directly, in small programs built here:
- CUDA launchers (the MoE router, the multi-tensor scale) given an int32
  tensor return a TypeError status naming the op and the argument, before
  they touch a GPU (so this runs on a machine without one);
- csrc/core/float_io.h, the CPU references' element access, stops the
  process with the dtype named instead of reading int32 bytes as bfloat16.
The nvcc tests skip without nvcc (about ten seconds each on two cores)."""
import os
import pathlib
import shutil
import subprocess

import pytest

from helpers import cuda_toolkit

ROOT = pathlib.Path(__file__).resolve().parents[1]
_HOME = cuda_toolkit()
NVCC = os.path.join(_HOME, "bin", "nvcc") if _HOME else None
CC = shutil.which("gcc") or shutil.which("cc")
INCLUDES = [f"-I{ROOT / 'csrc' / 'include'}", f"-I{ROOT / 'csrc'}"]
# what the programs below link from the library's core: sf_fail / sf_last_error,
# the dtype table, tensor views
CORE_C = [str(ROOT / "csrc" / "core" / name) for name in ("status.c", "dtype.c", "tensor.c")]

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


LAUNCHERS = r"""
#include <stdio.h>
#include "moe/moe_backend.h"
#include "optim/optim_backend.h"

static void report(const char *what, sf_status st)
{
    printf("%s|%s|%s\n", what, st == SF_ERR_TYPE ? "TypeError" : "other", sf_last_error());
}

int main()
{
    static float buf[64];
    const int64_t shape[2] = {2, 4};
    sf_tensor ints, floats;
    sf_tensor_init(&ints, buf, SF_INT32, 2, shape, SF_CUDA, 0);
    sf_tensor_init(&floats, buf, SF_FLOAT32, 2, shape, SF_CUDA, 0);
    sf_moe_args a = {};
    a.T = 2;
    a.E = 4;
    a.topk = 1;
    a.logits = &ints;
    a.out = &floats;
    a.out2 = &floats;
    a.out3 = &floats;
    report("moe_topk_forward", sf_moe_topk_forward_cuda(&a, NULL));
    a.logits = &floats;
    a.out = &ints;
    report("moe_topk_forward", sf_moe_topk_forward_cuda(&a, NULL));
    sf_tensor list[2] = {floats, ints};
    report("multi_tensor_scale", sf_multi_tensor_scale_cuda(2, list, &floats, NULL));
    return 0;
}
"""


@pytest.mark.skipif(NVCC is None or CC is None, reason="needs nvcc and a C compiler")
def test_cuda_launchers_refuse_a_dtype_outside_the_visitor(tmp_path):
    # PTX only (no ptxas): the launchers' host code is what runs here
    nvcc = [NVCC, "-c", "-std=c++17", "--expt-relaxed-constexpr", "-DSF_WITH_CUDA=1", *INCLUDES,
            "-gencode", "arch=compute_90a,code=compute_90a"]
    (tmp_path / "main.cu").write_text(LAUNCHERS)
    objects = []
    for src in (tmp_path / "main.cu", ROOT / "csrc" / "moe" / "moe_cuda.cu", ROOT / "csrc" / "optim" / "optim_cuda.cu"):
        obj = tmp_path / (src.stem + ".o")
        done = subprocess.run(nvcc + [str(src), "-o", str(obj)], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        objects.append(str(obj))
    for src in CORE_C:
        obj = tmp_path / (pathlib.Path(src).stem + "_c.o")
        done = subprocess.run([CC, "-c", "-std=c11", *INCLUDES, src, "-o", str(obj)], capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        objects.append(str(obj))
    exe = tmp_path / "launchers"
    done = subprocess.run([NVCC, "-o", str(exe), *objects], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    ran = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran.stderr
    rows = [line.split("|") for line in ran.stdout.splitlines()]
    takes = "the CUDA kernel takes float32, float16 or bfloat16"
    assert rows == [
        ["moe_topk_forward", "TypeError", f"moe_topk_forward: argument 'logits' has dtype int32; {takes}"],
        ["moe_topk_forward", "TypeError", f"moe_topk_forward: argument 'probs' has dtype int32; {takes}"],
        ["multi_tensor_scale", "TypeError", f"multi_tensor_scale: argument 'tensors' has dtype int32; {takes}"],
    ]


FLOAT_IO = r"""
#include <stdio.h>
#include <string.h>
#include "core/float_io.h"

int main(int argc, char **argv)
{
    uint16_t bits[2] = {0x3f80, 0x3f80}; /* 1.0 as bfloat16 */
    if (strcmp(argv[1], "bfloat16") == 0) {
        sf_store_float(bits, SF_BFLOAT16, 1, 2.0f);
        printf("%g %g\n", sf_load_float(bits, SF_BFLOAT16, 0), sf_load_float(bits, SF_BFLOAT16, 1));
    } else if (strcmp(argv[1], "load") == 0) {
        printf("%g\n", sf_load_float(bits, SF_INT32, 0));
    } else {
        sf_store_float(bits, SF_UINT8, 0, 2.0f);
    }
    return 0;
}
"""


@pytest.mark.skipif(CC is None, reason="needs a C compiler")
@pytest.mark.parametrize("use, what", [("load", "a load"), ("store", "a store")])
def test_float_io_stops_on_a_dtype_it_does_not_read(tmp_path, use, what):
    src = tmp_path / "float_io.c"
    src.write_text(FLOAT_IO)
    exe = tmp_path / "float_io"
    done = subprocess.run([CC, "-std=c11", "-O2", *INCLUDES, str(src), *CORE_C, "-o", str(exe)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    good = subprocess.run([str(exe), "bfloat16"], capture_output=True, text=True, timeout=30)
    assert (good.returncode, good.stdout) == (0, "1 2\n")
    bad = subprocess.run([str(exe), use], capture_output=True, text=True, timeout=30)
    assert bad.returncode != 0 and bad.stdout == ""  # aborted, nothing read as bfloat16
    dtype = "int32" if use == "load" else "uint8"
    assert f"seqfuse: float_io.h got {what} of an element of dtype {dtype}" in bad.stderr
