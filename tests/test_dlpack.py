"""The DLPack import path of seqfuse._C: what the C side reads from torch
tensors and numpy arrays, through the C exchange API and through capsules."""
import gc
import sys

import numpy as np
import pytest
import torch

import seqfuse
from seqfuse import _C

from dlpack_forge import KDL_CUDA, KDL_FLOAT, KDL_VULKAN, ForgedLayout, ForgedTensor
from helpers import dlpack_path


path = dlpack_path  # both DLPack import paths (helpers)


def test_contiguous(path):
    x = torch.randn(4, 5, 6)
    d = _C.describe(x)
    assert d["shape"] == (4, 5, 6) and d["strides"] == (30, 6, 1)
    assert d["dtype"] == "float32" and d["device"] == "cpu" and d["contiguous"]
    assert d["data"] == x.data_ptr()


def test_non_contiguous_and_offset(path):
    base = torch.randn(8, 10)
    x = base[1:, ::3].t()
    d = _C.describe(x)
    assert d["shape"] == tuple(x.shape) and d["strides"] == tuple(x.stride())
    assert d["data"] == x.data_ptr()  # storage offset applied
    assert not d["contiguous"]


def test_zero_size(path):
    d = _C.describe(torch.empty(3, 0, 2))
    assert d["shape"] == (3, 0, 2)
    assert seqfuse.ops.amax(torch.empty(0)).item() == 0.0


def test_zero_dim(path):
    d = _C.describe(torch.tensor(2.5))
    assert d["shape"] == () and d["strides"] == ()
    assert seqfuse.ops.amax(torch.tensor(-2.5)).item() == 2.5


@pytest.mark.parametrize(
    "dtype,name",
    [
        (torch.float32, "float32"),
        (torch.float16, "float16"),
        (torch.bfloat16, "bfloat16"),
        (torch.float8_e4m3fn, "float8_e4m3fn"),
        (torch.float8_e5m2, "float8_e5m2"),
        (torch.int32, "int32"),
        (torch.int64, "int64"),
        (torch.uint8, "uint8"),
        (torch.bool, "bool"),
    ],
)
def test_dtypes(path, dtype, name):
    from seqfuse.ops._call import FP8_DLPACK

    if dtype.itemsize == 1 and dtype.is_floating_point and not FP8_DLPACK:
        pytest.skip(f"torch {torch.__version__} cannot export float8 through DLPack")
    x = torch.zeros(3, dtype=dtype)
    assert _C.describe(x)["dtype"] == name


def test_e8m0(path):
    if not hasattr(torch, "float8_e8m0fnu"):
        pytest.skip("torch has no float8_e8m0fnu")
    from seqfuse.ops._call import FP8_DLPACK

    if not FP8_DLPACK:
        pytest.skip(f"torch {torch.__version__} cannot export float8 through DLPack")
    x = torch.zeros(2, dtype=torch.float8_e8m0fnu)
    assert _C.describe(x)["dtype"] == "float8_e8m0fnu"


def test_unsupported_dtype_is_type_error(path):
    with pytest.raises(TypeError, match="argument 'x' has a dtype seqfuse does not take"):
        _C.describe(torch.zeros(2, dtype=torch.complex64))


def test_numpy_input():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)[:, 1:]
    d = _C.describe(a)
    assert d["shape"] == (3, 3) and d["strides"] == (4, 1) and not d["readonly"]
    out = np.zeros((), dtype=np.float32)
    _C.amax(a, out)
    assert out == 11.0


def test_numpy_read_only_input_and_output():
    a = np.arange(6, dtype=np.float32)
    a.flags.writeable = False
    try:
        d = _C.describe(a)
    except BufferError:
        pytest.skip("this numpy refuses to export read-only arrays")
    assert d["readonly"]
    out = np.zeros((), dtype=np.float32)
    _C.amax(a, out)  # read-only input is fine
    assert out == 5.0
    ro_out = np.zeros((), dtype=np.float32)
    ro_out.flags.writeable = False
    with pytest.raises(ValueError, match="argument 'out' is an output but its memory is read-only"):
        _C.amax(np.ones(3, dtype=np.float32), ro_out)


def test_not_a_tensor():
    with pytest.raises(TypeError, match="argument 'x' must be a tensor supporting DLPack"):
        _C.describe([1.0, 2.0])


