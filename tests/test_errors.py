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


def test_number_arguments_name_the_argument_and_the_rule():
    """The bindings' int and float readers (sf_py_arg_long / sf_py_arg_float):
    a value of another kind is a TypeError, one too large for C a ValueError,
    both naming the op and the argument."""
    import torch

    x = torch.ones(4)
    with pytest.raises(TypeError, match="act_forward: argument 'activation' must be an int, got str"):
        _C.act_forward("gelu", x, torch.empty(4), None, None, None)
    with pytest.raises(ValueError, match="act_forward: argument 'activation' is out of range"):
        _C.act_forward(2**70, x, torch.empty(4), None, None, None)
    a, b = torch.ones(3, 4), torch.ones(4, 2)
    with pytest.raises(TypeError, match="gemm: argument 'transa' must be an int, got str"):
        _C.gemm(a, b, torch.empty(3, 2), "x", 0, None, None, 0, 0, None, None, 0, 0, 0, 1, 1.0, None, 0, 0)
    with pytest.raises(ValueError, match="bias_dropout_add: argument 'p' is out of range"):
        _C.bias_dropout_add(x, None, x, 10**400, 0, 0, torch.empty_like(x))
    with pytest.raises(TypeError, match="bias_dropout_add: argument 'p' must be a float, got str"):
        _C.bias_dropout_add(x, None, x, "0.1", 0, 0, torch.empty_like(x))
    t = torch.ones(1, 2, 1, 4)
    with pytest.raises(TypeError, match="rope: argument 'format' must be an int, got str"):
        _C.rope(t, torch.ones(2, 1, 1, 4), None, None, "bshd", False, False, torch.empty_like(t))
    with pytest.raises(TypeError, match="attn_set_forward_kernel: argument 'arch' must be an int, got str"):
        _C.attn_set_forward_kernel("sm90")
    with pytest.raises(TypeError, match="cuda_capability: argument 'device' must be an int, got str"):
        _C.cuda_capability("0")
