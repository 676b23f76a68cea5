"""The FP8 GEMM steps shared by Linear, LayerNormLinear and LayerNormMLP.

A module's FP8 forward and backward are, per GEMM, the same three products
over operands made by its GemmQuantizers (seqfuse.quantization):

    forward  y  = x  W^T    x row-wise,  W row-wise          (fast accumulation)
    dgrad    dx = dy W      dy row-wise, W^T (the weight's bytes transposed)
    wgrad    dW = dy^T x    dy's and x's transposed (column-wise) copies

Each operand is a triple (data, scale_inv, scaling) where scaling names
cuBLASLt's block layout ("block_1x128", "block_128x128") or is None for one
scale per tensor.  The quantizers pad the token rows of x and dy to a
multiple of 16 (zeros), so y and dx come back with padded rows and are cut
to the real ones with ``row_prefix``.
"""
import logging

import torch

from ..ops.gemm import fp8_gemm_nt
from ..quantization import gemm_quantizers as gq

row_prefix = gq.row_prefix
_log = logging.getLogger("seqfuse")


def _bias(bias, out_dtype):
    """cuBLASLt's FP8 kernels take the bias in bfloat16 (float16 for a float16 output); ``bias`` is a tensor
    (gemm converts only where there is one)."""
    want = torch.float16 if out_dtype == torch.float16 else torch.bfloat16
    return bias if bias.dtype == want else bias.to(want)


def rowwise(q, kind):
    """The forward / dgrad operand of an activation or gradient cast."""
    return q.data, q.scale_inv, ("block_1x128" if kind == "block" else None)


def columnwise(q, kind):
    """The wgrad operand: the transposed copy (made now for a producer's row-wise FP8 output)."""
    if kind == "block":
        return q.data_t, q.scale_inv_t, "block_1x128"
    return gq.transposed(q), q.scale_inv, None


def weight_forward(pair, kind):
    w = pair[0]
    return w.data, w.scale_inv, ("block_128x128" if kind == "block" else None)


def weight_dgrad(pair, kind):
    """The input-gradient operand (W^T) of a pair cast with it."""
    w = pair[1]
    if kind == "block":
        return w.data, w.scale_inv, "block_128x128"
    return w.data_t, w.scale_inv, None


def weight_kept(pair, kind, transposed):
    """(data, scale_inv): what a backward keeps of the weight for its input
    gradient, given ``transposed``, the module's request to
    WeightQuantizer.get (gemm_quantizers.wants_weight_transpose), as
    weight_saved gives them (the scale inverse as an alias).  True:
    the input-gradient operand get() made.  False: the forward operand's
    bytes, which the weight's cache holds anyway; the backward makes W^T
    from them for its input-gradient GEMM alone (weight_dgrad_kept).  A
    function of the request, not of what the pair holds, so a checkpoint's
    recompute (which repeats the request) saves what the forward's
    bookkeeping expects."""
    if transposed:
        return weight_saved(weight_dgrad(pair, kind))
    return weight_saved((pair[0].data, pair[0].scale_inv))


def weight_saved(operand):
    """The (data, scale_inv) of a weight operand for ctx.save_for_backward,
    the scale inverse as an alias (a detached tensor of its own over the same
    storage): while autograd keeps it, the weight's cache sees that storage
    shared and casts the next weight update into new buffers
    (WeightQuantizer._spare reads the scale inverses' storage alone, so a
    backward never keeps a weight's bytes without their scale inverse)."""
    return operand[0], operand[1].detach()


def weight_dgrad_kept(data, scale_inv, kind, transposed):
    """The input-gradient operand from weight_kept's tensors (``transposed``:
    the same request)."""
    if not transposed:
        data, scale_inv = gq.transposed_weight_parts(data, scale_inv, kind)
    return restore(data, scale_inv, kind, weight=True)


def saved(operand):
    """The tensors of an operand, for ctx.save_for_backward."""
    return operand[0], operand[1]


