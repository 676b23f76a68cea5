"""Quantizers: torch tensor in, quantized tensor (tensor.py) out.  What the
GEMM modules call; each is a thin layer over seqfuse.ops.quant that
allocates the outputs and fills the quantized tensor's fields."""
import logging

import torch

from ..ops import quant as qops
from ..ops import device_checks
from . import recompute, stats
from .tensor import Float8BlockTensor, Float8Tensor, MXFP8Tensor, NVFP4Tensor

_log = logging.getLogger("seqfuse")


def quantize(x, scale, amax, fp8_dtype, *, transpose=False, rowwise=True, dbias=False, out=None,
             out_t=None, scale_inv=None, rows=None, dbias_dtype=torch.float32):
    """x -> Float8Tensor with ``scale`` (float32 one-element tensor), folding
    max|x| into ``amax`` (accumulates; None to skip).  ``transpose`` also
    makes the [K, M] copy (x viewed as [M, K]); ``rowwise=False`` makes only
    that copy.  ``dbias`` (with ``transpose``, where
    ``ops.quant.dbias_fusable(x)``): also x's column sums from the same
    pass, in ``dbias_dtype`` (summed in float32, rounded once), returned as
    ``(Float8Tensor, dbias)``.  ``out``, ``out_t`` and
    ``scale_inv`` (optional) are written instead of new tensors.  ``rows``
    (>= M): the copies carry that many token rows, the extra ones zero
    (the FP8 GEMMs' padding, written by the cast); ``shape`` stays x's."""
    fp8_dtype = qops.fp8_dtype_of(fp8_dtype, "quantize")
    if dbias and not transpose:
        raise ValueError("quantize: dbias=True needs transpose=True (the sums come from the "
                         "cast+transpose kernel)")
    if scale_inv is None:
        scale_inv = torch.empty(1, dtype=torch.float32, device=x.device)
    if transpose:
        data, data_t, *db = qops.cast_transpose_fp8(x, scale, amax, fp8_dtype, scale_inv=scale_inv,
                                                    rowwise=rowwise, dbias=dbias, out=out, out_t=out_t,
                                                    rows=rows, dbias_dtype=dbias_dtype)
    else:
        if not rowwise:
            raise ValueError("quantize: rowwise=False needs transpose=True (no copy asked for)")
        data, data_t = qops.cast_fp8(x, scale, amax, fp8_dtype, scale_inv=scale_inv, out=out, rows=rows), None
    q = Float8Tensor(data, scale_inv, fp8_dtype, data_t=data_t, dtype=x.dtype, shape=x.shape)
    return (q, db[0]) if dbias else q


_first_cast_logged = []


def delayed_scale(state, index, amax, device):
    """The scale tensor ``index`` of ``state`` is cast with under delayed
    scaling: the state's.  For a tensor with no amax history yet, the
    first step, ``amax()`` (a device tensor: the tensor's own amax, or an
    upper bound of it for a tensor a kernel casts) sets it first, written
    into the live slots so its consumers see it, logged once.  Not under
    CUDA graph capture (a replay would repeat the host's first-step choice:
    the scale stays 1) nor in a checkpoint's recompute, which reads the
    scale its forward noted, as for any scale."""
    if not state.has_history(index) and not recompute.replaying():
        state.note_first_cast(index)
        if not device_checks.capturing(device):
            if not _first_cast_logged:
                _first_cast_logged.append(True)
                _log.info("seqfuse FP8 delayed scaling: tensors cast before their first amax history "
                          "(the first step) take their scale from their own amax (current scaling), not "
                          "the initial scale 1")
            # into the live slots, before scale_of below notes the scale for a checkpoint's recompute
            qops.fp8_compute_scale(amax().reshape(1).float(), *state.live_scale(index), state.fp8_max(index),
                                   int(getattr(state.recipe, "margin", 0)))
    return state.scale_of(index)


def quantize_with_state(x, state, index, *, transpose=False, rowwise=True, dbias=False, rows=None):
    """Quantize ``x`` as tensor ``index`` of a ScalingState (delayed
    scaling): its scale, its amax slot for this step, its FP8 dtype.

    A tensor with no amax history yet (``state.has_history(index)`` False:
    no delayed-scaling update has run since it was first cast) would be cast
    with the initial scale 1, where a training step's small output gradients
    (~1e-5 and below) fall under E5M2's range and the first weight gradients
    come out zero.  Such a cast takes its scale from its own amax instead
    (current scaling, written into the state's scale, so its consumers see
    it), logged once.  Not under CUDA graph capture (a replay would repeat
    the host's first-step choice), which keeps scale 1; a checkpoint's
    recompute reads the scale its forward noted, as for any scale."""
    state.ensure_pooled()  # (state_cast_args' steady path leaves that check to its callers)
    scale, amax, fp8_dtype = state_cast_args(state, index, x)
    return quantize(x, scale, amax, fp8_dtype, transpose=transpose,
                    rowwise=rowwise, dbias=dbias, rows=rows)


