"""The CPU/CUDA split at the end of every family's C entry (csrc/core/dispatch.h).

In a CPU-only build a tensor that lives on a GPU passes every argument check
and then meets SF_DISPATCH's CUDA branch: one NotImplementedError, worded the
same for every family, naming the op and the argument whose device decides.
The tensors here only claim to be on cuda:0 (hand-made DLPack capsules over
host memory), so nothing can launch.  In a CUDA build the branch runs the
kernels, which the cuda-marked tests of each family cover; these skip there.
CPU only, milliseconds."""
import numpy as np
import pytest

import seqfuse
from seqfuse import _C
from dlpack_forge import KDL_CUDA, ForgedLayout

pytestmark = pytest.mark.skipif(seqfuse.build_info()["cuda"], reason="a CUDA build runs the kernels")

_DL = {np.float32: (2, 32), np.int64: (0, 64), np.int32: (0, 32), np.uint8: (1, 8), np.bool_: (6, 8)}


def gpu(shape, dtype=np.float32):
    """A contiguous tensor of `shape` that claims to live on cuda:0."""
    a = np.zeros(shape, dtype=dtype)
    code, bits = _DL[dtype]
    strides = [s // a.itemsize for s in a.strides]
    return ForgedLayout(a, a.ctypes.data, a.shape, strides, code, bits, device_type=KDL_CUDA)


def fp8(shape):
    """The same in float8_e4m3fn (DLPack code 10)."""
    a = np.zeros(shape, dtype=np.uint8)
    return ForgedLayout(a, a.ctypes.data, a.shape, [s for s in a.strides], 10, 8, device_type=KDL_CUDA)


def bf16(shape):
    """The same in bfloat16, 64-byte aligned (the attention entry checks alignment on CUDA)."""
    raw = np.zeros(int(np.prod(shape)) * 2 + 64, dtype=np.uint8)
    data = raw.ctypes.data + (-raw.ctypes.data) % 64
    strides = [int(np.prod(shape[i + 1:])) for i in range(len(shape))]
    return ForgedLayout(raw, data, shape, strides, 4, 16, device_type=KDL_CUDA)


_CFG = (0, 0, -1, -1, 0.125, 4, 4, 0, 0.0, 0, 0)  # bshd, no mask, s_q = s_kv = 4


CASES = {
    "amax": (lambda: _C.amax(gpu(3), gpu(()), 0), "x"),
    "cast_fp8": (lambda: _C.cast_fp8(gpu((4, 16)), gpu(1), None, fp8((4, 16)), None, None, 0), "x"),
    "dequantize_fp8": (lambda: _C.dequantize_fp8(fp8((4, 16)), gpu(1), gpu((4, 16)), 0), "data"),
    "fp8_compute_scale": (lambda: _C.fp8_compute_scale(gpu(3), gpu(3), gpu(3), 448.0, 0, 0), "amax"),
    "fp8_scale_update": (lambda: _C.fp8_scale_update(gpu((2, 3)), gpu(3), gpu(3), gpu(3), 0, 0, 0),
                         "amax_history"),
    "quantize_block_fp8": (lambda: _C.quantize_block_fp8(gpu((128, 128)), fp8((128, 128)), gpu((1, 128)), 1, 0),
                           "x"),
    "attention_forward": (lambda: _C.attn_forward(bf16((1, 4, 2, 64)), bf16((1, 4, 2, 64)), bf16((1, 4, 2, 64)), None,
                                          None, bf16((1, 4, 2, 64)), gpu((1, 2, 4)), _CFG, 0), "q"),
    "quantize_rowwise_fp8": (lambda: _C.quantize_rowwise_fp8(gpu((4, 16)), fp8((4, 16)), gpu(4), 0), "x"),
    "quantize_mxfp8": (lambda: _C.quantize_mxfp8(gpu((2, 32)), fp8((2, 32)), gpu((2, 1), np.uint8), 0), "x"),
    "gemm": (lambda: _C.gemm(gpu((4, 4)), gpu((4, 4)), gpu((4, 4)), 0, 0, None, None, 0, 0, None, None, 0, 0,
                             0, 1, 1.0, None, 0, 0, None, 0), "a"),
    "rmsnorm_forward": (lambda: _C.rmsnorm_forward(gpu((2, 8)), gpu(8), 1e-5, False, gpu((2, 8)), None, None, None,
                                           None, 0), "x"),
    "act_forward": (lambda: _C.act_forward(0, gpu((2, 8)), gpu((2, 8)), None, None, None, 0), "x"),
    "bias_dropout_add": (lambda: _C.bias_dropout_add(gpu((2, 8)), None, gpu((2, 8)), 0.1, 1, 2, gpu((2, 8)),
                                                     0), "x"),
    "rope": (lambda: _C.rope(gpu((4, 1, 2, 8)), gpu((4, 1, 1, 8)), None, None, 0, False, False,
                             gpu((4, 1, 2, 8)), 0), "t"),
    "cross_entropy_forward": (lambda: _C.cross_entropy_forward(gpu((2, 8)), gpu(2, np.int64), -100, 0.0, gpu(2),
                                                               gpu(2), None, None, 0), "logits"),
    "multi_tensor_scale": (lambda: _C.multi_tensor_scale([gpu(4)], gpu(1), 0), "scale"),
    "multi_tensor_adamw": (lambda: _C.multi_tensor_adamw([gpu(4)], [gpu(4)], [gpu(4)], [gpu(4)], None, 1e-3, 0.9,
                                                         0.99, 1e-8, 0.0, 1, 0), "params"),
    "moe_swiglu_forward": (lambda: _C.moe_swiglu_forward(gpu((2, 8)), None, gpu((2, 4)), 0), "x"),
}


@pytest.mark.parametrize("op", sorted(CASES))
def test_cuda_tensor_in_cpu_build_names_the_op_and_argument(op):
    call, arg = CASES[op]
    with pytest.raises(NotImplementedError) as info:
        call()
    assert str(info.value) == (f"{op}: argument '{arg}' is a CUDA tensor but seqfuse was built without CUDA "
                               "(rebuild with nvcc on PATH and SEQFUSE_CUDA unset)")