def restore(data, scale_inv, kind, weight=False):
    """An operand back from saved tensors (a weight's dgrad operand, or a wgrad operand)."""
    if kind != "block":
        return data, scale_inv, None
    return data, scale_inv, "block_128x128" if weight else "block_1x128"


def gemm(a, b, out_dtype, *, bias=None, fast_accum=False, out=None, accumulate=False, addend=None):
    """a [m, k] @ b [n, k]^T over FP8 operand triples, into ``out`` (with
    ``accumulate``: added to it) or a new [m, n] tensor of ``out_dtype``
    (``addend``: plus that [m, n] tensor, in the epilogue)."""
    if out is None:
        out = torch.empty(a[0].shape[0], b[0].shape[0], dtype=out_dtype, device=a[0].device)
    if bias is not None:
        bias = _bias(bias, out.dtype)
    return fp8_gemm_nt(a[0], a[1], a[2], b[0], b[1], b[2], out, bias=bias,
                       accumulate=accumulate, fast_accum=fast_accum, addend=addend)


def forward(xq, pair, kind, out_dtype, bias, rows, residual=None):
    """y [rows, N] = x W^T (+ bias) (+ residual [rows, N], out_dtype) from the
    quantized input and weight.  The residual is added in the GEMM's
    epilogue (C, cuBLASLt's FP8 rule: 16-byte aligned, the output's rows).
    Where the input's token rows were padded to a multiple of 16, or the
    residual is not aligned, it is first copied into an aligned buffer of
    the padded rows (one copy pass, logged once): the same epilogue, so the
    same bits as at an aligned row count."""
    a, w = rowwise(xq, kind), weight_forward(pair, kind)
    mp = a[0].shape[0]
    if residual is not None and (mp != rows or residual.data_ptr() % 16):
        if not _logged_copied_residual:
            _logged_copied_residual.append(True)
            _log.info("seqfuse FP8: a residual is copied into an aligned buffer of %d rows for its GEMM's "
                      "epilogue (%d token rows, padded to a multiple of 16 for the FP8 GEMMs; residual at %s"
                      "16-byte alignment)", mp, rows, "" if residual.data_ptr() % 16 == 0 else "no ")
        padded = torch.empty(mp, residual.shape[1], dtype=residual.dtype, device=residual.device)
        padded[:rows].copy_(residual)  # (the padding rows' outputs are cut off: left as they are)
        residual = padded
    y = gemm(a, w, out_dtype, bias=bias, fast_accum=kind != "block", addend=residual)
    return y if mp == rows else row_prefix(y, rows)  # (row_prefix's own test, inline: no call when aligned)


_logged_copied_residual = []


def wgrad_dtype(w_dtype):
    """The FP8 weight-gradient GEMM's output dtype: the weight's where
    cuBLASLt writes it, else float32 (then cast)."""
    return w_dtype if w_dtype in (torch.float32, torch.bfloat16) else torch.float32


def backward(g, x_col, w_dgrad, kind, out_dtype, rows, need_dx, need_dw, w_dtype, main_grad=None):
    """(dx [rows, K] or None, dW or None) from the quantized output gradient
    ``g``, the input's wgrad operand ``x_col`` and the weight's dgrad
    operand.  With ``main_grad`` (a modules._base.MainGrad) dW goes there
    (returned None)."""
    dx = dw = None
    if need_dx:
        a = rowwise(g, kind)
        dx = gemm(a, w_dgrad, out_dtype)
        if a[0].shape[0] != rows:  # (padded token rows: cut off)
            dx = row_prefix(dx, rows)
    if need_dw:
        g_col = columnwise(g, kind)
        if main_grad is not None:
            gemm(g_col, x_col, None, out=main_grad.tensor, accumulate=main_grad.accumulate)
        else:
            dw = gemm(g_col, x_col, wgrad_dtype(w_dtype))
            if dw.dtype != w_dtype:
                dw = dw.to(w_dtype)
    return dx, dw