def test_too_many_dims(path):
    with pytest.raises(ValueError, match="at most 8 are supported"):
        _C.describe(torch.zeros([1] * 9))


def test_requires_grad_through_ops(path):
    x = torch.randn(5, requires_grad=True)
    assert seqfuse.ops.amax(x).item() == x.detach().abs().max().item()


def test_wrong_device_is_value_error():
    gpu = ForgedTensor(np.ones(3), device_type=KDL_CUDA)
    with pytest.raises(ValueError, match="arguments 'x' \\(cuda:0\\) and 'out' \\(cpu:0\\) must be on the same device"):
        _C.amax(gpu, np.zeros((), dtype=np.float32), 0)
    assert gpu.deleted == gpu.exported == 1


def test_unknown_device_is_value_error():
    t = ForgedTensor(np.ones(3), device_type=KDL_VULKAN)
    with pytest.raises(ValueError, match="lives on a device seqfuse cannot use"):
        _C.describe(t)
    assert t.deleted == 1


def test_unknown_major_version_is_given_back():
    t = ForgedTensor(np.ones(3), major=2)
    with pytest.raises(TypeError, match="DLPack 2.0 tensor"):
        _C.describe(t)
    assert t.deleted == 1


def test_read_only_flag_respected():
    t = ForgedTensor(np.ones(3), flags=1)
    assert _C.describe(t)["readonly"]
    out = ForgedTensor(np.zeros(()), flags=1)
    with pytest.raises(ValueError, match="argument 'out' is an output but its memory is read-only"):
        _C.amax(np.ones(3, dtype=np.float32), out)
    assert out.deleted == 1


def test_deleter_called_exactly_once_per_export():
    t = ForgedTensor(np.arange(5))
    out = np.zeros((), dtype=np.float32)
    for _ in range(50):
        _C.amax(t, out)
    assert out == 4.0
    assert t.exported == 50 and t.deleted == 50


class LegacyOnly:
    """A producer that knows only the pre-1.0 protocol (no max_version)."""

    def __init__(self, t):
        self.t = t

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()

    def __dlpack__(self, stream=None):
        return self.t.__dlpack__()


def test_legacy_capsule():
    t = torch.arange(6, dtype=torch.float32)
    d = _C.describe(LegacyOnly(t))
    assert d["shape"] == (6,) and d["data"] == t.data_ptr()


class CountingDeleter:
    """Wraps a numpy array; each capsule it hands out must be consumed once."""

    def __init__(self, a):
        self.a = a
        self.calls = 0

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()

    def __dlpack__(self, stream=None, max_version=None):
        self.calls += 1
        return self.a.__dlpack__(max_version=max_version) if max_version else self.a.__dlpack__()


def test_capsule_consumed_and_owner_released():
    a = np.arange(4, dtype=np.float32)
    w = CountingDeleter(a)
    before = sys.getrefcount(a)
    for _ in range(10):
        _C.describe(w)
    gc.collect()
    assert w.calls == 10
    # every capsule's deleter ran: the exporter's references to `a` are gone
    assert sys.getrefcount(a) == before


def test_reference_safety_100k_calls(path):
    """100,000 calls with three tensors: no leaked capsules, flat memory."""
    import tracemalloc

    a, b, c = torch.randn(16), torch.randn(4, 4), torch.randn(2, 8)[:, ::2]
    refs = [sys.getrefcount(t) for t in (a, b, c)]
    for _ in range(1000):  # warm caches before measuring
        _C.probe(a, b, c)
    tracemalloc.start()
    snap0 = tracemalloc.get_traced_memory()[0]
    for _ in range(100_000):
        _C.probe(a, b, c)
    gc.collect()
    grown = tracemalloc.get_traced_memory()[0] - snap0
    tracemalloc.stop()
    assert [sys.getrefcount(t) for t in (a, b, c)] == refs
    assert grown < 64 * 1024, f"traced Python memory grew by {grown} bytes"
    # and the tensors' storages are still intact and usable
    assert torch.isfinite(a).all()


def test_probe_errors_leave_no_borrow(path):
    a = torch.randn(3)
    before = sys.getrefcount(a)
    for _ in range(100):
        with pytest.raises(TypeError):
            _C.probe(a, a, "not a tensor")
    assert sys.getrefcount(a) == before


