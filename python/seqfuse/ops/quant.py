"""Quantization statistics and casts (csrc/quant/)."""
import math

import torch

from .. import _C
from ._call import (FAST_EXCHANGE, FP8_DLPACK, as_float, as_int, empty, given_out, mark_written,
                    require_fp8_dlpack, stream_for)
from .buffers import new_or_transient

_FLOAT_INPUTS = (torch.float32, torch.float16, torch.bfloat16)


def amax(x, out=None):
    """max |x| over every element, as a 0-d float32 tensor on x's device.

    NaN in ``x`` gives NaN; an empty ``x`` gives 0.  ``out`` (optional) is a
    float32 tensor of one element to write into.  Runs on the current CUDA
    stream without synchronizing the host.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"amax: argument 'x' must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_INPUTS:
        raise TypeError(f"amax: argument 'x' must have dtype float32, float16 or bfloat16, got {x.dtype}")
    if x.requires_grad:
        x = x.detach()
    if out is None:
        out = torch.empty((), dtype=torch.float32, device=x.device)
        _C.amax(x, out, stream_for(x))
        return out
    y = given_out("amax", out)
    _C.amax(x, y, stream_for(x))
    mark_written(y)
    return out


# ---- FP8 with one scale per tensor -----------------------------------------

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
#: Largest finite value of each FP8 format (saturation bound).
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
_FP8_NAMES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2,
              "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


def fp8_dtype_of(fp8_dtype, op="cast_fp8"):
    """torch.float8_e4m3fn / torch.float8_e5m2 from a dtype or a name
    ("e4m3", "e5m2")."""
    if isinstance(fp8_dtype, str):
        d = _FP8_NAMES.get(fp8_dtype.lower())
        if d is not None:
            return d
    elif fp8_dtype in FP8_DTYPES:
        return fp8_dtype
    raise TypeError(f"{op}: argument 'fp8_dtype' must be torch.float8_e4m3fn or "
                    f"torch.float8_e5m2 (or 'e4m3' / 'e5m2'), got {fp8_dtype!r}")


def _check_input(op, x, name="x"):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: argument '{name}' must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_INPUTS:
        raise TypeError(f"{op}: argument '{name}' must have dtype float32, float16 or bfloat16, got {x.dtype}")
    if x.requires_grad:
        x = x.detach()
    return x if x.is_contiguous() else x.contiguous()


def _check_fp8_data(op, data):
    """``data`` is a float8 (e4m3fn / e5m2) torch tensor, or a TypeError naming it."""
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"{op}: argument 'data' must be a torch.Tensor, got {type(data).__name__}")
    if data.dtype not in FP8_DTYPES:
        raise TypeError(f"{op}: argument 'data' must have dtype float8_e4m3fn or float8_e5m2, got {data.dtype}")


def _check_scalar(op, name, t, device):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: argument '{name}' must be a float32 torch.Tensor of one element, "
                        f"got {type(t).__name__}")
    return t


def cast_fp8(x, scale, amax, fp8_dtype, *, out=None, scale_inv=None, rows=None):
    """Scale and cast ``x`` to FP8: ``out = saturate(x * scale[0])``, rounding
    to nearest even and saturating at the format's max (448 for E4M3, 57344
    for E5M2).  One pass over ``x`` on the current stream, no host sync.

    ``scale``: float32 tensor of one element on x's device (read on the device).
    ``amax``: float32 tensor of one element, or None.  It ACCUMULATES:
    ``amax[0] = max(amax[0], max|x|)`` -- the per-step amax of delayed
    scaling is zeroed by the scale update and then gathers every cast of the
    step.  A start below zero (or -0.0) counts as 0 (the fold is a signed
    max on the float bits); NaN, in the buffer or in x, wins.
    ``scale_inv``: optional float32 tensor of one element that receives
    ``1 / scale[0]`` (the inverse that goes with this data).
    ``rows``: x viewed as [M, K], the output as [rows, K] with rows >= M,
    rows M.. zero (the FP8 GEMMs' token padding, written in the same pass).
    Returns the FP8 tensor (``out`` if given), shaped like ``x`` (or [rows, K]).
    """
    op = "cast_fp8"
    require_fp8_dlpack(op)
    x = _check_input(op, x)
    fp8_dtype = fp8_dtype_of(fp8_dtype, op)
    if out is not None and out.dtype != fp8_dtype:
        raise TypeError(f"{op}: argument 'out' must have dtype {fp8_dtype}, got {out.dtype}")
    out, _, _ = _row_outputs(op, x, fp8_dtype, rows, out, None, True, False)
    _C.cast_fp8(x, _check_scalar(op, "scale", scale, x.device), amax, out, None, scale_inv,
                stream_for(x))
    return out


def cast_transpose_fp8(x, scale, amax, fp8_dtype, *, out=None, out_t=None, scale_inv=None,
                       rowwise=True, dbias=False, rows=None, dbias_dtype=torch.float32):
    """Scale, cast and transpose in one pass: ``x`` is viewed as [M, K] (K the
    last dimension), and the result is ``(data, data_t)`` with ``data`` the
    FP8 copy shaped like ``x`` and ``data_t`` the [K, M] transposed copy that
    Hopper's FP8 GEMMs take as their K-major operand.  ``rowwise=False`` skips
    ``data`` (returns ``(None, data_t)``).  ``scale``, ``amax`` and
    ``scale_inv`` as in :func:`cast_fp8` (amax accumulates).

    The fast GPU kernel needs K % 8 == 0 and M % 16 == 0 (FP8 GEMMs need 16
    anyway); other shapes run a plain per-element kernel.

    ``rows`` (>= M): both copies carry ``rows`` token rows, data [rows, K]
    and data_t [K, rows], rows M.. zero: an unaligned token count padded to
    what the GEMMs take, in the cast's own pass (the fast kernel then needs
    rows % 16 == 0 instead of M's).

    ``dbias=True`` also sums x's columns in the same pass (the bias gradient
    when x is an output gradient) and returns ``(data, data_t, dbias)``,
    dbias [K] in ``dbias_dtype`` (float32, bfloat16 or float16): the kernel
    writes the float32 sums of each 128-row block in a fixed order (the CPU
    backend repeats it bit for bit) and the same C call adds the blocks as
    :func:`column_sums` does, rounding once.  It takes the fast kernel's shapes and, on CUDA, 16-byte
    aligned x (see :func:`dbias_fusable`).
    """
    op = "cast_transpose_fp8"
    require_fp8_dlpack(op)
    x = _check_input(op, x)
    if x.dim() < 1:
        raise ValueError(f"{op}: argument 'x' must have at least 1 dimension")
    fp8_dtype = fp8_dtype_of(fp8_dtype, op)
    k = x.shape[-1]
    out, out_t, m = _row_outputs(op, x, fp8_dtype, rows, out, out_t, rowwise, True)
    for name, t in (("out", out), ("out_t", out_t)):
        if t is not None and t.dtype != fp8_dtype:
            raise TypeError(f"{op}: argument '{name}' must have dtype {fp8_dtype}, got {t.dtype}")
    scale = _check_scalar(op, "scale", scale, x.device)
    if dbias:
        if dbias_dtype not in SUM_DTYPES:  # (before the cast: it writes the outputs and folds the amax)
            raise TypeError(f"{op}: argument 'dbias_dtype' must be torch.float32, torch.bfloat16 or "
                            f"torch.float16, got {dbias_dtype}")
        sums = torch.empty(*block_sums_shape(m, k), dtype=torch.float32, device=x.device)
        db = torch.empty(k, dtype=dbias_dtype, device=x.device)
        _C.cast_fp8_dbias(x, scale, amax, out if rowwise else None, out_t, scale_inv, sums, stream_for(x), db)
        return (out if rowwise else None), out_t, db
    _C.cast_fp8(x, scale, amax, out if rowwise else None, out_t, scale_inv, stream_for(x))
    return (out if rowwise else None), out_t


def block_sums_shape(rows, k):
    """The shape of the float32 per-128-row-block column sums a dbias pass
    writes for a matrix of ``rows`` rows and ``k`` columns: [ceil(rows / 128), k]."""
    return (rows + 127) // 128, k


#: The dtypes column_sums writes (a bias gradient's).
SUM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def column_sums(col_sums, dtype=torch.float32):
    """The column sums of a matrix from the per-128-row-block sums a cast
    wrote (``col_sums`` float32 [P, N]: :func:`cast_transpose_fp8` with
    dbias, :func:`cast_fp8_into` with col_sums,
    :func:`quantize_block_fp8_rowcol` with col_sums), added in a fixed
    order and rounded once to ``dtype`` (float32, bfloat16 or float16): a
    bias gradient in one launch (seqfuse_quant.h states the order).
    Returns the [N] tensor."""
    if not isinstance(col_sums, torch.Tensor):
        raise TypeError(f"column_sums: argument 'col_sums' must be a torch.Tensor, got {type(col_sums).__name__}")
    if dtype not in SUM_DTYPES:
        raise TypeError(f"column_sums: argument 'dtype' must be torch.float32, torch.bfloat16 or torch.float16, "
                        f"got {dtype}")
    out = torch.empty(col_sums.shape[-1] if col_sums.dim() else 1, dtype=dtype, device=col_sums.device)
    _C.column_sums(col_sums, out, stream_for(col_sums))
    return out


def cast_fp8_into(x, scale, amax, out, out_t, scale_inv, col_sums=None, dbias=None):
    """The cast of :func:`cast_fp8` / :func:`cast_transpose_fp8` into outputs
    the caller made: the quantizers' hot path (seqfuse.quantization), which
    knows its shapes and makes one set of outputs per cast.

    ``x``: a contiguous float tensor without autograd history, viewed as
    [M, K].  ``out`` [rows, K] (or x's shape) and ``out_t`` [K, rows]: FP8
    of one dtype, either None (not both), rows >= M with rows M.. written as
    zeros.  ``scale``, ``amax``, ``scale_inv`` as in :func:`cast_fp8`.
    ``col_sums`` (with ``out_t``): float32 [ceil(rows / 128), K], receives
    x's column sums per 128-row block (the dbias pass); ``dbias`` (with
    ``col_sums``): a [K] tensor of a :data:`SUM_DTYPES` dtype, receives
    their total as :func:`column_sums` makes it, in the same C call.
    Nothing is checked here: the C entry checks every argument and names it
    in its error.  Returns None."""
    if not FP8_DLPACK:  # (a flag test on the quantizers' hot path, not a call)
        require_fp8_dlpack("cast_fp8")
    # (the hot "_into" entries pass None for the stream without calling stream_for where the extension
    # asks torch itself: FAST_EXCHANGE, stream_for's own first test)
    if col_sums is None:
        _C.cast_fp8(x, scale, amax, out, out_t, scale_inv, None if FAST_EXCHANGE else stream_for(x))
    else:
        _C.cast_fp8_dbias(x, scale, amax, out, out_t, scale_inv, col_sums, None if FAST_EXCHANGE else stream_for(x),
                          dbias)


def cast_fp8_current_into(x, amax, scale, scale_inv, out, out_t, margin=0, col_sums=None, dbias=None):
    """:func:`cast_fp8_current` into outputs the caller made (``out`` /
    ``out_t`` as in :func:`cast_fp8_into`; ``amax``, ``scale`` and
    ``scale_inv`` one-element float32 buffers it writes).  ``col_sums`` /
    ``dbias``: the dbias pass's block sums and their total, as
    :func:`cast_fp8_into` takes them (the C call then runs amax, scale,
    cast and sums as separate launches).  The quantizers' hot path: the C
    entry checks every argument.  Returns None."""
    if not FP8_DLPACK:  # (a flag test on the quantizers' hot path, not a call)
        require_fp8_dlpack("cast_fp8_current")
    if col_sums is None:
        _C.cast_fp8_current(x, amax, scale, scale_inv, out, out_t, margin, None if FAST_EXCHANGE else stream_for(x))
    else:
        _C.cast_fp8_current(x, amax, scale, scale_inv, out, out_t, margin, None if FAST_EXCHANGE else stream_for(x),
                            col_sums, dbias)


def _check_rows(op, rows, m):
    """``rows`` as an int >= m (x's rows), or an error naming it."""
    rows = as_int(op, "rows", rows)
    if rows < m:
        raise ValueError(f"{op}: argument 'rows' ({rows}) must be at least x's row count {m} "
                         f"(x viewed as [M, K]; rows M.. are zero padding)")
    return rows


def _row_outputs(op, x, fp8_dtype, rows, out, out_t, want_out, want_t):
    """The FP8 outputs of a cast of x viewed as [M, K] with ``rows`` token
    rows (None: M): ``out`` [rows, K] (x's shape when rows == M) and
    ``out_t`` [K, rows], made where wanted and not given, and checked
    against ``rows`` where given.  Returns (out, out_t, rows)."""
    k = x.shape[-1] if x.dim() else 1
    m = x.numel() // k if k else 0
    mp = m if rows is None else _check_rows(op, rows, m)
    if want_out:
        if out is None:
            out = empty(x.shape if mp == m else (mp, k), fp8_dtype, x.device)
        elif rows is not None and tuple(out.shape) != (mp, k) and not (mp == m and out.numel() == x.numel()):
            raise ValueError(f"{op}: argument 'out' must have shape [{mp}, {k}] for rows={mp}, got "
                             f"{tuple(out.shape)}")
    if want_t:
        if out_t is None:
            out_t = torch.empty(k, mp, dtype=fp8_dtype, device=x.device)
        elif rows is not None and tuple(out_t.shape) != (k, mp):
            raise ValueError(f"{op}: argument 'out_t' must have shape [{k}, {mp}] for rows={mp}, got "
                             f"{tuple(out_t.shape)}")
    return out, out_t, mp


def dbias_fusable(x, rows=None):
    """Whether ``cast_transpose_fp8(x, ..., dbias=True, rows=rows)`` takes x:
    viewed as [M, K], K % 8 == 0 and the outputs' rows (``rows``, else M) a
    multiple of 16, contiguous and, on CUDA, 16-byte aligned (its tiled
    kernel's rules)."""
    k = x.shape[-1] if x.dim() else 1
    m = x.numel() // k if k else 0
    if rows is not None:
        m = rows
    return (x.dim() >= 1 and x.is_contiguous() and k % 8 == 0 and m % 16 == 0
            and (not x.is_cuda or x.data_ptr() % 16 == 0))


def transpose_fp8(data, *, out=None):
    """``data`` (float8_e4m3fn / float8_e5m2, viewed as [M, K] with K its last
    dimension) transposed to a contiguous [K, M] tensor of the same dtype: the
    bytes move unchanged (same scale).  Under delayed scaling the norm and
    activation kernels write their FP8 outputs row-wise only, and the weight
    gradient takes this transpose as its K-major operand.  The fast GPU kernel
    needs K % 16 == 0, M % 16 == 0 and 16-byte aligned tensors; other shapes
    run a per-element kernel."""
    op = "transpose_fp8"
    _check_fp8_data(op, data)
    require_fp8_dlpack(op)
    if data.dim() < 1:  # (C checks contiguity and the shapes; this one is needed for out's shape)
        raise ValueError(f"{op}: argument 'data' must have at least 1 dimension")
    k = data.shape[-1]
    m = data.numel() // k if k else 0
    if out is None:
        out = torch.empty(k, m, dtype=data.dtype, device=data.device)
    _C.transpose_fp8(data, out, stream_for(data))
    return out


def transpose_fp8_into(data, out):
    """:func:`transpose_fp8` into ``out`` [K, M] the caller made: the
    quantizers' hot path (a producer kernel's FP8 output transposed for the
    weight gradient); the C entry checks every argument.  Returns None."""
    if not FP8_DLPACK:  # (a flag test on the quantizers' hot path, not a call)
        require_fp8_dlpack("transpose_fp8")
    _C.transpose_fp8(data, out, None if FAST_EXCHANGE else stream_for(data))


def dequantize_fp8(data, scale_inv, out_dtype=torch.float32, *, out=None):
    """``float(data) * scale_inv[0]`` in ``out_dtype`` (float32, float16 or
    bfloat16), shaped like ``data``."""
    op = "dequantize_fp8"
    _check_fp8_data(op, data)
    if out_dtype not in _FLOAT_INPUTS:
        raise TypeError(f"{op}: argument 'out_dtype' must be float32, float16 or bfloat16, "
                        f"got {out_dtype}")
    require_fp8_dlpack(op)
    data = data.contiguous()
    if out is None:
        out = torch.empty(data.shape, dtype=out_dtype, device=data.device)
        _C.dequantize_fp8(data, scale_inv, out, stream_for(data))
        return out
    y = given_out(op, out)
    _C.dequantize_fp8(data, scale_inv, y, stream_for(data))
    mark_written(y)
    return out


_AMAX_ALGOS = {"max": 0, "most_recent": 1}


def fp8_scale_update(amax_history, scale, scale_inv, fp8_max, algo="max", margin=0):
    """The delayed-scaling update of N tensors in one launch (in place).

    ``amax_history`` float32 [H, N] (row 0: this step's amaxes), ``scale`` /
    ``scale_inv`` / ``fp8_max`` float32 [N].  Per column: a = max over the
    history (``algo="max"``) or row 0 (``"most_recent"``); the scale becomes
    ``fp8_max / a / 2**margin`` where a is finite and positive, else it keeps
    its value; ``scale_inv = 1 / scale``; the history rolls as
    ``torch.roll(h, -1, 0); h[0] = 0``.

    ``fp8_max`` may also be one Python number for every column.  It must be
    positive and finite (as :func:`fp8_compute_scale`'s): a Python number
    and a CPU tensor's values are checked (ValueError).  A CUDA tensor's values
    are not read (this runs every training step and must not synchronize
    with the device): they are the caller's responsibility; the scaling
    states seqfuse keeps fill theirs from the FP8 format's largest value.
    """
    op = "fp8_scale_update"
    algo_id = _AMAX_ALGOS.get(algo)
    if algo_id is None:
        raise ValueError(f"{op}: argument 'algo' must be 'max' or 'most_recent', got {algo!r}")
    if not hasattr(fp8_max, "__dlpack__"):  # (a tensor or numpy array goes to C, which checks it)
        value = as_float(op, "fp8_max", fp8_max)
        if not (value > 0.0 and math.isfinite(value)):
            raise ValueError(f"{op}: argument 'fp8_max' must be a positive finite number, got {value}")
        if isinstance(amax_history, torch.Tensor) and amax_history.dim() == 2:
            fp8_max = torch.full((amax_history.shape[1],), value, dtype=torch.float32, device=amax_history.device)
    _C.fp8_scale_update(amax_history, scale, scale_inv, fp8_max, algo_id,
                        as_int(op, "margin", margin),
                        None if FAST_EXCHANGE else stream_for(amax_history))


def fp8_compute_scale(amax, scale, scale_inv, fp8_max, margin=0):
    """Current scaling: ``scale = fp8_max / amax / 2**margin`` (1 where amax is
    0 or not finite) and ``scale_inv = 1 / scale``, elementwise, in place."""
    op = "fp8_compute_scale"
    _C.fp8_compute_scale(amax, scale, scale_inv, as_float(op, "fp8_max", fp8_max), as_int(op, "margin", margin),
                         stream_for(amax))


def cast_fp8_current(x, fp8_dtype, *, amax, scale, scale_inv, out=None, out_t=None, rowwise=True,
                     transpose=False, margin=0, rows=None):
    """Current scaling of ``x`` in one call: ``amax = max|x|``, ``scale =
    fp8_max / amax / 2**margin`` (1 where amax is 0 or not finite),
    ``scale_inv = 1 / scale``, then the cast (and, with ``transpose``, the
    transposed copy [K, M]; ``rowwise=False`` makes only that one).  One C call on the
    current stream, no host sync: on CUDA one cooperative launch where the
    tiled cast+transpose takes the shapes (transpose wanted, K % 8 == 0,
    padded rows % 16 == 0, aligned), else the amax, scale and cast kernels
    (same results, three launches).  ``amax``, ``scale`` and ``scale_inv`` are
    one-element float32 buffers the caller keeps (a weight re-cast each step
    allocates nothing when ``out`` / ``out_t`` are given too).  ``rows``:
    the outputs' token rows, padded as in :func:`cast_transpose_fp8`.  Returns
    ``(data or None, data_t or None)``.  Arguments are checked by the C
    entries (this is the quantizers' hot path)."""
    op = "cast_fp8_current"
    require_fp8_dlpack(op)
    x = _check_input(op, x)
    fp8_dtype = fp8_dtype_of(fp8_dtype, op)
    transpose = transpose or not rowwise
    out, out_t, _ = _row_outputs(op, x, fp8_dtype, rows, out, out_t, rowwise, transpose)
    _C.cast_fp8_current(x, amax, scale, scale_inv, out if rowwise else None, out_t if transpose else None,
                        as_int(op, "margin", margin), stream_for(x))
    return (out if rowwise else None), out_t


# ---- block-scaled formats ----------------------------------------------------

def _matrix(op, x, multiple, what, name="x"):
    x = _check_input(op, x, name)
    if x.dim() < 1:
        raise ValueError(f"{op}: argument '{name}' must have at least 1 dimension")
    k = x.shape[-1]
    if k % multiple:
        raise ValueError(f"{op}: the last dimension of '{name}' (K = {k}) must be a multiple of "
                         f"{multiple} for {what}")
    return x, (x.numel() // k if k else 0), k


def block_scale_shape(m, k, block_rows):
    """Shape of the fp32 scale tensor of an [m, k] matrix in cuBLASLt's Hopper
    layout: 1x128 blocks -> [k/128, round_up(m, 4)] (m fastest);
    128x128 blocks -> [ceil(m/128), round_up(k/128, 4)]."""
    if block_rows == 1:
        return (k // 128, (m + 3) // 4 * 4)
    return ((m + 127) // 128, (k // 128 + 3) // 4 * 4)


def quantize_block_fp8(x, block_rows=1, fp8_dtype=torch.float8_e4m3fn, rows=None):
    """FP8 with an fp32 scale per 1x128 (``block_rows=1``) or 128x128
    (``block_rows=128``) block, for cuBLASLt's block-scaled FP8 GEMMs on
    Hopper (CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F / BLK128x128_32F).
    ``rows`` (1x128 blocks, >= M): ``data`` is [rows, K] and rows M.. are
    zero rows (data 0, the scale of a zero block, 1) written by the same
    launch: the FP8 GEMMs' token padding without a padded copy of x.

    Returns ``(data, scale_inv)``: ``data`` FP8 shaped like x (viewed as
    [M, K], K % 128 == 0 required), ``scale_inv`` float32 of
    :func:`block_scale_shape` -- 1x128: [K/128, round_up(M, 4)] with M
    fastest (element [kb, m] belongs to x[m, 128kb:128kb+128]); 128x128:
    [ceil(M/128), round_up(K/128, 4)].  Padding entries are 0.  A block's
    values are ``saturate(x * s)`` with s = fp8_max / block_amax (1 for an
    all-zero block) and scale_inv = 1 / s.
    """
    op = "quantize_block_fp8"
    if block_rows not in (1, 128):
        raise ValueError(f"{op}: argument 'block_rows' must be 1 (1x128 blocks) or 128 "
                         f"(128x128 blocks), got {block_rows!r}")
    require_fp8_dlpack(op)
    x, m, k = _matrix(op, x, 128, "1x128 blocks" if block_rows == 1 else "128x128 blocks")
    fp8_dtype = fp8_dtype_of(fp8_dtype, op)
    out, _, mp = _row_outputs(op, x, fp8_dtype, rows, None, None, True, False)
    if mp != m and block_rows != 1:
        raise ValueError(f"{op}: argument 'rows' (token padding) is for 1x128 blocks, got block_rows=128")
    scale_inv = torch.empty(*block_scale_shape(mp, k, block_rows), dtype=torch.float32, device=x.device)
    _C.quantize_block_fp8(x, out, scale_inv, block_rows, stream_for(x))
    return out, scale_inv


def quantize_block_fp8_weight(w, fp8_dtype=torch.float8_e4m3fn):
    """A weight's two 128x128-block FP8 operands in one call: ``w`` [M, K]
    (M and K multiples of 128) -> ``(data, scale_inv, data_t, scale_inv_t)``:
    ``data`` / ``scale_inv`` as :func:`quantize_block_fp8` with
    block_rows=128, ``data_t`` [K, M] the same bytes transposed and
    ``scale_inv_t`` [K/128, round_up(M/128, 4)] the real scales transposed
    (padding 0): bit for bit the 128x128 quantization of ``w.t()`` (a block
    of w^T is a block of w), for a byte transpose instead of a second
    quantization.  The forward and input-gradient operands of a
    block-scaled FP8 weight."""
    op = "quantize_block_fp8_weight"
    require_fp8_dlpack(op)
    w, m, k = _matrix(op, w, 128, "128x128 blocks", "w")
    if w.dim() != 2:
        raise ValueError(f"{op}: argument 'w' must be 2-D (a weight [M, K]), got shape {tuple(w.shape)}")
    if m % 128:
        raise ValueError(f"{op}: the rows of 'w' (M = {m}) must be a multiple of 128 (whole 128x128 blocks of "
                         f"its transpose)")
    fp8_dtype = fp8_dtype_of(fp8_dtype, op)
    outs = block_weight_outputs(m, k, fp8_dtype, w.device)
    _C.quantize_block_fp8_weight(w, *outs, stream_for(w))
    return outs


def block_transpose_fp8(data, scale_inv):
    """W^T's 128x128-block operand from W's: ``data`` FP8 [M, K] (M, K
    multiples of 128) and its ``scale_inv`` (:func:`block_scale_shape` with
    block_rows=128) -> ``(data_t, scale_inv_t)``, data's bytes transposed
    [K, M] and the real scales transposed [K/128, round_up(M/128, 4)]
    (padding 0): what :func:`quantize_block_fp8_weight` writes beside W, for
    a weight whose transposed copy was not kept.  One call (a byte transpose
    and a scale transpose)."""
    op = "block_transpose_fp8"
    require_fp8_dlpack(op)
    _check_fp8_data(op, data)
    if data.dim() != 2:
        raise ValueError(f"{op}: argument 'data' must be 2-D (a weight's FP8 bytes [M, K]), got shape "
                         f"{tuple(data.shape)}")
    data_t, scale_inv_t = _transposed_block_outputs(*data.shape, data.dtype, data.device)
    _C.block_transpose_fp8(data, scale_inv, data_t, scale_inv_t, stream_for(data))
    return data_t, scale_inv_t


def _transposed_block_outputs(m, k, fp8_dtype, device):
    """New (data_t [k, m], scale_inv_t) for W^T's 128x128-block operand of an [m, k] weight."""
    return (torch.empty(k, m, dtype=fp8_dtype, device=device),
            torch.empty(*block_scale_shape(k, m, 128), dtype=torch.float32, device=device))


def block_weight_outputs(m, k, fp8_dtype, device):
    """New (data, scale_inv, data_t, scale_inv_t) for :func:`quantize_block_fp8_weight` of an [m, k] weight."""
    return (torch.empty(m, k, dtype=fp8_dtype, device=device),
            torch.empty(*block_scale_shape(m, k, 128), dtype=torch.float32, device=device),
            *_transposed_block_outputs(m, k, fp8_dtype, device))


def quantize_block_fp8_weight_into(w, data, scale_inv, data_t, scale_inv_t):
    """:func:`quantize_block_fp8_weight` into outputs the caller made
    (:func:`block_weight_outputs`): the weight quantizers' hot path, whose
    shapes are known; the C entry checks every argument.  Returns None."""
    if not FP8_DLPACK:  # (a flag test on the quantizers' hot path, not a call)
        require_fp8_dlpack("quantize_block_fp8_weight")
    _C.quantize_block_fp8_weight(w, data, scale_inv, data_t, scale_inv_t, None if FAST_EXCHANGE else stream_for(w))


def quantize_rowwise_fp8(x, fp8_dtype=torch.float8_e4m3fn):
    """FP8 with one float32 scale per row: x viewed as [M, K] (K % 16 == 0)
    -> ``(data, scale_inv)``, ``data`` FP8 shaped like x, ``scale_inv``
    float32 [M].  Row r is scaled by s = fp8_max / max|x[r]| (1 for an
    all-zero row), ``data[r] = saturate(x[r] * s)``, ``scale_inv[r] = 1 / s``:
    the row-wise operands of torch._scaled_grouped_mm (each row scaled along
    the contraction dimension from its own amax, no host involvement; one
    read of x on CUDA for rows of up to 8,192 values).  A row whose amax is
    NaN or infinite takes scale 1 (its NaN stays NaN, infinities saturate).
    x must start 16-byte aligned (the kernel reads 16-byte vectors): a view
    starting mid-row of another tensor is a ValueError."""
    op = "quantize_rowwise_fp8"
    require_fp8_dlpack(op)
    x, m, k = _matrix(op, x, 16, "row-wise FP8 (the scaled GEMMs' 16-byte FP8 rows)")
    fp8_dtype = fp8_dtype_of(fp8_dtype, op)
    out = torch.empty(*x.shape, dtype=fp8_dtype, device=x.device)
    scale_inv = torch.empty(m, dtype=torch.float32, device=x.device)
    _C.quantize_rowwise_fp8(x, out, scale_inv, stream_for(x))
    return out, scale_inv


def quantize_block_fp8_rowcol(x, fp8_dtype=torch.float8_e4m3fn, *, rowwise=True, columnwise=True,
                              col_sums=False, rows=None):
    """1x128 block quantization along both dimensions from one read of x
    [M, K] (K a multiple of 128, M any): returns ``(data, scale_inv, data_t,
    scale_inv_t)`` -- the row-wise copy as :func:`quantize_block_fp8` with
    block_rows=1, and the column-wise copy ``data_t`` [K, Mt] (x transposed,
    1x128 blocks along M; Mt = M rounded up to a multiple of 128, the
    columns past M zero) with ``scale_inv_t`` [Mt/128, round_up(K, 4)] in the
    same cuBLASLt layout.  Either copy can be skipped (returned as None).
    ``col_sums=True`` (with the column-wise copy) also returns, fifth, the
    float32 [Mt/128, K] sums of each column over each 128-row block, from the
    same pass: ``column_sums(col_sums)`` is x's column sum (a bias
    gradient) without another read of x (float32 adds in the fixed order of
    seqfuse_quant.h).  ``rows`` (M <= rows <= Mt): the row-wise copy has
    that many rows, as :func:`quantize_block_fp8`'s (token padding); the
    column-wise copy is the same either way."""
    op = "quantize_block_fp8_rowcol"
    require_fp8_dlpack(op)
    x, m, k = _matrix(op, x, 128, "1x128 blocks")
    mt = (m + 127) // 128 * 128
    fp8_dtype = fp8_dtype_of(fp8_dtype, op)
    mp = m if rows is None else _check_rows(op, rows, m)
    if mp > mt:
        raise ValueError(f"{op}: argument 'rows' must be at most round_up(M, 128) = {mt}, got {mp}")
    if col_sums and not columnwise:
        raise ValueError(f"{op}: col_sums=True needs columnwise=True (that pass computes them)")
    outs = rowcol_outputs(x, m, k, fp8_dtype, mp, rowwise, columnwise)
    sums = torch.empty(*block_sums_shape(m, k), dtype=torch.float32, device=x.device) if col_sums else None
    quantize_block_fp8_rowcol_into(x, *outs, sums)
    return (*outs, sums) if col_sums else outs


def rowcol_outputs(x, m, k, fp8_dtype, rows=None, rowwise=True, columnwise=True, row_place=None, col_place=None):
    """New (data, scale_inv, data_t, scale_inv_t) for :func:`quantize_block_fp8_rowcol`
    of ``x`` viewed as [m, k], the row-wise copy [rows, k] (``rows`` None:
    m); the copies not wanted are None.  ``row_place`` / ``col_place``: a
    copy's bytes and scales are the transient buffers there instead of new ones
    (seqfuse.ops.buffers.new_or_transient; the scales' purpose is
    (purpose, "scale_inv"))."""
    mp = m if rows is None else rows
    mt = (m + 127) // 128 * 128
    dev = x.device
    data = scale_inv = data_t = scale_inv_t = None
    if rowwise:
        data = new_or_transient(row_place, dev, fp8_dtype, *(x.shape if mp == m else (mp, k)))
        scale_inv = new_or_transient(_scales_place(row_place), dev, torch.float32, *block_scale_shape(mp, k, 1))
    if columnwise:
        data_t = new_or_transient(col_place, dev, fp8_dtype, k, mt)
        scale_inv_t = new_or_transient(_scales_place(col_place), dev, torch.float32, *block_scale_shape(k, mt, 1))
    return data, scale_inv, data_t, scale_inv_t


def _scales_place(place):
    return None if place is None else (place[0], (place[1], "scale_inv"))


def quantize_block_fp8_rowcol_into(x, data, scale_inv, data_t, scale_inv_t, col_sums=None, dbias=None):
    """:func:`quantize_block_fp8_rowcol` into outputs the caller made
    (:func:`rowcol_outputs`; ``col_sums`` float32 [round_up(M, 128)/128, K] or
    None; ``dbias`` (with ``col_sums``) a [K] tensor that receives their
    total as :func:`column_sums` makes it, in the same C call): the
    quantizers' hot path, which knows its shapes; the C entry checks every
    argument.  ``x``: contiguous, without autograd history.  Returns None."""
    if not FP8_DLPACK:  # (a flag test on the quantizers' hot path, not a call)
        require_fp8_dlpack("quantize_block_fp8_rowcol")
    if col_sums is None:
        _C.quantize_block_fp8_rowcol(x, data, scale_inv, data_t, scale_inv_t, None if FAST_EXCHANGE else stream_for(x))
    else:
        _C.quantize_block_fp8_rowcol(x, data, scale_inv, data_t, scale_inv_t, None if FAST_EXCHANGE else stream_for(x),
                                     col_sums, dbias)


def dequantize_block_fp8(data, scale_inv, block_rows=1, out_dtype=torch.float32):
    """``data * scale_inv`` of the matching block (layout of quantize_block_fp8)."""
    require_fp8_dlpack("dequantize_block_fp8")
    out = torch.empty(data.shape, dtype=out_dtype, device=data.device)
    _C.dequantize_block_fp8(data.contiguous(), scale_inv, block_rows, out, stream_for(data))
    return out


def _scales_arg(t, dtype, op="dequantize_mxfp8", name="scales"):
    """Scales travel as their float8 dtype where torch has it, else uint8."""
    _check_view_source(op, name, t)
    return t.view(torch.uint8) if dtype is not None and t.dtype == dtype else t


def _check_view_source(op, name, t):
    """What torch's .view(dtype) would refuse with a message naming nothing."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: argument '{name}' must be a torch.Tensor, got {type(t).__name__}")
    if t.is_neg():
        raise ValueError(f"{op}: argument '{name}' has torch's negative bit set; call .resolve_neg() first")


_E8M0 = getattr(torch, "float8_e8m0fnu", None)


def quantize_mxfp8(x, fp8_dtype=torch.float8_e4m3fn):
    """MXFP8: FP8 values with an E8M0 scale (a power of two) per 32
    consecutive elements along the last dimension (K % 32 == 0).  Returns
    ``(data, scales)``; scales [..., K/32] as torch.float8_e8m0fnu (uint8 on
    torch without it), row-major -- Blackwell GEMMs want them swizzled.
    The scale is 2^ceil(log2(block_amax / fp8_max)), so nothing saturates.
    """
    op = "quantize_mxfp8"
    require_fp8_dlpack(op)
    x, m, k = _matrix(op, x, 32, "MXFP8 (1x32 blocks)")
    fp8_dtype = fp8_dtype_of(fp8_dtype, op)
    out = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    scales = torch.empty((*x.shape[:-1], k // 32), dtype=torch.uint8, device=x.device)
    _C.quantize_mxfp8(x, out, scales, stream_for(x))
    return out, (scales.view(_E8M0) if _E8M0 is not None else scales)


def dequantize_mxfp8(data, scales, out_dtype=torch.float32):
    """``data * 2^(scale - 127)`` of the matching 32-element block."""
    require_fp8_dlpack("dequantize_mxfp8")
    out = torch.empty(data.shape, dtype=out_dtype, device=data.device)
    _C.dequantize_mxfp8(data.contiguous(), _scales_arg(scales, _E8M0).contiguous(), out,
                        stream_for(data))
    return out


def quantize_nvfp4(x, amax=None):
    """NVFP4: E2M1 values packed two per byte (element 2j in the low nibble
    of byte j), an E4M3 scale per 16 consecutive elements (K % 16 == 0) and
    one fp32 scale per tensor.  ``amax``: max|x| if already known (one-element
    float32), else computed here.  Returns ``(data uint8 [..., K/2],
    block_scales float8_e4m3fn [..., K/16], global_scale_inv float32 [1])``;
    x ~= e2m1 * block_scale * global_scale_inv.
    """
    op = "quantize_nvfp4"
    x, m, k = _matrix(op, x, 16, "NVFP4 (16-element blocks)")
    if amax is None:
        amax = torch.empty(1, dtype=torch.float32, device=x.device)
        _C.amax(x, amax, stream_for(x))
    out = torch.empty((*x.shape[:-1], k // 2), dtype=torch.uint8, device=x.device)
    block_scales = torch.empty((*x.shape[:-1], k // 16), dtype=torch.uint8, device=x.device)
    gsi = torch.empty(1, dtype=torch.float32, device=x.device)
    _C.quantize_nvfp4(x, amax, out, block_scales, gsi, stream_for(x))
    return out, block_scales.view(torch.float8_e4m3fn), gsi


def dequantize_nvfp4(data, block_scales, global_scale_inv, out_dtype=torch.float32):
    """``e2m1 * block_scale * global_scale_inv`` (layout of quantize_nvfp4)."""
    _check_view_source("dequantize_nvfp4", "block_scales", block_scales)
    if block_scales.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise TypeError("dequantize_nvfp4: argument 'block_scales' must have dtype float8_e4m3fn (or its "
                        f"uint8 bytes), got {block_scales.dtype}")
    shape = (*data.shape[:-1], data.shape[-1] * 2)
    out = torch.empty(shape, dtype=out_dtype, device=data.device)
    _C.dequantize_nvfp4(data.contiguous(), block_scales.view(torch.uint8).contiguous(),
                        global_scale_inv, out, stream_for(data))
    return out
