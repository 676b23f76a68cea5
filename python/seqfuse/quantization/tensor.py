"""Quantized tensors: the FP8 (or FP4) bytes plus what it takes to read them
back -- the inverse scale the data was made with and, where a GEMM needs
it, the transposed copy.

These are plain holders, not torch.Tensor subclasses: the GEMM layer takes
their fields apart and hands them to cuBLASLt.  Each has ``dequantize()``.
"""
import torch

from ..ops import quant as qops


class Float8Tensor:
    """An FP8 tensor with one scale for the whole tensor.

    data:      FP8 torch tensor (float8_e4m3fn / float8_e5m2), the row-wise
               copy shaped like the original [..., K], or None when only the
               transposed copy was made.
    data_t:    FP8 [K, M] transposed copy (the original viewed as [M, K]), or None.
    scale_inv: float32 tensor of one element: original ~= float(data) * scale_inv.
    fp8_dtype: data's dtype.
    dtype:     the dtype the tensor stands for (what dequantize() returns).
    """

    __slots__ = ("data", "data_t", "scale_inv", "fp8_dtype", "dtype", "shape")

    def __init__(self, data, scale_inv, fp8_dtype=None, data_t=None, dtype=torch.float32,
                 shape=None):
        if data is None and data_t is None:
            raise ValueError("Float8Tensor: needs 'data' or 'data_t'")
        self.data = data
        self.data_t = data_t
        self.scale_inv = scale_inv
        self.fp8_dtype = fp8_dtype or (data if data is not None else data_t).dtype
        self.dtype = dtype
        if shape is None:
            shape = data.shape if data is not None else tuple(reversed(data_t.shape))
        self.shape = shape if type(shape) is torch.Size else torch.Size(shape)

    @property
    def device(self):
        return (self.data if self.data is not None else self.data_t).device

    def dequantize(self, dtype=None):
        """The original values, as float(data) * scale_inv, in ``dtype``
        (default: the dtype this tensor stands for)."""
        dtype = dtype or self.dtype
        if self.data is not None:
            return qops.dequantize_fp8(self.data, self.scale_inv, dtype)
        return qops.dequantize_fp8(self.data_t, self.scale_inv, dtype).t().reshape(self.shape)

    def __repr__(self):
        return (f"Float8Tensor(shape={tuple(self.shape)}, fp8_dtype={self.fp8_dtype}, "
                f"transposed_copy={self.data_t is not None}, device={self.device})")


class Float8BlockTensor:
    """FP8 with fp32 block scales in the layout cuBLASLt's block-scaled GEMMs
    read on Hopper (see seqfuse.ops.quantize_block_fp8): block_rows 1 for
    1x128 blocks, 128 for 128x128 blocks.  For 1x128, ``data_t`` /
    ``scale_inv_t`` optionally hold the column-wise copy (the transposed
    matrix in 1x128 blocks along M, quantize_block_fp8_rowcol; its rows are
    zero-padded to a multiple of 128, ``shape`` stays the original's).  A
    1x128 ``data`` may carry more rows than ``shape`` (token padding: zero
    rows past the real ones, which dequantize() leaves out)."""

    __slots__ = ("data", "scale_inv", "block_rows", "dtype", "data_t", "scale_inv_t", "_shape")

    def __init__(self, data, scale_inv, block_rows, dtype=torch.float32, data_t=None,
                 scale_inv_t=None, shape=None):
        self.data, self.scale_inv, self.block_rows, self.dtype = data, scale_inv, block_rows, dtype
        self.data_t, self.scale_inv_t = data_t, scale_inv_t
        if shape is None:
            shape = data.shape if data is not None else tuple(reversed(data_t.shape))
        self._shape = shape if type(shape) is torch.Size else torch.Size(shape)

    @property
    def shape(self):
        return self._shape

    def dequantize(self, dtype=None):
        if self.data is None:
            k = self._shape[-1]
            m = self._shape.numel() // k if k else 0
            full = qops.dequantize_block_fp8(self.data_t, self.scale_inv_t, 1, dtype or self.dtype)
            return full.t()[:m].reshape(self._shape)
        full = qops.dequantize_block_fp8(self.data, self.scale_inv, self.block_rows, dtype or self.dtype)
        if full.numel() != self._shape.numel():  # token rows padded with zero rows (quantize_block's rows)
            return full[:self._shape.numel() // self._shape[-1]].reshape(self._shape)
        return full


class MXFP8Tensor:
    """MXFP8: FP8 data [M, K] and E8M0 scales [M, K/32] (row-major)."""

    __slots__ = ("data", "scales", "dtype")

    def __init__(self, data, scales, dtype=torch.float32):
        self.data, self.scales, self.dtype = data, scales, dtype

    @property
    def shape(self):
        return self.data.shape

    def dequantize(self, dtype=None):
        return qops.dequantize_mxfp8(self.data, self.scales, dtype or self.dtype)


class NVFP4Tensor:
    """NVFP4: packed E2M1 data uint8 [M, K/2] (low nibble first), E4M3 block
    scales [M, K/16] and the per-tensor float32 global_scale_inv."""

    __slots__ = ("data", "block_scales", "global_scale_inv", "dtype")

    def __init__(self, data, block_scales, global_scale_inv, dtype=torch.float32):
        self.data, self.block_scales, self.global_scale_inv, self.dtype = (
            data, block_scales, global_scale_inv, dtype)

    @property
    def shape(self):
        return torch.Size((*self.data.shape[:-1], self.data.shape[-1] * 2))

    def dequantize(self, dtype=None):
        return qops.dequantize_nvfp4(self.data, self.block_scales, self.global_scale_inv,
                                     dtype or self.dtype)