def test_bad_stream_argument():
    with pytest.raises(TypeError, match="argument 'stream' must be None or an int"):
        _C.amax(torch.randn(3), torch.empty(()), "s")


def test_argument_count():
    with pytest.raises(TypeError, match=r"amax\(\) takes from 2 to 3 positional arguments"):
        _C.amax(torch.randn(3))


@pytest.mark.cuda
def test_cuda_tensor_view(path):
    x = torch.randn(3, 4, device="cuda")
    d = _C.describe(x, torch.cuda.current_stream().cuda_stream)
    assert d["device"] == "cuda" and d["device_id"] == x.device.index and d["data"] == x.data_ptr()


@pytest.mark.cuda
def test_cuda_capsule_path_needs_stream():
    previous = _C.set_exchange_api(False)
    try:
        with pytest.raises(ValueError, match="argument 'stream' is required"):
            _C.amax(torch.randn(3, device="cuda"), torch.empty((), device="cuda"))
    finally:
        _C.set_exchange_api(previous)


@pytest.mark.cuda
def test_cuda_float8_view(path):
    x = torch.randn(8, device="cuda").to(torch.float8_e4m3fn)
    assert _C.describe(x, torch.cuda.current_stream().cuda_stream)["dtype"] == "float8_e4m3fn"


def test_requires_grad_tensor_imported_directly(path):
    """torch's __dlpack__ refuses tensors that require grad; the capsule path
    exports a detached view of the same memory instead."""
    x = torch.randn(4, requires_grad=True)
    d = _C.describe(x)
    assert d["data"] == x.data_ptr() and d["shape"] == (4,)
    assert x.requires_grad and x.grad_fn is None


@pytest.mark.parametrize("row_stride", [2**61, 2**62, 2**62 + 2**60, -(2**61)])
def test_extent_past_64_bits_refused_for_any_producer(row_stride):
    """A producer seqfuse trusts (a DLPack capsule, no torch storage to
    check against) whose layout's bytes overflow 64 bits or wrap around the
    address space is refused naming the argument, before any kernel forms
    an address: at a row stride of 2^62 float32 elements the second row's
    bytes wrap onto the first's (a GEMM with such out and addend wrote both
    rows into one, the overlap check having seen two 8-byte spans); so are
    spans that run past the top of the address range or below 0.  Its
    deleter runs once; a stride that fits is read."""
    keep = np.zeros(64, np.float32)
    x = ForgedLayout(keep, keep.ctypes.data, [2, 2], [row_stride, 1], KDL_FLOAT, 32)
    with pytest.raises(ValueError, match="describe: argument 'x' has shape and strides whose extent overflows "
                                         "64 bits"):
        _C.describe(x, None)
    assert x.deleted == x.exported == 1
    # spans that fit in 64 bits but run past the top of the address range or below address 0 (never read)
    for data, shape, strides in ((2**64 - 16, [8], [1]), (64, [2], [-32])):
        with pytest.raises(ValueError, match="argument 'x' has shape and strides whose extent overflows"):
            _C.describe(ForgedLayout(keep, data, shape, strides, KDL_FLOAT, 32), None)
    fine = ForgedLayout(keep, keep.ctypes.data, [2, 2], [4, 1], KDL_FLOAT, 32)
    assert tuple(_C.describe(fine, None)["strides"]) == (4, 1)


def test_gemm_refuses_an_out_whose_rows_wrap_onto_each_other():
    import importlib
    gemm_ops = importlib.import_module("seqfuse.ops.gemm")
    out_buf, add_buf = np.zeros(64, np.float32), np.zeros(64, np.float32)
    out = ForgedLayout(out_buf, out_buf.ctypes.data, [2, 2], [2**62, 1], KDL_FLOAT, 32)
    addend = ForgedLayout(add_buf, add_buf.ctypes.data, [2, 2], [2**62, 1], KDL_FLOAT, 32)
    with pytest.raises(ValueError, match="gemm: argument 'out' has shape and strides whose extent overflows"):
        _C.gemm(torch.ones(2, 2), torch.ones(2, 2), out, False, False, None, None, 0, 0, None, None,
                gemm_ops._EPI["none"], False, False, False, 1.0, None, 0, 0, addend, None)