def state_cast_args(state, index, x):
    """(scale, amax slot, FP8 dtype) of a delayed-scaling cast of ``x`` as
    tensor ``index`` of ``state``, with what such a cast does first: the
    first step's own-amax scale (:func:`delayed_scale`) and, when statistics
    are recorded, the cast's record.  What :func:`quantize_with_state` and
    the GEMM modules' quantizers (which make their outputs themselves) share.
    In steady state (``state.steady_cast_args``: a history, no recompute, no
    statistics recorded this step) three kept views; the caller has checked
    the pooling then (GemmQuantizers.adopt, quantize_with_state)."""
    if not recompute.open_contexts and not stats.recording():
        args = state.steady_cast_args(index)
        if args is not None:
            return args
    state.ensure_pooled()
    fp8_dtype = state.fp8_dtype(index)
    scale = delayed_scale(state, index, lambda: qops.amax(x), x.device)
    if stats.recording() and not recompute.replaying():  # a recompute's casts were the forward's
        stats.record_cast(state, index, x.detach(), scale, fp8_dtype)
    return scale, state.amax_of(index), fp8_dtype


def quantize_current(x, fp8_dtype, *, margin=0, transpose=False, rowwise=True, amax=None,
                     amax_reduction_group=None, dbias=False, into=None, scale=None, rows=None,
                     dbias_dtype=torch.float32):
    """Current scaling: scale = fp8_max / max|x| / 2**margin from x itself
    (an amax pass, an optional all-reduce of that amax, a scale kernel, then
    the cast).  ``amax`` (optional one-element float32) receives max|x|.
    ``into`` (a Float8Tensor of x's shape and format) and ``scale`` (a
    one-element float32 buffer): written instead of new tensors (a weight
    re-cast each step allocates nothing).  ``rows``, ``dbias`` and
    ``dbias_dtype``: as in :func:`quantize`."""
    fp8_dtype = qops.fp8_dtype_of(fp8_dtype, "quantize_current")
    dev = x.device
    if amax is None:
        amax = torch.empty(1, device=dev)
    if scale is None:
        scale = torch.empty(1, dtype=torch.float32, device=dev)
    if into is not None:
        scale_inv, out, out_t = into.scale_inv, into.data, into.data_t
    else:
        scale_inv = torch.empty(1, dtype=torch.float32, device=dev)
        out = out_t = None
    if amax_reduction_group is None and not dbias:
        # the common path (weights, current-scaling activations): one op call
        data, data_t = qops.cast_fp8_current(x, fp8_dtype, amax=amax.reshape(1), scale=scale,
                                             scale_inv=scale_inv, out=out, out_t=out_t,
                                             rowwise=rowwise, transpose=transpose, margin=margin,
                                             rows=rows)
        return Float8Tensor(data, scale_inv, fp8_dtype, data_t=data_t, dtype=x.dtype, shape=x.shape)
    amax = qops.amax(x, out=amax)
    if amax_reduction_group is not None:
        torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX,
                                     group=amax_reduction_group)
    amax = amax.reshape(1)
    qops.fp8_compute_scale(amax, scale, scale_inv, qops.FP8_MAX[fp8_dtype], margin)
    return quantize(x, scale, None, fp8_dtype, transpose=transpose, rowwise=rowwise, dbias=dbias,
                    out=out, out_t=out_t, scale_inv=scale_inv, rows=rows, dbias_dtype=dbias_dtype)


def quantize_block(x, block_rows=1, fp8_dtype=torch.float8_e4m3fn, *, columnwise=False,
                   rowwise=True, rows=None):
    """FP8 with 1x128 (block_rows=1) or 128x128 (block_rows=128) fp32 block
    scales in cuBLASLt's Hopper layout -> Float8BlockTensor.  With
    ``columnwise=True`` (1x128 only) the same pass also makes the transposed
    copy in 1x128 blocks along M (data_t [K, round_up(M, 128)], zero past
    M, and scale_inv_t); ``rowwise=False`` then skips the row-wise copy.
    ``rows`` (1x128, >= M): the row-wise copy carries that many token rows,
    the extra ones zero (written by the same launch); ``shape`` stays x's."""
    if columnwise:
        if block_rows != 1:
            raise ValueError("quantize_block: columnwise copies are made for 1x128 blocks; a "
                             "128x128-block tensor serves both GEMM layouts by transposing its "
                             "scales")
        data, si, data_t, si_t = qops.quantize_block_fp8_rowcol(x, fp8_dtype, rowwise=rowwise, rows=rows)
        return Float8BlockTensor(data, si, 1, dtype=x.dtype, data_t=data_t, scale_inv_t=si_t,
                                 shape=x.shape)
    data, scale_inv = qops.quantize_block_fp8(x, block_rows, fp8_dtype, rows=rows)
    return Float8BlockTensor(data, scale_inv, block_rows, dtype=x.dtype,
                             shape=None if rows is None else x.shape)


def quantize_mxfp8(x, fp8_dtype=torch.float8_e4m3fn):
    data, scales = qops.quantize_mxfp8(x, fp8_dtype)
    return MXFP8Tensor(data, scales, dtype=x.dtype)


def quantize_nvfp4(x):
    data, block_scales, global_scale_inv = qops.quantize_nvfp4(x)
    return NVFP4Tensor(data, block_scales, global_scale_inv, dtype=x.dtype)
