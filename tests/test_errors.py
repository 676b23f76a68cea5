"""Every C status maps to its Python exception, carrying the C message."""
import pytest

import seqfuse
from seqfuse import _C


@pytest.mark.parametrize(
    "code,exc",
    [
        (_C.STATUS_TYPE, TypeError),
        (_C.STATUS_VALUE, ValueError),
        (_C.STATUS_NOT_IMPLEMENTED, NotImplementedError),
        (_C.STATUS_RUNTIME, RuntimeError),
    ],
)
def test_status_mapping(code, exc):
    with pytest.raises(exc, match="^op: argument 'x' broke a rule$"):
        _C.raise_status(code, "op: argument 'x' broke a rule")


def test_ok_status_raises_nothing():
    assert _C.raise_status(0, "ignored") is None


def test_build_info_fields():
    info = seqfuse.build_info()
    assert set(info) >= {"cuda", "cuda_archs", "cuda_runtime", "cublaslt", "nccl"}
    if info["cuda"]:
        assert info["cuda_runtime"] >= 12000 and info["cublaslt"] > 0
        assert "90a" in info["cuda_archs"] or info["cuda_archs"]
    else:
        assert info["cuda_runtime"] == 0


def test_cuda_available_is_bool():
    assert isinstance(seqfuse.cuda_available(), bool)


def test_cuda_tensor_in_cpu_build_is_not_implemented():
    if seqfuse.build_info()["cuda"]:
        pytest.skip("CUDA build")
    from dlpack_forge import KDL_CUDA, ForgedTensor
    import numpy as np

    with pytest.raises(NotImplementedError, match="built without CUDA"):
        _C.amax(ForgedTensor(np.ones(3), device_type=KDL_CUDA), ForgedTensor(np.zeros(()), device_type=KDL_CUDA), 0)
